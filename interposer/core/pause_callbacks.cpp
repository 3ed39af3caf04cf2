// SPDX-License-Identifier: Apache-2.0
// tmsdisk_on_pause callbacks (pause_callbacks.h).
#include "pause_callbacks.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>

#include "log.h"
#include "tmsdisk/common/signal_blocked_thread.h"

namespace tmsdisk::shim {
namespace {

// Registered callbacks. Written under g_register_mu and published by g_count (release), so that a
// pause reads them without a lock: a fork child whose parent was registering never blocks on one.
struct Registered {
  std::atomic<PauseCallback> callback{nullptr};
  std::atomic<void*> arg{nullptr};
};
Registered g_registered[kMaxPauseCallbacks];
std::atomic<std::size_t> g_count{0};
std::mutex g_register_mu;

// Callbacks of a pause are running (started, not all returned): the next pause does not start them
// again while an earlier round is stuck (on the GIL, say).
std::atomic<bool> g_running{false};

// One pause's round of callbacks, shared by the control thread (which may stop waiting) and the
// thread that runs them (which may outlive the wait).
struct Round {
  std::size_t count = 0;
  PauseCallback callbacks[kMaxPauseCallbacks] = {};
  void* args[kMaxPauseCallbacks] = {};
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

void* run_round(void* p) noexcept {
  auto* handed = static_cast<std::shared_ptr<Round>*>(p);
  const std::shared_ptr<Round> round = std::move(*handed);
  delete handed;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < round->count; ++i) {
    // C callbacks do not throw; one written in C++ might, and must not end the process.
    try {
      round->callbacks[i](round->args[i]);
    } catch (...) {
      TMS_WARN("a tmsdisk_on_pause callback threw an exception; ignored");
    }
  }
  TMS_DEBUG("pause: %zu callback(s) returned in %lld ms", round->count,
            static_cast<long long>(
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count()));
  g_running.store(false, std::memory_order_release);
  {
    std::lock_guard lock(round->mu);
    round->done = true;
  }
  round->cv.notify_all();
  return nullptr;
}

}  // namespace

int add_pause_callback(PauseCallback callback, void* arg) noexcept {
  if (!callback) return -EINVAL;
  try {
    std::lock_guard lock(g_register_mu);
    const std::size_t n = g_count.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < n; ++i) {
      if (g_registered[i].callback.load(std::memory_order_relaxed) == callback &&
          g_registered[i].arg.load(std::memory_order_relaxed) == arg)
        return 0;  // a start-up module imported twice registers once
    }
    if (n == kMaxPauseCallbacks) return -ENOSPC;
    g_registered[n].callback.store(callback, std::memory_order_relaxed);
    g_registered[n].arg.store(arg, std::memory_order_relaxed);
    g_count.store(n + 1, std::memory_order_release);
    return 0;
  } catch (...) {
    return -ENOMEM;  // the lock could not be taken
  }
}

bool run_pause_callbacks(int timeout_ms) noexcept {
  const std::size_t n = g_count.load(std::memory_order_acquire);
  if (n == 0) return true;
  if (g_running.exchange(true, std::memory_order_acq_rel)) {
    TMS_WARN("pause: the tmsdisk_on_pause callbacks of an earlier pause have not returned; pausing without them");
    return false;
  }
  bool started = false;
  try {
    auto round = std::make_shared<Round>();
    round->count = n;
    for (std::size_t i = 0; i < n; ++i) {
      round->callbacks[i] = g_registered[i].callback.load(std::memory_order_relaxed);
      round->args[i] = g_registered[i].arg.load(std::memory_order_relaxed);
    }
    auto* handed = new std::shared_ptr<Round>(round);
    if (const int rc = start_detached_signal_blocked_thread(&run_round, handed, "tmsdisk-onpause"); rc != 0) {
      delete handed;
      g_running.store(false, std::memory_order_release);
      TMS_WARN("pause: cannot start a thread for the tmsdisk_on_pause callbacks (%s); pausing without them",
               std::strerror(rc));
      return false;
    }
    started = true;
    std::unique_lock lock(round->mu);
    if (!round->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return round->done; })) {
      TMS_WARN(
          "pause: the tmsdisk_on_pause callbacks did not return within %d ms (TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS); "
          "pausing without waiting for them",
          timeout_ms);
      return false;
    }
    return true;
  } catch (...) {
    if (!started) g_running.store(false, std::memory_order_release);  // else the thread clears it
    return false;
  }
}

void clear_pause_callbacks() noexcept {
  std::lock_guard lock(g_register_mu);
  g_count.store(0, std::memory_order_release);
}

void pause_callbacks_fork_child() noexcept {
  new (&g_register_mu) std::mutex;
  g_running.store(false, std::memory_order_relaxed);
}

}  // namespace tmsdisk::shim
