// SPDX-License-Identifier: Apache-2.0
// tmsctl's connection to tmsdiskd: HELLO, then one request at a time.
#include "client.h"

#include <cstring>

#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::ctl {

Result<Client> Client::connect(const std::string& socket_path) {
  int fd = proto::connect_seqpacket(socket_path);
  if (fd < 0) {
    std::string hint = (fd == -ENOENT || fd == -ECONNREFUSED)
                           ? "is tmsdiskd running? start it with `systemctl start tmsdiskd` or use `tmsctl run`, "
                             "or point TMSDISK_SOCKET/--socket at its socket"
                           : "check the path and its permissions";
    return make_error(-fd,
                      "cannot connect to tmsdiskd at " + socket_path + ": " + std::strerror(-fd) + " (" + hint + ")");
  }
  Client c(UniqueFd(fd), socket_path);
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  // No time limit, as for every other answer tmsctl waits for: a pause may legitimately take long.
  auto welcome = proto::say_hello(fd, hello, -1, c.next_request_);
  if (!welcome)
    return make_error(welcome.error, welcome.refused ? welcome.message
                                                     : "tmsdiskd at " + socket_path + ": " + welcome.message + ": " +
                                                           std::strerror(welcome.error));
  c.welcome_ = welcome.welcome;
  return c;
}

Status Client::send(const proto::Message& m) {
  auto bytes = proto::encode(next_request_, m);
  if (bytes.empty()) return make_error(EINVAL, "request does not fit in a protocol message");
  int rc = proto::send_message(fd_.get(), bytes);
  if (rc < 0) return make_error(-rc, "cannot send to tmsdiskd at " + path_ + ": " + std::strerror(-rc));
  return {};
}

Result<proto::Message> Client::receive() {
  std::vector<uint8_t> buf;
  for (;;) {
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

Result<std::vector<proto::SessionInfo>> Client::list_sessions() {
  std::vector<proto::SessionInfo> all;
  for (;;) {
    ++next_request_;
    proto::ListSessions req;
    req.start = static_cast<uint32_t>(all.size());
    if (auto st = send(req); !st) return std::move(st).error();
    auto reply = receive();
    if (!reply) return std::move(reply).error();
    auto* page = std::get_if<proto::Sessions>(&*reply);
    if (!page) return make_error(EPROTO, "unexpected answer to LIST_SESSIONS");
    for (auto& s : page->sessions) all.push_back(std::move(s));
    if (page->sessions.empty() || all.size() >= page->total) return all;
  }
}

Result<std::vector<proto::RankResult>> Client::control(const proto::Control& request,
                                                       const std::function<void(const proto::Progress&)>& progress) {
  ++next_request_;
  if (auto st = send(request); !st) return std::move(st).error();
  std::vector<proto::RankResult> results;
  for (;;) {
    auto reply = receive();
    if (!reply) return std::move(reply).error();
    if (auto* p = std::get_if<proto::Progress>(&*reply)) {
      if (progress) progress(*p);
      continue;
    }
    auto* r = std::get_if<proto::ControlResult>(&*reply);
    if (!r) return make_error(EPROTO, "unexpected answer to CONTROL");
    for (auto& x : r->results) results.push_back(std::move(x));
    if (r->last) return results;
  }
}

Result<proto::GcResult> Client::gc() {
  ++next_request_;
  if (auto st = send(proto::Gc{}); !st) return std::move(st).error();
  auto reply = receive();
  if (!reply) return std::move(reply).error();
  auto* r = std::get_if<proto::GcResult>(&*reply);
  if (!r) return make_error(EPROTO, "unexpected answer to GC");
  return *r;
}

}  // namespace tmsdisk::ctl
