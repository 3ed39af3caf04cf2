// SPDX-License-Identifier: Apache-2.0
// The replies queued for tmsdiskd's connections (connection.h).
#include "connection.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::server {
namespace {

// A peer with this many replies queued (or kReadPauseBytes of them) is not read further.
constexpr std::size_t kReadPauseReplies = 256;
constexpr std::size_t kMaxQueuedFds = 16;  // descriptors queued for a peer that does not read them

// What a queued reply costs the daemon: its bytes, and its share of the outbox's bookkeeping (the
// deque's entry, the allocator's header).
std::size_t queued_cost(const Outgoing& o) noexcept {
  return o.bytes.capacity() + sizeof(Outgoing) + 32;
}

void raise_peak(std::atomic<uint64_t>& peak, uint64_t now) noexcept {
  uint64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

void ReplyQueues::send(Connection& c, uint64_t request_id, const proto::Message& m, int fd) {
  auto bytes = proto::encode(request_id, m);
  if (bytes.empty()) {
    spdlog::error("internal: could not encode a reply to connection {}", c.id);
    return;
  }
  if (c.outbox.empty()) {
    int rc = proto::send_message(c.fd.get(), bytes, fd);
    if (rc == 0) return;
    if (rc != -EAGAIN) {
      c.closing = true;  // peer gone; the read side notices too
      return;
    }
  }
  Outgoing out;
  out.bytes = std::move(bytes);
  if (fd >= 0 && c.outbox_fds >= kMaxQueuedFds) {
    spdlog::warn("connection {} (pid {}) does not read the descriptors it asked for; closing it", c.id, c.cred.pid);
    c.closing = true;
    return;
  }
  if (fd >= 0) {
    // The descriptor must outlive whatever owns it now (an export revoked meanwhile).
    out.fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!out.fd) {
      spdlog::warn("connection {} (pid {}): cannot queue a descriptor: {}", c.id, c.cred.pid, std::strerror(errno));
      c.closing = true;
      return;
    }
  }
  // Reading stops well before these (update_interest): what passes them comes from replies the
  // peer's requests did not just ask for (I/O completions, a pause's progress and results, IPC
  // notices), which cannot be held back. Such a peer is closed rather than buffered for: it gets
  // no error, as it reads nothing; the log says why.
  const std::size_t cost = queued_cost(out);
  if (c.outbox_bytes + cost > kMaxOutboxBytes) {
    spdlog::warn(
        "connection {} (pid {} uid {}) does not read its replies ({} bytes queued, the most one connection "
        "may have); closing it",
        c.id, c.cred.pid, c.cred.uid, c.outbox_bytes);
    c.closing = true;
    drop(c);
    return;
  }
  std::size_t& uid_backlog = backlog_by_uid_[c.cred.uid];
  if (c.cred.uid != 0 && uid_backlog + cost > max_unread_bytes_per_uid_) {
    spdlog::warn(
        "uid {} has {} bytes of replies queued for connections that do not read them, the most one user "
        "may have (max-unread-replies-mb-per-uid); closing connection {} (pid {}), whose reply does not "
        "fit",
        c.cred.uid, uid_backlog, c.id, c.cred.pid);
    c.closing = true;
    drop(c);
    return;
  }
  c.outbox_bytes += cost;
  uid_backlog += cost;
  c.outbox_fds += out.fd ? 1 : 0;
  c.outbox.push_back(std::move(out));
  raise_peak(peak_connection_, c.outbox_bytes);
  raise_peak(peak_uid_, uid_backlog);
  update_interest(c);
}

void ReplyQueues::pop(Connection& c) {
  const std::size_t cost = queued_cost(c.outbox.front());
  c.outbox_bytes -= cost;
  forget(c.cred.uid, cost);
  c.outbox_fds -= c.outbox.front().fd ? 1 : 0;
  c.outbox.pop_front();
}

void ReplyQueues::drop(Connection& c) {
  forget(c.cred.uid, c.outbox_bytes);
  c.outbox.clear();
  c.outbox_bytes = 0;
  c.outbox_fds = 0;
}

void ReplyQueues::forget(uid_t uid, std::size_t cost) {
  auto it = backlog_by_uid_.find(uid);
  if (it == backlog_by_uid_.end()) return;
  it->second -= std::min(it->second, cost);
  if (it->second == 0) backlog_by_uid_.erase(it);
}

bool ReplyQueues::reads_paused(const Connection& c) noexcept {
  return c.hello_pending || c.outbox.size() >= kReadPauseReplies || c.outbox_bytes >= kReadPauseBytes;
}

void ReplyQueues::update_interest(Connection& c) {
  uint32_t want = 0;
  if (!reads_paused(c)) want |= EPOLLIN;
  if (!c.outbox.empty()) want |= EPOLLOUT;
  if (want == c.interest) return;
  c.interest = want;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c.id;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd.get(), &ev);
}

void ReplyQueues::flush(Connection& c) {
  while (!c.outbox.empty()) {
    int rc = proto::send_message(c.fd.get(), c.outbox.front().bytes, c.outbox.front().fd.get());
    if (rc == -EAGAIN) break;
    if (rc != 0) {
      drop(c);
      c.closing = true;
      break;
    }
    pop(c);
  }
  update_interest(c);
}

bool peer_allowed(const Connection& c, const std::vector<uid_t>& allowed_uids, const std::vector<gid_t>& allowed_gids) {
  if (c.cred.uid == 0) return true;
  if (allowed_uids.empty() && allowed_gids.empty()) return true;
  if (std::find(allowed_uids.begin(), allowed_uids.end(), c.cred.uid) != allowed_uids.end()) return true;
  std::vector<gid_t> groups(64);
  socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0 && errno == ERANGE) {
    groups.resize(len / sizeof(gid_t));  // the kernel said how many there are
    if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0) len = 0;
  } else if (errno == ERANGE) {
    len = 0;
  }
  groups.resize(std::min<std::size_t>(groups.size(), len / sizeof(gid_t)));
  groups.push_back(c.cred.gid);
  for (gid_t g : groups)
    if (std::find(allowed_gids.begin(), allowed_gids.end(), g) != allowed_gids.end()) return true;
  return false;
}

}  // namespace tmsdisk::server
