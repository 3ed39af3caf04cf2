// SPDX-License-Identifier: Apache-2.0
// A peer's connection to tmsdiskd, and the replies queued for it (ReplyQueues): what does not fit in
// the socket's buffer waits in the connection's outbox, within bounds per connection and per user,
// and a peer that leaves its replies unread stops being read (backpressure).
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

// A connection is not read while the replies queued for it cost this much (or 256 of them wait):
// backpressure on a peer that sends requests without reading the answers.
inline constexpr std::size_t kReadPauseBytes = 64 << 10;
// Replies queued for one connection, root's too, beyond which it is closed (only replies it did not
// just ask for, such as I/O completions and a pause's progress, can take it there).
inline constexpr std::size_t kMaxOutboxBytes = 16 << 20;

// A reply waiting in a connection's outbox, with the descriptor it passes (IPC_OPENED).
struct Outgoing {
  std::vector<uint8_t> bytes;
  UniqueFd fd;
};

struct Connection {
  using Clock = std::chrono::steady_clock;
  uint64_t id = 0;
  UniqueFd fd;
  ucred cred{};
  bool hello_done = false;
  // Its HELLO is accepted and its staging buffer is being built off the loop: nothing more is read
  // from it until the WELCOME (or the refusal) is sent.
  bool hello_pending = false;
  uint64_t hello_request_id = 0;
  proto::Role role = proto::Role::Control;
  uint64_t session_id = 0;  // shim connections
  std::deque<Outgoing> outbox;
  std::size_t outbox_bytes = 0;
  std::size_t outbox_fds = 0;  // descriptors among the queued replies (each one of ours)
  uint32_t interest = 0;       // the epoll events currently asked for
  Clock::time_point accepted = Clock::now();
  bool closing = false;  // close once the outbox drains (after a fatal error reply)
};

// Whether the peer of `c` may use this daemon: root always; anyone when both lists are empty; else a
// uid listed, or a member (SO_PEERGROUPS, or its primary gid) of a group listed (allowed-uid, allowed-gid).
bool peer_allowed(const Connection& c, const std::vector<uid_t>& allowed_uids, const std::vector<gid_t>& allowed_gids);

// Sends replies to connections, queuing what their sockets do not take. Event-loop thread only, but
// for the peaks, which any thread may read.
class ReplyQueues {
 public:
  // `max_unread_bytes_per_uid`: what a (non-root) user's connections may have queued together.
  explicit ReplyQueues(uint64_t max_unread_bytes_per_uid) : max_unread_bytes_per_uid_(max_unread_bytes_per_uid) {}

  // The epoll set whose interest in each connection follows its outbox (update_interest()).
  void watch_with(int epoll_fd) noexcept { epoll_fd_ = epoll_fd; }

  // Sends `m` (with descriptor `fd`, duplicated if it must wait) as the answer to `request_id`, now
  // or once the connection reads; a connection past its bounds is marked closing instead.
  void send(Connection& c, uint64_t request_id, const proto::Message& m, int fd = -1);
  // Sends what the socket takes now of the outbox (the connection is writable).
  void flush(Connection& c);
  // Forgets every reply queued for `c` (it closes): they no longer count against its user.
  void drop(Connection& c);

  // Requests are read from a peer only while few of its replies wait for it (backpressure: a peer
  // that does not read its replies stops being read, and its requests wait in its own socket, so it
  // cannot make the daemon buffer without bound by sending more), and not while its HELLO is served.
  static bool reads_paused(const Connection& c) noexcept;
  // Asks epoll for writability while replies wait, for readability unless reads_paused().
  void update_interest(Connection& c);

  // The most ever queued for one connection and for one user (Server::reply_backlog_peaks()).
  uint64_t peak_connection_bytes() const noexcept { return peak_connection_.load(); }
  uint64_t peak_uid_bytes() const noexcept { return peak_uid_.load(); }

 private:
  void pop(Connection& c);
  void forget(uid_t uid, std::size_t cost);

  uint64_t max_unread_bytes_per_uid_;
  int epoll_fd_ = -1;
  std::map<uid_t, std::size_t> backlog_by_uid_;  // the cost of the replies queued for each user
  std::atomic<uint64_t> peak_connection_{0};
  std::atomic<uint64_t> peak_uid_{0};
};

}  // namespace tmsdisk::server
