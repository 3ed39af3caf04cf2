// SPDX-License-Identifier: Apache-2.0
// Storage roots, per-rank directories, blob extents and manifests: everything tmsdiskd keeps on disk.
//
// Layout: <root>/<uid>/<job>/rank<R>-<pid>/ on every root (mode 0700; the uid and job directories
// are 0711, owned by the daemon), each holding `owner` (pid, start time, token, uid, job, rank),
// `data` (preallocated, overwritten in place every pause) and, on the first root only, `manifest` and
// `sums` (the checksum journal of a pause in progress, checksum_journal.h).
// R is the declared rank, or the pid when the rank declared none (rank < 0), so an undeclared rank
// of pid 4242 lives in rank4242-4242/. A blob is striped over the roots chunk by chunk: chunk i of a blob lives on
// root (i % roots) in one contiguous extent of that root's data file.
//
// Every path is built with openat/mkdirat relative to a root's directory fd with O_NOFOLLOW: a
// client-supplied name never reaches the filesystem unchecked, and a symlink planted inside a root
// is refused, never followed.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checksum128.h"
#include "rank_identity.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage {

// O_DIRECT needs offsets, lengths and buffers aligned to this (the largest logical block size we
// expect; 4 KiB covers NVMe and ext4/xfs).
inline constexpr uint32_t kIoAlignment = 4096;

// Job names are checked by proto::valid_job_name (one path component: never "." or ".."); every
// other component is built here from numbers.

// The store's own words for what a reservation and a commit are given; the server turns the wire's
// (proto::BlobSize, proto::ChunkRun, proto::CommitState) into these.

// One allocation of the set: its id and size in bytes.
struct BlobSize {
  uint64_t id = 0;
  uint64_t size = 0;
};

// Chunks [first_chunk, first_chunk + count) of `blob` (chunk i covers bytes [i*chunk, (i+1)*chunk)).
struct ChunkRun {
  uint64_t blob = 0;
  uint64_t first_chunk = 0;
  uint64_t count = 0;
};

// What a commit closes: a pause (the files hold the rank's memory) or a resume. The values are the
// wire's (proto::CommitState), so that any other is refused by commit() as unknown.
enum class CommitState : uint8_t { Paused = 1, Resumed = 2 };

struct Root {
  std::string path;        // as configured, made absolute and lexically normalised
  UniqueFd dir;            // O_PATH|O_DIRECTORY handle every operation is relative to
  bool direct_io = true;   // false when the filesystem refused O_DIRECT (buffered fallback, logged)
  bool in_memory = false;  // tmpfs or ramfs (--allow-tmpfs): every read and write is a memory copy
  dev_t dev = 0;           // filesystem of the root: equal values mean no striping benefit
};

class Roots {
 public:
  // Opens every root. A tmpfs/ramfs root is refused with a message saying why unless allow_tmpfs;
  // a missing, non-directory or symlinked root is refused, and so is the same directory listed
  // twice (both would share one data file). direct_io is probed with an O_TMPFILE where the
  // filesystem supports that, else decided when a rank's data file is opened. Roots on the same filesystem are allowed
  // but logged by the caller (no striping benefit).
  static Result<Roots> open(const std::vector<std::string>& paths, bool allow_tmpfs);
  // The one directory a rank chose for its files and handed over by descriptor (TMS_DISK_BACKUP_DIR
  // outside the roots; `named` is what it called it, for messages only: nothing is opened by a path a
  // client sent). Refused unless it is a directory owned by `uid` (the rank's user; root may name any),
  // not writable by group or others, on no filesystem that can hold up the daemon (FUSE, network
  // filesystems), and, as a root, not in memory unless allow_tmpfs. A rank store
  // made on it keeps the rank's files directly in it, beside anything else (rank_chosen()).
  static Result<Roots> open_rank_directory(UniqueFd dir, uid_t uid, const std::string& named, bool allow_tmpfs);
  bool rank_chosen() const noexcept { return rank_chosen_; }
  // Whether directory `dir` is one of these roots (same device and inode).
  bool holds(int dir) const;

  std::size_t size() const noexcept { return roots_.size(); }
  const Root& operator[](std::size_t i) const { return roots_[i]; }
  Root& operator[](std::size_t i) { return roots_[i]; }

  // Index of the root a client's TMS_DISK_BACKUP_DIR lies under (lexically, after normalising "."
  // and "//"; any ".." is refused), or an error saying which roots are allowed.
  Result<std::size_t> root_for(std::string_view client_path) const;

  // Free bytes on root i (statvfs f_bavail * f_frsize).
  Result<uint64_t> free_bytes(std::size_t i) const;

 private:
  std::vector<Root> roots_;
  bool rank_chosen_ = false;
};

// One rank's files on all roots: directories, data files, blob extents, checksums, manifest.
// Not thread-safe: the daemon's one event-loop thread makes every call (I/O completions are reaped
// on that thread too).
//
// The store owns every chunk's checksum, an XXH3-128 ("seal on write, verify on read"): end_write()
// records it when the chunk has been written, in memory and in the checksum journal beside the
// manifest, so a daemon restarted mid-pause still knows it; settle_read() checks a chunk read back
// against that record. No checksum from the client is needed for either. Chunks sealed by a daemon
// of manifest version 1 (a record adopted by an upgraded daemon) keep their XXH3-64 until rewritten.
//
// Two kinds of chunk move no bytes. A zero chunk (every byte zero, named by reserve()'s zero runs)
// takes no disk space and is recorded as zero at once: it is never written nor read. An unchanged
// chunk is one whose bytes, hashed before the write (open_write(), settle_write()), equal what the
// data file provably holds at its place: it is sealed without being rewritten. "Provably" includes
// the file itself: its identity and metadata (device, inode, size, mtime, ctime) are recorded when a
// pause is committed and checked before anything is skipped; a file changed outside tmsdiskd since
// (a byte flipped, truncated, replaced), before or after a daemon restart, has its chunks rewritten.
//
// A WRITE takes open_write(), hash_chunk() (on any thread), settle_write() and, unless the chunk is
// unchanged, end_write() once the bytes are on disk; a READ takes open_read(), then hash_chunk() and
// settle_read() once the bytes are read. Tests look further through storage_testing.h.
class RankStore;
namespace testing {
void wait_for_punches(RankStore& store) noexcept;  // storage_testing.h
}  // namespace testing

class RankStore {
 public:
  // Creates <root>/<uid>/<job>/rank<R>-<pid>/ on every root (replacing a stale directory of the same
  // name left by a dead process; EEXIST if its owner is alive), writes `owner`, opens `data` on each
  // root. On roots a rank chose (Roots::open_rank_directory) the files go directly in that one
  // directory, named "tmsdisk-<job>-rank<R>-<pid>.owner" and so on, and the files of dead ranks found
  // there go first (sweep_rank_files); the directory itself is never removed. Data files are opened
  // O_DIRECT where the filesystem allows it (else roots[i].direct_io becomes false). chunk_bytes
  // is the chunk size (a non-zero multiple of kIoAlignment). On failure nothing is left behind.
  static Result<std::unique_ptr<RankStore>> create(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes);

  // Re-adopts an existing rank directory after a daemon restart: the owner file on every root must
  // name the same pid, start time and token. Loads the manifest (blobs, extents, checksums, paused
  // or resumed) and, for a pause in progress, the checksums journaled since its reservation. Without
  // a manifest and with empty data files the rank starts empty. A manifest that is missing while the
  // data files hold bytes, or unreadable, or a journal a pause in progress needs that is missing, is
  // no reason to refuse the rank nor to touch its files: the store is adopted with record_problem()
  // set. A manifest of another chunk size or root count is refused (reconnecting as before works).
  static Result<std::unique_ptr<RankStore>> adopt(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes);

  ~RankStore();
  RankStore(const RankStore&) = delete;
  RankStore& operator=(const RankStore&) = delete;

  // Path of the rank's directory on the first root (what TMS_DISK_BACKUP_DIR is set to).
  const std::string& dir_path() const noexcept;
  uint32_t chunk_bytes() const noexcept;
  std::size_t root_count() const noexcept;
  // The rank's directory on each root, in root order (O_PATH; valid until remove() or destruction):
  // the rank's object store (object_store.h) keeps its files there too.
  std::vector<int> dir_fds() const;
  // The names of its files there (prefixed in a directory the rank chose), and whether it is one.
  const RankFileNames& file_names() const noexcept;
  bool in_own_directory() const noexcept;

  // Makes `blobs` the exact set this rank stores: new or resized blobs get extents, blobs not listed
  // are dropped and their extents recycled, unchanged blobs keep theirs (overwritten in place).
  // The chunks `zero_runs` name are zero: recorded as such now, never written, and their ranges are
  // holes (punched, best effort, where they held data). Space is preallocated with fallocate(2) for
  // the other chunks only, and only they count in the space check. What the new set gives back (its
  // zero chunks that held data, extents it frees, a file's tail) is given back after this returns, on
  // a thread of the store's (background_punch.h): a reservation that zeroes gigabytes no longer holds
  // up the caller's thread for the filesystem's punching. The next reservation waits for it first,
  // and removal and destruction stop it; the manifest records the set before anything is punched.
  // All or nothing: on ENOSPC (or any
  // error) the previous set and files are unchanged and the error says how much was needed and
  // available. Clears every recorded checksum and the journal (a new generation is being written) and
  // records the new extents and zero chunks in the manifest (state "writing"), so a daemon restarted
  // mid-pause can still locate and verify chunks already written. Duplicate blob ids are refused
  // (EINVAL), and so are zero runs naming a blob not in `blobs`, reaching past its last chunk or
  // overlapping; and a new set while a committed pause has not been resumed (EBUSY): its data is
  // still the only copy. The chunks `host_runs` name are kept by the rank in its host-tier memory:
  // like zero chunks, nothing of them is stored (no run of either list may overlap another).
  //
  // `carry` names blobs that stay paused while the rest of the set changes (several parts of a rank
  // paused one after another): each must be in `blobs` with the size it is stored with and
  // every chunk sealed (data, zero or host), and no run may name it; it passes into the new set
  // untouched, its extents, states and checksums with it (the reservation's manifest records them,
  // so a daemon restarted before the next commit still has them). Carrying, the rank says that what
  // it does not carry is resident again, as a resumed commit says of everything: a committed pause
  // then no longer refuses the new set (EBUSY without `carry`).
  Status reserve(std::span<const BlobSize> blobs, std::span<const ChunkRun> zero_runs = {},
                 std::span<const ChunkRun> host_runs = {}, std::span<const uint64_t> carry = {});

  // Where chunk [offset, offset+length) of `blob` lives. Validates: blob reserved, offset a multiple
  // of chunk_bytes, length == min(chunk_bytes, size - offset), the chunk not reserved as zero (EINVAL:
  // nothing is stored for it, as for every call below that names a chunk). io_length is length
  // rounded up to kIoAlignment (the extent always has that room).
  struct Location {
    int fd = -1;
    bool direct_io = true;
    bool in_memory = false;  // the root's Root::in_memory
    uint64_t file_offset = 0;
    uint32_t io_length = 0;
  };
  Result<Location> locate(uint64_t blob, uint64_t offset, uint32_t length) const;

  // Location::fd stays valid until the next reserve() (which opens the file at the data file's name
  // anew where another file took it), remove() or destruction: I/O is queued with a fresh locate().

  // Before a WRITE of a chunk to (blob, offset), in three steps, so that the daemon hashes the
  // chunk's bytes elsewhere: on its hash workers (hash_workers.h), the WRITEs in flight side by side
  // instead of one after another on its event loop. open_write() and settle_write() run on the
  // store's thread, hash_chunk() on any. From open_write() on, what the file holds there is unknown
  // (a write is about to start; any seal of the chunk in this generation is dropped). settle_write()
  // then seals the chunk at once, journal included, and says it is `unchanged` (nothing needs
  // writing) when the data file provably held these very bytes there when open_write() was called
  // and no other WRITE of the chunk was opened since: written or found unchanged by this store since
  // the last committed generation, the blob kept its extents, no read of them failed its check, the
  // data file matches the identity recorded when the pause before was committed. Otherwise the
  // plan's `sum` goes to end_write() once the bytes are on disk; anything in doubt is written.
  struct WritePlan {
    Checksum128 sum;
    bool unchanged = false;
  };
  struct WriteTicket {
    Checksum128 held_sum;  // what the data file holds there, when `held`
    bool held = false;     // as ChunkRecord::held (rank_store_impl.h), for a sealed XXH3-128
    bool xxh64 = false;    // hash with XXH3-64: a pause under a version-1 record
    uint32_t opened = 0;   // which WRITE of the chunk this is
  };
  // Validates as locate() does.
  Result<WriteTicket> open_write(uint64_t blob, uint64_t offset, uint32_t length);
  // The checksum of `chunk`'s bytes, XXH3-128 or, with `xxh64` (a WriteTicket's or ReadTicket's), the
  // XXH3-64 of a version-1 record (one pass; any thread, no store state).
  static Checksum128 hash_chunk(bool xxh64, std::span<const uint8_t> chunk) noexcept;
  // The plan for the chunk open_write() gave `ticket` for, whose bytes hash to `sum`.
  Result<WritePlan> settle_write(uint64_t blob, uint64_t offset, uint32_t length, const WriteTicket& ticket,
                                 Checksum128 sum);
  // Seals the chunk written after settle_write() planned it with its `sum` (in memory and in the
  // journal) and returns it. Fails without recording when the journal cannot be written, so the chunk
  // is never acknowledged without a record that outlives the daemon.
  Result<Checksum128> end_write(uint64_t blob, uint64_t offset, uint32_t length, Checksum128 sum);
  // A READ of (blob, offset) in three steps, as a WRITE: open_read() on the store's thread refuses,
  // before any I/O, a chunk there is nothing to verify against: ENODATA if it was never written in
  // this generation, EUCLEAN if its record is lost (record_problem(), or its journal record is
  // corrupt); else it says how to hash it. hash_chunk() runs on any thread (the daemon's hash
  // workers verify the READs in flight side by side). settle_read() on the store's thread compares
  // the sum of the bytes read with what is sealed then (an XXH3-64 for a chunk a version-1 record
  // vouches for): the checksum, or EBADMSG on a mismatch (the store then no longer trusts what the
  // file holds there), or open_read()'s refusals. Both validate as locate() does.
  struct ReadTicket {
    bool xxh64 = false;  // sealed with an XXH3-64 (a version-1 record)
  };
  Result<ReadTicket> open_read(uint64_t blob, uint64_t offset, uint32_t length) const;
  Result<Checksum128> settle_read(uint64_t blob, uint64_t offset, uint32_t length, Checksum128 sum);

  // Chunks of the reserved set, zero ones included (what the records cost: max-chunks-per-uid).
  uint64_t chunk_count() const noexcept;
  // Bytes of the reserved set's zero chunks, but those of the blobs `except` names (carried ones,
  // whose zero chunks an earlier pause reported).
  uint64_t zero_bytes(std::span<const uint64_t> except = {}) const noexcept;
  // Bytes of host-tier memory the reserved set's host chunks take in the rank (whole chunks, laid one
  // after another): the most of its host-tier memory these records vouch for.
  uint64_t host_tier_bytes() const noexcept;

  // Commits the state: for Paused, requires every chunk written (or zero), fdatasyncs each data file, then
  // writes the manifest (the next generation, blobs, extents, checksums) to a temporary file,
  // fdatasyncs it, renames it over `manifest` and fsyncs the directory. For Resumed, marks the
  // manifest not-paused the same way (same generation; the files are kept for the next pause). The
  // store numbers generations itself: nobody else keeps a count that must agree with it.
  Status commit(CommitState state);

  // True if the loaded/committed manifest says the rank is paused (adopt() after a restart).
  bool paused() const noexcept;
  // Why the record that locates and verifies the rank's data cannot be used, empty when it can: the
  // refusal (EUCLEAN from locate() and every call that names a chunk; EBUSY from reserve() and a
  // Paused commit), naming the file and what the user can do. The files stay exactly as they are
  // (invariant 6) until the rank commits a resume, which says that every allocation is resident
  // again and clears it.
  const std::string& record_problem() const noexcept;
  // True while reserve() is refused until the rank commits a resume: a committed pause, a
  // record_problem(), or chunks of a pause in progress whose journal record is corrupt (each refused
  // with EUCLEAN). PAUSE_STATE reports it as "paused", so that a rank with every allocation resident
  // closes the record with that commit, and one with paused memory resumes it first.
  bool awaits_resume() const noexcept;
  // True while the files hold the only copy of some of the rank's memory: a committed pause, or a
  // pause in progress with chunks already written (the rank may have released them); also while
  // awaits_resume(), since what a lost record described cannot be ruled out.
  bool holds_unresumed_data() const noexcept;
  uint64_t generation() const noexcept;
  std::vector<BlobSize> blobs() const;
  std::size_t blob_count() const noexcept;  // blobs in the reserved set (what it costs in memory)

  // Bytes allocated in data files on all roots, zero chunks' holes left out (with a record_problem(),
  // the files' whole size: all kept).
  uint64_t disk_bytes() const noexcept;
  // Those on root `root` (its index in Roots; 0 for an index beyond them), for the metrics per root.
  uint64_t disk_bytes_on(std::size_t root) const noexcept;

  // Removes the rank's directories on every root (session closed), then the job and uid
  // directories where they became empty, after stopping what is still being punched in them.
  // Idempotent. The destructor never removes anything (a daemon restart must keep paused ranks'
  // files); it stops the punching too, so no thread outlives the store.
  Status remove();

  struct Impl;

 private:
  explicit RankStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend void testing::wait_for_punches(RankStore& store) noexcept;
};

struct SweepStats {
  uint32_t removed_dirs = 0;
  uint64_t removed_bytes = 0;
};

// Removes every rank directory under every root whose owner process is gone (pid + start time no
// longer match) and that `in_use` does not claim; `in_use` gets the path relative to the root,
// "<uid>/<job>/rank<R>-<pid>". Empty job and uid directories are removed too. Never follows
// symlinks; entries that do not look like ours (bad names, no or mismatching owner file, links)
// inside a uid directory are left alone and logged through `warn`. Top-level entries whose name is
// not a uid are skipped silently, since a root may be a shared directory such as /var/tmp.
// A sweep may remove an empty job or uid directory in the instant a concurrent create() made it;
// create() retries once for that, but running both from the daemon's one event loop avoids it.
Result<SweepStats> sweep_dead_ranks(Roots& roots, const std::function<bool(const std::string& relative_dir)>& in_use,
                                    const std::function<void(const std::string&)>& warn = {});

// In directory `dir` (`path` names it in messages), one that ranks chose for their files
// (Roots::rank_chosen()): removes the files of every rank whose owner process is gone, each rank's
// known names under the prefix its owner file gives (RankFileNames); nothing else there is touched.
// A rank that died while no daemon held its directory leaves files no sweep of the roots finds: the
// next rank to use that directory removes them. removed_dirs counts ranks.
SweepStats sweep_rank_files(int dir, const std::string& path, const std::function<void(const std::string&)>& warn = {});

}  // namespace tmsdisk::storage
