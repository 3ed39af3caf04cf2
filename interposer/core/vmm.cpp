// SPDX-License-Identifier: Apache-2.0
// Memory beyond cuMemAlloc: application VMM behind handle tokens (paused like the shim's own
// allocations), managed and pool memory (counted, resident), shared memory (exported, imported,
// multicast-bound: resident for good), pointer queries that answer for managed allocations as for
// native ones, and peer access replayed onto managed allocations.
//
// Application VMM: cuMemCreate hands out a token (kTokenTag | n) for the real handle. A handle mapped
// once, whole (offset 0, its full size) is registered as an Allocation at that address, which the
// engine pauses and resumes with a fresh real handle; the token stays valid. Handles mapped partly,
// more than once, or not at all stay resident and count as "other". Every call that maps, unmaps,
// releases or hands out physical memory passes the gate, so while any of it is paused those calls
// wait (or resume, or fail, per TMSDISK_ON_TOUCH) and the tables never change under the engine.
// While the gate is open with lost memory (an allocation a resume could not restore), only the calls
// naming that memory (its range, or its token) are held: the engine's retry changes nothing else.
#include "vmm.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "driver.h"
#include "gate.h"
#include "log.h"
#include "registry.h"
#include "shim.h"

namespace tmsdisk::shim {
namespace {

constexpr uint64_t kTokenTag = 0x7d5d000000000000ull;
constexpr uint64_t kTokenMask = 0xffff000000000000ull;

struct Mapping {
  CUdeviceptr addr = 0;
  std::size_t size = 0;
  std::size_t offset = 0;
};

struct VmmHandle {
  CUmemGenericAllocationHandle real = 0;  // the real handle while no Allocation tracks it
  std::size_t size = 0;                   // 0 for imported handles (their mappings are counted)
  CUmemAllocationProp prop{};
  int refs = 1;  // cuMemCreate/Import/Retain minus cuMemRelease
  bool imported = false;
  int pinned = -1;  // an Unmanaged reason once shared
  CUcontext ctx = nullptr;
  std::vector<Mapping> maps;
  std::shared_ptr<Allocation> alloc;  // set while pausable
};

struct Tables {
  std::mutex mu;
  std::unordered_map<uint64_t, VmmHandle> handles;  // by token
  std::map<CUdeviceptr, uint64_t> by_addr;          // mapping start -> token
  uint64_t next = 1;
  std::vector<std::pair<CUdevice, CUdevice>> peers;  // (owner, accessor) from cuCtxEnablePeerAccess
  std::unordered_set<CUmemoryPool> pools;
  bool pool_used = false;
};

std::atomic<ManagedHook> g_on_managed{nullptr};

Tables& tables() {
  static Tables* t = new Tables;  // never destroyed: hooks may run during static destruction
  return *t;
}

bool is_token(uint64_t h) noexcept {
  return (h & kTokenMask) == kTokenTag;
}

// Tracks the driver's handle `real` behind a new token, which goes to *handle; `describe` fills in
// what else is known of it (under the table lock). The handle goes back to the driver if the shim
// cannot track it.
template <class Describe>
CUresult hand_out_token(const Driver& d, CUmemGenericAllocationHandle real, CUmemGenericAllocationHandle* handle,
                        Describe&& describe) noexcept {
  const CUresult tracked = no_throw(CUDA_ERROR_OUT_OF_MEMORY, [&]() -> CUresult {
    Tables& t = tables();
    std::lock_guard lock(t.mu);
    const uint64_t token = kTokenTag | t.next++;
    VmmHandle& v = t.handles[token];
    v.real = real;
    describe(token, v);
    *handle = token;
    return CUDA_SUCCESS;
  });
  if (tracked != CUDA_SUCCESS) d.api.cuMemRelease(real);
  return tracked;
}

CUmemGenericAllocationHandle real_of(const VmmHandle& v) noexcept {
  return v.alloc ? v.alloc->handle : v.real;
}

CUcontext context_for(const DriverApi& api, CUdevice dev) {
  CUcontext ctx = nullptr;
  if (api.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx) return ctx;
  // VMM calls need no context; the engine needs one to copy. The device's primary context (one
  // reference kept) is the one frameworks use.
  if (api.cuDevicePrimaryCtxRetain && api.cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS) return ctx;
  return nullptr;
}

// Brings the registry in line with the handle: an Allocation while it is mapped once and whole and
// neither imported nor shared, otherwise unmanaged bytes with the reason. Caller holds the table
// lock and is inside the gate.
void account(uint64_t token, VmmHandle& v) {
  // Mapped by a thread in a resident region (tmsdisk.disabled()): never paused.
  if (!v.alloc && v.pinned < 0 && current_tag().policy == Policy::Resident)
    v.pinned = static_cast<int>(proto::Unmanaged::Resident);
  const bool pausable = !v.imported && v.pinned < 0 && v.maps.size() == 1 && v.maps[0].offset == 0 &&
                        v.maps[0].size == v.size && v.ctx != nullptr;
  Registry& reg = registry();
  if (pausable && !v.alloc) {
    auto a = std::make_unique<Allocation>();
    const CurrentTag tag = current_tag();
    a->tag = tag.tag;
    a->policy = tag.policy;
    a->base = v.maps[0].addr;
    a->size = a->mapped = v.size;
    a->ctx = v.ctx;
    a->device = v.prop.location.id;
    a->prop = v.prop;
    a->handle = v.real;
    a->app_vmm = true;
    a->token = token;
    reg.remove_unmanaged(token);
    v.alloc = reg.add(std::move(a));
    ensure_init();  // registers the hook below, as the first cuMemAlloc would
    if (ManagedHook hook = g_on_managed.load(std::memory_order_acquire)) hook();
  } else if (!pausable && v.alloc) {
    v.real = v.alloc->handle;
    v.ctx = v.alloc->ctx;
    reg.remove(v.alloc->base);
    v.alloc.reset();
  }
  if (v.alloc) return;
  std::size_t bytes = v.size;
  if (v.imported) {
    bytes = 0;
    for (const Mapping& m : v.maps) bytes += m.size;
  }
  const proto::Unmanaged reason = v.pinned >= 0 ? static_cast<proto::Unmanaged>(v.pinned)
                                  : v.imported  ? proto::Unmanaged::Imported
                                                : proto::Unmanaged::Other;
  reg.remove_unmanaged(token);
  if (bytes) reg.add_unmanaged(token, bytes, reason);
}

// The handle whose mapping contains `ptr`. Caller holds the table lock.
std::pair<uint64_t, VmmHandle*> mapping_at(Tables& t, CUdeviceptr ptr) {
  auto it = t.by_addr.upper_bound(ptr);
  if (it == t.by_addr.begin()) return {0, nullptr};
  --it;
  auto h = t.handles.find(it->second);
  if (h == t.handles.end()) return {0, nullptr};
  for (const Mapping& m : h->second.maps)
    if (m.addr == it->first && ptr - m.addr < m.size) return {it->second, &h->second};
  return {0, nullptr};
}

// A managed allocation of the shim's own (cuMemAlloc) containing `ptr`, or null.
std::shared_ptr<Allocation> own_allocation(CUdeviceptr ptr) {
  auto a = registry().find(ptr);
  return a && !a->app_vmm ? a : nullptr;
}

// Same for pointer queries, which answer from the driver when the lookup ran out of memory.
std::shared_ptr<Allocation> queried_allocation(CUdeviceptr ptr) noexcept {
  std::shared_ptr<Allocation> a;
  best_effort([&] { a = own_allocation(ptr); });
  return a;
}

// Marks whatever memory `ptr` lies in as shared for good (export, DMA-BUF, multicast).
void pin_address(CUdeviceptr ptr, proto::Unmanaged reason) {
  if (auto a = own_allocation(ptr)) {
    registry().pin(*a, reason);
    return;
  }
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  auto [token, v] = mapping_at(t, ptr);
  if (v && v->pinned < 0) {
    v->pinned = static_cast<int>(reason);
    account(token, *v);
  }
}

// A real handle the application obtained for one of the shim's allocations (retain): pin it.
void pin_real_handle(CUmemGenericAllocationHandle h, proto::Unmanaged reason) {
  for (auto& a : registry().snapshot())
    if (!a->app_vmm && a->handle == h) registry().pin(*a, reason);
}

void release_if_unused(Tables& t, uint64_t token) {
  auto it = t.handles.find(token);
  if (it == t.handles.end() || it->second.refs > 0 || !it->second.maps.empty()) return;
  driver().api.cuMemRelease(real_of(it->second));
  registry().remove_unmanaged(token);
  t.handles.erase(it);
}

void merge_access(std::vector<CUmemAccessDesc>& into, const CUmemAccessDesc* desc, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    auto same = std::find_if(into.begin(), into.end(), [&](const CUmemAccessDesc& d) {
      return d.location.type == desc[i].location.type && d.location.id == desc[i].location.id;
    });
    if (same != into.end())
      same->flags = desc[i].flags;
    else
      into.push_back(desc[i]);
  }
}

// Answers one pointer attribute of a shim allocation as the driver would for a cuMemAlloc one.
// Returns false for attributes only the driver can answer.
bool answer(const Allocation& a, CUdeviceptr ptr, CUpointer_attribute attr, void* data) noexcept {
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *static_cast<CUcontext*>(data) = a.ctx; return true;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned*>(data) = CU_MEMORYTYPE_DEVICE; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr*>(data) = ptr; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = a.device; return true;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: *static_cast<CUdeviceptr*>(data) = a.base; return true;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: *static_cast<std::size_t*>(data) = a.size; return true;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *static_cast<unsigned*>(data) = 0; return true;
    case CU_POINTER_ATTRIBUTE_MAPPED: *static_cast<unsigned*>(data) = 1; return true;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
      *static_cast<unsigned long long*>(data) = (0x746dull << 48) | a.id;
      return true;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
      *static_cast<unsigned*>(data) = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      return true;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
      *static_cast<unsigned*>(data) = a.prop.allocFlags.gpuDirectRDMACapable ? 1u : 0u;
      return true;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *static_cast<CUmemoryPool*>(data) = nullptr; return true;
    default: return false;
  }
}

// Whether the application VMM handle `token` is backed by lost memory (an allocation a resume
// could not restore): calls that hand it out or release it follow TMSDISK_ON_TOUCH, as for its range.
gate::Touch token_touch(CUmemGenericAllocationHandle token) noexcept {
  if (!is_token(token)) return gate::Touch::Clear;  // a real handle: never one of a lost allocation's (it has none)
  gate::Touch touch = gate::Touch::Clear;
  best_effort([&] {
    Tables& t = tables();
    std::lock_guard lock(t.mu);
    auto it = t.handles.find(token);
    if (it != t.handles.end() && it->second.alloc)
      touch = gate::range_touch(it->second.alloc->base, it->second.alloc->mapped);
  });
  return touch;
}

template <class Fn>
CUresult passthrough_gated(const char* what, CUdeviceptr ptr, Fn&& fn) noexcept {
  GateScope gate(what, [&]() noexcept { return gate::range_touch(ptr, 1); });
  if (gate.result() != CUDA_SUCCESS) return gate.result();
  return fn();
}

}  // namespace

void vmm_on_managed(ManagedHook hook) noexcept {
  g_on_managed.store(hook, std::memory_order_release);
}

void vmm_peer_access(CUdevice owner, std::vector<CUmemAccessDesc>& access) {
  Tables& t = tables();
  std::lock_guard lock(t.mu);
  for (auto [o, accessor] : t.peers) {
    if (o != owner) continue;
    CUmemAccessDesc d{};
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = accessor;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    merge_access(access, &d, 1);
  }
}

void vmm_trim_pools() noexcept {
  const DriverApi& api = driver().api;
  if (!api.cuMemPoolTrimTo) return;
  best_effort([&] {
    std::vector<CUmemoryPool> pools;
    {
      Tables& t = tables();
      std::lock_guard lock(t.mu);
      if (!t.pool_used) return;
      pools.assign(t.pools.begin(), t.pools.end());
    }
    int devices = 0;
    if (api.cuDeviceGetMemPool && api.cuDeviceGetCount(&devices) == CUDA_SUCCESS) {
      for (int d = 0; d < devices; ++d) {
        CUmemoryPool p = nullptr;
        if (api.cuDeviceGetMemPool(&p, d) == CUDA_SUCCESS && p) pools.push_back(p);
      }
    }
    for (CUmemoryPool p : pools)
      if (CUresult r = api.cuMemPoolTrimTo(p, 0); r != CUDA_SUCCESS)
        TMS_DEBUG("cuMemPoolTrimTo failed: %s", cu_error_name(r));
  });
}

namespace hook {

// ---- memory that stays resident, counted with its reason ----

CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) noexcept {
  return intercept<&DriverApi::cuMemAllocManaged>(
      [&](const Driver& d) -> CUresult {
        const CUresult r = d.api.cuMemAllocManaged(dptr, bytesize, flags);
        if (r == CUDA_SUCCESS) registry().add_unmanaged(*dptr, bytesize, proto::Unmanaged::ManagedMemory);
        return r;
      },
      dptr, bytesize, flags);
}

namespace {
CUresult pool_alloc(CUresult r, CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool) noexcept {
  if (r != CUDA_SUCCESS) return r;
  registry().add_unmanaged(*dptr, bytes, proto::Unmanaged::Pool);
  best_effort([&] {
    Tables& t = tables();
    std::lock_guard lock(t.mu);
    t.pool_used = true;
    if (pool) t.pools.insert(pool);
  });
  return r;
}
}  // namespace

CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemAllocAsync>(
      [&](const Driver& d) -> CUresult {
        return pool_alloc(d.api.cuMemAllocAsync(dptr, bytesize, hStream), dptr, bytesize, nullptr);
      },
      dptr, bytesize, hStream);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemAllocAsync_ptsz>(
      [&](const Driver& d) -> CUresult {
        return pool_alloc(d.api.cuMemAllocAsync_ptsz(dptr, bytesize, hStream), dptr, bytesize, nullptr);
      },
      dptr, bytesize, hStream);
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemAllocFromPoolAsync>(
      [&](const Driver& d) -> CUresult {
        return pool_alloc(d.api.cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream), dptr, bytesize, pool);
      },
      dptr, bytesize, pool, hStream);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemAllocFromPoolAsync_ptsz>(
      [&](const Driver& d) -> CUresult {
        return pool_alloc(d.api.cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, hStream), dptr, bytesize, pool);
      },
      dptr, bytesize, pool, hStream);
}
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemFreeAsync>(
      [&](const Driver& d) -> CUresult {
        registry().remove_unmanaged(dptr);
        return d.api.cuMemFreeAsync(dptr, hStream);
      },
      dptr, hStream);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) noexcept {
  return intercept<&DriverApi::cuMemFreeAsync_ptsz>(
      [&](const Driver& d) -> CUresult {
        registry().remove_unmanaged(dptr);
        return d.api.cuMemFreeAsync_ptsz(dptr, hStream);
      },
      dptr, hStream);
}

// ---- pointer queries ----

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) noexcept {
  return intercept<&DriverApi::cuPointerGetAttribute>(
      [&](const Driver& d) -> CUresult {
        if (auto a = queried_allocation(ptr); a && data && answer(*a, ptr, attribute, data)) return CUDA_SUCCESS;
        return passthrough_gated("cuPointerGetAttribute", ptr,
                                 [&] { return d.api.cuPointerGetAttribute(data, attribute, ptr); });
      },
      data, attribute, ptr);
}

CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute* attributes, void** data,
                                CUdeviceptr ptr) noexcept {
  return intercept<&DriverApi::cuPointerGetAttributes>(
      [&](const Driver& d) -> CUresult {
        const std::shared_ptr<Allocation> a = queried_allocation(ptr);
        if (!a || !attributes || !data) {
          return passthrough_gated("cuPointerGetAttributes", ptr,
                                   [&] { return d.api.cuPointerGetAttributes(numAttributes, attributes, data, ptr); });
        }
        for (unsigned i = 0; i < numAttributes; ++i) {
          if (!data[i] || answer(*a, ptr, attributes[i], data[i])) continue;
          const CUresult r = passthrough_gated("cuPointerGetAttributes", ptr, [&] {
            return d.api.cuPointerGetAttributes(1, &attributes[i], &data[i], ptr);
          });
          if (r != CUDA_SUCCESS) return r;
        }
        return CUDA_SUCCESS;
      },
      numAttributes, attributes, data, ptr);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) noexcept {
  return intercept<&DriverApi::cuMemGetAddressRange_v2>(
      [&](const Driver& d) -> CUresult {
        if (auto a = queried_allocation(dptr)) {
          if (pbase) *pbase = a->base;
          if (psize) *psize = a->size;
          return CUDA_SUCCESS;
        }
        return passthrough_gated("cuMemGetAddressRange", dptr,
                                 [&] { return d.api.cuMemGetAddressRange_v2(pbase, psize, dptr); });
      },
      pbase, psize, dptr);
}

// ---- application VMM ----

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMemCreate>(
      [&](const Driver& d) -> CUresult {
        if (!handle || !prop) return d.api.cuMemCreate(handle, size, prop, flags);
        CUmemGenericAllocationHandle real = 0;
        const CUresult r = d.api.cuMemCreate(&real, size, prop, flags);
        if (r != CUDA_SUCCESS) return r;
        return hand_out_token(d, real, handle, [&](uint64_t token, VmmHandle& v) {
          v.size = size;
          v.prop = *prop;
          account(token, v);
        });
      },
      handle, size, prop, flags);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) noexcept {
  return intercept<&DriverApi::cuMemRelease>(
      [&](const Driver& d) -> CUresult {
        if (!is_token(handle)) return d.api.cuMemRelease(handle);
        GateScope gate("cuMemRelease", [&]() noexcept { return token_touch(handle); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.handles.find(handle);
          if (it == t.handles.end() || it->second.refs <= 0) return CUDA_ERROR_INVALID_VALUE;
          // Physical memory lives on while mapped, as with the driver; the real handle goes with the last
          // mapping.
          --it->second.refs;
          release_if_unused(t, handle);
          return CUDA_SUCCESS;
        });
      },
      handle);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMemMap>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMemMap", [&]() noexcept {
          const gate::Touch at = gate::range_touch(ptr, size);
          return at == gate::Touch::Lost ? at : token_touch(handle);
        });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        if (!is_token(handle)) return d.api.cuMemMap(ptr, size, offset, handle, flags);
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.handles.find(handle);
          if (it == t.handles.end() || it->second.refs <= 0) return CUDA_ERROR_INVALID_VALUE;
          VmmHandle& v = it->second;
          const CUresult r = d.api.cuMemMap(ptr, size, offset, real_of(v), flags);
          if (r != CUDA_SUCCESS) return r;
          if (!v.ctx && !v.alloc) v.ctx = context_for(d.api, v.prop.location.id);
          v.maps.push_back({ptr, size, offset});
          t.by_addr[ptr] = handle;
          account(handle, v);
          return CUDA_SUCCESS;
        });
      },
      ptr, size, offset, handle, flags);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) noexcept {
  return intercept<&DriverApi::cuMemUnmap>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMemUnmap", [&]() noexcept { return gate::range_touch(ptr, size); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        const CUresult r = d.api.cuMemUnmap(ptr, size);
        if (r != CUDA_SUCCESS) return r;
        best_effort([&] {
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          for (auto it = t.by_addr.lower_bound(ptr); it != t.by_addr.end() && it->first < ptr + size;) {
            const uint64_t token = it->second;
            const CUdeviceptr addr = it->first;
            it = t.by_addr.erase(it);
            auto h = t.handles.find(token);
            if (h == t.handles.end()) continue;
            auto& maps = h->second.maps;
            maps.erase(std::remove_if(maps.begin(), maps.end(), [&](const Mapping& m) { return m.addr == addr; }),
                       maps.end());
            account(token, h->second);
            release_if_unused(t, token);
          }
        });
        return r;
      },
      ptr, size);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) noexcept {
  return intercept<&DriverApi::cuMemSetAccess>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMemSetAccess", [&]() noexcept { return gate::range_touch(ptr, size); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        const CUresult r = d.api.cuMemSetAccess(ptr, size, desc, count);
        if (r != CUDA_SUCCESS || !desc) return r;
        best_effort([&] {
          // Remember the rights of every mapping in the range: a resume restores them (peers included).
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.by_addr.upper_bound(ptr);
          if (it != t.by_addr.begin()) --it;
          for (; it != t.by_addr.end() && it->first < ptr + size; ++it) {
            auto h = t.handles.find(it->second);
            if (h == t.handles.end() || !h->second.alloc) continue;
            Allocation& a = *h->second.alloc;
            if (a.base + a.size <= ptr) continue;
            merge_access(a.access, desc, count);
          }
        });
        return r;
      },
      ptr, size, desc, count);
}

CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* location, CUdeviceptr ptr) noexcept {
  return intercept<&DriverApi::cuMemGetAccess>(
      [&](const Driver& d) -> CUresult {
        return passthrough_gated("cuMemGetAccess", ptr, [&] { return d.api.cuMemGetAccess(flags, location, ptr); });
      },
      flags, location, ptr);
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) noexcept {
  return intercept<&DriverApi::cuMemRetainAllocationHandle>(
      [&](const Driver& d) -> CUresult {
        const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(addr));
        GateScope gate("cuMemRetainAllocationHandle", [&]() noexcept { return gate::range_touch(ptr, 1); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          if (handle) {
            Tables& t = tables();
            std::lock_guard lock(t.mu);
            if (auto [token, v] = mapping_at(t, ptr); v) {
              ++v->refs;
              *handle = token;
              return CUDA_SUCCESS;
            }
          }
          // The real handle of one of the shim's allocations: whoever holds it may map or share the
          // physical memory, so it stays resident from now on.
          if (auto a = own_allocation(ptr)) {
            const CUresult r = d.api.cuMemRetainAllocationHandle(handle, addr);
            if (r == CUDA_SUCCESS) registry().pin(*a, proto::Unmanaged::Exported);
            return r;
          }
          return d.api.cuMemRetainAllocationHandle(handle, addr);
        });
      },
      handle, addr);
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                CUmemGenericAllocationHandle handle) noexcept {
  return intercept<&DriverApi::cuMemGetAllocationPropertiesFromHandle>(
      [&](const Driver& d) -> CUresult {
        if (!is_token(handle) || !prop) return d.api.cuMemGetAllocationPropertiesFromHandle(prop, handle);
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.handles.find(handle);
          if (it == t.handles.end()) return CUDA_ERROR_INVALID_VALUE;
          if (it->second.imported) return d.api.cuMemGetAllocationPropertiesFromHandle(prop, it->second.real);
          *prop = it->second.prop;
          return CUDA_SUCCESS;
        });
      },
      prop, handle);
}

// ---- sharing: whatever another process or device may reference stays resident ----

CUresult cuMemExportToShareableHandle(void* shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType, unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMemExportToShareableHandle>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMemExportToShareableHandle", [&]() noexcept { return token_touch(handle); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          if (!is_token(handle)) {
            pin_real_handle(handle, proto::Unmanaged::Exported);
            return d.api.cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
          }
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.handles.find(handle);
          if (it == t.handles.end()) return CUDA_ERROR_INVALID_VALUE;
          VmmHandle& v = it->second;
          const CUresult r = d.api.cuMemExportToShareableHandle(shareableHandle, real_of(v), handleType, flags);
          if (r == CUDA_SUCCESS && v.pinned < 0 && !v.imported) {
            v.pinned = static_cast<int>(proto::Unmanaged::Exported);
            account(handle, v);
          }
          return r;
        });
      },
      shareableHandle, handle, handleType, flags);
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* osHandle,
                                        CUmemAllocationHandleType shHandleType) noexcept {
  return intercept<&DriverApi::cuMemImportFromShareableHandle>(
      [&](const Driver& d) -> CUresult {
        if (!handle) return d.api.cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
        CUmemGenericAllocationHandle real = 0;
        const CUresult r = d.api.cuMemImportFromShareableHandle(&real, osHandle, shHandleType);
        if (r != CUDA_SUCCESS) return r;
        return hand_out_token(d, real, handle, [](uint64_t, VmmHandle& v) { v.imported = true; });
      },
      handle, osHandle, shHandleType);
}

CUresult cuMemGetHandleForAddressRange(void* handle, CUdeviceptr dptr, size_t size, CUmemRangeHandleType handleType,
                                       unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMemGetHandleForAddressRange>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMemGetHandleForAddressRange", [&]() noexcept { return gate::range_touch(dptr, size); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        const CUresult r = d.api.cuMemGetHandleForAddressRange(handle, dptr, size, handleType, flags);
        if (r == CUDA_SUCCESS) {
          best_effort([&] {
            pin_address(dptr, proto::Unmanaged::Exported);  // a DMA-BUF: another device may read it any time
          });
        }
        return r;
      },
      handle, dptr, size, handleType, flags);
}

// cuMulticastCreate is deliberately not called anywhere (forbidden on the GPU machines); binding
// memory that the application's own multicast object covers keeps that memory resident.
CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                            CUmemGenericAllocationHandle memHandle, size_t memOffset, size_t size,
                            unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMulticastBindMem>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMulticastBindMem", [&]() noexcept { return token_touch(memHandle); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        return no_throw(CUDA_ERROR_UNKNOWN, [&]() -> CUresult {
          if (!is_token(memHandle)) {
            pin_real_handle(memHandle, proto::Unmanaged::Multicast);
            return d.api.cuMulticastBindMem(mcHandle, mcOffset, memHandle, memOffset, size, flags);
          }
          Tables& t = tables();
          std::lock_guard lock(t.mu);
          auto it = t.handles.find(memHandle);
          if (it == t.handles.end()) return CUDA_ERROR_INVALID_VALUE;
          VmmHandle& v = it->second;
          const CUresult r = d.api.cuMulticastBindMem(mcHandle, mcOffset, real_of(v), memOffset, size, flags);
          if (r == CUDA_SUCCESS && v.pinned < 0 && !v.imported) {
            v.pinned = static_cast<int>(proto::Unmanaged::Multicast);
            account(memHandle, v);
          }
          return r;
        });
      },
      mcHandle, mcOffset, memHandle, memOffset, size, flags);
}

CUresult cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUdeviceptr memptr, size_t size,
                             unsigned long long flags) noexcept {
  return intercept<&DriverApi::cuMulticastBindAddr>(
      [&](const Driver& d) -> CUresult {
        GateScope gate("cuMulticastBindAddr", [&]() noexcept { return gate::range_touch(memptr, size); });
        if (gate.result() != CUDA_SUCCESS) return gate.result();
        const CUresult r = d.api.cuMulticastBindAddr(mcHandle, mcOffset, memptr, size, flags);
        if (r == CUDA_SUCCESS) {
          best_effort([&] { pin_address(memptr, proto::Unmanaged::Multicast); });
        }
        return r;
      },
      mcHandle, mcOffset, memptr, size, flags);
}

// ---- peers ----

CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) noexcept {
  return intercept<&DriverApi::cuCtxEnablePeerAccess>(
      [&](const Driver& d) -> CUresult {
        const CUresult r = d.api.cuCtxEnablePeerAccess(peerContext, Flags);
        if (r != CUDA_SUCCESS) return r;
        // The current context's device may now use the peer's cuMemAlloc memory. The shim's allocations
        // are VMM memory, which peer access does not open: grant it explicitly, now and on every resume,
        // and to allocations made later.
        CUdevice accessor = 0, owner = 0;
        if (d.api.cuCtxGetDevice(&accessor) != CUDA_SUCCESS) return r;
        {
          CtxScope scope(d.api, peerContext);
          if (!scope.ok() || d.api.cuCtxGetDevice(&owner) != CUDA_SUCCESS) return r;
        }
        // Touches no lost memory: a lost allocation gets the new peer when a resume maps it (map_job).
        GateScope gate("cuCtxEnablePeerAccess", []() noexcept { return gate::Touch::Clear; });
        if (gate.result() != CUDA_SUCCESS) {
          TMS_WARN(
              "peer access enabled while paused under TMSDISK_ON_TOUCH=fail: managed memory of device %d is not "
              "opened to device %d",
              owner, accessor);
          return r;
        }
        best_effort([&] {
          {
            Tables& t = tables();
            std::lock_guard lock(t.mu);
            if (std::find(t.peers.begin(), t.peers.end(), std::make_pair(owner, accessor)) == t.peers.end())
              t.peers.emplace_back(owner, accessor);
          }
          CUmemAccessDesc desc{};
          desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
          desc.location.id = accessor;
          desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
          for (auto& a : registry().snapshot()) {
            if (a->app_vmm || a->device != owner || a->state.load() != AllocState::Resident) continue;
            if (CUresult e = d.api.cuMemSetAccess(a->base, a->mapped, &desc, 1); e != CUDA_SUCCESS) {
              TMS_WARN("opening blob %llu to device %d failed: %s", static_cast<unsigned long long>(a->id), accessor,
                       cu_error_name(e));
              continue;
            }
            merge_access(a->access, &desc, 1);
          }
        });
        return r;
      },
      peerContext, Flags);
}

}  // namespace hook
}  // namespace tmsdisk::shim
