// SPDX-License-Identifier: Apache-2.0
// Sending and receiving whole protocol messages on a SOCK_SEQPACKET Unix socket, with an optional
// file descriptor passed alongside (SCM_RIGHTS). Functions return 0 or a negative errno value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tmsdisk::proto {

// Sends one message; `fd` >= 0 is passed to the peer. Retries EINTR. -EAGAIN on a non-blocking
// socket whose buffer is full; -EPIPE/-ECONNRESET when the peer is gone (never raises SIGPIPE).
int send_message(int sock, std::span<const uint8_t> bytes, int fd = -1) noexcept;

// Descriptors taken from one message; the kernel closes any beyond (without a flush).
inline constexpr std::size_t kMaxPassedFds = 8;

// Receives one message into `buf` (resized to the message). Returns the message size, 0 when the
// peer closed the connection, or a negative errno: -EMSGSIZE for a message over kMaxMessageSize (it
// is discarded, `buf` left empty); -ETOOMANYREFS for one that came with more than kMaxPassedFds
// descriptors (refused: `buf` holds it, so that the caller can answer its request id, and none of
// its descriptors goes to `*fd`). If the message carried descriptors, the first is stored in `*fd`
// (when `fd` is not null); any other, and every one of a refused message, is appended to `*extra`
// when given (for a caller that must not close a client's descriptor itself, see
// daemon/server/fd_reaper.h), else closed. All arrive with O_CLOEXEC.
long recv_message(int sock, std::vector<uint8_t>& buf, int* fd = nullptr, std::vector<int>* extra = nullptr) noexcept;

// Connects a SOCK_SEQPACKET socket (CLOEXEC) to `path`. Returns the fd or a negative errno.
// `timeout_ms` >= 0 bounds the connect itself, which blocks while the listener's backlog is full (a
// daemon that is stopped or wedged stops accepting): -ETIMEDOUT then. Later sends are not bounded by
// it (the caller polls).
int connect_seqpacket(const std::string& path, int timeout_ms = -1) noexcept;

}  // namespace tmsdisk::proto
