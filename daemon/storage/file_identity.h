// SPDX-License-Identifier: Apache-2.0
// Storage internals: what a data file looked like when tmsdiskd last knew every byte of it, so that a
// file changed outside tmsdiskd is never taken to hold what the store wrote there.
//
// An unchanged chunk (storage.h) is skipped on the store's word that the data file still holds its
// bytes. That word is only as good as the file: root may flip a byte, truncate the file or put
// another in its place while the memory is resident again, and a chunk skipped over such damage is
// lost at the next resume when a rewrite would have repaired it. Reading every chunk back would cost
// what skipping saves; the file's identity and metadata cost one fstat(2). Any write, truncation,
// fallocate or link change moves ctime (and most move mtime or the size), a replacement changes the
// inode, so a file whose identity still matches was not changed through the filesystem since. Not
// caught: root writing the block device underneath or setting the clock back, and a change within
// the same timestamp granule on a filesystem that stamps coarsely (whole seconds: ext4 with 128-byte
// inodes, some network filesystems). Resume still verifies every chunk, so such damage is refused,
// never returned.
#pragma once

#include <cstdint>
#include <optional>

namespace tmsdisk::storage::detail {

struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_sec = 0;
  int64_t mtime_nsec = 0;
  int64_t ctime_sec = 0;
  int64_t ctime_nsec = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

// The identity of open file `fd` now; nullopt if it cannot be taken.
std::optional<FileIdentity> file_identity(int fd) noexcept;

// The identity of `fd` right after the store's last change to it (the fdatasync of a commit), taken so
// that it proves something: returns only once the coarse clock the kernel stamps files with has moved
// past the file's timestamps, so that a change made after this returns cannot carry the timestamps
// recorded (kernels without multigrain timestamps stamp every change within one tick alike). Waits at
// most a few ticks; nullopt when the clock did not move on by then or fstat failed: nothing is
// recorded, and the next pause rewrites the file's chunks rather than trust it.
std::optional<FileIdentity> settled_file_identity(int fd) noexcept;

}  // namespace tmsdisk::storage::detail
