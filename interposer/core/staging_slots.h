// SPDX-License-Identifier: Apache-2.0
// The staging buffer tmsdiskd hands the shim (a memfd, mapped here and registered with CUDA) and the
// bookkeeping of its slots: which chunk each slot holds and what it waits for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda_api.h"
#include "registered_mapping.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

enum class SlotState : uint8_t {
  Free,
  Copying,   // a copy between the device and this slot runs on the shim's stream
  InDaemon,  // the daemon holds this slot for the WRITE or READ `request`
  Lost,      // its request timed out: freed if the answer ever comes
};

struct Slot {
  SlotState state = SlotState::Free;
  uint64_t request = 0;  // id of the Write/Read the daemon holds this slot for
  int job = -1;          // index of the transfer job the chunk belongs to
  uint64_t offset = 0;   // of the chunk in its allocation
  uint32_t length = 0;
  int ctx = -1;   // index of the context whose stream copies it (TransferPipeline)
  int lane = -1;  // the pipeline lane that started it (of the run that did, also while Lost)
};

class StagingSlots {
 public:
  StagingSlots() = default;
  ~StagingSlots() { release(); }
  StagingSlots(const StagingSlots&) = delete;
  StagingSlots& operator=(const StagingSlots&) = delete;

  // Maps the buffer WELCOME describes; `memfd` is its descriptor (kept open by the caller).
  Status map(int memfd, const proto::Welcome& w);
  // Unregisters and unmaps the buffer; every slot becomes free.
  void release() noexcept;
  // A fork child: the mapping is the parent's, and so is its CUDA registration (not undone here).
  void forget_after_fork() noexcept;

  // Registers the buffer with CUDA in `ctx` once (pinned copies); a failure is logged once and
  // copies go on unpinned.
  void register_with(CUcontext ctx) noexcept;

  bool mapped() const noexcept { return buffer_.mapped(); }
  uint32_t chunk_bytes() const noexcept { return chunk_bytes_; }
  std::size_t count() const noexcept { return slots_.size(); }
  uint8_t* data(std::size_t slot) const noexcept { return buffer_.data() + slot * chunk_bytes_; }
  Slot& operator[](std::size_t slot) noexcept { return slots_[slot]; }
  const Slot& operator[](std::size_t slot) const noexcept { return slots_[slot]; }

  // A free slot, or -1.
  int free_slot() const noexcept;
  // The slot whose request the daemon answers with `request_id`, or -1 (an answer to something else).
  int awaiting(uint64_t request_id) const noexcept;
  bool any(SlotState s) const noexcept;
  // A late answer to a request that timed out frees its slot; false if no slot waited for it.
  bool answer_lost(uint64_t request_id) noexcept;
  // The connection is gone, and with it whatever the daemon held.
  void drop_daemon_held() noexcept;

 private:
  RegisteredMapping buffer_;
  uint32_t chunk_bytes_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace tmsdisk::shim
