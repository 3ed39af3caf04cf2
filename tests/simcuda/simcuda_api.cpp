// SPDX-License-Identifier: Apache-2.0
// simcuda's exported surface: the CUDA driver entry points under their real exported names, the
// cuGetProcAddress table, error strings, and the simcuda_ introspection API.
#include <cstring>
#include <new>

#include "simcuda/simcuda.h"
#include "simcuda_internal.h"

using namespace simcuda;

namespace {

// Every entry point goes through here: nothing before cuInit, and no exception ever reaches the
// caller (cuda.h declares the functions without noexcept, so the guard is the promise).
template <class F>
CUresult call(F&& f) {
  try {
    Driver* d = driver();
    if (d == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
    return f(*d);
  } catch (const std::bad_alloc&) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
}

CUresult need_ctx(Driver& d, CUctx_st** c) {
  return current_context(d, c);
}

uintptr_t u(CUdeviceptr p) {
  return static_cast<uintptr_t>(p);
}
uintptr_t u(const void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

// Queues a copy on the stream (the default stream for the synchronous forms, which then wait).
CUresult copy(Driver& d, uintptr_t dst, Side ds, uintptr_t src, Side ss, size_t n, CUstream h, bool async, bool ptds) {
  if (n != 0 && (dst == 0 || src == 0)) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  int dev = s->ctx->device;
  if (CUresult r = check_copy(d, dst, ds, src, ss, n, dev); r != CUDA_SUCCESS) return r;
  auto run = [&d, dst, ds, src, ss, n, dev] { return do_copy(d, dst, ds, src, ss, n, dev); };
  if (!async) return run_sync(d, s, run);
  Op op;
  op.run = run;
  return enqueue(d, s, std::move(op));
}

CUresult set(Driver& d, CUdeviceptr p, uint32_t value, unsigned width, size_t count, CUstream h, bool async,
             bool ptds) {
  if (u(p) % width != 0 || count > SIZE_MAX / width) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  int dev = s->ctx->device;
  if (CUresult r = check_device_range(d, u(p), count * width, dev, true); r != CUDA_SUCCESS) return r;
  auto run = [&d, p, value, width, count, dev] { return do_memset(d, u(p), value, width, count, dev); };
  if (!async) return run_sync(d, s, run);
  Op op;
  op.run = run;
  return enqueue(d, s, std::move(op));
}

CUresult host_func(Driver& d, CUstream h, std::function<void()> fn, bool ptds) {
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  Op op;
  op.run = [fn = std::move(fn)] {
    fn();
    return CUDA_SUCCESS;
  };
  return enqueue(d, s, std::move(op));
}

CUresult stream_sync(Driver& d, CUstream h, bool ptds) {
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  wait_stream(d, s);
  return static_cast<CUresult>(s->ctx->sticky.load());
}

CUresult stream_query(Driver& d, CUstream h, bool ptds) {
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  return query_stream(d, s);
}

CUresult stream_ctx(Driver& d, CUstream h, CUcontext* pctx, bool ptds) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  *pctx = s->ctx;
  return CUDA_SUCCESS;
}

CUresult stream_flags(Driver& d, CUstream h, unsigned* flags, bool ptds) {
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  *flags = s->flags;
  return CUDA_SUCCESS;
}

CUresult stream_callback(Driver& d, CUstream h, CUstreamCallback cb, void* user, unsigned flags, bool ptds) {
  if (cb == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  return host_func(
      d, h, [cb, h, user] { cb(h, CUDA_SUCCESS, user); }, ptds);
}

CUresult launch_host(Driver& d, CUstream h, CUhostFn fn, void* user, bool ptds) {
  if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return host_func(
      d, h, [fn, user] { fn(user); }, ptds);
}

CUresult begin_capture(Driver& d, CUstream h, CUstreamCaptureMode mode, bool ptds) {
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  if (s->kind == CUstream_st::Kind::Legacy) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  int none = CU_STREAM_CAPTURE_STATUS_NONE;
  return s->capture.compare_exchange_strong(none, CU_STREAM_CAPTURE_STATUS_ACTIVE) ? CUDA_SUCCESS
                                                                                   : CUDA_ERROR_ILLEGAL_STATE;
}

CUresult end_capture(Driver& d, CUstream h, CUgraph* graph, bool ptds) {
  if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  if (s->capture.exchange(CU_STREAM_CAPTURE_STATUS_NONE) == CU_STREAM_CAPTURE_STATUS_NONE)
    return CUDA_ERROR_ILLEGAL_STATE;
  *graph = nullptr;  // no graphs: an empty capture
  return CUDA_SUCCESS;
}

CUresult is_capturing(Driver& d, CUstream h, CUstreamCaptureStatus* status, bool ptds) {
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  *status = static_cast<CUstreamCaptureStatus>(s->capture.load());
  return CUDA_SUCCESS;
}

CUresult ctx_create(CUcontext* pctx, unsigned flags, CUdevice dev) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return call([&](Driver& d) { return create_context(d, dev, flags, pctx); });
}

CUresult ctx_get_device(Driver& d, CUdevice* device, CUcontext ctx) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ctx == nullptr) {
    if (CUresult r = need_ctx(d, &ctx); r != CUDA_SUCCESS) return r;
  } else if (!find_context(d, ctx)) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  *device = ctx->device;
  return CUDA_SUCCESS;
}

CUresult ctx_synchronize(Driver& d, CUcontext ctx) {
  if (ctx == nullptr) {
    if (CUresult r = need_ctx(d, &ctx); r != CUDA_SUCCESS) return r;
  } else if (!find_context(d, ctx)) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  return sync_context(d, ctx);
}

int device_attribute(const Driver& d, CUdevice_attribute a) {
  switch (a) {
    // Shareable handles are handles of VMM allocations: a device without VMM has neither.
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: return d.cfg.vmm;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: return d.cfg.rdma_with_vmm;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 0x7fffffff;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 2;
    default: return 0;
  }
}

// ---- error strings ----

#define SIMCUDA_ERRORS(X)                                                                                           \
  X(CUDA_SUCCESS, "no error")                                                                                       \
  X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                                                   \
  X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                                      \
  X(CUDA_ERROR_NOT_INITIALIZED, "initialization error")                                                             \
  X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                                               \
  X(CUDA_ERROR_PROFILER_DISABLED, "profiler disabled while using external profiling tool")                          \
  X(CUDA_ERROR_PROFILER_NOT_INITIALIZED, "profiler not initialized")                                                \
  X(CUDA_ERROR_PROFILER_ALREADY_STARTED, "profiler already started")                                                \
  X(CUDA_ERROR_PROFILER_ALREADY_STOPPED, "profiler already stopped")                                                \
  X(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library")                                                       \
  X(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, "API call is not supported in the installed CUDA driver")                \
  X(CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA-capable device(s) is/are busy or unavailable")                             \
  X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                                                     \
  X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                                            \
  X(CUDA_ERROR_DEVICE_NOT_LICENSED, "device doesn't have valid Grid license")                                       \
  X(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")                                                     \
  X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                                           \
  X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")                                                  \
  X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")                                                       \
  X(CUDA_ERROR_UNMAP_FAILED, "unmapping of buffer object failed")                                                   \
  X(CUDA_ERROR_ARRAY_IS_MAPPED, "array is mapped")                                                                  \
  X(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped")                                                           \
  X(CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device")                       \
  X(CUDA_ERROR_ALREADY_ACQUIRED, "resource already acquired")                                                       \
  X(CUDA_ERROR_NOT_MAPPED, "resource not mapped")                                                                   \
  X(CUDA_ERROR_NOT_MAPPED_AS_ARRAY, "resource not mapped as array")                                                 \
  X(CUDA_ERROR_NOT_MAPPED_AS_POINTER, "resource not mapped as pointer")                                             \
  X(CUDA_ERROR_ECC_UNCORRECTABLE, "uncorrectable ECC error encountered")                                            \
  X(CUDA_ERROR_UNSUPPORTED_LIMIT, "limit is not supported on this architecture")                                    \
  X(CUDA_ERROR_CONTEXT_ALREADY_IN_USE, "exclusive-thread device already in use by a different thread")              \
  X(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices")                   \
  X(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed")                                                         \
  X(CUDA_ERROR_INVALID_GRAPHICS_CONTEXT, "invalid OpenGL or DirectX context")                                       \
  X(CUDA_ERROR_NVLINK_UNCORRECTABLE, "uncorrectable NVLink error detected during the execution")                    \
  X(CUDA_ERROR_JIT_COMPILER_NOT_FOUND, "PTX JIT compiler library not found")                                        \
  X(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "the provided PTX was compiled with an unsupported toolchain")              \
  X(CUDA_ERROR_JIT_COMPILATION_DISABLED, "PTX JIT compilation was disabled")                                        \
  X(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, "the provided execution affinity is not supported")                       \
  X(CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC, "the provided PTX contains unsupported call to cudaDeviceSynchronize")     \
  X(CUDA_ERROR_CONTAINED, "an exception occurred on the device that is now contained")                              \
  X(CUDA_ERROR_INVALID_SOURCE, "device kernel image is invalid")                                                    \
  X(CUDA_ERROR_FILE_NOT_FOUND, "file not found")                                                                    \
  X(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, "shared object symbol not found")                                    \
  X(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, "shared object initialization failed")                                    \
  X(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS")                            \
  X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                                           \
  X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state")                             \
  X(CUDA_ERROR_LOSSY_QUERY, "attempted introspection would be semantically lossy")                                  \
  X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                                                 \
  X(CUDA_ERROR_NOT_READY, "device not ready")                                                                       \
  X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")                                         \
  X(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch")                                  \
  X(CUDA_ERROR_LAUNCH_TIMEOUT, "the launch timed out and was terminated")                                           \
  X(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, "launch uses incompatible texturing mode")                            \
  X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled")                                       \
  X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled")                                         \
  X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "cannot set while device is active in this process")                         \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")                                                        \
  X(CUDA_ERROR_ASSERT, "device-side assert triggered")                                                              \
  X(CUDA_ERROR_TOO_MANY_PEERS, "peer mapping resources exhausted")                                                  \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped")       \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region")             \
  X(CUDA_ERROR_HARDWARE_STACK_ERROR, "hardware stack error")                                                        \
  X(CUDA_ERROR_ILLEGAL_INSTRUCTION, "an illegal instruction was encountered")                                       \
  X(CUDA_ERROR_MISALIGNED_ADDRESS, "misaligned address")                                                            \
  X(CUDA_ERROR_INVALID_ADDRESS_SPACE, "operation not supported on global/shared address space")                     \
  X(CUDA_ERROR_INVALID_PC, "invalid program counter")                                                               \
  X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                                                         \
  X(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "too many blocks in cooperative launch")                               \
  X(CUDA_ERROR_TENSOR_MEMORY_LEAK, "tensor memory not completely freed")                                            \
  X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                                            \
  X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                                            \
  X(CUDA_ERROR_SYSTEM_NOT_READY, "system not yet initialized")                                                      \
  X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver combination")           \
  X(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "forward compatibility was attempted on non supported HW")           \
  X(CUDA_ERROR_MPS_CONNECTION_FAILED, "MPS client failed to connect to the MPS control daemon or the MPS server")   \
  X(CUDA_ERROR_MPS_RPC_FAILURE, "the remote procedural call between the MPS server and the MPS client failed")      \
  X(CUDA_ERROR_MPS_SERVER_NOT_READY, "MPS server is not ready to accept new MPS client requests")                   \
  X(CUDA_ERROR_MPS_MAX_CLIENTS_REACHED, "the hardware resources required to create MPS client are exhausted")       \
  X(CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED, "the hardware resources required for device connections are exhausted") \
  X(CUDA_ERROR_MPS_CLIENT_TERMINATED, "the MPS client has been terminated by the server")                           \
  X(CUDA_ERROR_CDP_NOT_SUPPORTED, "the module is using CUDA Dynamic Parallelism, which is not supported")           \
  X(CUDA_ERROR_CDP_VERSION_MISMATCH, "the module uses CDP but CDP versions do not match")                           \
  X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing")                      \
  X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture")               \
  X(CUDA_ERROR_STREAM_CAPTURE_MERGE, "operation would result in a merge of separate capture sequences")             \
  X(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not ended in the same stream as it began")                    \
  X(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capturing stream has unjoined work")                                       \
  X(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "dependency created on uncaptured work in another stream")                 \
  X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing stream")      \
  X(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream")           \
  X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture from another thread")      \
  X(CUDA_ERROR_TIMEOUT, "wait operation timed out")                                                                 \
  X(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "the graph update was not performed")                                     \
  X(CUDA_ERROR_EXTERNAL_DEVICE, "an async error has occurred in an external entity outside of CUDA")                \
  X(CUDA_ERROR_INVALID_CLUSTER_SIZE, "a kernel launch error has occurred due to cluster misconfiguration")          \
  X(CUDA_ERROR_FUNCTION_NOT_LOADED, "the function handle is not loaded")                                            \
  X(CUDA_ERROR_INVALID_RESOURCE_TYPE, "one or more resources are not valid resource types for the operation")       \
  X(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, "one or more resources are insufficient for the operation")          \
  X(CUDA_ERROR_KEY_ROTATION, "an error happened during the key rotation sequence")                                  \
  X(CUDA_ERROR_UNKNOWN, "unknown error")

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
#define SIMCUDA_ERROR_ROW(code, text) {code, #code, text},
constexpr ErrorText kErrors[] = {SIMCUDA_ERRORS(SIMCUDA_ERROR_ROW)};
#undef SIMCUDA_ERROR_ROW

const ErrorText* find_error(CUresult e) {
  for (const ErrorText& t : kErrors) {
    if (t.code == e) return &t;
  }
  return nullptr;
}

CUresult get_proc(const char* symbol, void** pfn, int version, cuuint64_t flags,
                  CUdriverProcAddressQueryResult* status);

}  // namespace

extern "C" {

// ---- initialization, versions, errors, resolvers ----

CUresult cuInit(unsigned int Flags) {
  try {
    return init(Flags);
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
}

CUresult cuDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = kDriverVersion;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** pStr) {
  if (pStr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* t = find_error(error);
  *pStr = t != nullptr ? t->text : nullptr;
  return t != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char** pStr) {
  if (pStr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* t = find_error(error);
  *pStr = t != nullptr ? t->name : nullptr;
  return t != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* symbolStatus) {
  return get_proc(symbol, pfn, cudaVersion, flags, symbolStatus);
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) {
  return get_proc(symbol, pfn, cudaVersion, flags, nullptr);
}

// The private tables cudart and some tools ask for do not exist here.
CUresult cuGetExportTable(const void** ppExportTable, const CUuuid* /*pExportTableId*/) {
  if (ppExportTable != nullptr) *ppExportTable = nullptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}

// ---- devices ----

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  return call([&](Driver& d) {
    if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceGetCount(int* count) {
  return call([&](Driver& d) {
    if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *count = d.cfg.device_count;
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  return call([&](Driver& d) {
    if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, static_cast<size_t>(len), "simcuda device %d", dev);
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  return call([&](Driver& d) {
    if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    memcpy(uuid->bytes, "simcuda-dev", 11);
    uuid->bytes[15] = static_cast<char>(dev);
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  return cuDeviceGetUuid_v2(uuid, dev);
}

CUresult cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  return call([&](Driver& d) {
    if (pi == nullptr || attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    *pi = attrib == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ? dev + 1 : device_attribute(d, attrib);
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  return call([&](Driver& d) {
    if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = d.cfg.capacity;
    return CUDA_SUCCESS;
  });
}

CUresult cuDeviceCanAccessPeer(int* canAccessPeer, CUdevice dev, CUdevice peerDev) {
  return call([&](Driver& d) {
    if (canAccessPeer == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev) || !valid_device(d, peerDev)) return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = dev != peerDev ? 1 : 0;
    return CUDA_SUCCESS;
  });
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  return call([&](Driver& d) {
    if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    return primary_retain(d, dev, pctx);
  });
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  return call([&](Driver& d) { return primary_release(d, dev); });
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  return cuDevicePrimaryCtxRelease_v2(dev);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  return call([&](Driver& d) { return primary_reset(d, dev); });
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
  return cuDevicePrimaryCtxReset_v2(dev);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  return call([&](Driver& d) {
    if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    CUctx_st* p = d.primaries[static_cast<size_t>(dev)];
    *flags = d.primary_flags[static_cast<size_t>(dev)];
    *active = p != nullptr && p->active ? 1 : 0;
    return CUDA_SUCCESS;
  });
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
  return call([&](Driver& d) {
    if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    d.primary_flags[static_cast<size_t>(dev)] = flags;
    if (CUctx_st* p = d.primaries[static_cast<size_t>(dev)]; p != nullptr) p->flags = flags;
    return CUDA_SUCCESS;
  });
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
  return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

// ---- contexts ----

CUresult cuCtxCreate(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* paramsArray, int numParams, unsigned int flags,
                        CUdevice dev) {
  if (paramsArray != nullptr && numParams > 0) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* ctxCreateParams, unsigned int flags, CUdevice dev) {
  if (ctxCreateParams != nullptr) {
    if (ctxCreateParams->execAffinityParams != nullptr && ctxCreateParams->numExecAffinityParams > 0) {
      return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
    }
    if (ctxCreateParams->cigParams != nullptr) return CUDA_ERROR_NOT_SUPPORTED;
  }
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
  return call([&](Driver& d) { return destroy_context(d, ctx); });
}

CUresult cuCtxDestroy(CUcontext ctx) {
  return cuCtxDestroy_v2(ctx);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  return call([&](Driver& d) {
    if (ctx != nullptr && !find_context(d, ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack_set(d, ctx);
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  return call([&](Driver& d) {
    if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *pctx = ctx_stack_top(d);
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  return call([&](Driver& d) {
    if (ctx == nullptr || !find_context(d, ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack_push(d, ctx);
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  return cuCtxPushCurrent_v2(ctx);
}

CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
  return call([&](Driver& d) { return ctx_stack_pop(d, pctx); });
}

CUresult cuCtxPopCurrent(CUcontext* pctx) {
  return cuCtxPopCurrent_v2(pctx);
}

CUresult cuCtxGetDevice(CUdevice* device) {
  return call([&](Driver& d) { return ctx_get_device(d, device, nullptr); });
}

CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
  return call([&](Driver& d) { return ctx_get_device(d, device, ctx); });
}

CUresult cuCtxGetFlags(unsigned int* flags) {
  return call([&](Driver& d) {
    if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* c = nullptr;
    if (CUresult r = need_ctx(d, &c); r != CUDA_SUCCESS) return r;
    *flags = c->flags;
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int* version) {
  return call([&](Driver& d) {
    if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (ctx == nullptr) {
      if (CUresult r = need_ctx(d, &ctx); r != CUDA_SUCCESS) return r;
    } else if (!find_context(d, ctx)) {
      return CUDA_ERROR_INVALID_CONTEXT;
    }
    *version = 3020;  // every context of the v2 API reports this
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxSynchronize(void) {
  return call([&](Driver& d) { return ctx_synchronize(d, nullptr); });
}

CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  return call([&](Driver& d) { return ctx_synchronize(d, ctx); });
}

CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
  return call([&](Driver& d) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* c = nullptr;
    if (CUresult r = need_ctx(d, &c); r != CUDA_SUCCESS) return r;
    auto peer = find_context(d, peerContext);
    if (!peer) return CUDA_ERROR_INVALID_CONTEXT;
    if (peer->device == c->device) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    uint64_t bit = uint64_t{1} << peer->device;
    if ((c->peer_mask & bit) != 0) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    c->peer_mask |= bit;
    return CUDA_SUCCESS;
  });
}

CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
  return call([&](Driver& d) {
    CUctx_st* c = nullptr;
    if (CUresult r = need_ctx(d, &c); r != CUDA_SUCCESS) return r;
    auto peer = find_context(d, peerContext);
    if (!peer) return CUDA_ERROR_INVALID_CONTEXT;
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    uint64_t bit = uint64_t{1} << peer->device;
    if ((c->peer_mask & bit) == 0) return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    c->peer_mask &= ~bit;
    return CUDA_SUCCESS;
  });
}

// ---- memory ----

CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
  return call([&](Driver& d) { return mem_get_info(d, free, total); });
}

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  return call([&](Driver& d) { return mem_alloc(d, dptr, bytesize); });
}

CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
  return call([&](Driver& d) { return mem_alloc_pitch(d, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes); });
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  return call([&](Driver& d) { return mem_free(d, dptr); });
}

CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
  return call([&](Driver& d) { return mem_alloc_managed(d, dptr, bytesize, flags); });
}

// ---- stream-ordered pools (the default pool of each device only) ----

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool_out, CUdevice dev) {
  return call([&](Driver& d) { return default_mem_pool(d, pool_out, dev); });
}

CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) {
  return call([&](Driver& d) { return default_mem_pool(d, pool, dev); });
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
  return call([&](Driver& d) { return mem_pool_trim(d, pool, minBytesToKeep); });
}

CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return call([&](Driver& d) { return mem_alloc_async(d, dptr, bytesize, hStream, false); });
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return call([&](Driver& d) { return mem_alloc_async(d, dptr, bytesize, hStream, true); });
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  return call([&](Driver& d) { return mem_free_async(d, dptr, hStream, false); });
}

CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
  return call([&](Driver& d) { return mem_free_async(d, dptr, hStream, true); });
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  return call([&](Driver& d) { return mem_get_address_range(d, pbase, psize, dptr); });
}

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  return call([&](Driver& d) {
    if (attribute == CU_POINTER_ATTRIBUTE_P2P_TOKENS) return CUDA_ERROR_NOT_SUPPORTED;
    return pointer_get_attribute(d, data, attribute, ptr, false);
  });
}

CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute* attributes, void** data,
                                CUdeviceptr ptr) {
  return call([&](Driver& d) {
    if (numAttributes == 0 || attributes == nullptr || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < numAttributes; ++i) {
      if (attributes[i] == CU_POINTER_ATTRIBUTE_P2P_TOKENS) return CUDA_ERROR_INVALID_VALUE;
      if (CUresult r = pointer_get_attribute(d, data[i], attributes[i], ptr, true); r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
  });
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  return call([&](Driver& d) {
    return d.cfg.vmm ? address_reserve(d, ptr, size, alignment, addr, flags) : CUDA_ERROR_NOT_SUPPORTED;
  });
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  return call([&](Driver& d) { return address_free(d, ptr, size); });
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  return call(
      [&](Driver& d) { return d.cfg.vmm ? mem_create(d, handle, size, prop, flags) : CUDA_ERROR_NOT_SUPPORTED; });
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  return call([&](Driver& d) { return mem_release(d, handle); });
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  return call([&](Driver& d) { return mem_map(d, ptr, size, offset, handle, flags); });
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  return call([&](Driver& d) { return mem_unmap(d, ptr, size); });
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  return call([&](Driver& d) { return mem_set_access(d, ptr, size, desc, count); });
}

CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) {
  return call([&](Driver& d) { return mem_get_access(d, flags, location, ptr); });
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  return call(
      [&](Driver& d) { return d.cfg.vmm ? mem_granularity(d, granularity, prop, option) : CUDA_ERROR_NOT_SUPPORTED; });
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  return call([&](Driver& d) { return mem_properties(d, prop, handle); });
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  return call([&](Driver& d) { return mem_retain_handle(d, handle, addr); });
}

CUresult cuMemExportToShareableHandle(void* shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType, unsigned long long flags) {
  return call([&](Driver& d) { return mem_export(d, shareableHandle, handle, handleType, flags); });
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* osHandle,
                                        CUmemAllocationHandleType shHandleType) {
  return call([&](Driver& d) { return mem_import(d, handle, osHandle, shHandleType); });
}

CUresult cuIpcGetMemHandle(CUipcMemHandle* pHandle, CUdeviceptr dptr) {
  return call([&](Driver& d) { return ipc_get(d, pHandle, dptr); });
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) {
  return call([&](Driver& d) { return ipc_open(d, pdptr, handle, Flags); });
}

CUresult cuIpcOpenMemHandle(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) {
  return cuIpcOpenMemHandle_v2(pdptr, handle, Flags);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  return call([&](Driver& d) { return ipc_close(d, dptr); });
}

// ---- copies and sets: the _ptds/_ptsz forms use the per-thread default stream for stream 0 ----

#define SIMCUDA_COPY(ptds, dst, ds, src, ss, n, stream, async) \
  return call([&](Driver& d) { return copy(d, dst, ds, src, ss, n, stream, async, ptds); })

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount) {
  SIMCUDA_COPY(false, u(dstDevice), Side::Device, u(srcHost), Side::Host, ByteCount, nullptr, false);
}
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount) {
  SIMCUDA_COPY(true, u(dstDevice), Side::Device, u(srcHost), Side::Host, ByteCount, nullptr, false);
}
CUresult cuMemcpyDtoH_v2(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  SIMCUDA_COPY(false, u(dstHost), Side::Host, u(srcDevice), Side::Device, ByteCount, nullptr, false);
}
CUresult cuMemcpyDtoH_v2_ptds(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  SIMCUDA_COPY(true, u(dstHost), Side::Host, u(srcDevice), Side::Device, ByteCount, nullptr, false);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
  SIMCUDA_COPY(false, u(dstDevice), Side::Device, u(srcDevice), Side::Device, ByteCount, nullptr, false);
}
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
  SIMCUDA_COPY(true, u(dstDevice), Side::Device, u(srcDevice), Side::Device, ByteCount, nullptr, false);
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
  SIMCUDA_COPY(false, u(dst), Side::Unified, u(src), Side::Unified, ByteCount, nullptr, false);
}
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
  SIMCUDA_COPY(true, u(dst), Side::Unified, u(src), Side::Unified, ByteCount, nullptr, false);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(false, u(dstDevice), Side::Device, u(srcHost), Side::Host, ByteCount, hStream, true);
}
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(true, u(dstDevice), Side::Device, u(srcHost), Side::Host, ByteCount, hStream, true);
}
CUresult cuMemcpyDtoHAsync_v2(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(false, u(dstHost), Side::Host, u(srcDevice), Side::Device, ByteCount, hStream, true);
}
CUresult cuMemcpyDtoHAsync_v2_ptsz(void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(true, u(dstHost), Side::Host, u(srcDevice), Side::Device, ByteCount, hStream, true);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(false, u(dstDevice), Side::Device, u(srcDevice), Side::Device, ByteCount, hStream, true);
}
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(true, u(dstDevice), Side::Device, u(srcDevice), Side::Device, ByteCount, hStream, true);
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(false, u(dst), Side::Unified, u(src), Side::Unified, ByteCount, hStream, true);
}
CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
  SIMCUDA_COPY(true, u(dst), Side::Unified, u(src), Side::Unified, ByteCount, hStream, true);
}

#undef SIMCUDA_COPY

#define SIMCUDA_SET(ptds, p, value, width, n, stream, async) \
  return call([&](Driver& d) { return set(d, p, value, width, n, stream, async, ptds); })

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  SIMCUDA_SET(false, dstDevice, uc, 1, N, nullptr, false);
}
CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  SIMCUDA_SET(true, dstDevice, uc, 1, N, nullptr, false);
}
CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N) {
  SIMCUDA_SET(false, dstDevice, us, 2, N, nullptr, false);
}
CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N) {
  SIMCUDA_SET(true, dstDevice, us, 2, N, nullptr, false);
}
CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
  SIMCUDA_SET(false, dstDevice, ui, 4, N, nullptr, false);
}
CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
  SIMCUDA_SET(true, dstDevice, ui, 4, N, nullptr, false);
}
CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
  SIMCUDA_SET(false, dstDevice, uc, 1, N, hStream, true);
}
CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
  SIMCUDA_SET(true, dstDevice, uc, 1, N, hStream, true);
}
CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream) {
  SIMCUDA_SET(false, dstDevice, us, 2, N, hStream, true);
}
CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream) {
  SIMCUDA_SET(true, dstDevice, us, 2, N, hStream, true);
}
CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
  SIMCUDA_SET(false, dstDevice, ui, 4, N, hStream, true);
}
CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
  SIMCUDA_SET(true, dstDevice, ui, 4, N, hStream, true);
}

// Stream memory operations: a 32-bit write is a one-word set, ordered on the stream. (Waits and batches
// are not simulated.)
CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  if ((flags & ~static_cast<unsigned>(CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)) != 0) return CUDA_ERROR_INVALID_VALUE;
  SIMCUDA_SET(false, addr, value, 4, 1, stream, true);
}
CUresult cuStreamWriteValue32_v2_ptsz(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  if ((flags & ~static_cast<unsigned>(CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)) != 0) return CUDA_ERROR_INVALID_VALUE;
  SIMCUDA_SET(true, addr, value, 4, 1, stream, true);
}

#undef SIMCUDA_SET

// ---- host memory ----

CUresult cuMemAllocHost_v2(void** pp, size_t bytesize) {
  return call([&](Driver& d) { return host_alloc(d, pp, bytesize, 0); });
}

CUresult cuMemHostAlloc(void** pp, size_t bytesize, unsigned int Flags) {
  return call([&](Driver& d) { return host_alloc(d, pp, bytesize, Flags); });
}

CUresult cuMemFreeHost(void* p) {
  return call([&](Driver& d) { return host_free(d, p); });
}

CUresult cuMemHostRegister_v2(void* p, size_t bytesize, unsigned int Flags) {
  return call([&](Driver& d) { return host_register(d, p, bytesize, Flags); });
}

CUresult cuMemHostRegister(void* p, size_t bytesize, unsigned int Flags) {
  return cuMemHostRegister_v2(p, bytesize, Flags);
}

CUresult cuMemHostUnregister(void* p) {
  return call([&](Driver& d) { return host_unregister(d, p); });
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* pdptr, void* p, unsigned int Flags) {
  return call([&](Driver& d) { return host_device_pointer(d, pdptr, p, Flags); });
}

CUresult cuMemHostGetFlags(unsigned int* pFlags, void* p) {
  return call([&](Driver& d) { return host_get_flags(d, pFlags, p); });
}

// ---- streams and events ----

CUresult cuStreamCreate(CUstream* phStream, unsigned int Flags) {
  return call([&](Driver& d) {
    if (phStream == nullptr || (Flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    CUctx_st* c = nullptr;
    if (CUresult r = need_ctx(d, &c); r != CUDA_SUCCESS) return r;
    *phStream = new_stream(d, c, CUstream_st::Kind::User, Flags, 0).get();
    return CUDA_SUCCESS;
  });
}

CUresult cuStreamCreateWithPriority(CUstream* phStream, unsigned int flags, int priority) {
  return call([&](Driver& d) {
    if (phStream == nullptr || (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    CUctx_st* c = nullptr;
    if (CUresult r = need_ctx(d, &c); r != CUDA_SUCCESS) return r;
    int p = priority < -5 ? -5 : (priority > 0 ? 0 : priority);  // Hopper's range, clamped like CUDA
    *phStream = new_stream(d, c, CUstream_st::Kind::User, flags, p).get();
    return CUDA_SUCCESS;
  });
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
  return call([&](Driver& d) { return destroy_stream(d, hStream); });
}

CUresult cuStreamDestroy(CUstream hStream) {
  return cuStreamDestroy_v2(hStream);
}

CUresult cuStreamSynchronize(CUstream hStream) {
  return call([&](Driver& d) { return stream_sync(d, hStream, false); });
}
CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
  return call([&](Driver& d) { return stream_sync(d, hStream, true); });
}

CUresult cuStreamQuery(CUstream hStream) {
  return call([&](Driver& d) { return stream_query(d, hStream, false); });
}
CUresult cuStreamQuery_ptsz(CUstream hStream) {
  return call([&](Driver& d) { return stream_query(d, hStream, true); });
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  return call([&](Driver& d) {
    if ((Flags & ~static_cast<unsigned>(CU_EVENT_WAIT_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
    return stream_wait_event(d, hStream, hEvent, false);
  });
}
CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  return call([&](Driver& d) {
    if ((Flags & ~static_cast<unsigned>(CU_EVENT_WAIT_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
    return stream_wait_event(d, hStream, hEvent, true);
  });
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext* pctx) {
  return call([&](Driver& d) { return stream_ctx(d, hStream, pctx, false); });
}
CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext* pctx) {
  return call([&](Driver& d) { return stream_ctx(d, hStream, pctx, true); });
}
CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext* pCtx, CUgreenCtx* pGreenCtx) {
  if (pGreenCtx != nullptr) *pGreenCtx = nullptr;
  return call([&](Driver& d) { return stream_ctx(d, hStream, pCtx, false); });
}
CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext* pCtx, CUgreenCtx* pGreenCtx) {
  if (pGreenCtx != nullptr) *pGreenCtx = nullptr;
  return call([&](Driver& d) { return stream_ctx(d, hStream, pCtx, true); });
}

CUresult cuStreamGetFlags(CUstream hStream, unsigned int* flags) {
  return call([&](Driver& d) { return stream_flags(d, hStream, flags, false); });
}
CUresult cuStreamGetFlags_ptsz(CUstream hStream, unsigned int* flags) {
  return call([&](Driver& d) { return stream_flags(d, hStream, flags, true); });
}

CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void* userData, unsigned int flags) {
  return call([&](Driver& d) { return stream_callback(d, hStream, callback, userData, flags, false); });
}
CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void* userData, unsigned int flags) {
  return call([&](Driver& d) { return stream_callback(d, hStream, callback, userData, flags, true); });
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void* userData) {
  return call([&](Driver& d) { return launch_host(d, hStream, fn, userData, false); });
}
CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void* userData) {
  return call([&](Driver& d) { return launch_host(d, hStream, fn, userData, true); });
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
  return call([&](Driver& d) { return begin_capture(d, hStream, mode, false); });
}
CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
  return call([&](Driver& d) { return begin_capture(d, hStream, mode, true); });
}
CUresult cuStreamEndCapture(CUstream hStream, CUgraph* phGraph) {
  return call([&](Driver& d) { return end_capture(d, hStream, phGraph, false); });
}
CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph* phGraph) {
  return call([&](Driver& d) { return end_capture(d, hStream, phGraph, true); });
}
CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus* captureStatus) {
  return call([&](Driver& d) { return is_capturing(d, hStream, captureStatus, false); });
}
CUresult cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus* captureStatus) {
  return call([&](Driver& d) { return is_capturing(d, hStream, captureStatus, true); });
}

CUresult cuEventCreate(CUevent* phEvent, unsigned int Flags) {
  return call([&](Driver& d) { return event_create(d, phEvent, Flags); });
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  return call([&](Driver& d) { return event_record(d, hEvent, hStream, false); });
}
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
  return call([&](Driver& d) { return event_record(d, hEvent, hStream, true); });
}
CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
  return call([&](Driver& d) {
    if ((flags & ~static_cast<unsigned>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
    return event_record(d, hEvent, hStream, false);
  });
}
CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
  return call([&](Driver& d) {
    if ((flags & ~static_cast<unsigned>(CU_EVENT_RECORD_EXTERNAL)) != 0) return CUDA_ERROR_INVALID_VALUE;
    return event_record(d, hEvent, hStream, true);
  });
}

CUresult cuEventQuery(CUevent hEvent) {
  return call([&](Driver& d) { return event_query(d, hEvent); });
}

CUresult cuEventSynchronize(CUevent hEvent) {
  return call([&](Driver& d) { return event_sync(d, hEvent); });
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
  return call([&](Driver& d) { return event_destroy(d, hEvent); });
}

CUresult cuEventDestroy(CUevent hEvent) {
  return cuEventDestroy_v2(hEvent);
}

CUresult cuEventElapsedTime_v2(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  return call([&](Driver& d) { return event_elapsed(d, pMilliseconds, hStart, hEnd); });
}

CUresult cuEventElapsedTime(float* pMilliseconds, CUevent hStart, CUevent hEnd) {
  return cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

// ---- modules and kernels ----

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
  return call([&](Driver& d) { return module_load(d, module, image); });
}

CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int /*numOptions*/, CUjit_option* /*options*/,
                            void** /*optionValues*/) {
  return call([&](Driver& d) { return module_load(d, module, image); });
}

CUresult cuModuleUnload(CUmodule hmod) {
  return call([&](Driver& d) { return module_unload(d, hmod); });
}

CUresult cuModuleGetFunction(CUfunction* hfunc, CUmodule hmod, const char* name) {
  return call([&](Driver& d) { return module_get_function(d, hfunc, hmod, name); });
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int /*sharedMemBytes*/, CUstream hStream, void** kernelParams, void** extra) {
  return call([&](Driver& d) {
    return launch_kernel(d, f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams,
                         extra, false);
  });
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                             unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                             unsigned int /*sharedMemBytes*/, CUstream hStream, void** kernelParams, void** extra) {
  return call([&](Driver& d) {
    return launch_kernel(d, f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams,
                         extra, true);
  });
}

// ---- simcuda introspection ----

uint64_t simcuda_used_bytes(int device) {
  Driver* d = driver();
  if (d == nullptr || !valid_device(*d, device)) return 0;
  return d->ledger->used[device].load();
}

uint64_t simcuda_capacity_bytes(int device) {
  Driver* d = driver();
  if (d == nullptr || !valid_device(*d, device)) return 0;
  return d->cfg.capacity;
}

uint64_t simcuda_held_bytes(void) {
  Driver* d = driver();
  if (d == nullptr) return 0;
  uint64_t n = 0;
  for (const auto& h : d->held) n += h.load();
  return n;
}

int simcuda_is_mapped(unsigned long long addr, size_t len) {
  Driver* d = driver();
  try {
    return d != nullptr && is_mapped(*d, static_cast<uintptr_t>(addr), len) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

uint64_t simcuda_mapped_bytes(void) {
  Driver* d = driver();
  try {
    return d != nullptr ? mapped_bytes(*d) : 0;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"

// ---- cuGetProcAddress ----

namespace {

// The one list of what cuGetProcAddress resolves. R(base, version, symbol): `symbol` serves callers
// asking with cudaVersion >= version, until a later row of the same base takes over. P(...) adds the
// symbol for CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM. Versions are those of cudaTypedefs.h's
// PFN_<base>_v<version>; the 32-bit entry points of CUDA 2.x are not provided, so asking for them is
// answered VERSION_NOT_SUFFICIENT.
#define SIMCUDA_PROCS(R, P)                                                                \
  R(cuGetErrorString, 6000, cuGetErrorString)                                              \
  R(cuGetErrorName, 6000, cuGetErrorName)                                                  \
  R(cuInit, 2000, cuInit)                                                                  \
  R(cuDriverGetVersion, 2020, cuDriverGetVersion)                                          \
  R(cuGetProcAddress, 11030, cuGetProcAddress)                                             \
  R(cuGetProcAddress, 12000, cuGetProcAddress_v2)                                          \
  R(cuGetExportTable, 3000, cuGetExportTable)                                              \
  R(cuDeviceGet, 2000, cuDeviceGet)                                                        \
  R(cuDeviceGetCount, 2000, cuDeviceGetCount)                                              \
  R(cuDeviceGetName, 2000, cuDeviceGetName)                                                \
  R(cuDeviceGetUuid, 9020, cuDeviceGetUuid)                                                \
  R(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2)                                            \
  R(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute)                                      \
  R(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2)                                           \
  R(cuDeviceCanAccessPeer, 4000, cuDeviceCanAccessPeer)                                    \
  R(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain)                              \
  R(cuDevicePrimaryCtxRelease, 7000, cuDevicePrimaryCtxRelease)                            \
  R(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2)                        \
  R(cuDevicePrimaryCtxReset, 7000, cuDevicePrimaryCtxReset)                                \
  R(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2)                            \
  R(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState)                          \
  R(cuDevicePrimaryCtxSetFlags, 7000, cuDevicePrimaryCtxSetFlags)                          \
  R(cuDevicePrimaryCtxSetFlags, 11000, cuDevicePrimaryCtxSetFlags_v2)                      \
  R(cuCtxCreate, 2000, cuCtxCreate)                                                        \
  R(cuCtxCreate, 3020, cuCtxCreate_v2)                                                     \
  R(cuCtxCreate, 11040, cuCtxCreate_v3)                                                    \
  R(cuCtxCreate, 12050, cuCtxCreate_v4)                                                    \
  R(cuCtxDestroy, 2000, cuCtxDestroy)                                                      \
  R(cuCtxDestroy, 4000, cuCtxDestroy_v2)                                                   \
  R(cuCtxSetCurrent, 4000, cuCtxSetCurrent)                                                \
  R(cuCtxGetCurrent, 4000, cuCtxGetCurrent)                                                \
  R(cuCtxGetDevice, 2000, cuCtxGetDevice)                                                  \
  R(cuCtxGetDevice, 13000, cuCtxGetDevice_v2)                                              \
  R(cuCtxGetFlags, 7000, cuCtxGetFlags)                                                    \
  R(cuCtxGetApiVersion, 3020, cuCtxGetApiVersion)                                          \
  R(cuCtxPushCurrent, 2000, cuCtxPushCurrent)                                              \
  R(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2)                                           \
  R(cuCtxPopCurrent, 2000, cuCtxPopCurrent)                                                \
  R(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2)                                             \
  R(cuCtxSynchronize, 2000, cuCtxSynchronize)                                              \
  R(cuCtxSynchronize, 13000, cuCtxSynchronize_v2)                                          \
  R(cuCtxEnablePeerAccess, 4000, cuCtxEnablePeerAccess)                                    \
  R(cuCtxDisablePeerAccess, 4000, cuCtxDisablePeerAccess)                                  \
  R(cuMemGetInfo, 3020, cuMemGetInfo_v2)                                                   \
  R(cuMemAlloc, 3020, cuMemAlloc_v2)                                                       \
  R(cuMemAllocPitch, 3020, cuMemAllocPitch_v2)                                             \
  R(cuMemFree, 3020, cuMemFree_v2)                                                         \
  R(cuMemAllocManaged, 6000, cuMemAllocManaged)                                            \
  R(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool)                           \
  R(cuDeviceGetMemPool, 11020, cuDeviceGetMemPool)                                         \
  R(cuMemPoolTrimTo, 11020, cuMemPoolTrimTo)                                               \
  P(cuMemAllocAsync, 11020, cuMemAllocAsync, cuMemAllocAsync_ptsz)                         \
  P(cuMemFreeAsync, 11020, cuMemFreeAsync, cuMemFreeAsync_ptsz)                            \
  R(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2)                                   \
  R(cuPointerGetAttribute, 4000, cuPointerGetAttribute)                                    \
  R(cuPointerGetAttributes, 7000, cuPointerGetAttributes)                                  \
  R(cuMemAddressReserve, 10020, cuMemAddressReserve)                                       \
  R(cuMemAddressFree, 10020, cuMemAddressFree)                                             \
  R(cuMemCreate, 10020, cuMemCreate)                                                       \
  R(cuMemRelease, 10020, cuMemRelease)                                                     \
  R(cuMemMap, 10020, cuMemMap)                                                             \
  R(cuMemUnmap, 10020, cuMemUnmap)                                                         \
  R(cuMemSetAccess, 10020, cuMemSetAccess)                                                 \
  R(cuMemGetAccess, 10020, cuMemGetAccess)                                                 \
  R(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity)                   \
  R(cuMemGetAllocationPropertiesFromHandle, 10020, cuMemGetAllocationPropertiesFromHandle) \
  R(cuMemRetainAllocationHandle, 11000, cuMemRetainAllocationHandle)                       \
  R(cuMemExportToShareableHandle, 10020, cuMemExportToShareableHandle)                     \
  R(cuMemImportFromShareableHandle, 10020, cuMemImportFromShareableHandle)                 \
  R(cuIpcGetMemHandle, 4010, cuIpcGetMemHandle)                                            \
  R(cuIpcOpenMemHandle, 4010, cuIpcOpenMemHandle)                                          \
  R(cuIpcOpenMemHandle, 11000, cuIpcOpenMemHandle_v2)                                      \
  R(cuIpcCloseMemHandle, 4010, cuIpcCloseMemHandle)                                        \
  P(cuMemcpyHtoD, 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds)                             \
  P(cuMemcpyDtoH, 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds)                             \
  P(cuMemcpyDtoD, 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds)                             \
  P(cuMemcpy, 4000, cuMemcpy, cuMemcpy_ptds)                                               \
  P(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz)              \
  P(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz)              \
  P(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz)              \
  P(cuMemcpyAsync, 4000, cuMemcpyAsync, cuMemcpyAsync_ptsz)                                \
  P(cuMemsetD8, 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds)                                   \
  P(cuMemsetD16, 3020, cuMemsetD16_v2, cuMemsetD16_v2_ptds)                                \
  P(cuMemsetD32, 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds)                                \
  P(cuMemsetD8Async, 3020, cuMemsetD8Async, cuMemsetD8Async_ptsz)                          \
  P(cuMemsetD16Async, 3020, cuMemsetD16Async, cuMemsetD16Async_ptsz)                       \
  P(cuMemsetD32Async, 3020, cuMemsetD32Async, cuMemsetD32Async_ptsz)                       \
  P(cuStreamWriteValue32, 11070, cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz)    \
  R(cuMemAllocHost, 3020, cuMemAllocHost_v2)                                               \
  R(cuMemHostAlloc, 2020, cuMemHostAlloc)                                                  \
  R(cuMemFreeHost, 2000, cuMemFreeHost)                                                    \
  R(cuMemHostRegister, 4000, cuMemHostRegister)                                            \
  R(cuMemHostRegister, 6050, cuMemHostRegister_v2)                                         \
  R(cuMemHostUnregister, 4000, cuMemHostUnregister)                                        \
  R(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer_v2)                         \
  R(cuMemHostGetFlags, 2030, cuMemHostGetFlags)                                            \
  R(cuStreamCreate, 2000, cuStreamCreate)                                                  \
  R(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority)                          \
  R(cuStreamDestroy, 2000, cuStreamDestroy)                                                \
  R(cuStreamDestroy, 4000, cuStreamDestroy_v2)                                             \
  P(cuStreamSynchronize, 2000, cuStreamSynchronize, cuStreamSynchronize_ptsz)              \
  P(cuStreamQuery, 2000, cuStreamQuery, cuStreamQuery_ptsz)                                \
  P(cuStreamWaitEvent, 3020, cuStreamWaitEvent, cuStreamWaitEvent_ptsz)                    \
  P(cuStreamGetCtx, 9020, cuStreamGetCtx, cuStreamGetCtx_ptsz)                             \
  P(cuStreamGetCtx, 12050, cuStreamGetCtx_v2, cuStreamGetCtx_v2_ptsz)                      \
  P(cuStreamGetFlags, 5050, cuStreamGetFlags, cuStreamGetFlags_ptsz)                       \
  P(cuStreamAddCallback, 5000, cuStreamAddCallback, cuStreamAddCallback_ptsz)              \
  P(cuLaunchHostFunc, 10000, cuLaunchHostFunc, cuLaunchHostFunc_ptsz)                      \
  P(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz)    \
  P(cuStreamEndCapture, 10000, cuStreamEndCapture, cuStreamEndCapture_ptsz)                \
  P(cuStreamIsCapturing, 10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz)             \
  R(cuEventCreate, 2000, cuEventCreate)                                                    \
  P(cuEventRecord, 2000, cuEventRecord, cuEventRecord_ptsz)                                \
  P(cuEventRecordWithFlags, 11010, cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz)    \
  R(cuEventQuery, 2000, cuEventQuery)                                                      \
  R(cuEventSynchronize, 2000, cuEventSynchronize)                                          \
  R(cuEventDestroy, 2000, cuEventDestroy)                                                  \
  R(cuEventDestroy, 4000, cuEventDestroy_v2)                                               \
  R(cuEventElapsedTime, 2000, cuEventElapsedTime)                                          \
  R(cuEventElapsedTime, 12080, cuEventElapsedTime_v2)                                      \
  R(cuModuleLoadData, 2000, cuModuleLoadData)                                              \
  R(cuModuleLoadDataEx, 2010, cuModuleLoadDataEx)                                          \
  R(cuModuleUnload, 2000, cuModuleUnload)                                                  \
  R(cuModuleGetFunction, 2000, cuModuleGetFunction)                                        \
  P(cuLaunchKernel, 4000, cuLaunchKernel, cuLaunchKernel_ptsz)

struct Proc {
  const char* name;
  int version;
  void* legacy;
  void* per_thread;
};

#define SIMCUDA_PROC_R(base, version, sym) \
  {#base, version, reinterpret_cast<void*>(&sym), reinterpret_cast<void*>(&sym)},
#define SIMCUDA_PROC_P(base, version, sym, pt) \
  {#base, version, reinterpret_cast<void*>(&sym), reinterpret_cast<void*>(&pt)},
const Proc kProcs[] = {SIMCUDA_PROCS(SIMCUDA_PROC_R, SIMCUDA_PROC_P)};
#undef SIMCUDA_PROC_R
#undef SIMCUDA_PROC_P

// Works before cuInit, as cudart relies on. Symbols are base names ("cuMemAlloc"), never "_v2".
CUresult get_proc(const char* symbol, void** pfn, int version, cuuint64_t flags,
                  CUdriverProcAddressQueryResult* status) {
  auto answer = [status](CUdriverProcAddressQueryResult s, CUresult r) {
    if (status != nullptr) *status = s;
    return r;
  };
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  constexpr cuuint64_t kKnown = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  if ((flags & ~kKnown) != 0 || flags == kKnown) return CUDA_ERROR_INVALID_VALUE;
  const Proc* best = nullptr;
  bool known = false;
  for (const Proc& p : kProcs) {
    if (strcmp(p.name, symbol) != 0) continue;
    known = true;
    if (p.version <= version && (best == nullptr || p.version > best->version)) best = &p;
  }
  if (!known) return answer(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, CUDA_ERROR_NOT_FOUND);
  if (best == nullptr) return answer(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, CUDA_ERROR_NOT_FOUND);
  // Per-thread default stream variants exist from CUDA 7.0 on.
  bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0 && version >= 7000;
  *pfn = per_thread ? best->per_thread : best->legacy;
  return answer(CU_GET_PROC_ADDRESS_SUCCESS, CUDA_SUCCESS);
}

}  // namespace
