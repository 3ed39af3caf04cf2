// SPDX-License-Identifier: Apache-2.0
// Storage internals: the checksum journal, where a rank's chunk checksums live between RESERVE and
// COMMIT, so that a daemon restarted mid-pause still verifies every chunk written before it died.
//
// Once a pause is committed the manifest holds every checksum; before that, only memory did (and
// the shim's copy). File `sums` in the rank directory on the first root holds one 40-byte record
// per chunk of the reserved set, at (the chunk's ordinal in the set) x 40, all little-endian:
//   u64 blob id   u64 chunk index   u64 checksum low   u64 checksum high (the XXH3-128)
//   u64 XXH3-64 of those 32 bytes, seeded with the XXH3-64 of the "writing" manifest of this set
// A slot never written reads as zeros (a hole) and fails its check; a record of another reservation
// fails it too (another seed), and so does a torn one. Written with pwrite and never flushed: it must
// outlive the daemon process, which the page cache ensures; a power loss also ends the rank that
// needed it. One pwrite of 40 bytes per chunk of megabytes keeps it off the hot path.
// Zero chunks are not journaled: the "writing" manifest records them at the reservation.
//
// A pause whose "writing" manifest is version 1 (a daemon upgraded mid-pause) keeps the layout of
// version 1 until its commit: 32-byte records of u64 blob, u64 chunk, u64 XXH3-64, u64 check hash
// (of those 24 bytes, same seed). Its chunks are then sealed with XXH3-64 (ChunkState::Data64).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checksum128.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage::detail {

inline constexpr uint64_t kJournalRecordBytes = 40;
inline constexpr uint64_t kJournalRecordBytesV1 = 32;

class ChecksumJournal {
 public:
  struct Record {
    bool valid = false;
    // Not a hole (bytes were written there) yet it fails its check: a record damaged outside
    // tmsdiskd. The chunk it sealed may have been acknowledged, and its memory released.
    bool corrupt = false;
    uint64_t blob = 0;
    uint64_t chunk = 0;
    Checksum128 checksum;  // an XXH3-64 in `low` under the layout of version 1
  };

  ChecksumJournal() = default;

  // Opens the journal `name` (RankFileNames::sums) below `rank_dir` (`path` names it in messages)
  // without following a link. With
  // `create` the file must not exist yet (a fresh rank directory); otherwise an existing one is
  // opened, or created when absent. Anything but a regular file with one link is refused.
  static Result<ChecksumJournal> open(int rank_dir, const std::string& name, bool create, const std::string& path);
  // Whether open() made the file: without `create`, the journal was missing (deleted outside tmsdiskd
  // if a pause in progress needs it).
  bool created() const noexcept { return created_; }
  const std::string& path() const noexcept { return path_; }

  // A new reservation: forgets every record and returns to the layout of version 2. The seed is set
  // once its manifest is written.
  Status reset();
  void set_seed(uint64_t seed) noexcept { seed_ = seed; }
  // The pause in progress was reserved by a daemon that wrote version 1: its records have that
  // layout until the next reset().
  void use_version1_layout() noexcept { v1_ = true; }
  bool version1_layout() const noexcept { return v1_; }

  // Records chunk `chunk` of `blob`, the set's chunk number `ordinal` (under the layout of version
  // 1, checksum.low only).
  Status record(uint64_t ordinal, uint64_t blob, uint64_t chunk, Checksum128 checksum);

  // The records of the first `chunks` ordinals (invalid where none was written under this seed).
  Result<std::vector<Record>> load(uint64_t chunks) const;

 private:
  UniqueFd fd_;
  std::string path_;
  uint64_t seed_ = 0;
  bool created_ = false;
  bool v1_ = false;
};

}  // namespace tmsdisk::storage::detail
