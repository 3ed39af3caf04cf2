// SPDX-License-Identifier: Apache-2.0
// Starting the private per-user tmsdiskd (`tmsdiskd --private --detach`) when no daemon answers.
// Shared by `tmsctl run` and the shim. The shim calls it inside arbitrary (multi-threaded, CUDA)
// programs, so it uses posix_spawn, which runs no fork handlers and nothing but exec in the child.
// The spawned process only forks the daemon and exits at once, and we reap it right away, so the
// daemon is never the host's child (the host does see one short-lived child and its SIGCHLD).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "tmsdisk/common/paths.h"

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

// Runs `tmsdiskd --private --detach` (stdio on /dev/null: it logs beside its socket, without our
// LD_PRELOAD) and waits up to `timeout_ms` for `socket` to answer. -EPERM if the socket's directory
// exists but is not this user's own (0700). Several processes may race here:
// the daemon's instance lock lets one win, the others exit, and every caller waits for the winner.
// Returns 0 or a negative errno (-ETIMEDOUT if no daemon answered in time).
inline int spawn_private_daemon(const std::string& tmsdiskd, const std::string& socket, int timeout_ms) noexcept {
  // A directory that exists but is not ours alone is refused, never used (see private_dir_trusted).
  struct stat st {};
  const std::string dir = socket.substr(0, socket.rfind('/'));
  if (::lstat(dir.c_str(), &st) == 0 && !private_dir_trusted(socket)) return -EPERM;
  if (socket_answers(socket)) return 0;
  try {
    std::vector<char*> envp;
    for (char** e = environ; e && *e; ++e)
      if (std::strncmp(*e, "LD_PRELOAD=", 11) != 0) envp.push_back(*e);
    envp.push_back(nullptr);
    const char* argv[] = {tmsdiskd.c_str(), "--private", "--detach", nullptr};

    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attr);
    for (int fd = 0; fd <= 2; ++fd) posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_RDWR, 0);
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
    if (rc != 0) return -rc;
    // The spawned process forks the daemon and exits at once.
    int status = 0;
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
  } catch (...) {
    return -ENOMEM;
  }
  for (int waited = 0; waited < timeout_ms; waited += 10) {
    if (socket_answers(socket)) return 0;
    timespec ts{0, 10 * 1000 * 1000};  // the socket appears within milliseconds of the start
    ::nanosleep(&ts, nullptr);
  }
  return -ETIMEDOUT;
}

}  // namespace tmsdisk
