// SPDX-License-Identifier: Apache-2.0
// The client side of the HELLO handshake, shared by everything that talks to tmsdiskd (tmsctl, the
// tests, and the shim once it adopts it): send HELLO, wait for WELCOME or ERROR, and hand back the
// WELCOME with the descriptor that came along (a shim's staging memfd). Depends on nothing but the
// protocol; never throws.
#pragma once

#include <cstdint>
#include <string>

#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::proto {

// What a HELLO came to. Move-only: `fd` and `sock` are closed with it unless the caller takes them
// (std::exchange(r.fd, -1)), so no early return can leak the staging memfd.
struct HelloReply {
  int error = 0;         // 0: WELCOME received; else a positive errno value
  bool refused = false;  // the daemon answered ERROR: `error` and `message` are its own
  std::string message;   // when error != 0: the daemon's refusal, or what went wrong on the way
  Welcome welcome;       // when error == 0
  int fd = -1;           // when error == 0: the descriptor passed with WELCOME, or -1 if none came
  int sock = -1;         // connect_and_hello() only: the connected socket, ready for the next request

  HelloReply() = default;
  HelloReply(HelloReply&& other) noexcept;
  HelloReply& operator=(HelloReply&& other) noexcept;
  HelloReply(const HelloReply&) = delete;
  HelloReply& operator=(const HelloReply&) = delete;
  ~HelloReply();
  explicit operator bool() const noexcept { return error == 0; }
};

// Sends `hello` as request `request_id` on the connected SOCK_SEQPACKET socket `sock` and waits up to
// `timeout_ms` milliseconds (negative: no limit) for the answer. `sock` stays the caller's, open
// whatever happens. Errors: those of send_message()/recv_message(), ECONNRESET when the daemon closed
// the connection instead of answering, ETIMEDOUT, the decoder's code for a malformed answer, EPROTO
// for an answer other than WELCOME or ERROR, and the daemon's own code (refused) for an ERROR.
// `fd`, when not -1, rides along (the rank's directory, with kHelloRankDir).
HelloReply say_hello(int sock, const Hello& hello, int timeout_ms, uint64_t request_id = 1, int fd = -1) noexcept;

// connect_seqpacket(path), then say_hello(); on success the reply owns the socket in `sock`. A
// failure to connect reports connect's errno with a message naming `path`.
HelloReply connect_and_hello(const std::string& path, const Hello& hello, int timeout_ms, int fd = -1) noexcept;

}  // namespace tmsdisk::proto
