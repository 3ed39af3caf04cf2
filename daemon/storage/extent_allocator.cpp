// SPDX-License-Identifier: Apache-2.0
// First-fit extent allocator with a coalesced free list (see extent_allocator.h).
#include "extent_allocator.h"

#include <iterator>

namespace tmsdisk::storage {

namespace {
// Offsets stay below 2^63 so that off_t (signed) can hold every one of them.
constexpr uint64_t kMaxFileEnd = uint64_t{1} << 62;
}  // namespace

ExtentAllocator::ExtentAllocator(uint64_t alignment) : alignment_(alignment == 0 ? 1 : alignment) {}

ExtentAllocator ExtentAllocator::with_free_file(uint64_t alignment, uint64_t end) {
  ExtentAllocator a(alignment);
  a.end_ = end;
  if (end > 0) {
    a.free_.emplace(0, end);
    a.free_bytes_ = end;
  }
  return a;
}

bool ExtentAllocator::valid_range(uint64_t offset, uint64_t length) const noexcept {
  return length > 0 && offset % alignment_ == 0 && length % alignment_ == 0 && offset <= end_ &&
         length <= end_ - offset;
}

std::optional<uint64_t> ExtentAllocator::allocate(uint64_t length) {
  if (length == 0 || length % alignment_ != 0 || length > kMaxFileEnd) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < length) continue;
    uint64_t offset = it->first;
    uint64_t rest = it->second - length;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + length, rest);
    free_bytes_ -= length;
    return offset;
  }
  // Nothing fits. A free extent at the end of the file still helps: grow the file only by the part
  // that is missing rather than leaving that hole behind.
  uint64_t offset = end_;
  uint64_t reused = 0;
  if (!free_.empty()) {
    auto last = std::prev(free_.end());
    if (last->first + last->second == end_) {
      offset = last->first;
      reused = last->second;
    }
  }
  if (offset > kMaxFileEnd - length) return std::nullopt;
  if (reused > 0) free_.erase(std::prev(free_.end()));
  free_bytes_ -= reused;
  end_ = offset + length;
  return offset;
}

bool ExtentAllocator::release(uint64_t offset, uint64_t length) {
  if (!valid_range(offset, length)) return false;
  uint64_t stop = offset + length;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first < stop) return false;  // overlaps a free extent
  auto prev = next == free_.begin() ? free_.end() : std::prev(next);
  if (prev != free_.end() && prev->first + prev->second > offset) return false;

  uint64_t start = offset;
  if (prev != free_.end() && prev->first + prev->second == offset) {
    start = prev->first;
    free_.erase(prev);
  }
  if (next != free_.end() && next->first == stop) {
    stop += next->second;
    free_.erase(next);
  }
  free_.emplace(start, stop - start);
  free_bytes_ += length;
  return true;
}

bool ExtentAllocator::claim(uint64_t offset, uint64_t length) {
  if (!valid_range(offset, length)) return false;
  auto it = free_.upper_bound(offset);
  if (it == free_.begin()) return false;
  --it;
  uint64_t fstart = it->first;
  uint64_t fstop = it->first + it->second;
  if (offset + length > fstop) return false;
  free_.erase(it);
  if (offset > fstart) free_.emplace(fstart, offset - fstart);
  if (offset + length < fstop) free_.emplace(offset + length, fstop - offset - length);
  free_bytes_ -= length;
  return true;
}

void ExtentAllocator::trim_tail() {
  if (free_.empty()) return;
  auto last = std::prev(free_.end());
  if (last->first + last->second != end_) return;
  end_ = last->first;
  free_bytes_ -= last->second;
  free_.erase(last);
}

}  // namespace tmsdisk::storage
