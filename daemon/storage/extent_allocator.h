// SPDX-License-Identifier: Apache-2.0
// ExtentAllocator: first-fit allocation of aligned byte ranges inside one growing data file.
//
// The file is [0, end()); everything in it is either handed out or on the free list. The free list
// is kept coalesced (no two free extents touch), so freeing a blob's extent and allocating one of the
// same size later reuses the same bytes and the file stops growing once a rank's working set is
// known. The allocator is plain data: copying it is how reserve() gets all-or-nothing semantics
// (plan on a copy, keep the original on failure).
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace tmsdisk::storage {

class ExtentAllocator {
 public:
  explicit ExtentAllocator(uint64_t alignment);

  // A file whose [0, end) is entirely free (rebuilding from a manifest: claim() the used extents).
  static ExtentAllocator with_free_file(uint64_t alignment, uint64_t end);

  // Offset of a new extent of `length` bytes (a non-zero multiple of the alignment): the first free
  // extent that fits, else the free extent touching the end of the file grown to fit, else the end
  // of the file. nullopt only if length is invalid or the file would overflow 2^63.
  std::optional<uint64_t> allocate(uint64_t length);

  // Returns [offset, offset+length) to the free list, merged with its neighbours. False (and nothing
  // changes) if the range is misaligned, empty, past the end or overlaps free space: that is a bug
  // in the caller, never a state to corrupt silently.
  bool release(uint64_t offset, uint64_t length);

  // Marks a free range as used (rebuilding the allocator from a manifest). False if any of it is
  // not free.
  bool claim(uint64_t offset, uint64_t length);

  // Drops a free extent that touches the end of the file, so the file can be truncated there.
  void trim_tail();

  uint64_t alignment() const noexcept { return alignment_; }
  uint64_t end() const noexcept { return end_; }
  uint64_t free_bytes() const noexcept { return free_bytes_; }
  uint64_t used_bytes() const noexcept { return end_ - free_bytes_; }
  // offset -> length, in offset order, coalesced.
  const std::map<uint64_t, uint64_t>& free_extents() const noexcept { return free_; }

 private:
  bool valid_range(uint64_t offset, uint64_t length) const noexcept;

  uint64_t alignment_;
  uint64_t end_ = 0;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> free_;
};

}  // namespace tmsdisk::storage
