// SPDX-License-Identifier: Apache-2.0
// tmsdiskd: reads its options (command line and config file, options.h) and runs the daemon (run.h).
#include <iostream>
#include <utility>

#include "options.h"
#include "run.h"

int main(int argc, char** argv) {
  auto invocation = tmsdisk::parse_invocation(argc, argv, TMSDISK_DEFAULT_CONFIG, std::cout, std::cerr);
  if (invocation.exit_now) return *invocation.exit_now;
  return tmsdisk::run_daemon(std::move(invocation.options));
}
