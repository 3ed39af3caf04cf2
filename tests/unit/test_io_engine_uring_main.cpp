// SPDX-License-Identifier: Apache-2.0
// Catch2 main of the io_uring engine tests: exits 77 (CTest: skipped) with the reason where io_uring is unavailable.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "io_engine.h"

int main(int argc, char** argv) {
  std::string why;
  if (!tmsdisk::io::io_uring_available(&why)) {
    std::printf("SKIPPED: io_uring is unavailable here: %s\n", why.c_str());
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
