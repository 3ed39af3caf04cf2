// SPDX-License-Identifier: Apache-2.0
// Views of a paused allocation's host copy at an address of their own (tmsdisk_paused_view; TMS's
// get_cpu_backup(x, zero_copy=True)), which stays the same for as long as the allocation has a host
// copy: while paused, after a resume that retains the copy (tmsdisk_retain_host_copy), and across its
// later pauses, whatever part of the host-tier memory each pause puts its chunks in. It goes when the
// allocation is freed or resumed without retaining, as TMS's pinned backup does.
//
// A view is a range of the process's address space as long as the allocation, in which each chunk
// shows what the allocation's placement says: its host-tier chunk (the tier's memfd mapped again
// there, read-only: no copy), zero pages, or no access for a chunk on disk. Where every chunk is
// readable the view is pinned with CUDA (read-only registration), as TMS's backup is pinned memory:
// copies from it go by DMA, and cudaHostGetFlags knows it until it goes. Before the host-tier memory
// under a resumed allocation's view is used again (the next pause, a prefetch, memory given back),
// the view's bytes are copied into memory of its own at the same address (keep_private).
//
// The views live on the control thread (made by a read, moved by a pause, kept before the tier is
// reused, dropped by a non-retaining resume) and in cuMemFree (dropped): HostViews serializes them.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda_api.h"
#include "registry.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

class HostView {
 public:
  // Reserves `bytes` (rounded up to whole pages) of address space, no access yet.
  static Result<std::unique_ptr<HostView>> reserve(uint64_t bytes);
  ~HostView();
  HostView(const HostView&) = delete;
  HostView& operator=(const HostView&) = delete;

  // Shows `placement` (chunks of `chunk` bytes): host chunks from `tier_fd`, the allocation's lying
  // one after another from `tier_offset`; zero chunks as zero pages; disk chunks not at all. Pinned
  // in `ctx` when every chunk is readable. On failure the view shows nothing (no access).
  Status show(int tier_fd, uint64_t tier_offset, const std::vector<ChunkPlace>& placement, uint32_t chunk,
              CUcontext ctx);
  // What it shows, copied into anonymous memory of its own mapped in its place (same address, same
  // access, pinned again): the memory it showed may now be overwritten. Nothing to do once private.
  Status keep_private();

  const uint8_t* data() const noexcept { return base_; }
  // Whether [offset, offset + length) shows the allocation's bytes (no chunk of it on disk).
  bool readable(uint64_t offset, uint64_t length) const noexcept;

 private:
  HostView(uint8_t* base, uint64_t bytes) : base_(base), bytes_(bytes) {}
  void unpin() noexcept;
  void pin() noexcept;
  // The view made inaccessible (after a failure midway: it then shows nothing rather than a mix).
  void hide() noexcept;

  uint8_t* base_;
  uint64_t bytes_;
  uint32_t chunk_ = 0;
  std::vector<ChunkPlace> shown_;  // per chunk (Disk: no access)
  bool private_ = false;           // keep_private() copied it: it no longer shows host-tier memory
  bool registered_ = false;
  CUcontext ctx_ = nullptr;
};

// The process's views, one per allocation at most (Allocation::view).
class HostViews {
 public:
  // The view of `a`'s host copy: the one it has, else one made to show `placement` (op lock held;
  // the control thread). ENODATA where a chunk of [offset, offset + length) lies on disk.
  Result<const uint8_t*> of(const std::shared_ptr<Allocation>& a, uint64_t offset, uint64_t length, int tier_fd,
                            uint64_t tier_offset, const std::vector<ChunkPlace>& placement, uint32_t chunk);
  // A pause moved `a`'s host copy: its view (if any) shows where it is now (dropped if it cannot).
  void moved(Allocation& a, int tier_fd, uint32_t chunk) noexcept;
  // The host-tier memory is about to be used again or given back: the views of resident allocations
  // (retained copies) keep their bytes in memory of their own. Paused allocations' chunks stay where
  // they are.
  void before_tier_reuse() noexcept;
  // `a` is freed, or resumed without retaining its copy: its view goes (the address with it).
  void drop(Allocation& a) noexcept;
  // Whether `a` has a view.
  bool has(const Allocation& a);
  // Copies [offset, offset + length) of `a`'s view into dst; false when it has no view, or the view
  // does not show all of it.
  bool copy(const Allocation& a, uint64_t offset, uint64_t length, uint8_t* dst);

 private:
  std::mutex mu_;
  std::vector<std::weak_ptr<Allocation>> viewed_;  // allocations with a view (some may be gone)
};

}  // namespace tmsdisk::shim
