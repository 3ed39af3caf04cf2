// SPDX-License-Identifier: Apache-2.0
// The pause/resume engine: one session with tmsdiskd, driven by one control thread that is the only
// reader of the socket. Commands from the daemon and the in-process C API share it.
//
// A pause first closes the gate (gate.h) and waits for gated calls in flight, then synchronizes
// every context it allocated on, then moves data; the gate opens again when nothing is paused.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "registry.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

struct OpResult {
  int code = 0;  // 0 or a positive errno value
  uint64_t bytes = 0;
  uint64_t nanos = 0;
  std::string message;
};

struct EngineStatus {
  proto::RankStats stats;
  RegistryTotals totals;
  bool connected = false;
  uint64_t session_id = 0;
  int last_error = 0;
  std::string last_message;
};

// The process-wide registry of allocations (never destroyed).
Registry& registry() noexcept;

// Starts (or joins) this user's private daemon when no system daemon is reachable and TMSDISK_SOCKET
// is unset (DESIGN.md, "Embedded default"). Returns 0 once it answers, else -errno (logged).
int start_private_daemon() noexcept;

class Engine {
 public:
  // The process's engine. Created on first use, never destroyed (the control thread may outlive
  // static destruction); replaced by a fresh one in a fork child. Null only if memory ran out.
  static Engine* instance() noexcept;
  // The engine if one was created, without creating it.
  static Engine* existing() noexcept;

  // Starts the control thread (which connects to the daemon) unless it runs. Cheap once started.
  void ensure_started() noexcept;

  // Runs a pause or resume on the control thread and waits for it. Returns 0 or -errno; -EBUSY
  // when another operation is running. `out` (optional) receives the details.
  int run(proto::CommandOp op, OpResult* out) noexcept;

  EngineStatus status() const;

  // Legacy CUDA IPC brokered by tmsdiskd (ipc.cpp). Called by application threads; each exchange
  // runs on the control thread, serialized with pauses. They return 0 or -errno with *why set.
  //
  // Shares `a`'s physical memory with the daemon (once; later calls return the same id).
  int ipc_export(const std::shared_ptr<Allocation>& a, uint64_t* export_id, std::string* why) noexcept;
  // Resolves an export id: its size, device and exporter (*out), and the memory's fd (*fd).
  int ipc_open(uint64_t export_id, proto::IpcOpened* out, UniqueFd* fd, std::string* why) noexcept;
  // Ends one ipc_open of `export_id`.
  int ipc_close(uint64_t export_id, std::string* why) noexcept;
  // The exported allocation was freed: the daemon forgets the export. Does not wait.
  void ipc_forget(uint64_t export_id) noexcept;

  // Frees of managed memory hold this shared; a pause or resume holds it exclusively.
  std::shared_mutex& op_lock() noexcept { return op_lock_; }

  // pthread_atfork handlers.
  static void fork_prepare() noexcept;
  static void fork_parent() noexcept;
  static void fork_child() noexcept;

  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  struct Request {
    proto::CommandOp op{};
    std::function<void()> task;  // set: other work for the control thread (IPC) instead of `op`
    bool detached = false;       // nobody waits: the control thread deletes it
    bool done = false;
    OpResult result;
  };
  enum class SlotState : uint8_t { Free, Copying, InDaemon, Lost };
  struct Slot {
    SlotState state = SlotState::Free;
    uint64_t request = 0;  // id of the Write/Read the daemon holds this slot for
    int job = -1;
    uint64_t offset = 0;
    uint32_t length = 0;
    int ctx = -1;
  };
  struct CtxResources {
    CUcontext ctx = nullptr;
    CUstream stream = nullptr;
    std::vector<CUevent> events;  // one per slot, created on first use
  };
  struct Job;

  // Runs `task` on the control thread; waits for it unless `wait` is false. -ESRCH if the thread
  // cannot be started, -ENOMEM if memory ran out (before or inside the task).
  int post(std::function<void()> task, bool wait) noexcept;
  // One request and its reply on the session, connecting first if needed; `fd` rides along and
  // *reply_fd receives one that comes back. An ErrorReply becomes -code with its message; `reply`
  // holds an ErrorReply only when the daemon sent one (not when the answer never came).
  int exchange(const proto::Message& m, int fd, proto::Envelope& reply, UniqueFd* reply_fd, std::string* why);
  // Pause: drops the daemon's fds of exported allocations; those open elsewhere leave `resident`.
  void ipc_revoke(std::vector<std::shared_ptr<Allocation>>& resident, std::vector<std::shared_ptr<Allocation>>& revoked);
  // After a resume (or a pause that failed): hands the daemon the new physical memory of `a`.
  void ipc_refresh(Allocation& a) noexcept;
  void on_ipc_users(const proto::IpcUsers& m);
  // A new session: sends what waited for one, or, when the daemon kept nothing of the old session
  // (it restarted), forgets exports it no longer knows.
  void ipc_session_started(bool adopted);
  // Sends `m` now, or after the next reconnect when disconnected; no answer is awaited.
  void ipc_notify(const proto::Message& m);

  static void* thread_main(void* self) noexcept;
  void control_loop();
  void serve_requests();
  void serve_socket();
  void serve_command(const proto::Envelope& env);
  OpResult execute(proto::CommandOp op, uint64_t command_request);
  OpResult pause(uint64_t command_request);
  OpResult resume(uint64_t command_request);
  OpResult resume_list(std::vector<std::shared_ptr<Allocation>> list, uint64_t command_request);
  // The last step of a pause or resume: the daemon syncs the data and commits its manifest. `done`
  // says what already happened (for the message of a failure); `bytes` is what moved.
  OpResult commit(proto::CommitState state, uint64_t generation, uint64_t bytes, const char* done);

  int connect_session(std::string* why);
  void drop_session(const char* why);
  void release_staging() noexcept;
  int send(uint64_t request_id, const proto::Message& body, int fd = -1);
  // The next message within `timeout_ms` (1), none (0) or -errno; a descriptor that came with it
  // goes to *fd when given, else is closed.
  int receive(proto::Envelope& env, int timeout_ms, UniqueFd* fd = nullptr);
  // The pause and resume loops' wait: the daemon's next message, or, while copies run and nothing
  // has arrived, the oldest copy's completion (then 0, so the caller harvests it instead of spinning).
  int next_message(proto::Envelope& env, bool copying);
  // The slot whose request the daemon answers with `request_id`, or -1 (an answer to something else).
  int slot_awaiting(uint64_t request_id) const noexcept;
  int await_reply(uint64_t request_id, proto::Envelope& reply, std::string* why, UniqueFd* fd = nullptr);
  void handle_other(const proto::Envelope& env);
  void send_report();
  void maybe_progress(uint64_t command_request, uint64_t done, uint64_t total, bool force);

  int ctx_index(CUcontext ctx, std::string* why);
  CUevent slot_event(int ctx, std::size_t slot, std::string* why);
  void register_staging(CUcontext ctx);
  int free_slot() const noexcept;
  void map_job(Job& j);
  void unmap_job(Job& j) noexcept;
  void set_state(proto::RankState s);
  proto::RankStats make_stats();

  // Shared with application threads (guarded by mu_).
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request*> queue_;
  bool thread_started_ = false;
  std::atomic<bool> started_{false};  // thread_started_, readable without the lock (allocation path)
  bool busy_ = false;
  int wake_fd_ = -1;
  proto::RankStats last_;  // state and last_* fields
  bool connected_ = false;
  uint64_t session_id_ = 0;
  int last_error_ = 0;
  std::string last_message_;
  std::shared_mutex op_lock_;

  // Control thread only.
  int sock_ = -1;
  uint64_t token_ = 0;
  uint8_t* staging_ = nullptr;
  std::size_t staging_bytes_ = 0;
  uint32_t slot_bytes_ = 0;
  std::vector<Slot> slots_;
  bool staging_registered_ = false;
  CUcontext registered_ctx_ = nullptr;
  std::vector<CtxResources> ctxs_;
  uint64_t next_request_ = 1;
  uint64_t generation_ = 0;
  bool committed_paused_ = false;  // the daemon's manifest holds a committed pause
  uint64_t reported_version_ = ~0ull;
  int64_t last_report_ms_ = 0;
  int64_t next_connect_ms_ = 0;
  int64_t connect_backoff_ms_ = 1000;
  bool unreachable_logged_ = false;
  int64_t last_progress_ms_ = 0;
  std::vector<uint8_t> rx_;
  // A pause or resume the daemon asked for while an IPC exchange waited for its reply: run next.
  std::optional<proto::Envelope> deferred_command_;
  // IPC messages that found no session (a close, a forget): sent once the session is back.
  std::vector<proto::Message> ipc_pending_;
};

}  // namespace tmsdisk::shim
