// SPDX-License-Identifier: Apache-2.0
// Peer access on two devices, as multi-GPU programs enable it: cuMemAlloc memory on device 0, one
// buffer allocated before and one after device 1's context calls cuCtxEnablePeerAccess on device 0's.
// Runs on simcuda with SIMCUDA_DEVICE_COUNT=2 (or two real GPUs with peer access). Prints "ready" or
// "err WHAT RC", then on stdin:
//
//   access   device 1's rights on both buffers (cuMemGetAccess)   -> "ok FLAGS FLAGS" (3: read-write)
//   copy     device 1 copies both buffers into its own memory and
//            checks them                                          -> "ok" | "bad WHY"
//   exit                                                          -> "ok"
#include <cuda.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr size_t kBytes = 4u << 20;
CUcontext g_ctx[2];
CUdeviceptr g_buf[2];  // on device 0: before and after peer access was enabled

std::string copy_check() {
  if (cuCtxSetCurrent(g_ctx[1]) != CUDA_SUCCESS) return "bad context";
  CUdeviceptr mine = 0;
  std::string answer = "ok";
  if (CUresult r = cuMemAlloc(&mine, kBytes); r != CUDA_SUCCESS) answer = "bad alloc " + std::to_string(r);
  for (int i = 0; i < 2 && answer == "ok"; ++i) {
    std::vector<uint32_t> host(kBytes / 4);
    CUresult r = cuMemcpyDtoD(mine, g_buf[i], kBytes);
    if (r == CUDA_SUCCESS) r = cuMemcpyDtoH(host.data(), mine, kBytes);
    if (r != CUDA_SUCCESS) answer = "bad copy " + std::to_string(r);
    for (size_t w = 0; w < host.size() && answer == "ok"; ++w)
      if (host[w] != 10u + i) answer = "bad buffer " + std::to_string(i) + " word " + std::to_string(w);
  }
  if (mine) cuMemFree(mine);
  cuCtxSetCurrent(g_ctx[0]);
  return answer;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int count = 0;
  CUdevice dev[2];
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&count) != CUDA_SUCCESS || count < 2) {
    std::printf("err devices %d\n", count);
    return 1;
  }
  for (int i = 0; i < 2; ++i) {
    if (cuDeviceGet(&dev[i], i) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&g_ctx[i], dev[i]) != CUDA_SUCCESS) {
      std::printf("err context %d\n", i);
      return 1;
    }
  }
  auto alloc = [](int i) {
    CUresult r = cuCtxSetCurrent(g_ctx[0]);
    if (r == CUDA_SUCCESS) r = cuMemAlloc(&g_buf[i], kBytes);
    if (r == CUDA_SUCCESS) r = cuMemsetD32(g_buf[i], 10u + i, kBytes / 4);
    if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
    return r;
  };
  CUresult r = alloc(0);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(g_ctx[1]);
  if (r == CUDA_SUCCESS) r = cuCtxEnablePeerAccess(g_ctx[0], 0);  // device 1 may use device 0's memory
  if (r == CUDA_SUCCESS) r = alloc(1);
  if (r != CUDA_SUCCESS) {
    std::printf("err setup %d\n", r);
    return 1;
  }
  std::printf("ready\n");
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "access") {
      CUmemLocation peer{};
      peer.type = CU_MEM_LOCATION_TYPE_DEVICE;
      peer.id = 1;
      unsigned long long flags[2] = {0, 0};
      CUresult a = cuMemGetAccess(&flags[0], &peer, g_buf[0]);
      CUresult b = cuMemGetAccess(&flags[1], &peer, g_buf[1]);
      if (a != CUDA_SUCCESS || b != CUDA_SUCCESS)
        std::printf("err %d %d\n", a, b);
      else
        std::printf("ok %llu %llu\n", flags[0], flags[1]);
    } else if (line == "copy") {
      std::printf("%s\n", copy_check().c_str());
    } else if (line == "exit") {
      cuMemFree(g_buf[0]);
      cuMemFree(g_buf[1]);
      std::printf("ok\n");
      return 0;
    } else {
      std::printf("err unknown command\n");
    }
  }
  return 0;
}
