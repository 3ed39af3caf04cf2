// SPDX-License-Identifier: Apache-2.0
// Host memory tmsdiskd hands the shim as a memfd, mapped here and pinned with CUDA so that copies to
// and from the device go by DMA: the staging buffer (staging_slots.h) and the host-tier memory
// (host_tier.h). Owns the mapping and its registration, and undoes both on release.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda_api.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

class RegisteredMapping {
 public:
  RegisteredMapping() = default;
  ~RegisteredMapping() { release(); }
  RegisteredMapping(const RegisteredMapping&) = delete;
  RegisteredMapping& operator=(const RegisteredMapping&) = delete;

  // Whether `fd` is at least `bytes` long (what the daemon said it is).
  static bool holds(int fd, uint64_t bytes) noexcept;
  // Whether the driver can pin host memory at all (cuMemHostRegister_v2 was found).
  static bool can_pin() noexcept;

  // Maps `bytes` of `fd`, shared, for reading and writing, in place of what it held (release()). On
  // failure: "cannot map the <what>: <reason>".
  Status map(int fd, std::size_t bytes, const char* what);
  // Pins the mapping in `ctx` (cuMemHostRegister_v2, portable) and says what the driver answered.
  // Registered, and unregistered by release() in that context, on CUDA_SUCCESS, and on
  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED where `already_counts`. Only once mapped() and
  // can_pin().
  CUresult pin(CUcontext ctx, bool already_counts = false) noexcept;
  // Unregisters (where pin() registered it) and unmaps.
  void release() noexcept;
  // A fork child: the mapping is the parent's, and so is its CUDA registration (not undone here).
  void forget_after_fork() noexcept;

  bool mapped() const noexcept { return data_ != nullptr; }
  bool registered() const noexcept { return registered_; }
  uint8_t* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  uint8_t* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool registered_ = false;
  CUcontext registered_ctx_ = nullptr;
};

}  // namespace tmsdisk::shim
