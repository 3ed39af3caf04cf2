// SPDX-License-Identifier: Apache-2.0
// A rank's store of named objects: byte arrays of a fixed size that the rank creates, writes and reads
// in ranges while it runs (an optimizer's state, streamed bucket by bucket through the step), apart
// from its pauses: a pause never writes, reads nor reserves any of it.
//
// Files, in the rank's directory on every root (so they go with it: removed when the rank's session
// ends, kept across a daemon restart, swept with a dead rank): `objects` holds the chunks, each in an
// extent of its own (chunk i of an object on root i % roots), and on the first root `objects.log`
// records which extent holds the current version of each chunk, with its XXH3-128 seal.
//
// A write of a range is all or nothing. Chunks written since the last commit of their range go to
// fresh extents (copy on write): the current version stays where it is, readable, until
// commit_range() has every chunk of the range written, fdatasyncs the data files, appends one record
// naming the new extents and their seals to the log and fdatasyncs it; only then do reads see the new
// version and the old extents become free. A daemon killed at any point before the record is whole
// leaves the previous version readable (open() replays the log; a torn last record is ignored).
// discard_range() (or the session ending) drops what was written of a range and not committed.
//
// A chunk that was never committed has nothing to verify against: a read of it is ENODATA (an object
// reads only what was written to it; a new optimizer state starts in device memory).
//
// Handles are recorded in the log: a restarted daemon gives every object the handle it had, and no
// handle is given twice in the life of the rank directory (a removed object's handle is never reused,
// across restarts and compactions too). The log is compacted (a snapshot of the live objects written
// beside it, flushed, renamed over it) once it grows past a few times what that snapshot takes.
//
// The server commits, discards or removes only while no chunk of the range or object is in flight: the
// extents those calls free may be handed to the next WRITE at once.
//
// Not thread-safe: the daemon's event-loop thread makes every call, as for RankStore. The chunk
// functions follow RankStore's (storage.h), so that ChunkIo drives both the same way.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checksum128.h"
#include "storage.h"
#include "tmsdisk/common/object_name.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::storage {

// Object names follow tmsdisk/common/object_name.h (valid_object_name): a rank's optimizer names its
// buckets ("g0.b3.exp_avg"); the name never reaches the filesystem.
inline constexpr std::size_t kMaxObjectName = kMaxObjectNameLength;
// The most objects one rank holds: each costs the daemon memory for its records (its name, its maps,
// its log record) whatever its size, so chunk_count() also charges each this many chunks.
inline constexpr std::size_t kMaxObjects = 65536;
inline constexpr uint64_t kObjectOverheadChunks = 16;

struct ObjectInfo {
  uint64_t handle = 0;  // what WRITE/READ/COMMIT name it by, kept across daemon restarts
  std::string name;
  uint64_t size = 0;             // bytes
  uint64_t committed_bytes = 0;  // bytes of its chunks that hold a committed version
};

class ObjectStore {
 public:
  // The store in the rank directory `rank_dirs` (one directory fd per root, in root order, O_PATH or
  // not; used during the call only: the store opens its own) of a rank whose chunks are `chunk_bytes`
  // (a non-zero multiple of kIoAlignment), its files named as `names` says. Creates `objects` on each
  // root and `objects.log` on the first if missing; with them present (a daemon restarted), replays the log: objects,
  // their handles, committed chunks, seals and extents come back; a torn or corrupt tail is dropped (it was never
  // acknowledged) and logged through `warn` (spdlog when empty), and so is a committed chunk whose
  // extent no longer fits its objects file; the log is then rewritten without them. A log of another
  // chunk size or root count is refused (EINVAL), its files left as they are; one whose header is
  // damaged too (EUCLEAN). A symbolic link (or a file with another link) in place of either file is
  // refused (ELOOP, EINVAL), never followed. The objects files are opened O_DIRECT where the
  // filesystem takes it (else roots[i].direct_io becomes false, and Location::direct_io says so).
  static Result<std::unique_ptr<ObjectStore>> open(Roots& roots, std::span<const int> rank_dirs,
                                                   const RankFileNames& names, uint32_t chunk_bytes,
                                                   const std::function<void(const std::string&)>& warn = {});
  // open() where the rank's directory holds a store already (a daemon restarted), else null: a rank
  // that never stored an object gets no object files.
  static Result<std::unique_ptr<ObjectStore>> open_existing(Roots& roots, std::span<const int> rank_dirs,
                                                            const RankFileNames& names, uint32_t chunk_bytes,
                                                            const std::function<void(const std::string&)>& warn = {});
  ~ObjectStore();
  ObjectStore(const ObjectStore&) = delete;
  ObjectStore& operator=(const ObjectStore&) = delete;

  uint32_t chunk_bytes() const noexcept;

  // The handle of object `name`, created with `size` bytes when it does not exist (recorded in the
  // log before this returns). An existing object of another size is EEXIST (remove it first);
  // a bad name EINVAL; size 0 EINVAL; a new object beyond kMaxObjects E2BIG.
  Result<uint64_t> open_object(std::string_view name, uint64_t size);
  // Removes object `name` (ENOENT if none): recorded in the log, then its extents (committed and
  // written) are freed and the objects files' free space given back (punched, the tail truncated); its
  // handle no longer valid (the server refuses while the session has chunks in flight).
  Status remove_object(std::string_view name);
  std::vector<ObjectInfo> list() const;
  std::size_t object_count() const noexcept;
  bool contains(std::string_view name) const noexcept;
  // Chunks the objects take at their size, kObjectOverheadChunks more for each object (what
  // max-chunks-per-uid counts: the store keeps 24 bytes for each; kept as a total, no walk), and bytes of the extents
  // held in the objects files now (committed versions and written, uncommitted ones, each rounded up to kIoAlignment).
  uint64_t chunk_count() const noexcept;
  uint64_t disk_bytes() const noexcept;

  // The chunk functions, as RankStore's: `handle` for the blob. Every one validates: a live handle
  // (else ENOENT, as RankStore's unknown blob), offset a multiple of chunk_bytes, offset inside the
  // object, length == min(chunk_bytes, size - offset) (else EINVAL). A Location's fd stays valid for
  // the store's life.
  //
  // A WRITE: open_write() gives the chunk a fresh extent (the one it already has when the chunk was
  // written since its range's last commit), preallocated (ENOSPC when the disk is full), and
  // locate_write() says where it is; settle_write() never finds a chunk unchanged (every write of a
  // range is a new version); end_write() seals it, in memory only (what is not committed is dropped
  // by a restart). From open_write() on the chunk counts as unwritten until its end_write(). Once the
  // range is committed or discarded, locate_write(), settle_write() and end_write() of the chunk are
  // EINVAL (no WRITE open) until the next open_write().
  Result<RankStore::WriteTicket> open_write(uint64_t handle, uint64_t offset, uint32_t length);
  Result<RankStore::Location> locate_write(uint64_t handle, uint64_t offset, uint32_t length) const;
  Result<RankStore::WritePlan> settle_write(uint64_t handle, uint64_t offset, uint32_t length,
                                            const RankStore::WriteTicket& ticket, Checksum128 sum);
  Result<Checksum128> end_write(uint64_t handle, uint64_t offset, uint32_t length, Checksum128 sum);
  // A READ: of the committed version only (ENODATA if none), wherever a WRITE of the chunk is;
  // settle_read() compares its seal: the checksum, or EBADMSG on a mismatch.
  Result<RankStore::ReadTicket> open_read(uint64_t handle, uint64_t offset, uint32_t length) const;
  Result<RankStore::Location> locate_read(uint64_t handle, uint64_t offset, uint32_t length) const;
  Result<Checksum128> settle_read(uint64_t handle, uint64_t offset, uint32_t length, Checksum128 sum);

  // Makes the chunks written of [offset, offset + length) of `handle` (offset a multiple of
  // chunk_bytes, the range inside the object and ending at a chunk's end or the object's; else
  // EINVAL, and length 0 too) its current version, as described above. EINVAL naming the first chunk
  // not written (end_write() done) since the range's last commit (nothing changes); on an I/O error
  // nothing changes either (the written chunks stay pending: commit again or discard). After an
  // error that leaves the log's end unknown (a failed flush of it), every call that writes the log
  // (open_object() of a new object, remove_object(), commit_range()) is EIO until the store is
  // opened again; reads go on.
  Status commit_range(uint64_t handle, uint64_t offset, uint64_t length);
  // commit_range() in steps, for a caller that flushes off its thread (the daemon, through its I/O
  // engine): begin_commit() checks the range as commit_range() does and names the files to flush
  // first (the data files its new versions lie in); once they are, write_commit() puts the range's
  // record at the log's end, unflushed, and names the log; end_commit() takes the log's flush result
  // (0 or -errno) and makes the range current, or leaves it as it was (a failed flush of the log
  // makes the store refuse to write the log again, as commit_range()'s does). Between write_commit()
  // and end_commit() whatever else would write the log is EBUSY; the caller keeps the range's chunks
  // as they are.
  struct FileToFlush {
    int fd = -1;
    std::string path;  // for messages
  };
  Result<std::vector<FileToFlush>> begin_commit(uint64_t handle, uint64_t offset, uint64_t length);
  Result<FileToFlush> write_commit(uint64_t handle, uint64_t offset, uint64_t length);
  Status end_commit(uint64_t handle, uint64_t offset, uint64_t length, int flush_result);
  // Drops the chunks written of the range and not committed, freeing their extents; the committed
  // version stays. The range is checked as commit_range()'s.
  Status discard_range(uint64_t handle, uint64_t offset, uint64_t length);
  // Drops every chunk written and not committed (the rank's session ended or its shim reconnected).
  void discard_all() noexcept;

  struct Impl;

 private:
  explicit ObjectStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tmsdisk::storage
