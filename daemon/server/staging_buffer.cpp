// SPDX-License-Identifier: Apache-2.0
// The staging buffer (staging_buffer.h).
#include "staging_buffer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace tmsdisk::server {
namespace {

// Faulting in and unmapping hold the daemon's mmap lock (for reading, and for writing at first), which
// the event loop's own allocations need for writing (brk, mmap): done in pieces of this size, so
// that it waits for one piece at most, not for a whole GiB.
constexpr uint64_t kPieceBytes = 16ull << 20;

}  // namespace

Status fault_in(uint8_t* base, uint64_t bytes, const char* what) {
  for (uint64_t off = 0; off < bytes;) {
    const uint64_t len = std::min(kPieceBytes, bytes - off);
    if (::madvise(base + off, len, MADV_POPULATE_WRITE) == 0) {
      off += len;
      continue;
    }
    if (errno == EINTR || errno == EAGAIN) continue;
    if (errno == EINVAL) {
      // A kernel before 5.14: one write per page does the same.
      const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
      for (uint64_t at = off; at < bytes; at += page) static_cast<volatile uint8_t*>(base)[at] = 0;
      return {};
    }
    if (errno == ENOMEM || errno == EFAULT)
      return make_error(ENOMEM, fmt::format("not enough memory for {} of {} MiB", what, bytes >> 20));
    return errno_error(fmt::format("cannot fault in {}", what));
  }
  return {};
}

Result<std::unique_ptr<StagingBuffer>> StagingBuffer::create(io::Engine& engine, uint32_t chunk_bytes,
                                                             uint32_t slot_count, int fixed_index,
                                                             std::string* not_registered) {
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
  if (auto st = fault_in(b->base_, bytes, "a staging buffer"); !st)
    return make_error(
        st.error().errnum(),
        st.error().message + (st.error().errnum() == ENOMEM
                                  ? "; ask for a smaller one (TMS_DISK_BACKUP_CHUNK_MB) or free memory on the node"
                                  : ""));
  if (fixed_index >= 0) {
    if (engine.fill_buffer_slot(fixed_index, b->base_, bytes, not_registered) == 0) b->buf_index_ = fixed_index;
  }
  b->busy_.assign(slot_count, 0);
  return b;
}

StagingBuffer::~StagingBuffer() {
  if (buf_index_ >= 0) engine_->empty_buffer_slot(buf_index_);
  if (!base_) return;
  for (uint64_t off = 0; off < bytes(); off += kPieceBytes) ::munmap(base_ + off, std::min(kPieceBytes, bytes() - off));
}

}  // namespace tmsdisk::server
