// SPDX-License-Identifier: Apache-2.0
// simcuda tests: streams and events run work asynchronously and in order, and the built-in kernels.
#include <catch2/catch.hpp>
#include <cstring>
#include <thread>
#include <vector>

#include "simcuda_fixture.h"

using namespace simtest;

namespace {

struct Buffer {
  CUdeviceptr d = 0;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) { REQUIRE(cuMemAlloc(&d, n) == CUDA_SUCCESS); }
  ~Buffer() { cuMemFree(d); }
};

}  // namespace

TEST_CASE("An async copy completes only when the stream's worker has done it", "[simcuda][stream]") {
  setup();
  Buffer dev(1 << 20);
  REQUIRE(cuMemsetD8(dev.d, 0x3c, dev.bytes) == CUDA_SUCCESS);
  std::vector<unsigned char> host(dev.bytes, 0);
  REQUIRE(cuMemHostRegister(host.data(), host.size(), 0) == CUDA_SUCCESS);

  CUstream s = nullptr;
  REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  CUevent done = nullptr;
  REQUIRE(cuEventCreate(&done, CU_EVENT_DEFAULT) == CUDA_SUCCESS);
  CHECK(cuEventQuery(done) == CUDA_SUCCESS);  // never recorded

  Gate gate;
  REQUIRE(cuLaunchHostFunc(s, Gate::wait, &gate) == CUDA_SUCCESS);
  REQUIRE(cuMemcpyDtoHAsync(host.data(), dev.d, dev.bytes, s) == CUDA_SUCCESS);
  REQUIRE(cuEventRecord(done, s) == CUDA_SUCCESS);
  CHECK(cuEventQuery(done) == CUDA_ERROR_NOT_READY);
  CHECK(cuStreamQuery(s) == CUDA_ERROR_NOT_READY);
  CHECK(host[0] == 0);
  CHECK(host.back() == 0);

  gate.release();
  REQUIRE(cuEventSynchronize(done) == CUDA_SUCCESS);
  CHECK(cuEventQuery(done) == CUDA_SUCCESS);
  CHECK(host[0] == 0x3c);
  CHECK(host.back() == 0x3c);
  REQUIRE(cuStreamSynchronize(s) == CUDA_SUCCESS);
  CHECK(cuStreamQuery(s) == CUDA_SUCCESS);

  REQUIRE(cuEventDestroy(done) == CUDA_SUCCESS);
  REQUIRE(cuStreamDestroy(s) == CUDA_SUCCESS);
  REQUIRE(cuMemHostUnregister(host.data()) == CUDA_SUCCESS);
}

TEST_CASE("cuStreamWaitEvent orders work across streams", "[simcuda][stream]") {
  setup();
  Buffer dev(4096);
  std::vector<uint32_t> src(1024), dst(1024, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(i * 3 + 1);

  CUstream producer = nullptr, consumer = nullptr;
  REQUIRE(cuStreamCreate(&producer, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  REQUIRE(cuStreamCreate(&consumer, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  CUevent uploaded = nullptr, downloaded = nullptr;
  REQUIRE(cuEventCreate(&uploaded, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);
  REQUIRE(cuEventCreate(&downloaded, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);

  Gate gate;
  REQUIRE(cuLaunchHostFunc(producer, Gate::wait, &gate) == CUDA_SUCCESS);
  REQUIRE(cuMemcpyHtoDAsync(dev.d, src.data(), 4096, producer) == CUDA_SUCCESS);
  REQUIRE(cuEventRecord(uploaded, producer) == CUDA_SUCCESS);
  REQUIRE(cuStreamWaitEvent(consumer, uploaded, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemcpyDtoHAsync(dst.data(), dev.d, 4096, consumer) == CUDA_SUCCESS);
  REQUIRE(cuEventRecord(downloaded, consumer) == CUDA_SUCCESS);
  CHECK(cuEventQuery(downloaded) == CUDA_ERROR_NOT_READY);

  gate.release();
  REQUIRE(cuEventSynchronize(downloaded) == CUDA_SUCCESS);
  CHECK(dst == src);
  float ms = 0;
  CHECK(cuEventElapsedTime(&ms, uploaded, downloaded) == CUDA_ERROR_INVALID_HANDLE);  // timing disabled

  cuEventDestroy(uploaded);
  cuEventDestroy(downloaded);
  cuStreamDestroy(producer);
  cuStreamDestroy(consumer);
}

TEST_CASE("The legacy default stream waits for blocking streams", "[simcuda][stream]") {
  setup();
  Buffer dev(4096);
  std::vector<uint32_t> src(1024, 77), dst(1024, 0);
  CUstream blocking = nullptr;
  REQUIRE(cuStreamCreate(&blocking, CU_STREAM_DEFAULT) == CUDA_SUCCESS);
  CUevent e = nullptr, t0 = nullptr;
  REQUIRE(cuEventCreate(&e, 0) == CUDA_SUCCESS);
  REQUIRE(cuEventCreate(&t0, 0) == CUDA_SUCCESS);

  Gate gate;
  REQUIRE(cuEventRecord(t0, blocking) == CUDA_SUCCESS);
  REQUIRE(cuLaunchHostFunc(blocking, Gate::wait, &gate) == CUDA_SUCCESS);
  REQUIRE(cuMemcpyHtoDAsync(dev.d, src.data(), 4096, blocking) == CUDA_SUCCESS);
  // Stream 0 is the legacy stream: its copy is ordered after everything queued on `blocking`.
  REQUIRE(cuMemcpyDtoHAsync(dst.data(), dev.d, 4096, nullptr) == CUDA_SUCCESS);
  REQUIRE(cuEventRecord(e, CU_STREAM_LEGACY) == CUDA_SUCCESS);
  CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
  CHECK(cuStreamQuery(nullptr) == CUDA_ERROR_NOT_READY);
  float ms = 0;
  CHECK(cuEventElapsedTime(&ms, t0, e) == CUDA_ERROR_NOT_READY);

  gate.release();
  REQUIRE(cuCtxSynchronize() == CUDA_SUCCESS);
  CHECK(cuEventQuery(e) == CUDA_SUCCESS);
  CHECK(dst == src);
  REQUIRE(cuEventElapsedTime(&ms, t0, e) == CUDA_SUCCESS);
  CHECK(ms >= 0.0f);

  cuEventDestroy(e);
  cuEventDestroy(t0);
  cuStreamDestroy(blocking);
}

TEST_CASE("Synchronous calls and the per-thread default stream", "[simcuda][stream]") {
  setup();
  Buffer dev(1 << 16);
  std::vector<uint32_t> host(1 << 14, 0);
  REQUIRE(cuMemsetD32(dev.d, 0xfeedbeefu, host.size()) == CUDA_SUCCESS);
  REQUIRE(cuMemcpyDtoH(host.data(), dev.d, dev.bytes) == CUDA_SUCCESS);
  CHECK(host.front() == 0xfeedbeefu);
  CHECK(host.back() == 0xfeedbeefu);

  // The per-thread form of a call (cuMemsetD8Async_ptsz) treats stream 0 as this thread's default
  // stream; callers reach it through cuGetProcAddress.
  using SetAsync = CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream);
  using Set = CUresult (*)(CUdeviceptr, unsigned char, size_t);
  void* fn = nullptr;
  REQUIRE(cuGetProcAddress("cuMemsetD8Async", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, nullptr) ==
          CUDA_SUCCESS);
  auto set_async_ptsz = reinterpret_cast<SetAsync>(fn);
  REQUIRE(cuGetProcAddress("cuMemsetD8", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, nullptr) ==
          CUDA_SUCCESS);
  auto set_ptds = reinterpret_cast<Set>(fn);
  REQUIRE(set_async_ptsz(dev.d, 0x11, dev.bytes, nullptr) == CUDA_SUCCESS);
  REQUIRE(cuStreamSynchronize(CU_STREAM_PER_THREAD) == CUDA_SUCCESS);
  REQUIRE(cuMemcpy(reinterpret_cast<CUdeviceptr>(host.data()), dev.d, dev.bytes) == CUDA_SUCCESS);
  CHECK(host[5] == 0x11111111u);

  // Another thread has no current context until it sets one.
  std::thread([&] {
    CUdeviceptr p = 0;
    CHECK(cuMemAlloc(&p, 64) == CUDA_ERROR_INVALID_CONTEXT);
    CUcontext none = reinterpret_cast<CUcontext>(1);
    CHECK(cuCtxGetCurrent(&none) == CUDA_SUCCESS);
    CHECK(none == nullptr);
    setup();
    CHECK(set_ptds(dev.d, 0x22, 16) == CUDA_SUCCESS);
  }).join();
  unsigned char b = 0;
  REQUIRE(cuMemcpyDtoH(&b, dev.d + 15, 1) == CUDA_SUCCESS);
  CHECK(b == 0x22);
}

TEST_CASE("Built-in kernels fill and add in stream order", "[simcuda][kernel]") {
  setup();
  const size_t n = 1 << 16;
  Buffer dev(n * 4);
  CUmodule mod = nullptr;
  const char image[] = "simcuda ignores the image";
  REQUIRE(cuModuleLoadData(&mod, image) == CUDA_SUCCESS);
  CUfunction fill = nullptr, add = nullptr, missing = nullptr;
  REQUIRE(cuModuleGetFunction(&fill, mod, "simcuda_fill_u32") == CUDA_SUCCESS);
  REQUIRE(cuModuleGetFunction(&add, mod, "simcuda_add_u32") == CUDA_SUCCESS);
  CHECK(cuModuleGetFunction(&missing, mod, "no_such_kernel") == CUDA_ERROR_NOT_FOUND);

  CUstream s = nullptr;
  REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  Gate gate;
  REQUIRE(cuLaunchHostFunc(s, Gate::wait, &gate) == CUDA_SUCCESS);
  {
    CUdeviceptr ptr = dev.d;
    uint32_t value = 7;
    size_t count = n;
    void* args[] = {&ptr, &value, &count};
    REQUIRE(cuLaunchKernel(fill, 64, 1, 1, 256, 1, 1, 0, s, args, nullptr) == CUDA_SUCCESS);
    value = 1000;  // arguments were copied at launch
  }
  {
    // The CU_LAUNCH_PARAM_BUFFER_POINTER form: (CUdeviceptr, uint32 + padding, size_t).
    struct {
      CUdeviceptr ptr;
      uint32_t addend;
      uint32_t pad;
      size_t count;
    } packed{dev.d, 5, 0, n};
    size_t size = sizeof packed;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
    REQUIRE(cuLaunchKernel(add, 64, 1, 1, 256, 1, 1, 0, s, nullptr, extra) == CUDA_SUCCESS);
  }
  std::vector<uint32_t> host(n, 0);
  REQUIRE(cuMemcpyDtoHAsync(host.data(), dev.d, n * 4, s) == CUDA_SUCCESS);
  CHECK(cuStreamQuery(s) == CUDA_ERROR_NOT_READY);
  gate.release();
  REQUIRE(cuStreamSynchronize(s) == CUDA_SUCCESS);
  CHECK(host.front() == 12);
  CHECK(host.back() == 12);

  cuStreamDestroy(s);
  REQUIRE(cuModuleUnload(mod) == CUDA_SUCCESS);
  CHECK(cuModuleGetFunction(&fill, mod, "simcuda_fill_u32") == CUDA_ERROR_INVALID_HANDLE);
}

TEST_CASE("A kernel touching unmapped memory poisons its context", "[simcuda][kernel]") {
  CUcontext primary = setup();
  CUcontext ctx = nullptr;
  REQUIRE(cuCtxCreate(&ctx, nullptr, 0, 0) == CUDA_SUCCESS);  // becomes current
  CUcontext cur = nullptr;
  REQUIRE(cuCtxGetCurrent(&cur) == CUDA_SUCCESS);
  CHECK(cur == ctx);

  CUdeviceptr va = 0;
  REQUIRE(cuMemAddressReserve(&va, kGran, 0, 0, 0) == CUDA_SUCCESS);
  CUmodule mod = nullptr;
  REQUIRE(cuModuleLoadData(&mod, "x") == CUDA_SUCCESS);
  CUfunction fill = nullptr;
  REQUIRE(cuModuleGetFunction(&fill, mod, "simcuda_fill_u32") == CUDA_SUCCESS);
  CUdeviceptr ptr = va;
  uint32_t value = 1;
  size_t count = 16;
  void* args[] = {&ptr, &value, &count};
  REQUIRE(cuLaunchKernel(fill, 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr) == CUDA_SUCCESS);
  CHECK(cuCtxSynchronize() == CUDA_ERROR_ILLEGAL_ADDRESS);
  CUevent e = nullptr;
  REQUIRE(cuEventCreate(&e, 0) == CUDA_SUCCESS);
  CHECK(cuEventRecord(e, nullptr) == CUDA_ERROR_ILLEGAL_ADDRESS);
  cuEventDestroy(e);

  REQUIRE(cuCtxDestroy(ctx) == CUDA_SUCCESS);
  CHECK(cuModuleGetFunction(&fill, mod, "simcuda_fill_u32") == CUDA_ERROR_INVALID_HANDLE);
  REQUIRE(cuMemAddressFree(va, kGran) == CUDA_SUCCESS);
  REQUIRE(cuCtxGetCurrent(&cur) == CUDA_SUCCESS);
  CHECK(cur == primary);                      // destroying the current context popped it
  CHECK(cuCtxSynchronize() == CUDA_SUCCESS);  // other contexts are unaffected
}
