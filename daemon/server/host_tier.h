// SPDX-License-Identifier: Apache-2.0
// The host-memory tier (issue 9): one budget of host memory for the whole node (host-tier-mb), which
// pausing ranks use before the disk. A rank asks (TIER_ASK) for what its pause would keep there; the
// daemon grants at most the rank's fair share of the budget, and never more than the node can spare
// now, as a sealed memfd whose pages it faulted in (so they are charged to the daemon's cgroup, which
// it checked, and not to the rank's, which might be killed for them). The rank maps it, registers it
// with CUDA and copies into it by DMA. The daemon keeps no descriptor: the memory belongs to the rank
// and goes when it releases it (TIER_RELEASE) or exits; a daemon that restarts learns of it again
// when the rank hands its memfd back (TIER_ADOPT).
//
// Fair share: the budget divided by the ranks (sessions) on the node, each rank's grant at most that
// and what is left of the budget. The ranks of a job pause together and wait for the slowest, so an
// equal split of the fast tier makes the job's pause as short as it can be; a rank that pauses alone
// on the node gets the whole budget.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

// What the node can spare for the tier now, and what bounds it (for the log line of a smaller grant).
struct SpareMemory {
  uint64_t bytes = UINT64_MAX;
  std::string limited_by;  // "MemAvailable", "cgroup /system.slice/tmsdiskd.service"; empty: nothing known
};

// The node's spare memory: MemAvailable of `meminfo` less what the tier always leaves free (1 GiB or
// 5% of MemTotal, the larger), and the headroom (memory.max - memory.current, less 64 MiB) of the
// daemon's cgroup and each of its ancestors under `cgroup_root` (cgroup v2; absent files bound nothing).
SpareMemory spare_memory(const std::string& meminfo = "/proc/meminfo",
                         const std::string& self_cgroup = "/proc/self/cgroup",
                         const std::string& cgroup_root = "/sys/fs/cgroup");

struct TierPlan {
  uint64_t bytes = 0;  // what to grant: a whole number of chunks
  std::string note;    // why less than asked; empty when all of it
};

// A rank's fair share of `budget` while `ranks` ranks are on the node.
inline uint64_t fair_share(uint64_t budget, std::size_t ranks) {
  return budget / (ranks ? ranks : 1);
}

// The grant for a rank asking `ask` bytes (chunks of `chunk` bytes) while `ranks` ranks are on the
// node and `used` bytes of `budget` are held or being granted, with `spare` bytes to spare.
TierPlan plan_grant(uint64_t ask, uint32_t chunk, uint64_t budget, uint64_t used, std::size_t ranks,
                    const SpareMemory& spare);

// A sealed memfd of `bytes` whose pages are faulted in, by several threads for a large one (the kernel
// zeroes each page: one thread does a few GB/s). Slow: call it off the event loop. ENOMEM when the
// memory could not be had.
Result<UniqueFd> make_tier_memory(uint64_t bytes);

// The bytes a memfd handed back by TIER_ADOPT holds, checked to be tier memory as make_tier_memory
// makes it (a sealed memfd of that name): the pages it really holds, not its size, so that a sparse
// file cannot claim the budget.
Result<uint64_t> tier_memory_bytes(int fd);

}  // namespace tmsdisk::server
