// SPDX-License-Identifier: Apache-2.0
// Registry of the device memory the shim knows about: managed (VMM-backed, pausable) allocations by
// base address, and the bytes left to the native allocator with the reason (status reports them).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_api.h"
#include "tags.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

class HostView;

// Where a chunk of an allocation goes on a pause, and comes back from on a resume.
enum class ChunkPlace : uint8_t {
  Disk = 0,  // staged and written to tmsdiskd, read back through the staging slots
  Zero = 1,  // every byte zero (zero_scan.h): nothing moves; resume sets it to zero on the device
  Host = 2,  // copied by DMA into the rank's host-tier memory (host_tier.h) and back
};

// Where chunk `i` went by `placement` (a TransferJob's place, an Allocation's placement): chunks
// past its end went to disk (an empty placement: every chunk).
inline ChunkPlace place_at(const std::vector<ChunkPlace>& placement, uint64_t i) noexcept {
  return i < placement.size() ? placement[i] : ChunkPlace::Disk;
}
// Host chunks among the first `n` of `placement` (all of them by default): a paused allocation's lie
// one after another in the host-tier memory from its host_offset, so this is also where chunk `n`'s
// would go.
inline uint64_t host_chunks(const std::vector<ChunkPlace>& placement, uint64_t n = UINT64_MAX) noexcept {
  uint64_t count = 0;
  for (uint64_t i = 0; i < placement.size() && i < n; ++i) count += placement[i] == ChunkPlace::Host;
  return count;
}

enum class AllocState : uint8_t { Resident = 0, Paused = 1 };

struct Allocation {
  uint64_t id = 0;          // stable for the allocation's life; the daemon's blob id
  CUdeviceptr base = 0;     // start of the reserved virtual range (what the application got)
  std::size_t size = 0;     // bytes the application asked for: what a pause saves
  std::size_t mapped = 0;   // size rounded up to the granularity: what is reserved and mapped
  CUcontext ctx = nullptr;  // context current when it was allocated (synchronized before a pause)
  CUdevice device = 0;
  CUmemAllocationProp prop{};               // recreated with exactly these properties on resume
  std::vector<CUmemAccessDesc> access;      // restored after every resume
  CUmemGenericAllocationHandle handle = 0;  // physical memory; 0 while paused
  // Written by the engine (under the registry's op lock), read by status.
  std::atomic<AllocState> state{AllocState::Resident};
  // Set while paused when a resume could not restore it because its backup is damaged (a
  // proto::Damage, 0: not damaged), with the first chunk that failed. Such an allocation stays
  // paused (unmapped, its file kept) while the rest of the process runs; a later resume retries it,
  // or maps zero-filled memory in its place when the loss is accepted. Written by the engine under
  // the exclusive op lock.
  std::atomic<uint8_t> damage{0};
  std::atomic<uint64_t> damaged_chunk{0};
  // Physical memory the application mapped itself (cuMemCreate + cuMemMap): `handle` is the real
  // handle behind the application's token, which vmm.cpp maps to this allocation.
  bool app_vmm = false;
  uint64_t token = 0;
  // Legacy IPC (ipc.cpp): the daemon's id for this allocation's export, 0 if never exported.
  // Written by the control thread under the exclusive op lock; read under the shared one.
  uint64_t export_id = 0;
  // Processes that have the export open (IPC_USERS): while any has, a pause leaves the allocation
  // resident and status counts it as exported.
  std::atomic<uint32_t> importers{0};
  // An Unmanaged reason once another process or device may reference the memory (exported,
  // multicast-bound, its handle handed out): it then stays resident for good and status counts it
  // as unmanaged. -1: pausable.
  std::atomic<int> pinned{-1};
  // While paused: where each chunk went (TransferJob::place; empty: every chunk to disk), and where
  // its host chunks begin in the rank's host-tier memory. Zero chunks were kept nowhere; resume sets
  // them to zero. Written and read by the engine under the exclusive op lock.
  std::vector<ChunkPlace> placement;
  uint64_t host_offset = 0;
  // After a resume while the process retains host copies (tmsdisk_retain_host_copy; TMS's
  // retain_cpu_backup): the placement it was resumed from, its host chunks still in the host-tier
  // memory, readable (paused_reader.h) while that memory holds them: until the generation of the
  // memory (HostTierClient::generation) moves on. Written and read by the engine under the exclusive
  // op lock, or on the control thread.
  std::vector<ChunkPlace> retained;
  uint64_t retained_offset = 0;
  uint64_t retained_generation = 0;
  // Its host copy at an address of its own, once a zero-copy read asked for it (host_view.h): kept
  // while it has a host copy, whatever the host-tier memory does. Only under HostViews' lock.
  std::shared_ptr<HostView> view;
  // The allocating thread's innermost tag and its policy (tags.h), for good.
  TagId tag = kUntagged;
  Policy policy = Policy::Backup;
};

struct RegistryTotals {
  uint64_t resident_bytes = 0;
  uint64_t paused_bytes = 0;
  uint32_t managed_allocations = 0;
  uint32_t paused_allocations = 0;
  uint32_t damaged_allocations = 0;  // paused allocations with a damaged backup (counted as paused too)
  uint64_t damaged_bytes = 0;
  std::array<uint64_t, proto::kUnmanagedReasons> unmanaged_bytes{};
};

// Managed allocations of one tag with one policy (tmsdisk_tags, status).
struct TagTotals {
  TagId tag = kUntagged;
  Policy policy = Policy::Backup;
  uint32_t allocations = 0;
  uint32_t paused_allocations = 0;
  uint64_t resident_bytes = 0;
  uint64_t paused_bytes = 0;
};

class Registry {
 public:
  // Takes ownership of a new managed allocation and assigns its id. Throws std::bad_alloc.
  std::shared_ptr<Allocation> add(std::unique_ptr<Allocation> a);
  // The managed allocation that contains `ptr`, or null.
  std::shared_ptr<Allocation> find(CUdeviceptr ptr) const;
  // The managed allocations that overlap [ptr, ptr + bytes), in address order.
  std::vector<std::shared_ptr<Allocation>> overlapping(CUdeviceptr ptr, std::size_t bytes) const;
  // Removes and returns the managed allocation starting exactly at `base`, or null.
  std::shared_ptr<Allocation> remove(CUdeviceptr base);
  // Every managed allocation, in address order.
  std::vector<std::shared_ptr<Allocation>> snapshot() const;
  // Keeps `a` resident for good, counted as unmanaged for `reason` (the first reason sticks).
  void pin(Allocation& a, proto::Unmanaged reason) noexcept;
  // How many processes have `a` open through legacy IPC (IPC_USERS from the daemon).
  void set_importers(Allocation& a, uint32_t importers) noexcept;

  // Native allocations, counted so status can show why they are not paused. Out of memory only
  // loses the accounting, never the allocation.
  void add_unmanaged(CUdeviceptr ptr, std::size_t bytes, proto::Unmanaged reason) noexcept;
  // Forgets a native allocation; false if the pointer was not one.
  bool remove_unmanaged(CUdeviceptr ptr) noexcept;

  RegistryTotals totals() const;
  // Per (tag, policy) of the managed allocations that can be paused, in order of first appearance.
  // Throws std::bad_alloc.
  std::vector<TagTotals> tag_totals() const;

  // Increments on every change, so the control thread can tell when to send a fresh report.
  uint64_t version() const noexcept { return version_.load(std::memory_order_relaxed); }

  // Held around fork() so the child never inherits a locked mutex.
  void lock_for_fork() noexcept { mu_.lock(); }
  void unlock_after_fork() noexcept { mu_.unlock(); }

 private:
  struct Native {
    std::size_t bytes;
    proto::Unmanaged reason;
  };
  mutable std::mutex mu_;
  std::map<CUdeviceptr, std::shared_ptr<Allocation>> managed_;
  std::unordered_map<CUdeviceptr, Native> native_;
  std::array<uint64_t, proto::kUnmanagedReasons> unmanaged_bytes_{};
  uint64_t next_id_ = 1;
  std::atomic<uint64_t> version_{0};
};

// The process-wide registry of allocations (never destroyed).
Registry& registry() noexcept;

}  // namespace tmsdisk::shim
