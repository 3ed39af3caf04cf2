// SPDX-License-Identifier: Apache-2.0
// The staging buffer (staging_buffer.h).
#include "staging_buffer.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace tmsdisk::server {

Result<std::unique_ptr<StagingBuffer>> StagingBuffer::create(io::Engine& engine, uint32_t chunk_bytes,
                                                             uint32_t slot_count, uint64_t session_id) {
  std::unique_ptr<StagingBuffer> b(new StagingBuffer);
  b->engine_ = &engine;
  b->chunk_bytes_ = chunk_bytes;
  b->slot_count_ = slot_count;
  const uint64_t bytes = b->bytes();
  // Sealed against shrinking: a client that truncated the memfd would make our next access to the
  // mapping a SIGBUS, taking down the daemon for everyone.
  b->memfd_.reset(::memfd_create("tmsdisk-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!b->memfd_) return errno_error("memfd_create for the staging buffer");
  if (::ftruncate(b->memfd_.get(), static_cast<off_t>(bytes)) != 0)
    return errno_error(fmt::format("cannot size the staging buffer to {} bytes", bytes));
  if (::fcntl(b->memfd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return errno_error("cannot seal the staging buffer");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, b->memfd_.get(), 0);
  if (p == MAP_FAILED) return errno_error("cannot map the staging buffer");
  b->base_ = static_cast<uint8_t*>(p);
  std::string why;
  b->buf_index_ = engine.register_buffer(b->base_, bytes, &why);
  if (b->buf_index_ < 0)
    spdlog::info("session {}: staging not registered with io_uring ({}); using plain I/O", session_id, why);
  b->busy_.assign(slot_count, 0);
  return b;
}

StagingBuffer::~StagingBuffer() {
  if (buf_index_ >= 0) engine_->unregister_buffer(buf_index_);
  if (base_) ::munmap(base_, bytes());
}

}  // namespace tmsdisk::server
