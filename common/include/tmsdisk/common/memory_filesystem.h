// SPDX-License-Identifier: Apache-2.0
// Filesystems whose files live in RAM: one rule for tmsdiskd (refuses them as roots unless
// --allow-tmpfs; sends their I/O to io_uring's workers where allowed), tmsdisk-rawdisk (measures them
// the way the daemon uses them) and tmsctl doctor (fails them).
#pragma once

#include <linux/magic.h>

namespace tmsdisk {

// `f_type`: statfs(2)'s.
inline bool in_memory_filesystem(unsigned long f_type) noexcept {
  return f_type == TMPFS_MAGIC || f_type == RAMFS_MAGIC;
}

}  // namespace tmsdisk
