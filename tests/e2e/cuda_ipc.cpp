// SPDX-License-Identifier: Apache-2.0
// Legacy CUDA IPC between two ordinary driver programs, as torch.multiprocessing does it.
//
//   cuda_ipc export BYTES   allocates two buffers of BYTES with cuMemAlloc ("shared" and "private"),
//                           fills them with 1 and 2, and shares the first with cuIpcGetMemHandle:
//                           prints "ready HANDLE" (the 64 handle bytes in hex) or "err WHAT RC".
//   cuda_ipc import HANDLE  opens the handle with cuIpcOpenMemHandle: "ready" or "err open RC".
//
// Each runs on device 0, or on the device CUDA_IPC_DEVICE names (an importer on another device than
// the exporter's maps the memory across devices, as with peer access).
//
// Then, on stdin (both roles; `buf` is shared or private, the importer has only shared):
//   check BUF V   every 32-bit word of BUF is V (read with cuMemcpyDtoH)  -> "ok" | "bad WHY"
//   fill BUF V    cuMemsetD32 BUF to V, synchronized                     -> "ok" | "err RC"
//   open          (importer) cuIpcOpenMemHandle again                    -> "ok" | "err RC"
//   close         (importer) cuIpcCloseMemHandle                         -> "ok" | "err RC"
//   selfopen      (exporter) opens its own handle, which the driver refuses -> "rc RC"
//   exit          frees (exporter) and exits                              -> "ok"
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string to_hex(const CUipcMemHandle& h) {
  std::string out;
  char b[3];
  for (unsigned char c : h.reserved) {
    std::snprintf(b, sizeof(b), "%02x", c);
    out += b;
  }
  return out;
}

bool from_hex(const std::string& s, CUipcMemHandle* h) {
  if (s.size() != 2 * sizeof(h->reserved)) return false;
  for (size_t i = 0; i < sizeof(h->reserved); ++i)
    h->reserved[i] = static_cast<char>(std::strtoul(s.substr(2 * i, 2).c_str(), nullptr, 16));
  return true;
}

std::string check(CUdeviceptr p, size_t bytes, uint32_t want) {
  std::vector<uint32_t> host(bytes / 4);
  if (CUresult r = cuMemcpyDtoH(host.data(), p, bytes); r != CUDA_SUCCESS) return "bad copy " + std::to_string(r);
  for (size_t i = 0; i < host.size(); ++i)
    if (host[i] != want) return "bad word " + std::to_string(i) + " is " + std::to_string(host[i]);
  return "ok";
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc != 3 || (std::strcmp(argv[1], "export") != 0 && std::strcmp(argv[1], "import") != 0)) {
    std::fprintf(stderr, "usage: cuda_ipc export BYTES | import HANDLE\n");
    return 2;
  }
  const bool exporter = std::strcmp(argv[1], "export") == 0;
  CUdevice dev;
  CUcontext ctx;
  const char* ordinal = std::getenv("CUDA_IPC_DEVICE");
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, ordinal ? std::atoi(ordinal) : 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::printf("err setup 0\n");
    return 1;
  }
  CUdeviceptr shared = 0, priv = 0;
  size_t bytes = 0;
  CUipcMemHandle handle{};
  if (exporter) {
    bytes = std::strtoull(argv[2], nullptr, 10);
    CUresult r = cuMemAlloc(&shared, bytes);
    if (r == CUDA_SUCCESS) r = cuMemAlloc(&priv, bytes);
    if (r == CUDA_SUCCESS) r = cuMemsetD32(shared, 1, bytes / 4);
    if (r == CUDA_SUCCESS) r = cuMemsetD32(priv, 2, bytes / 4);
    if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
    if (r != CUDA_SUCCESS) {
      std::printf("err allocate %d\n", r);
      return 1;
    }
    if ((r = cuIpcGetMemHandle(&handle, shared)) != CUDA_SUCCESS) {
      std::printf("err cuIpcGetMemHandle %d\n", r);
      return 1;
    }
    std::printf("ready %s\n", to_hex(handle).c_str());
  } else {
    if (!from_hex(argv[2], &handle)) {
      std::printf("err handle 0\n");
      return 1;
    }
    if (CUresult r = cuIpcOpenMemHandle(&shared, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS); r != CUDA_SUCCESS) {
      std::printf("err open %d\n", r);
      return 1;
    }
    // The mapping's size, as any importer would learn it.
    CUdeviceptr base = 0;
    if (CUresult r = cuMemGetAddressRange(&base, &bytes, shared); r != CUDA_SUCCESS || base != shared) {
      std::printf("err range %d\n", r);
      return 1;
    }
    std::printf("ready\n");
  }

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, buf;
    uint32_t value = 0;
    in >> cmd >> buf >> value;
    const CUdeviceptr target = buf == "private" ? priv : shared;
    if ((cmd == "check" || cmd == "fill") && !target) {
      std::printf("err no such buffer\n");
    } else if (cmd == "check") {
      std::printf("%s\n", check(target, bytes, value).c_str());
    } else if (cmd == "fill") {
      CUresult r = cuMemsetD32(target, value, bytes / 4);
      if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
      std::printf(r == CUDA_SUCCESS ? "ok\n" : "err %d\n", r);
    } else if (cmd == "open") {
      CUdeviceptr p = 0;
      const CUresult r = cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (r == CUDA_SUCCESS) shared = p;
      std::printf(r == CUDA_SUCCESS ? "ok\n" : "err %d\n", r);
    } else if (cmd == "close") {
      const CUresult r = cuIpcCloseMemHandle(shared);
      std::printf(r == CUDA_SUCCESS ? "ok\n" : "err %d\n", r);
    } else if (cmd == "selfopen") {
      CUdeviceptr p = 0;
      std::printf("rc %d\n", cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    } else if (cmd == "exit") {
      if (exporter) {
        cuMemFree(shared);
        cuMemFree(priv);
      }
      std::printf("ok\n");
      return 0;
    } else {
      std::printf("err unknown command\n");
    }
  }
  return 0;
}
