// SPDX-License-Identifier: Apache-2.0
// Storage internals: the object store's log, `objects.log` (object_store.h): its records and the file
// they are appended to. Not part of object_store.h's interface.
//
// The log is a run of records, each checking itself; all integers little-endian:
//   u32 body length   body   u64 XXH3-64 of the length's 4 bytes and the body
// The body starts with its kind (u8):
//   1 header     u64 magic "TMSDOBJL"  u32 format version (1)  u32 chunk bytes  u32 root count
//                u64 next handle (no object of the log has a handle at or above it)
//   2 created    u64 handle  u64 size  u8 name length  name
//   3 removed    u64 handle
//   4 committed  u64 handle  u64 count  count x (u64 chunk index, u64 file offset, u64 seal low, u64 seal high)
// The header is the first record and only there. A committed record names the new current version
// of each chunk it lists: the chunk's extent (on root chunk index % roots, its length the chunk's
// rounded up to kIoAlignment) and its XXH3-128. A record that fails its check, and everything after
// it, was never acknowledged (a record is acknowledged once it is flushed whole): a reader stops
// there.
//
// The file is only ever appended to, and flushed after each append; it is replaced whole (a
// snapshot of the live state written beside it, flushed, renamed over it, the directory flushed) when
// it is created and when it is compacted, so a crash leaves the old log or the new one.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checksum128.h"
#include "storage_fs.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage::detail {

inline constexpr uint64_t kObjectLogMagic = 0x4c4a424f44534d54ull;  // "TMSDOBJL" as little-endian bytes
inline constexpr uint32_t kObjectLogVersion = 1;
// The log is read whole at start-up; compaction keeps it within a few times the live state, far
// below this unless a rank stores millions of chunks.
inline constexpr uint64_t kMaxObjectLogBytes = uint64_t{1} << 30;

enum class LogKind : uint8_t { Header = 1, Created = 2, Removed = 3, Committed = 4 };

// One chunk of a committed record: where its new version lies and its seal.
struct LogChunk {
  uint64_t chunk = 0;
  uint64_t offset = 0;
  Checksum128 seal;
};

struct LogRecord {
  LogKind kind = LogKind::Header;
  uint64_t begin = 0;  // where the record starts in the log (set by LogReader)
  // Header.
  uint32_t version = kObjectLogVersion;
  uint32_t chunk_bytes = 0;
  uint32_t roots = 0;
  uint64_t next_handle = 1;
  // Created, removed, committed.
  uint64_t handle = 0;
  uint64_t size = 0;             // created
  std::string name;              // created
  std::vector<LogChunk> chunks;  // committed
};

// What each kind of record takes in the log, for the size of a snapshot without writing one.
inline constexpr uint64_t kLogFrameBytes = 4 + 8;
inline constexpr uint64_t kLogHeaderBytes = kLogFrameBytes + 1 + 8 + 4 + 4 + 4 + 8;
inline constexpr uint64_t log_created_bytes(std::size_t name_length) {
  return kLogFrameBytes + 1 + 8 + 8 + 1 + name_length;
}
inline constexpr uint64_t log_committed_bytes(uint64_t chunks) {
  return kLogFrameBytes + 1 + 8 + 8 + 32 * chunks;
}

// Appends `r` to `out`, framed (its `begin` is ignored). A name longer than 255 bytes is cut: callers
// check names first (valid_object_name()). May throw std::bad_alloc.
void encode_log_record(std::string& out, const LogRecord& r);

// Reads records one by one from a log's bytes.
class LogReader {
 public:
  explicit LogReader(std::string_view bytes) : bytes_(bytes) {}
  // The next record, or nullopt: at the end of the bytes (why() empty), or at a record that is torn or
  // fails its check (why() says how; offset() is where it starts). May throw std::bad_alloc.
  std::optional<LogRecord> next();
  uint64_t offset() const noexcept { return pos_; }
  const std::string& why() const noexcept { return why_; }

 private:
  std::optional<LogRecord> fail(std::string why);
  std::string_view bytes_;
  std::size_t pos_ = 0;
  std::string why_;
};

// The log file: appended to and flushed, or replaced whole.
class ObjectLog {
 public:
  ObjectLog() = default;
  // Opens the log in `dir` (a directory descriptor that can be flushed, not O_PATH) without following
  // a link, under the name `names` gives it; `dir_path` names the directory in messages. ENOENT when there is none;
  // anything but a regular file with one link is refused (a hard link would make a compaction's rename leave the old
  // file's other name behind, and a symlink could make the daemon write elsewhere).
  static Result<ObjectLog> open(int dir, const std::string& dir_path, const RankFileNames& names);
  // Writes `content` as the whole log, created or replacing the one there: a temporary file beside it,
  // flushed, renamed over it, the directory flushed. This log then appends to the new file.
  static Result<ObjectLog> create(int dir, const std::string& dir_path, const RankFileNames& names,
                                  std::string_view content);
  Status replace(std::string_view content);

  // The whole file, at most kMaxObjectLogBytes.
  Result<std::string> read_all() const;
  // Appends `records` and flushes them. On failure the log is cut back to where it ended, so that the
  // next append never follows a torn record; when even that fails, problem() is set and every later
  // append refused: where the log ends, and whether the record is in it, is no longer known.
  Status append(std::string_view records);
  // append() in two steps, for a caller that flushes off its thread: write() puts `records` at the
  // log's end, unflushed (at most one such write at a time; fd() is what to flush), and flushed()
  // takes the flush's result (0 or -errno): the records are part of the log, or cut off as append()
  // cuts them.
  Status write(std::string_view records);
  Status flushed(int result);
  int fd() const noexcept { return fd_.get(); }
  bool flushing() const noexcept { return unflushed_ != 0; }

  uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& problem() const noexcept { return problem_; }

 private:
  // A record that is not acknowledged (`st`, returned) is cut off the log's end.
  Status cut(Status st);

  int dir_ = -1;  // borrowed from the store, which outlives its log
  std::string dir_path_;
  std::string name_;      // the log's file name in dir_
  std::string tmp_name_;  // its temporary's, while replaced
  std::string path_;
  UniqueFd fd_;
  uint64_t size_ = 0;
  uint64_t unflushed_ = 0;  // bytes write() put after size_, waiting for flushed()
  std::string problem_;
};

}  // namespace tmsdisk::storage::detail
