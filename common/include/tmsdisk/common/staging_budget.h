// SPDX-License-Identifier: Apache-2.0
// The one rule about a staging budget and its chunks, for every side that checks it: tmsdiskd's
// settings, a rank's HELLO, and tmsctl before it launches anything.
#pragma once

#include <cstdint>

namespace tmsdisk {

// A rank streams through its staging budget one chunk per slot and needs two slots, so that one is
// filled while the other is on its way to the disk: the least staging budget, in bytes, for chunks of
// `chunk_bytes`.
constexpr uint64_t min_staging_budget_bytes(uint64_t chunk_bytes) noexcept {
  return 2 * chunk_bytes;
}

// The same in whole MiB, rounded up: what to tell a user who speaks MiB.
constexpr uint64_t min_staging_budget_mib(uint64_t chunk_bytes) noexcept {
  return (min_staging_budget_bytes(chunk_bytes) + (uint64_t{1} << 20) - 1) >> 20;
}

}  // namespace tmsdisk
