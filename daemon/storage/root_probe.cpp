// SPDX-License-Identifier: Apache-2.0
// The probes of a storage root (root_probe.h).
#include "root_probe.h"

#include <fcntl.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>

#include "storage_fs.h"

namespace tmsdisk::storage {

namespace {

// Opens `name` in `dir` with `flags` and O_DIRECT; where O_DIRECT alone is refused, finds whether the
// open works without it (closing that file again). The kernel checks O_DIRECT only once it has made
// the file, so the second open must not insist on making it (O_EXCL).
DirectIoProbe open_direct(int dir, const char* name, int flags) {
  DirectIoProbe probe;
  probe.file.reset(::openat(dir, name, flags | O_DIRECT, detail::kFileMode));
  if (probe.file) {
    probe.outcome = DirectIoProbe::Outcome::Direct;
    return probe;
  }
  probe.error = errno;
  if (probe.error == EINVAL) {
    const UniqueFd plain(::openat(dir, name, flags & ~O_EXCL, detail::kFileMode));
    if (plain) probe.outcome = DirectIoProbe::Outcome::Buffered;
  }
  return probe;
}

}  // namespace

Result<unsigned long> filesystem_type(int dir, const std::string& path) {
  struct statfs sfs {};
  if (::fstatfs(dir, &sfs) != 0) return errno_error("cannot stat the filesystem of storage root " + path);
  return static_cast<unsigned long>(sfs.f_type);
}

DirectIoProbe probe_direct_io(int dir, const char* fallback_name) {
  DirectIoProbe probe = open_direct(dir, ".", O_TMPFILE | O_RDWR | O_CLOEXEC);
  if (probe.outcome != DirectIoProbe::Outcome::Unknown || !fallback_name) return probe;
  // A new file, removed as soon as it is made (a probe killed in between leaves one empty file). Only
  // EEXIST says that a file of that name is not this probe's: O_EXCL made any other.
  probe = open_direct(dir, fallback_name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC);
  if (probe.error != EEXIST) ::unlinkat(dir, fallback_name, 0);
  return probe;
}

}  // namespace tmsdisk::storage
