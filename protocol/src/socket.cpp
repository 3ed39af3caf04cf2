// SPDX-License-Identifier: Apache-2.0
// Whole-message I/O with descriptor passing on SOCK_SEQPACKET sockets (socket.h).
#include "tmsdisk/protocol/socket.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::proto {

int send_message(int sock, std::span<const uint8_t> bytes, int fd) noexcept {
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  for (;;) {
    ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return static_cast<std::size_t>(n) == bytes.size() ? 0 : -EIO;
    if (errno != EINTR) return -errno;
  }
}

long recv_message(int sock, std::vector<uint8_t>& buf, int* fd, std::vector<int>* extra) noexcept {
  if (fd) *fd = -1;
  try {
    buf.resize(kMaxMessageSize);
  } catch (...) {
    return -ENOMEM;
  }
  iovec iov{buf.data(), buf.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for a few descriptors so that a peer sending extras cannot make us leak them silently:
  // whatever arrives beyond the first is handed on or closed below.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;

  // Every descriptor that arrived (the control buffer holds at most kMaxPassedFds).
  int passed[kMaxPassedFds];
  std::size_t count = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t in = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < in && count < kMaxPassedFds; ++i)
      std::memcpy(&passed[count++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
  }
  // MSG_TRUNC: the message itself did not fit. MSG_CTRUNC alone: it arrived whole, but with more
  // descriptors than the control buffer holds (the kernel closed those beyond); it is refused too,
  // as what it asks would act on descriptors that are gone, but with its own error.
  const bool truncated = msg.msg_flags & MSG_TRUNC;
  const bool too_many_fds = msg.msg_flags & MSG_CTRUNC;
  // The first goes to the caller (unless the message is refused); the others to `extra`, else closed.
  const std::size_t first_extra = fd && !truncated && !too_many_fds && count > 0 ? 1 : 0;
  bool to_extra = extra != nullptr && count > first_extra;
  if (to_extra) {
    try {
      extra->reserve(extra->size() + count - first_extra);
    } catch (...) {
      to_extra = false;  // no memory: closing them here is the lesser evil
    }
  }
  for (std::size_t i = first_extra; i < count; ++i) {
    if (to_extra)
      extra->push_back(passed[i]);  // reserved: cannot throw
    else
      ::close(passed[i]);
  }
  const int kept = first_extra ? passed[0] : -1;
  if (truncated) {
    buf.clear();
    return -EMSGSIZE;
  }
  buf.resize(static_cast<std::size_t>(n));
  if (too_many_fds) return -ETOOMANYREFS;
  if (fd) *fd = kept;
  return n;
}

int connect_seqpacket(const std::string& path, int timeout_ms) noexcept {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return -ENAMETOOLONG;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return -errno;
  // A Unix socket's connect waits for room in the listener's backlog for as long as the send timeout
  // allows (and then fails with EAGAIN): the one way to bound it without a non-blocking socket, whose
  // connect would fail at once instead of waiting at all. A zero timeout would mean "forever".
  auto set_send_timeout = [s](int ms) {
    timeval tv{ms / 1000, (ms % 1000) * 1000};
    return ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  };
  if (timeout_ms >= 0 && set_send_timeout(timeout_ms > 0 ? timeout_ms : 1) != 0) {
    int e = errno;
    ::close(s);
    return -e;
  }
  int rc;
  do {
    rc = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) {
    int e = errno == EAGAIN && timeout_ms >= 0 ? ETIMEDOUT : errno;
    ::close(s);
    return -e;
  }
  if (timeout_ms >= 0) (void)set_send_timeout(0);  // sends are the caller's to bound
  return s;
}

}  // namespace tmsdisk::proto
