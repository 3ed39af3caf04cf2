// SPDX-License-Identifier: Apache-2.0
// libtmsdisk.so's exported symbols. Each one only forwards to the core (core/), which the unit tests
// link directly; nothing else belongs in this file.
#include <dlfcn.h>

#include "driver.h"
#include "shim.h"
#include "tms_entry_points.h"
#include "tmsdisk.h"

#define TMSDISK_EXPORT extern "C" __attribute__((visibility("default")))

// The driver's entry points, under their exported (versioned) names.
#define TMSDISK_X(name, params, args, ...)       \
  TMSDISK_EXPORT CUresult name params noexcept { \
    return tmsdisk::shim::hook::name args;       \
  }
TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X

// Programs that dlopen libcuda and look functions up by name (XLA, Triton) get the hooks too. The
// return address tells the core who asked, so that RTLD_NEXT keeps glibc's meaning.
TMSDISK_EXPORT void* dlsym(void* __restrict handle, const char* __restrict name) noexcept {
  return tmsdisk::shim::dlsym_hook(handle, name, __builtin_return_address(0));
}

TMSDISK_EXPORT int tmsdisk_pause(void) noexcept {
  return tmsdisk::shim::api_pause();
}
TMSDISK_EXPORT int tmsdisk_resume(void) noexcept {
  return tmsdisk::shim::api_resume();
}
TMSDISK_EXPORT int tmsdisk_resume_accept_loss(void) noexcept {
  return tmsdisk::shim::api_resume_accept_loss();
}
TMSDISK_EXPORT int tmsdisk_status(struct tmsdisk_status* status, size_t size) noexcept {
  return tmsdisk::shim::api_status(status, size);
}
TMSDISK_EXPORT int tmsdisk_on_pause(void (*callback)(void* arg), void* arg) noexcept {
  return tmsdisk::shim::api_on_pause(callback, arg);
}
TMSDISK_EXPORT int tmsdisk_tag_push(const char* tag, int policy) noexcept {
  return tmsdisk::shim::api_tag_push(tag, policy);
}
TMSDISK_EXPORT int tmsdisk_tag_pop(void) noexcept {
  return tmsdisk::shim::api_tag_pop();
}
TMSDISK_EXPORT int tmsdisk_pause_tag(const char* tag) noexcept {
  return tmsdisk::shim::api_pause_tag(tag);
}
TMSDISK_EXPORT int tmsdisk_resume_tag(const char* tag) noexcept {
  return tmsdisk::shim::api_resume_tag(tag);
}
TMSDISK_EXPORT int tmsdisk_resume_tag_accept_loss(const char* tag) noexcept {
  return tmsdisk::shim::api_resume_tag_accept_loss(tag);
}
TMSDISK_EXPORT int tmsdisk_tags(struct tmsdisk_tag_info* out, size_t count, size_t size) noexcept {
  return tmsdisk::shim::api_tags(out, count, size);
}
TMSDISK_EXPORT const char* tmsdisk_version(void) noexcept {
  return tmsdisk::shim::api_version();
}
TMSDISK_EXPORT uint64_t tmsdisk_store_chunk_bytes(void) noexcept {
  return tmsdisk::shim::api_store_chunk_bytes();
}
TMSDISK_EXPORT int tmsdisk_store_open(const char* name, uint64_t size, uint64_t* handle) noexcept {
  return tmsdisk::shim::api_store_open(name, size, handle);
}
TMSDISK_EXPORT int tmsdisk_store_remove(const char* name) noexcept {
  return tmsdisk::shim::api_store_remove(name);
}
TMSDISK_EXPORT int tmsdisk_store_write(uint64_t handle, uint64_t offset, const void* src, uint64_t length, void* stream,
                                       uint64_t* ticket) noexcept {
  return tmsdisk::shim::api_store_write(handle, offset, src, length, stream, ticket);
}
TMSDISK_EXPORT int tmsdisk_store_read(uint64_t handle, uint64_t offset, void* dst, uint64_t length, void* stream,
                                      uint64_t* ticket) noexcept {
  return tmsdisk::shim::api_store_read(handle, offset, dst, length, stream, ticket);
}
TMSDISK_EXPORT int tmsdisk_store_prefetch(uint64_t handle, uint64_t offset, uint64_t length) noexcept {
  return tmsdisk::shim::api_store_prefetch(handle, offset, length);
}
TMSDISK_EXPORT int tmsdisk_store_wait(uint64_t ticket) noexcept {
  return tmsdisk::shim::api_store_wait(ticket);
}
TMSDISK_EXPORT int tmsdisk_store_flush(void) noexcept {
  return tmsdisk::shim::api_store_flush();
}
TMSDISK_EXPORT int tmsdisk_read_paused(const void* ptr, uint64_t length, void* dst) noexcept {
  return tmsdisk::shim::api_read_paused(ptr, length, dst);
}
TMSDISK_EXPORT int tmsdisk_paused_view(const void* ptr, uint64_t length, const void** view) noexcept {
  return tmsdisk::shim::api_paused_view(ptr, length, view);
}
TMSDISK_EXPORT int tmsdisk_prefetch(const char* tag, int wait) noexcept {
  return tmsdisk::shim::api_prefetch(tag, wait);
}
TMSDISK_EXPORT int tmsdisk_retain_host_copy(int on) noexcept {
  return tmsdisk::shim::api_retain_host_copy(on);
}
TMSDISK_EXPORT int tmsdisk_set_backup_dir(const char* path) noexcept {
  return tmsdisk::shim::api_set_backup_dir(path);
}

// torch_memory_saver's C entry points (tms_entry_points.h).
#define TMSDISK_X(ret, name, params, args)  \
  TMSDISK_EXPORT ret name params noexcept { \
    return tmsdisk::shim::tms::name args;   \
  }
TMSDISK_TMS_ENTRY_POINTS(TMSDISK_X)
#undef TMSDISK_X
