// SPDX-License-Identifier: Apache-2.0
// The deterministic test pattern: bytes derived from (blob or allocation id, absolute offset), so any
// chunk can be produced or checked on its own. Header-only: test programs that run under the
// preloaded shim use it without linking the (possibly sanitized) test support library.
#pragma once

#include <cstdint>

namespace tmsdisk::testing {

inline uint64_t pattern_word(uint64_t id, uint64_t word_index) {
  uint64_t x = (id + 1) * 0x9E3779B97F4A7C15ull ^ word_index * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return x;
}

inline uint8_t pattern_byte(uint64_t id, uint64_t offset) {
  return static_cast<uint8_t>(pattern_word(id, offset / 8) >> (8 * (offset % 8)));
}

inline void fill_pattern(uint64_t id, uint64_t offset, uint8_t* dst, uint64_t len) {
  for (uint64_t i = 0; i < len; ++i) dst[i] = pattern_byte(id, offset + i);
}

// Offset of the first byte that differs from the pattern, or -1 if all match.
inline int64_t find_mismatch(uint64_t id, uint64_t offset, const uint8_t* src, uint64_t len) {
  for (uint64_t i = 0; i < len; ++i)
    if (src[i] != pattern_byte(id, offset + i)) return static_cast<int64_t>(i);
  return -1;
}

inline bool check_pattern(uint64_t id, uint64_t offset, const uint8_t* src, uint64_t len) {
  return find_mismatch(id, offset, src, len) < 0;
}

}  // namespace tmsdisk::testing
