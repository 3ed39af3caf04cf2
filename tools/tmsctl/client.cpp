// SPDX-License-Identifier: Apache-2.0
// tmsctl's connection to tmsdiskd: HELLO, then one request at a time, every wait bounded.
#include "client.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::ctl {
namespace {

// Waits until `fd` is ready for `events` or `deadline` passes: 0, -ETIMEDOUT, or another negative
// errno. Once the deadline has passed it still takes what is ready now, so that answers that came in
// time are never left unread.
int wait_for(int fd, short events, const Deadline& deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, deadline.poll_ms());
    if (n > 0) return 0;  // ready, or hung up: the read or write that follows says which
    if (n == 0) return -ETIMEDOUT;
    if (errno != EINTR) return -errno;
  }
}

// The order tmsctl prints ranks in.
template <class T>
void sort_by_rank(std::vector<T>& v) {
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    return a.job != b.job ? a.job < b.job : a.rank != b.rank ? a.rank < b.rank : a.pid < b.pid;
  });
}

}  // namespace

Error Client::silent_daemon(const Deadline& deadline) const {
  return make_error(ETIMEDOUT, "tmsdiskd at " + path_ + " did not answer within " + deadline.seconds_text() +
                                   "; is it stopped or overloaded? see `systemctl status tmsdiskd` or its log "
                                   "(--timeout S waits longer)");
}

Result<Client> Client::connect(const std::string& socket_path, const Deadline& deadline) {
  Client c(UniqueFd(), socket_path);
  int fd = proto::connect_seqpacket(socket_path, deadline.poll_ms());
  if (fd == -ETIMEDOUT) return c.silent_daemon(deadline);  // its backlog is full: it accepts nobody
  if (fd < 0) {
    std::string hint = (fd == -ENOENT || fd == -ECONNREFUSED)
                           ? "is tmsdiskd running? start it with `systemctl start tmsdiskd` or use `tmsctl run`, "
                             "or point TMSDISK_SOCKET/--socket at its socket"
                           : "check the path and its permissions";
    return make_error(-fd,
                      "cannot connect to tmsdiskd at " + socket_path + ": " + std::strerror(-fd) + " (" + hint + ")");
  }
  c.fd_.reset(fd);
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  auto welcome = proto::say_hello(fd, hello, deadline.poll_ms(), c.next_request_);
  if (!welcome && !welcome.refused && welcome.error == ETIMEDOUT) return c.silent_daemon(deadline);
  if (!welcome)
    return make_error(welcome.error, welcome.refused ? welcome.message
                                                     : "tmsdiskd at " + socket_path + ": " + welcome.message + ": " +
                                                           std::strerror(welcome.error));
  c.welcome_ = welcome.welcome;
  return c;
}

Status Client::send(const proto::Message& m, const Deadline& deadline) {
  auto bytes = proto::encode(next_request_, m);
  if (bytes.empty()) return make_error(EINVAL, "request does not fit in a protocol message");
  // A daemon that reads nothing fills its socket's queue, and a send would then wait for it.
  if (int rc = wait_for(fd_.get(), POLLOUT, deadline); rc == -ETIMEDOUT) return silent_daemon(deadline);
  int rc = proto::send_message(fd_.get(), bytes);
  if (rc < 0) return make_error(-rc, "cannot send to tmsdiskd at " + path_ + ": " + std::strerror(-rc));
  return {};
}

Result<proto::Message> Client::receive(const Deadline& deadline) {
  std::vector<uint8_t> buf;
  for (;;) {
    if (int rc = wait_for(fd_.get(), POLLIN, deadline); rc < 0) {
      if (rc == -ETIMEDOUT) return silent_daemon(deadline);
      return make_error(-rc, "cannot wait for tmsdiskd at " + path_ + ": " + std::strerror(-rc));
    }
    long n = proto::recv_message(fd_.get(), buf);
    if (n == 0) return make_error(ECONNRESET, "tmsdiskd at " + path_ + " closed the connection (see its log)");
    if (n < 0)
      return make_error(static_cast<int>(-n),
                        "cannot read from tmsdiskd at " + path_ + ": " + std::strerror(static_cast<int>(-n)));
    auto d = proto::decode(buf);
    if (!d.envelope) return make_error(d.code, "bad message from tmsdiskd: " + d.error);
    if (d.envelope->request_id != next_request_ && d.envelope->request_id != 0) continue;  // stale answer
    if (auto* e = std::get_if<proto::ErrorReply>(&d.envelope->body)) return make_error(e->code, e->message);
    return std::move(d.envelope->body);
  }
}

Result<std::vector<proto::SessionInfo>> Client::list_sessions(const Deadline& deadline, HostTier* host_tier) {
  std::vector<proto::SessionInfo> all;
  for (;;) {
    ++next_request_;
    proto::ListSessions req;
    req.start = static_cast<uint32_t>(all.size());
    if (auto st = send(req, deadline); !st) return std::move(st).error();
    auto reply = receive(deadline);
    if (!reply) return std::move(reply).error();
    auto* page = std::get_if<proto::Sessions>(&*reply);
    if (!page) return make_error(EPROTO, "unexpected answer to LIST_SESSIONS");
    if (host_tier) *host_tier = {page->host_tier_budget_bytes, page->host_tier_used_bytes};
    for (auto& s : page->sessions) all.push_back(std::move(s));
    if (page->sessions.empty() || all.size() >= page->total) return all;
  }
}

Result<ControlAnswer> Client::control(const proto::Control& request, Deadline deadline,
                                      const std::function<void(const proto::Progress&)>& progress,
                                      const Waiting& waiting) {
  ++next_request_;
  if (auto st = send(request, deadline); !st) return std::move(st).error();
  deadline.heard();                             // a silence limit counts from the request
  std::map<uint64_t, proto::RankTarget> asked;  // by session id
  bool asked_all = false;                       // the last CONTROL_TARGETS page came
  std::map<uint64_t, proto::RankResult> answered;
  auto last_heard = Deadline::Clock::now();
  for (;;) {
    // Waiting is told in steps of a second: each one that passes in silence before the deadline.
    constexpr std::chrono::milliseconds kWaitingStep{1000};
    const bool step = waiting && asked_all && deadline.poll_ms() > kWaitingStep.count();
    auto reply = receive(step ? Deadline::fixed(kWaitingStep) : deadline);
    if (!reply && step && reply.error().errnum() == ETIMEDOUT) {
      std::vector<proto::RankTarget> silent;
      for (const auto& [sid, t] : asked)
        if (!answered.count(sid)) silent.push_back(t);
      sort_by_rank(silent);
      waiting(silent, std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::Clock::now() - last_heard));
      continue;
    }
    if (!reply) {
      // Until the daemon has said whom it asked, its silence is the daemon's failure; after, the
      // ranks without an answer are named.
      if (reply.error().errnum() == ETIMEDOUT && asked_all) break;
      return std::move(reply).error();
    }
    deadline.heard();
    last_heard = Deadline::Clock::now();
    if (auto* p = std::get_if<proto::Progress>(&*reply)) {
      if (progress) progress(*p);
      continue;
    }
    if (auto* t = std::get_if<proto::ControlTargets>(&*reply)) {
      for (auto& x : t->ranks) asked.emplace(x.session_id, std::move(x));
      asked_all = t->last != 0;
      continue;
    }
    auto* r = std::get_if<proto::ControlResult>(&*reply);
    if (!r) return make_error(EPROTO, "unexpected answer to CONTROL");
    for (auto& x : r->results) answered.insert_or_assign(x.session_id, std::move(x));
    if (r->last) break;
  }
  ControlAnswer out;
  for (auto& [sid, r] : answered) out.results.push_back(std::move(r));
  for (auto& [sid, t] : asked)
    if (!answered.count(sid)) out.unanswered.push_back(std::move(t));
  sort_by_rank(out.results);
  sort_by_rank(out.unanswered);
  return out;
}

Result<proto::GcResult> Client::gc(const Deadline& deadline) {
  ++next_request_;
  if (auto st = send(proto::Gc{}, deadline); !st) return std::move(st).error();
  auto reply = receive(deadline);
  if (!reply) return std::move(reply).error();
  auto* r = std::get_if<proto::GcResult>(&*reply);
  if (!r) return make_error(EPROTO, "unexpected answer to GC");
  return *r;
}

}  // namespace tmsdisk::ctl
