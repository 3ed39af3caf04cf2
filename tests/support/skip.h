// SPDX-License-Identifier: Apache-2.0
// Saying what a test could not check: skip() ends a case that cannot run here with CTest's "skipped"
// (exit 77) and the reason, and eventually() waits on a condition another process makes true.
// Header-only, so any test program can use it without linking the test-support library.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace tmsdisk::testing {

// Ends a test that cannot run here: CTest reports exit status 77 as skipped, with the reason printed.
// Catch2 v2 has no skip of its own, so a case that may skip must be its own CTest test (see
// SKIPPABLE in tests/CMakeLists.txt, or catch_discover_tests): the exit ends the whole program.
[[noreturn]] inline void skip(const std::string& why) {
  std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

// Waits for a condition another process makes true asynchronously (a closed session's teardown, a
// daemon's reconnect), checking it every few milliseconds up to a deadline; the assertion is on the
// condition, not on the time.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace tmsdisk::testing
