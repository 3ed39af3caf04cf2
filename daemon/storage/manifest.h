// SPDX-License-Identifier: Apache-2.0
// The manifest: a rank's committed state (blobs, extents, checksums) in a self-checking binary file.
//
// Layout of version 3, all integers little-endian:
//   u64 magic "TMSDMANI"   u32 version (3)   u32 state (1 paused, 2 resumed, 3 writing)
//   u64 generation   u32 chunk_bytes   u32 root count R   R x u64 data file end
//   R x (u64 known, u64 st_dev, u64 st_ino, u64 st_size, i64 mtime s, i64 mtime ns, i64 ctime s,
//        i64 ctime ns): each data file as it was when its bytes were last known (file_identity.h);
//        known 0: not recorded, and the fields are zero
//   u64 blob count, then per blob: u64 id, u64 size, R x (u64 offset, u64 length),
//       C x u8 chunk state (ChunkState), C x (u64 low, u64 high) checksum
//       where C = ceil(size / chunk_bytes)
//   u64 XXH3-64 of every byte before it
// Version 2 is version 3 without the data files' identities: adopted, its chunks are rewritten by the
// next pause rather than trusted to be in a file nothing vouches for. Version 1 (written before issue 9) had, per blob,
// C x u64 XXH3-64 checksum and a ceil(C/8)-byte bitmap of recorded checksums (bit i of byte i/8) instead of the states
// and 128-bit sums. It is still read, so that a daemon upgraded while ranks are paused resumes them: its recorded
// chunks become ChunkState::Data64. Every manifest written is version 3. The trailing hash catches torn or edited
// files; the decoder also bounds every count by the bytes that remain, so a hostile file cannot make it allocate more
// than the file's own size.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checksum128.h"
#include "file_identity.h"

namespace tmsdisk::storage {

inline constexpr uint64_t kManifestMagic = 0x494e414d44534d54ull;  // "TMSDMANI" as little-endian bytes
inline constexpr uint32_t kManifestVersion = 3;
inline constexpr uint32_t kManifestVersion2 = 2;  // read, never written
inline constexpr uint32_t kManifestVersion1 = 1;  // read, never written
inline constexpr uint32_t kManifestPaused = 1;
inline constexpr uint32_t kManifestResumed = 2;
inline constexpr uint32_t kManifestWriting = 3;  // a pause in progress: extents valid, checksums partial
inline constexpr uint32_t kManifestMaxRoots = 1024;
// A manifest holds 17 bytes per chunk; 1 GiB covers over 60 million chunks.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;

struct ManifestExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
};

// What the record says of one chunk of the set (the byte stored per chunk).
enum class ChunkState : uint8_t {
  Missing = 0,  // not recorded: never written in this generation
  Data = 1,     // written; its checksum is an XXH3-128
  Zero = 2,     // every byte zero: nothing stored, no disk space (issue 9)
  Data64 = 3,   // written; its checksum is an XXH3-64 from a version-1 manifest or journal
  Host = 4,     // kept by the rank in its host-tier memory: nothing stored, no disk space (issue 9)
};
inline constexpr uint8_t kChunkStateMax = 4;

// Zero and host-tier chunks: nothing of them is on disk, nothing is written or read for them.
inline bool kept_off_disk(ChunkState s) noexcept {
  return s == ChunkState::Zero || s == ChunkState::Host;
}

inline bool is_data(ChunkState s) noexcept {
  return s == ChunkState::Data || s == ChunkState::Data64;
}

struct ManifestBlob {
  uint64_t id = 0;
  uint64_t size = 0;
  std::vector<ManifestExtent> extents;  // one per root
  std::vector<ChunkState> states;       // one per chunk
  std::vector<Checksum128> sums;        // one per chunk, meaningful where is_data(states[i])
};

struct Manifest {
  uint32_t version = kManifestVersion;  // what decode_manifest() read; encode_manifest() writes version 3
  uint32_t state = kManifestResumed;
  uint64_t generation = 0;
  uint32_t chunk_bytes = 0;
  std::vector<uint64_t> data_end;  // per root: end of the data file's allocated range
  // Per root (or empty: none recorded, as in versions 1 and 2): the data file's identity when its
  // bytes were last known to be what the record says (RankStore::commit).
  std::vector<std::optional<detail::FileIdentity>> data_files;
  std::vector<ManifestBlob> blobs;
};

// Serialises `m` as version 3 (extents.size() must equal data_end.size(), states/sums one per
// chunk, data_files empty or one per root). May throw std::bad_alloc.
std::string encode_manifest(const Manifest& m);

// Parses and checks magic, version (1 to 3), hash and structure; on failure returns nullopt and says
// why. May throw std::bad_alloc.
std::optional<Manifest> decode_manifest(std::string_view bytes, std::string& why);

}  // namespace tmsdisk::storage
