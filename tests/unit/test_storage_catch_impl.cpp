// SPDX-License-Identifier: Apache-2.0
// Catch2 runner for the storage tests that first decide whether they can run here (exit 77 if not).
// Kept out of the sanitized test sources like catch_main.cpp: GCC's -Wmaybe-uninitialized misfires on
// Catch's own implementation under ASan.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

// Defined by each test program: 0 to run its tests, else the exit status; a program that cannot
// run here ends in skip() (exit 77, with the reason).
int storage_test_setup();
// Undoes what setup did (unmounts, removes temp files).
void storage_test_teardown();

int main(int argc, char** argv) {
  if (int rc = storage_test_setup(); rc != 0) return rc;
  int rc = Catch::Session().run(argc, argv);
  storage_test_teardown();
  return rc;
}
