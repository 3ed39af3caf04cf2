// SPDX-License-Identifier: Apache-2.0
// One rank's staging buffer: a sealed memfd of `slot_count` slots, mapped by the daemon, registered
// with the I/O engine as a fixed buffer, and passed to the shim (which maps the same pages). Its one
// owner releases all three, whatever path a session ends by.
//
// Building one (the kernel zeroes and pins every page) and tearing one down (it unpins and frees
// them) take seconds for a GiB on a busy node, so neither runs on the event loop: StagingWorkers
// (staging_workers.h) does both, and a StagingPtr hands its buffer to them when it lets go of it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io_engine.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

class StagingBuffer;
class StagingWorkers;

// Faults in every page of [base, base+bytes) for writing (`what` names the memory in an error), in
// pieces, so that registering them later (io_uring, CUDA) only pins pages already there and the
// holder of the mmap lock is never held up for long. ENOMEM when the memory is not to be had.
Status fault_in(uint8_t* base, uint64_t bytes, const char* what);

// Deletes a staging buffer on a staging worker (or here, when there is none).
struct StagingRetire {
  StagingWorkers* workers = nullptr;
  void operator()(StagingBuffer* buffer) const noexcept;
};
using StagingPtr = std::unique_ptr<StagingBuffer, StagingRetire>;

class StagingBuffer {
 public:
  // Creates, sizes, seals and maps `slot_count` slots of `chunk_bytes`, faults every page in, then
  // registers them at `fixed_index` (a slot of `engine`'s fixed-buffer table that its owner claimed
  // for this buffer, see Engine::claim_buffer_slot; -1: none). Slow: call it off the event loop.
  // Not being registered is not an error: I/O then goes through plain buffers, buf_index() is -1
  // (the claimed slot is not this buffer's to release) and *not_registered says why. `engine` must
  // outlive the buffer.
  static Result<std::unique_ptr<StagingBuffer>> create(io::Engine& engine, uint32_t chunk_bytes, uint32_t slot_count,
                                                       int fixed_index, std::string* not_registered);
  // Empties its fixed-buffer slot in the kernel (from any thread), unmaps and closes. The slot of the
  // engine's table stays claimed: its owner releases it (Engine::release_buffer_slot) afterwards.
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  int memfd() const noexcept { return memfd_.get(); }
  uint8_t* base() const noexcept { return base_; }
  uint64_t bytes() const noexcept { return uint64_t{chunk_bytes_} * slot_count_; }
  uint32_t chunk_bytes() const noexcept { return chunk_bytes_; }
  uint32_t slot_count() const noexcept { return slot_count_; }
  int buf_index() const noexcept { return buf_index_; }  // the engine's fixed-buffer index, or -1

  uint8_t* slot(uint32_t i) const noexcept { return base_ + uint64_t{i} * chunk_bytes_; }
  // The first `length` bytes of slot i.
  std::span<const uint8_t> bytes_of(uint32_t i, uint32_t length) const noexcept { return {slot(i), length}; }

  // A slot is busy while the kernel may read or write it.
  bool busy(uint32_t i) const noexcept { return busy_[i] != 0; }
  void set_busy(uint32_t i, bool busy) noexcept { busy_[i] = busy ? 1 : 0; }

 private:
  StagingBuffer() = default;
  io::Engine* engine_ = nullptr;
  UniqueFd memfd_;
  uint8_t* base_ = nullptr;
  uint32_t chunk_bytes_ = 0;
  uint32_t slot_count_ = 0;
  int buf_index_ = -1;
  std::vector<uint8_t> busy_;
};

}  // namespace tmsdisk::server
