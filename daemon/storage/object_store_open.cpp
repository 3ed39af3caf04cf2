// SPDX-License-Identifier: Apache-2.0
// ObjectStore::open (object_store.h): the files in the rank directory, and what the log says of them
// replayed, so that a restarted daemon finds every object and committed version where it was.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>
#include <utility>
#include <vector>

#include "object_store_impl.h"
#include "storage_fs.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

// The rank directory's path, for messages: the store is handed descriptors, not names.
std::string path_of(int fd, std::size_t root) {
  char buf[4096];
  const std::string link = fmt::format("/proc/self/fd/{}", fd);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf));
  if (n <= 0 || static_cast<std::size_t>(n) >= sizeof(buf)) return fmt::format("the rank directory on root #{}", root);
  return std::string(buf, static_cast<std::size_t>(n));
}

Status check_open_arguments(const Roots& roots, std::span<const int> rank_dirs, uint32_t chunk_bytes) {
  if (roots.size() == 0) return make_error(EINVAL, "no storage root configured");
  if (rank_dirs.size() != roots.size())
    return make_error(EINVAL, fmt::format("{} rank directories for {} roots", rank_dirs.size(), roots.size()));
  if (chunk_bytes == 0 || chunk_bytes % kIoAlignment != 0)
    return make_error(EINVAL, fmt::format("chunk size {} is not a non-zero multiple of {}", chunk_bytes, kIoAlignment));
  return {};
}

// Opens the objects file `name` in `dir`, made when missing (`created` says so), without following a
// link; then asks for O_DIRECT, which the filesystem may refuse (`direct_io` says whether it took it).
Result<UniqueFd> open_objects_file(int dir, const std::string& name, const std::string& path, bool& created,
                                   bool& direct_io) {
  constexpr int kFlags = O_RDWR | O_NOFOLLOW | O_CLOEXEC;
  UniqueFd fd(::openat(dir, name.c_str(), kFlags));
  created = !fd && errno == ENOENT;
  if (created) fd.reset(::openat(dir, name.c_str(), kFlags | O_CREAT | O_EXCL, kFileMode));
  if (!fd) {
    if (errno == ELOOP)
      return make_error(ELOOP, path +
                                   " is a symbolic link; tmsdiskd never follows links inside a rank directory. "
                                   "It was not created by tmsdiskd: remove it");
    return errno_error("cannot open " + path);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_error("cannot stat " + path);
  // A hard link would have the daemon write chunks into whatever other file it names.
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
    return make_error(EINVAL, path + " is not a regular file of its own: it was not created by tmsdiskd; remove it");
  // Set on the open file rather than asked of open(2): one descriptor, whatever the answer. A
  // filesystem without O_DIRECT (tmpfs before 6.6, some FUSE and network ones) refuses with EINVAL and
  // is used buffered, as RankStore's data files are.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  direct_io = flags >= 0 && ::fcntl(fd.get(), F_SETFL, flags | O_DIRECT) == 0;
  return fd;
}

// The log's first record, which must be a header of this store's chunk size and root count: the rest
// of the log means nothing without it. Nothing is changed when it is refused.
Status check_header(LogReader& reader, const std::string& path, uint32_t chunk, std::size_t roots,
                    uint64_t* next_handle) {
  const std::optional<LogRecord> h = reader.next();
  if (!h || h->kind != LogKind::Header)
    return make_error(EUCLEAN, fmt::format("{} is damaged: it does not start with its header ({}). tmsdiskd keeps "
                                           "it and the objects files as they are; remove them to start the rank's "
                                           "objects afresh",
                                           path, h ? "another record comes first" : reader.why()));
  if (h->version != kObjectLogVersion)
    return make_error(EINVAL, fmt::format("{} has format version {}; this daemon reads version {}", path, h->version,
                                          kObjectLogVersion));
  if (h->chunk_bytes != chunk || h->roots != roots)
    return make_error(EINVAL, fmt::format("{} records chunks of {} bytes over {} roots, not {} over {}: reconnect "
                                          "with the chunk size and roots it was written with",
                                          path, h->chunk_bytes, h->roots, chunk, roots));
  *next_handle = h->next_handle;
  return {};
}

}  // namespace

Status ObjectStore::Impl::open_roots(Roots& roots_in, std::span<const int> rank_dirs) {
  roots.resize(roots_in.size());
  std::vector<std::pair<dev_t, ino_t>> dirs;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    // The store's own descriptor of the directory: one that can be flushed (an O_PATH one cannot),
    // valid for the store's life whatever the caller does with its own.
    roots[i].dir.reset(::openat(rank_dirs[i], ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!roots[i].dir) return errno_error(fmt::format("cannot open the rank directory on root {}", roots_in[i].path));
    roots[i].dir_path = path_of(roots[i].dir.get(), i);
    roots[i].in_memory = roots_in[i].in_memory;
    // Two roots in one directory would share one objects file, each allocating in it on its own.
    struct stat st {};
    if (::fstat(roots[i].dir.get(), &st) != 0) return errno_error("cannot stat " + roots[i].dir_path);
    for (std::size_t j = 0; j < i; ++j)
      if (dirs[j].first == st.st_dev && dirs[j].second == st.st_ino)
        return make_error(
            EINVAL, fmt::format("roots {} and {} were given the same rank directory {}", j, i, roots[i].dir_path));
    dirs.emplace_back(st.st_dev, st.st_ino);
  }
  return {};
}

Status ObjectStore::Impl::open_data(Roots& roots_in) {
  for (std::size_t i = 0; i < roots.size(); ++i) {
    ObjectRoot& r = roots[i];
    r.data_path = join_path(r.dir_path, files.objects);
    bool created = false;
    auto fd = open_objects_file(r.dir.get(), files.objects, r.data_path, created, r.direct_io);
    if (!fd) return std::move(fd).error();
    r.data = std::move(fd).value();
    // The log will name extents in it: its name must outlive a crash as the log's does.
    if (created && ::fsync(r.dir.get()) != 0) return errno_error("cannot flush directory " + r.dir_path);
    if (!r.direct_io) roots_in[i].direct_io = false;
  }
  return {};
}

bool ObjectStore::Impl::apply(const LogRecord& r, std::string& why) {
  switch (r.kind) {
    case LogKind::Header: why = "a second header"; return false;
    case LogKind::Created:
      if (r.handle == 0 || r.handle == UINT64_MAX || objects.count(r.handle) || !valid_object_name(r.name) ||
          names.count(r.name) || r.size == 0 || r.size > kMaxObjectSize || objects.size() >= kMaxObjects) {
        why = fmt::format("an invalid creation of object handle {}", r.handle);
        return false;
      }
      objects.emplace(r.handle, make_object(r.handle, r.name, r.size));
      chunk_total += objects.at(r.handle).chunks;
      names.emplace(r.name, r.handle);
      next_handle = std::max(next_handle, r.handle + 1);
      return true;
    case LogKind::Removed: {
      auto it = objects.find(r.handle);
      if (it == objects.end()) {
        why = fmt::format("a removal of handle {}, which names no object", r.handle);
        return false;
      }
      names.erase(it->second.name);
      chunk_total -= it->second.chunks;
      objects.erase(it);
      return true;
    }
    case LogKind::Committed: {
      auto it = objects.find(r.handle);
      const bool valid =
          it != objects.end() && std::all_of(r.chunks.begin(), r.chunks.end(), [&](const LogChunk& c) {
            return c.chunk < it->second.chunks && c.offset % kIoAlignment == 0 && c.offset <= kMaxObjectSize;
          });
      if (!valid) {
        why = fmt::format("a commit of handle {} naming no object or chunk of it", r.handle);
        return false;
      }
      Object& o = it->second;
      for (const LogChunk& c : r.chunks) {
        o.committed_chunks += o.committed[c.chunk].offset == kNoExtent;
        o.committed[c.chunk] = {.offset = c.offset, .seal = c.seal};
      }
      return true;
    }
  }
  return false;
}

Status ObjectStore::Impl::replay(std::string_view bytes, bool& repair) {
  LogReader reader(bytes);
  if (auto st = check_header(reader, log.path(), chunk, roots.size(), &next_handle); !st) return st;
  uint64_t stop = bytes.size();
  std::string why;
  while (std::optional<LogRecord> r = reader.next()) {
    if (!apply(*r, why)) {
      stop = r->begin;
      break;
    }
  }
  if (why.empty() && !reader.why().empty()) {
    stop = reader.offset();
    why = reader.why();
  }
  if (stop < bytes.size()) {
    // Each record is acknowledged only once it is flushed whole, and the records after a bad one
    // cannot be told apart from garbage: the log is kept up to it.
    say(fmt::format("{}: {} bytes from offset {} dropped ({}): never acknowledged; everything before them is kept",
                    log.path(), bytes.size() - stop, stop, why));
    repair = true;
  }
  return {};
}

Status ObjectStore::Impl::rebuild_allocators(bool& repair) {
  for (auto& r : roots) {
    struct stat st {};
    if (::fstat(r.data.get(), &st) != 0) return errno_error("cannot stat " + r.data_path);
    r.alloc =
        ExtentAllocator::with_free_file(kIoAlignment, round_up_to(static_cast<uint64_t>(st.st_size), kIoAlignment));
  }
  std::vector<uint64_t> dropped(roots.size());
  for (auto& [handle, o] : objects) {
    for (uint64_t ci = 0; ci < o.chunks; ++ci) {
      if (o.committed[ci].offset == kNoExtent) continue;
      const Extent e = extent_of(o, ci, o.committed[ci].offset);
      if (roots[e.root].alloc.claim(e.offset, e.length)) continue;
      // Past the file's end (truncated outside tmsdiskd) or on another chunk's extent: nothing there
      // can be this version's bytes.
      o.committed[ci] = {};
      --o.committed_chunks;
      ++dropped[e.root];
    }
  }
  for (std::size_t i = 0; i < roots.size(); ++i) {
    if (dropped[i] == 0) continue;
    say(
        fmt::format("{}: {} committed chunks lie past its end or on another chunk's place: they are lost (a read "
                    "of them is ENODATA)",
                    roots[i].data_path, dropped[i]));
    repair = true;
  }
  return {};
}

Result<std::unique_ptr<ObjectStore>> ObjectStore::open(Roots& roots, std::span<const int> rank_dirs,
                                                       const RankFileNames& names, uint32_t chunk_bytes,
                                                       const std::function<void(const std::string&)>& warn) {
  try {
    if (auto st = check_open_arguments(roots, rank_dirs, chunk_bytes); !st) return std::move(st).error();
    auto impl = std::make_unique<Impl>();
    impl->chunk = chunk_bytes;
    impl->warn = warn;
    impl->files = names;
    if (auto st = impl->open_roots(roots, rank_dirs); !st) return std::move(st).error();
    const ObjectRoot& first = impl->roots[0];
    auto log = ObjectLog::open(first.dir.get(), first.dir_path, names);
    if (!log && log.error().errnum() != ENOENT) return std::move(log).error();
    if (!log) {
      // A new store. The log comes last and whole (written beside, renamed into place): without it,
      // nothing in the objects files was ever committed, and their space is free.
      if (auto st = impl->open_data(roots); !st) return std::move(st).error();
      auto created = ObjectLog::create(first.dir.get(), first.dir_path, names, impl->snapshot());
      if (!created) return std::move(created).error();
      impl->log = std::move(created).value();
      return std::unique_ptr<ObjectStore>(new ObjectStore(std::move(impl)));
    }
    impl->log = std::move(log).value();
    auto bytes = impl->log.read_all();
    if (!bytes) return std::move(bytes).error();
    // The header is checked before any file is opened for writing: a log of another store is refused
    // with every file as it is.
    LogReader header(*bytes);
    uint64_t ignored = 0;
    if (auto st = check_header(header, impl->log.path(), chunk_bytes, roots.size(), &ignored); !st)
      return std::move(st).error();
    if (auto st = impl->open_data(roots); !st) return std::move(st).error();
    bool repair = false;
    if (auto st = impl->replay(*bytes, repair); !st) return std::move(st).error();
    if (auto st = impl->rebuild_allocators(repair); !st) return std::move(st).error();
    // What was dropped goes from the log too, so that the next record follows a whole one and no
    // extent handed out anew is named twice.
    if (repair)
      if (auto st = impl->log.replace(impl->snapshot()); !st) return std::move(st).error();
    return std::unique_ptr<ObjectStore>(new ObjectStore(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening a rank's objects");
  }
}

Result<std::unique_ptr<ObjectStore>> ObjectStore::open_existing(Roots& roots, std::span<const int> rank_dirs,
                                                                const RankFileNames& names, uint32_t chunk_bytes,
                                                                const std::function<void(const std::string&)>& warn) {
  // Anything at the log's name counts (a link too: open() refuses it, saying why).
  if (rank_dirs.empty() || ::faccessat(rank_dirs[0], names.objects_log.c_str(), F_OK, AT_SYMLINK_NOFOLLOW) != 0)
    return std::unique_ptr<ObjectStore>();
  return open(roots, rank_dirs, names, chunk_bytes, warn);
}

}  // namespace tmsdisk::storage
