// SPDX-License-Identifier: Apache-2.0
// The HELLO handshake as a client says it (client.h).
#include "tmsdisk/protocol/client.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::proto {

namespace {

void close_if_open(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

HelloReply failure(int error, std::string message, bool refused = false) noexcept {
  HelloReply r;
  r.error = error;
  r.refused = refused;
  try {
    r.message = std::move(message);
  } catch (...) {  // no memory for the text: the code still says what happened
  }
  return r;
}

// Waits until `sock` is readable or `timeout_ms` has passed (negative: forever); 0 or a negative errno.
int wait_readable(int sock, int timeout_ms) noexcept {
  if (timeout_ms < 0) return 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{sock, POLLIN, 0};
    const int n = ::poll(&p, 1, left > 0 ? static_cast<int>(left) : 0);
    if (n > 0) return 0;  // readable, or hung up: recv_message says which
    if (n == 0) return -ETIMEDOUT;
    if (errno != EINTR) return -errno;
  }
}

// The ERROR a daemon sent before closing a connection it refused without reading it (one too many
// of this user's), if one is there: such a refusal makes sending HELLO fail, or, when the HELLO got
// there first and was not read, makes the first receive report ECONNRESET before the answer.
std::optional<HelloReply> refusal_waiting(int sock, std::vector<uint8_t>& buf) noexcept {
  // A peer that closed with our message unread leaves ECONNRESET, reported once before its data.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const long n = recv_message(sock, buf);  // the peer has closed: returns at once
    if (n == -ECONNRESET) continue;
    if (n <= 0) return std::nullopt;
    DecodeResult d = decode(buf);
    if (!d.envelope) return std::nullopt;
    auto* e = std::get_if<ErrorReply>(&d.envelope->body);
    if (!e) return std::nullopt;
    return failure(e->code, std::move(e->message), true);
  }
  return std::nullopt;
}

}  // namespace

HelloReply::HelloReply(HelloReply&& o) noexcept
    : error(o.error),
      refused(o.refused),
      message(std::move(o.message)),
      welcome(std::move(o.welcome)),
      fd(std::exchange(o.fd, -1)),
      sock(std::exchange(o.sock, -1)) {}

HelloReply& HelloReply::operator=(HelloReply&& o) noexcept {
  if (this != &o) {
    close_if_open(fd);
    close_if_open(sock);
    error = o.error;
    refused = o.refused;
    message = std::move(o.message);
    welcome = std::move(o.welcome);
    fd = std::exchange(o.fd, -1);
    sock = std::exchange(o.sock, -1);
  }
  return *this;
}

HelloReply::~HelloReply() {
  close_if_open(fd);
  close_if_open(sock);
}

HelloReply say_hello(int sock, const Hello& hello, int timeout_ms, uint64_t request_id, int fd) noexcept {
  std::vector<uint8_t> buf;
  try {
    buf = encode(request_id, hello);
  } catch (...) {
    return failure(ENOMEM, "no memory to encode HELLO");
  }
  if (buf.empty()) return failure(EINVAL, "HELLO does not fit in a protocol message");
  if (int rc = send_message(sock, buf, fd); rc < 0) {
    if (rc == -EPIPE || rc == -ECONNRESET)
      if (auto refused = refusal_waiting(sock, buf)) return std::move(*refused);
    return failure(-rc, std::string("cannot send HELLO: ") + std::strerror(-rc));
  }
  if (int rc = wait_readable(sock, timeout_ms); rc < 0)
    return failure(-rc, rc == -ETIMEDOUT ? "no answer to HELLO within " + std::to_string(timeout_ms) + " ms"
                                         : std::string("cannot wait for the answer to HELLO: ") + std::strerror(-rc));
  int passed = -1;
  const long n = recv_message(sock, buf, &passed);
  if (n == -ECONNRESET)
    if (auto refused = refusal_waiting(sock, buf)) return std::move(*refused);
  if (n <= 0) {
    close_if_open(passed);
    if (n == 0) return failure(ECONNRESET, "the connection was closed instead of an answer to HELLO");
    return failure(static_cast<int>(-n), std::string("no answer to HELLO: ") + std::strerror(static_cast<int>(-n)));
  }
  DecodeResult d = decode(buf);
  if (!d.envelope) {
    close_if_open(passed);
    return failure(d.code ? d.code : EPROTO, "bad answer to HELLO: " + d.error);
  }
  if (auto* e = std::get_if<ErrorReply>(&d.envelope->body)) {
    close_if_open(passed);
    return failure(e->code, std::move(e->message), true);
  }
  auto* w = std::get_if<Welcome>(&d.envelope->body);
  if (!w) {
    close_if_open(passed);
    const MsgType got = std::visit([](const auto& m) { return m.kType; }, d.envelope->body);
    return failure(EPROTO, std::string("HELLO answered with ") + type_name(got) + " instead of WELCOME");
  }
  HelloReply r;
  r.welcome = std::move(*w);
  r.fd = passed;
  return r;
}

HelloReply connect_and_hello(const std::string& path, const Hello& hello, int timeout_ms, int fd) noexcept {
  const int sock = connect_seqpacket(path);
  if (sock < 0) {
    try {
      return failure(-sock, "cannot connect to " + path + ": " + std::strerror(-sock));
    } catch (...) {
      return failure(-sock, {});
    }
  }
  HelloReply r = say_hello(sock, hello, timeout_ms, 1, fd);
  r.sock = sock;  // closed with the reply on failure, the caller's on success
  return r;
}

}  // namespace tmsdisk::proto
