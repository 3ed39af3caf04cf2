// SPDX-License-Identifier: Apache-2.0
// Storage roots: opening and checking them (tmpfs, symlinks, duplicates), placing a client's
// TMS_DISK_BACKUP_DIR under one or taking the directory a rank handed over, free space (storage.h).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <new>

#include "root_probe.h"
#include "storage.h"
#include "storage_fs.h"
#include "tmsdisk/common/memory_filesystem.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

Status check_root(Root& root, const std::string& what, bool allow_tmpfs);

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
  if (auto st = check_root(root, "storage root " + root.path, allow_tmpfs); !st) return std::move(st).error();
  return root;
}

// What every directory files go in must be: not in memory (unless allowed), writable by tmsdiskd;
// and whether O_DIRECT works there. `what` names it in messages ("storage root /nvme/x").
Status check_root(Root& root, const std::string& what, bool allow_tmpfs) {
  const int fd = root.dir.get();
  auto type = filesystem_type(fd, root.path);
  if (!type) return std::move(type).error();
  const unsigned long magic = *type;
  root.in_memory = in_memory_filesystem(magic);
  if (root.in_memory && !allow_tmpfs) {
    return make_error(EINVAL, what + " is on " + (magic == TMPFS_MAGIC ? "tmpfs" : "ramfs") +
                                  ": paused GPU memory would sit in RAM, which defeats moving it to disk. Use a "
                                  "directory on local NVMe, or pass --allow-tmpfs (allow-tmpfs = true in the config "
                                  "file) to accept this anyway");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat " + what);
  root.dev = st.st_dev;

  // If O_TMPFILE itself is unsupported the probe cannot tell: the first data file decides.
  const DirectIoProbe probe = probe_direct_io(fd);
  if (probe.outcome == DirectIoProbe::Outcome::Buffered) root.direct_io = false;
  if (probe.error == EROFS || probe.error == EACCES)
    return make_error(probe.error, what + " is not writable by tmsdiskd");
  return {};
}

// The path of directory `fd` as the kernel names it, for messages and `tmsctl status` only (nothing
// is ever opened by it); `fallback` where it cannot be read.
std::string path_of_dir(int fd, const std::string& fallback) {
  char buf[4096];
  const std::string link = fmt::format("/proc/self/fd/{}", fd);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf));
  if (n <= 0 || static_cast<std::size_t>(n) >= sizeof(buf)) return fallback;
  return std::string(buf, static_cast<std::size_t>(n));
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

Result<Roots> Roots::open_rank_directory(UniqueFd dir, uid_t uid, const std::string& named, bool allow_tmpfs) {
  try {
    struct stat st {};
    if (!dir || ::fstat(dir.get(), &st) != 0) return errno_error("cannot stat the directory " + named);
    Root root;
    root.path = path_of_dir(dir.get(), named);
    const std::string what = "the rank's directory " + root.path;
    if (!S_ISDIR(st.st_mode)) return make_error(ENOTDIR, what + " is not a directory");
    // The rank's own, or root's: a directory the rank may write, and nobody else may change under it
    // (swap its files for links, fill it): other users' files are never the daemon's to touch.
    if (uid != 0 && st.st_uid != uid)
      return make_error(EACCES, fmt::format("{} belongs to uid {}, not to the rank's user (uid {}): name a "
                                            "directory of your own",
                                            what, st.st_uid, uid));
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
      return make_error(EACCES, fmt::format("{} is writable by others (mode {:o}): another user could replace the "
                                            "files of a paused rank there; chmod go-w it or name another directory",
                                            what, st.st_mode & 07777));
    // The daemon's event loop makes its files there (openat, fallocate, the manifest): a filesystem
    // whose operations the user can make wait (FUSE) or that waits on a network would stall it for
    // every rank of the node. Roots are the administrator's choice; this directory is the user's.
    struct statfs fs {};
    if (::fstatfs(dir.get(), &fs) != 0) return errno_error("cannot stat the filesystem of " + what);
    if (const char* kind = blocking_filesystem(static_cast<unsigned long>(fs.f_type)))
      return make_error(EINVAL, fmt::format("{} is on {}, whose operations can hold up tmsdiskd for every rank of the "
                                            "node: name a directory on a local disk",
                                            what, kind));
    root.dir = std::move(dir);
    if (auto s = check_root(root, what, allow_tmpfs); !s) return std::move(s).error();
    Roots roots;
    roots.rank_chosen_ = true;
    roots.roots_.push_back(std::move(root));
    return roots;
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening the rank's directory");
  }
}

bool Roots::holds(int dir) const {
  struct stat st {};
  if (::fstat(dir, &st) != 0) return false;
  for (const auto& r : roots_) {
    struct stat rs {};
    if (::fstat(r.dir.get(), &rs) == 0 && rs.st_dev == st.st_dev && rs.st_ino == st.st_ino) return true;
  }
  return false;
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
