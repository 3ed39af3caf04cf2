// SPDX-License-Identifier: Apache-2.0
// Starting the private per-user tmsdiskd (`tmsdiskd --private`) when no daemon answers. Shared by
// `tmsctl run` and the shim; uses only fork/exec/connect so it is safe inside the shim too.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace tmsdisk {

// True if something accepts SOCK_SEQPACKET connections at `path`.
inline bool socket_answers(const std::string& path) noexcept {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  bool ok = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(s);
  return ok;
}

// Starts `tmsdiskd --private` detached (own session, stdio to /dev/null: it logs to its log file)
// and waits up to `timeout_ms` for `socket` to answer. Several processes may race here: the
// daemon's instance lock lets one win and the others exit, and every caller waits for the winner.
// Returns 0 or a negative errno (-ETIMEDOUT if no daemon answered in time).
inline int spawn_private_daemon(const std::string& tmsdiskd, const std::string& socket, int timeout_ms) noexcept {
  if (socket_answers(socket)) return 0;
  pid_t child = ::fork();
  if (child < 0) return -errno;
  if (child == 0) {
    // Intermediate child: a new session, then fork again so the daemon is not our child (no
    // zombie, no SIGCHLD surprises for the host program, not killed with its process group).
    ::setsid();
    pid_t grandchild = ::fork();
    if (grandchild != 0) ::_exit(grandchild < 0 ? 1 : 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) {
      ::dup2(devnull, 0);
      ::dup2(devnull, 1);
      ::dup2(devnull, 2);
    }
    ::unsetenv("LD_PRELOAD");  // the daemon must not load the shim into itself
    const char* argv[] = {tmsdiskd.c_str(), "--private", nullptr};
    ::execv(tmsdiskd.c_str(), const_cast<char* const*>(argv));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  for (int waited = 0; waited < timeout_ms; waited += 10) {
    if (socket_answers(socket)) return 0;
    timespec ts{0, 10 * 1000 * 1000};  // polling a socket that appears within milliseconds
    ::nanosleep(&ts, nullptr);
  }
  return -ETIMEDOUT;
}

}  // namespace tmsdisk
