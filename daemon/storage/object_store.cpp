// SPDX-License-Identifier: Apache-2.0
// A rank's store of named objects, copy on write, its commits recorded in objects.log (object_store.h).
#include "object_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <utility>

#include "object_store_impl.h"
#include "storage_fs.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

// The log's compaction: once it is this many times what a snapshot of the live state takes, and past
// this size. An optimizer commits every bucket every step: without it, the log would grow by a record
// per bucket per step for the life of the run.
constexpr uint64_t kCompactFactor = 4;
constexpr uint64_t kCompactMinBytes = 16 * 1024;

LogRecord log_record(LogKind kind, uint64_t handle) {
  LogRecord r;
  r.kind = kind;
  r.handle = handle;
  return r;
}

LogRecord created_record(const Object& o) {
  LogRecord r = log_record(LogKind::Created, o.handle);
  r.size = o.size;
  r.name = o.name;
  return r;
}

}  // namespace

void ObjectStore::Impl::say(const std::string& what) const {
  if (warn)
    warn(what);
  else
    spdlog::warn("{}", what);
}

Result<RankStore::Location> ObjectStore::Impl::locate(uint64_t handle, uint64_t offset, uint32_t length, bool written) {
  try {
    uint64_t extent = 0;
    if (written) {
      auto pending = pending_of(handle, offset, length);
      if (!pending) return std::move(pending).error();
      extent = (*pending)->offset;
    } else {
      auto version = committed_of(handle, offset, length);
      if (!version) return std::move(version).error();
      extent = (*version)->offset;
    }
    const uint64_t ci = offset / chunk;
    const ObjectRoot& r = roots[root_of(ci)];
    return RankStore::Location{.fd = r.data.get(),
                               .direct_io = r.direct_io,
                               .in_memory = r.in_memory,
                               .file_offset = extent,
                               .io_length = io_length_of(objects.at(handle), ci)};
  } catch (const std::bad_alloc&) {
    return out_of_memory("locating an object chunk");
  }
}

std::string ObjectStore::Impl::describe(const Object& o) {
  return fmt::format("object \"{}\" (handle {})", o.name, o.handle);
}

Object ObjectStore::Impl::make_object(uint64_t handle, std::string_view name, uint64_t size) const {
  Object o;
  o.handle = handle;
  o.name = name;
  o.size = size;
  o.chunks = (size - 1) / chunk + 1;
  o.committed.resize(o.chunks);
  return o;
}

Result<Object*> ObjectStore::Impl::find(uint64_t handle) {
  auto it = objects.find(handle);
  if (it == objects.end()) return make_error(ENOENT, fmt::format("no object has handle {}", handle));
  return &it->second;
}

Result<Object*> ObjectStore::Impl::find_chunk(uint64_t handle, uint64_t offset, uint32_t length, uint64_t* ci) {
  auto found = find(handle);
  if (!found) return found;
  const Object& o = **found;
  if (offset % chunk != 0)
    return make_error(
        EINVAL, fmt::format("offset {} of {} is not a multiple of the chunk size {}", offset, describe(o), chunk));
  if (offset >= o.size)
    return make_error(EINVAL, fmt::format("offset {} is past the end of {} ({} bytes)", offset, describe(o), o.size));
  *ci = offset / chunk;
  if (length != length_of(o, *ci))
    return make_error(EINVAL, fmt::format("chunk at offset {} of {} is {} bytes, not {}", offset, describe(o),
                                          length_of(o, *ci), length));
  return found;
}

Result<Object*> ObjectStore::Impl::find_range(uint64_t handle, uint64_t offset, uint64_t length, uint64_t* first,
                                              uint64_t* end) {
  auto found = find(handle);
  if (!found) return found;
  const Object& o = **found;
  if (length == 0 || offset % chunk != 0 || offset >= o.size || length > o.size - offset ||
      ((offset + length) % chunk != 0 && offset + length != o.size))
    return make_error(EINVAL, fmt::format("[{}, +{}) is not a range of whole chunks of {} ({} bytes, chunks of {})",
                                          offset, length, describe(o), o.size, chunk));
  *first = offset / chunk;
  *end = (offset + length - 1) / chunk + 1;
  return found;
}

Result<PendingVersion*> ObjectStore::Impl::pending_of(uint64_t handle, uint64_t offset, uint32_t length) {
  uint64_t ci = 0;
  auto found = find_chunk(handle, offset, length, &ci);
  if (!found) return std::move(found).error();
  auto it = (*found)->pending.find(ci);
  if (it == (*found)->pending.end())
    return make_error(EINVAL, fmt::format("no WRITE is open for the chunk at offset {} of {} (its range was "
                                          "committed or discarded since)",
                                          offset, describe(**found)));
  return &it->second;
}

Result<const ObjectVersion*> ObjectStore::Impl::committed_of(uint64_t handle, uint64_t offset, uint32_t length) {
  uint64_t ci = 0;
  auto found = find_chunk(handle, offset, length, &ci);
  if (!found) return std::move(found).error();
  const ObjectVersion& v = (*found)->committed[ci];
  if (v.offset == kNoExtent)
    return make_error(ENODATA, fmt::format("chunk at offset {} of {} was never committed: there is nothing to read",
                                           offset, describe(**found)));
  return &v;
}

Result<uint64_t> ObjectStore::Impl::new_extent(std::size_t root, uint32_t io_length) {
  ObjectRoot& r = roots[root];
  const std::optional<uint64_t> offset = r.alloc.allocate(io_length);
  if (!offset) return make_error(EFBIG, fmt::format("{} cannot grow further", r.data_path));
  // Preallocated now, so that a full disk is a refused WRITE rather than a failed I/O later.
  int err = 0;
  while (::fallocate(r.data.get(), 0, static_cast<off_t>(*offset), io_length) != 0) {
    if (errno == EINTR) continue;
    if (errno != EOPNOTSUPP) err = errno;
    break;
  }
  if (err != 0) {
    r.alloc.release(*offset, io_length);
    r.alloc.trim_tail();
    return make_error(err, fmt::format("cannot allocate {} bytes in {}", io_length, r.data_path));
  }
  return *offset;
}

void ObjectStore::Impl::free_extents(std::span<const Extent> extents) {
  // Only extents this store handed out come back: a refusal is a bug, never a reason to stop.
  for (const Extent& e : extents)
    if (!roots[e.root].alloc.release(e.offset, e.length))
      say(fmt::format("internal: extent [{}, +{}) of {} was not in use", e.offset, e.length, roots[e.root].data_path));
}

void ObjectStore::Impl::drop_pending(Object& o, std::map<uint64_t, PendingVersion>::iterator it) {
  const Extent e = extent_of(o, it->first, it->second.offset);
  o.pending.erase(it);
  free_extents({&e, 1});
}

// What the files hold beyond their last extent, and their free extents, go back to the filesystem:
// after a removal, much of what was in use may never be asked for again. Best effort.
void ObjectStore::Impl::give_back_space() {
  for (auto& r : roots) {
    r.alloc.trim_tail();
    struct stat st {};
    if (::fstat(r.data.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) > r.alloc.end() &&
        ::ftruncate(r.data.get(), static_cast<off_t>(r.alloc.end())) != 0)
      say(fmt::format("cannot truncate {}: {}", r.data_path, std::strerror(errno)));
    for (const auto& [offset, length] : r.alloc.free_extents()) {
      if (::fallocate(r.data.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                      static_cast<off_t>(length)) != 0 &&
          errno != EOPNOTSUPP) {
        say(fmt::format("cannot give back free space in {}: {}", r.data_path, std::strerror(errno)));
        break;
      }
    }
  }
}

Status ObjectStore::Impl::append(const LogRecord& r) {
  std::string bytes;
  encode_log_record(bytes, r);
  return log.append(bytes);
}

uint64_t ObjectStore::Impl::live_log_bytes() const {
  uint64_t total = kLogHeaderBytes;
  for (const auto& [handle, o] : objects) {
    total += log_created_bytes(o.name.size());
    if (o.committed_chunks > 0) total += log_committed_bytes(o.committed_chunks);
  }
  return total;
}

// The log that says what this store holds now, and nothing of how it came to: the header, then each
// object's creation and one record of its committed chunks.
std::string ObjectStore::Impl::snapshot() const {
  std::string out;
  out.reserve(live_log_bytes());
  LogRecord header = log_record(LogKind::Header, 0);
  header.chunk_bytes = chunk;
  header.roots = static_cast<uint32_t>(roots.size());
  header.next_handle = next_handle;
  encode_log_record(out, header);
  for (const auto& [handle, o] : objects) {
    encode_log_record(out, created_record(o));
    if (o.committed_chunks == 0) continue;
    LogRecord c = log_record(LogKind::Committed, handle);
    c.chunks.reserve(o.committed_chunks);
    for (uint64_t ci = 0; ci < o.chunks; ++ci)
      if (o.committed[ci].offset != kNoExtent) c.chunks.push_back({ci, o.committed[ci].offset, o.committed[ci].seal});
    encode_log_record(out, c);
  }
  return out;
}

void ObjectStore::Impl::maybe_compact() {
  if (!log.problem().empty() || log.flushing() || log.size() <= kCompactMinBytes) return;
  try {
    if (log.size() <= kCompactFactor * live_log_bytes()) return;
    // A failure costs only room: the log as it was stays whole and in use, unless the rename was done
    // and not flushed (the log says so through problem()).
    if (auto st = log.replace(snapshot()); !st) say("cannot compact " + log.path() + ": " + st.error().describe());
  } catch (const std::bad_alloc&) {
    say("out of memory while compacting " + log.path() + ": it stays as it is");
  }
}

ObjectStore::ObjectStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ObjectStore::~ObjectStore() = default;

uint32_t ObjectStore::chunk_bytes() const noexcept {
  return impl_->chunk;
}

Result<uint64_t> ObjectStore::open_object(std::string_view name, uint64_t size) {
  try {
    if (!valid_object_name(name))
      return make_error(EINVAL, fmt::format("object name \"{}\" is not 1 to {} characters of A-Z a-z 0-9 _ . - (nor "
                                            "\".\" or \"..\")",
                                            name.substr(0, kMaxObjectName + 1), kMaxObjectName));
    if (size == 0 || size > kMaxObjectSize)
      return make_error(
          EINVAL, fmt::format("object \"{}\" of {} bytes: an object holds 1 to {} bytes", name, size, kMaxObjectSize));
    if (auto it = impl_->names.find(name); it != impl_->names.end()) {
      const Object& o = impl_->objects.at(it->second);
      if (o.size == size) return o.handle;
      return make_error(
          EEXIST, fmt::format("{} exists with {} bytes, not {}: remove it first", Impl::describe(o), o.size, size));
    }
    // Each object costs the daemon memory for its records whatever its size: a rank holds a bounded
    // number of them.
    if (impl_->objects.size() >= kMaxObjects)
      return make_error(E2BIG, fmt::format("the rank holds {} objects already, the most a rank may: remove some, or "
                                           "store fewer, larger ones",
                                           kMaxObjects));
    // Made whole before the record: once the log names the object, only inserting it is left.
    Object o = impl_->make_object(impl_->next_handle, name, size);
    std::string key(name);
    if (auto st = impl_->append(created_record(o)); !st) return std::move(st).error();
    const uint64_t handle = o.handle;
    impl_->next_handle = handle + 1;
    impl_->chunk_total += o.chunks;
    impl_->objects.emplace(handle, std::move(o));
    impl_->names.emplace(std::move(key), handle);
    impl_->maybe_compact();
    return handle;
  } catch (const std::bad_alloc&) {
    return out_of_memory("creating an object");
  }
}

Status ObjectStore::remove_object(std::string_view name) {
  try {
    auto it = impl_->names.find(name);
    if (it == impl_->names.end()) return make_error(ENOENT, fmt::format("no object is named \"{}\"", name));
    Object& o = impl_->objects.at(it->second);
    // Listed before the record, so that once it is written nothing is left that could fail.
    std::vector<Extent> extents;
    extents.reserve(o.pending.size() + o.committed_chunks);
    for (const auto& [ci, p] : o.pending) extents.push_back(impl_->extent_of(o, ci, p.offset));
    for (uint64_t ci = 0; ci < o.chunks; ++ci)
      if (o.committed[ci].offset != kNoExtent) extents.push_back(impl_->extent_of(o, ci, o.committed[ci].offset));
    if (auto st = impl_->append(log_record(LogKind::Removed, o.handle)); !st) return st;
    // Recorded: from here on, nothing of it is read again, and its extents may be handed out anew.
    impl_->chunk_total -= o.chunks;
    impl_->objects.erase(it->second);
    impl_->names.erase(it);
    impl_->free_extents(extents);
    impl_->give_back_space();
    impl_->maybe_compact();
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("removing an object");
  }
}

std::vector<ObjectInfo> ObjectStore::list() const {
  std::vector<ObjectInfo> out;
  try {
    out.reserve(impl_->objects.size());
    for (const auto& [handle, o] : impl_->objects) {
      // Every committed chunk is whole but perhaps the last, which may be shorter.
      uint64_t bytes = o.committed_chunks * impl_->chunk;
      if (o.committed.back().offset != kNoExtent) bytes -= impl_->chunk - impl_->length_of(o, o.chunks - 1);
      out.push_back({.handle = handle, .name = o.name, .size = o.size, .committed_bytes = bytes});
    }
  } catch (const std::bad_alloc&) {
    out.clear();
  }
  return out;
}

std::size_t ObjectStore::object_count() const noexcept {
  return impl_->objects.size();
}

uint64_t ObjectStore::chunk_count() const noexcept {
  return impl_->chunk_total + impl_->objects.size() * kObjectOverheadChunks;
}

bool ObjectStore::contains(std::string_view name) const noexcept {
  return impl_->names.find(name) != impl_->names.end();
}

uint64_t ObjectStore::disk_bytes() const noexcept {
  uint64_t total = 0;
  for (const auto& r : impl_->roots) total += r.alloc.used_bytes();
  return total;
}

Result<RankStore::WriteTicket> ObjectStore::open_write(uint64_t handle, uint64_t offset, uint32_t length) {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk(handle, offset, length, &ci);
    if (!found) return std::move(found).error();
    Object& o = **found;
    auto it = o.pending.find(ci);
    // Two WRITEs of one chunk in flight at once (a retry while a timed-out one still runs) would share
    // an extent, and the seal of whichever ended last could vouch for the other's bytes.
    if (it != o.pending.end() && !it->second.sealed && it->second.opened > 0)
      return make_error(EBUSY, fmt::format("{}: a WRITE of the chunk at offset {} is still in flight; drop the "
                                           "range (STORE_COMMIT with discard) once it ended, and write it again",
                                           Impl::describe(o), offset));
    if (it == o.pending.end()) {
      // Copy on write: the committed version stays where it is, readable, until a commit.
      auto extent = impl_->new_extent(impl_->root_of(ci), impl_->io_length_of(o, ci));
      if (!extent) return std::move(extent).error();
      it = o.pending.emplace(ci, PendingVersion{.offset = *extent, .sum = {}, .opened = 0, .sealed = false}).first;
    }
    // Whatever was sealed there is being overwritten: the range commits only once this WRITE ends.
    it->second.sealed = false;
    return RankStore::WriteTicket{.held_sum = {}, .held = false, .xxh64 = false, .opened = ++it->second.opened};
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening an object chunk's write");
  }
}

Result<RankStore::Location> ObjectStore::locate_write(uint64_t handle, uint64_t offset, uint32_t length) const {
  return impl_->locate(handle, offset, length, true);
}

Result<RankStore::WritePlan> ObjectStore::settle_write(uint64_t handle, uint64_t offset, uint32_t length,
                                                       const RankStore::WriteTicket& ticket, Checksum128 sum) {
  (void)ticket;  // every WRITE of an object is a new version: nothing is skipped, so nothing to compare
  try {
    if (auto pending = impl_->pending_of(handle, offset, length); !pending) return std::move(pending).error();
    return RankStore::WritePlan{.sum = sum, .unchanged = false};
  } catch (const std::bad_alloc&) {
    return out_of_memory("settling an object chunk's write");
  }
}

Result<Checksum128> ObjectStore::end_write(uint64_t handle, uint64_t offset, uint32_t length, Checksum128 sum) {
  try {
    auto pending = impl_->pending_of(handle, offset, length);
    if (!pending) return std::move(pending).error();
    (*pending)->sum = sum;
    (*pending)->sealed = true;
    return sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("sealing an object chunk");
  }
}

Result<RankStore::ReadTicket> ObjectStore::open_read(uint64_t handle, uint64_t offset, uint32_t length) const {
  try {
    if (auto version = impl_->committed_of(handle, offset, length); !version) return std::move(version).error();
    return RankStore::ReadTicket{};
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening an object chunk's read");
  }
}

Result<RankStore::Location> ObjectStore::locate_read(uint64_t handle, uint64_t offset, uint32_t length) const {
  return impl_->locate(handle, offset, length, false);
}

Result<Checksum128> ObjectStore::settle_read(uint64_t handle, uint64_t offset, uint32_t length, Checksum128 sum) {
  try {
    auto version = impl_->committed_of(handle, offset, length);
    if (!version) return std::move(version).error();
    if (sum != (*version)->seal)
      return make_error(EBADMSG, fmt::format("checksum mismatch in {} at offset {}: the bytes read are not what was "
                                             "sealed (the objects file is damaged, or the staging slot was written "
                                             "before the answer)",
                                             Impl::describe(impl_->objects.at(handle)), offset));
    return sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("verifying an object chunk");
  }
}

// The record that makes [offset, offset + length) of `handle` current, and the roots its new versions
// lie on; EINVAL naming the first chunk of the range not written since its last commit.
Result<detail::LogRecord> ObjectStore::Impl::commit_record(uint64_t handle, uint64_t offset, uint64_t length,
                                                           std::vector<bool>* touched) {
  uint64_t first = 0, end = 0;
  auto found = find_range(handle, offset, length, &first, &end);
  if (!found) return std::move(found).error();
  Object& o = **found;
  LogRecord record = log_record(LogKind::Committed, handle);
  record.chunks.reserve(end - first);
  touched->assign(roots.size(), false);
  for (uint64_t ci = first; ci < end; ++ci) {
    auto it = o.pending.find(ci);
    if (it == o.pending.end() || !it->second.sealed)
      return make_error(EINVAL, fmt::format("cannot commit [{}, +{}) of {}: the chunk at offset {} {}", offset, length,
                                            describe(o), ci * chunk,
                                            it == o.pending.end() ? "was not written since the range's last commit"
                                                                  : "is still being written"));
    record.chunks.push_back({ci, it->second.offset, it->second.sum});
    (*touched)[root_of(ci)] = true;
  }
  return record;
}

Status ObjectStore::commit_range(uint64_t handle, uint64_t offset, uint64_t length) {
  auto files = begin_commit(handle, offset, length);
  if (!files) return std::move(files).error();
  for (const FileToFlush& f : *files)
    if (::fdatasync(f.fd) != 0) return errno_error("cannot flush " + f.path);
  auto log = write_commit(handle, offset, length);
  if (!log) return std::move(log).error();
  return end_commit(handle, offset, length, ::fdatasync(log->fd) == 0 ? 0 : -errno);
}

Result<std::vector<ObjectStore::FileToFlush>> ObjectStore::begin_commit(uint64_t handle, uint64_t offset,
                                                                        uint64_t length) {
  try {
    std::vector<bool> touched;
    auto record = impl_->commit_record(handle, offset, length, &touched);
    if (!record) return std::move(record).error();
    // The new versions' bytes are on disk before the record that makes them current.
    std::vector<FileToFlush> files;
    for (std::size_t r = 0; r < impl_->roots.size(); ++r)
      if (touched[r]) files.push_back({impl_->roots[r].data.get(), impl_->roots[r].data_path});
    return files;
  } catch (const std::bad_alloc&) {
    return out_of_memory("committing an object range");
  }
}

Result<ObjectStore::FileToFlush> ObjectStore::write_commit(uint64_t handle, uint64_t offset, uint64_t length) {
  try {
    std::vector<bool> touched;
    auto record = impl_->commit_record(handle, offset, length, &touched);
    if (!record) return std::move(record).error();
    std::string bytes;
    encode_log_record(bytes, *record);
    if (Status st = impl_->log.write(bytes); !st) return std::move(st).error();
    return FileToFlush{impl_->log.fd(), impl_->log.path()};
  } catch (const std::bad_alloc&) {
    return out_of_memory("committing an object range");
  }
}

Status ObjectStore::end_commit(uint64_t handle, uint64_t offset, uint64_t length, int flush_result) {
  // The range cannot have changed since write_commit(): the server commits only while none of its
  // chunks is in flight, and nothing else writes the log meanwhile (ObjectLog::write refuses).
  if (Status st = impl_->log.flushed(flush_result); !st) return st;
  try {
    uint64_t first = 0, end = 0;
    auto found = impl_->find_range(handle, offset, length, &first, &end);
    if (!found) return std::move(found).error();
    Object& o = **found;
    std::vector<Extent> replaced;
    replaced.reserve(end - first);
    // Recorded: the new versions are current, and the old ones free once nothing names them.
    for (uint64_t ci = first; ci < end; ++ci) {
      auto it = o.pending.find(ci);
      if (it == o.pending.end()) continue;  // not reachable: commit_record() found every one
      ObjectVersion& current = o.committed[ci];
      if (current.offset != kNoExtent)
        replaced.push_back(impl_->extent_of(o, ci, current.offset));
      else
        ++o.committed_chunks;
      current = {.offset = it->second.offset, .seal = it->second.sum};
      o.pending.erase(it);
    }
    impl_->free_extents(replaced);
    impl_->maybe_compact();
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("committing an object range");
  }
}

Status ObjectStore::discard_range(uint64_t handle, uint64_t offset, uint64_t length) {
  try {
    uint64_t first = 0, end = 0;
    auto found = impl_->find_range(handle, offset, length, &first, &end);
    if (!found) return std::move(found).error();
    Object& o = **found;
    for (auto it = o.pending.lower_bound(first); it != o.pending.end() && it->first < end;)
      impl_->drop_pending(o, it++);
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("discarding an object range");
  }
}

void ObjectStore::discard_all() noexcept {
  try {
    for (auto& [handle, o] : impl_->objects)
      while (!o.pending.empty()) impl_->drop_pending(o, o.pending.begin());
  } catch (const std::bad_alloc&) {
    // The free list could not take an extent back: it stays in use until the store is opened again
    // (a replay claims only what the log names).
    impl_->say("out of memory while discarding uncommitted object chunks: their space is kept");
  }
}

}  // namespace tmsdisk::storage
