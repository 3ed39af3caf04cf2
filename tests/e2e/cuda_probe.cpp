// SPDX-License-Identifier: Apache-2.0
// A second process that tries to take device memory: `cuda_probe MIB` allocates MIB MiB, writes to
// it, frees it, and exits 0 on success or 1 if the allocation failed (out of memory).
// `cuda_probe free` prints the device's free memory in MiB.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: cuda_probe MIB | cuda_probe free\n");
    return 2;
  }
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    return 3;
  if (std::strcmp(argv[1], "free") == 0) {
    size_t free_bytes = 0, total = 0;
    if (cuMemGetInfo(&free_bytes, &total) != CUDA_SUCCESS) return 3;
    std::printf("%zu\n", free_bytes >> 20);
    return 0;
  }
  const size_t bytes = std::strtoull(argv[1], nullptr, 10) << 20;
  CUdeviceptr p = 0;
  CUresult rc = cuMemAlloc(&p, bytes);
  if (rc != CUDA_SUCCESS) {
    std::printf("alloc of %zu MiB failed: %d\n", bytes >> 20, static_cast<int>(rc));
    return 1;
  }
  if (cuMemsetD8(p, 0xAB, bytes) != CUDA_SUCCESS) return 4;
  cuMemFree(p);
  std::printf("alloc of %zu MiB ok\n", bytes >> 20);
  return 0;
}
