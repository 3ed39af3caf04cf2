// SPDX-License-Identifier: Apache-2.0
// io_uring engine (io_engine.h): request pool, backlog, CQE interpretation and the pread/pwrite fallback.
#include "io_engine.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

#include "tmsdisk/common/unique_fd.h"
#include "uring_probe.h"

namespace tmsdisk::io {
namespace {

constexpr uint32_t kNone = UINT32_MAX;
constexpr unsigned kMaxQueueDepth = 32768;           // IORING_MAX_ENTRIES
constexpr std::size_t kMaxFixedBuffer = 1ull << 30;  // the kernel refuses larger registered buffers

// Building the message allocates; a noexcept caller would rather lose it than terminate.
template <typename MakeText>
void set_why(std::string* why, MakeText&& make_text) noexcept {
  if (!why) return;
  try {
    *why = make_text();
  } catch (...) {
  }
}

std::string errno_text(int errnum) {
  return std::strerror(errnum);
}

// io_uring_setup failures, spelled out with the usual causes so the daemon's startup warning is actionable.
std::string describe_setup_error(int rc) {
  std::string out = "io_uring_setup: " + errno_text(-rc);
  if (rc == -ENOSYS) out += " (kernel built without io_uring, or a seccomp filter blocks it)";
  if (rc == -EPERM || rc == -EACCES) {
    out += " (kernel.io_uring_disabled, kernel.io_uring_group, or a seccomp filter";
    if (const auto v = io_uring_disabled(); v && *v != 0) out += fmt::format("; kernel.io_uring_disabled={}", *v);
    out += ")";
  }
  return out;
}

std::string describe_register_error(int rc, std::size_t len) {
  std::string out = fmt::format("registering {} bytes with io_uring: {}", len, errno_text(-rc));
  if (rc == -ENOMEM) {
    // Fixed buffers are pinned and charged to RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK.
    rlimit lim{};
    if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
      out += fmt::format(" (RLIMIT_MEMLOCK is {} bytes; raise LimitMEMLOCK= or grant CAP_IPC_LOCK)", lim.rlim_cur);
  } else if (rc == -EOPNOTSUPP) {
    out += " (this kernel cannot pin file-backed memory such as a memfd)";
  }
  return out;
}

}  // namespace

struct Engine::Impl {
  enum class State : uint8_t { Free, Backlog, Kernel, Done };

  struct Slot {
    Request req;            // what is still outstanding: buf/offset/length advance on short transfers
    uint32_t next = kNone;  // link in the free list, the backlog or the done list
    int result = 0;         // final result while in the done list
    uint32_t retries = 0;   // -EAGAIN/-EINTR in a row
    State state = State::Free;
  };

  // FIFO of slot indices linked through Slot::next, so requeueing never allocates.
  struct List {
    uint32_t head = kNone, tail = kNone;
    bool empty() const noexcept { return head == kNone; }
  };

  struct FixedBuffer {
    const char* base = nullptr;
    std::size_t len = 0;
    bool used = false;
  };

  Options opts;
  UniqueFd efd;
  io_uring ring{};
  bool ring_ok = false;
  std::string fallback;  // why ring_ok is false
  std::string no_fixed;  // why register_buffer() cannot work, if it cannot
  std::vector<FixedBuffer> fixed;
  // Held by a thread registering or emptying a fixed buffer. The kernel holds the ring's own lock
  // meanwhile (for as long as pinning a GiB takes), which io_uring_enter would wait for: the owner
  // submits only when it can take this one at once, and otherwise leaves its SQEs in the ring for
  // its next submit(). Whoever registers tells the owner when it is done (the daemon's staging
  // workers post to its event loop), so they do not wait long.
  mutable std::mutex registering;

  std::vector<Slot> slots;
  uint32_t free_head = kNone;
  List backlog, done;
  std::size_t in_use = 0;  // slots not Free
  unsigned in_kernel = 0;  // SQEs prepared (consumed by the kernel or not) without their CQE yet

  explicit Impl(const Options& o) : opts(o) {}
  ~Impl() {
    if (ring_ok) {
      drain_started();
      io_uring_queue_exit(&ring);
    }
  }

  void push(List& list, uint32_t idx, State state) noexcept {
    slots[idx].state = state;
    slots[idx].next = kNone;
    if (list.tail == kNone)
      list.head = idx;
    else
      slots[list.tail].next = idx;
    list.tail = idx;
  }

  uint32_t pop(List& list) noexcept {
    uint32_t idx = list.head;
    list.head = slots[idx].next;
    if (list.head == kNone) list.tail = kNone;
    slots[idx].next = kNone;
    return idx;
  }

  uint32_t alloc_slot() {
    if (free_head == kNone) {
      slots.emplace_back();  // the only allocation on the request path
      free_head = static_cast<uint32_t>(slots.size() - 1);
    }
    uint32_t idx = free_head;
    free_head = slots[idx].next;
    ++in_use;
    return idx;
  }

  void free_slot(uint32_t idx) noexcept {
    slots[idx].state = State::Free;
    slots[idx].next = free_head;
    free_head = idx;
    --in_use;
  }

  void signal() noexcept {
    // Only fails when the counter would overflow, and then the fd is readable anyway.
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(efd.get(), &one, sizeof(one));
  }

  void clear_signal() noexcept {
    uint64_t count;
    [[maybe_unused]] ssize_t n = ::read(efd.get(), &count, sizeof(count));
  }

  void finish(uint32_t idx, int result) noexcept {
    slots[idx].result = result;
    push(done, idx, State::Done);
    signal();  // with io_uring only immediate completions come this way, and epoll must see them too
  }

  // Interprets one result for slot `idx`. Returns true when the request is finished (result stored in
  // the slot), false when what remains of it must run again.
  bool settle(uint32_t idx, int raw) noexcept {
    Slot& s = slots[idx];
    int res = opts.fault ? opts.fault(s.req, raw) : raw;
    if (res < 0) {
      if ((res == -EAGAIN || res == -EINTR) && s.retries < kMaxRetries) {
        ++s.retries;
        return false;
      }
      s.result = res;
      return true;
    }
    if (s.req.op == Op::Sync) {  // moves no bytes: done
      s.result = 0;
      return true;
    }
    auto moved = static_cast<uint32_t>(res);
    // 0 bytes is EOF on a read; on a write it is no progress, and retrying it would spin forever.
    if (moved == 0 || moved > s.req.length) {
      s.result = -EIO;
      return true;
    }
    if (moved == s.req.length) {
      s.result = 0;
      return true;
    }
    s.req.buf = static_cast<char*>(s.req.buf) + moved;
    s.req.offset += moved;
    s.req.length -= moved;
    s.retries = 0;
    return false;
  }

  bool fixed_range_ok(const Request& r) const noexcept {
    if (r.buf_index < 0 || static_cast<std::size_t>(r.buf_index) >= fixed.size()) return false;
    const FixedBuffer& b = fixed[r.buf_index];
    auto p = reinterpret_cast<uintptr_t>(r.buf);
    auto base = reinterpret_cast<uintptr_t>(b.base);
    return b.used && p >= base && r.length <= b.len && p - base <= b.len - r.length;
  }

  void prep(io_uring_sqe* sqe, uint32_t idx) noexcept {
    const Request& r = slots[idx].req;
    if (r.op == Op::Sync) {
      io_uring_prep_fsync(sqe, r.fd, IORING_FSYNC_DATASYNC);
    } else if (r.buf_index >= 0) {
      if (r.op == Op::Read)
        io_uring_prep_read_fixed(sqe, r.fd, r.buf, r.length, r.offset, r.buf_index);
      else
        io_uring_prep_write_fixed(sqe, r.fd, r.buf, r.length, r.offset, r.buf_index);
    } else {
      if (r.op == Op::Read)
        io_uring_prep_read(sqe, r.fd, r.buf, r.length, r.offset);
      else
        io_uring_prep_write(sqe, r.fd, r.buf, r.length, r.offset);
    }
    if (r.async) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
    io_uring_sqe_set_data64(sqe, idx);
  }

  void submit_ring() noexcept {
    // Capping what the kernel holds at queue_depth keeps the CQ ring (twice the SQ) from overflowing.
    while (!backlog.empty() && in_kernel < opts.queue_depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (!sqe) break;
      uint32_t idx = pop(backlog);
      slots[idx].state = State::Kernel;
      prep(sqe, idx);
      ++in_kernel;
    }
    if (io_uring_sq_ready(&ring) == 0) return;
    std::unique_lock not_registering(registering, std::try_to_lock);
    if (!not_registering) return;
    int rc;
    do rc = io_uring_submit(&ring);
    while (rc == -EINTR);
    // On -EAGAIN (kernel short of memory) or -EBUSY (completions to reap first) the SQEs stay in the
    // SQ ring; the next submit(), reap() or wait() sends them.
  }

  void submit_sync() noexcept {
    while (!backlog.empty()) {
      uint32_t idx = pop(backlog);
      for (;;) {
        const Request& r = slots[idx].req;
        ssize_t n = r.op == Op::Sync   ? ::fdatasync(r.fd)
                    : r.op == Op::Read ? ::pread(r.fd, r.buf, r.length, static_cast<off_t>(r.offset))
                                       : ::pwrite(r.fd, r.buf, r.length, static_cast<off_t>(r.offset));
        int raw = n < 0 ? -errno : static_cast<int>(n);  // Linux moves at most 0x7ffff000 bytes per call
        if (settle(idx, raw)) break;
      }
      finish(idx, slots[idx].result);
    }
  }

  void submit() noexcept {
    if (ring_ok)
      submit_ring();
    else
      submit_sync();
  }

  // Handles every CQE in the ring; `out` has room for all of them (reserved by the caller).
  void reap_ring(std::vector<Completion>& out) noexcept {
    unsigned head, seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++seen;
      uint64_t idx = io_uring_cqe_get_data64(cqe);
      // Every SQE we make carries a slot index and buffer updates use tag 0 (no CQE): anything else
      // would be a kernel or memory bug, and guessing whose it is would break exactly-once.
      if (idx >= slots.size() || slots[idx].state != State::Kernel) continue;
      --in_kernel;
      auto i = static_cast<uint32_t>(idx);
      if (settle(i, cqe->res)) {
        out.push_back({slots[i].req.tag, slots[i].result});
        free_slot(i);
      } else {
        push(backlog, i, State::Backlog);
      }
    }
    io_uring_cq_advance(&ring, seen);
  }

  std::size_t reap(std::vector<Completion>& out) {
    std::size_t before = out.size();
    out.reserve(before + in_use);  // an upper bound, so that nothing below can throw
    clear_signal();                // before draining: a CQE posted after this signals again
    if (ring_ok) reap_ring(out);
    submit();
    while (!done.empty()) {
      uint32_t idx = pop(done);
      out.push_back({slots[idx].req.tag, slots[idx].result});
      free_slot(idx);
    }
    return out.size() - before;
  }

  // Waits for the CQEs of requests the kernel has consumed; their buffers are in use until then.
  void drain_started() noexcept {
    unsigned started = in_kernel - io_uring_sq_ready(&ring);
    while (started > 0) {
      io_uring_cqe* cqe;
      int rc = io_uring_wait_cqe(&ring, &cqe);
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
      if (rc < 0) return;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++seen;
        uint64_t idx = io_uring_cqe_get_data64(cqe);
        if (idx < slots.size() && slots[idx].state == State::Kernel && started > 0) --started;
      }
      io_uring_cq_advance(&ring, seen);
    }
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::create(const Options& options) {
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth)
    return make_error(EINVAL, "io queue depth must be between 1 and 32768");
  try {
    auto impl = std::make_unique<Impl>(options);
    impl->slots.reserve(2 * options.queue_depth);
    impl->efd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!impl->efd) return errno_error("creating the I/O completion eventfd");

    if (options.force_sync) {
      impl->fallback = "synchronous engine forced by configuration";
    } else {
      int rc = setup_ring(impl->ring, options.queue_depth);
      if (rc < 0) {
        impl->fallback = describe_setup_error(rc);
      } else {
        impl->ring_ok = true;
        rc = io_uring_register_eventfd(&impl->ring, impl->efd.get());
        if (rc < 0) return make_error(-rc, "registering the eventfd with io_uring");
        if (options.buffer_slots > 0) {
          rc = io_uring_register_buffers_sparse(&impl->ring, options.buffer_slots);
          if (rc < 0)
            impl->no_fixed = fmt::format("sparse registered-buffer table of {} slots: {} (needs Linux 5.19+)",
                                         options.buffer_slots, errno_text(-rc));
          else
            impl->fixed.resize(options.buffer_slots);
        } else {
          impl->no_fixed = "no registered-buffer slots configured";
        }
      }
    }
    if (!impl->ring_ok) impl->no_fixed = "io_uring unavailable: " + impl->fallback;
    return std::unique_ptr<Engine>(new Engine(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return make_error(ENOMEM, "creating the I/O engine");
  }
}

bool Engine::uses_io_uring() const noexcept {
  return impl_->ring_ok;
}
std::string Engine::fallback_reason() const {
  return impl_->fallback;
}
int Engine::event_fd() const noexcept {
  return impl_->efd.get();
}

int Engine::register_buffer(void* base, std::size_t len, std::string* why) noexcept {
  const int idx = claim_buffer_slot(why);
  if (idx < 0) return -1;
  if (fill_buffer_slot(idx, base, len, why) != 0) {
    release_buffer_slot(idx);
    return -1;
  }
  commit_buffer_slot(idx, base, len);
  return idx;
}

void Engine::unregister_buffer(int index) noexcept {
  Impl& m = *impl_;
  if (index < 0 || static_cast<std::size_t>(index) >= m.fixed.size() || !m.fixed[index].used) return;
  empty_buffer_slot(index);
  release_buffer_slot(index);
}

int Engine::claim_buffer_slot(std::string* why) noexcept {
  Impl& m = *impl_;
  if (!m.no_fixed.empty()) {
    set_why(why, [&] { return m.no_fixed; });
    return -1;
  }
  for (std::size_t i = 0; i < m.fixed.size(); ++i) {
    if (!m.fixed[i].used) {
      m.fixed[i] = {nullptr, 0, true};  // claimed: no base yet, so fixed_range_ok() refuses requests
      return static_cast<int>(i);
    }
  }
  set_why(why, [&] { return fmt::format("all {} registered-buffer slots are in use", m.fixed.size()); });
  return -1;
}

int Engine::fill_buffer_slot(int index, void* base, std::size_t len, std::string* why) const noexcept {
  const Impl& m = *impl_;  // only the ring's descriptor is read: see claim_buffer_slot() in the header
  if (!base || len == 0 || len > kMaxFixedBuffer) {
    set_why(why, [&] { return fmt::format("registered buffers must be 1 byte to 1 GiB (got {})", len); });
    return -1;
  }
  iovec iov{base, len};
  __u64 tag = 0;  // no tag: the kernel posts no CQE when the buffer is later released
  std::lock_guard lock(m.registering);
  int rc =
      io_uring_register_buffers_update_tag(const_cast<io_uring*>(&m.ring), static_cast<unsigned>(index), &iov, &tag, 1);
  if (rc != 1) {
    set_why(why, [&] { return describe_register_error(rc < 0 ? rc : -EIO, len); });
    return -1;
  }
  return 0;
}

void Engine::commit_buffer_slot(int index, void* base, std::size_t len) noexcept {
  Impl& m = *impl_;
  if (index < 0 || static_cast<std::size_t>(index) >= m.fixed.size()) return;
  m.fixed[index] = {static_cast<const char*>(base), len, true};
}

void Engine::empty_buffer_slot(int index) const noexcept {
  const Impl& m = *impl_;
  if (index < 0 || !m.ring_ok) return;
  // An empty iovec clears the slot; requests already in the kernel keep their own reference.
  iovec iov{nullptr, 0};
  __u64 tag = 0;
  std::lock_guard lock(m.registering);
  (void)io_uring_register_buffers_update_tag(const_cast<io_uring*>(&m.ring), static_cast<unsigned>(index), &iov, &tag,
                                             1);
}

void Engine::release_buffer_slot(int index) noexcept {
  Impl& m = *impl_;
  if (index < 0 || static_cast<std::size_t>(index) >= m.fixed.size()) return;
  m.fixed[index] = {};
}

void Engine::queue(const Request& request) {
  Impl& m = *impl_;
  uint32_t idx = m.alloc_slot();
  Impl::Slot& s = m.slots[idx];
  s.req = request;
  s.retries = 0;
  if (request.length == 0 && request.op != Op::Sync)
    m.finish(idx, 0);
  else if (request.buf_index >= 0 && !m.fixed_range_ok(request))
    m.finish(idx, -EINVAL);
  else
    m.push(m.backlog, idx, Impl::State::Backlog);
}

void Engine::submit() noexcept {
  impl_->submit();
}

std::size_t Engine::reap(std::vector<Completion>& out) {
  return impl_->reap(out);
}

std::size_t Engine::wait(std::vector<Completion>& out) {
  Impl& m = *impl_;
  std::size_t n = m.reap(out);
  while (n == 0 && m.in_use > 0) {
    if (!m.ring_ok) break;  // unreachable: the synchronous engine finishes everything inside reap()
    int rc;
    io_uring_cqe* cqe;
    if (io_uring_sq_ready(&m.ring) > 0)
      rc = io_uring_submit_and_wait(&m.ring, 1);
    else if (m.in_kernel > 0)
      rc = io_uring_wait_cqe(&m.ring, &cqe);
    else
      break;  // unreachable: reap() leaves nothing in the backlog while the kernel holds nothing
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME) break;
    n += m.reap(out);
  }
  return n;
}

std::size_t Engine::in_flight() const noexcept {
  return impl_->in_use;
}

bool io_uring_available(std::string* why) noexcept {
  const int error = ring_setup_error(2);
  if (error != 0) {
    set_why(why, [&] { return describe_setup_error(-error); });
    return false;
  }
  return true;
}

}  // namespace tmsdisk::io
