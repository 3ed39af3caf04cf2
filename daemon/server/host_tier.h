// SPDX-License-Identifier: Apache-2.0
// The host-memory tier: one budget of host memory for the whole node (host-tier-mb), which
// pausing ranks use before the disk. A rank asks (TIER_ASK) for what its pause would keep there; the
// daemon grants at most the rank's fair share of the budget, and never more than the node can spare
// now, as a sealed memfd whose pages it faulted in (so they are charged to the daemon's cgroup, which
// it checked, and not to the rank's, which might be killed for them). The rank maps it, registers it
// with CUDA and copies into it by DMA.
//
// The daemon keeps a descriptor of every memfd it counts (TierMemory). What it stops counting, when
// the rank releases it (TIER_RELEASE) or its session ends, it also takes back: it punches the whole
// file, so that pages it faulted in and charged to itself cannot outlive the count in a process that
// kept its own descriptor or mapping (such a process then sees fresh zero pages, charged to itself).
// A daemon that restarts learns of memory holding paused chunks again when the rank hands its memfd
// back (TIER_ADOPT); it counts what the rank's manifest says the rank was granted, once per memfd.
//
// Fair share: the budget is split equally between the users with ranks (sessions) on the node, and a
// user's part equally between that user's ranks; each rank's grant is at most that and what is left
// of the budget. The ranks of a job pause together and wait for the slowest, so an equal split of the
// fast tier makes the job's pause as short as it can be; a rank that pauses alone on the node gets the
// whole budget, and one user's many ranks cannot crowd out another user's.
#pragma once

#include <sys/types.h>

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

// a - b, or 0 where b is larger: what is left of a budget or a headroom.
inline uint64_t sub_floor(uint64_t a, uint64_t b) noexcept {
  return a > b ? a - b : 0;
}

struct TierPlan {
  uint64_t bytes = 0;  // what to grant: a whole number of chunks
  std::string note;    // why less than asked; empty when all of it
};

// A rank's fair share of the budget, and how it was split (for the note of a smaller grant).
struct FairShare {
  uint64_t bytes = 0;
  std::size_t users = 1;          // users with ranks on the node
  std::size_t ranks_of_user = 1;  // ... and the ranks of the asking rank's user
};

// The share of `budget` of a rank whose user has `ranks_of_user` ranks, while `users` users have ranks
// on the node.
FairShare fair_share(uint64_t budget, std::size_t users, std::size_t ranks_of_user);

// The grant for a rank asking `ask` bytes (chunks of `chunk` bytes) with its fair share `fair`, while
// `used` bytes of `budget` are held or being granted, with `spare` bytes to spare.
TierPlan plan_grant(uint64_t ask, uint32_t chunk, uint64_t budget, uint64_t used, const FairShare& fair,
                    const SpareMemory& spare);

// Host-tier memory a rank holds, as the daemon counts it: its own descriptor of the memfd, which file
// that is (st_dev, st_ino: one memfd is counted once), and the bytes counted. Empty: bytes == 0.
struct TierMemory {
  UniqueFd fd;
  uint64_t bytes = 0;
  dev_t dev = 0;
  ino_t ino = 0;
};

// Counts `bytes` of the memfd `fd` (its identity from fstat).
Result<TierMemory> hold_tier_memory(UniqueFd fd, uint64_t bytes);

// Takes the memory back and forgets it: punches the whole file, so that no page the daemon faulted in
// survives in a process that still maps it or holds a descriptor (pages pinned by a driver stay until
// unpinned; the kernel frees them then). Only for memory no paused chunk lives in any more. Returns
// what could not be punched (the memory is forgotten either way: its pages go with the last holder).
Status revoke_tier_memory(TierMemory& memory);

// A sealed memfd of `bytes` whose pages are faulted in, by several threads for a large one (the kernel
// zeroes each page: one thread does a few GB/s). Slow: call it off the event loop. ENOMEM when the
// memory could not be had.
Result<UniqueFd> make_tier_memory(uint64_t bytes);

// The bytes a memfd handed back by TIER_ADOPT holds, checked to be tier memory as make_tier_memory
// makes it (a sealed memfd of that name): the pages it really holds, not its size, so that a sparse
// file cannot claim the budget. That alone proves nothing (anyone can make such a memfd): TIER_ADOPT
// counts at most what the rank's own records say it was granted (tier_broker.h).
Result<uint64_t> tier_memory_bytes(int fd);

}  // namespace tmsdisk::server
