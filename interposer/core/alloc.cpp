// SPDX-License-Identifier: Apache-2.0
// The intercepted entry points: managed allocation (cuMemAlloc/AllocPitch become VMM reserve +
// create + map), free, and the cuGetProcAddress resolvers.
#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>

#include "config.h"
#include "driver.h"
#include "engine.h"
#include "gate.h"
#include "log.h"
#include "registry.h"
#include "shim.h"
#include "vmm.h"

namespace tmsdisk::shim {
namespace {

// What cudaMallocPitch hands out on current GPUs: pitches are multiples of 512 bytes.
constexpr std::size_t kPitchAlignment = 512;
constexpr int kMaxDevices = 128;

enum DeviceVmm : int { kUnknown = 0, kVmm = 1, kNoVmm = 2 };

// Per-device facts, looked up once (racing first callers compute the same values).
struct DeviceInfo {
  std::atomic<int> vmm{kUnknown};
  std::atomic<bool> rdma{false};
  std::atomic<bool> posix_fd{false};  // allocations can be exported as a POSIX fd (legacy IPC, ipc.cpp)
  std::atomic<std::size_t> granularity{0};
};
DeviceInfo g_devices[kMaxDevices];

CUmemAllocationProp make_prop(CUdevice dev, bool rdma, bool posix_fd) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  // Exportable, so that cuIpcGetMemHandle can share it through the daemon.
  prop.requestedHandleTypes = posix_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

const DeviceInfo* device_info(const DriverApi& api, CUdevice dev) {
  if (dev < 0 || dev >= kMaxDevices) return nullptr;
  DeviceInfo& d = g_devices[dev];
  if (d.vmm.load(std::memory_order_acquire) != kUnknown) return &d;
  int vmm = 0, rdma = 0, posix_fd = 0;
  if (api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS)
    vmm = 0;
  if (api.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev) != CUDA_SUCCESS)
    rdma = 0;
  if (api.cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) !=
      CUDA_SUCCESS)
    posix_fd = 0;
  std::size_t granularity = 0;
  const CUmemAllocationProp prop = make_prop(dev, rdma != 0, posix_fd != 0);
  if (vmm &&
      (api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
       granularity == 0))
    vmm = 0;
  if (!vmm) TMS_INFO("device %d has no usable virtual memory management; its allocations stay native", dev);
  d.rdma.store(rdma != 0, std::memory_order_relaxed);
  d.posix_fd.store(posix_fd != 0, std::memory_order_relaxed);
  d.granularity.store(granularity, std::memory_order_relaxed);
  d.vmm.store(vmm ? kVmm : kNoVmm, std::memory_order_release);
  return &d;
}

// Backs `size` bytes with VMM memory for the current context. Returns false when the allocation
// should be left to the native allocator (no context, no VMM, an unexpected VMM failure); otherwise
// true with *result set: CUDA_SUCCESS and *dptr, or CUDA_ERROR_OUT_OF_MEMORY after cleaning up.
bool try_managed(CUdeviceptr* dptr, std::size_t size, CUresult* result) {
  const DriverApi& api = driver().api;
  CUcontext ctx = nullptr;
  if (api.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return false;  // the real call reports it
  CUdevice dev = 0;
  if (api.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return false;
  DeviceInfo* info = const_cast<DeviceInfo*>(device_info(api, dev));
  if (!info || info->vmm.load(std::memory_order_acquire) != kVmm) return false;
  const std::size_t gran = info->granularity.load(std::memory_order_relaxed);
  if (size > SIZE_MAX - gran) {
    *result = CUDA_ERROR_OUT_OF_MEMORY;
    return true;
  }
  const std::size_t mapped = (size + gran - 1) / gran * gran;

  auto a = std::make_unique<Allocation>();
  const CurrentTag tag = current_tag();
  a->tag = tag.tag;
  a->policy = tag.policy;
  a->size = size;
  a->mapped = mapped;
  a->ctx = ctx;
  a->device = dev;
  a->prop = make_prop(dev, info->rdma.load(std::memory_order_relaxed), info->posix_fd.load(std::memory_order_relaxed));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  a->access.push_back(access);
  vmm_peer_access(dev, a->access);  // devices that enabled peer access to this one see it too

  CUdeviceptr base = 0;
  CUresult r = api.cuMemAddressReserve(&base, mapped, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    TMS_LOG_ONCE(LogLevel::Warn, "cuMemAddressReserve failed (%s); allocating natively", cu_error_name(r));
    return false;
  }
  CUmemGenericAllocationHandle handle = 0;
  r = api.cuMemCreate(&handle, mapped, &a->prop, 0);
  // Some platforms advertise an attribute but refuse what it promises: drop the RDMA flag, then the
  // exportable handle type, for this device (legacy IPC of its memory then fails, and says so).
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && a->prop.allocFlags.gpuDirectRDMACapable) {
    info->rdma.store(false, std::memory_order_relaxed);
    a->prop.allocFlags.gpuDirectRDMACapable = 0;
    r = api.cuMemCreate(&handle, mapped, &a->prop, 0);
  }
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && a->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
    info->posix_fd.store(false, std::memory_order_relaxed);
    a->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    r = api.cuMemCreate(&handle, mapped, &a->prop, 0);
  }
  if (r != CUDA_SUCCESS) {
    api.cuMemAddressFree(base, mapped);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      *result = CUDA_ERROR_OUT_OF_MEMORY;
      return true;
    }
    TMS_LOG_ONCE(LogLevel::Warn, "cuMemCreate failed (%s); allocating natively", cu_error_name(r));
    return false;
  }
  r = api.cuMemMap(base, mapped, 0, handle, 0);
  if (r == CUDA_SUCCESS) {
    r = api.cuMemSetAccess(base, mapped, a->access.data(), a->access.size());
    if (r != CUDA_SUCCESS) api.cuMemUnmap(base, mapped);
  }
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(handle);
    api.cuMemAddressFree(base, mapped);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      *result = CUDA_ERROR_OUT_OF_MEMORY;
      return true;
    }
    TMS_LOG_ONCE(LogLevel::Warn, "mapping VMM memory failed (%s); allocating natively", cu_error_name(r));
    return false;
  }
  a->base = base;
  a->handle = handle;
  try {
    registry().add(std::move(a));
  } catch (...) {
    api.cuMemUnmap(base, mapped);
    api.cuMemRelease(handle);
    api.cuMemAddressFree(base, mapped);
    *result = CUDA_ERROR_OUT_OF_MEMORY;
    return true;
  }
  *dptr = base;
  *result = CUDA_SUCCESS;
  // The session with the daemon starts with the first managed allocation, on the control thread.
  if (Engine* e = Engine::instance()) e->ensure_started();
  return true;
}

CUresult free_managed(const Allocation& a) {
  const DriverApi& api = driver().api;
  CUresult sync = CUDA_SUCCESS;
  CtxScope scope(api, a.ctx);
  // Like the real cuMemFree: work still using the memory finishes first.
  if (scope.ok()) sync = api.cuCtxSynchronize();
  if (a.state.load() == AllocState::Resident && a.handle) {
    api.cuMemUnmap(a.base, a.mapped);
    api.cuMemRelease(a.handle);
  }
  api.cuMemAddressFree(a.base, a.mapped);
  return sync;
}

CUresult resolve(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                 CUdriverProcAddressQueryResult* status, CUresult r) {
  if (r != CUDA_SUCCESS || !pfn || !*pfn || !symbol) return r;
  if (status && *status != CU_GET_PROC_ADDRESS_SUCCESS) return r;
  *pfn = substitute_proc(symbol, *pfn, cuda_version, flags);
  return r;
}

}  // namespace

namespace hook {

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  if (!d.api.cuMemAlloc_v2) return CUDA_ERROR_NOT_INITIALIZED;
  if (guard.nested() || !d.usable || !dptr) return d.api.cuMemAlloc_v2(dptr, bytesize);
  ensure_init();
  try {
    if (current_tag().policy == Policy::Resident) {
      const CUresult r = d.api.cuMemAlloc_v2(dptr, bytesize);
      if (r == CUDA_SUCCESS) registry().add_unmanaged(*dptr, bytesize, proto::Unmanaged::Resident);
      return r;
    }
    if (bytesize >= config().min_bytes) {
      CUresult r;
      if (try_managed(dptr, bytesize, &r)) return r;
      r = d.api.cuMemAlloc_v2(dptr, bytesize);
      if (r == CUDA_SUCCESS) registry().add_unmanaged(*dptr, bytesize, proto::Unmanaged::Other);
      return r;
    }
  } catch (...) {
    return CUDA_ERROR_OUT_OF_MEMORY;  // before any device memory was taken
  }
  const CUresult r = d.api.cuMemAlloc_v2(dptr, bytesize);
  if (r == CUDA_SUCCESS) registry().add_unmanaged(*dptr, bytesize, proto::Unmanaged::Small);
  return r;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height,
                            unsigned int element_size) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  auto real = d.api.cuMemAllocPitch_v2;
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  // Invalid arguments go to the driver, which reports them its own way.
  if (guard.nested() || !d.usable || !dptr || !pitch || width == 0 || height == 0 ||
      (element_size != 4 && element_size != 8 && element_size != 16) || width > SIZE_MAX - kPitchAlignment)
    return real(dptr, pitch, width, height, element_size);
  ensure_init();
  const std::size_t p = (width + kPitchAlignment - 1) / kPitchAlignment * kPitchAlignment;
  if (height > SIZE_MAX / p) return real(dptr, pitch, width, height, element_size);
  const std::size_t bytes = p * height;
  proto::Unmanaged reason = proto::Unmanaged::Small;
  try {
    if (current_tag().policy == Policy::Resident) {
      reason = proto::Unmanaged::Resident;
    } else if (bytes >= config().min_bytes) {
      CUresult r;
      if (try_managed(dptr, bytes, &r)) {
        if (r == CUDA_SUCCESS) *pitch = p;
        return r;
      }
      reason = proto::Unmanaged::Other;
    }
  } catch (...) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUresult r = real(dptr, pitch, width, height, element_size);
  if (r == CUDA_SUCCESS) registry().add_unmanaged(*dptr, *pitch * height, reason);
  return r;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  if (!d.api.cuMemFree_v2) return CUDA_ERROR_NOT_INITIALIZED;
  if (guard.nested() || !d.usable || dptr == 0) return d.api.cuMemFree_v2(dptr);
  try {
    // Wait for a pause or resume that may be moving this very allocation.
    std::shared_lock<std::shared_mutex> lock;
    if (Engine* e = Engine::existing()) lock = std::shared_lock<std::shared_mutex>(e->op_lock());
    std::shared_ptr<Allocation> a = registry().find(dptr);
    if (a && a->app_vmm) return d.api.cuMemFree_v2(dptr);  // the application's own mapping: not ours to free
    if (!a) {
      // Forget it before the driver can hand the address out again to another thread.
      registry().remove_unmanaged(dptr);
      return d.api.cuMemFree_v2(dptr);
    }
    if (a->base != dptr) return CUDA_ERROR_INVALID_VALUE;  // inside an allocation, as the driver says
    a = registry().remove(dptr);
    if (!a) return CUDA_ERROR_INVALID_VALUE;  // freed concurrently by another thread
    if (Engine* e = Engine::existing()) {
      if (a->export_id) e->ipc().forget(a->export_id);  // importers keep what they mapped
      e->views().drop(*a);                              // a view of its host copy goes with it
    }
    const bool was_paused = a->state.load() == AllocState::Paused;
    // Before the range is returned: the driver may hand it out again at once, and calls on the new
    // memory must not be held as lost.
    if (was_paused) gate::forget_lost(a->base);
    const CUresult r = free_managed(*a);
    if (was_paused)
      if (Engine* e = Engine::existing()) e->paused_freed();  // the state, the gate, the daemon's pause
    return r;
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  if (!d.api.cuGetProcAddress) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = d.api.cuGetProcAddress(symbol, pfn, cuda_version, flags);
  if (guard.nested()) return r;
  return resolve(symbol, pfn, cuda_version, flags, nullptr, r);
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* symbol_status) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  if (!d.api.cuGetProcAddress_v2) return CUDA_ERROR_NOT_SUPPORTED;
  const CUresult r = d.api.cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, symbol_status);
  if (guard.nested()) return r;
  return resolve(symbol, pfn, cuda_version, flags, symbol_status, r);
}

}  // namespace hook
}  // namespace tmsdisk::shim
