// SPDX-License-Identifier: Apache-2.0
// Host-to-host copies into fresh memory, in parallel slices (host_copy.h).
#include "host_copy.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace tmsdisk::shim {
namespace {

// Populates the whole pages inside [to, to + length) for writing in one call: no fault per page.
// Refused on kernels before 5.14 (EINVAL) and on memory that cannot be populated so: the writer then
// faults the pages in itself, as it would have anyway.
void populate_pages(uint8_t* to, uint64_t length) noexcept {
#ifdef MADV_POPULATE_WRITE
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t lo = (reinterpret_cast<uint64_t>(to) + page - 1) & ~(page - 1);
  const uint64_t hi = (reinterpret_cast<uint64_t>(to) + length) & ~(page - 1);
  if (lo < hi) (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
#else
  (void)to;
  (void)length;
#endif
}

}  // namespace

void HostCopies::add(uint8_t* to, const uint8_t* from, uint64_t length) {
  push({to, from, length, from ? Kind::Copy : Kind::Zero});
}

void HostCopies::populate(uint8_t* to, uint64_t length) {
  push({to, nullptr, length, Kind::Populate});
}

void HostCopies::push(Part p) {
  if (p.length == 0) return;
  Part* last = parts_.empty() ? nullptr : &parts_.back();
  if (last && last->kind == p.kind && last->to + last->length == p.to &&
      (p.kind != Kind::Copy || last->from + last->length == p.from))
    last->length += p.length;
  else
    parts_.push_back(p);
  total_ += p.length;
}

void HostCopies::copy_slice(uint64_t begin, uint64_t end) const noexcept {
  uint64_t at = 0;
  for (const Part& p : parts_) {
    const uint64_t lo = std::max(begin, at), hi = std::min(end, at + p.length);
    if (lo < hi) {
      uint8_t* to = p.to + (lo - at);
      if (p.kind == Kind::Copy)
        std::memcpy(to, p.from + (lo - at), hi - lo);
      else if (p.kind == Kind::Zero)
        std::memset(to, 0, hi - lo);
      else
        populate_pages(to, hi - lo);
    }
    at += p.length;
    if (at >= end) break;
  }
}

void HostCopies::start() noexcept {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const auto count = static_cast<unsigned>(std::clamp<uint64_t>(total_ / kMinSlice, 1, std::min(kMaxThreads, cores)));
  const uint64_t slice = (total_ + count - 1) / count;
  uint64_t begin = 0;
  if (count > 1) {
    try {
      threads_.reserve(count);
      for (; begin < total_; begin += slice)
        threads_.emplace_back([this, begin, end = std::min(total_, begin + slice)] { copy_slice(begin, end); });
    } catch (...) {  // no thread (or no memory for one): what is left, here
    }
  }
  if (begin < total_) copy_slice(begin, total_);
}

void HostCopies::wait() noexcept {
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

}  // namespace tmsdisk::shim
