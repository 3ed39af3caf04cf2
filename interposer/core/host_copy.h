// SPDX-License-Identifier: Apache-2.0
// Copies out of host memory the process already has mapped (the host tier's segments, a view of a
// host copy) into memory its caller has just allocated: a weight sync of a paused trainer reads GiBs
// this way (tmsdisk_read_paused, torch_memory_saver's get_cpu_backup). One memcpy on one thread moved
// 1.4 GB/s on the H200, where torch's parallel copy out of pinned memory moves 11–22: the cost is the
// first touch of each of the caller's fresh pages, not the bytes, and page faults are taken in parallel.
// So slices of at least 4 MiB are copied on threads of their own, up to one per core (16 on an H200
// node: 8.9 GB/s there by plain memcpy into fresh pages, 1.6 on one thread). Populating the pages ahead
// (MADV_POPULATE_WRITE) did worse in parallel (2.3 GB/s on 8 threads, bench/RESULTS.md, session 4),
// so copies fault their pages in themselves; it serves memory that something else fills later (a read
// from disk, copied out of the staging slots on the control thread), populated here ahead of it.
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
  static constexpr unsigned kMaxThreads = 16;

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
