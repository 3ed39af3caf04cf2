// SPDX-License-Identifier: Apache-2.0
// An ordinary CUDA driver-API program, unaware of tmsdisk: it allocates device memory through each
// way programs reach the driver (the linked symbol, cuGetProcAddress, dlsym on a dlopen'ed libcuda),
// fills it with a pattern and checks it on request. Tests drive it line by line on stdin:
//
//   alloc ID BYTES PATH   PATH = direct | procaddr | dlsym    -> "ok ID 0xADDR"
//   free ID                                                    -> "ok"
//   check                                                      -> "ok N" | "bad ID OFFSET"
//   addr ID                                                    -> "ok 0xADDR"
//   api pause|resume      the in-process C API, if preloaded   -> "ok" | "err ERRNO"
//   exit
//
// Every answer is one line on stdout; errors are "err ..." lines, never a crash.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "pattern.h"

namespace {

struct Allocation {
  CUdeviceptr ptr = 0;
  uint64_t bytes = 0;
};

using AllocFn = CUresult (*)(CUdeviceptr*, size_t);
using FreeFn = CUresult (*)(CUdeviceptr);

AllocFn alloc_fn(const std::string& path) {
  if (path == "direct") return &cuMemAlloc;
  if (path == "procaddr") {
    void* fn = nullptr;
    CUdriverProcAddressQueryResult status{};
    if (cuGetProcAddress("cuMemAlloc", &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS)
      return nullptr;
    return reinterpret_cast<AllocFn>(fn);
  }
  if (path == "dlsym") {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<AllocFn>(dlsym(lib, "cuMemAlloc_v2")) : nullptr;
  }
  return nullptr;
}

constexpr uint64_t kStep = 8u << 20;  // host bounce buffer per copy

bool fill(const Allocation& a, uint64_t id) {
  std::vector<uint8_t> buf(std::min<uint64_t>(kStep, a.bytes));
  for (uint64_t off = 0; off < a.bytes; off += kStep) {
    const uint64_t n = std::min<uint64_t>(kStep, a.bytes - off);
    tmsdisk::testing::fill_pattern(id, off, buf.data(), n);
    if (cuMemcpyHtoD(a.ptr + off, buf.data(), n) != CUDA_SUCCESS) return false;
  }
  return true;
}

int64_t verify(const Allocation& a, uint64_t id) {
  std::vector<uint8_t> buf(std::min<uint64_t>(kStep, a.bytes));
  for (uint64_t off = 0; off < a.bytes; off += kStep) {
    const uint64_t n = std::min<uint64_t>(kStep, a.bytes - off);
    if (cuMemcpyDtoH(buf.data(), a.ptr + off, n) != CUDA_SUCCESS) return static_cast<int64_t>(off);
    int64_t bad = tmsdisk::testing::find_mismatch(id, off, buf.data(), n);
    if (bad >= 0) return static_cast<int64_t>(off) + bad;
  }
  return -1;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (cuInit(0) != CUDA_SUCCESS) {
    std::printf("err cuInit\n");
    return 1;
  }
  CUdevice dev;
  CUcontext ctx;
  if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::printf("err context\n");
    return 1;
  }
  std::printf("ready\n");

  std::map<uint64_t, Allocation> allocs;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "alloc") {
      uint64_t id = 0, bytes = 0;
      std::string path;
      in >> id >> bytes >> path;
      AllocFn fn = alloc_fn(path);
      Allocation a;
      a.bytes = bytes;
      CUresult rc = fn ? fn(&a.ptr, bytes) : CUDA_ERROR_NOT_FOUND;
      if (rc != CUDA_SUCCESS) {
        std::printf("err alloc %d\n", static_cast<int>(rc));
        continue;
      }
      if (!fill(a, id)) {
        std::printf("err fill\n");
        continue;
      }
      allocs[id] = a;
      std::printf("ok %llu 0x%llx\n", static_cast<unsigned long long>(id), static_cast<unsigned long long>(a.ptr));
    } else if (cmd == "free") {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      if (it == allocs.end() || cuMemFree(it->second.ptr) != CUDA_SUCCESS) {
        std::printf("err free\n");
        continue;
      }
      allocs.erase(it);
      std::printf("ok\n");
    } else if (cmd == "check") {
      bool good = true;
      for (auto& [id, a] : allocs) {
        int64_t bad = verify(a, id);
        if (bad >= 0) {
          std::printf("bad %llu %lld\n", static_cast<unsigned long long>(id), static_cast<long long>(bad));
          good = false;
          break;
        }
      }
      if (good) std::printf("ok %zu\n", allocs.size());
    } else if (cmd == "addr") {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      if (it == allocs.end())
        std::printf("err addr\n");
      else
        std::printf("ok 0x%llx\n", static_cast<unsigned long long>(it->second.ptr));
    } else if (cmd == "api") {
      std::string what;
      in >> what;
      using ApiFn = int (*)();
      auto fn = reinterpret_cast<ApiFn>(dlsym(RTLD_DEFAULT, what == "pause" ? "tmsdisk_pause" : "tmsdisk_resume"));
      if (!fn) {
        std::printf("err no-api\n");
        continue;
      }
      int rc = fn();
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
  for (auto& [id, a] : allocs) cuMemFree(a.ptr);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}
