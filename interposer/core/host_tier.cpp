// SPDX-License-Identifier: Apache-2.0
// The rank's host-tier memory and the client that negotiates it with tmsdiskd (host_tier.h).
#include "host_tier.h"

#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <utility>
#include <variant>

#include "config.h"
#include "driver.h"
#include "log.h"
#include "registry.h"

namespace tmsdisk::shim {
namespace {

// The rank's memory has not changed for this long: its host-tier memory is asked for ahead of a pause.
constexpr int64_t kAheadQuietMs = 2000;
// Kept host-tier memory beyond what the last pause placed there, an eighth more and this much more,
// goes back (and is asked for again ahead of the next pause at the size that pause placed).
constexpr uint64_t kKeepSlackBytes = 64ull << 20;

}  // namespace

Status HostTier::take(UniqueFd memory, uint64_t bytes, CUcontext ctx) {
  release();
  if (!memory || bytes == 0 || !RegisteredMapping::holds(memory.get(), bytes))
    return make_error(EPROTO, "tmsdiskd's TIER_GRANT has no usable host-tier memory");
  if (Status st = mapping_.map(memory.get(), bytes, "host-tier memory"); !st) return st;
  fd_ = std::move(memory);
  (void)::madvise(mapping_.data(), mapping_.bytes(), MADV_HUGEPAGE);  // as the daemon asked when it made the memory
  // Pinning walks every page (the daemon faulted them in already): timed, as it is part of the pause.
  if (!RegisteredMapping::can_pin()) return {};
  timespec t0, t1;
  ::clock_gettime(CLOCK_MONOTONIC, &t0);
  const CUresult r = mapping_.pin(ctx);
  ::clock_gettime(CLOCK_MONOTONIC, &t1);
  if (r == CUDA_SUCCESS) {
    TMS_INFO("host tier: %llu bytes mapped and registered in %.3f s", static_cast<unsigned long long>(bytes),
             static_cast<double>(t1.tv_sec - t0.tv_sec) + static_cast<double>(t1.tv_nsec - t0.tv_nsec) / 1e9);
  } else {
    TMS_WARN("cannot pin the host-tier memory (cuMemHostRegister failed: %s (%d)); its copies will be slower",
             cu_error_name(r), static_cast<int>(r));
  }
  return {};
}

void HostTier::release() noexcept {
  if (!mapping_.mapped()) return;
  mapping_.release();
  fd_.reset();
}

void HostTier::forget_after_fork() noexcept {
  mapping_.forget_after_fork();
  fd_.reset();
}

// ---------------------------------------------------------------------------------------------
// The client

void HostTierClient::place(std::vector<TransferJob>& jobs, CUcontext ctx) {
  const uint32_t chunk = staging_.chunk_bytes();
  uint64_t wanted = 0;
  for (const TransferJob& j : jobs) wanted += j.chunks * uint64_t{chunk};
  if (!config().host_tier || wanted == 0 || chunk == 0) return;
  uint64_t slots = 0, next = 0;
  if (memory_.held() && in_use()) {
    // Chunks of an earlier pause (another tag's) lie in it: this pause takes what is free after them
    // (memory asked for ahead holds the whole process's), and the rest goes to disk. The daemon is not
    // asked: it grants no more while the memory holds paused chunks.
    const uint64_t end = paused_end();
    if (end >= memory_.bytes()) {
      TMS_DEBUG("the host-tier memory is full of an earlier pause's chunks; this one goes to disk");
      return;
    }
    next_generation();  // retained copies after those chunks are overwritten
    slots = (memory_.bytes() - end) / chunk;
    next = end / chunk;
    placed_ += std::min(slots * chunk, wanted);
  } else {
    asked_at_pause_ = true;
    placed_ = 0;
    const uint64_t usable = obtain(wanted, 0, ctx);
    if (usable == 0) return;
    placed_ = std::min(usable, wanted);
    slots = usable / chunk;
  }
  // The first disk chunks, in order, up to the grant: a job's host chunks lie one after another.
  for (TransferJob& j : jobs) {
    if (slots == 0) break;
    const uint64_t all = (j.a->size + chunk - 1) / chunk;
    if (j.place.size() < all) j.place.resize(all, ChunkPlace::Disk);
    const uint64_t first = next;
    for (uint64_t i = 0; i < all && slots > 0; ++i) {
      if (j.place[i] != ChunkPlace::Disk) continue;
      j.place[i] = ChunkPlace::Host;
      --slots;
      ++next;
    }
    if (next != first) {
      j.host = memory_.base() + first * chunk;
      j.a->host_offset = first * chunk;
    }
    count_disk_chunks(j, chunk);
  }
}

uint64_t HostTierClient::room_for_prefetch(uint64_t wanted, CUcontext ctx, uint64_t* offset) {
  *offset = 0;
  const uint64_t chunk = staging_.chunk_bytes();
  if (!config().host_tier || wanted == 0 || chunk == 0) return 0;
  if (memory_.held() && in_use()) {
    // After the paused chunks; what lies beyond (resumed allocations' retained copies) is overwritten.
    next_generation();
    const uint64_t end = paused_end();
    *offset = end;
    return memory_.bytes() > end ? (memory_.bytes() - end) / chunk * chunk : 0;
  }
  asked_at_pause_ = true;
  const uint64_t usable = obtain(wanted, 0, ctx) / chunk * chunk;
  placed_ = std::min(usable, wanted);
  return usable;
}

uint64_t HostTierClient::obtain(uint64_t wanted, uint8_t ask_flags, CUcontext ctx) {
  next_generation();  // whatever the memory is used for next overwrites what it held
  const bool ahead = ask_flags & proto::kTierAskAhead;
  const char* fallback = ahead ? "its first pause asks again" : "every chunk goes to disk";
  // Twice at most: a rank told to release what it kept (kTierReleaseFirst) asks again.
  for (int attempt = 0; attempt < 2; ++attempt) {
    proto::Envelope reply;
    UniqueFd memory;
    if (Status st = session_.exchange(proto::TierAsk{.bytes = wanted, .flags = ask_flags}, -1, reply, &memory); !st) {
      TMS_WARN("no host tier %s (%s); %s", ahead ? "ahead of a pause" : "for this pause", st.error().message.c_str(),
               fallback);
      return 0;
    }
    // Any TIER_RECLAIM of the memory kept until now came before this answer: the ask ended that.
    reclaimed_ = false;
    kept_told_ = false;
    const auto* grant = std::get_if<proto::TierGrant>(&reply.body);
    if (!grant) {
      TMS_WARN("unexpected answer to TIER_ASK; %s", fallback);
      return 0;
    }
    if (!grant->note.empty()) TMS_INFO("host tier%s: %s", ahead ? " ahead of a pause" : "", grant->note.c_str());
    keep_ = grant->flags & proto::kTierKeep;
    // Memory asked for ahead is kept from the start: the daemon counts it so without a TIER_KEEP.
    kept_told_ = ahead;
    if (grant->flags & proto::kTierReleaseFirst) {
      give_back();
      continue;
    }
    if (grant->flags & proto::kTierReuse) {
      if (!memory_.held()) {
        // It still counts memory this rank let go of while disconnected: it counts it no more.
        TMS_WARN("tmsdiskd says to reuse host-tier memory this rank does not hold; %s", fallback);
        give_back();
        return 0;
      }
      return std::min(grant->bytes, memory_.bytes());
    }
    if (grant->bytes == 0) return 0;
    memory_.release();  // nothing held unless the daemon forgot it (it counts only the new grant)
    if (Status st = memory_.take(std::move(memory), grant->bytes, ctx); !st) {
      TMS_WARN("cannot use the host tier (%s); %s", st.error().message.c_str(), fallback);
      give_back();
      return 0;
    }
    return grant->bytes;
  }
  return 0;
}

void HostTierClient::tick(int64_t now) {
  if (reclaimed_) settle();  // another rank's pause waits for the memory this one kept
  ask_ahead(now);
}

void HostTierClient::ask_ahead(int64_t now) {
  if (!config().host_tier || !session_.connected() || reclaimed_) return;
  if (const uint64_t want = std::exchange(resize_bytes_, 0); want && !memory_.held()) {
    // Kept memory went back, larger than the last pause needed: asked for again at that pause's size.
    CUcontext ctx = nullptr;
    for (const auto& a : registry().snapshot()) {
      if (a->state.load() != AllocState::Resident || a->app_vmm || !a->ctx) continue;
      ctx = a->ctx;
      break;
    }
    if (!ctx) return;
    const uint64_t got = obtain(want, proto::kTierAskAhead, ctx);
    if (got) TMS_INFO("host tier: %llu bytes ready ahead of the next pause", static_cast<unsigned long long>(got));
    return;
  }
  if (asked_at_pause_) return;
  const uint64_t version = registry().version();
  if (version != ahead_version_) {
    ahead_version_ = version;
    ahead_quiet_since_ms_ = now;
    return;
  }
  if (now - ahead_quiet_since_ms_ < kAheadQuietMs || version == ahead_decided_version_) return;
  // What a pause would want now: the memory it would back up, in whole chunks (its zero chunks, and
  // what the program frees before the pause, such as PyTorch's cache, are not known before it: at
  // most the rank's fair share is granted either way, and settle() sizes it again after the first
  // pause).
  const uint64_t chunk = staging_.chunk_bytes();
  if (chunk == 0) return;
  uint64_t want = 0;
  CUcontext ctx = nullptr;
  for (const auto& a : registry().snapshot()) {
    if (a->state.load() != AllocState::Resident) return;  // a pause is in place: its own ask decided
    if (a->policy != Policy::Backup || a->pinned.load() >= 0 || a->app_vmm) continue;
    want += (a->size + chunk - 1) / chunk * chunk;
    if (!ctx) ctx = a->ctx;
  }
  // Decided for this state of the registry: looked at again once an allocation comes or goes.
  ahead_decided_version_ = version;
  // Asked for about this much already (granted, or refused with its reason in the log): again only
  // after the memory grew by a quarter.
  if (want == 0 || want <= ahead_asked_bytes_ + ahead_asked_bytes_ / 4) return;
  if (memory_.held() && memory_.bytes() >= want) return;
  ahead_asked_bytes_ = want;
  // What the first pause would otherwise make first: the scan kernel, the copy stream and its events.
  warm_(ctx);
  const uint64_t got = obtain(want, proto::kTierAskAhead, ctx);
  if (got) TMS_INFO("host tier: %llu bytes ready ahead of the next pause", static_cast<unsigned long long>(got));
}

void HostTierClient::settle() {
  if (!memory_.held()) return;
  // After the operation's answer (unpinning and freeing a GiB takes a good part of a second, which
  // nobody needs to wait for), under the op lock: paused allocations' placement is read.
  std::unique_lock lock(op_lock_);
  if (in_use()) return;
  // More than the last pause placed (memory asked for ahead of a pause that found much of it zero, or
  // sized before PyTorch emptied its cache): given back, so that the node's budget counts what is
  // used, and asked for again ahead of the next pause at the size this one placed.
  const bool oversized = placed_ && memory_.bytes() > placed_ + placed_ / 8 + kKeepSlackBytes;
  if (keep_ && !reclaimed_ && !oversized) {
    if (!kept_told_ && session_.connected()) {
      // No answer: the daemon marks the memory as kept (another rank's pause may reclaim it).
      if (session_.send(session_.next_id(), proto::TierKeep{}) >= 0) kept_told_ = true;
    }
    return;
  }
  if (keep_ && !reclaimed_ && oversized) resize_bytes_ = placed_;
  give_back();
}

uint64_t HostTierClient::paused_end() const {
  const uint64_t chunk = staging_.chunk_bytes();
  uint64_t end = 0;
  for (const auto& a : registry().snapshot()) {
    if (a->state.load() != AllocState::Paused) continue;
    if (const uint64_t host = host_chunks(a->placement)) end = std::max(end, a->host_offset + host * chunk);
  }
  return end;
}

bool HostTierClient::in_use() const {
  if (prefetching_) return true;
  for (const auto& a : registry().snapshot())
    if (a->state.load() == AllocState::Paused &&
        std::find(a->placement.begin(), a->placement.end(), ChunkPlace::Host) != a->placement.end())
      return true;
  return false;
}

bool HostTierClient::yield_to_objects() {
  // The objects of a step are opened one after another: the ask ahead waits until they are quiet too.
  ahead_quiet_since_ms_ = now_ms();
  if (!memory_.held() || in_use()) return false;
  TMS_INFO("host tier: %llu bytes held for a pause given back first: the rank's objects come first in its share",
           static_cast<unsigned long long>(memory_.bytes()));
  give_back();
  ahead_asked_bytes_ = 0;
  ahead_decided_version_ = ~0ull;
  return true;
}

void HostTierClient::next_generation() {
  if (before_reuse_) before_reuse_();
  ++generation_;
}

void HostTierClient::give_back() {
  next_generation();
  memory_.release();
  kept_told_ = false;
  reclaimed_ = false;
  // Not connected: a daemon that adopts this session on reconnect is told then (session_started).
  if (!session_.connected()) return;
  proto::Envelope reply;
  if (Status st = session_.exchange(proto::TierRelease{}, -1, reply, nullptr); !st)
    TMS_WARN("cannot tell tmsdiskd the host-tier memory is released: %s", st.error().message.c_str());
}

void HostTierClient::session_started(bool adopted) {
  if (memory_.held() && !adopted && !in_use()) {
    // Kept for a pause to come, by a daemon that is gone: the new one never counted it.
    next_generation();
    memory_.release();
    kept_told_ = false;
  }
  if (!adopted) {  // a new daemon: asked again ahead of a first pause
    ahead_asked_bytes_ = 0;
    ahead_decided_version_ = ~0ull;
  }
  if (config().host_tier && adopted && !memory_.held()) {
    // The daemon kept our session, and counts host-tier memory we may have let go of meanwhile.
    give_back();
  }
  if (memory_.held() && !adopted) {
    // A new daemon (or one that dropped our session): it counts our host-tier memory, which holds
    // paused chunks, again.
    const uint64_t id = session_.next_id();
    proto::Envelope reply;
    Status st = session_.send(id, proto::TierAdopt{}, memory_.fd()) < 0 ? make_error(EPIPE, "cannot send TIER_ADOPT")
                                                                        : session_.await_reply(id, reply);
    if (st && std::holds_alternative<proto::ErrorReply>(reply.body))
      st = make_error(EPROTO, std::get<proto::ErrorReply>(reply.body).message);
    if (!st)
      TMS_WARN("tmsdiskd does not count this rank's host-tier memory (%s); the paused chunks there are kept",
               st.error().message.c_str());
  }
}

}  // namespace tmsdisk::shim
