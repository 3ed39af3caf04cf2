// SPDX-License-Identifier: Apache-2.0
// Inside RankStore (storage.h): its state, RankStore::Impl, and the types it is made of, shared by
// rank_store.cpp (directories, files, WRITEs and READs), rank_store_reserve.cpp (a new set's
// layout) and rank_store_manifest.cpp (commits and what adopt() reads back). Not for other users.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "background_punch.h"
#include "checksum_journal.h"
#include "extent_allocator.h"
#include "file_identity.h"
#include "manifest.h"
#include "storage.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage {

// The storage's own helpers (manifest, journal, file identity), as every file of RankStore uses them.
using namespace detail;

// Keeps every extent length and file offset far from 64-bit overflow (1 EiB per blob).
inline constexpr uint64_t kMaxBlobSize = uint64_t{1} << 60;

struct RootFiles {
  std::string path;  // root path, for messages
  std::string rank_path;
  UniqueFd root;  // dup of the root's O_PATH fd: the RankStore does not depend on Roots' lifetime
  UniqueFd uid_dir;
  UniqueFd job_dir;
  UniqueFd rank_dir;
  UniqueFd data;
  bool direct_io = true;
  bool in_memory = false;  // the root's Root::in_memory
  bool gone = false;       // rank directory removed
  ExtentAllocator alloc{kIoAlignment};
  // Of alloc.used_bytes(), the ranges of zero and host-tier chunks: holes in the file, no disk space.
  uint64_t off_disk_bytes = 0;
  // The data file as it was when its bytes were last known to be what the records say: taken at a
  // commit of a pause, after its fdatasync (file_identity.h); nullopt from the moment the store
  // itself may change the file again (a reservation, a WRITE), and whenever it was not taken. The
  // held chunks of a file that no longer matches it are forgotten (RankStore::Impl::check_files).
  std::optional<FileIdentity> known;
  // The file was found changed outside the store: the next reservation preallocates its data chunks
  // again (a truncation or a punch may have taken their blocks).
  bool changed = false;
};

// What the store knows of one chunk.
struct ChunkRecord {
  // The sealed checksum where is_data(state); otherwise, while `held`, the XXH3-128 of what the
  // data file holds at the chunk's place from an earlier generation.
  Checksum128 sum;
  ChunkState state = ChunkState::Missing;
  // The data file provably holds bytes whose XXH3-128 is `sum` at this chunk's place: this store
  // wrote them (or found them unchanged) in this generation or the last committed one, and since
  // then no write there has started, no read of them failed its check, the chunk was not zero, its
  // blob kept its extents and the file was not changed outside the store (RootFiles::known, checked
  // before anything is skipped). A WRITE of the same bytes then skips the disk. Never set
  // from a journal record, a version-1 checksum or a "writing" manifest: they prove less.
  bool held = false;
  // WRITEs of this chunk opened (RankStore::open_write): a hash that comes back after another WRITE
  // of the chunk was opened is not taken for what the file holds.
  uint32_t opened = 0;
};
// Each chunk costs the daemon about 24 bytes (max-chunks-per-uid's help and the README say so).
static_assert(sizeof(ChunkRecord) <= 24);

struct BlobState {
  uint64_t id = 0;
  uint64_t size = 0;
  uint64_t chunks = 0;
  uint64_t first_chunk = 0;             // ordinal of its chunk 0 in the set (checksum journal slot)
  std::vector<ManifestExtent> extents;  // one per root; length 0: no chunk of this blob there
  std::vector<ChunkRecord> records;     // one per chunk
};

// A byte range of one root's data file.
struct FileRange {
  std::size_t root;
  uint64_t offset;
  uint64_t length;
};

inline uint64_t round_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

// Extent of `size` bytes' chunks that land on root r of n: every n-th chunk starting at r, packed
// back to back; the blob's last chunk is rounded up to kIoAlignment so O_DIRECT can move it whole.
inline uint64_t extent_length(uint64_t size, uint32_t chunk, std::size_t n, std::size_t r) {
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

// Where chunk `ci` of `b` lies: its root and byte range (the last chunk rounded up to kIoAlignment).
inline FileRange chunk_range(const BlobState& b, uint64_t ci, uint32_t chunk, std::size_t n) {
  const std::size_t r = static_cast<std::size_t>(ci % n);
  const uint64_t length = ci + 1 == b.chunks ? round_up(b.size - ci * chunk, kIoAlignment) : chunk;
  return {r, b.extents[r].offset + (ci / n) * chunk, length};
}

// Opens (or, with `create`, creates) a rank's data file `name` in `rank_dir`, with O_DIRECT where the
// filesystem takes it (`direct_io` says whether it did); `path` names it in messages.
Result<UniqueFd> open_data_file(int rank_dir, const std::string& name, bool create, bool& direct_io,
                                const std::string& path);

struct RankStore::Impl {
  RankIdentity id;
  uint32_t chunk = 0;
  std::string uid_name;
  std::string rank_name;
  std::string relative;
  std::string dir_path;
  // The rank's files lie directly in one directory of its choosing (Roots::rank_chosen()), their names
  // prefixed, instead of in rank directories of their own under the roots (RankFileNames).
  bool own_dir = false;
  RankFileNames names;
  std::vector<RootFiles> roots;
  ChecksumJournal journal;  // beside the manifest, on the first root
  std::vector<BlobState> blobs;
  std::unordered_map<uint64_t, std::size_t> index;
  uint64_t missing = 0;
  bool paused = false;
  bool writing = false;  // a reservation was made and no commit has closed it yet
  uint64_t generation = 0;
  bool removed = false;
  // Set by adopt() when the record of where the rank's memory lies and what it must read back as is
  // gone or unusable (record_problem()): the whole refusal, naming the file and what to do.
  std::string record_problem;
  // Ordinals of chunks of the pause in progress whose journal record is corrupt: each may have been
  // written and acknowledged, so its memory released; none can be verified.
  std::unordered_set<uint64_t> corrupt_records;
  // Every range the layout has free or zero, and each file past its layout's end, is a hole (or will
  // be once `punches` is done, which the next reservation waits for): a reservation then punches
  // only what it frees or zeroes anew. False after adopt() (a daemon may have stopped before its
  // punches) and after a punch that did not happen: the next reservation punches all of them again.
  bool holes_punched = true;

  Status open_dirs(std::size_t i, int root_fd, bool create);
  // The directory rf's files go in, opened (and with `create`, made) into rf.rank_dir: the rank
  // directory under the root, or the directory of the rank's choosing.
  Status enter_rank_dir(RootFiles& rf, bool create);
  Status enter_own_dir(RootFiles& rf, bool create);
  // Files of this rank's name found in `dir` (at `dir_path`; `what` names them): an error unless their
  // owner is gone.
  Status check_leftovers(int dir, const std::string& dir_path, const std::string& what) const;
  Status remove_locked();
  Status reserve_locked(std::span<const BlobSize> set, std::span<const ChunkRun> zero_runs,
                        std::span<const ChunkRun> host_runs, std::span<const uint64_t> carry);
  Status load_manifest();
  Status load_journal(uint64_t seed, uint64_t chunks);
  // Bytes in the data file of each root, as they are.
  std::vector<uint64_t> data_file_sizes() const;
  // "the data file P (N bytes) is kept untouched", for every root.
  std::string kept_files_text() const;
  // Keeps every file as it is and refuses, with `what` and the way out, whatever would read, move
  // or overwrite the rank's data (invariant 6): the record that locates and verifies it is `what`.
  void lose_record(const std::string& what);
  // Writes the manifest of the current set; *hash (when given) receives the XXH3-64 of its bytes.
  Status write_manifest(uint32_t state, uint64_t gen, uint64_t* hash = nullptr);
  Result<const BlobState*> find_chunk(uint64_t blob, uint64_t offset, uint64_t* chunk_index) const;
  // find_chunk, and `length` must be that chunk's length.
  Result<const BlobState*> find_chunk_of_length(uint64_t blob, uint64_t offset, uint64_t length,
                                                uint64_t* chunk_index) const;
  // Seals chunk (blob, offset) with `sum`, the checksum of bytes the data file now holds there (so
  // the chunk is held, ChunkRecord::held, where the sum is an XXH3-128), journaled first.
  Status record(uint64_t blob, uint64_t offset, Checksum128 sum);
  // The checksum sealed for chunk `ci` of `b` in this generation (what a READ of it is verified
  // against): ENODATA if it was never written, EUCLEAN if its record in the journal is corrupt.
  Result<Checksum128> sealed_sum(const BlobState& b, uint64_t ci) const;
  ChunkState sealed_state() const { return journal.version1_layout() ? ChunkState::Data64 : ChunkState::Data; }
  // Writes a manifest of `set` with the data files ending at `data_end`.
  Status write_manifest_of(const std::vector<BlobState>& set, const std::vector<uint64_t>& data_end, uint32_t state,
                           uint64_t gen, uint64_t* hash);
  // Recounts missing chunks and each root's zero bytes from `blobs`.
  void recount();
  // Before anything is skipped for being held: forgets every held chunk of a data file whose identity
  // differs from the one recorded (or was never recorded), so that a file changed outside the store is
  // rewritten rather than trusted. With `before_change` (a reservation or a WRITE is about to change
  // the files) the identities are dropped too, as the change makes them stale.
  void check_files(bool before_change);
  // Forgets what the data file of root `r` is known to hold.
  void forget_held(std::size_t r);
  // Where another file has taken a data file's name, or none is left there, the store would go on
  // writing a file that a daemon restarted later never finds: a reservation opens the file the name
  // gives (a new one if there is none), as adopt() would, and its data chunks are preallocated and
  // written anew. Not while the open file holds the only copy of something (a pause in progress or
  // committed, blobs carried): those stay where they are. True when a file was opened anew.
  Result<bool> follow_replaced_files(bool carrying);
  // Waits for `punches` (reserve(), testing::wait_for_punches()); false when they left something undone.
  bool wait_punches(const char* who) noexcept {
    holes_punched = punches.wait(who) && holes_punched;
    return holes_punched;
  }

  // The space the last reservation gives back, being given back off the caller's thread. Declared
  // last, so destroyed first: stopped and joined while everything else is still there (it touches
  // nothing of the store's, only its own plan and descriptors, but that is one thing less to check).
  BackgroundPunch punches;
};

}  // namespace tmsdisk::storage
