// SPDX-License-Identifier: Apache-2.0
// The workers' threads and eventfd (worker_pool.h).
#include "worker_pool.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <system_error>

#include "tmsdisk/common/signal_blocked_thread.h"

namespace tmsdisk::server {

WorkerPool::WorkerPool(const char* what) {
  efd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!efd_) throw std::system_error(errno, std::generic_category(), std::string("eventfd for the ") + what);
}

void WorkerPool::start_workers(unsigned count, const std::function<void()>& work) {
  try {
    threads_.reserve(count);  // so that a started thread always finds its place
    for (unsigned i = 0; i < count; ++i) threads_.push_back(start_signal_blocked_thread(work));
  } catch (...) {
    stop_workers();
    throw;
  }
}

void WorkerPool::stop_workers() noexcept {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
}

void WorkerPool::wake_loop() noexcept {
  const uint64_t one = 1;
  (void)!::write(efd_.get(), &one, sizeof(one));
}

void WorkerPool::clear_wakeup() noexcept {
  uint64_t ignored;
  (void)!::read(efd_.get(), &ignored, sizeof(ignored));
}

}  // namespace tmsdisk::server
