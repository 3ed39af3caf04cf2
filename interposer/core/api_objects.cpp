// SPDX-License-Identifier: Apache-2.0
// The C API of the rank's store of named objects (tmsdisk.h, tmsdisk_store_*), over ObjectClient.
#include <cerrno>
#include <string_view>

#include "api_outcome.h"
#include "engine.h"
#include "log.h"
#include "shim.h"

namespace tmsdisk::shim {
namespace {

ObjectClient* objects() noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  return e ? &e->objects() : nullptr;
}

}  // namespace

uint64_t api_store_chunk_bytes() noexcept {
  ObjectClient* o = objects();
  if (!o) return 0;
  Result<uint64_t> chunk = o->chunk_bytes();
  return chunk ? *chunk : 0;
}

int api_store_open(const char* name, uint64_t size, uint64_t* handle) noexcept {
  if (!name || !handle) return -EINVAL;
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->open(name, size), handle, "tmsdisk_store_open");
}

int api_store_remove(const char* name) noexcept {
  if (!name) return -EINVAL;
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->remove(name), "tmsdisk_store_remove");
}

int api_store_write(uint64_t handle, uint64_t offset, const void* src, uint64_t length, void* stream,
                    uint64_t* ticket) noexcept {
  if (!ticket) return -EINVAL;
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->write(handle, offset, src, length, static_cast<CUstream>(stream)), ticket,
                     "tmsdisk_store_write");
}

int api_store_read(uint64_t handle, uint64_t offset, void* dst, uint64_t length, void* stream,
                   uint64_t* ticket) noexcept {
  if (!ticket) return -EINVAL;
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->read(handle, offset, dst, length, static_cast<CUstream>(stream)), ticket, "tmsdisk_store_read");
}

int api_store_prefetch(uint64_t handle, uint64_t offset, uint64_t length) noexcept {
  // A hint. An object lives in the host tier (already close: a read is one DMA copy) or on disk,
  // whole; an object on disk is not staged in memory ahead of its read, which does all the work.
  (void)handle, (void)offset, (void)length;
  return 0;
}

int api_store_wait(uint64_t ticket) noexcept {
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->wait(ticket), "tmsdisk_store_wait");
}

int api_store_flush() noexcept {
  ObjectClient* o = objects();
  if (!o) return -ENOMEM;
  return api_outcome(o->flush(), "tmsdisk_store_flush");
}

}  // namespace tmsdisk::shim
