// SPDX-License-Identifier: Apache-2.0
// A CUDA program that keeps the GPU busy while it may be paused from outside: worker threads, each
// on its own stream, launch simcuda_add_u32 on their buffer and copy it in a loop, checking what they
// copy back. Runs on simcuda only (the module image is simcuda's builtin one). Driven on stdin:
//
//   start                 start the workers                           -> "ok"
//   stop                  stop them, verify every buffer and the
//                         context (no asynchronous error)             -> "ok ADDS" | "bad WHY"
//   launch                one add on the probe buffer, synchronized   -> "ok STATE" | "err CODE"
//                         (STATE: tmsdisk_status().state right after the launch returned, -1 without the shim)
//   probe N               the probe buffer holds N in every word      -> "ok" | "bad WHY"
//   memop N               cuStreamWriteValue32 of N to the probe
//                         buffer's first word, synchronized          -> "ok WORD0" | "err CODE"
//   capture begin|end     stream capture on a stream of its own       -> "ok" | "err CODE"
//   api pause|resume      the in-process C API                        -> "ok" | "err ERRNO"
//   exit
#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tmsdisk.h"

namespace {

constexpr size_t kBufferBytes = 2u << 20;  // managed (TMSDISK_MIN_BYTES default)
constexpr size_t kScratchBytes = 64u << 10;
constexpr size_t kWords = kBufferBytes / 4;
constexpr int kCheckEvery = 8;

CUmodule g_module;
CUfunction g_add;
CUcontext g_ctx;

CUresult launch_add(CUdeviceptr ptr, uint32_t value, size_t count, CUstream stream) {
  void* params[] = {&ptr, &value, &count};
  return cuLaunchKernel(g_add, 1, 1, 1, 1, 1, 1, 0, stream, params, nullptr);
}

struct Worker {
  int index = 0;
  CUstream stream = nullptr;
  CUdeviceptr buffer = 0, scratch = 0;
  std::vector<uint32_t> host = std::vector<uint32_t>(kScratchBytes / 4);
  uint64_t adds = 0;
  std::string error;
  std::thread thread;

  bool setup() {
    return cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
           cuMemAlloc(&buffer, kBufferBytes) == CUDA_SUCCESS && cuMemAlloc(&scratch, kScratchBytes) == CUDA_SUCCESS &&
           cuMemsetD32Async(buffer, 0, kWords, stream) == CUDA_SUCCESS && cuStreamSynchronize(stream) == CUDA_SUCCESS;
  }

  void fail(const char* what, CUresult r) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "worker %d: %s returned %d after %llu adds", index, what, static_cast<int>(r),
                  static_cast<unsigned long long>(adds));
    error = buf;
  }

  void run(const std::atomic<bool>& stop) {
    cuCtxSetCurrent(g_ctx);
    // Odd workers copy through the synchronous API, even ones asynchronously: both are gated.
    while (!stop.load(std::memory_order_relaxed)) {
      if (CUresult r = launch_add(buffer, 1, kWords, stream); r != CUDA_SUCCESS) return fail("cuLaunchKernel", r);
      ++adds;
      const size_t off = (adds * 4096) % (kBufferBytes - kScratchBytes);
      if (CUresult r = cuMemcpyDtoDAsync(scratch, buffer + off, kScratchBytes, stream); r != CUDA_SUCCESS)
        return fail("cuMemcpyDtoDAsync", r);
      if (adds % kCheckEvery != 0) continue;
      CUresult r;
      if (index % 2) {
        if ((r = cuStreamSynchronize(stream)) != CUDA_SUCCESS) return fail("cuStreamSynchronize", r);
        r = cuMemcpyDtoH(host.data(), scratch, kScratchBytes);
      } else {
        r = cuMemcpyDtoHAsync(host.data(), scratch, kScratchBytes, stream);
        if (r == CUDA_SUCCESS) r = cuStreamSynchronize(stream);
      }
      if (r != CUDA_SUCCESS) return fail("copy to host", r);
      for (uint32_t v : host) {
        if (v != adds) {
          char buf[128];
          std::snprintf(buf, sizeof buf, "worker %d: read %u after %llu adds", index, v,
                        static_cast<unsigned long long>(adds));
          error = buf;
          return;
        }
      }
    }
  }

  std::string verify() {
    if (!error.empty()) return error;
    if (CUresult r = cuStreamSynchronize(stream); r != CUDA_SUCCESS) return "final cuStreamSynchronize failed";
    std::vector<uint32_t> all(kWords);
    if (cuMemcpyDtoH(all.data(), buffer, kBufferBytes) != CUDA_SUCCESS) return "final copy failed";
    for (size_t i = 0; i < kWords; ++i)
      if (all[i] != adds)
        return "worker " + std::to_string(index) + ": word " + std::to_string(i) + " is " + std::to_string(all[i]) +
               ", expected " + std::to_string(adds);
    return {};
  }
};

int shim_state() {
  using StatusFn = int (*)(struct tmsdisk_status*, size_t);
  auto fn = reinterpret_cast<StatusFn>(dlsym(RTLD_DEFAULT, "tmsdisk_status"));
  struct tmsdisk_status st {};
  if (!fn || fn(&st, sizeof st) != 0) return -1;
  return static_cast<int>(st.state);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int threads = argc > 1 ? std::atoi(argv[1]) : 4;
  CUdevice dev;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&g_ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS ||
      cuModuleLoadData(&g_module, "simcuda") != CUDA_SUCCESS ||
      cuModuleGetFunction(&g_add, g_module, "simcuda_add_u32") != CUDA_SUCCESS) {
    std::printf("err setup\n");
    return 1;
  }
  std::vector<Worker> workers(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) {
    workers[static_cast<size_t>(i)].index = i;
    if (!workers[static_cast<size_t>(i)].setup()) {
      std::printf("err worker setup\n");
      return 1;
    }
  }
  CUdeviceptr probe = 0;
  CUstream capture_stream = nullptr;
  if (cuMemAlloc(&probe, kBufferBytes) != CUDA_SUCCESS || cuMemsetD32(probe, 0, kWords) != CUDA_SUCCESS ||
      cuStreamCreate(&capture_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    std::printf("err probe setup\n");
    return 1;
  }
  std::printf("ready\n");

  std::atomic<bool> stop{false};
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "start") {
      stop = false;
      for (auto& w : workers) w.thread = std::thread([&w, &stop] { w.run(stop); });
      std::printf("ok\n");
    } else if (cmd == "stop") {
      stop = true;
      uint64_t adds = 0;
      std::string bad;
      for (auto& w : workers) {
        if (w.thread.joinable()) w.thread.join();
        if (bad.empty()) bad = w.verify();
        adds += w.adds;
      }
      if (bad.empty()) {
        if (CUresult r = cuCtxSynchronize(); r != CUDA_SUCCESS) bad = "cuCtxSynchronize: " + std::to_string(r);
      }
      if (bad.empty())
        std::printf("ok %llu\n", static_cast<unsigned long long>(adds));
      else
        std::printf("bad %s\n", bad.c_str());
    } else if (cmd == "launch") {
      CUresult r = launch_add(probe, 1, kWords, nullptr);
      const int state = shim_state();  // right after the launch returned: running unless it slipped through
      if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
      if (r == CUDA_SUCCESS)
        std::printf("ok %d\n", state);
      else
        std::printf("err %d\n", static_cast<int>(r));
    } else if (cmd == "memop") {
      // A stream memory operation (gated like a launch): word 0 of the probe buffer becomes N.
      uint32_t value = 0, word = 0;
      in >> value;
      CUresult r = cuStreamWriteValue32(nullptr, probe, value, 0);
      if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
      if (r == CUDA_SUCCESS) r = cuMemcpyDtoH(&word, probe, sizeof(word));
      if (r == CUDA_SUCCESS)
        std::printf("ok %u\n", word);
      else
        std::printf("err %d\n", static_cast<int>(r));
    } else if (cmd == "probe") {
      uint32_t want = 0;
      in >> want;
      std::vector<uint32_t> all(kWords);
      CUresult r = cuMemcpyDtoH(all.data(), probe, kBufferBytes);
      if (r != CUDA_SUCCESS) {
        std::printf("bad copy %d\n", static_cast<int>(r));
        continue;
      }
      size_t i = 0;
      while (i < kWords && all[i] == want) ++i;
      if (i == kWords)
        std::printf("ok\n");
      else
        std::printf("bad word %zu is %u\n", i, all[i]);
    } else if (cmd == "capture") {
      std::string what;
      in >> what;
      CUgraph graph = nullptr;
      CUresult r = what == "begin" ? cuStreamBeginCapture(capture_stream, CU_STREAM_CAPTURE_MODE_RELAXED)
                                   : cuStreamEndCapture(capture_stream, &graph);
      if (r == CUDA_SUCCESS)
        std::printf("ok\n");
      else
        std::printf("err %d\n", static_cast<int>(r));
    } else if (cmd == "api") {
      std::string what;
      in >> what;
      using ApiFn = int (*)();
      auto fn = reinterpret_cast<ApiFn>(dlsym(RTLD_DEFAULT, what == "pause" ? "tmsdisk_pause" : "tmsdisk_resume"));
      int rc = fn ? fn() : -1;
      if (rc == 0)
        std::printf("ok\n");
      else
        std::printf("err %d\n", -rc);
    } else if (cmd == "exit") {
      break;
    } else {
      std::printf("err unknown command\n");
    }
  }
  stop = true;
  for (auto& w : workers)
    if (w.thread.joinable()) w.thread.join();
  return 0;
}
