// SPDX-License-Identifier: Apache-2.0
// Storage internals: openat helpers that never follow a symlink (storage_fs.h).
#include "storage_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>

#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage::detail {

Error out_of_memory(std::string_view what) {
  return make_error(ENOMEM, "out of memory while " + std::string(what));
}

std::string join_path(std::string_view dir, std::string_view name) {
  std::string out(dir);
  if (out.empty() || out.back() != '/') out += '/';
  out += name;
  return out;
}

// Splits an absolute path into its components, dropping empty ones and ".". False for a relative
// path or one containing "..": those cannot be checked lexically against a root.
bool split_absolute(std::string_view path, std::vector<std::string_view>& parts) {
  parts.clear();
  if (path.empty() || path.front() != '/') return false;
  std::size_t pos = 0;
  while (pos < path.size()) {
    std::size_t slash = path.find('/', pos);
    if (slash == std::string_view::npos) slash = path.size();
    std::string_view part = path.substr(pos, slash - pos);
    if (part == "..") return false;
    if (!part.empty() && part != ".") parts.push_back(part);
    pos = slash + 1;
  }
  return true;
}

std::string join_parts(const std::vector<std::string_view>& parts) {
  if (parts.empty()) return "/";
  std::string out;
  for (auto part : parts) {
    out += '/';
    out += part;
  }
  return out;
}

bool all_digits(std::string_view s) {
  return !s.empty() && s.size() <= 19 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

Status write_all(int fd, const void* data, std::size_t len, const std::string& what) {
  auto* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("cannot write " + what);
    }
    p += n;
    len -= static_cast<std::size_t>(n);
  }
  return {};
}

// Opens an existing directory below `dirfd` without following a symlink in its place.
int open_dir_nofollow(int dirfd, const char* name) {
  return ::openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

Error not_a_directory_error(int err, const std::string& path) {
  if (err == ELOOP || err == ENOTDIR) {
    return make_error(err, path +
                               " is a symbolic link or not a directory; tmsdiskd never follows links inside a "
                               "storage root. It was not created by tmsdiskd: remove it");
  }
  return make_error(err, "cannot open directory " + path);
}

// Reads a small regular file (at most `limit` bytes) without following a symlink.
Result<std::string> read_small_file(int dirfd, const char* name, std::size_t limit, const std::string& path) {
  UniqueFd fd(::openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (!fd) return errno_error("cannot open " + path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_error("cannot stat " + path);
  if (!S_ISREG(st.st_mode)) return make_error(EINVAL, path + " is not a regular file");
  if (static_cast<uint64_t>(st.st_size) > limit) {
    return make_error(EFBIG, fmt::format("{} is larger than {} bytes: not a file tmsdiskd wrote", path, limit));
  }
  std::string out(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::pread(fd.get(), out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("cannot read " + path);
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  return out;
}

// Writes `name` atomically: a temporary file in the same directory, renamed over it. With `durable`,
// the temporary is flushed before the rename and the directory after it, so after a crash `name` is
// either the old or the new content, never a torn mix.
Status write_file_atomic(int dirfd, const char* tmp_name, const char* name, std::string_view content, bool durable,
                         const std::string& dir_path) {
  std::string tmp_path = join_path(dir_path, tmp_name);
  // Unlinked first and created exclusively: whatever sits under that name (a leftover, or a hard link
  // someone planted to make us truncate another file) is never written through.
  if (::unlinkat(dirfd, tmp_name, 0) != 0 && errno != ENOENT) return errno_error("cannot remove " + tmp_path);
  UniqueFd fd(::openat(dirfd, tmp_name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, kFileMode));
  if (!fd) return errno_error("cannot create " + tmp_path);
  if (auto st = write_all(fd.get(), content.data(), content.size(), tmp_path); !st) return st;
  if (durable && ::fdatasync(fd.get()) != 0) return errno_error("cannot flush " + tmp_path);
  fd.reset();
  if (::renameat(dirfd, tmp_name, dirfd, name) != 0) {
    return errno_error("cannot rename " + tmp_path + " to " + name);
  }
  if (durable && ::fsync(dirfd) != 0) return errno_error("cannot flush directory " + dir_path);
  return {};
}

// Names in directory `dirfd`, read through a fresh open file description so the caller's fd
// offset is untouched.
Result<std::vector<std::string>> list_dir(int dirfd, const std::string& path) {
  int fd = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_error("cannot open directory " + path);
  DIR* dir = ::fdopendir(fd);
  if (!dir) {
    Error e = errno_error("cannot list directory " + path);
    ::close(fd);
    return e;
  }
  std::vector<std::string> names;
  try {
    errno = 0;
    while (struct dirent* ent = ::readdir(dir)) {
      std::string_view n(ent->d_name);
      if (n != "." && n != "..") names.emplace_back(n);
      errno = 0;
    }
  } catch (const std::bad_alloc&) {
    ::closedir(dir);
    return out_of_memory("listing " + path);
  }
  int err = errno;
  ::closedir(dir);
  if (err != 0) return make_error(err, "cannot list directory " + path);
  return names;
}

// Removes everything inside directory `dirfd` with unlinkat on names listed through that fd: a symlink
// is removed, never followed, and nothing outside the directory is touched. Adds the disk usage of
// removed files (st_blocks * 512) to *bytes when given.
Status empty_dir(int dirfd, const std::string& path, int depth, uint64_t* bytes) {
  auto names = list_dir(dirfd, path);
  if (!names) return std::move(names).error();
  for (const auto& name : *names) {
    struct stat st {};
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;
      return errno_error("cannot stat " + join_path(path, name));
    }
    if (S_ISDIR(st.st_mode)) {
      std::string sub = join_path(path, name);
      if (depth <= 0) return make_error(ENOTEMPTY, "cannot remove " + sub + ": directories nested too deeply");
      UniqueFd subfd(open_dir_nofollow(dirfd, name.c_str()));
      if (!subfd) return not_a_directory_error(errno, sub);
      if (auto s = empty_dir(subfd.get(), sub, depth - 1, bytes); !s) return s;
      if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        return errno_error("cannot remove directory " + sub);
      }
      continue;
    }
    if (::unlinkat(dirfd, name.c_str(), 0) != 0) {
      if (errno == ENOENT) continue;
      return errno_error("cannot remove " + join_path(path, name));
    }
    if (bytes) *bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return {};
}

// Removes directory `name` below `dirfd` if it is empty; a non-empty one is fine (other jobs or
// ranks still use it).
// Failure is fine: ENOTEMPTY/EEXIST means still in use, ENOENT already gone, and anything else
// only leaves an empty directory behind, which the next sweep retries.
Status remove_rank_files(int dirfd, const std::string& path, const RankFileNames& names, uint64_t* bytes) {
  for (const std::string* name : names.all()) {
    struct stat st {};
    const bool there = bytes && ::fstatat(dirfd, name->c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (::unlinkat(dirfd, name->c_str(), 0) != 0) {
      if (errno == ENOENT) continue;
      return errno_error("cannot remove " + join_path(path, *name));
    }
    if (there) *bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return {};
}

void remove_if_empty(int dirfd, const char* name) {
  (void)::unlinkat(dirfd, name, AT_REMOVEDIR);
}

}  // namespace tmsdisk::storage::detail
