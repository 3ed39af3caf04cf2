// SPDX-License-Identifier: Apache-2.0
// The rank's figures and state as the daemon and tmsdisk_status see them: what the last pause and
// resume did, the last error, the session, and the REPORT that carries them to tmsdiskd when the
// registry changes. Read by application threads (status), written by the control thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "daemon_session.h"
#include "op_result.h"
#include "registry.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

struct EngineStatus {
  proto::RankStats stats;
  RegistryTotals totals;
  bool connected = false;
  uint64_t session_id = 0;
  int last_error = 0;
  std::string last_message;
};

// The state (running, paused, partially paused) that `t` amounts to between operations.
proto::RankState settled_state(const RegistryTotals& t) noexcept;

class RankReport {
 public:
  explicit RankReport(DaemonSession& session) : session_(session) {}
  RankReport(const RankReport&) = delete;
  RankReport& operator=(const RankReport&) = delete;

  EngineStatus status() const;
  // The state an operation is in (pausing, resuming), or settled to; sends nothing.
  void set_state(proto::RankState s);
  // After an operation: the state it left, its figures unless it was a no-op, what it said.
  void record(bool pausing, const OpResult& r);
  void session_opened(uint64_t session_id);
  void session_closed();
  // Sends the REPORT now; or only when the registry changed and the last one is a report interval old.
  void send();
  void send_if_due();

  // pthread_atfork: the figures are not changing while the process forks.
  void lock_for_fork() noexcept { mu_.lock(); }
  void unlock_after_fork() noexcept { mu_.unlock(); }

 private:
  proto::RankStats make_stats() const;

  DaemonSession& session_;
  // Shared with application threads (guarded by mu_).
  mutable std::mutex mu_;
  proto::RankStats last_;  // state and last_* fields
  bool connected_ = false;
  uint64_t session_id_ = 0;
  int last_error_ = 0;
  std::string last_message_;
  // Control thread only.
  uint64_t reported_version_ = ~0ull;
  int64_t last_report_ms_ = 0;
};

}  // namespace tmsdisk::shim
