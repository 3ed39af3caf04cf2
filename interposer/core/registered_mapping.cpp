// SPDX-License-Identifier: Apache-2.0
// Mapped and pinned host memory (registered_mapping.h).
#include "registered_mapping.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "driver.h"

namespace tmsdisk::shim {

bool RegisteredMapping::holds(int fd, uint64_t bytes) noexcept {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= bytes;
}

bool RegisteredMapping::can_pin() noexcept {
  return driver().api.cuMemHostRegister_v2 != nullptr;
}

Status RegisteredMapping::map(int fd, std::size_t bytes, const char* what) {
  release();
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    return make_error(e, fmt::format("cannot map the {}: {}", what, std::strerror(e)));
  }
  data_ = static_cast<uint8_t*>(p);
  bytes_ = bytes;
  registered_ = false;
  return {};
}

CUresult RegisteredMapping::pin(CUcontext ctx, bool already_counts) noexcept {
  const DriverApi& api = driver().api;
  CtxScope scope(api, ctx);
  const CUresult r = api.cuMemHostRegister_v2(data_, bytes_, CU_MEMHOSTREGISTER_PORTABLE);
  if (r == CUDA_SUCCESS || (already_counts && r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)) {
    registered_ = true;
    registered_ctx_ = ctx;
  }
  return r;
}

void RegisteredMapping::release() noexcept {
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
}

void RegisteredMapping::forget_after_fork() noexcept {
  if (data_) ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
  registered_ = false;
}

}  // namespace tmsdisk::shim
