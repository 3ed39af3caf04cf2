// SPDX-License-Identifier: Apache-2.0
// A tmsdiskd child process with sd_notify readiness (daemon_process.h).
#include "daemon_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "temp_dir.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::testing {

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) kill9();
  if (!log_path_.empty()) ::unlink(log_path_.c_str());
}

int DaemonProcess::start(const std::string& binary, const std::vector<std::string>& args,
                         std::chrono::milliseconds timeout) {
  // An abstract-namespace datagram socket receives READY=1 exactly as systemd would.
  static int counter = 0;
  const std::string name = "tmsdisk-test-notify-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  UniqueFd notify(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (::bind(notify.get(), reinterpret_cast<sockaddr*>(&addr), addr_len) != 0)
    throw std::runtime_error(std::string("bind notify socket: ") + std::strerror(errno));

  if (!log_path_.empty()) ::unlink(log_path_.c_str());  // a restart: the earlier run's log goes
  log_path_ = test_tmp_root() + "/" + name + ".log";
  pid_ = ::fork();
  if (pid_ == 0) {
    int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log >= 0) ::dup2(log, 2);
    ::setenv("NOTIFY_SOCKET", ("@" + name).c_str(), 1);
    ::unsetenv("LD_PRELOAD");
    std::vector<char*> argv{const_cast<char*>(binary.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    ::_exit(127);
  }
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      kill9();
      return 124;
    }
    pollfd fds[2] = {{notify.get(), POLLIN, 0}, {pidfd.get(), POLLIN, 0}};
    int n = ::poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (fds[0].revents & POLLIN) {
      char msg[256];
      ssize_t len = ::recv(notify.get(), msg, sizeof(msg) - 1, 0);
      if (len > 0) {
        msg[len] = '\0';
        if (std::strstr(msg, "READY=1")) return 0;
      }
    }
    if (fds[1].revents & POLLIN) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      return WIFEXITED(status) ? (WEXITSTATUS(status) ? WEXITSTATUS(status) : 255) : 128 + WTERMSIG(status);
    }
  }
}

int DaemonProcess::stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int DaemonProcess::wait_exit(std::chrono::milliseconds limit) {
  if (pid_ <= 0) return -1;
  // The pidfd turns readable when the process exits: no polling of waitpid, no sleep.
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  if (!pidfd) throw std::runtime_error(std::string("pidfd_open: ") + std::strerror(errno));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{pidfd.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
}

void DaemonProcess::kill9() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string DaemonProcess::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tmsdisk::testing
