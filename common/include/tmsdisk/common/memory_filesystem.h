// SPDX-License-Identifier: Apache-2.0
// Filesystems whose files live in RAM: one rule for tmsdiskd (refuses them as roots unless
// --allow-tmpfs; sends their I/O to io_uring's workers where allowed), tmsdisk-rawdisk (measures them
// the way the daemon uses them) and tmsctl doctor (fails them). And filesystems whose operations can
// wait on a user or a network, which tmsdiskd refuses for a directory a rank chose.
#pragma once

#include <linux/magic.h>

namespace tmsdisk {

// `f_type`: statfs(2)'s.
inline bool in_memory_filesystem(unsigned long f_type) noexcept {
  return f_type == TMPFS_MAGIC || f_type == RAMFS_MAGIC;
}

// The name of a filesystem whose operations a user can make wait (FUSE) or that waits on a network, or
// null for any other (`f_type`: statfs(2)'s).
inline const char* blocking_filesystem(unsigned long f_type) noexcept {
  constexpr unsigned long kSmb2Magic = 0xFE534D42;  // not in every linux/magic.h
  switch (f_type) {
    case FUSE_SUPER_MAGIC: return "FUSE";
    case NFS_SUPER_MAGIC: return "NFS";
    case SMB_SUPER_MAGIC:
    case CIFS_SUPER_MAGIC: return "SMB/CIFS";
    case kSmb2Magic: return "SMB2";
    case CEPH_SUPER_MAGIC: return "CephFS";
    case AFS_SUPER_MAGIC: return "AFS";
    case V9FS_MAGIC: return "9p";
    default: return nullptr;
  }
}

}  // namespace tmsdisk
