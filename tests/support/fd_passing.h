// SPDX-License-Identifier: Apache-2.0
// Sends a message with descriptors the way a hostile or careless client might: any number of them
// in one SCM_RIGHTS message (proto::send_message passes at most one).
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace tmsdisk::testing {

// sendmsg's result: the bytes sent, or -1 with errno (the kernel takes at most 253 descriptors).
inline ssize_t send_with_fds(int sock, const std::vector<uint8_t>& bytes, const std::vector<int>& fds) {
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()), 0);
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
  return ::sendmsg(sock, &msg, MSG_NOSIGNAL);
}

// `count` copies of `fd`.
inline ssize_t send_with_fds(int sock, const std::vector<uint8_t>& bytes, int fd, std::size_t count) {
  return send_with_fds(sock, bytes, std::vector<int>(count, fd));
}

}  // namespace tmsdisk::testing
