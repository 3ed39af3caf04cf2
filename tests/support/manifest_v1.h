// SPDX-License-Identifier: Apache-2.0
// A manifest in the layout of version 1 (daemon/storage/manifest.h), the one daemons wrote before
// chunks were sealed with XXH3-128: XXH3-64 sums (each Checksum128's low half) and a bitmap of the
// chunks that hold data. For the tests that adopt such a record (storage) and resume through it
// (daemon). Header-only; needs tmsdisk_storage and tmsdisk_xxhash.
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <string>

#include "manifest.h"

namespace storage_test {

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline std::string encode_manifest_v1(const tmsdisk::storage::Manifest& m) {
  std::string out;
  put_le(out, tmsdisk::storage::kManifestMagic, 8);
  put_le(out, 1, 4);
  put_le(out, m.state, 4);
  put_le(out, m.generation, 8);
  put_le(out, m.chunk_bytes, 4);
  put_le(out, m.data_end.size(), 4);
  for (uint64_t end : m.data_end) put_le(out, end, 8);
  put_le(out, m.blobs.size(), 8);
  for (const auto& b : m.blobs) {
    put_le(out, b.id, 8);
    put_le(out, b.size, 8);
    for (const auto& e : b.extents) put_le(out, e.offset, 8), put_le(out, e.length, 8);
    for (const auto& s : b.sums) put_le(out, s.low, 8);
    std::string bits((b.states.size() + 7) / 8, '\0');
    for (std::size_t i = 0; i < b.states.size(); ++i)
      if (tmsdisk::storage::is_data(b.states[i])) bits[i / 8] = static_cast<char>(bits[i / 8] | (1 << (i % 8)));
    out += bits;
  }
  put_le(out, XXH3_64bits(out.data(), out.size()), 8);
  return out;
}

}  // namespace storage_test
