// SPDX-License-Identifier: Apache-2.0
// The manifest: a rank's committed state (blobs, extents, checksums) in a self-checking binary file.
//
// Layout, all integers little-endian:
//   u64 magic "TMSDMANI"   u32 version (1)   u32 state (1 paused, 2 resumed, 3 writing)
//   u64 generation   u32 chunk_bytes   u32 root count R   R x u64 data file end
//   u64 blob count, then per blob: u64 id, u64 size, R x (u64 offset, u64 length),
//       C x u64 checksum, ceil(C/8) bytes bitmap of recorded checksums (bit i of byte i/8)
//       where C = ceil(size / chunk_bytes)
//   u64 XXH3-64 of every byte before it
// The trailing hash catches torn or edited files; the decoder also bounds every count by the bytes
// that remain, so a hostile file cannot make it allocate more than the file's own size.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tmsdisk::storage {

inline constexpr uint64_t kManifestMagic = 0x494e414d44534d54ull;  // "TMSDMANI" as little-endian bytes
inline constexpr uint32_t kManifestVersion = 1;
inline constexpr uint32_t kManifestPaused = 1;
inline constexpr uint32_t kManifestResumed = 2;
inline constexpr uint32_t kManifestWriting = 3;  // a pause in progress: extents valid, checksums partial
inline constexpr uint32_t kManifestMaxRoots = 1024;
// A manifest holds 8 bytes and a bit per chunk; 1 GiB covers over 100 million chunks.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;

struct ManifestExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ManifestBlob {
  uint64_t id = 0;
  uint64_t size = 0;
  std::vector<ManifestExtent> extents;  // one per root
  std::vector<uint64_t> sums;           // one per chunk
  std::vector<uint8_t> have;            // one per chunk: 1 if sums[i] was recorded
};

struct Manifest {
  uint32_t state = kManifestResumed;
  uint64_t generation = 0;
  uint32_t chunk_bytes = 0;
  std::vector<uint64_t> data_end;  // per root: end of the data file's allocated range
  std::vector<ManifestBlob> blobs;
};

// Serialises `m` (extents.size() must equal data_end.size(), sums/have one per chunk). May throw
// std::bad_alloc.
std::string encode_manifest(const Manifest& m);

// Parses and checks magic, version, hash and structure; on failure returns nullopt and says why.
// May throw std::bad_alloc.
std::optional<Manifest> decode_manifest(std::string_view bytes, std::string& why);

}  // namespace tmsdisk::storage
