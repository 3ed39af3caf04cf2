// SPDX-License-Identifier: Apache-2.0
// The hash workers (hash_workers.h).
#include "hash_workers.h"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace tmsdisk::server {

unsigned automatic_hash_threads() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cpus <= 0) cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return static_cast<unsigned>(std::clamp(cpus / 2, 2, 8));
}

HashWorkers::HashWorkers(unsigned threads, std::function<void()> before_hash)
    : WorkerPool("hash workers"), before_hash_(std::move(before_hash)) {
  start_workers(std::max(threads, 1u), [this] { work(); });
}

HashWorkers::~HashWorkers() {
  stop();
}

bool HashWorkers::submit(const Job& job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    queue_.push_back(job);
  }
  cv_.notify_one();
  return true;
}

void HashWorkers::finished(std::vector<Done>& out) {
  clear_wakeup();
  std::lock_guard lock(mu_);
  if (out.empty()) {
    out.swap(done_);
  } else {
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
  }
}

void HashWorkers::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;  // at once with the queue cleared: nothing submitted from here on is hashed
    queue_.clear();
  }
  stop_workers();
}

void HashWorkers::work() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const Job job = queue_.front();
    queue_.pop_front();
    lock.unlock();
    if (before_hash_) before_hash_();
    const Done done{job.tag, storage::RankStore::hash_chunk(job.xxh64, {job.bytes, job.length})};
    lock.lock();
    try {
      done_.push_back(done);
    } catch (...) {
      // No memory to hand it back: its WRITE is never answered, its slot never freed, and its session
      // stays until the daemon stops. Not reached in practice (done_ holds at most the jobs in flight,
      // bounded by the sessions' slots); nothing better is possible without memory.
      continue;
    }
    // The loop is woken once per batch: it takes all that is done when it wakes.
    if (done_.size() == 1) wake_loop();
  }
}

}  // namespace tmsdisk::server
