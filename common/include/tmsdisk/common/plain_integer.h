// SPDX-License-Identifier: Apache-2.0
// The one parser for sizes read from the environment (the shim's TMSDISK_MIN_BYTES and
// TMS_DISK_BACKUP_CHUNK_MB, tmsctl's reading of the latter): a plain decimal integer.
#pragma once

#include <cstdint>
#include <optional>

namespace tmsdisk {

// Digits only (no sign, suffix or space), fitting in 64 bits; nothing otherwise. "2M" could mean
// bytes or MiB, and a suffix once turned TMS_DISK_BACKUP_CHUNK_MB=1G into 2^50 bytes. No allocation:
// the preloaded shim calls it.
constexpr std::optional<uint64_t> parse_plain_integer(const char* text) noexcept {
  if (!text || !*text) return std::nullopt;
  uint64_t v = 0;
  for (const char* p = text; *p; ++p) {
    if (*p < '0' || *p > '9') return std::nullopt;
    const uint64_t digit = static_cast<uint64_t>(*p - '0');
    if (v > (UINT64_MAX - digit) / 10) return std::nullopt;
    v = v * 10 + digit;
  }
  return v;
}

// A plain number of MiB whose bytes fit in 64 bits, as the shim accepts it.
constexpr std::optional<uint64_t> parse_plain_mib(const char* text) noexcept {
  const std::optional<uint64_t> v = parse_plain_integer(text);
  if (!v || *v > (UINT64_MAX >> 20)) return std::nullopt;
  return v;
}

}  // namespace tmsdisk
