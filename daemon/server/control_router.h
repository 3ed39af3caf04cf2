// SPDX-License-Identifier: Apache-2.0
// The control router: a tmsctl's pause or resume fanned out to the matching sessions as COMMANDs,
// their progress and results routed back. tmsctl first hears which ranks were asked (CONTROL_TARGETS),
// then each rank's result as soon as it answers, so that one rank that never answers holds back no
// other's result, and a tmsctl that gives up at its own deadline can print every answer it has and
// name the ranks still silent. Also lists sessions for `tmsctl status`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "metrics_observer.h"
#include "session_table.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

class ControlRouter {
 public:
  using Clock = std::chrono::steady_clock;
  // Sends `m` as the answer to `request_id` on connection `conn_id` (dropped if it has gone).
  using Send = std::function<void(uint64_t conn_id, uint64_t request_id, const proto::Message& m)>;

  ControlRouter(SessionTable& sessions, Send send) : sessions_(sessions), send_(std::move(send)) {}

  // Counts each COMMAND's result there (metrics.h), answered or lost, whoever still waits for it.
  void set_metrics(MetricsObserver* metrics) noexcept { metrics_ = metrics; }

  // A tmsctl's requests, on connection `conn_id` of a client of uid `uid`.
  void list_sessions(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::ListSessions& m);
  // A pause or resume first waits for the HELLOs being served (their staging buffers are built off
  // the event loop) of ranks it would ask, so that a rank that said HELLO before it is asked too,
  // as when HELLOs were answered at once. It does not wait for HELLOs that come after it, which
  // could otherwise hold it back forever.
  void control(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::Control& m);
  // The HELLO on connection `conn_id` was answered (a session, or a refusal) or its client left.
  void opening_done(uint64_t conn_id);

  // A rank's answers to the COMMAND with request id `command_id`.
  void command_done(Session& s, uint64_t command_id, const proto::CommandDone& m);
  void progress(Session& s, uint64_t command_id, proto::Progress& m);

  // The rank's connection closed: what it was asked fails.
  void session_lost(Session& s);
  // A tmsctl that went away no longer waits for its results.
  void connection_closed(uint64_t conn_id);

  // Ends the operations whose deadline (Control.timeout_ms) passed: their last page goes out without
  // the ranks still silent, and their late answers are dropped. Returns ms until the next deadline,
  // or -1.
  int expire();

 private:
  struct Op {
    uint64_t id = 0;
    uint64_t conn_id = 0;
    uint64_t request_id = 0;
    std::map<uint64_t, proto::RankTarget> asked;  // by session id
    std::set<uint64_t> waiting;                   // session ids that have not answered
    Clock::time_point deadline = Clock::time_point::max();
  };

  // A pause or resume waiting for HELLOs being served (connection ids) before it starts.
  struct Parked {
    uint64_t conn_id = 0;
    uid_t uid = 0;
    uint64_t request_id = 0;
    proto::Control request;
    std::set<uint64_t> openings;
  };

  void start(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::Control& m);
  // Sends the rank's answer, or the one the daemon gives for a rank that cannot answer (Done, with
  // the reason's code: it was asked, and nothing says it found nothing to do), on its own page; the
  // page of the last rank ends the operation.
  void finish_rank(uint64_t op_id, uint64_t sid, const proto::CommandDone& answer);
  // Drops the COMMANDs of `op_id` still pending at the ranks: an answer that comes later is not routed.
  void forget_commands(uint64_t op_id);

  SessionTable& sessions_;
  Send send_;
  std::map<uint64_t, Op> ops_;
  std::vector<Parked> parked_;
  uint64_t next_op_ = 1;
  uint64_t next_command_ = 1;
  MetricsObserver* metrics_ = nullptr;
};

}  // namespace tmsdisk::server
