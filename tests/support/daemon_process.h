// SPDX-License-Identifier: Apache-2.0
// A tmsdiskd started as a child process, ready when it says so (sd_notify), as systemd would see it.
// For a server on a thread of the test process, see in_process_daemon.h.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace tmsdisk::testing {

// A tmsdiskd child process. start() waits for its sd_notify READY=1 (a real readiness signal, not
// a sleep) or for it to exit.
class DaemonProcess {
 public:
  DaemonProcess() = default;
  ~DaemonProcess();
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts `binary args...`. Returns 0 once ready, or the exit status (>0) if it exited instead;
  // its stderr is collected in log().
  int start(const std::string& binary, const std::vector<std::string>& args,
            std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // SIGTERM and wait; returns the exit status.
  int stop();
  // Waits up to `limit` for the daemon to exit on its own: its exit status, or -1 if it still runs.
  int wait_exit(std::chrono::milliseconds limit);
  void kill9();
  pid_t pid() const { return pid_; }
  std::string log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
};

}  // namespace tmsdisk::testing
