// SPDX-License-Identifier: Apache-2.0
// Running part of a test as another user (uid and gid 65534, "nobody"), for the checks that one user
// cannot see or touch another's ranks. Header-only; Catch2 test programs only.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <functional>
#include <string>

#include "skip.h"

namespace tmsdisk::testing {

// What `fn` returns when nobody cannot reach the daemon's socket at all (the test directory's
// permissions), so there is nothing to check: the case is skipped, not passed.
inline constexpr int kUnreachable = 77;

// Runs `fn` in a forked child switched to uid/gid 65534 and returns its result, fn's exit status
// (0: the check held; any other value names the step that failed). Skips the case where this process
// cannot switch users (a case skips earlier, with its own reason, before it sets anything up), and
// when fn returns kUnreachable.
inline int as_other_user(const std::function<int()>& fn) {
  if (::geteuid() != 0) skip("needs root to switch to another uid");
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    ::_exit(fn());
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == kUnreachable)
    skip("uid 65534 cannot reach the test socket (parent directory permissions)");
  return WEXITSTATUS(status);
}

}  // namespace tmsdisk::testing
