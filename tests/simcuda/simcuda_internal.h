// SPDX-License-Identifier: Apache-2.0
// simcuda internals shared by its translation units: configuration, the driver object, contexts,
// streams, events, and the tables that give host memory the shape of device memory.
#pragma once

// Compile as the driver itself: cuda.h then declares every literal exported name (cuMemAlloc_v2, the
// legacy cuCtxDestroy, cuMemcpyHtoD_v2_ptds, ...) with its real signature instead of renaming ours,
// and gives each declared entry point default visibility while the rest of the library stays hidden.
#define __CUDA_API_VERSION_INTERNAL 1
#define __CUDA_API_PUSH_VISIBILITY_DEFAULT 1
#include <cuda.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace simcuda {

inline constexpr int kMaxDevices = 64;                   // device bitmasks are one uint64_t
inline constexpr size_t kGranularity = size_t{2} << 20;  // VMM granularity, as on Hopper
inline constexpr int kDriverVersion = 13000;

struct Config {
  int device_count = 1;
  uint64_t capacity = uint64_t{1024} << 20;
  std::string state_path;
  int rdma_with_vmm = 1;
  int vmm = 1;  // 0: a device without virtual memory management (SIMCUDA_VIRTUAL_MEMORY_MANAGEMENT)
  long long fail_after_creates = -1;  // < 0: never
};

// The capacity ledger, one file mapped MAP_SHARED by every simcuda process that names it, so that
// what one process allocates is missing for the next. Lock-free, address-free atomics only.
struct Ledger {
  std::atomic<uint64_t> magic;
  std::atomic<uint64_t> used[kMaxDevices];
};

struct Driver;

struct Dep {
  std::shared_ptr<CUstream_st> stream;
  uint64_t seq;
};

// One queued stream operation. `run` is empty for markers (event records, waits).
struct Op {
  uint64_t seq = 0;
  std::vector<Dep> deps;
  std::function<CUresult()> run;
  std::shared_ptr<CUevent_st> event;
  uint64_t event_gen = 0;
  bool exit = false;
};

}  // namespace simcuda

// Opaque CUDA handle types are defined here, so a handle is a pointer to simcuda's own object. Every
// handle coming from the application is looked up in a registry before it is dereferenced.
struct CUctx_st {
  int device = 0;
  bool primary = false;
  unsigned flags = 0;
  uint64_t id = 0;
  // Guarded by Driver::ctx_mu.
  bool active = false;
  int primary_refs = 0;
  uint64_t peer_mask = 0;
  // Guarded by Driver::work_mu.
  std::shared_ptr<CUstream_st> legacy;
  std::vector<std::shared_ptr<CUstream_st>> streams;  // every live stream, legacy included
  // First asynchronous failure (an illegal address); like the real driver it poisons the context.
  std::atomic<int> sticky{CUDA_SUCCESS};
};

struct CUstream_st {
  enum class Kind { Legacy, PerThread, User };
  simcuda::Driver* driver = nullptr;
  CUctx_st* ctx = nullptr;  // contexts are never freed, so this pointer stays valid
  Kind kind = Kind::User;
  unsigned flags = 0;
  int priority = 0;
  uint64_t id = 0;
  // Guarded by Driver::work_mu.
  std::deque<simcuda::Op> queue;
  uint64_t enqueued = 0;
  uint64_t completed = 0;
  bool retired = false;
  // Stream capture is a state only (no graphs): work submitted while capturing still runs.
  std::atomic<int> capture{CU_STREAM_CAPTURE_STATUS_NONE};

  bool blocking() const {
    return kind == Kind::PerThread || (kind == Kind::User && (flags & CU_STREAM_NON_BLOCKING) == 0);
  }
};

struct CUevent_st {
  CUctx_st* ctx = nullptr;
  unsigned flags = 0;
  // Guarded by Driver::work_mu.
  std::shared_ptr<CUstream_st> stream;  // null until recorded
  uint64_t seq = 0;
  uint64_t gen = 0;
  bool stamped = false;
  std::chrono::steady_clock::time_point when;
};

namespace simcuda {

// NonzeroChunks is the shim's zero-chunk scan (interposer/core/zero_scan.cpp), run here on host
// memory with the same parameters and result as its PTX on a GPU.
enum class Kernel { Fill, Add, Noop, NonzeroChunks };

}  // namespace simcuda

struct CUfunc_st {
  simcuda::Kernel kernel;
  const char* name;
  CUmod_st* module;
};

struct CUmod_st {
  CUctx_st* ctx = nullptr;
  std::vector<std::unique_ptr<CUfunc_st>> functions;
};

namespace simcuda {

// Per-granule access of a VMM mapping: bit d set = device d may read / write.
struct Access {
  uint64_t read = 0;
  uint64_t write = 0;
};

struct PhysAlloc {
  uint64_t handle = 0;
  int fd = -1;
  size_t size = 0;
  int device = 0;
  CUmemAllocationProp prop{};
  int handle_refs = 0;   // cuMemCreate/Retain/Import minus cuMemRelease
  int map_count = 0;     // cuMemMap calls not yet unmapped
  bool charged = false;  // imported memory is charged to its creator
};

struct Reservation {
  size_t size = 0;
};

struct MapGroup {  // one cuMemMap call
  size_t size = 0;
  size_t offset = 0;
  std::shared_ptr<PhysAlloc> alloc;
  uint64_t id = 0;
  std::vector<Access> access;  // one per granule
};

struct NativeAlloc {  // cuMemAlloc_v2 / cuMemAllocPitch_v2 / cuMemAllocManaged / cuMemAllocAsync
  size_t size = 0;    // as requested
  size_t mapped = 0;  // rounded to pages, what is charged
  CUctx_st* ctx = nullptr;
  int device = 0;
  int fd = -1;
  uint64_t id = 0;
  bool managed = false;                // cuMemAllocManaged
  CUmemPoolHandle_st* pool = nullptr;  // cuMemAllocAsync: the pool it returns to when freed
};

struct IpcImport {  // cuIpcOpenMemHandle_v2
  size_t size = 0;
  int device = 0;
  int pid = 0;
  uint64_t remote_id = 0;
  int refs = 0;
  CUctx_st* ctx = nullptr;
  uint64_t id = 0;
};

struct HostRange {  // cuMemAllocHost_v2 / cuMemHostAlloc / cuMemHostRegister_v2
  size_t size = 0;
  CUctx_st* ctx = nullptr;
  bool allocated = false;
  unsigned flags = 0;
  uint64_t id = 0;
};

}  // namespace simcuda

// A device's default stream-ordered pool. Guarded by Driver::mem_mu.
struct CUmemPoolHandle_st {
  int device = 0;
  // Blocks freed by cuMemFreeAsync (in stream order), still mapped and charged, until reused by an
  // allocation of the same page-rounded size or released by cuMemPoolTrimTo.
  std::vector<std::pair<uintptr_t, simcuda::NativeAlloc>> idle;
};

namespace simcuda {

struct Driver {
  Config cfg;
  Ledger* ledger = nullptr;
  uint64_t epoch = 0;
  size_t page = 4096;
  std::atomic<uint64_t> held[kMaxDevices] = {};  // what this process has charged to the ledger
  std::atomic<long long> creates{0};
  std::atomic<uint64_t> next_id{1};

  // Contexts, modules.
  std::mutex ctx_mu;
  std::unordered_map<CUctx_st*, std::shared_ptr<CUctx_st>> contexts;  // live (primaries always)
  std::vector<std::shared_ptr<CUctx_st>> all_contexts;                // never freed
  std::vector<CUctx_st*> primaries;
  std::vector<unsigned> primary_flags;
  std::unordered_map<CUmod_st*, std::unique_ptr<CUmod_st>> modules;
  std::unordered_map<CUfunc_st*, CUmod_st*> functions;

  // Streams and events: one lock and one condition for all queues keeps ordering rules simple.
  std::mutex work_mu;
  std::condition_variable work_cv;
  std::unordered_map<CUstream_st*, std::shared_ptr<CUstream_st>> streams;  // user-created
  std::unordered_map<CUevent_st*, std::shared_ptr<CUevent_st>> events;

  // Memory tables, keyed by base address. Workers hold the lock shared while they touch device
  // memory, so an unmap (exclusive) never pulls pages out from under a running copy.
  std::shared_mutex mem_mu;
  std::map<uintptr_t, Reservation> reservations;
  std::map<uintptr_t, MapGroup> mappings;
  std::map<uintptr_t, NativeAlloc> natives;
  std::map<uintptr_t, IpcImport> imports;
  std::map<uintptr_t, HostRange> hosts;
  std::unordered_map<uint64_t, std::shared_ptr<PhysAlloc>> handles;  // handle_refs > 0
  CUmemPoolHandle_st pools[kMaxDevices];                             // default pools, by device

  uint64_t new_id() { return next_id.fetch_add(1, std::memory_order_relaxed); }
};

// ---- driver lifetime (simcuda_state.cpp) ----
Driver* driver();  // null before a successful cuInit (and in a fork child until it calls cuInit)
CUresult init(unsigned flags);
bool charge(Driver& d, int device, uint64_t bytes);
void uncharge(Driver& d, int device, uint64_t bytes);
void log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- contexts (simcuda_context.cpp) ----
CUresult current_context(Driver& d, CUctx_st** out);  // the calling thread's, active
std::shared_ptr<CUctx_st> find_context(Driver& d, CUcontext c);
void ctx_stack_push(Driver& d, CUctx_st* c);
CUctx_st* ctx_stack_top(Driver& d);
CUresult ctx_stack_pop(Driver& d, CUctx_st** out);
void ctx_stack_set(Driver& d, CUctx_st* c);
void ctx_stack_remove(Driver& d, CUctx_st* c);
CUresult create_context(Driver& d, int device, unsigned flags, CUctx_st** out);
CUresult destroy_context(Driver& d, CUcontext c);
CUresult primary_retain(Driver& d, int device, CUctx_st** out);
CUresult primary_release(Driver& d, int device);
CUresult primary_reset(Driver& d, int device);
bool valid_device(Driver& d, int device);

// ---- streams, events, kernels (simcuda_stream.cpp) ----
std::shared_ptr<CUstream_st> new_stream(Driver& d, CUctx_st* ctx, CUstream_st::Kind kind, unsigned flags, int priority);
void retire_streams(Driver& d, CUctx_st* ctx);  // waits for their work first
CUresult resolve_stream(Driver& d, CUstream h, bool ptds, std::shared_ptr<CUstream_st>* out);
CUresult enqueue(Driver& d, const std::shared_ptr<CUstream_st>& s, Op op, uint64_t* seq = nullptr);
// Enqueues `run` and waits for it: the synchronous API calls run on the default stream's worker.
CUresult run_sync(Driver& d, const std::shared_ptr<CUstream_st>& s, std::function<CUresult()> run);
void wait_stream(Driver& d, const std::shared_ptr<CUstream_st>& s);
CUresult sync_context(Driver& d, CUctx_st* ctx);
CUresult query_stream(Driver& d, const std::shared_ptr<CUstream_st>& s);
CUresult destroy_stream(Driver& d, CUstream h);
std::shared_ptr<CUevent_st> find_event(Driver& d, CUevent e);
CUresult event_create(Driver& d, CUevent* out, unsigned flags);
CUresult event_record(Driver& d, CUevent e, CUstream h, bool ptds);
CUresult event_query(Driver& d, CUevent e);
CUresult event_sync(Driver& d, CUevent e);
CUresult event_destroy(Driver& d, CUevent e);
CUresult event_elapsed(Driver& d, float* ms, CUevent a, CUevent b);
CUresult stream_wait_event(Driver& d, CUstream h, CUevent e, bool ptds);
CUresult module_load(Driver& d, CUmodule* out, const void* image);
CUresult module_unload(Driver& d, CUmodule m);
void unload_context_modules(Driver& d, CUctx_st* ctx);
CUresult module_get_function(Driver& d, CUfunction* out, CUmodule m, const char* name);
CUresult launch_kernel(Driver& d, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, CUstream h, void** params, void** extra, bool ptds);

// ---- memory (simcuda_memory.cpp) ----
CUresult mem_alloc(Driver& d, CUdeviceptr* out, size_t bytes);
CUresult mem_alloc_pitch(Driver& d, CUdeviceptr* out, size_t* pitch, size_t width, size_t height, unsigned elem);
CUresult mem_free(Driver& d, CUdeviceptr p);
CUresult mem_alloc_managed(Driver& d, CUdeviceptr* out, size_t bytes, unsigned flags);
CUresult default_mem_pool(Driver& d, CUmemoryPool* out, int device);
CUresult mem_alloc_async(Driver& d, CUdeviceptr* out, size_t bytes, CUstream h, bool ptds);
CUresult mem_free_async(Driver& d, CUdeviceptr p, CUstream h, bool ptds);
CUresult mem_pool_trim(Driver& d, CUmemoryPool pool, size_t keep);
void free_context_memory(Driver& d, CUctx_st* ctx);
CUresult mem_get_info(Driver& d, size_t* free_bytes, size_t* total_bytes);
CUresult mem_get_address_range(Driver& d, CUdeviceptr* base, size_t* size, CUdeviceptr p);
CUresult pointer_get_attribute(Driver& d, void* data, CUpointer_attribute attr, CUdeviceptr p, bool lenient);
CUresult address_reserve(Driver& d, CUdeviceptr* out, size_t size, size_t alignment, CUdeviceptr hint,
                         unsigned long long flags);
CUresult address_free(Driver& d, CUdeviceptr p, size_t size);
CUresult mem_create(Driver& d, CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                    unsigned long long flags);
CUresult mem_release(Driver& d, CUmemGenericAllocationHandle h);
CUresult mem_map(Driver& d, CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                 unsigned long long flags);
CUresult mem_unmap(Driver& d, CUdeviceptr p, size_t size);
CUresult mem_set_access(Driver& d, CUdeviceptr p, size_t size, const CUmemAccessDesc* desc, size_t count);
CUresult mem_get_access(Driver& d, unsigned long long* flags, const CUmemLocation* loc, CUdeviceptr p);
CUresult mem_granularity(Driver& d, size_t* out, const CUmemAllocationProp* prop,
                         CUmemAllocationGranularity_flags option);
CUresult mem_properties(Driver& d, CUmemAllocationProp* out, CUmemGenericAllocationHandle h);
CUresult mem_retain_handle(Driver& d, CUmemGenericAllocationHandle* out, void* addr);
CUresult mem_export(Driver& d, void* shareable, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                    unsigned long long flags);
CUresult mem_import(Driver& d, CUmemGenericAllocationHandle* out, void* os_handle, CUmemAllocationHandleType type);
CUresult ipc_get(Driver& d, CUipcMemHandle* out, CUdeviceptr p);
CUresult ipc_open(Driver& d, CUdeviceptr* out, CUipcMemHandle h, unsigned flags);
CUresult ipc_close(Driver& d, CUdeviceptr p);
CUresult host_alloc(Driver& d, void** out, size_t bytes, unsigned flags);
CUresult host_free(Driver& d, void* p);
CUresult host_register(Driver& d, void* p, size_t bytes, unsigned flags);
CUresult host_unregister(Driver& d, void* p);
CUresult host_device_pointer(Driver& d, CUdeviceptr* out, void* p, unsigned flags);
CUresult host_get_flags(Driver& d, unsigned* flags, void* p);

// Copies and sets. `dev` is the device that executes them (the stream's).
enum class Side { Host, Device, Unified };
CUresult check_copy(Driver& d, uintptr_t dst, Side dst_side, uintptr_t src, Side src_side, size_t n, int dev);
CUresult do_copy(Driver& d, uintptr_t dst, Side dst_side, uintptr_t src, Side src_side, size_t n, int dev);
CUresult check_device_range(Driver& d, uintptr_t p, size_t n, int dev, bool write);
CUresult do_memset(Driver& d, uintptr_t p, uint32_t value, unsigned width, size_t count, int dev);
CUresult do_kernel(Driver& d, Kernel k, uintptr_t p, uint32_t value, size_t count, int dev);
// tmsdisk_nonzero_chunks over `chunks` chunks (the grid): flags[i] = 1 when chunk i of
// [base, base + bytes) holds a non-zero byte.
CUresult do_nonzero_chunks(Driver& d, uintptr_t base, uint64_t bytes, uint64_t chunk, uintptr_t flags, uint64_t chunks,
                           int dev);
bool is_mapped(Driver& d, uintptr_t p, size_t n);
uint64_t mapped_bytes(Driver& d);

}  // namespace simcuda
