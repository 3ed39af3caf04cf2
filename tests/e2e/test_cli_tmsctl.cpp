// SPDX-License-Identifier: Apache-2.0
// tmsctl's command line as a user meets it: tmsctl run as a subprocess against a real tmsdiskd (and
// simcuda ranks where a rank is needed), its exit status, stdout and stderr asserted (issue 12).
#include "e2e.h"

using namespace tmsdisk::e2e;

TEST_CASE("tmsctl --help exits 0 and lists the commands") {
  Captured c = run_captured({TMSCTL_PATH, "--help"}, {});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  for (const char* cmd : {"status", "pause", "resume", "gc", "env", "run"}) CHECK(c.out.find(cmd) != std::string::npos);
}
