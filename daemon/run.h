// SPDX-License-Identifier: Apache-2.0
// tmsdiskd as a library call: main.cpp parses options into DaemonOptions and hands them here.
#pragma once

#include <string>

#include "server.h"

namespace tmsdisk {

struct DaemonOptions {
  server::Config config;
  std::string log_level = "info";  // trace, debug, info, warn, error
  bool private_mode = false;       // this user's private daemon (settings from the environment)
  bool detach = false;             // fork into the background first
  std::string config_file;         // the config file read (or that would have been), for messages
};

// Detaches if asked, configures the private daemon and logging, adopts a socket systemd passed,
// raises the descriptor limit, then serves until SIGTERM/SIGINT. Returns the process exit status.
int run_daemon(DaemonOptions options);

}  // namespace tmsdisk
