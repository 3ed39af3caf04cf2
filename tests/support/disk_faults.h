// SPDX-License-Identifier: Apache-2.0
// Damage a test does to a rank's files, as a failing disk would.
#pragma once

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <fstream>
#include <string>

namespace tmsdisk::testing {

// XORs the byte of `path` at `offset` with `mask` and gets it to the disk; the same call again
// repairs it.
inline void flip_byte(const std::string& path, uint64_t offset, uint8_t mask = 0x5a) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  f.seekg(static_cast<std::streamoff>(offset));
  char b = 0;
  f.read(&b, 1);
  REQUIRE(f);
  b = static_cast<char>(b ^ static_cast<char>(mask));
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&b, 1);
  f.close();
  ::sync();
}

}  // namespace tmsdisk::testing
