// SPDX-License-Identifier: Apache-2.0
// Storage roots, rank directories, extents, checksums and manifests (see storage.h).
#include "storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <mutex>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "extent_allocator.h"
#include "manifest.h"
#include "storage_testing.h"
#include "tmsdisk/common/proc.h"

namespace tmsdisk::storage {

namespace testing {
namespace {
std::atomic<FallocateHook> g_fallocate_hook{nullptr};
}  // namespace
FallocateHook set_fallocate_hook(FallocateHook hook) noexcept {
  return g_fallocate_hook.exchange(hook);
}
}  // namespace testing

namespace {

// The uid and job directories only need to be traversable by the daemon, which does all I/O; 0711
// lets a user's own tools stat their rank directory path without listing other users' jobs.
constexpr mode_t kParentDirMode = 0711;
constexpr mode_t kRankDirMode = 0700;
constexpr mode_t kFileMode = 0600;
constexpr std::size_t kMaxOwnerBytes = 4096;
// Files we create in a rank directory never contain directories; recursion is only a fallback for
// something foreign that appeared there, bounded so a hostile tree cannot exhaust the stack.
constexpr int kRemoveDepth = 4;
// Keeps every extent length and file offset far from 64-bit overflow (1 EiB per blob).
constexpr uint64_t kMaxBlobSize = uint64_t{1} << 60;

constexpr const char* kOwnerName = "owner";
constexpr const char* kOwnerTmpName = "owner.tmp";
constexpr const char* kDataName = "data";
constexpr const char* kManifestName = "manifest";
constexpr const char* kManifestTmpName = "manifest.tmp";

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

template <class T>
bool parse_number(std::string_view text, T& out) {
  if (text.empty()) return false;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && ptr == text.data() + text.size();
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
    return make_error(EFBIG, path + " is larger than " + std::to_string(limit) + " bytes: not a file tmsdiskd wrote");
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
void remove_if_empty(int dirfd, const char* name) {
  (void)::unlinkat(dirfd, name, AT_REMOVEDIR);
}

// What an `owner` file says.
struct Owner {
  pid_t pid = 0;
  uint64_t start_time = 0;
  uint64_t token = 0;
  uid_t uid = 0;
  std::string job;
  int64_t rank = 0;
};

constexpr std::string_view kOwnerMagic = "tmsdisk-owner 1";

std::string format_owner(const RankIdentity& id) {
  std::string s(kOwnerMagic);
  s += "\npid " + std::to_string(id.pid);
  s += "\nstart_time " + std::to_string(id.start_time);
  s += "\ntoken " + std::to_string(id.token);
  s += "\nuid " + std::to_string(id.uid);
  s += "\njob " + id.job;
  s += "\nrank " + std::to_string(id.rank);
  s += "\n";
  return s;
}

std::optional<Owner> parse_owner(std::string_view text) {
  Owner o;
  unsigned seen = 0;
  bool first = true;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (first) {
      if (line != kOwnerMagic) return std::nullopt;
      first = false;
      continue;
    }
    if (line.empty()) continue;
    std::size_t sp = line.find(' ');
    if (sp == std::string_view::npos) return std::nullopt;
    std::string_view key = line.substr(0, sp);
    std::string_view value = line.substr(sp + 1);
    bool ok = true;  // unknown keys are skipped: a later version may add fields
    if (key == "pid") {
      ok = parse_number(value, o.pid) && o.pid > 0;
      seen |= 1;
    } else if (key == "start_time") {
      ok = parse_number(value, o.start_time);
      seen |= 2;
    } else if (key == "token") {
      ok = parse_number(value, o.token);
      seen |= 4;
    } else if (key == "uid") {
      ok = parse_number(value, o.uid);
      seen |= 8;
    } else if (key == "job") {
      ok = valid_name(value);
      o.job = std::string(value);
      seen |= 16;
    } else if (key == "rank") {
      ok = parse_number(value, o.rank);
      seen |= 32;
    }
    if (!ok) return std::nullopt;
  }
  if (first || seen != 63) return std::nullopt;
  return o;
}

// "rank<R>-<pid>" -> pid, or nullopt if the name is not of that form.
std::optional<pid_t> parse_rank_dir_name(std::string_view name) {
  if (!name.starts_with("rank")) return std::nullopt;
  name.remove_prefix(4);
  std::size_t dash = name.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  std::string_view rank = name.substr(0, dash);
  std::string_view pid = name.substr(dash + 1);
  pid_t value = 0;
  if (!all_digits(rank) || !all_digits(pid) || !parse_number(pid, value) || value <= 0) return std::nullopt;
  return value;
}

// Creates (if needed) and opens directory `name` below `parent`. An existing entry must be a real
// directory (O_NOFOLLOW: a planted symlink fails with ELOOP) owned by the daemon or by the rank's
// user: a directory another user planted in a shared root could be renamed away under us.
Result<UniqueFd> make_parent_dir(int parent, const std::string& name, const std::string& path, uid_t rank_uid) {
  if (::mkdirat(parent, name.c_str(), kParentDirMode) != 0 && errno != EEXIST) {
    return errno_error("cannot create directory " + path);
  }
  UniqueFd fd(open_dir_nofollow(parent, name.c_str()));
  if (!fd) return not_a_directory_error(errno, path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_error("cannot stat " + path);
  if (st.st_uid != ::geteuid() && st.st_uid != rank_uid) {
    return make_error(EPERM, path + " is owned by uid " + std::to_string(st.st_uid) + ", neither tmsdiskd (uid " +
                                 std::to_string(::geteuid()) + ") nor the rank's user (uid " +
                                 std::to_string(rank_uid) + "); remove it so tmsdiskd can recreate it");
  }
  return fd;
}

// Opens `data` in a rank directory, with O_DIRECT where the filesystem allows it.
Result<UniqueFd> open_data_file(int rank_dir, bool create, bool& direct_io, const std::string& path) {
  int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  int fd = ::openat(rank_dir, kDataName, flags | O_DIRECT, kFileMode);
  direct_io = true;
  if (fd < 0 && errno == EINVAL) {
    // This filesystem has no O_DIRECT (tmpfs before 6.6, some FUSE and network filesystems):
    // buffered I/O still works, only slower and through the page cache. The caller logs it.
    fd = ::openat(rank_dir, kDataName, flags, kFileMode);
    direct_io = false;
  }
  if (fd < 0) return errno_error("cannot open data file " + path);
  UniqueFd out(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat " + path);
  if (!S_ISREG(st.st_mode)) return make_error(EINVAL, path + " is not a regular file");
  return out;
}

int fallocate_retry(int fd, int mode, uint64_t offset, uint64_t length) {
  while (::fallocate(fd, mode, static_cast<off_t>(offset), static_cast<off_t>(length)) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

// Gives the blocks of a free range back to the filesystem. Best effort: where punching is not
// supported the range just stays allocated, which costs space but never correctness.
void punch(int fd, uint64_t offset, uint64_t length) {
  if (length > 0) (void)fallocate_retry(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length);
}

// Punches the parts of [offset, offset+length) that `layout` has free or past its end.
void punch_free_parts(int fd, const ExtentAllocator& layout, uint64_t offset, uint64_t length) {
  const uint64_t stop = offset + length;
  const auto& free = layout.free_extents();
  auto it = free.upper_bound(offset);
  if (it != free.begin()) --it;
  for (; it != free.end() && it->first < stop; ++it) {
    uint64_t a = std::max(offset, it->first);
    uint64_t b = std::min(stop, it->first + it->second);
    if (a < b) punch(fd, a, b - a);
  }
  uint64_t tail = std::max(offset, layout.end());
  if (tail < stop) punch(fd, tail, stop - tail);
}

std::string bytes_text(uint64_t bytes) {
  std::string s = std::to_string(bytes) + " bytes";
  if (bytes >= (uint64_t{1} << 20)) s += " (" + std::to_string(bytes >> 20) + " MiB)";
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names

bool valid_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > proto::kMaxNameLength || name.front() == '.') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

std::string rank_dir_name(const RankIdentity& id) {
  int64_t r = id.rank >= 0 ? id.rank : static_cast<int64_t>(id.pid);
  return "rank" + std::to_string(r) + "-" + std::to_string(id.pid);
}

std::string rank_relative_dir(const RankIdentity& id) {
  return std::to_string(id.uid) + "/" + id.job + "/" + rank_dir_name(id);
}

// ---------------------------------------------------------------------------------------------
// Roots

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

  struct statfs sfs {};
  if (::fstatfs(fd, &sfs) != 0) return errno_error("cannot stat the filesystem of storage root " + root.path);
  auto magic = static_cast<unsigned long>(sfs.f_type);
  if ((magic == TMPFS_MAGIC || magic == RAMFS_MAGIC) && !allow_tmpfs) {
    return make_error(EINVAL, "storage root " + root.path + " is on " + (magic == TMPFS_MAGIC ? "tmpfs" : "ramfs") +
                                  ": paused GPU memory would sit in RAM, which defeats moving it to disk. Use a "
                                  "directory on local NVMe, or pass --allow-tmpfs (allow_tmpfs) to accept this anyway");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat storage root " + root.path);
  root.dev = st.st_dev;

  // Probe O_DIRECT with an unnamed temporary file. If O_TMPFILE itself is unsupported we cannot tell
  // and leave the decision to the first data file.
  int probe = ::openat(fd, ".", O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, kFileMode);
  if (probe >= 0) {
    ::close(probe);
  } else if (errno == EINVAL) {
    probe = ::openat(fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, kFileMode);
    if (probe >= 0) {
      ::close(probe);
      root.direct_io = false;
    }
  } else if (errno == EROFS || errno == EACCES) {
    return errno_error("storage root " + root.path + " is not writable by tmsdiskd");
  }
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
  if (i >= roots_.size()) return make_error(EINVAL, "no storage root #" + std::to_string(i));
  struct statvfs vfs {};
  if (::fstatvfs(roots_[i].dir.get(), &vfs) != 0) return errno_error("cannot stat storage root " + roots_[i].path);
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

// ---------------------------------------------------------------------------------------------
// RankStore

namespace {

struct RootFiles {
  std::string path;  // root path, for messages
  std::string rank_path;
  UniqueFd root;  // dup of the root's O_PATH fd: the RankStore does not depend on Roots' lifetime
  UniqueFd uid_dir;
  UniqueFd job_dir;
  UniqueFd rank_dir;
  UniqueFd data;
  bool direct_io = true;
  bool gone = false;  // rank directory removed
  ExtentAllocator alloc{kIoAlignment};
};

struct BlobState {
  uint64_t id = 0;
  uint64_t size = 0;
  uint64_t chunks = 0;
  std::vector<ManifestExtent> extents;  // one per root; length 0: no chunk of this blob there
  std::vector<uint64_t> sums;
  std::vector<uint8_t> have;
};

uint64_t round_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

}  // namespace

struct RankStore::Impl {
  mutable std::mutex mu;
  RankIdentity id;
  uint32_t chunk = 0;
  std::string uid_name;
  std::string rank_name;
  std::string relative;
  std::string dir_path;
  std::vector<RootFiles> roots;
  std::vector<BlobState> blobs;
  std::unordered_map<uint64_t, std::size_t> index;
  uint64_t missing = 0;
  bool paused = false;
  bool writing = false;  // a reservation was made and no commit has closed it yet
  uint64_t generation = 0;
  bool removed = false;

  Status open_dirs(std::size_t i, int root_fd, bool create);
  Status remove_locked();
  Status reserve_locked(std::span<const proto::BlobSize> set);
  Status load_manifest();
  Status write_manifest(uint32_t state, uint64_t gen);
  Result<const BlobState*> find_chunk(uint64_t blob, uint64_t offset, uint64_t* chunk_index) const;
};

namespace {

Status check_identity(const Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  if (roots.size() == 0) return make_error(EINVAL, "no storage root configured");
  if (!valid_name(id.job)) {
    return make_error(EINVAL, "job name \"" + id.job +
                                  "\" is not usable as a directory name: use 1-64 characters of A-Z a-z 0-9 . _ -, "
                                  "not starting with '.'");
  }
  if (id.pid <= 0) return make_error(EINVAL, "invalid pid " + std::to_string(id.pid));
  if (chunk_bytes == 0 || chunk_bytes % kIoAlignment != 0) {
    return make_error(EINVAL, "chunk size " + std::to_string(chunk_bytes) + " is not a non-zero multiple of " +
                                  std::to_string(kIoAlignment));
  }
  return {};
}

std::unique_ptr<RankStore::Impl> new_impl(const Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  auto impl = std::make_unique<RankStore::Impl>();
  impl->id = id;
  impl->chunk = chunk_bytes;
  impl->uid_name = std::to_string(id.uid);
  impl->rank_name = rank_dir_name(id);
  impl->relative = rank_relative_dir(id);
  impl->roots.resize(roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    impl->roots[i].path = roots[i].path;
    impl->roots[i].rank_path = join_path(roots[i].path, impl->relative);
  }
  impl->dir_path = impl->roots[0].rank_path;
  return impl;
}

}  // namespace

Status RankStore::Impl::open_dirs(std::size_t i, int root_fd, bool create) {
  RootFiles& rf = roots[i];
  std::string uid_path = join_path(rf.path, uid_name);
  std::string job_path = join_path(uid_path, id.job);
  int dupfd = ::fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
  if (dupfd < 0) return errno_error("cannot duplicate the handle of storage root " + rf.path);
  rf.root.reset(dupfd);

  if (create) {
    auto uid_dir = make_parent_dir(rf.root.get(), uid_name, uid_path, id.uid);
    if (!uid_dir) return std::move(uid_dir).error();
    rf.uid_dir = std::move(uid_dir).value();
    auto job_dir = make_parent_dir(rf.uid_dir.get(), id.job, job_path, id.uid);
    if (!job_dir) return std::move(job_dir).error();
    rf.job_dir = std::move(job_dir).value();

    if (::mkdirat(rf.job_dir.get(), rank_name.c_str(), kRankDirMode) != 0) {
      if (errno != EEXIST) return errno_error("cannot create directory " + rf.rank_path);
      // A directory of this name exists: pids are reused, so it may be a dead process's leftovers.
      // Replace it only if its owner is provably gone.
      UniqueFd old(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
      if (!old) return not_a_directory_error(errno, rf.rank_path);
      auto text = read_small_file(old.get(), kOwnerName, kMaxOwnerBytes, join_path(rf.rank_path, kOwnerName));
      std::optional<Owner> owner = text ? parse_owner(*text) : std::nullopt;
      if (owner && process_alive(owner->pid, owner->start_time)) {
        return make_error(EEXIST, rf.rank_path + " belongs to the live process " + std::to_string(owner->pid) +
                                      ": a reconnecting rank must present its session token to adopt it");
      }
      if (auto s = empty_dir(old.get(), rf.rank_path, kRemoveDepth, nullptr); !s) return s;
      old.reset();
      if (::unlinkat(rf.job_dir.get(), rank_name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        return errno_error("cannot remove stale directory " + rf.rank_path);
      }
      if (::mkdirat(rf.job_dir.get(), rank_name.c_str(), kRankDirMode) != 0) {
        return errno_error("cannot create directory " + rf.rank_path);
      }
    }
    rf.rank_dir.reset(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
    if (!rf.rank_dir) return not_a_directory_error(errno, rf.rank_path);
    // The umask may have narrowed the mode; it must not be wider than 0700 either way.
    if (::fchmod(rf.rank_dir.get(), kRankDirMode) != 0) return errno_error("cannot set the mode of " + rf.rank_path);

    // The owner file needs no fsync: it only matters while its process lives, and a machine crash
    // ends that process too.
    std::string owner = format_owner(id);
    if (auto s = write_file_atomic(rf.rank_dir.get(), kOwnerTmpName, kOwnerName, owner, false, rf.rank_path); !s) {
      return s;
    }
  } else {
    rf.uid_dir.reset(open_dir_nofollow(rf.root.get(), uid_name.c_str()));
    if (!rf.uid_dir) return not_a_directory_error(errno, uid_path);
    rf.job_dir.reset(open_dir_nofollow(rf.uid_dir.get(), id.job.c_str()));
    if (!rf.job_dir) return not_a_directory_error(errno, job_path);
    rf.rank_dir.reset(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
    if (!rf.rank_dir) return not_a_directory_error(errno, rf.rank_path);

    std::string owner_path = join_path(rf.rank_path, kOwnerName);
    auto text = read_small_file(rf.rank_dir.get(), kOwnerName, kMaxOwnerBytes, owner_path);
    if (!text) return std::move(text).error();
    auto owner = parse_owner(*text);
    if (!owner) return make_error(EINVAL, owner_path + " is not a tmsdisk owner file");
    if (owner->pid != id.pid || owner->start_time != id.start_time || owner->token != id.token ||
        owner->uid != id.uid || owner->job != id.job) {
      return make_error(EPERM, rf.rank_path +
                                   " belongs to another session (pid, start time or token differ): "
                                   "reconnect with the token this daemon issued, or start afresh");
    }
  }

  auto data = open_data_file(rf.rank_dir.get(), create, rf.direct_io, join_path(rf.rank_path, kDataName));
  if (!data) return std::move(data).error();
  rf.data = std::move(data).value();
  return {};
}

Status RankStore::Impl::remove_locked() {
  Status first;
  for (auto& rf : roots) {
    if (rf.gone) continue;
    rf.data.reset();
    if (rf.rank_dir) {
      Status s = empty_dir(rf.rank_dir.get(), rf.rank_path, kRemoveDepth, nullptr);
      if (s && ::unlinkat(rf.job_dir.get(), rank_name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        s = errno_error("cannot remove directory " + rf.rank_path);
      }
      if (!s) {
        if (first) first = std::move(s);
        continue;
      }
    }
    // Also reached when create() failed before making the rank directory: the job and uid
    // directories it may have made go too, if nothing else uses them.
    rf.gone = true;
    rf.rank_dir.reset();
    if (rf.uid_dir) remove_if_empty(rf.uid_dir.get(), id.job.c_str());
    if (rf.root) remove_if_empty(rf.root.get(), uid_name.c_str());
    rf.job_dir.reset();
    rf.uid_dir.reset();
  }
  if (first) removed = true;
  return first;
}

Result<std::unique_ptr<RankStore>> RankStore::create(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  try {
    if (auto s = check_identity(roots, id, chunk_bytes); !s) return std::move(s).error();
    auto impl = new_impl(roots, id, chunk_bytes);
    for (std::size_t i = 0; i < roots.size(); ++i) {
      Status s = impl->open_dirs(i, roots[i].dir.get(), true);
      // A sweep may remove the job or uid directory in the moment it is empty; one retry covers it.
      if (!s && s.error().errnum() == ENOENT) s = impl->open_dirs(i, roots[i].dir.get(), true);
      if (!s) {
        // Leave nothing half-made behind: remove what this call created on earlier roots.
        (void)impl->remove_locked();
        return std::move(s).error();
      }
      if (!impl->roots[i].direct_io) roots[i].direct_io = false;
    }
    return std::unique_ptr<RankStore>(new RankStore(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return out_of_memory("creating a rank directory");
  }
}

Result<std::unique_ptr<RankStore>> RankStore::adopt(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  try {
    if (auto s = check_identity(roots, id, chunk_bytes); !s) return std::move(s).error();
    auto impl = new_impl(roots, id, chunk_bytes);
    for (std::size_t i = 0; i < roots.size(); ++i) {
      if (auto s = impl->open_dirs(i, roots[i].dir.get(), false); !s) return std::move(s).error();
      if (!impl->roots[i].direct_io) roots[i].direct_io = false;
    }
    if (auto s = impl->load_manifest(); !s) return std::move(s).error();
    return std::unique_ptr<RankStore>(new RankStore(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return out_of_memory("adopting a rank directory");
  }
}

RankStore::RankStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankStore::~RankStore() = default;

const std::string& RankStore::dir_path() const noexcept {
  return impl_->dir_path;
}
const std::string& RankStore::relative_dir() const noexcept {
  return impl_->relative;
}
uint32_t RankStore::chunk_bytes() const noexcept {
  return impl_->chunk;
}
std::size_t RankStore::root_count() const noexcept {
  return impl_->roots.size();
}

Status RankStore::remove() {
  try {
    std::lock_guard lock(impl_->mu);
    if (impl_->removed) return {};
    return impl_->remove_locked();
  } catch (const std::bad_alloc&) {
    return out_of_memory("removing a rank directory");
  }
}

// Extent of `size` bytes' chunks that land on root r of n: every n-th chunk starting at r, packed
// back to back; the blob's last chunk is rounded up to kIoAlignment so O_DIRECT can move it whole.
static uint64_t extent_length(uint64_t size, uint32_t chunk, std::size_t n, std::size_t r) {
  uint64_t chunks = size == 0 ? 0 : (size - 1) / chunk + 1;
  if (chunks <= r) return 0;
  uint64_t count = (chunks - 1 - r) / n + 1;
  uint64_t len = count * chunk;
  if ((chunks - 1) % n == r) {
    uint64_t tail = size - (chunks - 1) * chunk;
    len = (count - 1) * chunk + round_up(tail, kIoAlignment);
  }
  return len;
}

Status RankStore::Impl::reserve_locked(std::span<const proto::BlobSize> set) {
  if (removed) return make_error(ENOENT, "the rank's directory was removed");
  if (paused) {
    return make_error(EBUSY, "rank has a committed pause (generation " + std::to_string(generation) +
                                 ") that was not resumed; its files are the only copy of that memory. Resume "
                                 "before reserving a new set");
  }
  const std::size_t n = roots.size();

  std::unordered_set<uint64_t> seen;
  seen.reserve(set.size());
  for (const auto& b : set) {
    if (!seen.insert(b.id).second) {
      return make_error(EINVAL, "blob " + std::to_string(b.id) + " appears twice in the reserved set");
    }
    if (b.size > kMaxBlobSize) {
      return make_error(EFBIG, "blob " + std::to_string(b.id) + " of " + std::to_string(b.size) +
                                   " bytes is larger than tmsdisk supports (" + std::to_string(kMaxBlobSize) + ")");
    }
  }

  // Plan the new layout on copies of the allocators; nothing on disk changes until it is complete.
  std::vector<ExtentAllocator> plan;
  plan.reserve(n);
  for (const auto& rf : roots) plan.push_back(rf.alloc);

  std::vector<bool> kept(blobs.size(), false);
  for (const auto& b : set) {
    auto it = index.find(b.id);
    if (it != index.end() && blobs[it->second].size == b.size) kept[it->second] = true;
  }
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    if (kept[i]) continue;
    for (std::size_t r = 0; r < n; ++r) {
      const auto& e = blobs[i].extents[r];
      if (e.length > 0 && !plan[r].release(e.offset, e.length)) {
        return make_error(
            EIO, "internal error: extent allocator of " + roots[r].rank_path + " is inconsistent; restart the rank");
      }
    }
  }

  struct Fresh {
    std::size_t root;
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Fresh> fresh;
  std::vector<uint64_t> fresh_bytes(n, 0);
  std::vector<BlobState> next;
  next.reserve(set.size());
  std::unordered_map<uint64_t, std::size_t> next_index;
  next_index.reserve(set.size());
  uint64_t total_chunks = 0;
  for (const auto& b : set) {
    BlobState s;
    s.id = b.id;
    s.size = b.size;
    s.chunks = b.size == 0 ? 0 : (b.size - 1) / chunk + 1;
    auto it = index.find(b.id);
    if (it != index.end() && kept[it->second]) {
      s.extents = blobs[it->second].extents;
    } else {
      s.extents.resize(n);
      for (std::size_t r = 0; r < n; ++r) {
        uint64_t len = extent_length(b.size, chunk, n, r);
        if (len == 0) continue;
        auto off = plan[r].allocate(len);
        if (!off) return make_error(EFBIG, "the data file on " + roots[r].path + " would grow past 2^62 bytes");
        s.extents[r] = {*off, len};
        fresh.push_back({r, *off, len});
        fresh_bytes[r] += len;
      }
    }
    total_chunks += s.chunks;
    next_index.emplace(s.id, next.size());
    next.push_back(std::move(s));
  }
  for (auto& a : plan) a.trim_tail();

  // A cheap refusal before touching the disk, with the numbers the user needs. It can only be
  // optimistic (roots may share a filesystem, metadata takes blocks): fallocate has the last word.
  std::vector<uint64_t> old_size(n, 0);
  for (std::size_t r = 0; r < n; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) != 0) return errno_error("cannot stat data file in " + roots[r].rank_path);
    old_size[r] = static_cast<uint64_t>(st.st_size);
    uint64_t grow = plan[r].end() > old_size[r] ? plan[r].end() - old_size[r] : 0;
    if (grow == 0) continue;
    struct statvfs vfs {};
    if (::fstatvfs(roots[r].data.get(), &vfs) != 0)
      return errno_error("cannot stat the filesystem of " + roots[r].path);
    uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    if (grow > avail) {
      return make_error(ENOSPC, "not enough disk space for this pause on " + roots[r].path + ": it needs " +
                                    bytes_text(grow) + " more there (" + bytes_text(fresh_bytes[r]) +
                                    " of new extents), " + bytes_text(avail) +
                                    " are free. Free space there, add a storage root, or pause less");
    }
  }

  // Checksum slots only now: a bogus size has been refused for lack of space instead of making
  // this allocate without bound.
  for (auto& s : next) {
    s.sums.assign(s.chunks, 0);
    s.have.assign(s.chunks, 0);
  }

  auto hook = testing::g_fallocate_hook.load();
  std::vector<uint8_t> touched(n, 0);  // allocated up front: the rollback below must not throw
  for (std::size_t k = 0; k < fresh.size(); ++k) {
    const Fresh& f = fresh[k];
    int err = hook ? hook(f.root, f.offset, f.length) : 0;
    if (err == 0) err = fallocate_retry(roots[f.root].data.get(), 0, f.offset, f.length);
    if (err == 0) continue;
    // Roll back: free what this call allocated (including the failed range, which a filesystem may
    // have allocated in part, even past the end of the file) and cut any growth off, so the files
    // are as before. Only the parts that were free in the old layout are punched: a fresh extent
    // may cover a dropped blob whose data the old set still owns.
    for (std::size_t j = 0; j <= k; ++j) {
      const Fresh& g = fresh[j];
      punch_free_parts(roots[g.root].data.get(), roots[g.root].alloc, g.offset, g.length);
      touched[g.root] = 1;
    }
    for (std::size_t r = 0; r < n; ++r) {
      // Truncating to the unchanged size still drops blocks preallocated past the end of the file.
      if (!touched[r]) continue;
      while (::ftruncate(roots[r].data.get(), static_cast<off_t>(old_size[r])) != 0 && errno == EINTR) {
      }
    }
    if (err == ENOSPC || err == EDQUOT) {
      uint64_t avail = 0;
      struct statvfs vfs {};
      if (::fstatvfs(roots[f.root].data.get(), &vfs) == 0) {
        avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
      }
      return make_error(err, "not enough disk space for this pause on " + roots[f.root].path + ": it needs " +
                                 bytes_text(fresh_bytes[f.root]) + " of new extents there, " + bytes_text(avail) +
                                 " are free" + (err == EDQUOT ? " within the disk quota" : "") +
                                 ". Free space there, add a storage root, or pause less");
    }
    return make_error(err,
                      "cannot preallocate " + bytes_text(f.length) + " in the data file of " + roots[f.root].rank_path);
  }

  // Committed in memory from here on; what follows only gives unused space back (best effort).
  for (std::size_t r = 0; r < n; ++r) {
    RootFiles& rf = roots[r];
    if (plan[r].end() < old_size[r]) {
      while (::ftruncate(rf.data.get(), static_cast<off_t>(plan[r].end())) != 0 && errno == EINTR) {
      }
    }
    for (const auto& [off, len] : plan[r].free_extents()) punch(rf.data.get(), off, len);
    rf.alloc = std::move(plan[r]);
  }
  blobs = std::move(next);
  index = std::move(next_index);
  missing = total_chunks;
  writing = true;
  // Record where this pause's chunks will go before any is written: if the daemon dies mid-pause,
  // its successor still knows the extents, and the rank (which holds every acknowledged chunk's
  // checksum) can read back what it had already released.
  if (auto s = write_manifest(kManifestWriting, generation); !s) {
    return make_error(s.error().errnum(), "cannot record the reservation: " + s.error().describe());
  }
  return {};
}

Status RankStore::reserve(std::span<const proto::BlobSize> blobs) {
  try {
    std::lock_guard lock(impl_->mu);
    return impl_->reserve_locked(blobs);
  } catch (const std::bad_alloc&) {
    return out_of_memory("reserving extents (set unchanged)");
  }
}

Result<const BlobState*> RankStore::Impl::find_chunk(uint64_t blob, uint64_t offset, uint64_t* chunk_index) const {
  if (removed) return make_error(ENOENT, "the rank's directory was removed");
  auto it = index.find(blob);
  if (it == index.end()) return make_error(ENOENT, "blob " + std::to_string(blob) + " is not in the reserved set");
  const BlobState& b = blobs[it->second];
  if (offset % chunk != 0) {
    return make_error(EINVAL, "offset " + std::to_string(offset) + " of blob " + std::to_string(blob) +
                                  " is not a multiple of the chunk size " + std::to_string(chunk));
  }
  if (offset >= b.size) {
    return make_error(EINVAL, "offset " + std::to_string(offset) + " is past the end of blob " + std::to_string(blob) +
                                  " (" + std::to_string(b.size) + " bytes)");
  }
  *chunk_index = offset / chunk;
  return &b;
}

Result<RankStore::Location> RankStore::locate(uint64_t blob, uint64_t offset, uint32_t length) const {
  try {
    std::lock_guard lock(impl_->mu);
    uint64_t ci = 0;
    auto found = impl_->find_chunk(blob, offset, &ci);
    if (!found) return std::move(found).error();
    const BlobState& b = **found;
    uint64_t want = std::min<uint64_t>(impl_->chunk, b.size - offset);
    if (length != want) {
      return make_error(EINVAL, "chunk at offset " + std::to_string(offset) + " of blob " + std::to_string(blob) +
                                    " is " + std::to_string(want) + " bytes, not " + std::to_string(length));
    }
    std::size_t n = impl_->roots.size();
    std::size_t r = static_cast<std::size_t>(ci % n);
    const RootFiles& rf = impl_->roots[r];
    Location loc;
    loc.fd = rf.data.get();
    loc.direct_io = rf.direct_io;
    loc.file_offset = b.extents[r].offset + (ci / n) * impl_->chunk;
    loc.io_length = static_cast<uint32_t>(round_up(length, kIoAlignment));
    return loc;
  } catch (const std::bad_alloc&) {
    return out_of_memory("locating a chunk");
  }
}

bool RankStore::record_checksum(uint64_t blob, uint64_t offset, uint64_t checksum) {
  try {
    std::lock_guard lock(impl_->mu);
    uint64_t ci = 0;
    auto found = impl_->find_chunk(blob, offset, &ci);
    if (!found) return false;
    auto& b = const_cast<BlobState&>(**found);
    if (!b.have[ci]) {
      b.have[ci] = 1;
      --impl_->missing;
    }
    b.sums[ci] = checksum;
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

Result<uint64_t> RankStore::expected_checksum(uint64_t blob, uint64_t offset) const {
  try {
    std::lock_guard lock(impl_->mu);
    uint64_t ci = 0;
    auto found = impl_->find_chunk(blob, offset, &ci);
    if (!found) return std::move(found).error();
    if (!(*found)->have[ci]) {
      return make_error(ENODATA, "chunk at offset " + std::to_string(offset) + " of blob " + std::to_string(blob) +
                                     " was never written in this generation");
    }
    return (*found)->sums[ci];
  } catch (const std::bad_alloc&) {
    return out_of_memory("looking up a checksum");
  }
}

uint64_t RankStore::missing_chunks() const noexcept {
  std::lock_guard lock(impl_->mu);
  return impl_->missing;
}

bool RankStore::holds_unresumed_data() const noexcept {
  std::lock_guard lock(impl_->mu);
  if (impl_->paused) return true;
  if (!impl_->writing) return false;
  uint64_t total = 0;
  for (const auto& b : impl_->blobs) total += b.chunks;
  return impl_->missing < total;
}

bool RankStore::paused() const noexcept {
  std::lock_guard lock(impl_->mu);
  return impl_->paused;
}

uint64_t RankStore::generation() const noexcept {
  std::lock_guard lock(impl_->mu);
  return impl_->generation;
}

std::vector<proto::BlobSize> RankStore::blobs() const {
  std::vector<proto::BlobSize> out;
  try {
    std::lock_guard lock(impl_->mu);
    out.reserve(impl_->blobs.size());
    for (const auto& b : impl_->blobs) out.push_back({b.id, b.size});
  } catch (const std::bad_alloc&) {
    out.clear();
  }
  return out;
}

uint64_t RankStore::disk_bytes() const noexcept {
  std::lock_guard lock(impl_->mu);
  uint64_t total = 0;
  for (const auto& rf : impl_->roots) total += rf.alloc.used_bytes();
  return total;
}

Status RankStore::commit(proto::CommitState state, uint64_t generation) {
  try {
    std::lock_guard lock(impl_->mu);
    Impl& m = *impl_;
    if (m.removed) return make_error(ENOENT, "the rank's directory was removed");
    if (state != proto::CommitState::Paused && state != proto::CommitState::Resumed) {
      return make_error(EINVAL, "unknown commit state " + std::to_string(static_cast<int>(state)));
    }
    if (state == proto::CommitState::Paused) {
      if (m.missing > 0) {
        uint64_t total = 0;
        for (const auto& b : m.blobs) total += b.chunks;
        return make_error(EINVAL, std::to_string(m.missing) + " of " + std::to_string(total) +
                                      " chunks of the reserved set were never written; the pause is incomplete and "
                                      "was not committed");
      }
      // The data must be on disk before a manifest that vouches for it; for O_DIRECT files this also
      // persists the conversion of fallocated (unwritten) extents.
      for (auto& rf : m.roots) {
        if (::fdatasync(rf.data.get()) != 0) return errno_error("cannot flush the data file in " + rf.rank_path);
      }
    }

    if (auto s = m.write_manifest(state == proto::CommitState::Paused ? kManifestPaused : kManifestResumed, generation);
        !s) {
      return s;
    }
    m.paused = state == proto::CommitState::Paused;
    m.writing = false;
    m.generation = generation;
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("committing the manifest");
  }
}

Status RankStore::Impl::write_manifest(uint32_t state, uint64_t gen) {
  Manifest mf;
  mf.state = state;
  mf.generation = gen;
  mf.chunk_bytes = chunk;
  for (const auto& rf : roots) mf.data_end.push_back(rf.alloc.end());
  mf.blobs.reserve(blobs.size());
  for (const auto& b : blobs) mf.blobs.push_back({b.id, b.size, b.extents, b.sums, b.have});
  std::string bytes = encode_manifest(mf);
  RootFiles& first = roots[0];
  return write_file_atomic(first.rank_dir.get(), kManifestTmpName, kManifestName, bytes, true, first.rank_path);
}

Status RankStore::Impl::load_manifest() {
  RootFiles& first = roots[0];
  std::string path = join_path(first.rank_path, kManifestName);
  auto bytes = read_small_file(first.rank_dir.get(), kManifestName, kMaxManifestBytes, path);
  if (!bytes) {
    if (bytes.error().errnum() != ENOENT) return std::move(bytes).error();
    // Nothing was ever committed: whatever the data files hold is unreferenced.
    for (auto& rf : roots) {
      while (::ftruncate(rf.data.get(), 0) != 0 && errno == EINTR) {
      }
    }
    return {};
  }
  std::string why;
  auto mf = decode_manifest(*bytes, why);
  if (!mf) {
    return make_error(EBADMSG, path + " is corrupt (" + why +
                                   "); this rank's paused data cannot be trusted. Restart the rank; its files are "
                                   "reclaimed once it exits");
  }
  if (mf->chunk_bytes != chunk) {
    return make_error(EINVAL, path + " was written with chunk size " + std::to_string(mf->chunk_bytes) +
                                  ", this session uses " + std::to_string(chunk) +
                                  ": reconnect with the slot size of the original session");
  }
  const std::size_t n = roots.size();
  if (mf->data_end.size() != n) {
    return make_error(EINVAL, path + " was written with " + std::to_string(mf->data_end.size()) +
                                  " storage roots, the daemon now has " + std::to_string(n) +
                                  ": restore the original --root list to resume this rank");
  }
  std::vector<ExtentAllocator> allocs;
  allocs.reserve(n);
  for (std::size_t r = 0; r < n; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) != 0)
      return errno_error("cannot stat the data file in " + roots[r].rank_path);
    if (static_cast<uint64_t>(st.st_size) < mf->data_end[r]) {
      return make_error(EBADMSG, "the data file in " + roots[r].rank_path + " is shorter (" +
                                     std::to_string(st.st_size) + " bytes) than its manifest says (" +
                                     std::to_string(mf->data_end[r]) +
                                     "): it was truncated outside tmsdiskd and the rank's paused data is lost");
    }
    allocs.push_back(ExtentAllocator::with_free_file(kIoAlignment, mf->data_end[r]));
  }
  std::vector<BlobState> loaded;
  std::unordered_map<uint64_t, std::size_t> idx;
  loaded.reserve(mf->blobs.size());
  uint64_t missing_count = 0;
  for (auto& mb : mf->blobs) {
    if (mb.size > kMaxBlobSize || !idx.emplace(mb.id, loaded.size()).second) {
      return make_error(EBADMSG, path + " lists blob " + std::to_string(mb.id) + " twice or with an invalid size");
    }
    for (std::size_t r = 0; r < n; ++r) {
      const auto& e = mb.extents[r];
      uint64_t want = extent_length(mb.size, chunk, n, r);
      if (e.length != want || (want > 0 && !allocs[r].claim(e.offset, e.length))) {
        return make_error(EBADMSG, path + ": the extent of blob " + std::to_string(mb.id) + " on root " +
                                       std::to_string(r) + " is inconsistent (wrong length, overlap or past the end)");
      }
    }
    BlobState s;
    s.id = mb.id;
    s.size = mb.size;
    s.chunks = mb.size == 0 ? 0 : (mb.size - 1) / chunk + 1;
    if (mb.sums.size() != s.chunks || mb.have.size() != s.chunks) {
      return make_error(EBADMSG, path + ": wrong number of checksums for blob " + std::to_string(mb.id));
    }
    s.extents = std::move(mb.extents);
    s.sums = std::move(mb.sums);
    s.have = std::move(mb.have);
    for (uint8_t h : s.have) missing_count += h ? 0 : 1;
    loaded.push_back(std::move(s));
  }
  if (mf->state == kManifestPaused && missing_count > 0) {
    return make_error(EBADMSG, path + " says paused but " + std::to_string(missing_count) + " chunks have no checksum");
  }
  for (std::size_t r = 0; r < n; ++r) roots[r].alloc = std::move(allocs[r]);
  blobs = std::move(loaded);
  index = std::move(idx);
  missing = missing_count;
  paused = mf->state == kManifestPaused;
  writing = mf->state == kManifestWriting;
  generation = mf->generation;
  return {};
}

// ---------------------------------------------------------------------------------------------
// Sweep

namespace {

struct Sweeper {
  const std::function<bool(const std::string&)>& in_use;
  const std::function<void(const std::string&)>& warn;
  SweepStats stats;

  void say(const std::string& msg) const {
    if (warn) warn(msg);
  }

  // One rank directory: removed only when its owner file is ours, matches the path, and names a
  // process that is gone, and the daemon does not hold it.
  void rank(int job_fd, const std::string& root_path, const std::string& uid, const std::string& job,
            const std::string& name) {
    std::string rel = uid + "/" + job + "/" + name;
    std::string path = join_path(root_path, rel);
    auto pid = parse_rank_dir_name(name);
    if (!pid) {
      say("sweep: leaving " + path + " alone: not a rank directory name (rank<R>-<pid>)");
      return;
    }
    UniqueFd fd(open_dir_nofollow(job_fd, name.c_str()));
    if (!fd) {
      say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
      return;
    }
    auto text = read_small_file(fd.get(), kOwnerName, kMaxOwnerBytes, join_path(path, kOwnerName));
    if (!text) {
      say("sweep: leaving " + path + " alone: " + text.error().describe());
      return;
    }
    auto owner = parse_owner(*text);
    if (!owner || owner->pid != *pid || std::to_string(owner->uid) != uid || owner->job != job) {
      say("sweep: leaving " + path + " alone: its owner file is not tmsdiskd's or does not match the path");
      return;
    }
    if (process_alive(owner->pid, owner->start_time)) return;
    if (in_use && in_use(rel)) return;
    uint64_t bytes = 0;
    if (auto s = empty_dir(fd.get(), path, kRemoveDepth, &bytes); !s) {
      stats.removed_bytes += bytes;
      say("sweep: cannot remove " + path + ": " + s.error().describe());
      return;
    }
    fd.reset();
    stats.removed_bytes += bytes;
    if (::unlinkat(job_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      Error e = errno_error("sweep: cannot remove " + path);
      say(e.describe());
      return;
    }
    ++stats.removed_dirs;
  }

  void job(int uid_fd, const std::string& root_path, const std::string& uid, const std::string& name) {
    std::string path = join_path(root_path, uid + "/" + name);
    if (!valid_name(name)) {
      say("sweep: leaving " + path + " alone: not a job name tmsdiskd creates");
      return;
    }
    UniqueFd fd(open_dir_nofollow(uid_fd, name.c_str()));
    if (!fd) {
      say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
      return;
    }
    auto names = list_dir(fd.get(), path);
    if (!names) {
      say("sweep: " + names.error().describe());
      return;
    }
    for (const auto& n : *names) rank(fd.get(), root_path, uid, name, n);
    fd.reset();
    remove_if_empty(uid_fd, name.c_str());
  }

  void root(const Root& r) {
    UniqueFd fd(::openat(r.dir.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd) {
      say("sweep: " + errno_error("cannot open storage root " + r.path).describe());
      return;
    }
    auto names = list_dir(fd.get(), r.path);
    if (!names) {
      say("sweep: " + names.error().describe());
      return;
    }
    for (const auto& uid : *names) {
      uid_t value = 0;
      // Not a uid: something else that lives in this (possibly shared) directory.
      if (!all_digits(uid) || !parse_number(uid, value)) continue;
      std::string path = join_path(r.path, uid);
      UniqueFd ufd(open_dir_nofollow(fd.get(), uid.c_str()));
      if (!ufd) {
        say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
        continue;
      }
      auto jobs = list_dir(ufd.get(), path);
      if (!jobs) {
        say("sweep: " + jobs.error().describe());
        continue;
      }
      for (const auto& j : *jobs) job(ufd.get(), r.path, uid, j);
      ufd.reset();
      remove_if_empty(fd.get(), uid.c_str());
    }
  }
};

}  // namespace

Result<SweepStats> sweep_dead_ranks(Roots& roots, const std::function<bool(const std::string& relative_dir)>& in_use,
                                    const std::function<void(const std::string&)>& warn) {
  try {
    Sweeper s{in_use, warn, {}};
    for (std::size_t i = 0; i < roots.size(); ++i) s.root(roots[i]);
    return s.stats;
  } catch (const std::bad_alloc&) {
    return out_of_memory("sweeping dead ranks' directories");
  }
}

}  // namespace tmsdisk::storage
