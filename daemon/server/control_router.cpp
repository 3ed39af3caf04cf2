// SPDX-License-Identifier: Apache-2.0
// The control router (control_router.h).
#include "control_router.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "chunk_io.h"

namespace tmsdisk::server {
namespace {

constexpr std::size_t kSessionsPerPage = 128;
// A ControlResult or Sessions page holds entries while their encoding fits the protocol's payload;
// this much is kept back for the page's own fields.
constexpr std::size_t kPageOverhead = 64;

// Whether `m` selects the rank of process `pid`, job `job`, rank `rank`.
bool selects(const proto::Control& m, const std::string& job, int64_t rank, pid_t pid) {
  return (m.match & proto::kMatchAll) ||
         (!((m.match & proto::kMatchJob) && job != m.job) && !((m.match & proto::kMatchRank) && rank != m.rank) &&
          !((m.match & proto::kMatchPid) && pid != m.pid));
}

}  // namespace

void ControlRouter::list_sessions(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::ListSessions& m) {
  proto::Sessions out;
  std::vector<const Session*> visible;
  // Orphans too: they hold files and count against max-sessions-per-uid, so the user must see them.
  // Only a session whose shim just went, waiting for its I/O before it closes or turns orphan, is left out.
  out.host_tier_budget_bytes = sessions_.host_tier_budget();
  out.host_tier_used_bytes = sessions_.host_tier_used();
  for (auto& [id, s] : sessions_.all()) {
    if (may_act_on(uid, s) && (s.conn_id != 0 || s.orphan)) visible.push_back(&s);
  }
  out.total = static_cast<uint32_t>(visible.size());
  // Paged by count and by size: a rank's stats list its damaged ranges, so an entry's size varies.
  std::size_t bytes = kPageOverhead;
  for (std::size_t i = m.start; i < visible.size() && out.sessions.size() < kSessionsPerPage; ++i) {
    const Session& s = *visible[i];
    proto::SessionInfo info;
    info.session_id = s.id;
    info.pid = s.cred.pid;
    info.uid = s.cred.uid;
    info.rank = s.rank;
    info.job = s.job;
    info.disk_bytes = s.store->disk_bytes();
    info.stats = s.stats;
    info.orphaned = s.orphan ? 1 : 0;
    info.orphaned_unix_ms = s.orphan ? s.orphaned_unix_ms : 0;
    info.host_tier_bytes = s.host_tier.bytes;
    info.host_tier_kept = s.host_tier_kept && s.host_tier.bytes ? 1 : 0;
    if (s.objects) {
      info.objects = static_cast<uint32_t>(std::min<std::size_t>(s.objects->object_count(), UINT32_MAX));
      info.object_bytes = s.objects->disk_bytes();
    }
    info.object_host_bytes = object_host_bytes(s);
    const std::size_t size = proto::encoded_size(info);
    if (!out.sessions.empty() && bytes + size > proto::kMaxPayload) break;
    bytes += size;
    out.sessions.push_back(std::move(info));
  }
  send_(conn_id, request_id, out);
}

void ControlRouter::control(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::Control& m) {
  const bool busy =
      std::any_of(ops_.begin(), ops_.end(), [&](const auto& kv) { return kv.second.conn_id == conn_id; }) ||
      std::any_of(parked_.begin(), parked_.end(), [&](const Parked& p) { return p.conn_id == conn_id; });
  if (busy)
    return send_(conn_id, request_id,
                 error_reply(EBUSY, "this connection already waits for a pause or resume; one at a time"));
  auto openings = sessions_.openings_where([&](const ucred& cred, const std::string& job, int64_t rank) {
    return (uid == 0 || uid == cred.uid) && selects(m, job, rank, cred.pid);
  });
  if (openings.empty()) return start(conn_id, uid, request_id, m);
  parked_.push_back(Parked{conn_id, uid, request_id, m, {openings.begin(), openings.end()}});
}

void ControlRouter::opening_done(uint64_t conn_id) {
  std::vector<Parked> ready;
  for (auto it = parked_.begin(); it != parked_.end();) {
    it->openings.erase(conn_id);
    if (it->openings.empty()) {
      ready.push_back(std::move(*it));
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
  for (const Parked& p : ready) start(p.conn_id, p.uid, p.request_id, p.request);
}

void ControlRouter::start(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::Control& m) {
  Op op;
  op.id = next_op_++;
  op.conn_id = conn_id;
  op.request_id = request_id;
  if (m.timeout_ms) op.deadline = Clock::now() + std::chrono::milliseconds(m.timeout_ms);
  std::size_t denied = 0, orphaned = 0;
  for (auto& [sid, s] : sessions_.all()) {
    if ((s.conn_id == 0 && !s.orphan) || !selects(m, s.job, s.rank, s.cred.pid)) continue;
    if (!may_act_on(uid, s)) {
      ++denied;
      continue;
    }
    if (s.orphan) {  // nothing to send a COMMAND on
      ++orphaned;
      continue;
    }
    op.waiting.insert(sid);
    op.asked.emplace(sid, proto::RankTarget{.session_id = sid, .pid = s.cred.pid, .rank = s.rank, .job = s.job});
  }
  if (op.waiting.empty()) {
    if (denied)
      return send_(conn_id, request_id,
                   error_reply(EPERM, fmt::format("{} matching rank(s) belong to other users; only root or their "
                                                  "owner may pause or resume them",
                                                  denied)));
    if (orphaned)
      return send_(conn_id, request_id,
                   error_reply(ENOTCONN, fmt::format("the {} matching rank(s) lost their connection to tmsdiskd "
                                                     "(orphaned in `tmsctl status`); they can be paused or resumed "
                                                     "once they reconnect",
                                                     orphaned)));
    return send_(conn_id, request_id, error_reply(ENOENT, "no running rank matches; see `tmsctl status`"));
  }
  // Who was asked goes out before any answer can (the answers come in on later turns of the loop),
  // sorted as tmsctl prints them.
  std::vector<proto::RankTarget> targets;
  targets.reserve(op.asked.size());
  for (auto& [sid, t] : op.asked) targets.push_back(t);
  std::sort(targets.begin(), targets.end(), [](const auto& a, const auto& b) {
    return a.job != b.job ? a.job < b.job : a.rank != b.rank ? a.rank < b.rank : a.pid < b.pid;
  });
  for (std::size_t i = 0; i < targets.size();) {
    proto::ControlTargets page;
    const std::size_t end = std::min(targets.size(), i + proto::kTargetsPerPage);
    page.ranks.assign(targets.begin() + static_cast<std::ptrdiff_t>(i),
                      targets.begin() + static_cast<std::ptrdiff_t>(end));
    i = end;
    page.last = i >= targets.size() ? 1 : 0;
    send_(conn_id, request_id, page);
  }
  const uint64_t op_id = op.id;
  auto waiting = op.waiting;
  ops_.emplace(op_id, std::move(op));
  for (uint64_t sid : waiting) {
    Session& s = *sessions_.find(sid);
    proto::Command cmd;
    cmd.op = m.op;
    cmd.flags = m.flags;
    cmd.tag = m.tag;
    const uint64_t cmd_id = proto::kDaemonRequestBit | next_command_++;
    s.commands.emplace(cmd_id, op_id);
    if (metrics_) metrics_->command_sent(cmd_id, sid, static_cast<proto::CommandOp>(cmd.op));
    send_(s.conn_id, cmd_id, cmd);
  }
}

void ControlRouter::command_done(Session& s, uint64_t command_id, const proto::CommandDone& m) {
  if (metrics_) metrics_->command_answered(command_id, m);  // before the result goes on: then it is counted
  auto it = s.commands.find(command_id);
  if (it == s.commands.end()) return;  // the tmsctl that asked has gone; nothing to forward
  const uint64_t op_id = it->second;
  s.commands.erase(it);
  finish_rank(op_id, s.id, m);
}

void ControlRouter::progress(Session& s, uint64_t command_id, proto::Progress& m) {
  auto it = s.commands.find(command_id);
  if (it == s.commands.end()) return;
  auto op = ops_.find(it->second);
  if (op == ops_.end()) return;
  m.session_id = s.id;
  send_(op->second.conn_id, op->second.request_id, m);
}

void ControlRouter::session_lost(Session& s) {
  if (metrics_) metrics_->session_lost(s.id);
  proto::CommandDone lost;
  lost.code = ECONNRESET;
  lost.message = "the rank exited or lost its connection before answering";
  lost.outcome = static_cast<uint8_t>(proto::Outcome::Done);
  for (auto& [cmd, op_id] : s.commands) finish_rank(op_id, s.id, lost);
  s.commands.clear();
}

void ControlRouter::connection_closed(uint64_t conn_id) {
  std::erase_if(parked_, [&](const Parked& p) { return p.conn_id == conn_id; });
  // Nobody reads the results any more: the operation goes, and so do its COMMANDs' entries at the
  // ranks, whose answers would otherwise find a stale entry (or, worse, keep it forever).
  for (auto op = ops_.begin(); op != ops_.end();) {
    if (op->second.conn_id == conn_id) {
      forget_commands(op->first);
      op = ops_.erase(op);
    } else {
      ++op;
    }
  }
}

void ControlRouter::forget_commands(uint64_t op_id) {
  for (auto& [sid, s] : sessions_.all()) std::erase_if(s.commands, [&](const auto& kv) { return kv.second == op_id; });
}

void ControlRouter::finish_rank(uint64_t op_id, uint64_t sid, const proto::CommandDone& answer) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  Op& op = it->second;
  if (!op.waiting.erase(sid)) return;
  const proto::RankTarget& who = op.asked.at(sid);
  proto::RankResult r;
  r.session_id = sid;
  r.pid = who.pid;
  r.rank = who.rank;
  r.job = who.job;
  r.code = answer.code;
  r.bytes = answer.bytes;
  r.nanos = answer.nanos;
  // The rank's whole message (it is bounded by kMaxTextLength, as is a result's text): a refusal
  // cut mid-sentence leaves the user without its advice.
  r.message = answer.message.substr(0, proto::kMaxResultText);
  r.outcome = answer.outcome;
  r.skipped = answer.skipped;
  // Its own page, now: a result at most kMaxResultText long always fits in one.
  proto::ControlResult page;
  page.results.push_back(std::move(r));
  page.last = op.waiting.empty() ? 1 : 0;
  send_(op.conn_id, op.request_id, page);
  if (op.waiting.empty()) ops_.erase(it);
}

int ControlRouter::expire() {
  const auto now = Clock::now();
  auto next = Clock::time_point::max();
  for (auto it = ops_.begin(); it != ops_.end();) {
    Op& op = it->second;
    if (op.deadline <= now) {
      // The ranks still silent get no result: tmsctl names them from CONTROL_TARGETS, as ranks that
      // did not answer (they may still finish; `tmsctl status` shows their state).
      forget_commands(it->first);
      send_(op.conn_id, op.request_id, proto::ControlResult{.last = 1, .results = {}});
      it = ops_.erase(it);
    } else {
      next = std::min(next, op.deadline);
      ++it;
    }
  }
  if (next == Clock::time_point::max()) return -1;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
  return static_cast<int>(std::min<int64_t>(ms, INT32_MAX));  // deadlines may be weeks away
}

}  // namespace tmsdisk::server
