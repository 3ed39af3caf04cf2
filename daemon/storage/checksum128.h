// SPDX-License-Identifier: Apache-2.0
// Checksum128: the checksum of one chunk, an XXH3-128 (issue 9), or an XXH3-64 carried over from a
// version-1 record (manifest.h's ChunkState::Data64 says which).
#pragma once

#include <cstdint>

namespace tmsdisk::storage {

// The two halves of XXH128_hash_t, without making every user of storage.h include xxhash.h. An
// XXH3-64 from a version-1 record lives in `low`, `high` zero.
struct Checksum128 {
  uint64_t low = 0;
  uint64_t high = 0;
  friend bool operator==(const Checksum128&, const Checksum128&) = default;
};

}  // namespace tmsdisk::storage
