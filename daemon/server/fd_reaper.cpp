// SPDX-License-Identifier: Apache-2.0
#include "fd_reaper.h"

#include <unistd.h>

#include <thread>

#include "tmsdisk/common/signal_blocked_thread.h"

namespace tmsdisk::server {

FdReaper::~FdReaper() {
  if (!state_) return;
  std::lock_guard lock(state_->mu);
  state_->stop = true;
  state_->cv.notify_all();
}

void FdReaper::discard(UniqueFd fd) noexcept {
  if (!fd) return;
  try {
    if (!state_) {
      auto st = std::make_shared<State>();
      // Signals stay with the main thread (SIGTERM handling).
      start_signal_blocked_thread([st] {
        std::unique_lock lock(st->mu);
        for (;;) {
          st->cv.wait(lock, [&] { return st->stop || !st->fds.empty(); });
          if (st->fds.empty()) return;  // stopping, nothing left
          const int fd = st->fds.front();
          st->fds.pop_front();
          lock.unlock();
          ::close(fd);
          lock.lock();
        }
      }).detach();
      state_ = std::move(st);
    }
    std::lock_guard lock(state_->mu);
    state_->fds.push_back(fd.get());
    fd.release();
    state_->cv.notify_one();
  } catch (...) {
    // No thread or no memory: closing here is the lesser evil.
  }
}

}  // namespace tmsdisk::server
