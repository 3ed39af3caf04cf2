// SPDX-License-Identifier: Apache-2.0
// Shared setup for the simcuda tests: a private capacity ledger, two small devices, the primary
// context of device 0 current, and a helper that runs code in a forked child.
#pragma once

#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>

#include "simcuda/simcuda.h"

namespace simtest {

inline constexpr size_t kGran = size_t{2} << 20;
inline constexpr uint64_t kCapacity = uint64_t{64} << 20;  // SIMCUDA_DEVICE_MEM_MB below

// Reads the environment once, like simcuda: set it before the first cuInit of the process. Fork
// children start over with their own cuInit and find the same settings, hence the same ledger.
inline CUcontext setup() {
  static CUcontext primary = [] {
    std::string path = "/dev/shm/simcuda-test-XXXXXX";
    int fd = mkstemp(path.data());
    if (fd < 0) {
      path = "/tmp/simcuda-test-XXXXXX";
      fd = mkstemp(path.data());
    }
    if (fd < 0) {
      std::perror("mkstemp");
      std::abort();
    }
    close(fd);
    static std::string state = path;
    static pid_t owner = getpid();
    std::atexit([] {
      if (getpid() == owner) unlink(state.c_str());
    });
    setenv("SIMCUDA_STATE", state.c_str(), 1);
    setenv("SIMCUDA_DEVICE_COUNT", "2", 1);
    setenv("SIMCUDA_DEVICE_MEM_MB", "64", 1);
    unsetenv("SIMCUDA_FAIL_AFTER_CREATES");
    if (cuInit(0) != CUDA_SUCCESS) std::abort();
    CUcontext c = nullptr;
    if (cuDevicePrimaryCtxRetain(&c, 0) != CUDA_SUCCESS) std::abort();
    return c;
  }();
  cuCtxSetCurrent(primary);
  return primary;
}

// For a forked child: a fresh driver, and device 0's primary context current.
inline CUresult child_setup() {
  if (CUresult r = cuInit(0); r != CUDA_SUCCESS) return r;
  CUcontext c = nullptr;
  if (CUresult r = cuDevicePrimaryCtxRetain(&c, 0); r != CUDA_SUCCESS) return r;
  return cuCtxSetCurrent(c);
}

// Runs `fn` in a forked child, which exits with fn's result through exit(), so destructors (and
// simcuda's exit hook) run; returns the exit status, or 128 + signal.
inline int run_in_child(const std::function<int()>& fn) {
  std::cout.flush();
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
    }
    std::exit(rc);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// A latch a stream's host function blocks on, so work queued behind it provably waits.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;

  static void CUDA_CB wait(void* self) {
    auto* g = static_cast<Gate*>(self);
    std::unique_lock<std::mutex> lk(g->mu);
    g->cv.wait(lk, [g] { return g->open; });
  }
  void release() {
    std::lock_guard<std::mutex> lk(mu);
    open = true;
    cv.notify_all();
  }
};

inline CUmemAllocationProp device_prop(int dev, bool fd_shareable = false) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes = fd_shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return p;
}

inline CUmemAccessDesc rw(int dev) {
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

}  // namespace simtest
