// SPDX-License-Identifier: Apache-2.0
// An ordinary CUDA driver-API program, unaware of tmsdisk: it allocates device memory through each
// way programs reach the driver (the linked symbol, cuGetProcAddress, dlsym on a dlopen'ed libcuda),
// fills it with a pattern and checks it on request. Tests drive it line by line on stdin:
//
//   alloc ID BYTES PATH   PATH = direct | procaddr | dlsym | thread (cuMemAlloc on a new thread)
//                                                              -> "ok ID 0xADDR"
//   alloc ID BYTES PATH sparse STRIDE   the pattern in the first 4 KiB of every STRIDE bytes, zeros
//                         elsewhere (STRIDE 0: all zeros); check knows
//   edit ID OFFSET        changes the byte at OFFSET (checks expect the new value) -> "ok"
//   free ID                                                    -> "ok"
//   check                                                      -> "ok N" | "bad ID OFFSET"
//   check ID      one allocation                               -> "ok" | "bad ID OFFSET" | "err copy CURESULT"
//   zeros ID      whether it reads back as zeros               -> "ok" | "nonzero ID OFFSET" | "err copy CURESULT"
//   addr ID                                                    -> "ok 0xADDR"
//   api pause|resume|resume-accept-loss   the in-process C API, if preloaded -> "ok" | "err ERRNO"
//   api pause-tag|resume-tag TAG          ... of one tag                    -> "ok" | "err ERRNO"
//   tag push NAME backup|discard|resident this thread's next allocations carry NAME -> "ok" | "err ERRNO"
//   tag pop                                                    -> "ok" | "err ERRNO"
//   refill ID     writes its pattern again (after a discard)   -> "ok"
//   device N      device N's primary context becomes current: the next allocations are on it
//                 (each allocation is filled, checked and edited in its own context) -> "ok" | "err device"
//   ordinal ID    the device its memory is on                  -> "ok N"
//   exit
//
// Every answer is one line on stdout; errors are "err ..." lines, never a crash.
#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pattern.h"

namespace {

struct Allocation {
  CUdeviceptr ptr = 0;
  CUcontext ctx = nullptr;  // the context current when it was allocated
  uint64_t bytes = 0;
  bool sparse = false;                // only the first kPage bytes of every `stride` hold the pattern
  uint64_t stride = 0;                // 0 with sparse: nothing does
  std::map<uint64_t, uint8_t> edits;  // bytes changed since, by offset
};

constexpr uint64_t kPage = 4096;

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

// What `a` must hold in [off, off + n).
void expected(const Allocation& a, uint64_t id, uint64_t off, uint8_t* buf, uint64_t n) {
  if (!a.sparse) {
    tmsdisk::testing::fill_pattern(id, off, buf, n);
  } else {
    std::memset(buf, 0, n);
    // The pattern only in the first kPage bytes of each stride that [off, off + n) meets.
    for (uint64_t page = a.stride ? off / a.stride * a.stride : off + n; page < off + n; page += a.stride) {
      const uint64_t from = std::max(page, off), to = std::min(page + kPage, off + n);
      if (from < to) tmsdisk::testing::fill_pattern(id, from, buf + (from - off), to - from);
    }
  }
  for (auto it = a.edits.lower_bound(off); it != a.edits.end() && it->first < off + n; ++it)
    buf[it->first - off] = it->second;
}

// Makes `a`'s context current for the scope (a program on several devices copies in each one's).
class InContextOf {
 public:
  explicit InContextOf(const Allocation& a) {
    if (cuCtxGetCurrent(&prev_) == CUDA_SUCCESS && a.ctx && a.ctx != prev_)
      set_ = cuCtxSetCurrent(a.ctx) == CUDA_SUCCESS;
  }
  ~InContextOf() {
    if (set_) cuCtxSetCurrent(prev_);
  }
  InContextOf(const InContextOf&) = delete;
  InContextOf& operator=(const InContextOf&) = delete;

 private:
  CUcontext prev_ = nullptr;
  bool set_ = false;
};

bool fill(const Allocation& a, uint64_t id) {
  InContextOf in_ctx(a);
  std::vector<uint8_t> buf(std::min<uint64_t>(kStep, a.bytes));
  for (uint64_t off = 0; off < a.bytes; off += kStep) {
    const uint64_t n = std::min<uint64_t>(kStep, a.bytes - off);
    expected(a, id, off, buf.data(), n);
    if (cuMemcpyHtoD(a.ptr + off, buf.data(), n) != CUDA_SUCCESS) return false;
  }
  return true;
}

// -1 when `a` holds what `expect(off, buf, n)` accepts, else the offset of the first difference (or
// of the copy that failed, whose result goes to *rc when given).
template <class Expect>
int64_t compare(const Allocation& a, Expect&& expect, CUresult* rc = nullptr) {
  InContextOf in_ctx(a);
  std::vector<uint8_t> buf(std::min<uint64_t>(kStep, a.bytes));
  for (uint64_t off = 0; off < a.bytes; off += kStep) {
    const uint64_t n = std::min<uint64_t>(kStep, a.bytes - off);
    if (CUresult r = cuMemcpyDtoH(buf.data(), a.ptr + off, n); r != CUDA_SUCCESS) {
      if (rc) *rc = r;
      return static_cast<int64_t>(off);
    }
    int64_t bad = expect(off, buf.data(), n);
    if (bad >= 0) return static_cast<int64_t>(off) + bad;
  }
  return -1;
}

int64_t verify(const Allocation& a, uint64_t id, CUresult* rc = nullptr) {
  std::vector<uint8_t> want(std::min<uint64_t>(kStep, a.bytes));
  return compare(
      a,
      [&](uint64_t off, const uint8_t* p, uint64_t n) -> int64_t {
        expected(a, id, off, want.data(), n);
        if (std::memcmp(p, want.data(), n) == 0) return -1;
        for (uint64_t i = 0; i < n; ++i)
          if (p[i] != want[i]) return static_cast<int64_t>(i);
        return -1;
      },
      rc);
}

int64_t verify_zeros(const Allocation& a, CUresult* rc) {
  return compare(
      a,
      [](uint64_t, const uint8_t* p, uint64_t n) -> int64_t {
        for (uint64_t i = 0; i < n; ++i)
          if (p[i] != 0) return static_cast<int64_t>(i);
        return -1;
      },
      rc);
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
  std::vector<CUdevice> devices{dev};  // whose primary contexts this program retained

  std::map<uint64_t, Allocation> allocs;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "alloc") {
      uint64_t id = 0, bytes = 0;
      std::string path, mode;
      in >> id >> bytes >> path >> mode;
      AllocFn fn = alloc_fn(path);
      Allocation a;
      a.bytes = bytes;
      a.ctx = ctx;
      a.sparse = mode == "sparse";
      if (a.sparse) in >> a.stride;
      CUresult rc = CUDA_ERROR_NOT_FOUND;
      if (path == "thread") {
        // Made by another thread (cuMemAlloc): the tag pushed on this one must not reach it.
        std::thread([&] {
          if (cuCtxSetCurrent(ctx) == CUDA_SUCCESS) rc = cuMemAlloc(&a.ptr, bytes);
        }).join();
      } else if (fn) {
        rc = fn(&a.ptr, bytes);
      }
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
    } else if ((cmd == "check" || cmd == "zeros") && in >> std::ws && !in.eof()) {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      if (it == allocs.end()) {
        std::printf("err no allocation %llu\n", static_cast<unsigned long long>(id));
        continue;
      }
      CUresult rc = CUDA_SUCCESS;
      const bool zeros = cmd == "zeros";
      const int64_t bad = zeros ? verify_zeros(it->second, &rc) : verify(it->second, id, &rc);
      if (rc != CUDA_SUCCESS)
        std::printf("err copy %d\n", static_cast<int>(rc));
      else if (bad >= 0)
        std::printf("%s %llu %lld\n", zeros ? "nonzero" : "bad", static_cast<unsigned long long>(id),
                    static_cast<long long>(bad));
      else
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
    } else if (cmd == "edit") {
      uint64_t id = 0, off = 0;
      in >> id >> off;
      auto it = allocs.find(id);
      uint8_t byte = 0;
      std::optional<InContextOf> in_ctx;
      if (it != allocs.end()) in_ctx.emplace(it->second);
      if (it == allocs.end() || off >= it->second.bytes ||
          cuMemcpyDtoH(&byte, it->second.ptr + off, 1) != CUDA_SUCCESS) {
        std::printf("err edit\n");
        continue;
      }
      byte = static_cast<uint8_t>(byte + 1) ? static_cast<uint8_t>(byte + 1) : 1;
      if (cuMemcpyHtoD(it->second.ptr + off, &byte, 1) != CUDA_SUCCESS) {
        std::printf("err edit\n");
        continue;
      }
      it->second.edits[off] = byte;
      std::printf("ok\n");
    } else if (cmd == "addr") {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      if (it == allocs.end())
        std::printf("err addr\n");
      else
        std::printf("ok 0x%llx\n", static_cast<unsigned long long>(it->second.ptr));
    } else if (cmd == "tag") {
      std::string what, name, policy;
      in >> what >> name >> policy;
      int rc = -EINVAL;
      if (what == "push") {
        auto push = reinterpret_cast<int (*)(const char*, int)>(dlsym(RTLD_DEFAULT, "tmsdisk_tag_push"));
        const int p = policy == "backup" ? 0 : policy == "discard" ? 1 : policy == "resident" ? 2 : -1;
        rc = push ? push(name.c_str(), p) : -ENOSYS;
      } else if (what == "pop") {
        auto pop = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "tmsdisk_tag_pop"));
        rc = pop ? pop() : -ENOSYS;
      }
      if (rc == 0)
        std::printf("ok\n");
      else
        std::printf("err %d\n", -rc);
    } else if (cmd == "refill") {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      if (it == allocs.end() || !fill(it->second, id))
        std::printf("err refill\n");
      else
        std::printf("ok\n");
    } else if (cmd == "api" &&
               (line.find("pause-tag") != std::string::npos || line.find("resume-tag") != std::string::npos)) {
      std::string what, tag;
      in >> what >> tag;
      auto fn = reinterpret_cast<int (*)(const char*)>(
          dlsym(RTLD_DEFAULT, what == "pause-tag" ? "tmsdisk_pause_tag" : "tmsdisk_resume_tag"));
      const int rc = fn ? fn(tag.c_str()) : -ENOSYS;
      if (rc == 0)
        std::printf("ok\n");
      else
        std::printf("err %d\n", -rc);
    } else if (cmd == "api") {
      std::string what;
      in >> what;
      using ApiFn = int (*)();
      const char* name = what == "pause"                ? "tmsdisk_pause"
                         : what == "resume-accept-loss" ? "tmsdisk_resume_accept_loss"
                                                        : "tmsdisk_resume";
      auto fn = reinterpret_cast<ApiFn>(dlsym(RTLD_DEFAULT, name));
      if (!fn) {
        std::printf("err no-api\n");
        continue;
      }
      int rc = fn();
      if (rc == 0)
        std::printf("ok\n");
      else
        std::printf("err %d\n", -rc);
    } else if (cmd == "ordinal") {
      uint64_t id = 0;
      in >> id;
      auto it = allocs.find(id);
      int ordinal = -1;
      if (it == allocs.end() ||
          cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, it->second.ptr) != CUDA_SUCCESS)
        std::printf("err ordinal\n");
      else
        std::printf("ok %d\n", ordinal);
    } else if (cmd == "device") {
      int n = -1;
      in >> n;
      CUdevice d;
      CUcontext c;
      if (cuDeviceGet(&d, n) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&c, d) != CUDA_SUCCESS) {
        std::printf("err device\n");
        continue;
      }
      if (cuCtxSetCurrent(c) != CUDA_SUCCESS) {
        cuDevicePrimaryCtxRelease(d);
        std::printf("err device\n");
        continue;
      }
      if (std::find(devices.begin(), devices.end(), d) == devices.end())
        devices.push_back(d);
      else
        cuDevicePrimaryCtxRelease(d);  // retained once per device, released at the end
      ctx = c;
      std::printf("ok\n");
    } else if (cmd == "exit") {
      break;
    } else {
      std::printf("err unknown command\n");
    }
  }
  for (auto& [id, a] : allocs) {
    InContextOf in_ctx(a);
    cuMemFree(a.ptr);
  }
  for (CUdevice d : devices) cuDevicePrimaryCtxRelease(d);
  return 0;
}
