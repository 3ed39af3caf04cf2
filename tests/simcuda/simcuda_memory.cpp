// SPDX-License-Identifier: Apache-2.0
// simcuda memory: device memory is host memory with real virtual-memory semantics. Reserve is a
// PROT_NONE mapping, physical memory is a memfd charged to the shared ledger, map is MAP_FIXED of the
// memfd, access is mprotect, and unmap puts PROT_NONE back so a stray touch faults.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "simcuda_internal.h"

namespace simcuda {
namespace {

constexpr int kReserveFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
constexpr char kVmmPrefix[] = "simcuda-vmm";
constexpr char kNativePrefix[] = "simcuda-native";
constexpr char kIpcMagic[8] = {'S', 'I', 'M', 'C', 'I', 'P', 'C', '1'};

// What cuIpcGetMemHandle puts in the 64 opaque bytes: the exporter's memfd, reopened by the
// importer through /proc/<pid>/fd/<fd>, and the allocation id that proves the fd was not reused.
struct IpcWire {
  char magic[8];
  int32_t pid;
  int32_t fd;
  uint64_t id;
  uint64_t size;
  int32_t device;
  int32_t reserved;
};
static_assert(sizeof(IpcWire) <= CU_IPC_HANDLE_SIZE);

template <class M>
typename M::iterator containing(M& m, uintptr_t p) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return m.end();
  --it;
  return p - it->first < it->second.size ? it : m.end();
}

bool add_overflows(uintptr_t a, size_t n) {
  return a + n < a;
}

bool round_up(size_t x, size_t a, size_t* out) {
  if (x > SIZE_MAX - (a - 1)) return false;
  *out = (x + a - 1) / a * a;
  return true;
}

bool power_of_two(size_t x) {
  return x != 0 && (x & (x - 1)) == 0;
}

// An aligned PROT_NONE range; `hint` is honored when it is free and aligned, like the driver's.
void* reserve_va(size_t size, size_t align, uintptr_t hint) {
#ifdef MAP_FIXED_NOREPLACE
  if (hint != 0 && hint % align == 0) {
    void* p = mmap(reinterpret_cast<void*>(hint), size, PROT_NONE, kReserveFlags | MAP_FIXED_NOREPLACE, -1, 0);
    if (p != MAP_FAILED) {
      if (reinterpret_cast<uintptr_t>(p) == hint) return p;
      munmap(p, size);  // a kernel without NOREPLACE treated it as a plain hint
    }
  }
#else
  (void)hint;
#endif
  if (size > SIZE_MAX - align) return nullptr;
  size_t span = size + align;
  void* p = mmap(nullptr, span, PROT_NONE, kReserveFlags, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  uintptr_t b = reinterpret_cast<uintptr_t>(p);
  uintptr_t a = (b + align - 1) / align * align;
  if (a > b) munmap(p, a - b);
  uintptr_t end = b + span;
  if (end > a + size) munmap(reinterpret_cast<void*>(a + size), end - (a + size));
  return reinterpret_cast<void*>(a);
}

// Back to an inaccessible reservation, atomically replacing whatever was mapped there.
bool unback(uintptr_t p, size_t n) {
  return mmap(reinterpret_cast<void*>(p), n, PROT_NONE, kReserveFlags | MAP_FIXED, -1, 0) != MAP_FAILED;
}

int make_memfd(const char* name, size_t size) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The memfd's name, as the kernel reports it for an fd of this process: "/memfd:<name> (deleted)".
bool memfd_name(int fd, char* out, size_t len) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, out, len - 1);
  if (n < 0) return false;
  out[n] = '\0';
  return strncmp(out, "/memfd:", 7) == 0;
}

// Caller holds mem_mu. Closing the memfd frees its pages once no mapping holds them.
void destroy_alloc(Driver& d, PhysAlloc& a) {
  if (a.fd >= 0) close(a.fd);
  a.fd = -1;
  if (a.charged) uncharge(d, a.device, a.size);
  a.charged = false;
}

// Caller holds mem_mu (either mode). Inside a reservation, a native allocation or an IPC import.
bool is_device_address(Driver& d, uintptr_t p) {
  return containing(d.reservations, p) != d.reservations.end() || containing(d.natives, p) != d.natives.end() ||
         containing(d.imports, p) != d.imports.end();
}

// Caller holds mem_mu. Device `dev` may read (write) every byte of [p, p+n).
CUresult check_locked(Driver& d, uintptr_t p, size_t n, int dev, bool write) {
  if (n == 0) return CUDA_SUCCESS;
  if (add_overflows(p, n)) return CUDA_ERROR_INVALID_VALUE;
  uintptr_t end = p + n;
  if (auto it = containing(d.natives, p); it != d.natives.end()) {
    return end <= it->first + it->second.size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  if (auto it = containing(d.imports, p); it != d.imports.end()) {
    return end <= it->first + it->second.size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  auto it = containing(d.mappings, p);
  uint64_t bit = uint64_t{1} << dev;
  uintptr_t cur = p;
  while (cur < end) {
    if (it == d.mappings.end() || it->first > cur) return CUDA_ERROR_INVALID_VALUE;
    const MapGroup& g = it->second;
    uintptr_t gend = it->first + g.size;
    size_t first = (cur - it->first) / kGranularity;
    size_t last = (std::min(end, gend) - 1 - it->first) / kGranularity;
    for (size_t i = first; i <= last; ++i) {
      if (((write ? g.access[i].write : g.access[i].read) & bit) == 0) return CUDA_ERROR_INVALID_VALUE;
    }
    cur = gend;
    ++it;
  }
  return CUDA_SUCCESS;
}

// Caller holds mem_mu. A host-side pointer is checked like device memory when it lies in device
// address space (unified addressing), and trusted otherwise.
CUresult check_side(Driver& d, uintptr_t p, Side side, size_t n, int dev, bool write) {
  if (side == Side::Device || is_device_address(d, p)) return check_locked(d, p, n, dev, write);
  return CUDA_SUCCESS;
}

CUresult current_device(Driver& d, CUctx_st** ctx, int* dev) {
  CUctx_st* c = nullptr;
  if (CUresult r = current_context(d, &c); r != CUDA_SUCCESS) return r;
  if (ctx != nullptr) *ctx = c;
  if (dev != nullptr) *dev = c->device;
  return CUDA_SUCCESS;
}

CUresult valid_location(Driver& d, const CUmemLocation& loc) {
  if (loc.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
  return valid_device(d, loc.id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

// Caller holds mem_mu exclusively. Applies the union of all devices' rights as the host protection
// of each granule of a mapping, in runs.
bool protect_group(uintptr_t base, const MapGroup& g, size_t first, size_t last) {
  auto prot_of = [&](size_t i) {
    if (g.access[i].write != 0) return PROT_READ | PROT_WRITE;
    if (g.access[i].read != 0) return PROT_READ;
    return PROT_NONE;
  };
  size_t i = first;
  while (i <= last) {
    int prot = prot_of(i);
    size_t j = i;
    while (j + 1 <= last && prot_of(j + 1) == prot) ++j;
    if (mprotect(reinterpret_cast<void*>(base + i * kGranularity), (j - i + 1) * kGranularity, prot) != 0) {
      return false;
    }
    i = j + 1;
  }
  return true;
}

struct PtrInfo {
  enum Kind { None, Native, Import, Mapped, Reserved, Host } kind = None;
  uintptr_t range_base = 0;
  size_t range_size = 0;
  uintptr_t map_base = 0;
  size_t map_size = 0;
  CUctx_st* ctx = nullptr;
  int device = 0;
  uint64_t buffer_id = 0;
  uint64_t block_id = 0;
  unsigned handle_types = 0;
  bool rdma = false;
  bool managed = false;
  CUmemoryPool pool = nullptr;
  Access access{};
};

// Caller holds mem_mu.
PtrInfo classify(Driver& d, uintptr_t p) {
  PtrInfo info;
  if (auto it = containing(d.natives, p); it != d.natives.end()) {
    const NativeAlloc& a = it->second;
    info.kind = PtrInfo::Native;
    info.range_base = info.map_base = it->first;
    info.range_size = info.map_size = a.size;
    info.ctx = a.ctx;
    info.device = a.device;
    info.buffer_id = info.block_id = a.id;
    info.rdma = d.cfg.rdma_with_vmm != 0 && !a.managed;
    info.managed = a.managed;
    info.pool = a.pool;
    info.access.read = info.access.write = ~uint64_t{0};
    return info;
  }
  if (auto it = containing(d.imports, p); it != d.imports.end()) {
    const IpcImport& a = it->second;
    info.kind = PtrInfo::Import;
    info.range_base = info.map_base = it->first;
    info.range_size = info.map_size = a.size;
    info.ctx = a.ctx;
    info.device = a.device;
    info.buffer_id = info.block_id = a.id;
    info.access.read = info.access.write = ~uint64_t{0};
    return info;
  }
  if (auto it = containing(d.reservations, p); it != d.reservations.end()) {
    info.kind = PtrInfo::Reserved;
    info.range_base = it->first;
    info.range_size = it->second.size;
    if (auto m = containing(d.mappings, p); m != d.mappings.end()) {
      const MapGroup& g = m->second;
      info.kind = PtrInfo::Mapped;
      info.map_base = m->first;
      info.map_size = g.size;
      info.device = g.alloc->device;
      info.buffer_id = g.id;
      info.block_id = g.alloc->handle;
      info.handle_types = static_cast<unsigned>(g.alloc->prop.requestedHandleTypes);
      info.rdma = g.alloc->prop.allocFlags.gpuDirectRDMACapable != 0 && d.cfg.rdma_with_vmm != 0;
      info.access = g.access[(p - m->first) / kGranularity];
    }
    return info;
  }
  if (auto it = containing(d.hosts, p); it != d.hosts.end()) {
    info.kind = PtrInfo::Host;
    info.range_base = info.map_base = it->first;
    info.range_size = info.map_size = it->second.size;
    info.ctx = it->second.ctx;
    info.device = it->second.ctx->device;
    info.buffer_id = info.block_id = it->second.id;
    return info;
  }
  return info;
}

template <class T>
void put(void* data, T v) {
  memcpy(data, &v, sizeof v);
}

// Frees one native allocation. Caller holds mem_mu exclusively.
void free_native(Driver& d, std::map<uintptr_t, NativeAlloc>::iterator it) {
  munmap(reinterpret_cast<void*>(it->first), it->second.mapped);
  close(it->second.fd);
  uncharge(d, it->second.device, it->second.mapped);
  d.natives.erase(it);
}

}  // namespace

// ---- native allocations ----

namespace {

// A page-rounded memfd mapping, charged to `dev` (2 MiB-aligned from 2 MiB up).
CUresult alloc_native(Driver& d, CUdeviceptr* out, size_t bytes, CUctx_st* c, int dev, bool managed,
                      CUmemPoolHandle_st* pool) {
  size_t mapped = 0;
  if (!round_up(bytes, d.page, &mapped)) return CUDA_ERROR_OUT_OF_MEMORY;
  // Large allocations get the VMM granularity's alignment, as from the real allocator.
  size_t align = bytes >= kGranularity ? kGranularity : d.page;
  if (!charge(d, dev, mapped)) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t id = d.new_id();
  char name[96];
  snprintf(name, sizeof name, "%s:pid=%d:id=%llu:dev=%d", kNativePrefix, static_cast<int>(getpid()),
           static_cast<unsigned long long>(id), dev);
  int fd = make_memfd(name, mapped);
  void* va = fd < 0 ? nullptr : reserve_va(mapped, align, 0);
  if (va == nullptr || mmap(va, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    if (va != nullptr) munmap(va, mapped);
    if (fd >= 0) close(fd);
    uncharge(d, dev, mapped);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  NativeAlloc a{bytes, mapped, c, dev, fd, id};
  a.managed = managed;
  a.pool = pool;
  d.natives[reinterpret_cast<uintptr_t>(va)] = a;
  *out = reinterpret_cast<CUdeviceptr>(va);
  return CUDA_SUCCESS;
}

// Releases an idle pool block. Caller holds mem_mu exclusively.
void release_block(Driver& d, uintptr_t base, const NativeAlloc& a) {
  munmap(reinterpret_cast<void*>(base), a.mapped);
  close(a.fd);
  uncharge(d, a.device, a.mapped);
}

}  // namespace

CUresult mem_alloc(Driver& d, CUdeviceptr* out, size_t bytes) {
  if (out == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* c = nullptr;
  int dev = 0;
  if (CUresult r = current_device(d, &c, &dev); r != CUDA_SUCCESS) return r;
  return alloc_native(d, out, bytes, c, dev, false, nullptr);
}

CUresult mem_alloc_managed(Driver& d, CUdeviceptr* out, size_t bytes, unsigned flags) {
  if (out == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* c = nullptr;
  int dev = 0;
  if (CUresult r = current_device(d, &c, &dev); r != CUDA_SUCCESS) return r;
  return alloc_native(d, out, bytes, c, dev, true, nullptr);
}

// ---- stream-ordered pools: one default pool per device ----

CUresult default_mem_pool(Driver& d, CUmemoryPool* out, int device) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(d, device)) return CUDA_ERROR_INVALID_DEVICE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  d.pools[device].device = device;
  *out = &d.pools[device];
  return CUDA_SUCCESS;
}

CUresult mem_alloc_async(Driver& d, CUdeviceptr* out, size_t bytes, CUstream h, bool ptds) {
  if (out == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  CUctx_st* c = s->ctx;
  int dev = c->device;
  CUmemPoolHandle_st* pool = &d.pools[dev];
  size_t mapped = 0;
  if (!round_up(bytes, d.page, &mapped)) return CUDA_ERROR_OUT_OF_MEMORY;
  {
    // Reuse a block that an earlier cuMemFreeAsync returned (its stream reached the free).
    std::unique_lock<std::shared_mutex> lk(d.mem_mu);
    pool->device = dev;
    for (auto it = pool->idle.begin(); it != pool->idle.end(); ++it) {
      if (it->second.mapped != mapped) continue;
      NativeAlloc a = it->second;
      uintptr_t base = it->first;
      pool->idle.erase(it);
      a.size = bytes;
      a.ctx = c;
      a.id = d.new_id();
      d.natives[base] = a;
      *out = static_cast<CUdeviceptr>(base);
      return CUDA_SUCCESS;
    }
  }
  return alloc_native(d, out, bytes, c, dev, false, pool);
}

CUresult mem_free_async(Driver& d, CUdeviceptr p, CUstream h, bool ptds) {
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  {
    std::shared_lock<std::shared_mutex> lk(d.mem_mu);
    auto it = d.natives.find(static_cast<uintptr_t>(p));
    if (it == d.natives.end() || it->second.pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  }
  // In stream order: work queued before the free still sees the memory.
  Op op;
  op.run = [&d, p] {
    std::unique_lock<std::shared_mutex> lk(d.mem_mu);
    auto it = d.natives.find(static_cast<uintptr_t>(p));
    if (it == d.natives.end() || it->second.pool == nullptr) return CUDA_SUCCESS;  // freed meanwhile
    it->second.pool->idle.emplace_back(it->first, it->second);
    d.natives.erase(it);
    return CUDA_SUCCESS;
  };
  return enqueue(d, s, std::move(op));
}

CUresult mem_pool_trim(Driver& d, CUmemoryPool pool, size_t keep) {
  if (pool < &d.pools[0] || pool >= &d.pools[kMaxDevices]) return CUDA_ERROR_INVALID_VALUE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  size_t idle = 0;
  for (const auto& [base, a] : pool->idle) idle += a.mapped;
  while (idle > keep && !pool->idle.empty()) {
    auto& [base, a] = pool->idle.back();
    idle -= a.mapped;
    release_block(d, base, a);
    pool->idle.pop_back();
  }
  return CUDA_SUCCESS;
}

CUresult mem_alloc_pitch(Driver& d, CUdeviceptr* out, size_t* pitch, size_t width, size_t height, unsigned elem) {
  if (out == nullptr || pitch == nullptr || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (elem != 4 && elem != 8 && elem != 16) return CUDA_ERROR_INVALID_VALUE;
  size_t p = 0;
  if (!round_up(width, 512, &p) || height > SIZE_MAX / p) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult r = mem_alloc(d, out, p * height);
  if (r == CUDA_SUCCESS) *pitch = p;
  return r;
}

CUresult mem_free(Driver& d, CUdeviceptr p) {
  if (p == 0) return CUDA_SUCCESS;
  CUctx_st* ctx = nullptr;
  {
    std::shared_lock<std::shared_mutex> lk(d.mem_mu);
    auto it = d.natives.find(static_cast<uintptr_t>(p));
    if (it == d.natives.end()) return CUDA_ERROR_INVALID_VALUE;
    ctx = it->second.ctx;
  }
  // cuMemFree synchronizes: nothing queued may still touch the memory.
  sync_context(d, ctx);
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.natives.find(static_cast<uintptr_t>(p));
  if (it == d.natives.end()) return CUDA_ERROR_INVALID_VALUE;
  free_native(d, it);
  return CUDA_SUCCESS;
}

void free_context_memory(Driver& d, CUctx_st* ctx) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  for (auto it = d.natives.begin(); it != d.natives.end();) {
    auto next = std::next(it);
    if (it->second.ctx == ctx) free_native(d, it);
    it = next;
  }
  for (auto it = d.imports.begin(); it != d.imports.end();) {
    if (it->second.ctx == ctx) {
      munmap(reinterpret_cast<void*>(it->first), it->second.size);
      it = d.imports.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = d.hosts.begin(); it != d.hosts.end();) {
    if (it->second.ctx == ctx) {
      if (it->second.allocated) munmap(reinterpret_cast<void*>(it->first), it->second.size);
      it = d.hosts.erase(it);
    } else {
      ++it;
    }
  }
}

CUresult mem_get_info(Driver& d, size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  int dev = 0;
  if (CUresult r = current_device(d, nullptr, &dev); r != CUDA_SUCCESS) return r;
  uint64_t used = std::min(d.ledger->used[dev].load(), d.cfg.capacity);
  *free_bytes = d.cfg.capacity - used;
  *total_bytes = d.cfg.capacity;
  return CUDA_SUCCESS;
}

CUresult mem_get_address_range(Driver& d, CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  if (CUresult r = current_device(d, nullptr, nullptr); r != CUDA_SUCCESS) return r;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  PtrInfo info = classify(d, static_cast<uintptr_t>(p));
  // The mapped region: for VMM memory the cuMemMap range holding p, not the reservation.
  if (info.kind != PtrInfo::Native && info.kind != PtrInfo::Import && info.kind != PtrInfo::Mapped) {
    return CUDA_ERROR_NOT_FOUND;
  }
  if (base != nullptr) *base = info.map_base;
  if (size != nullptr) *size = info.map_size;
  return CUDA_SUCCESS;
}

CUresult pointer_get_attribute(Driver& d, void* data, CUpointer_attribute attr, CUdeviceptr p, bool lenient) {
  if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* cur = nullptr;
  bool have_ctx = current_context(d, &cur) == CUDA_SUCCESS;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  PtrInfo info = classify(d, static_cast<uintptr_t>(p));
  bool backed = info.kind != PtrInfo::None && info.kind != PtrInfo::Reserved;
  bool device = info.kind == PtrInfo::Native || info.kind == PtrInfo::Import || info.kind == PtrInfo::Mapped;
  // cuPointerGetAttribute fails on memory CUDA does not know; cuPointerGetAttributes writes zeros.
  auto unknown = [&](auto zero) {
    put(data, zero);
    return lenient ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  };
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      if (!backed) return unknown(CUcontext{nullptr});
      put(data, static_cast<CUcontext>(info.ctx));  // null for VMM memory, which no context owns
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      if (!backed) return unknown(0u);
      put(data, static_cast<unsigned>(info.kind == PtrInfo::Host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      if (!lenient && !have_ctx) return CUDA_ERROR_INVALID_CONTEXT;
      if (!backed) return unknown(CUdeviceptr{0});
      put(data, p);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (info.kind != PtrInfo::Host) return unknown(static_cast<void*>(nullptr));
      put(data, reinterpret_cast<void*>(p));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      if (!backed) return unknown(0u);
      put(data, info.managed ? 1u : 0u);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
      if (!backed) return unknown(0u);
      put(data, 0u);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      if (!backed) return unknown(0ull);
      put(data, static_cast<unsigned long long>(info.buffer_id));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
      if (!backed) return unknown(0ull);
      put(data, static_cast<unsigned long long>(info.block_id));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      if (!backed) return unknown(-2);  // cudart's cudaInvalidDeviceId
      put(data, info.device);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      if (!backed) return unknown(0u);
      put(data, info.kind == PtrInfo::Native && !info.managed && info.pool == nullptr ? 1u : 0u);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      // For VMM memory this is the reservation, even where nothing is mapped.
      if (info.kind == PtrInfo::None) return unknown(CUdeviceptr{0});
      put(data, static_cast<CUdeviceptr>(info.range_base));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      if (info.kind == PtrInfo::None) return unknown(size_t{0});
      put(data, info.range_size);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      if (info.kind == PtrInfo::None) return unknown(0u);
      put(data, backed ? 1u : 0u);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
      if (!device) return unknown(CUdeviceptr{0});
      put(data, static_cast<CUdeviceptr>(info.map_base));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
      if (!device) return unknown(size_t{0});
      put(data, info.map_size);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
      if (!backed) return unknown(0u);
      put(data, info.handle_types);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
      if (!backed) return unknown(0u);
      put(data, info.rdma ? 1u : 0u);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: {
      if (!device) return unknown(0u);
      uint64_t bit = uint64_t{1} << (have_ctx ? cur->device : info.device);
      unsigned f = (info.access.write & bit) != 0  ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                   : (info.access.read & bit) != 0 ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                                   : CU_MEM_ACCESS_FLAGS_PROT_NONE;
      put(data, f);
      return CUDA_SUCCESS;
    }
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
      if (!backed) return unknown(static_cast<CUmemoryPool>(nullptr));
      put(data, info.pool);
      return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

// ---- virtual memory management ----

CUresult address_reserve(Driver& d, CUdeviceptr* out, size_t size, size_t alignment, CUdeviceptr hint,
                         unsigned long long flags) {
  if (out == nullptr || flags != 0 || size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment != 0 && !power_of_two(alignment)) return CUDA_ERROR_INVALID_VALUE;
  size_t align = std::max(alignment, kGranularity);
  void* p = reserve_va(size, align, static_cast<uintptr_t>(hint));
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  d.reservations[reinterpret_cast<uintptr_t>(p)] = Reservation{size};
  *out = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult address_free(Driver& d, CUdeviceptr p, size_t size) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.reservations.find(static_cast<uintptr_t>(p));
  if (it == d.reservations.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  // Stricter than the driver documents: freeing a range that still has mappings is refused, so a
  // caller that forgot cuMemUnmap finds out here rather than leaking physical memory.
  auto m = d.mappings.lower_bound(it->first);
  if (m != d.mappings.end() && m->first < it->first + size) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(it->first), size);
  d.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult mem_create(Driver& d, CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                    unsigned long long flags) {
  if (out == nullptr || prop == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    return prop->type == CU_MEM_ALLOCATION_TYPE_INVALID ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED;
  }
  if (CUresult r = valid_location(d, prop->location); r != CUDA_SUCCESS) return r;
  if ((prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  int dev = prop->location.id;
  // SIMCUDA_FAIL_AFTER_CREATES: the (N+1)th and later creations run out of memory.
  if (d.cfg.fail_after_creates >= 0 && d.creates.load() >= d.cfg.fail_after_creates) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (!charge(d, dev, size)) return CUDA_ERROR_OUT_OF_MEMORY;
  auto a = std::make_shared<PhysAlloc>();
  a->handle = d.new_id();
  a->size = size;
  a->device = dev;
  a->prop = *prop;
  a->prop.allocFlags.compressionType = 0;  // never granted
  a->handle_refs = 1;
  a->charged = true;
  char name[128];
  snprintf(name, sizeof name, "%s:pid=%d:id=%llu:dev=%d:ht=%u", kVmmPrefix, static_cast<int>(getpid()),
           static_cast<unsigned long long>(a->handle), dev, static_cast<unsigned>(prop->requestedHandleTypes));
  a->fd = make_memfd(name, size);
  if (a->fd < 0) {
    uncharge(d, dev, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  d.creates.fetch_add(1);
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  d.handles.emplace(a->handle, a);
  *out = a->handle;
  return CUDA_SUCCESS;
}

CUresult mem_release(Driver& d, CUmemGenericAllocationHandle h) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.handles.find(h);
  if (it == d.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  auto a = it->second;
  if (--a->handle_refs > 0) return CUDA_SUCCESS;
  d.handles.erase(it);
  // Physical memory (and its charge) goes when the handle is released and nothing maps it.
  if (a->map_count == 0) destroy_alloc(d, *a);
  return CUDA_SUCCESS;
}

CUresult mem_map(Driver& d, CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                 unsigned long long flags) {
  uintptr_t p = static_cast<uintptr_t>(ptr);
  if (flags != 0 || size == 0 || p % kGranularity != 0 || size % kGranularity != 0 || offset % kGranularity != 0 ||
      add_overflows(p, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto hit = d.handles.find(h);
  if (hit == d.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  auto a = hit->second;
  if (offset > a->size || size > a->size - offset) return CUDA_ERROR_INVALID_VALUE;
  auto r = containing(d.reservations, p);
  if (r == d.reservations.end() || p + size > r->first + r->second.size) return CUDA_ERROR_INVALID_VALUE;
  auto next = d.mappings.lower_bound(p);
  if (next != d.mappings.end() && next->first < p + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != d.mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > p) return CUDA_ERROR_INVALID_VALUE;
  }
  // No access until cuMemSetAccess, as with the driver.
  if (mmap(reinterpret_cast<void*>(p), size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, static_cast<off_t>(offset)) ==
      MAP_FAILED) {
    unback(p, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  MapGroup g;
  g.size = size;
  g.offset = offset;
  g.alloc = a;
  g.id = d.new_id();
  g.access.resize(size / kGranularity);
  d.mappings.emplace(p, std::move(g));
  ++a->map_count;
  return CUDA_SUCCESS;
}

CUresult mem_unmap(Driver& d, CUdeviceptr ptr, size_t size) {
  uintptr_t p = static_cast<uintptr_t>(ptr);
  if (size == 0 || add_overflows(p, size)) return CUDA_ERROR_INVALID_VALUE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  // The range must consist of whole cuMemMap ranges, back to back.
  auto first = d.mappings.find(p);
  if (first == d.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  auto last = first;
  uintptr_t cur = p;
  while (last != d.mappings.end() && last->first == cur && cur < p + size) {
    cur += last->second.size;
    ++last;
  }
  if (cur != p + size) return CUDA_ERROR_INVALID_VALUE;
  if (!unback(p, size)) return CUDA_ERROR_UNKNOWN;
  for (auto it = first; it != last;) {
    auto a = it->second.alloc;
    it = d.mappings.erase(it);
    if (--a->map_count == 0 && a->handle_refs == 0) destroy_alloc(d, *a);
  }
  return CUDA_SUCCESS;
}

CUresult mem_set_access(Driver& d, CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  uintptr_t p = static_cast<uintptr_t>(ptr);
  if (desc == nullptr || count == 0 || size == 0 || p % kGranularity != 0 || size % kGranularity != 0 ||
      add_overflows(p, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (size_t i = 0; i < count; ++i) {
    if (CUresult r = valid_location(d, desc[i].location); r != CUDA_SUCCESS) return r;
    unsigned f = desc[i].flags;
    if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
        f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  uintptr_t end = p + size;
  auto first = containing(d.mappings, p);
  for (auto it = first;; ++it) {  // validate the whole range before changing anything
    if (it == d.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
    if (it != first && it->first != std::prev(it)->first + std::prev(it)->second.size) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    if (it->first + it->second.size >= end) break;
  }
  for (auto it = first; it != d.mappings.end() && it->first < end; ++it) {
    MapGroup& g = it->second;
    size_t lo = (std::max(p, it->first) - it->first) / kGranularity;
    size_t hi = (std::min(end, it->first + g.size) - 1 - it->first) / kGranularity;
    for (size_t i = lo; i <= hi; ++i) {
      for (size_t k = 0; k < count; ++k) {
        uint64_t bit = uint64_t{1} << desc[k].location.id;
        g.access[i].read =
            desc[k].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE ? g.access[i].read | bit : g.access[i].read & ~bit;
        g.access[i].write =
            desc[k].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? g.access[i].write | bit : g.access[i].write & ~bit;
      }
    }
    if (!protect_group(it->first, g, lo, hi)) return CUDA_ERROR_UNKNOWN;
  }
  return CUDA_SUCCESS;
}

CUresult mem_get_access(Driver& d, unsigned long long* flags, const CUmemLocation* loc, CUdeviceptr p) {
  if (flags == nullptr || loc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = valid_location(d, *loc); r != CUDA_SUCCESS) return r;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = containing(d.mappings, static_cast<uintptr_t>(p));
  if (it == d.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  const Access& a = it->second.access[(static_cast<uintptr_t>(p) - it->first) / kGranularity];
  uint64_t bit = uint64_t{1} << loc->id;
  *flags = (a.write & bit) != 0  ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
           : (a.read & bit) != 0 ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                 : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  return CUDA_SUCCESS;
}

CUresult mem_granularity(Driver& d, size_t* out, const CUmemAllocationProp* prop,
                         CUmemAllocationGranularity_flags option) {
  if (out == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (CUresult r = valid_location(d, prop->location); r != CUDA_SUCCESS) return r;
  *out = kGranularity;
  return CUDA_SUCCESS;
}

CUresult mem_properties(Driver& d, CUmemAllocationProp* out, CUmemGenericAllocationHandle h) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.handles.find(h);
  if (it == d.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  *out = it->second->prop;
  return CUDA_SUCCESS;
}

CUresult mem_retain_handle(Driver& d, CUmemGenericAllocationHandle* out, void* addr) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = containing(d.mappings, reinterpret_cast<uintptr_t>(addr));
  if (it == d.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  auto a = it->second.alloc;
  // A mapping outlives a released handle; retaining gives the same handle value back.
  if (a->handle_refs++ == 0) d.handles.emplace(a->handle, a);
  *out = a->handle;
  return CUDA_SUCCESS;
}

CUresult mem_export(Driver& d, void* shareable, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                    unsigned long long flags) {
  if (shareable == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.handles.find(h);
  if (it == d.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  const PhysAlloc& a = *it->second;
  if ((a.prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) return CUDA_ERROR_INVALID_VALUE;
  int fd = fcntl(a.fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  put(shareable, fd);
  return CUDA_SUCCESS;
}

CUresult mem_import(Driver& d, CUmemGenericAllocationHandle* out, void* os_handle, CUmemAllocationHandleType type) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  // As with the driver, the fd travels in the pointer argument and stays the caller's.
  int fd = static_cast<int>(reinterpret_cast<intptr_t>(os_handle));
  char name[256];
  int pid = 0, dev = 0;
  unsigned long long id = 0;
  unsigned ht = 0;
  if (!memfd_name(fd, name, sizeof name) ||
      sscanf(name, "/memfd:simcuda-vmm:pid=%d:id=%llu:dev=%d:ht=%u", &pid, &id, &dev, &ht) != 4) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!valid_device(d, dev)) return CUDA_ERROR_INVALID_DEVICE;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) return CUDA_ERROR_INVALID_VALUE;
  auto a = std::make_shared<PhysAlloc>();
  a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (a->fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  a->handle = d.new_id();
  a->size = static_cast<size_t>(st.st_size);
  a->device = dev;
  a->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  a->prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(ht);
  a->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a->prop.location.id = dev;
  a->handle_refs = 1;
  a->charged = false;  // the creator pays for it
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  d.handles.emplace(a->handle, a);
  *out = a->handle;
  return CUDA_SUCCESS;
}

// ---- legacy IPC (cuMemAlloc memory only) ----

CUresult ipc_get(Driver& d, CUipcMemHandle* out, CUdeviceptr p) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = current_device(d, nullptr, nullptr); r != CUDA_SUCCESS) return r;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = containing(d.natives, static_cast<uintptr_t>(p));
  if (it == d.natives.end()) {
    // VMM memory is shared with cuMemExportToShareableHandle, never legacy IPC.
    return containing(d.reservations, static_cast<uintptr_t>(p)) != d.reservations.end() ? CUDA_ERROR_NOT_SUPPORTED
                                                                                         : CUDA_ERROR_INVALID_VALUE;
  }
  if (it->second.managed || it->second.pool != nullptr) return CUDA_ERROR_INVALID_VALUE;
  IpcWire w{};
  memcpy(w.magic, kIpcMagic, sizeof w.magic);
  w.pid = static_cast<int32_t>(getpid());
  w.fd = it->second.fd;
  w.id = it->second.id;
  w.size = it->second.size;
  w.device = it->second.device;
  memset(out, 0, sizeof *out);
  memcpy(out->reserved, &w, sizeof w);
  return CUDA_SUCCESS;
}

CUresult ipc_open(Driver& d, CUdeviceptr* out, CUipcMemHandle h, unsigned flags) {
  if (out == nullptr || (flags & ~static_cast<unsigned>(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUctx_st* c = nullptr;
  if (CUresult r = current_device(d, &c, nullptr); r != CUDA_SUCCESS) return r;
  IpcWire w{};
  memcpy(&w, h.reserved, sizeof w);
  if (memcmp(w.magic, kIpcMagic, sizeof w.magic) != 0 || w.size == 0) return CUDA_ERROR_INVALID_VALUE;
  if (w.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;  // the driver refuses same-process opens
  if (!valid_device(d, w.device)) return CUDA_ERROR_INVALID_DEVICE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  for (auto& [base, imp] : d.imports) {
    if (imp.pid == w.pid && imp.remote_id == w.id) {
      ++imp.refs;
      *out = static_cast<CUdeviceptr>(base);
      return CUDA_SUCCESS;
    }
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  char name[256], want[128];
  snprintf(want, sizeof want, "/memfd:%s:pid=%d:id=%llu:", kNativePrefix, w.pid, static_cast<unsigned long long>(w.id));
  size_t mapped = 0;
  if (!memfd_name(fd, name, sizeof name) || strncmp(name, want, strlen(want)) != 0 ||
      !round_up(w.size, d.page, &mapped)) {
    close(fd);
    return CUDA_ERROR_INVALID_HANDLE;  // the exporter freed it; the fd number now names something else
  }
  void* va = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (va == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  IpcImport imp;
  imp.size = mapped;
  imp.device = w.device;
  imp.pid = w.pid;
  imp.remote_id = w.id;
  imp.refs = 1;
  imp.ctx = c;
  imp.id = d.new_id();
  d.imports.emplace(reinterpret_cast<uintptr_t>(va), imp);
  *out = reinterpret_cast<CUdeviceptr>(va);
  return CUDA_SUCCESS;
}

CUresult ipc_close(Driver& d, CUdeviceptr p) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.imports.find(static_cast<uintptr_t>(p));
  if (it == d.imports.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs > 0) return CUDA_SUCCESS;
  munmap(reinterpret_cast<void*>(it->first), it->second.size);
  d.imports.erase(it);
  return CUDA_SUCCESS;
}

// ---- host memory ----

CUresult host_alloc(Driver& d, void** out, size_t bytes, unsigned flags) {
  if (out == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUctx_st* c = nullptr;
  if (CUresult r = current_device(d, &c, nullptr); r != CUDA_SUCCESS) return r;
  size_t n = 0;
  if (!round_up(bytes, d.page, &n)) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  d.hosts[reinterpret_cast<uintptr_t>(p)] = HostRange{n, c, true, flags, d.new_id()};
  *out = p;
  return CUDA_SUCCESS;
}

CUresult host_free(Driver& d, void* p) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.hosts.find(reinterpret_cast<uintptr_t>(p));
  if (it == d.hosts.end() || !it->second.allocated) return CUDA_ERROR_INVALID_VALUE;
  munmap(p, it->second.size);
  d.hosts.erase(it);
  return CUDA_SUCCESS;
}

CUresult host_register(Driver& d, void* p, size_t bytes, unsigned flags) {
  if (p == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  constexpr unsigned kAll = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                            CU_MEMHOSTREGISTER_READ_ONLY;
  if ((flags & ~kAll) != 0) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* c = nullptr;
  if (CUresult r = current_device(d, &c, nullptr); r != CUDA_SUCCESS) return r;
  uintptr_t b = reinterpret_cast<uintptr_t>(p);
  if (add_overflows(b, bytes)) return CUDA_ERROR_INVALID_VALUE;
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto next = d.hosts.lower_bound(b);
  bool overlaps = (next != d.hosts.end() && next->first < b + bytes) ||
                  (next != d.hosts.begin() && std::prev(next)->first + std::prev(next)->second.size > b);
  if (overlaps) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  d.hosts[b] = HostRange{bytes, c, false, flags, d.new_id()};
  return CUDA_SUCCESS;
}

CUresult host_unregister(Driver& d, void* p) {
  std::unique_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = d.hosts.find(reinterpret_cast<uintptr_t>(p));
  if (it == d.hosts.end() || it->second.allocated) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  d.hosts.erase(it);
  return CUDA_SUCCESS;
}

CUresult host_device_pointer(Driver& d, CUdeviceptr* out, void* p, unsigned flags) {
  if (out == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  if (containing(d.hosts, reinterpret_cast<uintptr_t>(p)) == d.hosts.end()) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult host_get_flags(Driver& d, unsigned* flags, void* p) {
  if (flags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  auto it = containing(d.hosts, reinterpret_cast<uintptr_t>(p));
  if (it == d.hosts.end()) return CUDA_ERROR_INVALID_VALUE;  // neither allocated nor registered with CUDA
  *flags = it->second.flags;
  return CUDA_SUCCESS;
}

// ---- copies, sets, kernels ----

CUresult check_copy(Driver& d, uintptr_t dst, Side dst_side, uintptr_t src, Side src_side, size_t n, int dev) {
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  if (CUresult r = check_side(d, dst, dst_side, n, dev, true); r != CUDA_SUCCESS) return r;
  return check_side(d, src, src_side, n, dev, false);
}

CUresult do_copy(Driver& d, uintptr_t dst, Side dst_side, uintptr_t src, Side src_side, size_t n, int dev) {
  // Held shared for the whole copy, so the pages cannot be unmapped under it. Memory that went
  // away since the call was queued is an illegal address, as a GPU would report it.
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  if (check_side(d, dst, dst_side, n, dev, true) != CUDA_SUCCESS ||
      check_side(d, src, src_side, n, dev, false) != CUDA_SUCCESS) {
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  if (n != 0) memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}

CUresult check_device_range(Driver& d, uintptr_t p, size_t n, int dev, bool write) {
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  return check_locked(d, p, n, dev, write);
}

CUresult do_memset(Driver& d, uintptr_t p, uint32_t value, unsigned width, size_t count, int dev) {
  if (count > SIZE_MAX / width) return CUDA_ERROR_ILLEGAL_ADDRESS;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  if (check_locked(d, p, count * width, dev, true) != CUDA_SUCCESS) return CUDA_ERROR_ILLEGAL_ADDRESS;
  if (width == 1) {
    memset(reinterpret_cast<void*>(p), static_cast<int>(value & 0xff), count);
  } else if (width == 2) {
    auto* q = reinterpret_cast<uint16_t*>(p);
    std::fill(q, q + count, static_cast<uint16_t>(value));
  } else {
    auto* q = reinterpret_cast<uint32_t*>(p);
    std::fill(q, q + count, value);
  }
  return CUDA_SUCCESS;
}

CUresult do_kernel(Driver& d, Kernel k, uintptr_t p, uint32_t value, size_t count, int dev) {
  if (k == Kernel::Noop) return CUDA_SUCCESS;
  if (p % alignof(uint32_t) != 0) return CUDA_ERROR_MISALIGNED_ADDRESS;
  if (count > SIZE_MAX / sizeof(uint32_t)) return CUDA_ERROR_ILLEGAL_ADDRESS;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  if (check_locked(d, p, count * sizeof(uint32_t), dev, true) != CUDA_SUCCESS) return CUDA_ERROR_ILLEGAL_ADDRESS;
  auto* q = reinterpret_cast<uint32_t*>(p);
  if (k == Kernel::Fill) {
    std::fill(q, q + count, value);
  } else {
    for (size_t i = 0; i < count; ++i) q[i] += value;
  }
  return CUDA_SUCCESS;
}

CUresult do_nonzero_chunks(Driver& d, uintptr_t base, uint64_t bytes, uint64_t chunk, uintptr_t flags, uint64_t chunks,
                           int dev) {
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  // As on a GPU: every block reads its chunk up to `bytes`, so all of that must be readable.
  const uint64_t read = std::min<uint64_t>(bytes, chunks * chunk);
  if (check_locked(d, base, read, dev, false) != CUDA_SUCCESS ||
      check_locked(d, flags, chunks, dev, true) != CUDA_SUCCESS)
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  const auto* p = reinterpret_cast<const uint8_t*>(base);
  auto* out = reinterpret_cast<uint8_t*>(flags);
  for (uint64_t i = 0; i < chunks; ++i) {
    const uint64_t from = i * chunk, to = std::min(from + chunk, read);
    if (from < to && std::any_of(p + from, p + to, [](uint8_t b) { return b != 0; })) out[i] = 1;
  }
  return CUDA_SUCCESS;
}

bool is_mapped(Driver& d, uintptr_t p, size_t n) {
  if (n == 0) n = 1;
  if (add_overflows(p, n)) return false;
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  uintptr_t cur = p, end = p + n;
  while (cur < end) {
    if (auto it = containing(d.mappings, cur); it != d.mappings.end()) {
      cur = it->first + it->second.size;
    } else if (auto nt = containing(d.natives, cur); nt != d.natives.end()) {
      cur = nt->first + nt->second.mapped;
    } else if (auto im = containing(d.imports, cur); im != d.imports.end()) {
      cur = im->first + im->second.size;
    } else {
      return false;
    }
  }
  return true;
}

uint64_t mapped_bytes(Driver& d) {
  std::shared_lock<std::shared_mutex> lk(d.mem_mu);
  uint64_t n = 0;
  for (const auto& [b, g] : d.mappings) n += g.size;
  for (const auto& [b, a] : d.natives) n += a.mapped;
  for (const auto& [b, a] : d.imports) n += a.size;
  return n;
}

}  // namespace simcuda
