// SPDX-License-Identifier: Apache-2.0
// The control thread and its request queue (control_thread.h).
#include "control_thread.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <variant>

#include "driver.h"
#include "log.h"
#include "tmsdisk/common/signal_blocked_thread.h"

namespace tmsdisk::shim {
namespace {

// While connected the thread wakes at least this often: the rank's report and the host tier's ask
// ahead run on its turns.
constexpr int kTurnMs = 1000;
constexpr int64_t kMaxConnectWaitMs = 30000;

}  // namespace

void ControlThread::start() noexcept {
  if (started_.load(std::memory_order_acquire)) return;
  std::lock_guard lock(mu_);
  if (thread_started_) return;
  if (wake_fd_ < 0) wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    TMS_LOG_ONCE(LogLevel::Error, "cannot create the control thread's eventfd: %s", std::strerror(errno));
    return;
  }
  if (const int rc = start_detached_signal_blocked_thread(&ControlThread::thread_main, this, "tmsdisk-ctl"); rc != 0) {
    TMS_LOG_ONCE(LogLevel::Error, "cannot start the control thread: %s", std::strerror(rc));
    return;
  }
  thread_started_ = true;
  started_.store(true, std::memory_order_release);
}

void ControlThread::forget_after_fork() noexcept {
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ControlThread::wake() noexcept {
  const uint64_t one = 1;
  ssize_t w;
  do {
    w = ::write(wake_fd_, &one, sizeof(one));
  } while (w < 0 && errno == EINTR);
}

int ControlThread::post(std::function<void()> task, bool wait) noexcept {
  try {
    start();
    auto req = std::make_unique<Request>();
    req->task = std::move(task);
    req->detached = !wait;
    Request* r = req.get();
    {
      std::lock_guard lock(mu_);
      if (!thread_started_) return -ESRCH;
      queue_.push_back(r);
      req.release();  // the queue owns it until done (detached) or until we take it back below
    }
    wake();
    if (!wait) return 0;
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return r->done; });
    const int code = r->result.code();
    delete r;
    return code ? -code : 0;
  } catch (...) {
    return -ENOMEM;
  }
}

Status ControlThread::run(proto::CommandOp op, uint8_t flags, std::string tag) noexcept {
  try {
    start();
    Request req;
    req.op = op;
    req.flags = flags;
    req.tag = std::move(tag);
    {
      std::unique_lock lock(mu_);
      if (!thread_started_) return make_error(EAGAIN, "the tmsdisk control thread could not be started");
      if (busy_ || std::any_of(queue_.begin(), queue_.end(), [](const Request* q) { return !q->task; }))
        return make_error(EBUSY, "another pause or resume is running");
      queue_.push_back(&req);
    }
    wake();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return req.done; });
    return std::move(req.result.status);
  } catch (...) {
    return make_error(ENOMEM, {});  // no message: building one could fail again
  }
}

void* ControlThread::thread_main(void* self) noexcept {
  mark_shim_thread();  // CUDA and dlsym calls from here go straight to the driver
  auto* thread = static_cast<ControlThread*>(self);
  for (;;) {
    try {
      thread->loop();
    } catch (...) {
      // Out of memory somewhere in a step: log, breathe, carry on. The thread must not die, or
      // callers of tmsdisk_pause() would wait forever.
      TMS_ERROR("control thread: unexpected failure; continuing");
      ::usleep(100000);
    }
  }
  return nullptr;
}

void ControlThread::loop() {
  for (;;) {
    int64_t now = now_ms();
    if (!session_.connected()) steps_.disconnected();
    if (!session_.connected() && session_.retry_due(now)) {
      if (Status st = session_.connect(); !st) session_.attempt_failed(st.error(), now);
    }
    now = now_ms();
    int timeout = kTurnMs;
    if (!session_.connected())
      timeout = static_cast<int>(std::clamp<int64_t>(session_.retry_in(now), 0, kMaxConnectWaitMs));
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {session_.fd(), POLLIN, 0}};
    const int n = ::poll(fds, session_.connected() ? 2 : 1, timeout);
    if (n < 0 && errno != EINTR) {
      TMS_ERROR("control thread: poll failed: %s", std::strerror(errno));
      ::usleep(100000);
      continue;
    }
    if (n > 0 && (fds[0].revents & POLLIN)) {
      uint64_t count;
      while (::read(wake_fd_, &count, sizeof(count)) < 0 && errno == EINTR) {
      }
      serve_requests();
    }
    if (n > 0 && session_.connected() && fds[1].revents) serve_socket();
    steps_.idle();
    serve_deferred_command();  // one the daemon sent while the idle step waited for an answer
    steps_.report();
  }
}

void ControlThread::serve_requests() {
  for (;;) {
    Request* req;
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) return;
      req = queue_.front();
      queue_.pop_front();
      busy_ = !req->task;
    }
    if (req->task) {
      try {
        req->task();
      } catch (...) {
        TMS_ERROR("control thread: an IPC request ran out of memory");
        req->result = OpResult{make_error(ENOMEM, {})};  // the waiter must not read the task's results as a success
      }
      if (req->detached) {
        delete req;
      } else {
        {
          std::lock_guard lock(mu_);
          req->done = true;
        }
        cv_.notify_all();
      }
      // A command the daemon sent meanwhile (deferred) waits until the queue is empty (loop()): the
      // tasks queued before it run first, so that a pause never moves memory an object's write
      // queued earlier still has to copy from.
      continue;
    }
    OpResult result;
    try {
      result = steps_.operate(req->op, req->flags, 0, req->tag);
    } catch (...) {
      result = OpResult{make_error(ENOMEM, "out of memory")};
    }
    {
      std::lock_guard lock(mu_);
      req->result = std::move(result);
      req->done = true;
      busy_ = false;
    }
    cv_.notify_all();
    steps_.operated();
  }
}

void ControlThread::serve_deferred_command() {
  if (!deferred_command_) return;
  const proto::Envelope cmd = std::move(*deferred_command_);
  deferred_command_.reset();
  serve_command(cmd);
}

void ControlThread::serve_socket() {
  proto::Envelope env;
  if (session_.receive(env, 0) <= 0) return;
  if (!std::holds_alternative<proto::Command>(env.body)) return session_.other(env);
  serve_command(env);
}

void ControlThread::command_while_waiting(const proto::Envelope& env) {
  if (!deferred_command_) {
    bool running;
    {
      std::lock_guard lock(mu_);
      running = busy_;
    }
    if (!running) {
      deferred_command_ = env;  // an IPC exchange is waiting for its reply: the command runs right after
      return;
    }
  }
  proto::CommandDone done;
  done.code = EBUSY;
  done.message = "another pause or resume is running";
  (void)session_.send(env.request_id, done);
}

void ControlThread::serve_command(const proto::Envelope& env) {
  const auto* cmd = std::get_if<proto::Command>(&env.body);
  {
    std::lock_guard lock(mu_);
    if (busy_) {
      // Cannot happen while this thread is the only one running operations; kept for safety.
      proto::CommandDone done;
      done.code = EBUSY;
      done.message = "another pause or resume is running";
      (void)session_.send(env.request_id, done);
      return;
    }
    busy_ = true;
  }
  OpResult r;
  try {
    r = steps_.operate(static_cast<proto::CommandOp>(cmd->op), cmd->flags, env.request_id, cmd->tag);
  } catch (...) {
    r = OpResult{make_error(ENOMEM, "out of memory")};
  }
  {
    std::lock_guard lock(mu_);
    busy_ = false;
  }
  proto::CommandDone done;
  done.code = r.code();
  done.bytes = r.bytes;
  done.nanos = r.nanos;
  done.message = proto::wire_text(r.message());  // what the daemon's decoder accepts
  done.outcome = static_cast<uint8_t>(r.outcome);
  done.skipped = r.skipped;
  if (session_.connected()) (void)session_.send(env.request_id, done);
  steps_.operated();
}

}  // namespace tmsdisk::shim
