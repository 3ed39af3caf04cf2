// SPDX-License-Identifier: Apache-2.0
// The daemon's file I/O: an io_uring ring moving whole chunks between staging memory and data files.
//
// Requests are queued without blocking and submitted in batches; every completion is checked: short
// transfers are resubmitted for the remainder, -EAGAIN and -EINTR are retried, any other error is
// handed back to the caller as -errno (never asserted). A request completes exactly once.
//
// Where the kernel refuses io_uring (kernel.io_uring_disabled, seccomp profiles of container
// runtimes), create() still succeeds with a synchronous engine that runs pread/pwrite inside
// submit(), with the same completion semantics; uses_io_uring() and fallback_reason() say so.
//
// An Engine is not thread-safe: one thread (its owner) queues, submits and reaps. The one exception is
// the middle of a registration in steps (fill_buffer_slot, empty_buffer_slot), which any thread may
// run: see claim_buffer_slot().
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tmsdisk/common/result.h"

namespace tmsdisk::io {

// Sync: fdatasync of `fd` (no buffer, no length): what was written to the file is on its device once
// it completes, without the caller's thread waiting for the device.
enum class Op : uint8_t { Read, Write, Sync };

struct Request {
  Op op = Op::Write;
  int fd = -1;
  void* buf = nullptr;  // must lie inside buffer `buf_index` when that is >= 0
  int buf_index = -1;   // registered buffer, or -1 for a plain read/write
  uint32_t length = 0;
  uint64_t offset = 0;
  uint64_t tag = 0;  // caller's cookie, returned in the completion
  // Run in one of the kernel's io_uring workers instead of trying it first inside submit(). For a
  // file in memory (tmpfs) the kernel otherwise does every copy on the submitting thread, one
  // request after another: a worker each lets them run in parallel. Harmless but useless on a disk.
  bool async = false;
};

struct Completion {
  uint64_t tag = 0;
  int result = 0;  // 0 when all `length` bytes moved, else a negative errno (-EIO for EOF on read)
};

class Engine {
 public:
  struct Options {
    unsigned queue_depth = 64;   // requests in the kernel at once (1..32768); more wait in a backlog
    unsigned buffer_slots = 64;  // size of the sparse registered-buffer table (0: none)
    // Test hook: sees each raw result (bytes moved or -errno, for the part of the request still
    // outstanding) and may replace it, e.g. with -EIO or fewer bytes to exercise resubmission.
    // Must not throw. Left empty in production.
    std::function<int(const Request&, int raw_result)> fault;
    // Use the synchronous pread/pwrite engine even where io_uring works (tests; escape hatch).
    bool force_sync = false;
  };

  // -EAGAIN/-EINTR in a row without progress after which a request completes with that error rather
  // than spinning forever (the kernel normally absorbs -EAGAIN for regular files itself).
  static constexpr unsigned kMaxRetries = 100;

  // Fails only for invalid options or when no eventfd can be made; an unusable io_uring is not a
  // failure (see uses_io_uring()).
  static Result<std::unique_ptr<Engine>> create(const Options& options);
  ~Engine();  // waits for requests the kernel has started (it may still touch their buffers)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  bool uses_io_uring() const noexcept;
  std::string fallback_reason() const;  // why the synchronous engine is in use; empty with io_uring

  // An eventfd that becomes readable when completions are waiting (for the daemon's epoll loop).
  // reap() clears it.
  int event_fd() const noexcept;

  // Registers [base, base+len) as a fixed buffer and returns its index. Where the kernel refuses
  // (RLIMIT_MEMLOCK for an unprivileged daemon, no sparse table support, more than 1 GiB, the
  // synchronous engine) it returns -1 and the caller uses plain reads and writes on that memory;
  // the reason is in `why`. The memory must stay mapped until unregister_buffer() or ~Engine.
  int register_buffer(void* base, std::size_t len, std::string* why = nullptr) noexcept;
  void unregister_buffer(int index) noexcept;

  // register_buffer() in steps, so that its slow part runs off the owner's thread: the kernel pins
  // every page of the buffer (faulting in those not present), which takes a noticeable time for a
  // GiB even when they are. On the owner's thread, claim_buffer_slot() reserves a slot of the
  // fixed-buffer table (-1 and the reason where register_buffer() would fail before the kernel);
  // then fill_buffer_slot() registers the memory in it, from any thread: it reads only the ring's
  // descriptor. The kernel holds the ring's lock while it pins (fault the pages in before, so that
  // this is short), which a submission would wait for: meanwhile submit() leaves queued requests in
  // the ring instead of blocking, so the caller should have the owner call submit() again when it is
  // done. Then, on the owner's thread, commit_buffer_slot() lets requests name the slot. The way
  // back: empty_buffer_slot() from any thread (the same holds), then release_buffer_slot() on the
  // owner's. A claimed slot that is not committed refuses requests (-EINVAL), like a free one.
  int claim_buffer_slot(std::string* why = nullptr) noexcept;
  // Returns 0, or -1 with the reason (the slot then stays claimed and empty).
  int fill_buffer_slot(int index, void* base, std::size_t len, std::string* why = nullptr) const noexcept;
  void commit_buffer_slot(int index, void* base, std::size_t len) noexcept;
  void empty_buffer_slot(int index) const noexcept;
  void release_buffer_slot(int index) noexcept;

  // Queues a request. Never blocks; call submit() to push queued requests to the kernel. A request
  // with length 0 completes with 0; one whose buffer lies outside its registered buffer completes
  // with -EINVAL. Throws std::bad_alloc only (growing the request pool), leaving the engine as it was.
  void queue(const Request& request);
  // Moves queued requests into the kernel as far as the queue depth allows. Never blocks with
  // io_uring (not even while another thread registers a buffer: the requests then wait for the next
  // call); the synchronous engine performs the I/O here.
  void submit() noexcept;

  // Reaps completed requests into `out` (appending), resubmitting partial ones. Does not block.
  // Returns how many were appended. May throw std::bad_alloc growing `out`, before any state changes.
  std::size_t reap(std::vector<Completion>& out);

  // Blocks until at least one request completes (or none is in flight), then reaps. Returns 0 with
  // requests still in flight only if the ring itself fails.
  std::size_t wait(std::vector<Completion>& out);

  std::size_t in_flight() const noexcept;  // queued + submitted, not yet handed out by reap()

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether this kernel lets us create an io_uring as the engine does (setup_ring, uring_probe.h;
// disabled by sysctl or seccomp in some containers). Tests that need it skip with this reason.
bool io_uring_available(std::string* why = nullptr) noexcept;

}  // namespace tmsdisk::io
