// SPDX-License-Identifier: Apache-2.0
// The staging buffer and its slots (staging_slots.h).
#include "staging_slots.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {

Status StagingSlots::map(int memfd, const proto::Welcome& w) {
  release();
  struct stat st {};
  if (memfd < 0 || w.chunk_bytes == 0 || w.slot_count == 0 ||
      uint64_t{w.slot_count} * w.chunk_bytes > w.staging_budget_bytes || ::fstat(memfd, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < w.staging_budget_bytes)
    return make_error(EPROTO, "tmsdiskd's WELCOME has no usable staging buffer");
  void* p = ::mmap(nullptr, w.staging_budget_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    return make_error(e, fmt::format("cannot map the staging buffer: {}", std::strerror(e)));
  }
  data_ = static_cast<uint8_t*>(p);
  bytes_ = w.staging_budget_bytes;
  chunk_bytes_ = w.chunk_bytes;
  slots_.assign(w.slot_count, Slot{});
  registered_ = false;
  return {};
}

void StagingSlots::release() noexcept {
  if (!data_) return;
  const DriverApi& api = driver().api;
  if (registered_ && api.cuMemHostUnregister) {
    CtxScope scope(api, registered_ctx_);
    api.cuMemHostUnregister(data_);
  }
  ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  registered_ = false;
  registered_ctx_ = nullptr;
  for (Slot& s : slots_) s = Slot{};
}

void StagingSlots::forget_after_fork() noexcept {
  if (data_) ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  registered_ = false;
}

void StagingSlots::register_with(CUcontext ctx) noexcept {
  const DriverApi& api = driver().api;
  if (registered_ || !data_ || !api.cuMemHostRegister_v2) return;
  CtxScope scope(api, ctx);
  const CUresult r = api.cuMemHostRegister_v2(data_, bytes_, CU_MEMHOSTREGISTER_PORTABLE);
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    registered_ = true;
    registered_ctx_ = ctx;
  } else {
    TMS_LOG_ONCE(LogLevel::Warn,
                 "cannot pin the staging buffer (cuMemHostRegister failed: %s (%d)); copies will be slower",
                 cu_error_name(r), static_cast<int>(r));
  }
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
