// SPDX-License-Identifier: Apache-2.0
// Sizes for people: the one formatter every message and table uses ("104.9 GiB", "512 B").
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace tmsdisk {

// Binary units with one decimal (whole bytes below 1 KiB).
inline std::string human_bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace tmsdisk
