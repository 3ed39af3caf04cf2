// SPDX-License-Identifier: Apache-2.0
// Starting the private per-user tmsdiskd (`tmsdiskd --private --detach`) when no daemon answers.
// Shared by `tmsctl run` and the shim. The shim calls it inside arbitrary (multi-threaded, CUDA)
// programs, so it uses posix_spawn, which runs no fork handlers and nothing but exec in the child.
// The spawned process forks the daemon and exits as soon as the daemon serves its socket or has
// failed, and we reap it then, so the daemon is never the host's child (the host does see one
// short-lived child and its SIGCHLD).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/unique_fd.h"

extern char** environ;

namespace tmsdisk {

// True if a daemon of this user (or root) accepts SOCK_SEQPACKET connections at `path`. A listener
// of any other uid does not count: it could only be someone impersonating our daemon.
inline bool socket_answers(const std::string& path) noexcept {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  bool ok = ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  if (ok) {
    ucred peer{};
    socklen_t len = sizeof(peer);
    ok = ::getsockopt(s, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && (peer.uid == ::getuid() || peer.uid == 0);
  }
  ::close(s);
  return ok;
}

// tmsdiskd's exit status when another daemon already serves its socket (holds the socket's lock).
// When several ranks start the private daemon at once, one wins and the others exit with this: for
// them the winner is the daemon to wait for, not a failure.
inline constexpr int kExitAlreadyServed = 3;

namespace detail {

inline int64_t monotonic_ms() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

// Appends what `fd` has to `out` (at most 4 KiB in all: a start-up error is a line or two). Returns
// false at end of file or on an error, true when it would block.
inline bool read_some(int fd, std::string& out) {
  char buf[512];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      if (out.size() < 4096) out.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && errno == EAGAIN;
  }
}

// The daemon's words, one line: trailing newlines dropped, inner ones joined with "; ".
inline std::string one_line(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  for (std::size_t at = text.find('\n'); at != std::string::npos; at = text.find('\n', at)) text.replace(at, 1, "; ");
  return text;
}

}  // namespace detail

// Runs `tmsdiskd --private --detach` (stdin and stdout on /dev/null, stderr on a pipe read here,
// without our LD_PRELOAD; once it serves, the daemon logs beside its socket) and waits up to
// `timeout_ms` for `socket` to answer. With --detach, tmsdiskd exits when its daemon serves (0) or
// has failed to start (non-zero, having said why on stderr), so a failure is known at once, in the
// daemon's own words: they go to `*why` when it is given. -EPERM if the socket's directory exists
// but is not this user's own (0700); `*why` then says whose it is and what to do. Several processes may race here: the
// daemon's instance lock lets one win, the others exit with kExitAlreadyServed, and every caller waits for the winner.
// Returns 0, -EIO if tmsdiskd failed (`*why` says how), -ETIMEDOUT if no daemon answered in time,
// or another negative errno.
inline int spawn_private_daemon(const std::string& tmsdiskd, const std::string& socket, int timeout_ms,
                                std::string* why = nullptr) noexcept {
  // A directory that exists but is not ours alone is refused, never used (see private_dir_trusted).
  struct stat st {};
  const std::string dir = socket.substr(0, socket.rfind('/'));
  if (::lstat(dir.c_str(), &st) == 0 && !private_dir_trusted(socket)) {
    // Whose it is and what to do, for the shim's log: "Operation not permitted" says neither.
    try {
      if (why) *why = private_dir_problem(socket);
    } catch (...) {
    }
    return -EPERM;
  }
  if (socket_answers(socket)) return 0;
  const int64_t deadline = detail::monotonic_ms() + timeout_ms;
  try {
    int err_pipe[2];
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) return -errno;
    UniqueFd from_daemon(err_pipe[0]), to_spawner(err_pipe[1]);
    std::vector<char*> envp;
    for (char** e = environ; e && *e; ++e)
      if (std::strncmp(*e, "LD_PRELOAD=", 11) != 0) envp.push_back(*e);
    envp.push_back(nullptr);
    const char* argv[] = {tmsdiskd.c_str(), "--private", "--detach", nullptr};

    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attr);
    for (int fd = 0; fd <= 1; ++fd) posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_RDWR, 0);
    posix_spawn_file_actions_adddup2(&actions, to_spawner.get(), 2);  // dup2 drops O_CLOEXEC on fd 2
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t child = -1;
    int rc = ::posix_spawn(&child, tmsdiskd.c_str(), &actions, &attr, const_cast<char* const*>(argv), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    to_spawner.reset();
    if (rc != 0) return -rc;
    ::fcntl(from_daemon.get(), F_SETFL, O_NONBLOCK);

    // Until the spawned process exits: it does once the daemon serves or has failed. Its stderr
    // closing means it has exited; the daemon itself may keep a copy (an older tmsdiskd does), so
    // the exit is what counts.
    std::string said;
    int status = 0;
    bool exited = false;
    bool reaped_elsewhere = false;  // the host's SIGCHLD handler waited for it: its status is lost
    for (;;) {
      const pid_t w = ::waitpid(child, &status, WNOHANG);
      if (w == child) {
        exited = true;
        break;
      }
      if (w < 0 && errno == ECHILD) {
        reaped_elsewhere = exited = true;
        break;
      }
      if (w < 0 && errno != EINTR) break;
      const int64_t left = deadline - detail::monotonic_ms();
      if (left <= 0) break;
      pollfd p{from_daemon.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left < 10 ? left : 10)) > 0 && !detail::read_some(from_daemon.get(), said)) {
        from_daemon.reset();  // every writer is gone: the spawned process has exited
        while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
        }
        exited = true;
        break;
      }
    }
    if (from_daemon) detail::read_some(from_daemon.get(), said);  // what it wrote before it exited
    if (!exited) {
      // Still waiting for its daemon at our deadline: give up on both. The daemon, if it comes up,
      // serves the next caller.
      ::kill(child, SIGKILL);
      while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
      }
      if (why) *why = detail::one_line(said);
      return -ETIMEDOUT;
    }
    // Without its status, the socket alone tells (as it did before tmsdiskd reported its outcome).
    const bool served = reaped_elsewhere ||
                        (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == kExitAlreadyServed));
    if (!served) {
      if (why) {
        *why = detail::one_line(said);
        if (why->empty())
          *why = WIFSIGNALED(status) ? "tmsdiskd was killed by signal " + std::to_string(WTERMSIG(status))
                                     : "tmsdiskd exited with status " + std::to_string(WEXITSTATUS(status));
      }
      return -EIO;
    }
    // It serves (or the daemon that won the race will): the socket answers within milliseconds.
    while (!socket_answers(socket)) {
      if (detail::monotonic_ms() >= deadline) {
        if (why) *why = detail::one_line(said);
        return -ETIMEDOUT;
      }
      timespec ts{0, 10 * 1000 * 1000};
      ::nanosleep(&ts, nullptr);
    }
    return 0;
  } catch (...) {
    return -ENOMEM;
  }
}

}  // namespace tmsdisk
