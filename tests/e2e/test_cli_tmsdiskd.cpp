// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's command line and config file as a user meets them: the daemon run as a subprocess, its
// exit status and messages asserted (issue 12). No GPU or simcuda needed.
#include "e2e.h"

using namespace tmsdisk::e2e;

TEST_CASE("tmsdiskd --help exits 0 and teaches the config file") {
  Captured c = run_captured({TMSDISK_DAEMON_PATH, "--help"}, {});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK(c.out.find("--config") != std::string::npos);
}
