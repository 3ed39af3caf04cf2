// SPDX-License-Identifier: Apache-2.0
// Fixed-buffer logger of the shim (log.h).
#include "log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tmsdisk::shim {
namespace {

constexpr int kUnread = -1;
std::atomic<int> g_level{kUnread};

int read_level() noexcept {
  const char* v = std::getenv("TMSDISK_LOG");
  if (!v || !*v) return static_cast<int>(LogLevel::Warn);
  if (!std::strcmp(v, "error")) return static_cast<int>(LogLevel::Error);
  if (!std::strcmp(v, "warn") || !std::strcmp(v, "warning")) return static_cast<int>(LogLevel::Warn);
  if (!std::strcmp(v, "info")) return static_cast<int>(LogLevel::Info);
  if (!std::strcmp(v, "debug")) return static_cast<int>(LogLevel::Debug);
  return static_cast<int>(LogLevel::Warn);
}

const char* level_name(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::Error: return "error";
    case LogLevel::Warn: return "warn";
    case LogLevel::Info: return "info";
    case LogLevel::Debug: return "debug";
  }
  return "?";
}

}  // namespace

bool log_enabled(LogLevel level) noexcept {
  int current = g_level.load(std::memory_order_relaxed);
  if (current == kUnread) {
    current = read_level();
    g_level.store(current, std::memory_order_relaxed);
  }
  return static_cast<int>(level) <= current;
}

void log(LogLevel level, const char* fmt, ...) noexcept {
  const int saved_errno = errno;  // logging must not disturb the host's errno
  char buf[1024];
  int n = std::snprintf(buf, sizeof(buf), "[tmsdisk %d:%ld] %s: ", static_cast<int>(::getpid()),
                        static_cast<long>(::syscall(SYS_gettid)), level_name(level));
  if (n < 0) n = 0;
  std::size_t used = static_cast<std::size_t>(n) < sizeof(buf) ? static_cast<std::size_t>(n) : sizeof(buf) - 1;
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + used, sizeof(buf) - used, fmt, ap);
  va_end(ap);
  if (m > 0)
    used += static_cast<std::size_t>(m) < sizeof(buf) - used ? static_cast<std::size_t>(m) : sizeof(buf) - used - 1;
  if (used >= sizeof(buf) - 1) used = sizeof(buf) - 2;
  buf[used++] = '\n';
  const char* p = buf;
  while (used > 0) {
    ssize_t w = ::write(STDERR_FILENO, p, used);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    p += w;
    used -= static_cast<std::size_t>(w);
  }
  errno = saved_errno;
}

}  // namespace tmsdisk::shim
