// SPDX-License-Identifier: Apache-2.0
// Paused memory brought back close ahead of its resume (prefetch.h).
#include "prefetch.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "config.h"
#include "log.h"

namespace tmsdisk::shim {
namespace {

uint64_t chunks_of(const Allocation& a, uint64_t chunk) noexcept {
  return (a.size + chunk - 1) / chunk;
}

}  // namespace

OpResult Prefetcher::command(const std::string& tag) {
  std::optional<TagId> id;
  if (!tag.empty()) {
    if (!valid_tag_name(tag)) return OpResult{make_error(EINVAL, "a tag is 1 to 63 of A-Z a-z 0-9 _ . -")};
    id = find_tag(tag);
    if (!id) return OpResult::no_op(fmt::format("no allocation carries tag {}", tag));
  }
  if (!session_.connected())
    if (Status st = session_.connect(); !st) return OpResult{std::move(st)};
  Result<uint64_t> planned = start(id);
  if (!planned) return OpResult{std::move(planned).error()};
  if (*planned == 0) return OpResult::no_op("nothing paused is on disk: all of it is in memory already, or zero");
  return OpResult({}, *planned, 0, fmt::format("reading {} bytes into the host tier ahead of the resume", *planned));
}

Result<uint64_t> Prefetcher::start(std::optional<TagId> tag) {
  stop();
  if (!config().host_tier)
    return make_error(ENOTSUP, "the host tier is off for this process (TMSDISK_HOST_TIER=0): nothing to read into");
  const uint64_t chunk = slots_.chunk_bytes();
  if (chunk == 0) return make_error(ENOTCONN, "no session with tmsdiskd");
  uint64_t wanted = 0;
  CUcontext ctx = nullptr;
  std::shared_lock lock(op_lock_);
  for (const auto& a : registry().snapshot()) {
    if (a->state.load() != AllocState::Paused || a->policy != Policy::Backup || a->damage.load() != 0 ||
        (tag && a->tag != *tag))
      continue;  // as next_batch() chooses: a damaged backup is not read ahead
    for (uint64_t c = 0; c < chunks_of(*a, chunk); ++c)
      if (place_at(a->placement, c) == ChunkPlace::Disk) wanted += chunk;
    if (!ctx) ctx = a->ctx;
  }
  if (wanted == 0) return uint64_t{0};  // nothing of it on disk: all there is to read is in memory already
  uint64_t offset = 0;
  const uint64_t room = tier_.room_for_prefetch(wanted, ctx, &offset);
  if (room == 0)
    return make_error(ENOSPC,
                      "the node's host tier has no room for this rank now (its log says why); the resume "
                      "reads from disk");
  tag_ = tag;
  next_offset_ = offset;
  room_end_ = offset + room;
  tier_.set_prefetching(true);
  std::lock_guard guard(mu_);
  active_ = true;
  outcome_ = {};
  TMS_INFO("prefetch: reading up to %llu of %llu bytes on disk into the host tier",
           static_cast<unsigned long long>(std::min(room, wanted)), static_cast<unsigned long long>(wanted));
  return std::min(room, wanted);
}

bool Prefetcher::next_batch(Batch& b) const {
  const uint64_t chunk = slots_.chunk_bytes();
  for (const auto& a : registry().snapshot()) {
    if (a->state.load() != AllocState::Paused || a->policy != Policy::Backup || a->damage.load() != 0 ||
        (tag_ && a->tag != *tag_))
      continue;
    const uint64_t all = chunks_of(*a, chunk);
    const uint64_t host = host_chunks(a->placement);
    // An allocation's host chunks lie one after another: it continues only where the free part begins.
    if (host > 0 && a->host_offset + host * chunk != next_offset_) continue;
    b = Batch{.a = a, .host_chunks = host, .chunks = {}};
    uint64_t offset = next_offset_;
    for (uint64_t c = 0; c < all && b.chunks.size() * chunk < kBatchBytes && offset + chunk <= room_end_; ++c) {
      if (place_at(a->placement, c) != ChunkPlace::Disk) continue;
      b.chunks.push_back(c);
      offset += chunk;
    }
    if (!b.chunks.empty()) return true;
  }
  return false;
}

Status Prefetcher::read(const Batch& b) {
  const Allocation& a = *b.a;
  const uint64_t chunk = slots_.chunk_bytes();
  const HostTier& memory = tier_.memory();
  if (!memory.held() || room_end_ > memory.bytes()) return make_error(EIO, "the host-tier memory went");
  // Runs of consecutive chunk indexes, each to the next free chunks of the memory.
  std::vector<TransferJob> jobs;
  uint64_t offset = next_offset_;
  for (std::size_t i = 0; i < b.chunks.size(); ++i) {
    const uint64_t c = b.chunks[i];
    const uint64_t length = std::min(chunk, a.size - c * chunk);
    if (i > 0 && b.chunks[i - 1] + 1 == c) {
      jobs.back().size += length;
    } else {
      TransferJob& j = jobs.emplace_back();
      j.base = reinterpret_cast<CUdeviceptr>(memory.base() + offset);
      j.size = length;
      j.blob = a.id;
      j.blob_offset = c * chunk;
      j.host_memory = true;
    }
    offset += chunk;
  }
  if (!session_.connected())
    if (Status st = session_.connect(); !st) return st;
  if (std::optional<Error> failed = pipeline_.run_plain(Direction::FromStorage, jobs)) return std::move(*failed);
  return {};
}

bool Prefetcher::step() noexcept {
  {
    std::lock_guard guard(mu_);
    if (!active_) return false;
  }
  try {
    std::unique_lock lock(op_lock_);
    Batch b;
    if (!next_batch(b)) {
      lock.unlock();
      finish({});
      return false;
    }
    // Not held across the reads: frees of managed memory take it shared, and the process runs on.
    // Pauses and resumes, which change placements, run on this thread only.
    lock.unlock();
    if (Status st = read(b); !st) {
      TMS_WARN("prefetch stopped: %s; the resume reads the rest from disk", st.error().message.c_str());
      finish(std::move(st));
      return false;
    }
    lock.lock();
    // Read and verified: the chunks are host chunks now (their bytes stay on disk too).
    Allocation& a = *b.a;
    if (a.state.load() != AllocState::Paused) return true;  // freed meanwhile: its reads are for nothing
    const uint64_t chunk = slots_.chunk_bytes();
    if (a.placement.size() < chunks_of(a, chunk)) a.placement.resize(chunks_of(a, chunk), ChunkPlace::Disk);
    for (uint64_t c : b.chunks) a.placement[c] = ChunkPlace::Host;
    if (b.host_chunks == 0) a.host_offset = next_offset_;
    next_offset_ += b.chunks.size() * chunk;
    return true;
  } catch (...) {
    finish(make_error(ENOMEM, "out of memory prefetching"));
    return false;
  }
}

void Prefetcher::stop() noexcept {
  finish({});
}

void Prefetcher::finish(Status st) noexcept {
  std::lock_guard guard(mu_);
  if (!active_) return;
  tier_.set_prefetching(false);  // what it read is paused chunks now, in use as any
  active_ = false;
  outcome_ = std::move(st);
  cv_.notify_all();
}

Status Prefetcher::wait() noexcept {
  try {
    std::unique_lock guard(mu_);
    cv_.wait(guard, [&] { return !active_; });
    return outcome_;
  } catch (...) {
    return make_error(ENOMEM, "out of memory waiting for a prefetch");
  }
}

}  // namespace tmsdisk::shim
