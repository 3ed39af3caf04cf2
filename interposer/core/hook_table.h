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
// Adding a line here also needs its name in interposer/libtmsdisk.map and a definition in the core
// (namespace tmsdisk::shim::hook); the export check test compares all three.
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
    (symbol, pfn, cuda_version, flags, symbol_status), "cuGetProcAddress", 12000, Any, Optional)

// Entry points the shim calls but does not intercept: X(name, params, need). cuGetExportTable is
// deliberately absent: it must reach the driver untouched.
#define TMSDISK_DRIVER_CALLS(X)                                                                                      \
  X(cuGetErrorName, (CUresult error, const char** name), Optional)                                                   \
  X(cuDeviceGetCount, (int* count), Required)                                                                        \
  X(cuDeviceGetAttribute, (int* value, CUdevice_attribute attribute, CUdevice device), Required)                     \
  X(cuCtxGetCurrent, (CUcontext * ctx), Required)                                                                    \
  X(cuCtxGetDevice, (CUdevice * device), Required)                                                                   \
  X(cuCtxPushCurrent_v2, (CUcontext ctx), Required)                                                                  \
  X(cuCtxPopCurrent_v2, (CUcontext * ctx), Required)                                                                 \
  X(cuCtxSynchronize, (void), Required)                                                                              \
  X(cuMemAddressReserve,                                                                                             \
    (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags), Required)        \
  X(cuMemAddressFree, (CUdeviceptr ptr, size_t size), Required)                                                      \
  X(cuMemCreate,                                                                                                     \
    (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp* prop, unsigned long long flags), \
    Required)                                                                                                        \
  X(cuMemRelease, (CUmemGenericAllocationHandle handle), Required)                                                   \
  X(cuMemMap,                                                                                                        \
    (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags),    \
    Required)                                                                                                        \
  X(cuMemUnmap, (CUdeviceptr ptr, size_t size), Required)                                                            \
  X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count), Required)             \
  X(cuMemGetAllocationGranularity,                                                                                   \
    (size_t * granularity, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags option), Required)      \
  X(cuStreamCreate, (CUstream * stream, unsigned int flags), Required)                                               \
  X(cuStreamDestroy_v2, (CUstream stream), Required)                                                                 \
  X(cuEventCreate, (CUevent * event, unsigned int flags), Required)                                                  \
  X(cuEventDestroy_v2, (CUevent event), Required)                                                                    \
  X(cuEventRecord, (CUevent event, CUstream stream), Required)                                                       \
  X(cuEventQuery, (CUevent event), Required)                                                                         \
  X(cuEventSynchronize, (CUevent event), Required)                                                                   \
  X(cuMemcpyDtoHAsync_v2, (void* dst, CUdeviceptr src, size_t bytes, CUstream stream), Required)                     \
  X(cuMemcpyHtoDAsync_v2, (CUdeviceptr dst, const void* src, size_t bytes, CUstream stream), Required)               \
  X(cuMemHostRegister_v2, (void* ptr, size_t bytes, unsigned int flags), Optional)                                   \
  X(cuMemHostUnregister, (void* ptr), Optional)
