// SPDX-License-Identifier: Apache-2.0
// The C API of paused memory read in place (tmsdisk.h, tmsdisk_read_paused, tmsdisk_paused_view),
// over PausedReader, and brought close ahead of its resume (tmsdisk_prefetch, prefetch.h).
#include <cerrno>

#include "api_outcome.h"
#include "engine.h"
#include "log.h"
#include "shim.h"

namespace tmsdisk::shim {
namespace {

PausedReader* reader() noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  return e ? &e->paused_reader() : nullptr;
}

}  // namespace

int api_read_paused(const void* ptr, uint64_t length, void* dst) noexcept {
  PausedReader* r = reader();
  if (!r) return -ENOMEM;
  return api_outcome(r->read(reinterpret_cast<CUdeviceptr>(ptr), length, dst), "tmsdisk_read_paused", ENODATA);
}

int api_paused_view(const void* ptr, uint64_t length, const void** view) noexcept {
  if (!view) return -EINVAL;
  *view = nullptr;
  PausedReader* r = reader();
  if (!r) return -ENOMEM;
  Result<const void*> found = r->view(reinterpret_cast<CUdeviceptr>(ptr), length);
  if (!found) return api_outcome(Status(std::move(found).error()), "tmsdisk_paused_view", ENODATA);
  *view = *found;
  return 0;
}

int api_prefetch(const char* tag, int wait) noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return -ENOMEM;
  try {
    return api_outcome(e->prefetch(tag ? std::string(tag) : std::string(), wait != 0), "tmsdisk_prefetch", ENOSPC);
  } catch (...) {
    return -ENOMEM;
  }
}

int api_retain_host_copy(int on) noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return -ENOMEM;
  const bool before = e->retain_host_copy();
  if (on >= 0) e->set_retain_host_copy(on != 0);
  return before ? 1 : 0;
}

}  // namespace tmsdisk::shim
