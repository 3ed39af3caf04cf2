// SPDX-License-Identifier: Apache-2.0
// The one list of driver entry points: what the shim intercepts and what it calls. Every other place
// (real-symbol resolution, the dlsym / cuGetProcAddress lookup map, exported symbols) expands it.
#pragma once

#include "cuda_api.h"

// Intercepted entry points, by exported symbol name:
//   X(name, params, args, base, since, variant, need)
// base/since: cuGetProcAddress resolves `base` to this symbol for cudaVersion >= since (until the
// next entry with the same base and variant). variant: Any (one function for both stream modes),
// Legacy or PerThread (the _ptsz/_ptds twin picked by CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM).
// need: Required (the shim disables itself without it) or Optional.
// Adding a line here also needs a definition in the core (namespace tmsdisk::shim::hook); the
// version script is generated from this list (interposer/version_script.cpp).
#define TMSDISK_HOOKS(X)                                                                                              \
  X(cuMemAlloc_v2, (CUdeviceptr * dptr, size_t bytesize), (dptr, bytesize), "cuMemAlloc", 3020, Any, Required)        \
  X(cuMemAllocPitch_v2, (CUdeviceptr * dptr, size_t * pitch, size_t width, size_t height, unsigned int element_size), \
    (dptr, pitch, width, height, element_size), "cuMemAllocPitch", 3020, Any, Required)                               \
  X(cuMemFree_v2, (CUdeviceptr dptr), (dptr), "cuMemFree", 3020, Any, Required)                                       \
  X(cuGetProcAddress, (const char* symbol, void** pfn, int cuda_version, cuuint64_t flags),                           \
    (symbol, pfn, cuda_version, flags), "cuGetProcAddress", 11030, Any, Optional)                                     \
  X(cuGetProcAddress_v2,                                                                                              \
    (const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,                                              \
     CUdriverProcAddressQueryResult* symbol_status),                                                                  \
    (symbol, pfn, cuda_version, flags, symbol_status), "cuGetProcAddress", 12000, Any, Optional)                      \
  TMSDISK_GATED_HOOKS(X)                                                                                              \
  TMSDISK_CAPTURE_HOOKS(X)                                                                                            \
  TMSDISK_VMM_HOOKS(X)                                                                                                \
  TMSDISK_IPC_HOOKS(X)

// Calls that submit work or touch device memory: each passes the gate (gate.h) and then forwards
// unchanged, one generic definition for all (gated.cpp). Query and synchronize calls are absent on
// purpose: watchdog threads must not wake a paused process. The 32-bit CUDA 2.x entry points are
// not listed (nothing built in this century calls them).
#define TMSDISK_GATED_HOOKS(X)                                                                                         \
  X(cuLaunchKernel,                                                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,        \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,                    \
     void** kernelParams, void** extra),                                                                               \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra),  \
    "cuLaunchKernel", 4000, Legacy, Optional)                                                                          \
  X(cuLaunchKernel_ptsz,                                                                                               \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,        \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,                    \
     void** kernelParams, void** extra),                                                                               \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra),  \
    "cuLaunchKernel", 7000, PerThread, Optional)                                                                       \
  X(cuLaunchKernelEx, (const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra),                 \
    (config, f, kernelParams, extra), "cuLaunchKernelEx", 11060, Legacy, Optional)                                     \
  X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra),            \
    (config, f, kernelParams, extra), "cuLaunchKernelEx", 11060, PerThread, Optional)                                  \
  X(cuLaunchCooperativeKernel,                                                                                         \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,        \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,                    \
     void** kernelParams),                                                                                             \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams),         \
    "cuLaunchCooperativeKernel", 9000, Legacy, Optional)                                                               \
  X(cuLaunchCooperativeKernel_ptsz,                                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX,        \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,                    \
     void** kernelParams),                                                                                             \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams),         \
    "cuLaunchCooperativeKernel", 9000, PerThread, Optional)                                                            \
  X(cuGraphLaunch, (CUgraphExec hGraph, CUstream hStream), (hGraph, hStream), "cuGraphLaunch", 10000, Legacy,          \
    Optional)                                                                                                          \
  X(cuGraphLaunch_ptsz, (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream), "cuGraphLaunch", 10000,     \
    PerThread, Optional)                                                                                               \
  X(cuMemcpyHtoD_v2, (CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount), (dstDevice, srcHost, ByteCount),  \
    "cuMemcpyHtoD", 3020, Legacy, Optional)                                                                            \
  X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount),                              \
    (dstDevice, srcHost, ByteCount), "cuMemcpyHtoD", 7000, PerThread, Optional)                                        \
  X(cuMemcpyDtoH_v2, (void* dstHost, CUdeviceptr srcDevice, size_t ByteCount), (dstHost, srcDevice, ByteCount),        \
    "cuMemcpyDtoH", 3020, Legacy, Optional)                                                                            \
  X(cuMemcpyDtoH_v2_ptds, (void* dstHost, CUdeviceptr srcDevice, size_t ByteCount), (dstHost, srcDevice, ByteCount),   \
    "cuMemcpyDtoH", 7000, PerThread, Optional)                                                                         \
  X(cuMemcpyDtoD_v2, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount),                                 \
    (dstDevice, srcDevice, ByteCount), "cuMemcpyDtoD", 3020, Legacy, Optional)                                         \
  X(cuMemcpyDtoD_v2_ptds, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount),                            \
    (dstDevice, srcDevice, ByteCount), "cuMemcpyDtoD", 7000, PerThread, Optional)                                      \
  X(cuMemcpyDtoA_v2, (CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice, size_t ByteCount),                    \
    (dstArray, dstOffset, srcDevice, ByteCount), "cuMemcpyDtoA", 3020, Legacy, Optional)                               \
  X(cuMemcpyDtoA_v2_ptds, (CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice, size_t ByteCount),               \
    (dstArray, dstOffset, srcDevice, ByteCount), "cuMemcpyDtoA", 7000, PerThread, Optional)                            \
  X(cuMemcpyAtoD_v2, (CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset, size_t ByteCount),                    \
    (dstDevice, srcArray, srcOffset, ByteCount), "cuMemcpyAtoD", 3020, Legacy, Optional)                               \
  X(cuMemcpyAtoD_v2_ptds, (CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset, size_t ByteCount),               \
    (dstDevice, srcArray, srcOffset, ByteCount), "cuMemcpyAtoD", 7000, PerThread, Optional)                            \
  X(cuMemcpy2D_v2, (const CUDA_MEMCPY2D* pCopy), (pCopy), "cuMemcpy2D", 3020, Legacy, Optional)                        \
  X(cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D* pCopy), (pCopy), "cuMemcpy2D", 7000, PerThread, Optional)                \
  X(cuMemcpy2DUnaligned_v2, (const CUDA_MEMCPY2D* pCopy), (pCopy), "cuMemcpy2DUnaligned", 3020, Legacy, Optional)      \
  X(cuMemcpy2DUnaligned_v2_ptds, (const CUDA_MEMCPY2D* pCopy), (pCopy), "cuMemcpy2DUnaligned", 7000, PerThread,        \
    Optional)                                                                                                          \
  X(cuMemcpy3D_v2, (const CUDA_MEMCPY3D* pCopy), (pCopy), "cuMemcpy3D", 3020, Legacy, Optional)                        \
  X(cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D* pCopy), (pCopy), "cuMemcpy3D", 7000, PerThread, Optional)                \
  X(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount), (dst, src, ByteCount), "cuMemcpy", 4000, Legacy,   \
    Optional)                                                                                                          \
  X(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount), (dst, src, ByteCount), "cuMemcpy", 7000,      \
    PerThread, Optional)                                                                                               \
  X(cuMemcpyPeer,                                                                                                      \
    (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount),      \
    (dstDevice, dstContext, srcDevice, srcContext, ByteCount), "cuMemcpyPeer", 4000, Legacy, Optional)                 \
  X(cuMemcpyPeer_ptds,                                                                                                 \
    (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount),      \
    (dstDevice, dstContext, srcDevice, srcContext, ByteCount), "cuMemcpyPeer", 7000, PerThread, Optional)              \
  X(cuMemcpy3DPeer, (const CUDA_MEMCPY3D_PEER* pCopy), (pCopy), "cuMemcpy3DPeer", 4000, Legacy, Optional)              \
  X(cuMemcpy3DPeer_ptds, (const CUDA_MEMCPY3D_PEER* pCopy), (pCopy), "cuMemcpy3DPeer", 7000, PerThread, Optional)      \
  X(cuMemcpyHtoDAsync_v2, (CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream),            \
    (dstDevice, srcHost, ByteCount, hStream), "cuMemcpyHtoDAsync", 3020, Legacy, Required)                             \
  X(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream),       \
    (dstDevice, srcHost, ByteCount, hStream), "cuMemcpyHtoDAsync", 7000, PerThread, Optional)                          \
  X(cuMemcpyDtoHAsync_v2, (void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),                  \
    (dstHost, srcDevice, ByteCount, hStream), "cuMemcpyDtoHAsync", 3020, Legacy, Required)                             \
  X(cuMemcpyDtoHAsync_v2_ptsz, (void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),             \
    (dstHost, srcDevice, ByteCount, hStream), "cuMemcpyDtoHAsync", 7000, PerThread, Optional)                          \
  X(cuMemcpyDtoDAsync_v2, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),          \
    (dstDevice, srcDevice, ByteCount, hStream), "cuMemcpyDtoDAsync", 3020, Legacy, Optional)                           \
  X(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),     \
    (dstDevice, srcDevice, ByteCount, hStream), "cuMemcpyDtoDAsync", 7000, PerThread, Optional)                        \
  X(cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D* pCopy, CUstream hStream), (pCopy, hStream), "cuMemcpy2DAsync", 3020,     \
    Legacy, Optional)                                                                                                  \
  X(cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D* pCopy, CUstream hStream), (pCopy, hStream), "cuMemcpy2DAsync",      \
    7000, PerThread, Optional)                                                                                         \
  X(cuMemcpy3DAsync_v2, (const CUDA_MEMCPY3D* pCopy, CUstream hStream), (pCopy, hStream), "cuMemcpy3DAsync", 3020,     \
    Legacy, Optional)                                                                                                  \
  X(cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D* pCopy, CUstream hStream), (pCopy, hStream), "cuMemcpy3DAsync",      \
    7000, PerThread, Optional)                                                                                         \
  X(cuMemcpyAsync, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream),                             \
    (dst, src, ByteCount, hStream), "cuMemcpyAsync", 4000, Legacy, Optional)                                           \
  X(cuMemcpyAsync_ptsz, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream),                        \
    (dst, src, ByteCount, hStream), "cuMemcpyAsync", 7000, PerThread, Optional)                                        \
  X(cuMemcpyPeerAsync,                                                                                                 \
    (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,       \
     CUstream hStream),                                                                                                \
    (dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream), "cuMemcpyPeerAsync", 4000, Legacy, Optional)   \
  X(cuMemcpyPeerAsync_ptsz,                                                                                            \
    (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,       \
     CUstream hStream),                                                                                                \
    (dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream), "cuMemcpyPeerAsync", 7000, PerThread,          \
    Optional)                                                                                                          \
  X(cuMemcpy3DPeerAsync, (const CUDA_MEMCPY3D_PEER* pCopy, CUstream hStream), (pCopy, hStream), "cuMemcpy3DPeerAsync", \
    4000, Legacy, Optional)                                                                                            \
  X(cuMemcpy3DPeerAsync_ptsz, (const CUDA_MEMCPY3D_PEER* pCopy, CUstream hStream), (pCopy, hStream),                   \
    "cuMemcpy3DPeerAsync", 7000, PerThread, Optional)                                                                  \
  X(cuMemcpyBatchAsync,                                                                                                \
    (CUdeviceptr * dsts, CUdeviceptr * srcs, size_t * sizes, size_t count, CUmemcpyAttributes * attrs,                 \
     size_t * attrsIdxs, size_t numAttrs, size_t * failIdx, CUstream hStream),                                         \
    (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream), "cuMemcpyBatchAsync", 12080, Legacy,     \
    Optional)                                                                                                          \
  X(cuMemcpyBatchAsync_ptsz,                                                                                           \
    (CUdeviceptr * dsts, CUdeviceptr * srcs, size_t * sizes, size_t count, CUmemcpyAttributes * attrs,                 \
     size_t * attrsIdxs, size_t numAttrs, size_t * failIdx, CUstream hStream),                                         \
    (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream), "cuMemcpyBatchAsync", 12080, PerThread,  \
    Optional)                                                                                                          \
  X(cuMemcpyBatchAsync_v2,                                                                                             \
    (CUdeviceptr * dsts, CUdeviceptr * srcs, size_t * sizes, size_t count, CUmemcpyAttributes * attrs,                 \
     size_t * attrsIdxs, size_t numAttrs, CUstream hStream),                                                           \
    (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream), "cuMemcpyBatchAsync", 13000, Legacy, Optional)    \
  X(cuMemcpyBatchAsync_v2_ptsz,                                                                                        \
    (CUdeviceptr * dsts, CUdeviceptr * srcs, size_t * sizes, size_t count, CUmemcpyAttributes * attrs,                 \
     size_t * attrsIdxs, size_t numAttrs, CUstream hStream),                                                           \
    (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream), "cuMemcpyBatchAsync", 13000, PerThread, Optional) \
  X(cuMemcpy3DBatchAsync,                                                                                              \
    (size_t numOps, CUDA_MEMCPY3D_BATCH_OP * opList, size_t * failIdx, unsigned long long flags, CUstream hStream),    \
    (numOps, opList, failIdx, flags, hStream), "cuMemcpy3DBatchAsync", 12080, Legacy, Optional)                        \
  X(cuMemcpy3DBatchAsync_ptsz,                                                                                         \
    (size_t numOps, CUDA_MEMCPY3D_BATCH_OP * opList, size_t * failIdx, unsigned long long flags, CUstream hStream),    \
    (numOps, opList, failIdx, flags, hStream), "cuMemcpy3DBatchAsync", 12080, PerThread, Optional)                     \
  X(cuMemcpy3DBatchAsync_v2,                                                                                           \
    (size_t numOps, CUDA_MEMCPY3D_BATCH_OP * opList, unsigned long long flags, CUstream hStream),                      \
    (numOps, opList, flags, hStream), "cuMemcpy3DBatchAsync", 13000, Legacy, Optional)                                 \
  X(cuMemcpy3DBatchAsync_v2_ptsz,                                                                                      \
    (size_t numOps, CUDA_MEMCPY3D_BATCH_OP * opList, unsigned long long flags, CUstream hStream),                      \
    (numOps, opList, flags, hStream), "cuMemcpy3DBatchAsync", 13000, PerThread, Optional)                              \
  X(cuMemsetD8_v2, (CUdeviceptr dstDevice, unsigned char uc, size_t N), (dstDevice, uc, N), "cuMemsetD8", 3020,        \
    Legacy, Optional)                                                                                                  \
  X(cuMemsetD8_v2_ptds, (CUdeviceptr dstDevice, unsigned char uc, size_t N), (dstDevice, uc, N), "cuMemsetD8", 7000,   \
    PerThread, Optional)                                                                                               \
  X(cuMemsetD8Async, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream),                            \
    (dstDevice, uc, N, hStream), "cuMemsetD8Async", 3020, Legacy, Optional)                                            \
  X(cuMemsetD8Async_ptsz, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream),                       \
    (dstDevice, uc, N, hStream), "cuMemsetD8Async", 7000, PerThread, Optional)                                         \
  X(cuMemsetD16_v2, (CUdeviceptr dstDevice, unsigned short us, size_t N), (dstDevice, us, N), "cuMemsetD16", 3020,     \
    Legacy, Optional)                                                                                                  \
  X(cuMemsetD16_v2_ptds, (CUdeviceptr dstDevice, unsigned short us, size_t N), (dstDevice, us, N), "cuMemsetD16",      \
    7000, PerThread, Optional)                                                                                         \
  X(cuMemsetD16Async, (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream),                          \
    (dstDevice, us, N, hStream), "cuMemsetD16Async", 3020, Legacy, Optional)                                           \
  X(cuMemsetD16Async_ptsz, (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream),                     \
    (dstDevice, us, N, hStream), "cuMemsetD16Async", 7000, PerThread, Optional)                                        \
  X(cuMemsetD32_v2, (CUdeviceptr dstDevice, unsigned int ui, size_t N), (dstDevice, ui, N), "cuMemsetD32", 3020,       \
    Legacy, Optional)                                                                                                  \
  X(cuMemsetD32_v2_ptds, (CUdeviceptr dstDevice, unsigned int ui, size_t N), (dstDevice, ui, N), "cuMemsetD32", 7000,  \
    PerThread, Optional)                                                                                               \
  X(cuMemsetD32Async, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream),                            \
    (dstDevice, ui, N, hStream), "cuMemsetD32Async", 3020, Legacy, Optional)                                           \
  X(cuMemsetD32Async_ptsz, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream),                       \
    (dstDevice, ui, N, hStream), "cuMemsetD32Async", 7000, PerThread, Optional)                                        \
  X(cuMemsetD2D8_v2, (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height),          \
    (dstDevice, dstPitch, uc, Width, Height), "cuMemsetD2D8", 3020, Legacy, Optional)                                  \
  X(cuMemsetD2D8_v2_ptds, (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height),     \
    (dstDevice, dstPitch, uc, Width, Height), "cuMemsetD2D8", 7000, PerThread, Optional)                               \
  X(cuMemsetD2D8Async,                                                                                                 \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height, CUstream hStream),         \
    (dstDevice, dstPitch, uc, Width, Height, hStream), "cuMemsetD2D8Async", 3020, Legacy, Optional)                    \
  X(cuMemsetD2D8Async_ptsz,                                                                                            \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc, size_t Width, size_t Height, CUstream hStream),         \
    (dstDevice, dstPitch, uc, Width, Height, hStream), "cuMemsetD2D8Async", 7000, PerThread, Optional)                 \
  X(cuMemsetD2D16_v2, (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height),        \
    (dstDevice, dstPitch, us, Width, Height), "cuMemsetD2D16", 3020, Legacy, Optional)                                 \
  X(cuMemsetD2D16_v2_ptds, (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height),   \
    (dstDevice, dstPitch, us, Width, Height), "cuMemsetD2D16", 7000, PerThread, Optional)                              \
  X(cuMemsetD2D16Async,                                                                                                \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height, CUstream hStream),        \
    (dstDevice, dstPitch, us, Width, Height, hStream), "cuMemsetD2D16Async", 3020, Legacy, Optional)                   \
  X(cuMemsetD2D16Async_ptsz,                                                                                           \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us, size_t Width, size_t Height, CUstream hStream),        \
    (dstDevice, dstPitch, us, Width, Height, hStream), "cuMemsetD2D16Async", 7000, PerThread, Optional)                \
  X(cuMemsetD2D32_v2, (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height),          \
    (dstDevice, dstPitch, ui, Width, Height), "cuMemsetD2D32", 3020, Legacy, Optional)                                 \
  X(cuMemsetD2D32_v2_ptds, (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height),     \
    (dstDevice, dstPitch, ui, Width, Height), "cuMemsetD2D32", 7000, PerThread, Optional)                              \
  X(cuMemsetD2D32Async,                                                                                                \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height, CUstream hStream),          \
    (dstDevice, dstPitch, ui, Width, Height, hStream), "cuMemsetD2D32Async", 3020, Legacy, Optional)                   \
  X(cuMemsetD2D32Async_ptsz,                                                                                           \
    (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui, size_t Width, size_t Height, CUstream hStream),          \
    (dstDevice, dstPitch, ui, Width, Height, hStream), "cuMemsetD2D32Async", 7000, PerThread, Optional)                \
  X(cuMemPrefetchAsync, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream),                      \
    (devPtr, count, dstDevice, hStream), "cuMemPrefetchAsync", 8000, Legacy, Optional)                                 \
  X(cuMemPrefetchAsync_ptsz, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream),                 \
    (devPtr, count, dstDevice, hStream), "cuMemPrefetchAsync", 8000, PerThread, Optional)                              \
  X(cuMemPrefetchAsync_v2,                                                                                             \
    (CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags, CUstream hStream),                  \
    (devPtr, count, location, flags, hStream), "cuMemPrefetchAsync", 12020, Legacy, Optional)                          \
  X(cuMemPrefetchAsync_v2_ptsz,                                                                                        \
    (CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags, CUstream hStream),                  \
    (devPtr, count, location, flags, hStream), "cuMemPrefetchAsync", 12020, PerThread, Optional)                       \
  /* Stream memory operations read and write device memory from the stream, like copies. */                            \
  X(cuStreamWriteValue32, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),                   \
    (stream, addr, value, flags), "cuStreamWriteValue32", 8000, Legacy, Optional)                                      \
  X(cuStreamWriteValue32_ptsz, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),              \
    (stream, addr, value, flags), "cuStreamWriteValue32", 8000, PerThread, Optional)                                   \
  X(cuStreamWriteValue32_v2, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),                \
    (stream, addr, value, flags), "cuStreamWriteValue32", 11070, Legacy, Optional)                                     \
  X(cuStreamWriteValue32_v2_ptsz, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),           \
    (stream, addr, value, flags), "cuStreamWriteValue32", 11070, PerThread, Optional)                                  \
  X(cuStreamWaitValue32, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),                    \
    (stream, addr, value, flags), "cuStreamWaitValue32", 8000, Legacy, Optional)                                       \
  X(cuStreamWaitValue32_ptsz, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),               \
    (stream, addr, value, flags), "cuStreamWaitValue32", 8000, PerThread, Optional)                                    \
  X(cuStreamWaitValue32_v2, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),                 \
    (stream, addr, value, flags), "cuStreamWaitValue32", 11070, Legacy, Optional)                                      \
  X(cuStreamWaitValue32_v2_ptsz, (CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags),            \
    (stream, addr, value, flags), "cuStreamWaitValue32", 11070, PerThread, Optional)                                   \
  X(cuStreamWriteValue64, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),                   \
    (stream, addr, value, flags), "cuStreamWriteValue64", 9000, Legacy, Optional)                                      \
  X(cuStreamWriteValue64_ptsz, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),              \
    (stream, addr, value, flags), "cuStreamWriteValue64", 9000, PerThread, Optional)                                   \
  X(cuStreamWriteValue64_v2, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),                \
    (stream, addr, value, flags), "cuStreamWriteValue64", 11070, Legacy, Optional)                                     \
  X(cuStreamWriteValue64_v2_ptsz, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),           \
    (stream, addr, value, flags), "cuStreamWriteValue64", 11070, PerThread, Optional)                                  \
  X(cuStreamWaitValue64, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),                    \
    (stream, addr, value, flags), "cuStreamWaitValue64", 9000, Legacy, Optional)                                       \
  X(cuStreamWaitValue64_ptsz, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),               \
    (stream, addr, value, flags), "cuStreamWaitValue64", 9000, PerThread, Optional)                                    \
  X(cuStreamWaitValue64_v2, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),                 \
    (stream, addr, value, flags), "cuStreamWaitValue64", 11070, Legacy, Optional)                                      \
  X(cuStreamWaitValue64_v2_ptsz, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),            \
    (stream, addr, value, flags), "cuStreamWaitValue64", 11070, PerThread, Optional)                                   \
  X(cuStreamBatchMemOp,                                                                                                \
    (CUstream stream, unsigned int count, CUstreamBatchMemOpParams* paramArray, unsigned int flags),                   \
    (stream, count, paramArray, flags), "cuStreamBatchMemOp", 8000, Legacy, Optional)                                  \
  X(cuStreamBatchMemOp_ptsz,                                                                                           \
    (CUstream stream, unsigned int count, CUstreamBatchMemOpParams* paramArray, unsigned int flags),                   \
    (stream, count, paramArray, flags), "cuStreamBatchMemOp", 8000, PerThread, Optional)                               \
  X(cuStreamBatchMemOp_v2,                                                                                             \
    (CUstream stream, unsigned int count, CUstreamBatchMemOpParams* paramArray, unsigned int flags),                   \
    (stream, count, paramArray, flags), "cuStreamBatchMemOp", 11070, Legacy, Optional)                                 \
  X(cuStreamBatchMemOp_v2_ptsz,                                                                                        \
    (CUstream stream, unsigned int count, CUstreamBatchMemOpParams* paramArray, unsigned int flags),                   \
    (stream, count, paramArray, flags), "cuStreamBatchMemOp", 11070, PerThread, Optional)

// Stream capture: gated like work submission, and recorded so a pause can refuse while a graph is
// being captured (gated.cpp).
#define TMSDISK_CAPTURE_HOOKS(X)                                                                                     \
  X(cuStreamBeginCapture, (CUstream hStream), (hStream), "cuStreamBeginCapture", 10000, Legacy, Optional)            \
  X(cuStreamBeginCapture_ptsz, (CUstream hStream), (hStream), "cuStreamBeginCapture", 10000, PerThread, Optional)    \
  X(cuStreamBeginCapture_v2, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode), "cuStreamBeginCapture",  \
    10010, Legacy, Optional)                                                                                         \
  X(cuStreamBeginCapture_v2_ptsz, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode),                     \
    "cuStreamBeginCapture", 10010, PerThread, Optional)                                                              \
  X(cuStreamBeginCaptureToGraph,                                                                                     \
    (CUstream hStream, CUgraph hGraph, const CUgraphNode* dependencies, const CUgraphEdgeData* dependencyData,       \
     size_t numDependencies, CUstreamCaptureMode mode),                                                              \
    (hStream, hGraph, dependencies, dependencyData, numDependencies, mode), "cuStreamBeginCaptureToGraph", 12030,    \
    Legacy, Optional)                                                                                                \
  X(cuStreamBeginCaptureToGraph_ptsz,                                                                                \
    (CUstream hStream, CUgraph hGraph, const CUgraphNode* dependencies, const CUgraphEdgeData* dependencyData,       \
     size_t numDependencies, CUstreamCaptureMode mode),                                                              \
    (hStream, hGraph, dependencies, dependencyData, numDependencies, mode), "cuStreamBeginCaptureToGraph", 12030,    \
    PerThread, Optional)                                                                                             \
  X(cuStreamEndCapture, (CUstream hStream, CUgraph * phGraph), (hStream, phGraph), "cuStreamEndCapture", 10000,      \
    Legacy, Optional)                                                                                                \
  X(cuStreamEndCapture_ptsz, (CUstream hStream, CUgraph * phGraph), (hStream, phGraph), "cuStreamEndCapture", 10000, \
    PerThread, Optional)

// Memory the shim accounts for, application VMM behind handle tokens, pointer queries, sharing
// (vmm.cpp). Calls that touch or hand out physical memory pass the gate.
#define TMSDISK_VMM_HOOKS(X)                                                                                           \
  X(cuMemAllocManaged, (CUdeviceptr * dptr, size_t bytesize, unsigned int flags), (dptr, bytesize, flags),             \
    "cuMemAllocManaged", 6000, Any, Optional)                                                                          \
  X(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream hStream), (dptr, bytesize, hStream),               \
    "cuMemAllocAsync", 11020, Legacy, Optional)                                                                        \
  X(cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUstream hStream), (dptr, bytesize, hStream),          \
    "cuMemAllocAsync", 11020, PerThread, Optional)                                                                     \
  X(cuMemAllocFromPoolAsync, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream),               \
    (dptr, bytesize, pool, hStream), "cuMemAllocFromPoolAsync", 11020, Legacy, Optional)                               \
  X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream),          \
    (dptr, bytesize, pool, hStream), "cuMemAllocFromPoolAsync", 11020, PerThread, Optional)                            \
  X(cuMemFreeAsync, (CUdeviceptr dptr, CUstream hStream), (dptr, hStream), "cuMemFreeAsync", 11020, Legacy, Optional)  \
  X(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream hStream), (dptr, hStream), "cuMemFreeAsync", 11020, PerThread,    \
    Optional)                                                                                                          \
  X(cuPointerGetAttribute, (void* data, CUpointer_attribute attribute, CUdeviceptr ptr), (data, attribute, ptr),       \
    "cuPointerGetAttribute", 4000, Any, Optional)                                                                      \
  X(cuPointerGetAttributes,                                                                                            \
    (unsigned int numAttributes, CUpointer_attribute* attributes, void** data, CUdeviceptr ptr),                       \
    (numAttributes, attributes, data, ptr), "cuPointerGetAttributes", 7000, Any, Optional)                             \
  X(cuMemGetAddressRange_v2, (CUdeviceptr * pbase, size_t * psize, CUdeviceptr dptr), (pbase, psize, dptr),            \
    "cuMemGetAddressRange", 3020, Any, Optional)                                                                       \
  X(cuMemCreate,                                                                                                       \
    (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp* prop, unsigned long long flags),   \
    (handle, size, prop, flags), "cuMemCreate", 10020, Any, Required)                                                  \
  X(cuMemRelease, (CUmemGenericAllocationHandle handle), (handle), "cuMemRelease", 10020, Any, Required)               \
  X(cuMemMap,                                                                                                          \
    (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags),      \
    (ptr, size, offset, handle, flags), "cuMemMap", 10020, Any, Required)                                              \
  X(cuMemUnmap, (CUdeviceptr ptr, size_t size), (ptr, size), "cuMemUnmap", 10020, Any, Required)                       \
  X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count),                         \
    (ptr, size, desc, count), "cuMemSetAccess", 10020, Any, Required)                                                  \
  X(cuMemGetAccess, (unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr),                       \
    (flags, location, ptr), "cuMemGetAccess", 10020, Any, Optional)                                                    \
  X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle * handle, void* addr), (handle, addr),                  \
    "cuMemRetainAllocationHandle", 11000, Any, Optional)                                                               \
  X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp * prop, CUmemGenericAllocationHandle handle),         \
    (prop, handle), "cuMemGetAllocationPropertiesFromHandle", 10020, Any, Optional)                                    \
  X(cuMemExportToShareableHandle,                                                                                      \
    (void* shareableHandle, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType,                 \
     unsigned long long flags),                                                                                        \
    (shareableHandle, handle, handleType, flags), "cuMemExportToShareableHandle", 10020, Any, Optional)                \
  X(cuMemImportFromShareableHandle,                                                                                    \
    (CUmemGenericAllocationHandle * handle, void* osHandle, CUmemAllocationHandleType shHandleType),                   \
    (handle, osHandle, shHandleType), "cuMemImportFromShareableHandle", 10020, Any, Optional)                          \
  X(cuMemGetHandleForAddressRange,                                                                                     \
    (void* handle, CUdeviceptr dptr, size_t size, CUmemRangeHandleType handleType, unsigned long long flags),          \
    (handle, dptr, size, handleType, flags), "cuMemGetHandleForAddressRange", 11070, Any, Optional)                    \
  X(cuMulticastBindMem,                                                                                                \
    (CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUmemGenericAllocationHandle memHandle, size_t memOffset, \
     size_t size, unsigned long long flags),                                                                           \
    (mcHandle, mcOffset, memHandle, memOffset, size, flags), "cuMulticastBindMem", 12010, Any, Optional)               \
  X(cuMulticastBindAddr,                                                                                               \
    (CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr, size_t size,                          \
     unsigned long long flags),                                                                                        \
    (mcHandle, mcOffset, memptr, size, flags), "cuMulticastBindAddr", 12010, Any, Optional)                            \
  X(cuCtxEnablePeerAccess, (CUcontext peerContext, unsigned int Flags), (peerContext, Flags), "cuCtxEnablePeerAccess", \
    4000, Any, Optional)

// Legacy IPC: brokered by tmsdiskd for the shim's own allocations (ipc.cpp).
#define TMSDISK_IPC_HOOKS(X)                                                                                          \
  X(cuIpcGetMemHandle, (CUipcMemHandle * pHandle, CUdeviceptr dptr), (pHandle, dptr), "cuIpcGetMemHandle", 4010, Any, \
    Optional)                                                                                                         \
  X(cuIpcOpenMemHandle, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int Flags), (pdptr, handle, Flags),     \
    "cuIpcOpenMemHandle", 4010, Any, Optional)                                                                        \
  X(cuIpcOpenMemHandle_v2, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int Flags), (pdptr, handle, Flags),  \
    "cuIpcOpenMemHandle", 11000, Any, Optional)                                                                       \
  X(cuIpcCloseMemHandle, (CUdeviceptr dptr), (dptr), "cuIpcCloseMemHandle", 4010, Any, Optional)

// Entry points the shim calls but does not intercept: X(name, params, need). cuGetExportTable is
// deliberately absent: it must reach the driver untouched.
#define TMSDISK_DRIVER_CALLS(X)                                                                                 \
  X(cuGetErrorName, (CUresult error, const char** name), Optional)                                              \
  X(cuDeviceGetCount, (int* count), Required)                                                                   \
  X(cuDeviceGetAttribute, (int* value, CUdevice_attribute attribute, CUdevice device), Required)                \
  X(cuCtxGetCurrent, (CUcontext * ctx), Required)                                                               \
  X(cuCtxGetDevice, (CUdevice * device), Required)                                                              \
  X(cuCtxPushCurrent_v2, (CUcontext ctx), Required)                                                             \
  X(cuCtxPopCurrent_v2, (CUcontext * ctx), Required)                                                            \
  X(cuCtxSynchronize, (void), Required)                                                                         \
  X(cuMemAddressReserve,                                                                                        \
    (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags), Required)   \
  X(cuMemAddressFree, (CUdeviceptr ptr, size_t size), Required)                                                 \
  X(cuMemGetAllocationGranularity,                                                                              \
    (size_t * granularity, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags option), Required) \
  X(cuStreamCreate, (CUstream * stream, unsigned int flags), Required)                                          \
  X(cuStreamDestroy_v2, (CUstream stream), Required)                                                            \
  X(cuEventCreate, (CUevent * event, unsigned int flags), Required)                                             \
  X(cuEventDestroy_v2, (CUevent event), Required)                                                               \
  X(cuEventRecord, (CUevent event, CUstream stream), Required)                                                  \
  X(cuEventQuery, (CUevent event), Required)                                                                    \
  X(cuEventSynchronize, (CUevent event), Required)                                                              \
  X(cuMemHostRegister_v2, (void* ptr, size_t bytes, unsigned int flags), Optional)                              \
  X(cuMemHostUnregister, (void* ptr), Optional)                                                                 \
  X(cuStreamIsCapturing, (CUstream stream, CUstreamCaptureStatus * status), Optional)                           \
  X(cuDevicePrimaryCtxRetain, (CUcontext * ctx, CUdevice device), Optional)                                     \
  X(cuDevicePrimaryCtxGetState, (CUdevice device, unsigned int* flags, int* active), Optional)                  \
  X(cuDevicePrimaryCtxRelease_v2, (CUdevice device), Optional)                                                  \
  X(cuDeviceGet, (CUdevice * device, int ordinal), Optional)                                                    \
  X(cuMemPoolTrimTo, (CUmemoryPool pool, size_t keep), Optional)                                                \
  X(cuDeviceGetMemPool, (CUmemoryPool * pool, CUdevice device), Optional)                                       \
  X(cuModuleLoadData, (CUmodule * module, const void* image), Optional)                                         \
  X(cuModuleGetFunction, (CUfunction * function, CUmodule module, const char* name), Optional)                  \
  X(cuModuleUnload, (CUmodule module), Optional)
