// SPDX-License-Identifier: Apache-2.0
// The shim's control thread and its request queue. Application threads post pauses, resumes (the C
// API, an automatic resume) and other work (legacy IPC exchanges); the daemon sends commands on the
// session. The thread runs them one at a time, the only reader of the session, and between them
// keeps the session open; what each request does is the engine's (ControlSteps).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "daemon_session.h"
#include "op_result.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

// What the control thread does, step by step; the engine supplies each.
struct ControlSteps {
  // A pause or resume: `command_request` is the daemon's command it answers (0: this process asked).
  std::function<OpResult(proto::CommandOp op, uint8_t flags, uint64_t command_request, const std::string& tag)> operate;
  // After an operation, once its answer is out.
  std::function<void()> operated;
  // Each turn while no session is open, before a connect attempt is due.
  std::function<void()> disconnected;
  // Each turn, once what woke the thread is served; a command the daemon sent meanwhile runs after it.
  std::function<void()> idle;
  // Each turn, last.
  std::function<void()> report;
};

class ControlThread {
 public:
  ControlThread(DaemonSession& session, ControlSteps steps) : session_(session), steps_(std::move(steps)) {}
  ControlThread(const ControlThread&) = delete;
  ControlThread& operator=(const ControlThread&) = delete;

  // Starts the thread (which connects to the daemon) unless it runs. Cheap once started.
  void start() noexcept;
  // Runs a pause or resume on the thread and waits for it; EBUSY when another operation is running.
  Status run(proto::CommandOp op, uint8_t flags, std::string tag) noexcept;
  // Runs `task` on the thread; waits for it unless `wait` is false. -ESRCH if the thread cannot be
  // started, -ENOMEM if memory ran out (before or inside the task).
  int post(std::function<void()> task, bool wait) noexcept;
  // Runs `task` on the thread and waits for it: the task's status, or why it could not run.
  Status call(const std::function<Status()>& task) noexcept {
    Status rc;
    const int posted = post([&] { rc = task(); }, true);
    if (posted < 0) return make_error(-posted, {});
    return rc;
  }
  // The session's handler of a command that came while the thread awaited another reply (an IPC
  // exchange, a host-tier ask): it runs right after, unless an operation is running (then EBUSY).
  void command_while_waiting(const proto::Envelope& env);

  // pthread_atfork: the queue is not changing while the process forks; a child drops the thread's
  // wake-up descriptor (it has no thread).
  void lock_for_fork() noexcept { mu_.lock(); }
  void unlock_after_fork() noexcept { mu_.unlock(); }
  void forget_after_fork() noexcept;

 private:
  struct Request {
    proto::CommandOp op{};
    uint8_t flags = 0;           // proto::kAcceptLoss
    std::string tag;             // empty: every allocation
    std::function<void()> task;  // set: other work for the control thread (IPC) instead of `op`
    bool detached = false;       // nobody waits: the control thread deletes it
    bool done = false;
    OpResult result;
  };

  static void* thread_main(void* self) noexcept;
  void wake() noexcept;
  void loop();
  void serve_requests();
  void serve_socket();
  void serve_command(const proto::Envelope& env);
  void serve_deferred_command();

  DaemonSession& session_;
  const ControlSteps steps_;

  // Shared with application threads (guarded by mu_).
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request*> queue_;
  bool thread_started_ = false;
  std::atomic<bool> started_{false};  // thread_started_, readable without the lock (allocation path)
  bool busy_ = false;
  int wake_fd_ = -1;

  // Control thread only: a pause or resume the daemon asked for while an IPC exchange or a host-tier
  // ask ahead waited for its reply: run next (serve_deferred_command).
  std::optional<proto::Envelope> deferred_command_;
};

}  // namespace tmsdisk::shim
