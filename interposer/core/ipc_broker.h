// SPDX-License-Identifier: Apache-2.0
// Legacy CUDA IPC of the shim's own allocations, brokered by tmsdiskd (README.md, "Known
// limitations"): this rank's exchanges with the daemon. The hooks (ipc.cpp) call it from application
// threads, and each exchange runs on the control thread, serialized with pauses; the engine calls it
// there around a pause or resume. The exporter keeps the allocation resident while any process has it
// open, and revokes the daemon's fd before pausing it so that no old physical memory stays alive.
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <vector>

#include "control_thread.h"
#include "daemon_session.h"
#include "registry.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

class IpcBroker {
 public:
  // The session is read on `control`'s thread only; `op_lock` keeps frees out while an export is made.
  IpcBroker(DaemonSession& session, ControlThread& control, std::shared_mutex& op_lock)
      : session_(session), control_(control), op_lock_(op_lock) {}
  IpcBroker(const IpcBroker&) = delete;
  IpcBroker& operator=(const IpcBroker&) = delete;

  // Application threads.
  //
  // Shares `a`'s physical memory with the daemon (once; later calls return the same id).
  Result<uint64_t> share(const std::shared_ptr<Allocation>& a) noexcept;
  // Resolves an export id: its size, device and exporter, and the memory's fd.
  struct Opened {
    proto::IpcOpened info;
    UniqueFd fd;
  };
  Result<Opened> open(uint64_t export_id) noexcept;
  // Ends one open() of `export_id`.
  Status close(uint64_t export_id) noexcept;
  // The exported allocation was freed: the daemon forgets the export. Does not wait.
  void forget(uint64_t export_id) noexcept;

  // Control thread.
  //
  // Pause: drops the daemon's fds of exported allocations; those open elsewhere leave `resident`.
  void revoke(std::vector<std::shared_ptr<Allocation>>& resident, std::vector<std::shared_ptr<Allocation>>& revoked);
  // After a resume (or a pause that failed): hands the daemon the new physical memory of `a`.
  void refresh(Allocation& a) noexcept;
  // IPC_USERS: how many processes have an export open.
  void on_users(const proto::IpcUsers& m);
  // A new session: sends what waited for one, or, when the daemon kept nothing of the old session
  // (it restarted), forgets exports it no longer knows.
  void session_started(bool adopted);

 private:
  // Sends `m` now, or after the next reconnect when disconnected; no answer is awaited.
  void notify(const proto::Message& m);

  DaemonSession& session_;
  ControlThread& control_;
  std::shared_mutex& op_lock_;
  // IPC messages that found no session (a close, a forget): sent once the session is back.
  std::vector<proto::Message> pending_;
};

}  // namespace tmsdisk::shim
