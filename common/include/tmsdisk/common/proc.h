// SPDX-License-Identifier: Apache-2.0
// Process identity: pid plus the kernel's start time, so a recycled pid is never mistaken for the
// process that owned a rank's files (DESIGN.md invariant 6).
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace tmsdisk {

// Field 22 of /proc/<pid>/stat (clock ticks since boot), or nullopt if the process does not exist.
// Uses only open/read/close so it is safe inside the shim as well.
inline std::optional<uint64_t> process_start_time(pid_t pid) noexcept {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  buf[n] = '\0';
  // The command name (field 2) is in parentheses and may contain spaces or ')': skip to the last ')'.
  char* p = std::strrchr(buf, ')');
  if (!p) return std::nullopt;
  p += 2;  // now at field 3 (state)
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return std::nullopt;
    ++p;
  }
  char* end = nullptr;
  unsigned long long v = std::strtoull(p, &end, 10);
  if (end == p) return std::nullopt;
  return static_cast<uint64_t>(v);
}

// True if `pid` runs and started at `start_time` (as returned by process_start_time).
inline bool process_alive(pid_t pid, uint64_t start_time) noexcept {
  auto now = process_start_time(pid);
  return now && *now == start_time;
}

}  // namespace tmsdisk
