// SPDX-License-Identifier: Apache-2.0
// The staging buffer and its slots (staging_slots.h).
#include "staging_slots.h"

#include <cerrno>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {

Status StagingSlots::map(int memfd, const proto::Welcome& w) {
  release();
  if (memfd < 0 || w.chunk_bytes == 0 || w.slot_count == 0 ||
      uint64_t{w.slot_count} * w.chunk_bytes > w.staging_budget_bytes ||
      !RegisteredMapping::holds(memfd, w.staging_budget_bytes))
    return make_error(EPROTO, "tmsdiskd's WELCOME has no usable staging buffer");
  if (Status st = buffer_.map(memfd, w.staging_budget_bytes, "staging buffer"); !st) return st;
  chunk_bytes_ = w.chunk_bytes;
  slots_.assign(w.slot_count, Slot{});
  return {};
}

void StagingSlots::release() noexcept {
  if (!buffer_.mapped()) return;
  buffer_.release();
  for (Slot& s : slots_) s = Slot{};
}

void StagingSlots::forget_after_fork() noexcept {
  buffer_.forget_after_fork();
}

void StagingSlots::register_with(CUcontext ctx) noexcept {
  if (buffer_.registered() || !buffer_.mapped() || !RegisteredMapping::can_pin()) return;
  // Already registered counts as pinned: nothing to try again at the next pause.
  const CUresult r = buffer_.pin(ctx, /*already_counts=*/true);
  if (!buffer_.registered())
    TMS_LOG_ONCE(LogLevel::Warn,
                 "cannot pin the staging buffer (cuMemHostRegister failed: %s (%d)); copies will be slower",
                 cu_error_name(r), static_cast<int>(r));
}

int StagingSlots::free_slot() const noexcept {
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].state == SlotState::Free) return static_cast<int>(i);
  return -1;
}

int StagingSlots::awaiting(uint64_t request_id) const noexcept {
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].state == SlotState::InDaemon && slots_[i].request == request_id) return static_cast<int>(i);
  return -1;
}

bool StagingSlots::any(SlotState s) const noexcept {
  for (const Slot& slot : slots_)
    if (slot.state == s) return true;
  return false;
}

bool StagingSlots::answer_lost(uint64_t request_id) noexcept {
  for (Slot& s : slots_) {
    if (s.state == SlotState::Lost && s.request == request_id) {
      s = Slot{};
      return true;
    }
  }
  return false;
}

void StagingSlots::drop_daemon_held() noexcept {
  for (Slot& s : slots_)
    if (s.state == SlotState::InDaemon || s.state == SlotState::Lost) s = Slot{};
}

}  // namespace tmsdisk::shim
