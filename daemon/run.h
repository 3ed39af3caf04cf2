// SPDX-License-Identifier: Apache-2.0
// tmsdiskd as a library call: main.cpp reads options into DaemonOptions (options.h) and hands them here.
#pragma once

#include "options.h"

namespace tmsdisk {

// Detaches if asked, configures the private daemon and logging, adopts a socket systemd passed,
// creates the socket's directory if missing, raises the descriptor limit, then serves until
// SIGTERM/SIGINT. Returns the process exit status: 0, kExitAlreadyServed (private_daemon.h) when
// another daemon holds the socket's lock, else kExitRuntimeFailure. With --detach the parent returns
// once the daemon serves (0) or with the daemon's status when it could not start. The options are
// taken as checked: parse_invocation() refuses what is wrong before anything starts.
int run_daemon(DaemonOptions options);

}  // namespace tmsdisk
