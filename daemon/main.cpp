// SPDX-License-Identifier: Apache-2.0
// tmsdiskd: reads its options (command line and config file, options.h) and runs the daemon (run.h).
#include <iostream>
#include <utility>

#include "options.h"
#include "run.h"
#include "tmsdisk/common/paths.h"

int main(int argc, char** argv) {
  auto invocation = tmsdisk::parse_invocation(argc, argv, tmsdisk::default_config_file(tmsdisk::layout::kSbinDir),
                                              std::cout, std::cerr);
  if (invocation.exit_now) return *invocation.exit_now;
  return tmsdisk::run_daemon(std::move(invocation.options));
}
