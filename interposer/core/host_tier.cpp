// SPDX-License-Identifier: Apache-2.0
// The rank's host-tier memory (host_tier.h).
#include "host_tier.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#include <cerrno>
#include <cstring>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {

Status HostTier::take(UniqueFd memory, uint64_t bytes, CUcontext ctx) {
  release();
  struct stat st {};
  if (!memory || bytes == 0 || ::fstat(memory.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes)
    return make_error(EPROTO, "tmsdiskd's TIER_GRANT has no usable host-tier memory");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory.get(), 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    return make_error(e, fmt::format("cannot map the host-tier memory: {}", std::strerror(e)));
  }
  fd_ = std::move(memory);
  base_ = static_cast<uint8_t*>(p);
  bytes_ = bytes;
  (void)::madvise(base_, bytes_, MADV_HUGEPAGE);  // as the daemon asked when it made the memory
  // Pinning walks every page (the daemon faulted them in already): timed, as it is part of the pause.
  const DriverApi& api = driver().api;
  if (!api.cuMemHostRegister_v2) return {};
  timespec t0, t1;
  ::clock_gettime(CLOCK_MONOTONIC, &t0);
  CtxScope scope(api, ctx);
  const CUresult r = api.cuMemHostRegister_v2(base_, bytes_, CU_MEMHOSTREGISTER_PORTABLE);
  ::clock_gettime(CLOCK_MONOTONIC, &t1);
  if (r == CUDA_SUCCESS) {
    registered_ = true;
    registered_ctx_ = ctx;
    TMS_INFO("host tier: %llu bytes mapped and registered in %.3f s", static_cast<unsigned long long>(bytes_),
             static_cast<double>(t1.tv_sec - t0.tv_sec) + static_cast<double>(t1.tv_nsec - t0.tv_nsec) / 1e9);
  } else {
    TMS_WARN("cannot pin the host-tier memory (cuMemHostRegister failed: %s (%d)); its copies will be slower",
             cu_error_name(r), static_cast<int>(r));
  }
  return {};
}

void HostTier::release() noexcept {
  if (!base_) return;
  const DriverApi& api = driver().api;
  if (registered_ && api.cuMemHostUnregister) {
    CtxScope scope(api, registered_ctx_);
    api.cuMemHostUnregister(base_);
  }
  ::munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
  registered_ = false;
  registered_ctx_ = nullptr;
  fd_.reset();
}

void HostTier::forget_after_fork() noexcept {
  if (base_) ::munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
  registered_ = false;
  fd_.reset();
}

}  // namespace tmsdisk::shim
