// SPDX-License-Identifier: Apache-2.0
// One rank's staging buffer: a sealed memfd of `slot_count` slots, mapped by the daemon, registered
// with the I/O engine as a fixed buffer, and passed to the shim (which maps the same pages). Its one
// owner releases all three in its destructor, whatever path a session ends by.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "io_engine.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

class StagingBuffer {
 public:
  // Creates, sizes, seals and maps `slot_count` slots of `chunk_bytes`, then registers them with
  // `engine` (which must outlive the buffer). Not being registered is not an error: I/O then goes
  // through plain buffers, and the reason is logged.
  static Result<std::unique_ptr<StagingBuffer>> create(io::Engine& engine, uint32_t chunk_bytes, uint32_t slot_count,
                                                       uint64_t session_id);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  int memfd() const noexcept { return memfd_.get(); }
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
