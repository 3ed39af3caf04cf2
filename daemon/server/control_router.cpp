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

}  // namespace

void ControlRouter::list_sessions(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::ListSessions& m) {
  proto::Sessions out;
  std::vector<const Session*> visible;
  for (auto& [id, s] : sessions_.all())
    if (may_act_on(uid, s) && s.conn_id != 0) visible.push_back(&s);
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
    const std::size_t size = proto::encoded_size(info);
    if (!out.sessions.empty() && bytes + size > proto::kMaxPayload) break;
    bytes += size;
    out.sessions.push_back(std::move(info));
  }
  send_(conn_id, request_id, out);
}

void ControlRouter::control(uint64_t conn_id, uid_t uid, uint64_t request_id, const proto::Control& m) {
  for (auto& [id, other] : ops_)
    if (other.conn_id == conn_id)
      return send_(conn_id, request_id,
                   error_reply(EBUSY, "this connection already waits for a pause or resume; one at a time"));
  Op op;
  op.id = next_op_++;
  op.conn_id = conn_id;
  op.request_id = request_id;
  if (m.timeout_ms) op.deadline = Clock::now() + std::chrono::milliseconds(m.timeout_ms);
  std::size_t denied = 0;
  for (auto& [sid, s] : sessions_.all()) {
    if (s.conn_id == 0) continue;
    const bool match = (m.match & proto::kMatchAll) || (!((m.match & proto::kMatchJob) && s.job != m.job) &&
                                                        !((m.match & proto::kMatchRank) && s.rank != m.rank) &&
                                                        !((m.match & proto::kMatchPid) && s.cred.pid != m.pid));
    if (!match) continue;
    if (!may_act_on(uid, s)) {
      ++denied;
      continue;
    }
    op.waiting.insert(sid);
    proto::RankResult r;
    r.session_id = sid;
    r.pid = s.cred.pid;
    r.rank = s.rank;
    r.job = s.job;
    op.results.emplace(sid, r);
  }
  if (op.waiting.empty()) {
    if (denied)
      return send_(conn_id, request_id,
                   error_reply(EPERM, fmt::format("{} matching rank(s) belong to other users; only root or their "
                                                  "owner may pause or resume them",
                                                  denied)));
    return send_(conn_id, request_id, error_reply(ENOENT, "no running rank matches; see `tmsctl status`"));
  }
  const uint64_t op_id = op.id;
  auto waiting = op.waiting;
  ops_.emplace(op_id, std::move(op));
  for (uint64_t sid : waiting) {
    Session& s = *sessions_.find(sid);
    proto::Command cmd;
    cmd.op = m.op;
    cmd.flags = m.flags;
    const uint64_t cmd_id = next_command_++;
    s.commands.emplace(cmd_id, op_id);
    send_(s.conn_id, cmd_id, cmd);
  }
}

void ControlRouter::command_done(Session& s, uint64_t command_id, const proto::CommandDone& m) {
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
  proto::CommandDone lost;
  lost.code = ECONNRESET;
  lost.message = "the rank exited or lost its connection before answering";
  lost.outcome = static_cast<uint8_t>(proto::Outcome::Done);
  for (auto& [cmd, op_id] : s.commands) finish_rank(op_id, s.id, lost);
  s.commands.clear();
}

void ControlRouter::connection_closed(uint64_t conn_id) {
  for (auto op = ops_.begin(); op != ops_.end();) {
    if (op->second.conn_id == conn_id) {
      for (auto& [sid, s] : sessions_.all())
        std::erase_if(s.commands, [&](const auto& kv) { return kv.second == op->first; });
      op = ops_.erase(op);
    } else {
      ++op;
    }
  }
}

void ControlRouter::finish_rank(uint64_t op_id, uint64_t sid, const proto::CommandDone& answer) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  Op& op = it->second;
  if (!op.waiting.erase(sid)) return;
  auto& r = op.results[sid];
  r.code = answer.code;
  r.bytes = answer.bytes;
  r.nanos = answer.nanos;
  // The rank's whole message (it is bounded by kMaxTextLength, as is a result's text): a refusal
  // cut mid-sentence leaves the user without its advice (issue 8).
  r.message = answer.message.substr(0, proto::kMaxResultText);
  r.outcome = answer.outcome;
  if (op.waiting.empty()) complete(it);
}

// Results go back sorted, in as many pages as their size needs: each page fits in one message.
void ControlRouter::complete(std::map<uint64_t, Op>::iterator it) {
  Op& op = it->second;
  std::vector<proto::RankResult> all;
  all.reserve(op.results.size());
  for (auto& [sid, r] : op.results) all.push_back(r);
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
    return a.job != b.job ? a.job < b.job : a.rank != b.rank ? a.rank < b.rank : a.pid < b.pid;
  });
  std::size_t i = 0;
  do {
    proto::ControlResult out;
    std::size_t bytes = kPageOverhead;
    while (i < all.size()) {
      const std::size_t size = proto::encoded_size(all[i]);
      if (!out.results.empty() && bytes + size > proto::kMaxPayload) break;
      bytes += size;
      out.results.push_back(std::move(all[i++]));
    }
    out.last = i >= all.size() ? 1 : 0;
    send_(op.conn_id, op.request_id, out);
  } while (i < all.size());
  ops_.erase(it);
}

int ControlRouter::expire() {
  const auto now = Clock::now();
  auto next = Clock::time_point::max();
  for (auto it = ops_.begin(); it != ops_.end();) {
    auto cur = it++;
    Op& op = cur->second;
    if (op.deadline <= now) {
      for (uint64_t sid : std::vector<uint64_t>(op.waiting.begin(), op.waiting.end())) {
        if (Session* s = sessions_.find(sid))
          std::erase_if(s->commands, [&](const auto& kv) { return kv.second == cur->first; });
        auto& r = op.results[sid];
        r.code = ETIMEDOUT;
        r.message = "no answer before the timeout; the rank may still finish";
        r.outcome = static_cast<uint8_t>(proto::Outcome::Done);  // asked, unanswered: not known to be a no-op
      }
      op.waiting.clear();
      complete(cur);
    } else {
      next = std::min(next, op.deadline);
    }
  }
  if (next == Clock::time_point::max()) return -1;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
  return static_cast<int>(std::min<int64_t>(ms, INT32_MAX));  // deadlines may be weeks away
}

}  // namespace tmsdisk::server
