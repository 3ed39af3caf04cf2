// SPDX-License-Identifier: Apache-2.0
// The rank's share of the node's host tier (DESIGN.md, "Where the data goes"): the memory tmsdiskd
// granted of its host-memory budget (HostTier), and the client that negotiates it with the daemon
// (HostTierClient): asking for it at a pause or ahead of the first one, placing a pause's first disk
// chunks in it, keeping it for the next pause or giving it back. The memory is a sealed memfd whose
// pages the daemon faulted in; the shim maps it, registers it with CUDA, and the pipeline copies host
// chunks into it and back by DMA (transfer.h). The descriptor is kept for as long as the memory holds
// paused chunks: a daemon that restarts meanwhile is handed it back (TIER_ADOPT), so that it counts the
// memory against the budget again.
#pragma once

#include <cstdint>
#include <functional>
#include <shared_mutex>
#include <vector>

#include "cuda_api.h"
#include "daemon_session.h"
#include "registered_mapping.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "transfer.h"

namespace tmsdisk::shim {

class HostTier {
 public:
  HostTier() = default;
  ~HostTier() { release(); }
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // Maps `memory` (`bytes` long, as TIER_GRANT said) and registers it with CUDA in `ctx`. Not being
  // registered is not an error (copies then go through the driver's own buffers, slower); being
  // smaller than `bytes`, or not mappable, is.
  Status take(UniqueFd memory, uint64_t bytes, CUcontext ctx);
  // Unregisters, unmaps and closes: the memory goes back to the node (the caller tells the daemon).
  void release() noexcept;
  // A fork child: the mapping and its registration are the parent's.
  void forget_after_fork() noexcept;

  bool held() const noexcept { return mapping_.mapped(); }
  uint8_t* base() const noexcept { return mapping_.data(); }
  uint64_t bytes() const noexcept { return mapping_.bytes(); }
  int fd() const noexcept { return fd_.get(); }

 private:
  UniqueFd fd_;
  RegisteredMapping mapping_;
};

// The host-tier policy of one rank, run on the control thread. The engine lends it the session (a
// request connects first when needed), the staging slots (their chunk size), the op lock (paused
// allocations' placement is read under it) and `warm`, which makes what the first pause would make
// first in a context (the scan kernel, the copy stream and its events).
class HostTierClient {
 public:
  using Warm = std::function<void(CUcontext)>;
  HostTierClient(DaemonSession& session, const StagingSlots& staging, std::shared_mutex& op_lock, Warm warm)
      : session_(session), staging_(staging), op_lock_(op_lock), warm_(std::move(warm)) {}
  HostTierClient(const HostTierClient&) = delete;
  HostTierClient& operator=(const HostTierClient&) = delete;

  // The memory (paused allocations' host chunks lie in it while it is held).
  const HostTier& memory() const noexcept { return memory_; }
  // Moves on whenever what the memory holds may be overwritten or goes (memory asked for or reused,
  // given back): a resumed allocation's retained host chunks are valid while it is the same.
  uint64_t generation() const noexcept { return generation_; }

  // Asks the daemon for host-tier memory for the disk chunks of `jobs` and places the first of them
  // there (as many as the grant holds, in order): memory kept since the last pause when the daemon
  // says to reuse it, else new memory. Without a grant, every chunk stays on disk.
  void place(std::vector<TransferJob>& jobs, CUcontext ctx);
  // Host-tier memory for a prefetch of `wanted` bytes of paused disk chunks (prefetch.h): the part of
  // the memory after the chunks paused there, or memory asked for now (as a pause asks) when none is
  // held in use. *offset: where that part begins. Returns its bytes, whole chunks (0: none). Op lock
  // held.
  uint64_t room_for_prefetch(uint64_t wanted, CUcontext ctx, uint64_t* offset);
  // While a prefetch runs, its memory is in use although no paused chunk lies in it yet: neither
  // kept (TIER_KEEP) nor given back by settle().
  void set_prefetching(bool on) noexcept { prefetching_ = on; }
  // Once no paused allocation keeps a chunk in the host-tier memory: kept for the next pause when the
  // daemon allows it (TIER_KEEP) and has not asked for it back (TIER_RECLAIM), else given back. Takes
  // the op lock: called after an operation, once its answer is out, and after a TIER_RECLAIM.
  void settle();
  // Between requests on the control thread: gives back what a TIER_RECLAIM asked for (another rank's
  // pause waits for it), then asks ahead of a first pause (ask_ahead).
  void tick(int64_t now);
  // Before the rank's object asks for host-tier memory (STORE_OPEN with kStoreOpenHost): the rank's
  // objects come first in its share of the node's tier, so memory held for a pause that holds nothing
  // of one (asked ahead of a pause, or kept since the last) is given back, and asked for again ahead
  // of the next pause once allocations and object opens are quiet (what the share then leaves). Not
  // while paused chunks, or a prefetch, use it. Returns whether it gave memory back. Op lock held.
  bool yield_to_objects();
  // After a resume, before its answer: memory the daemon lets nobody keep (host-tier-keep = false)
  // goes back now, so that the process's memory (its RSS, the device's mappings of pinned memory)
  // shows it gone once the resume returns, as torch_memory_saver frees its copy. Memory that may be
  // kept waits for settle(). Takes the op lock.
  void after_resume() {
    if (memory_.held() && !keep_) settle();
  }
  // TIER_RECLAIM came: given back by settle() once no operation runs.
  void reclaim() noexcept { reclaimed_ = true; }
  // A new session: what the daemon counts of this rank's memory is made to agree with what it holds.
  void session_started(bool adopted);
  // A fork child: the mapping and its registration are the parent's.
  void forget_after_fork() noexcept { memory_.forget_after_fork(); }
  // Called each time the generation is about to move on, before anything the memory held is
  // overwritten or given back (the views of retained copies keep their bytes: host_view.h).
  void on_reuse(std::function<void()> before) { before_reuse_ = std::move(before); }

 private:
  // What the memory holds may now be overwritten or go: the generation moves on (on_reuse first).
  void next_generation();
  // TIER_ASK for `wanted` bytes (kTierAsk* `ask_flags`): kept memory reused, or released and asked
  // again, or new memory mapped and registered from `ctx`. Returns the bytes usable now (0: none).
  uint64_t obtain(uint64_t wanted, uint8_t ask_flags, CUcontext ctx);
  // Host-tier memory before the first pause (kTierAskAhead, the daemon's host-tier-ahead): once
  // nothing was allocated or freed for kAheadQuietMs and nothing is paused, asks for what a pause
  // would want, on the control thread (a pause asked for meanwhile waits the seconds its own ask
  // would have taken). Again only when the memory grew by a quarter; never after a pause asked (keep
  // takes over, and knows better what a pause needs: its zero chunks). Also makes what the first
  // pause would make first in the rank's context (warm).
  void ask_ahead(int64_t now);
  // Where the host chunks of paused allocations end in the memory: after the last one of any (each
  // allocation's lie one after another from its host_offset). Op lock held.
  uint64_t paused_end() const;
  // Whether a paused allocation keeps chunks in the host-tier memory, or a prefetch fills it (op lock held).
  bool in_use() const;
  // Unmaps the host-tier memory and tells the daemon.
  void give_back();

  DaemonSession& session_;
  const StagingSlots& staging_;
  std::shared_mutex& op_lock_;
  Warm warm_;
  HostTier memory_;
  bool keep_ = false;                       // the grant allows keeping it after the resume (kTierKeep)
  bool kept_told_ = false;                  // TIER_KEEP sent since the last ask
  bool reclaimed_ = false;                  // TIER_RECLAIM came since the last ask
  uint64_t ahead_version_ = 0;              // registry version ask_ahead() saw last
  int64_t ahead_quiet_since_ms_ = 0;        // ... and since when
  uint64_t ahead_asked_bytes_ = 0;          // what it asked for last
  uint64_t ahead_decided_version_ = ~0ull;  // registry version it last decided for
  bool asked_at_pause_ = false;             // a pause has asked for host-tier memory
  uint64_t placed_ = 0;                     // bytes the last pause that asked placed there
  uint64_t resize_bytes_ = 0;               // kept memory went back oversized: asked for ahead at this size
  uint64_t generation_ = 1;                 // generation()
  bool prefetching_ = false;                // set_prefetching()
  std::function<void()> before_reuse_;      // on_reuse()
};

}  // namespace tmsdisk::shim
