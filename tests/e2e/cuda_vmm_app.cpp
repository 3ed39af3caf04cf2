// SPDX-License-Identifier: Apache-2.0
// An expandable-segments style allocator (as PyTorch's): one large reserved range, grown and shrunk
// by mapping and unmapping 2 MiB chunks, each with its own cuMemCreate handle; every chunk holds a
// known value. Runs on simcuda only (builtin module). Driven on stdin:
//
//   grow N        map N more chunks at the end, fill chunk i with its value  -> "ok CHUNKS"
//   shrink N      unmap and release the last N chunks                         -> "ok CHUNKS"
//   add V         simcuda_add_u32 V over every mapped chunk                   -> "ok"
//   check         every chunk holds its value                                 -> "ok CHUNKS" | "bad WHY"
//   bytes         bytes of physical memory the program holds (cuMemCreate)    -> "ok BYTES"
//   exit
#include <cuda.h>

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr size_t kChunk = 2u << 20;
constexpr size_t kReserve = 1u << 30;

struct Chunk {
  CUmemGenericAllocationHandle handle = 0;
  uint32_t value = 0;
};

CUfunction g_fill, g_add;

CUresult kernel(CUfunction f, CUdeviceptr ptr, uint32_t value, size_t count) {
  void* params[] = {&ptr, &value, &count};
  return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, params, nullptr);
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CUdevice dev;
  CUcontext ctx;
  CUmodule mod;
  CUdeviceptr base = 0;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      cuModuleLoadData(&mod, "simcuda") != CUDA_SUCCESS ||
      cuModuleGetFunction(&g_fill, mod, "simcuda_fill_u32") != CUDA_SUCCESS ||
      cuModuleGetFunction(&g_add, mod, "simcuda_add_u32") != CUDA_SUCCESS ||
      cuMemAddressReserve(&base, kReserve, 0, 0, 0) != CUDA_SUCCESS) {
    std::printf("err setup\n");
    return 1;
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  std::vector<Chunk> chunks;
  uint32_t next_value = 1;
  std::printf("ready\n");

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    CUresult r = CUDA_SUCCESS;
    if (cmd == "grow") {
      size_t n = 0;
      in >> n;
      for (size_t i = 0; i < n && r == CUDA_SUCCESS; ++i) {
        Chunk c;
        c.value = next_value++ * 1000;
        const CUdeviceptr at = base + chunks.size() * kChunk;
        if ((r = cuMemCreate(&c.handle, kChunk, &prop, 0)) != CUDA_SUCCESS) break;
        if ((r = cuMemMap(at, kChunk, 0, c.handle, 0)) != CUDA_SUCCESS) break;
        if ((r = cuMemSetAccess(at, kChunk, &access, 1)) != CUDA_SUCCESS) break;
        if ((r = kernel(g_fill, at, c.value, kChunk / 4)) != CUDA_SUCCESS) break;
        chunks.push_back(c);
      }
      if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
    } else if (cmd == "shrink") {
      size_t n = 0;
      in >> n;
      for (size_t i = 0; i < n && !chunks.empty() && r == CUDA_SUCCESS; ++i) {
        const CUdeviceptr at = base + (chunks.size() - 1) * kChunk;
        if ((r = cuMemUnmap(at, kChunk)) != CUDA_SUCCESS) break;
        if ((r = cuMemRelease(chunks.back().handle)) != CUDA_SUCCESS) break;
        chunks.pop_back();
      }
    } else if (cmd == "add") {
      uint32_t v = 0;
      in >> v;
      for (auto& c : chunks) c.value += v;
      if (!chunks.empty()) r = kernel(g_add, base, v, chunks.size() * kChunk / 4);
      if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
    } else if (cmd == "check") {
      std::vector<uint32_t> host(kChunk / 4);
      std::string bad;
      for (size_t i = 0; i < chunks.size() && bad.empty() && r == CUDA_SUCCESS; ++i) {
        if ((r = cuMemcpyDtoH(host.data(), base + i * kChunk, kChunk)) != CUDA_SUCCESS) break;
        for (size_t w = 0; w < host.size(); ++w) {
          if (host[w] != chunks[i].value) {
            bad = "chunk " + std::to_string(i) + " word " + std::to_string(w) + " is " + std::to_string(host[w]) +
                  ", expected " + std::to_string(chunks[i].value);
            break;
          }
        }
      }
      if (!bad.empty()) {
        std::printf("bad %s\n", bad.c_str());
        continue;
      }
    } else if (cmd == "bytes") {
      std::printf("ok %zu\n", chunks.size() * kChunk);
      continue;
    } else if (cmd == "exit") {
      break;
    } else {
      std::printf("err unknown command\n");
      continue;
    }
    if (r != CUDA_SUCCESS)
      std::printf("err %d\n", static_cast<int>(r));
    else if (cmd == "add")
      std::printf("ok\n");
    else
      std::printf("ok %zu\n", chunks.size());
  }
  return 0;
}
