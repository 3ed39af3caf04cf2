// SPDX-License-Identifier: Apache-2.0
// Copies out of host memory the process already has mapped (the host tier's segments, a view of a
// host copy) into memory its caller has just allocated: a weight sync of a paused trainer reads GiBs
// this way (tmsdisk_read_paused, torch_memory_saver's get_cpu_backup). One memcpy on one thread moved
// 1.4 GB/s on the H200, where torch's parallel copy out of pinned memory moves 10–13: the cost is the
// first touch of each of the caller's fresh pages, not the bytes. So the destination's pages are
// populated by the kernel a slice at a time (MADV_POPULATE_WRITE; where refused, the copy faults them
// in as before), and slices of at least 4 MiB run on threads of their own. Memory that something else
// fills later (a read from disk, copied out of the staging slots on the control thread) can be
// populated here alone, ahead of it.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

namespace tmsdisk::shim {

class HostCopies {
 public:
  HostCopies() = default;
  HostCopies(const HostCopies&) = delete;
  HostCopies& operator=(const HostCopies&) = delete;
  ~HostCopies() { wait(); }

  // `length` bytes from `from` to `to`; from == nullptr writes zeros. Adjacent parts merge. May throw
  // std::bad_alloc (before anything is copied).
  void add(uint8_t* to, const uint8_t* from, uint64_t length);
  // Populates the pages of [to, to + length) only: their bytes are written by someone else, who then
  // finds them in place instead of faulting each one in. Safe while that writer runs.
  void populate(uint8_t* to, uint64_t length);

  // Starts copying: on up to kMaxThreads threads, the last slice on the calling thread's behalf when
  // no thread can be had; returns at once. Call once, after the last add().
  void start() noexcept;
  // Returns once every byte is in place.
  void wait() noexcept;

  uint64_t bytes() const noexcept { return total_; }

  static constexpr uint64_t kMinSlice = uint64_t{4} << 20;  // below this a thread costs more than it saves
  static constexpr unsigned kMaxThreads = 8;

 private:
  enum class Kind : uint8_t { Copy, Zero, Populate };
  struct Part {
    uint8_t* to;
    const uint8_t* from;  // Copy only
    uint64_t length;
    Kind kind;
  };
  void push(Part p);
  // The bytes [begin, end) of the parts laid end to end.
  void copy_slice(uint64_t begin, uint64_t end) const noexcept;

  std::vector<Part> parts_;
  uint64_t total_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace tmsdisk::shim
