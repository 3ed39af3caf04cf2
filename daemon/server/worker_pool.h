// SPDX-License-Identifier: Apache-2.0
// What the hash workers (hash_workers.h) and the staging workers (staging_workers.h) share: a few
// threads of their own waiting on one lock and condition for the queues the derived class keeps, and
// an eventfd in the event loop's epoll set through which they tell the loop that something is done.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

class WorkerPool {
 public:
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Readable while the derived class has something done for the loop.
  int event_fd() const noexcept { return efd_.get(); }

 protected:
  // Makes the eventfd; throws std::system_error ("eventfd for the <what>") when it cannot.
  explicit WorkerPool(const char* what);
  // The threads run the derived class's code on its members: its destructor calls stop_workers().
  ~WorkerPool() = default;

  // Starts `count` threads running `work`, the derived class's loop (it returns once it sees
  // stopping_). Last in the derived constructor: the threads use what it made. Signals stay with the
  // main thread (SIGTERM handling). If a thread cannot be started, stops those that were and rethrows.
  void start_workers(unsigned count, const std::function<void()>& work);
  // Sets stopping_, wakes every worker and waits for them. Idempotent.
  void stop_workers() noexcept;
  unsigned worker_count() const noexcept { return static_cast<unsigned>(threads_.size()); }

  // Wakes the event loop.
  void wake_loop() noexcept;
  // Clears the eventfd: the loop, before it takes what is done.
  void clear_wakeup() noexcept;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // under mu_

 private:
  UniqueFd efd_;
  std::vector<std::thread> threads_;
};

}  // namespace tmsdisk::server
