// SPDX-License-Identifier: Apache-2.0
// Threads of our own that no signal is delivered to. The shim runs inside programs with their own
// handlers (SIGINT, SIGCHLD, a profiler's SIGPROF): one delivered to a shim thread runs the host's
// handler where it never expected to run (heaptrack learned this the hard way). tmsdiskd keeps its
// signals with the main thread, which handles SIGTERM. A thread inherits its creator's signal mask, so
// each is started with every signal blocked, and the creator's mask is put back after.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace tmsdisk {

// Blocks every signal on the calling thread for its lifetime, then restores the mask it found (also
// when the thread start it guards throws).
class AllSignalsBlocked {
 public:
  AllSignalsBlocked() noexcept {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  ~AllSignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  AllSignalsBlocked(const AllSignalsBlocked&) = delete;
  AllSignalsBlocked& operator=(const AllSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

// std::thread(fn, args...) with every signal blocked. Throws what std::thread throws
// (std::system_error when no thread can be started); the caller's mask is restored either way.
template <class Fn, class... Args>
[[nodiscard]] std::thread start_signal_blocked_thread(Fn&& fn, Args&&... args) {
  AllSignalsBlocked blocked;
  return std::thread(std::forward<Fn>(fn), std::forward<Args>(args)...);
}

// For code that must never throw (the shim): starts fn(arg) on a detached thread named `name` (at most
// 15 characters) with every signal blocked, through pthread_create itself (no allocation, nothing to
// throw). Returns 0 or pthread_create's error.
inline int start_detached_signal_blocked_thread(void* (*fn)(void*), void* arg, const char* name) noexcept {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  int rc;
  {
    AllSignalsBlocked blocked;
    rc = pthread_create(&thread, &attr, fn, arg);
  }
  pthread_attr_destroy(&attr);
  if (rc == 0) pthread_setname_np(thread, name);
  return rc;
}

}  // namespace tmsdisk
