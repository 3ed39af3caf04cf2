// SPDX-License-Identifier: Apache-2.0
// Paused memory brought back close ahead of its resume (tmsdisk_prefetch; torch_memory_saver's
// preload): the disk chunks of paused allocations are read, through the daemon and verified against
// their seals, into the rank's host-tier memory, in the order a resume wants them, as far as that
// memory goes. Each chunk read becomes a host chunk of its allocation (placement), so the resume
// copies it from memory by DMA and reads only the rest from disk; its bytes stay on disk too.
//
// It runs in the background on the control thread, one batch between two turns of the thread: a
// pause or resume that arrives meanwhile runs before the next batch (it wins) and ends the prefetch;
// what was read by then is used. The memory: the part of the rank's host-tier memory after the chunks
// paused there, or memory asked for now (TIER_ASK, the rank's fair share) when it holds none in use.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>

#include "daemon_session.h"
#include "host_tier.h"
#include "op_result.h"
#include "registry.h"
#include "staging_slots.h"
#include "tags.h"
#include "tmsdisk/common/result.h"
#include "transfer.h"

namespace tmsdisk::shim {

class Prefetcher {
 public:
  // Bytes of disk chunks one batch reads at most: a pause or resume waits at most that long.
  static constexpr uint64_t kBatchBytes = uint64_t{256} << 20;

  Prefetcher(DaemonSession& session, TransferPipeline& pipeline, StagingSlots& slots, HostTierClient& tier,
             std::shared_mutex& op_lock)
      : session_(session), pipeline_(pipeline), slots_(slots), tier_(tier), op_lock_(op_lock) {}

  // On the control thread, for tmsdisk_prefetch and the daemon's prefetch command: starts reading
  // the paused, backed-up allocations of `tag` (empty: every one) ahead of their resume, in place of
  // a prefetch still running. Done with the bytes it will read (the batches come with the thread's
  // next turns); NoOp when nothing of them is on disk or no allocation carries the tag. ENOTSUP
  // without the host tier (TMSDISK_HOST_TIER=0), ENOSPC when the node's tier has no room for this
  // rank now, EINVAL for a bad tag name.
  OpResult command(const std::string& tag);
  // On the control thread, between turns: one batch; true while more remains.
  bool step() noexcept;
  // A pause or resume begins: what was read by now is used, the rest stays on disk.
  void stop() noexcept;
  // Blocks (an application thread) until the prefetch that runs now ends: the first error it met.
  Status wait() noexcept;

 private:
  // The next allocation to read from and its chunks to read (op lock held): false when none is left
  // that the free memory can continue.
  struct Batch {
    std::shared_ptr<Allocation> a;
    uint64_t host_chunks = 0;      // the allocation's host chunks before this batch
    std::vector<uint64_t> chunks;  // indexes of the disk chunks to read, in order
  };
  // command()'s work once the tag is known: the bytes it will read (0: nothing on disk).
  Result<uint64_t> start(std::optional<TagId> tag);
  bool next_batch(Batch& b) const;
  Status read(const Batch& b);
  void finish(Status st) noexcept;

  DaemonSession& session_;
  TransferPipeline& pipeline_;
  StagingSlots& slots_;
  HostTierClient& tier_;
  std::shared_mutex& op_lock_;

  // Control thread only.
  std::optional<TagId> tag_;  // the allocations read: of this tag, or every one
  uint64_t next_offset_ = 0;  // where the next chunk goes in the host-tier memory
  uint64_t room_end_ = 0;     // ... and where the part it may use ends

  // Shared with waiters.
  std::mutex mu_;
  std::condition_variable cv_;
  bool active_ = false;
  Status outcome_;
};

}  // namespace tmsdisk::shim
