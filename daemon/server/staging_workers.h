// SPDX-License-Identifier: Apache-2.0
// Builds and tears down staging buffers (staging_buffer.h) on a few threads of their own. A HELLO
// asking for a GiB of staging costs seconds of page zeroing and pinning on a loaded node, and the end
// of a session as long to unpin and free them: on the event loop, which serves every user, that
// stalled everyone else's requests. The loop hands the work here and hears back through
// an eventfd in its epoll set. Host-tier memory (host_tier.h), zeroed by the kernel page by page as
// staging is, is made and taken back here too.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "host_tier.h"
#include "io_engine.h"
#include "staging_buffer.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "worker_pool.h"

namespace tmsdisk::server {

class StagingWorkers : public WorkerPool {
 public:
  // HELLOs that arrive together are built side by side, up to this many: one that is slow (a GiB on
  // a loaded node) holds back the others only when this many are in the works.
  static constexpr unsigned kThreads = 4;

  // What build() asked for, as it came out.
  struct Built {
    uint64_t conn_id = 0;        // the connection whose HELLO it is for
    int claimed_index = -1;      // the fixed-buffer slot the loop claimed for it
    StagingPtr buffer;           // null when it could not be made:
    Error error;                 // ... why
    std::string not_registered;  // why the buffer is not registered with io_uring (it works without)
  };
  // What build_tier() asked for, as it came out.
  struct TierBuilt {
    uint64_t session_id = 0;
    uint64_t conn_id = 0;
    uint64_t request_id = 0;  // of the TIER_ASK to answer
    uint64_t bytes = 0;
    std::string note;    // why less than asked (TierGrant.note)
    std::string object;  // not empty: the memory object `object` lives in (STORE_OPEN), not a pause's
    UniqueFd memory;     // invalid when it could not be made:
    Error error;         // ... why
    double seconds = 0;  // making it took (the kernel zeroes every page)
  };
  struct Finished {
    std::vector<Built> built;
    std::vector<int> emptied_slots;  // fixed-buffer slots of retired buffers, for the loop to release
    std::vector<TierBuilt> tiers;
  };

  // `before_build` (tests only) runs on the worker before each build, with the HELLO's job name.
  // `engine` must outlive the workers.
  StagingWorkers(io::Engine& engine, std::function<void(const std::string& job)> before_build);
  // Tears down the buffers handed to retire() (their memory must go back), drops the builds not yet
  // started, and waits for the threads (so for a build in progress, and for before_build).
  ~StagingWorkers();
  StagingWorkers(const StagingWorkers&) = delete;
  StagingWorkers& operator=(const StagingWorkers&) = delete;

  // event_fd() (WorkerPool) is readable while finished() has something for the loop.

  // Builds a buffer of `slot_count` slots of `chunk_bytes` for the HELLO on `conn_id`, registered at
  // `claimed_index` (-1: not registered). The result comes back through finished().
  void build(uint64_t conn_id, const std::string& job, uint32_t chunk_bytes, uint32_t slot_count, int claimed_index);
  // Makes `bytes` of host-tier memory for the TIER_ASK (or, for `object`, the STORE_OPEN) `request_id`
  // of session `session_id` on `conn_id`. The result comes back through finished().
  void build_tier(uint64_t session_id, uint64_t conn_id, uint64_t request_id, uint64_t bytes, std::string note,
                  std::string object = {});
  // Tears `buffer` down on a worker; its fixed-buffer slot comes back through finished(). What
  // StagingPtr's deleter calls; after the workers stopped it tears down on the calling thread.
  void retire(StagingBuffer* buffer) noexcept;
  // Takes host-tier memory the daemon stops counting back on a worker (revoke_tier_memory: freeing a
  // GiB takes a good part of a second); after the workers stopped, on the calling thread.
  void take_back_tier(TierMemory memory) noexcept;

  // What is done since the last call (event loop; clears the eventfd).
  Finished finished();

 private:
  struct BuildJob {
    uint64_t conn_id = 0;
    std::string job;
    uint32_t chunk_bytes = 0;
    uint32_t slot_count = 0;
    int claimed_index = -1;
  };
  void work();

  io::Engine& engine_;
  std::function<void(const std::string&)> before_build_;
  // Under mu_. Teardowns go first: they give memory back, builds take it.
  std::deque<StagingBuffer*> teardowns_;
  std::deque<TierMemory> tier_takebacks_;
  std::deque<BuildJob> builds_;
  std::deque<TierBuilt> tier_builds_;  // requests: `memory` and `error` filled in by a worker
  Finished done_;
};

}  // namespace tmsdisk::server
