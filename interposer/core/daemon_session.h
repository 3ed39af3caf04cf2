// SPDX-License-Identifier: Apache-2.0
// The shim's session with tmsdiskd: finding (or starting) the daemon, the HELLO handshake, requests
// and their replies, and reconnecting with backoff. Used by the control thread only; its owner (the
// engine) says how a session is opened, and the others (host tier, IPC broker) only ask.
#pragma once

#include <cerrno>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

// Starts (or joins) this user's private daemon when no system daemon is reachable and TMSDISK_SOCKET
// is unset (DESIGN.md, "Embedded default"). Returns 0 once it answers, else -errno (logged).
int start_private_daemon() noexcept;

// How long the daemon has to answer any request (every chunk is answered well within this).
inline constexpr int64_t kReplyTimeoutMs = 120000;

int64_t now_ms() noexcept;

class DaemonSession {
 public:
  // What HELLO brings back: the connected socket, WELCOME and the staging buffer's descriptor.
  struct Welcomed {
    UniqueFd sock;
    proto::Welcome welcome;
    UniqueFd memfd;
  };
  // A message that answers no request the caller waits for (commands, notices, late answers).
  using OtherHandler = std::function<void(const proto::Envelope&)>;
  // The connection was lost (`why`); called once the socket is closed.
  using LostHandler = std::function<void(const char* why)>;
  // Opens the session: hello(), what must be ready before the session is used (the staging buffer),
  // attach(), and what the owner's parts do on a new session.
  using Connector = std::function<Status()>;

  void on_other(OtherHandler h) { other_ = std::move(h); }
  void on_lost(LostHandler h) { lost_ = std::move(h); }
  void on_connect(Connector c) { connect_ = std::move(c); }

  bool connected() const noexcept { return sock_ >= 0; }
  // Counts the sessions attached so far: what the daemon handed out on an earlier one (an object's
  // handle) is asked for again on a new one.
  uint64_t connection() const noexcept { return attached_; }
  int fd() const noexcept { return sock_; }
  uint64_t next_id() noexcept { return next_request_++; }

  // Connects (starting the private daemon if allowed) and says HELLO. The session is not open
  // until attach(): the caller first maps the staging buffer.
  Result<Welcomed> hello();
  // Makes `w`'s socket this session's.
  void attach(Welcomed& w);
  // Opens the session through the Connector (connected or not: a reconnect starts a new one).
  Status connect() { return connect_ ? connect_() : make_error(ENOTCONN, "no way to reach tmsdiskd"); }
  // Closes the socket after the caller gave up on it (fork child: without telling anyone).
  void close_after_fork() noexcept;

  // Reconnecting: whether an attempt is due, how long until it is, and what an attempt gave.
  bool retry_due(int64_t now) const noexcept { return now >= next_connect_ms_; }
  int64_t retry_in(int64_t now) const noexcept { return next_connect_ms_ - now; }
  void attempt_failed(const Error& e, int64_t now);

  // Sends one message; -errno (a broken connection also drops the session).
  int send(uint64_t request_id, const proto::Message& body, int fd = -1);
  // The next message within `timeout_ms` (1), none (0) or -errno; a descriptor that came with it
  // goes to *fd when given, else is closed.
  int receive(proto::Envelope& env, int timeout_ms, UniqueFd* fd = nullptr);
  // Waits up to kReplyTimeoutMs for the answer to `request_id`; other messages go to the
  // OtherHandler meanwhile.
  Status await_reply(uint64_t request_id, proto::Envelope& reply, UniqueFd* fd = nullptr);
  // One request and its reply, connecting first if needed; `fd` rides along and *reply_fd receives
  // one that comes back. An ErrorReply becomes an error with its code and message; `reply` holds an
  // ErrorReply only when the daemon sent one (not when the answer never came).
  Status exchange(const proto::Message& m, int fd, proto::Envelope& reply, UniqueFd* reply_fd);
  // The directory this rank's files go in from now on (torch_memory_saver's set_disk_backup_dir),
  // opened here as the rank's user and handed over by descriptor: with a session, moved there by
  // SET_RANK_DIR (refused while anything is paused, saying why); without one, the next HELLO takes it
  // (and it is given up again if the daemon refuses that HELLO). TMS_DISK_BACKUP_DIR names the first.
  Status set_backup_dir(const std::string& path);
  // Hands a message that answers nothing awaited to the OtherHandler.
  void other(const proto::Envelope& env) {
    if (other_) other_(env);
  }

 private:
  void drop(const char* why);

  int sock_ = -1;
  uint64_t token_ = 0;
  // The directory the rank chose for its files (O_PATH), handed over with every HELLO; none: the
  // daemon's roots.
  UniqueFd backup_dir_;
  std::string backup_dir_path_;
  uint64_t next_request_ = 1;
  uint64_t attached_ = 0;
  int64_t next_connect_ms_ = 0;
  int64_t connect_backoff_ms_ = 1000;
  bool unreachable_logged_ = false;
  std::vector<uint8_t> rx_;
  OtherHandler other_;
  LostHandler lost_;
  Connector connect_;
};

}  // namespace tmsdisk::shim
