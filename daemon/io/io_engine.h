// SPDX-License-Identifier: Apache-2.0
// The daemon's file I/O: an io_uring ring moving whole chunks between staging memory and data files.
//
// Requests are queued without blocking and submitted in batches; every completion is checked: short
// transfers are resubmitted for the remainder, -EAGAIN and -EINTR are retried, any other error is
// handed back to the caller as -errno (never asserted). A request completes exactly once.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "tmsdisk/common/result.h"

namespace tmsdisk::io {

enum class Op : uint8_t { Read, Write };

struct Request {
  Op op = Op::Write;
  int fd = -1;
  void* buf = nullptr;     // must lie inside buffer `buf_index` when that is >= 0
  int buf_index = -1;      // registered buffer, or -1 for a plain read/write
  uint32_t length = 0;
  uint64_t offset = 0;
  uint64_t tag = 0;        // caller's cookie, returned in the completion
};

struct Completion {
  uint64_t tag = 0;
  int result = 0;  // 0 when all `length` bytes moved, else a negative errno (-EIO for EOF on read)
};

class Engine {
 public:
  struct Options {
    unsigned queue_depth = 64;    // SQ entries; requests beyond it wait in a backlog
    unsigned buffer_slots = 64;   // size of the sparse registered-buffer table
    // Test hook: sees each raw CQE result and may replace it (e.g. -EIO, or fewer bytes than asked
    // to exercise resubmission). Left empty in production.
    std::function<int(const Request&, int raw_result)> fault;
  };

  static Result<std::unique_ptr<Engine>> create(const Options& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // An eventfd that becomes readable when completions are waiting (for the daemon's epoll loop).
  int event_fd() const noexcept;

  // Registers [base, base+len) as a fixed buffer and returns its index. Where the kernel refuses
  // (RLIMIT_MEMLOCK for an unprivileged daemon, no sparse table support) it returns -1 and the
  // caller uses plain reads and writes on that memory; the reason is in `why`.
  int register_buffer(void* base, std::size_t len, std::string* why = nullptr) noexcept;
  void unregister_buffer(int index) noexcept;

  // Queues a request. Never blocks; call submit() to push queued requests to the kernel.
  void queue(const Request& request);
  void submit() noexcept;

  // Reaps completed requests into `out` (appending), resubmitting partial ones. Does not block.
  // Returns how many were appended.
  std::size_t reap(std::vector<Completion>& out);

  // Blocks until at least one request completes (or none is in flight), then reaps.
  std::size_t wait(std::vector<Completion>& out);

  std::size_t in_flight() const noexcept;  // queued + submitted, not yet completed

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether this kernel lets us create an io_uring at all (disabled by sysctl or seccomp in some
// containers). Tests that need it skip with this reason.
bool io_uring_available(std::string* why = nullptr) noexcept;

}  // namespace tmsdisk::io
