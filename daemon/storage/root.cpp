// SPDX-License-Identifier: Apache-2.0
// Storage roots: opening and checking them (tmpfs, symlinks, duplicates), placing a client's
// TMS_DISK_BACKUP_DIR under one, free space (storage.h).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>

#include "root_probe.h"
#include "storage.h"
#include "storage_fs.h"
#include "tmsdisk/common/memory_filesystem.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

Result<Root> open_root(const std::string& configured, bool allow_tmpfs) {
  std::string abs = configured;
  if (abs.empty()) return make_error(EINVAL, "empty storage root path: pass --root DIR (a directory on local NVMe)");
  if (abs.front() != '/') {
    char cwd[4096];
    if (!::getcwd(cwd, sizeof(cwd))) return errno_error("cannot resolve relative storage root " + configured);
    abs = join_path(cwd, abs);
  }
  std::vector<std::string_view> parts;
  if (!split_absolute(abs, parts)) {
    return make_error(EINVAL, "storage root " + configured + " contains \"..\": give the directory's plain path");
  }
  Root root;
  root.path = join_parts(parts);
  int fd = ::open(root.path.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    struct stat lst {};
    if (err == ENOENT) {
      return make_error(err, "storage root " + root.path +
                                 " does not exist: create it (a directory on local NVMe) or "
                                 "fix --root");
    }
    if (::lstat(root.path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
      return make_error(ELOOP, "storage root " + root.path +
                                   " is a symbolic link: configure the directory it points to, so the root cannot be "
                                   "swapped under the daemon");
    }
    if (err == ENOTDIR) return make_error(err, "storage root " + root.path + " is not a directory");
    return make_error(err, "cannot open storage root " + root.path);
  }
  root.dir.reset(fd);

  auto type = filesystem_type(fd, root.path);
  if (!type) return std::move(type).error();
  const unsigned long magic = *type;
  root.in_memory = in_memory_filesystem(magic);
  if (root.in_memory && !allow_tmpfs) {
    return make_error(EINVAL, "storage root " + root.path + " is on " + (magic == TMPFS_MAGIC ? "tmpfs" : "ramfs") +
                                  ": paused GPU memory would sit in RAM, which defeats moving it to disk. Use a "
                                  "directory on local NVMe, or pass --allow-tmpfs (allow-tmpfs = true in the config "
                                  "file) to accept this anyway");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat storage root " + root.path);
  root.dev = st.st_dev;

  // If O_TMPFILE itself is unsupported the probe cannot tell: the first data file decides.
  const DirectIoProbe probe = probe_direct_io(fd);
  if (probe.outcome == DirectIoProbe::Outcome::Buffered) root.direct_io = false;
  if (probe.error == EROFS || probe.error == EACCES)
    return make_error(probe.error, "storage root " + root.path + " is not writable by tmsdiskd");
  return root;
}

}  // namespace

Result<Roots> Roots::open(const std::vector<std::string>& paths, bool allow_tmpfs) {
  try {
    if (paths.empty()) {
      return make_error(EINVAL, "no storage root configured: pass --root DIR (a directory on local NVMe)");
    }
    Roots roots;
    std::vector<ino_t> inodes;
    for (const auto& p : paths) {
      auto root = open_root(p, allow_tmpfs);
      if (!root) return std::move(root).error();
      struct stat st {};
      if (::fstat(root->dir.get(), &st) != 0) return errno_error("cannot stat storage root " + root->path);
      for (std::size_t i = 0; i < roots.roots_.size(); ++i) {
        if (roots.roots_[i].dev == st.st_dev && inodes[i] == st.st_ino) {
          return make_error(EINVAL, "storage roots " + roots.roots_[i].path + " and " + root->path +
                                        " are the same directory: list each root once");
        }
      }
      inodes.push_back(st.st_ino);
      roots.roots_.push_back(std::move(root).value());
    }
    return roots;
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening storage roots");
  }
}

Result<std::size_t> Roots::root_for(std::string_view client_path) const {
  try {
    std::string allowed;
    for (const auto& r : roots_) allowed += (allowed.empty() ? "" : ", ") + r.path;
    std::vector<std::string_view> parts;
    if (!split_absolute(client_path, parts)) {
      return make_error(EINVAL, "TMS_DISK_BACKUP_DIR=" + std::string(client_path) +
                                    " must be an absolute path without \"..\" under a storage root (" + allowed + ")");
    }
    std::size_t best = roots_.size();
    std::size_t best_len = 0;
    std::vector<std::string_view> rparts;
    for (std::size_t i = 0; i < roots_.size(); ++i) {
      if (!split_absolute(roots_[i].path, rparts)) continue;
      if (rparts.size() > parts.size() || !std::equal(rparts.begin(), rparts.end(), parts.begin())) continue;
      if (best == roots_.size() || rparts.size() > best_len) {
        best = i;
        best_len = rparts.size();
      }
    }
    if (best == roots_.size()) {
      return make_error(EACCES, "TMS_DISK_BACKUP_DIR=" + std::string(client_path) +
                                    " is not under a storage root of this daemon (allowed: " + allowed +
                                    "); unset it or point it under one of them");
    }
    return best;
  } catch (const std::bad_alloc&) {
    return out_of_memory("checking TMS_DISK_BACKUP_DIR");
  }
}

Result<uint64_t> Roots::free_bytes(std::size_t i) const {
  if (i >= roots_.size()) return make_error(EINVAL, fmt::format("no storage root #{}", i));
  struct statvfs vfs {};
  if (::fstatvfs(roots_[i].dir.get(), &vfs) != 0) return errno_error("cannot stat storage root " + roots_[i].path);
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

}  // namespace tmsdisk::storage
