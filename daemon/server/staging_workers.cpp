// SPDX-License-Identifier: Apache-2.0
// The staging workers (staging_workers.h).
#include "staging_workers.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>

#include "host_tier.h"

namespace tmsdisk::server {
namespace {

constexpr int kWorkerNice = 10;

void take_back_now(TierMemory& memory) noexcept {
  try {
    if (auto st = revoke_tier_memory(memory); !st) spdlog::warn("{}", st.error().describe());
  } catch (...) {
    // No memory for the message: the memory went back all the same (revoke forgets it either way).
  }
}

}  // namespace

void StagingRetire::operator()(StagingBuffer* buffer) const noexcept {
  if (!buffer) return;
  if (workers)
    workers->retire(buffer);
  else
    delete buffer;
}

StagingWorkers::StagingWorkers(io::Engine& engine, std::function<void(const std::string&)> before_build)
    : WorkerPool("staging workers"), engine_(engine), before_build_(std::move(before_build)) {
  start_workers(kThreads, [this] { work(); });
}

StagingWorkers::~StagingWorkers() {
  stop_workers();
  // Buffers built for HELLOs the loop never finished: torn down here (retire() sees stopping_).
  Finished left;
  {
    std::lock_guard lock(mu_);
    left = std::move(done_);
  }
}

void StagingWorkers::take_back_tier(TierMemory memory) noexcept {
  if (!memory.fd) return;
  {
    std::unique_lock lock(mu_);
    if (!stopping_) {
      try {
        tier_takebacks_.push_back(std::move(memory));
        lock.unlock();
        cv_.notify_one();
        return;
      } catch (...) {
        // No memory for the queue entry: taken back here, late as it is.
      }
    }
  }
  take_back_now(memory);
}

void StagingWorkers::build(uint64_t conn_id, const std::string& job, uint32_t chunk_bytes, uint32_t slot_count,
                           int claimed_index) {
  {
    std::lock_guard lock(mu_);
    builds_.push_back(BuildJob{conn_id, job, chunk_bytes, slot_count, claimed_index});
  }
  cv_.notify_one();
}

void StagingWorkers::build_tier(uint64_t session_id, uint64_t conn_id, uint64_t request_id, uint64_t bytes,
                                std::string note, std::string object) {
  {
    std::lock_guard lock(mu_);
    TierBuilt t;
    t.session_id = session_id;
    t.conn_id = conn_id;
    t.request_id = request_id;
    t.bytes = bytes;
    t.note = std::move(note);
    t.object = std::move(object);
    tier_builds_.push_back(std::move(t));
  }
  cv_.notify_one();
}

void StagingWorkers::retire(StagingBuffer* buffer) noexcept {
  if (!buffer) return;
  {
    std::unique_lock lock(mu_);
    if (!stopping_) {
      try {
        teardowns_.push_back(buffer);
        lock.unlock();
        cv_.notify_one();
        return;
      } catch (...) {
        // No memory for the queue entry: tearing down here, late as it is, beats leaking a GiB.
      }
    }
  }
  const int slot = buffer->buf_index();
  delete buffer;
  if (slot >= 0) {
    std::lock_guard lock(mu_);
    try {
      done_.emptied_slots.push_back(slot);
      wake_loop();
    } catch (...) {
    }
  }
}

StagingWorkers::Finished StagingWorkers::finished() {
  clear_wakeup();
  std::lock_guard lock(mu_);
  Finished out = std::move(done_);
  done_ = {};
  return out;
}

void StagingWorkers::work() {
  // Zeroing a GiB is CPU work: on a busy node the event loop, which answers everyone, goes first.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kWorkerNice);
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] {
      return stopping_ || !teardowns_.empty() || !tier_takebacks_.empty() || !builds_.empty() || !tier_builds_.empty();
    });
    if (!teardowns_.empty()) {
      StagingBuffer* buffer = teardowns_.front();
      teardowns_.pop_front();
      lock.unlock();
      const int slot = buffer->buf_index();
      delete buffer;  // empties its slot in the kernel, unpins, unmaps, frees
      lock.lock();
      if (slot >= 0) {
        try {
          done_.emptied_slots.push_back(slot);
        } catch (...) {
          // The slot stays claimed: one fewer registered buffer for later sessions, nothing worse.
        }
        wake_loop();
      }
      continue;
    }
    if (!tier_takebacks_.empty()) {
      TierMemory memory = std::move(tier_takebacks_.front());
      tier_takebacks_.pop_front();
      lock.unlock();
      take_back_now(memory);
      lock.lock();
      continue;
    }
    if (stopping_) return;  // builds not started are dropped: nobody will take them
    if (builds_.empty()) {
      TierBuilt tier = std::move(tier_builds_.front());
      tier_builds_.pop_front();
      lock.unlock();
      const auto start = std::chrono::steady_clock::now();
      try {
        if (auto made = make_tier_memory(tier.bytes))
          tier.memory = std::move(made).value();
        else
          tier.error = std::move(made).error();
      } catch (const std::exception& e) {
        tier.error = make_error(ENOMEM, fmt::format("cannot make host-tier memory: {}", e.what()));
      }
      tier.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      lock.lock();
      try {
        done_.tiers.push_back(std::move(tier));
      } catch (...) {
        // No memory to report it: the TIER_ASK is never answered (the shim times out and pauses to
        // disk); its charge stays until the session ends.
      }
      wake_loop();
      continue;
    }
    BuildJob job = std::move(builds_.front());
    builds_.pop_front();
    lock.unlock();
    Built built;
    built.conn_id = job.conn_id;
    built.claimed_index = job.claimed_index;
    try {
      if (before_build_) before_build_(job.job);
      auto made =
          StagingBuffer::create(engine_, job.chunk_bytes, job.slot_count, job.claimed_index, &built.not_registered);
      if (made)
        built.buffer = StagingPtr(std::move(made).value().release(), StagingRetire{this});
      else
        built.error = std::move(made).error();
    } catch (const std::exception& e) {
      built.error = make_error(ENOMEM, fmt::format("cannot build the staging buffer: {}", e.what()));
    }
    lock.lock();
    try {
      done_.built.push_back(std::move(built));
    } catch (...) {
      // No memory to report it: the HELLO is never answered and its connection waits until the
      // client gives up (closing it releases the charge); the buffer, if any, goes now.
      lock.unlock();
      built.buffer.reset();
      lock.lock();
    }
    wake_loop();
  }
}

}  // namespace tmsdisk::server
