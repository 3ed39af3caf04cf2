// SPDX-License-Identifier: Apache-2.0
// The rank's host-tier memory (issue 9): what tmsdiskd granted of the node's host-memory budget for
// one pause, a sealed memfd whose pages the daemon faulted in. The shim maps it, registers it with
// CUDA, and the pipeline copies host chunks into it and back by DMA (transfer.h). The descriptor is
// kept for as long as the memory holds paused chunks: a daemon that restarts meanwhile is handed it
// back (TIER_ADOPT), so that it counts the memory against the budget again.
#pragma once

#include <cstdint>

#include "cuda_api.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::shim {

class HostTier {
 public:
  HostTier() = default;
  ~HostTier() { release(); }
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // Maps `memory` (`bytes` long, as TIER_GRANT said) and registers it with CUDA in `ctx`. Not being
  // registered is not an error (copies then go through the driver's own buffers, slower); being
  // smaller than `bytes`, or not mappable, is.
  Status take(UniqueFd memory, uint64_t bytes, CUcontext ctx);
  // Unregisters, unmaps and closes: the memory goes back to the node (the caller tells the daemon).
  void release() noexcept;
  // A fork child: the mapping and its registration are the parent's.
  void forget_after_fork() noexcept;

  bool held() const noexcept { return base_ != nullptr; }
  uint8_t* base() const noexcept { return base_; }
  uint64_t bytes() const noexcept { return bytes_; }
  int fd() const noexcept { return fd_.get(); }

 private:
  UniqueFd fd_;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  bool registered_ = false;
  CUcontext registered_ctx_ = nullptr;
};

}  // namespace tmsdisk::shim
