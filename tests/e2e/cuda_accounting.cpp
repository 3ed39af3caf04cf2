// SPDX-License-Identifier: Apache-2.0
// An ordinary CUDA driver program that allocates through every path the shim accounts for, so that
// a test can check that `tmsctl status` adds up. At start it allocates:
//
//   two cuMemAlloc allocations at or above TMSDISK_MIN_BYTES       (paused by the shim: "managed")
//   one cuMemAlloc below TMSDISK_MIN_BYTES                          ("small")
//   one cuMemAllocManaged allocation                                ("managed-memory")
//   two live cuMemAllocAsync allocations, and a third one freed with cuMemFreeAsync, which its pool
//   keeps until trimmed                                              ("pool")
//   one cuMemAlloc allocation whose handle is taken with cuMemRetainAllocationHandle and exported
//   as a POSIX fd                                                    ("exported")
//
// fills each with a known value and prints
//   "ready managed=B small=B managed-memory=B pool=B exported=B pool-idle=B retain=RC export=RC"
// (B: the bytes asked for; RC: the result of cuMemRetainAllocationHandle and of
// cuMemExportToShareableHandle). Then, on stdin:
//
//   query    pointer queries on the first managed allocation answer its base and size: -> "ok" | "bad WHY"
//   check    every allocation still holds its value                                   -> "ok" | "bad WHY"
//   peek     the exported allocation holds its value, read through its address from the host
//            without any CUDA call (simcuda only: device memory is host memory there, and
//            memory a pause took away faults)                                          -> "ok" | "bad WHY"
//   exit     frees everything                                                          -> "ok"
#include <cuda.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Buf {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  uint32_t value = 0;
};

size_t env_bytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

std::string query(const Buf& b) {
  const CUdeviceptr inner = b.ptr + b.bytes / 2 + 3;
  CUdeviceptr start = 0;
  size_t size = 0;
  int ordinal = -1;
  if (CUresult r = cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, inner); r != CUDA_SUCCESS)
    return "bad RANGE_START_ADDR " + std::to_string(r);
  if (CUresult r = cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, inner); r != CUDA_SUCCESS)
    return "bad RANGE_SIZE " + std::to_string(r);
  if (CUresult r = cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, inner); r != CUDA_SUCCESS)
    return "bad DEVICE_ORDINAL " + std::to_string(r);
  if (start != b.ptr || size != b.bytes || ordinal != 0)
    return "bad attribute start=" + std::to_string(start) + " size=" + std::to_string(size) +
           " ordinal=" + std::to_string(ordinal);
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  CUdeviceptr start2 = 0;
  size_t size2 = 0;
  int ordinal2 = -1;
  void* data[] = {&start2, &size2, &ordinal2};
  if (CUresult r = cuPointerGetAttributes(3, attrs, data, inner); r != CUDA_SUCCESS)
    return "bad cuPointerGetAttributes " + std::to_string(r);
  if (start2 != b.ptr || size2 != b.bytes || ordinal2 != 0) return "bad cuPointerGetAttributes values";
  CUdeviceptr base = 0;
  size_t range = 0;
  if (CUresult r = cuMemGetAddressRange(&base, &range, inner); r != CUDA_SUCCESS)
    return "bad cuMemGetAddressRange " + std::to_string(r);
  if (base != b.ptr || range != b.bytes)
    return "bad range base=" + std::to_string(base) + " size=" + std::to_string(range);
  return "ok";
}

std::string check(const std::vector<Buf>& all) {
  for (const Buf& b : all) {
    std::vector<uint32_t> host(b.bytes / 4);
    if (CUresult r = cuMemcpyDtoH(host.data(), b.ptr, host.size() * 4); r != CUDA_SUCCESS)
      return "bad copy " + std::to_string(r);
    for (uint32_t v : host)
      if (v != b.value) return "bad value " + std::to_string(v) + " != " + std::to_string(b.value);
  }
  return "ok";
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CUdevice dev;
  CUcontext ctx;
  CUstream stream;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    std::printf("err setup\n");
    return 1;
  }
  const size_t min = env_bytes("TMSDISK_MIN_BYTES", 2u << 20);
  uint32_t next_value = 0x1000;
  std::vector<Buf> managed, small, unified, pool, exported;
  auto fill = [&](Buf& b) {
    b.value = next_value++;
    return cuMemsetD32(b.ptr, b.value, b.bytes / 4) == CUDA_SUCCESS;
  };
  bool ok = true;
  // Sizes that are no multiple of the granularity: the shim counts what was asked for.
  for (size_t bytes : {8 * min + 4096, 3 * min + 12}) {
    Buf b{0, bytes};
    ok = ok && cuMemAlloc(&b.ptr, bytes) == CUDA_SUCCESS && fill(b);
    managed.push_back(b);
  }
  {
    Buf b{0, min / 4};
    ok = ok && cuMemAlloc(&b.ptr, b.bytes) == CUDA_SUCCESS && fill(b);
    small.push_back(b);
  }
  {
    Buf b{0, 3 * min + 20};
    ok = ok && cuMemAllocManaged(&b.ptr, b.bytes, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS && fill(b);
    unified.push_back(b);
  }
  for (size_t bytes : {2 * min + 4, min + 8}) {
    Buf b{0, bytes};
    ok = ok && cuMemAllocAsync(&b.ptr, bytes, stream) == CUDA_SUCCESS;
    b.value = next_value++;
    ok = ok && cuMemsetD32Async(b.ptr, b.value, b.bytes / 4, stream) == CUDA_SUCCESS;
    pool.push_back(b);
  }
  // Freed back into the pool: no longer the application's, but the pool holds it until trimmed.
  const size_t pool_idle = 8 * min;
  {
    CUdeviceptr p = 0;
    ok = ok && cuMemAllocAsync(&p, pool_idle, stream) == CUDA_SUCCESS &&
         cuMemsetD8Async(p, 0, pool_idle, stream) == CUDA_SUCCESS && cuMemFreeAsync(p, stream) == CUDA_SUCCESS;
  }
  ok = ok && cuStreamSynchronize(stream) == CUDA_SUCCESS;
  // Natively, cuMemAlloc memory has no handle to retain (the driver refuses); under the shim it is
  // VMM memory, and whoever holds its handle may map or share it, so it stays resident for good.
  CUresult retain_rc = CUDA_ERROR_UNKNOWN, export_rc = CUDA_ERROR_UNKNOWN;
  {
    Buf b{0, 2 * min + 16};
    ok = ok && cuMemAlloc(&b.ptr, b.bytes) == CUDA_SUCCESS && fill(b);
    CUmemGenericAllocationHandle h = 0;
    if (ok) retain_rc = cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(b.ptr));
    if (retain_rc == CUDA_SUCCESS) {
      int fd = -1;
      export_rc = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (export_rc == CUDA_SUCCESS) close(fd);
      ok = cuMemRelease(h) == CUDA_SUCCESS;
    }
    exported.push_back(b);
  }
  ok = ok && cuCtxSynchronize() == CUDA_SUCCESS;
  if (!ok) {
    std::printf("err allocate\n");
    return 1;
  }
  auto sum = [](const std::vector<Buf>& v) {
    size_t s = 0;
    for (const Buf& b : v) s += b.bytes;
    return s;
  };
  std::printf(
      "ready managed=%zu small=%zu managed-memory=%zu pool=%zu exported=%zu pool-idle=%zu retain=%d export=%d\n",
      sum(managed), sum(small), sum(unified), sum(pool), sum(exported), pool_idle, static_cast<int>(retain_rc),
      static_cast<int>(export_rc));

  std::vector<Buf> all;
  for (const auto* v : {&managed, &small, &unified, &pool, &exported}) all.insert(all.end(), v->begin(), v->end());
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "query") {
      std::printf("%s\n", query(managed[0]).c_str());
    } else if (line == "peek") {
      const Buf& b = exported[0];
      const auto* words = reinterpret_cast<const volatile uint32_t*>(static_cast<uintptr_t>(b.ptr));
      std::string answer = "ok";
      for (size_t i = 0; i < b.bytes / 4; ++i)
        if (words[i] != b.value) {
          answer = "bad value at word " + std::to_string(i);
          break;
        }
      std::printf("%s\n", answer.c_str());
    } else if (line == "check") {
      std::printf("%s\n", check(all).c_str());
    } else if (line == "exit") {
      for (const Buf& b : pool) cuMemFreeAsync(b.ptr, stream);
      cuStreamSynchronize(stream);
      for (const auto* v : {&managed, &small, &unified, &exported})
        for (const Buf& b : *v) cuMemFree(b.ptr);
      std::printf("ok\n");
      return 0;
    } else {
      std::printf("err unknown command\n");
    }
  }
  return 0;
}
