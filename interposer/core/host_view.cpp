// SPDX-License-Identifier: Apache-2.0
// Views of host copies at addresses of their own (host_view.h).
#include "host_view.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "driver.h"
#include "host_copy.h"
#include "log.h"

namespace tmsdisk::shim {
namespace {

uint64_t page_bytes() noexcept {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

Error mmap_error(const char* what) {
  const int e = errno;
  return make_error(e, fmt::format("cannot map a view of the host copy ({})", what));  // describe() adds strerror
}

}  // namespace

Result<std::unique_ptr<HostView>> HostView::reserve(uint64_t bytes) {
  const uint64_t page = page_bytes();
  bytes = (bytes + page - 1) / page * page;
  void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return mmap_error("address space");
  return std::unique_ptr<HostView>(new HostView(static_cast<uint8_t*>(p), bytes));
}

HostView::~HostView() {
  unpin();
  ::munmap(base_, bytes_);
}

Status HostView::show(int tier_fd, uint64_t tier_offset, const std::vector<ChunkPlace>& placement, uint32_t chunk,
                      CUcontext ctx) {
  unpin();
  ctx_ = ctx;
  private_ = false;
  if (chunk == 0 || chunk % page_bytes() != 0 || tier_offset % page_bytes() != 0) {
    hide();
    return make_error(EINVAL, "the host copy's chunks are not whole pages: no view of it");
  }
  chunk_ = chunk;
  const uint64_t chunks = (bytes_ + chunk - 1) / chunk;
  shown_.assign(chunks, ChunkPlace::Disk);
  uint64_t host_index = 0;
  // Runs of chunks of one kind, each one mapping: a run of host chunks lies one after another in the tier.
  for (uint64_t first = 0; first < chunks;) {
    const ChunkPlace kind = place_at(placement, first);
    uint64_t end = first + 1;
    while (end < chunks && place_at(placement, end) == kind) ++end;
    uint8_t* at = base_ + first * chunk;
    const uint64_t length = std::min(end * uint64_t{chunk}, bytes_) - first * chunk;
    void* p = MAP_FAILED;
    switch (kind) {
      case ChunkPlace::Host:
        p = ::mmap(at, length, PROT_READ, MAP_SHARED | MAP_FIXED, tier_fd,
                   static_cast<off_t>(tier_offset + host_index * chunk));
        host_index += end - first;
        break;
      case ChunkPlace::Zero:  // zero pages, never written
        p = ::mmap(at, length, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        break;
      case ChunkPlace::Disk:
        p = ::mmap(at, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        break;
    }
    if (p == MAP_FAILED) {
      Error e = mmap_error(kind == ChunkPlace::Host ? "host-tier memory" : "zero pages");
      hide();
      return e;
    }
    std::fill(shown_.begin() + static_cast<std::ptrdiff_t>(first), shown_.begin() + static_cast<std::ptrdiff_t>(end),
              kind);
    first = end;
  }
  pin();
  return {};
}

Status HostView::keep_private() {
  if (private_) return {};
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return mmap_error("memory of its own");
  auto* copy = static_cast<uint8_t*>(p);
  for (uint64_t c = 0; c < shown_.size(); ++c)
    if (shown_[c] == ChunkPlace::Host) {  // zero chunks: the new memory is zero already
      const uint64_t from = c * chunk_;
      std::memcpy(copy + from, base_ + from, std::min(uint64_t{chunk_}, bytes_ - from));
    }
  unpin();
  // In one step: the address never shows nothing, nor anything else.
  if (::mremap(copy, bytes_, bytes_, MREMAP_MAYMOVE | MREMAP_FIXED, base_) == MAP_FAILED) {
    Error e = mmap_error("moving its copy in place");
    ::munmap(copy, bytes_);
    pin();
    return e;
  }
  private_ = true;
  for (uint64_t c = 0; c < shown_.size(); ++c) {
    const uint64_t from = c * chunk_;
    ::mprotect(base_ + from, std::min(uint64_t{chunk_}, bytes_ - from),
               shown_[c] == ChunkPlace::Disk ? PROT_NONE : PROT_READ);
  }
  pin();
  return {};
}

bool HostView::readable(uint64_t offset, uint64_t length) const noexcept {
  if (chunk_ == 0 || length == 0 || offset >= bytes_ || length > bytes_ - offset) return false;
  for (uint64_t c = offset / chunk_; c * chunk_ < offset + length; ++c)
    if (shown_[c] == ChunkPlace::Disk) return false;
  return true;
}

void HostView::pin() noexcept {
  const DriverApi& api = driver().api;
  if (registered_ || !api.cuMemHostRegister_v2 || shown_.empty() ||
      std::find(shown_.begin(), shown_.end(), ChunkPlace::Disk) != shown_.end())
    return;
  CtxScope scope(api, ctx_);
  const CUresult r =
      api.cuMemHostRegister_v2(base_, bytes_, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
  registered_ = r == CUDA_SUCCESS;
  if (!registered_)
    TMS_DEBUG("a view of a host copy is not pinned (CUresult %d): copies from it go through the driver's buffers",
              static_cast<int>(r));
}

void HostView::unpin() noexcept {
  if (!registered_) return;
  const DriverApi& api = driver().api;
  CtxScope scope(api, ctx_);
  if (api.cuMemHostUnregister) api.cuMemHostUnregister(base_);
  registered_ = false;
}

void HostView::hide() noexcept {
  unpin();
  ::mmap(base_, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  std::fill(shown_.begin(), shown_.end(), ChunkPlace::Disk);
}

// ---------------------------------------------------------------------------------------------

Result<const uint8_t*> HostViews::of(const std::shared_ptr<Allocation>& a, uint64_t offset, uint64_t length,
                                     int tier_fd, uint64_t tier_offset, const std::vector<ChunkPlace>& placement,
                                     uint32_t chunk) {
  std::lock_guard lock(mu_);
  // A view made earlier may show as on disk what a prefetch has since brought into the tier.
  const bool fresh = !a->view || (!a->view->readable(offset, length) && a->state.load() == AllocState::Paused);
  if (fresh) {
    if (!a->view) {
      Result<std::unique_ptr<HostView>> made = HostView::reserve(a->size);
      if (!made) return std::move(made).error();
      a->view = std::move(*made);
      std::erase_if(viewed_, [](const std::weak_ptr<Allocation>& w) { return w.expired(); });
      viewed_.push_back(a);
    }
    if (Status st = a->view->show(tier_fd, tier_offset, placement, chunk, a->ctx); !st) {
      a->view.reset();
      return std::move(st).error();
    }
  }
  if (!a->view->readable(offset, length))
    return make_error(ENODATA, "part of the range lies on disk, not in the host tier: read it by copy");
  return a->view->data() + offset;
}

void HostViews::moved(Allocation& a, int tier_fd, uint32_t chunk) noexcept {
  std::lock_guard lock(mu_);
  if (!a.view) return;
  if (Status st = a.view->show(tier_fd, a.host_offset, a.placement, chunk, a.ctx); !st) {
    TMS_WARN("the view of the allocation at %#llx is gone (%s)", static_cast<unsigned long long>(a.base),
             st.error().message.c_str());
    a.view.reset();
  }
}

void HostViews::before_tier_reuse() noexcept {
  std::lock_guard lock(mu_);
  for (const std::weak_ptr<Allocation>& w : viewed_) {
    std::shared_ptr<Allocation> a = w.lock();
    if (!a || !a->view || a->state.load() != AllocState::Resident) continue;
    if (Status st = a->view->keep_private(); !st) {
      TMS_WARN("the retained copy of the allocation at %#llx is gone with the host-tier memory it lay in (%s)",
               static_cast<unsigned long long>(a->base), st.error().message.c_str());
      a->view.reset();
    }
  }
}

void HostViews::drop(Allocation& a) noexcept {
  std::lock_guard lock(mu_);
  a.view.reset();
}

bool HostViews::has(const Allocation& a) {
  std::lock_guard lock(mu_);
  return a.view != nullptr;
}

bool HostViews::copy(const Allocation& a, uint64_t offset, uint64_t length, uint8_t* dst) {
  std::lock_guard lock(mu_);
  if (!a.view || !a.view->readable(offset, length)) return false;
  HostCopies copies;
  copies.add(dst, a.view->data() + offset, length);
  copies.start();
  return true;
}

}  // namespace tmsdisk::shim
