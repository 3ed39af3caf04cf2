// SPDX-License-Identifier: Apache-2.0
// The shim's own threads: the control thread (control_thread.cpp) and the one running a pause's callbacks
// (pause_callbacks.cpp).
#pragma once

#include <pthread.h>
#include <signal.h>

namespace tmsdisk::shim {

// Starts fn(arg) on a detached thread named `name` (at most 15 characters). It blocks every signal: a
// SIGINT, SIGCHLD or profiler signal meant for the application must never be delivered to ours
// (heaptrack learned this the hard way). Returns 0 or pthread_create's error.
inline int start_shim_thread(void* (*fn)(void*), void* arg, const char* name) noexcept {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  const int rc = pthread_create(&thread, &attr, fn, arg);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (rc == 0) pthread_setname_np(thread, name);
  return rc;
}

}  // namespace tmsdisk::shim
