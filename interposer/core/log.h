// SPDX-License-Identifier: Apache-2.0
// The shim's logger: one snprintf into a stack buffer, one write(2) to stderr, no allocation.
#pragma once

#include <atomic>

namespace tmsdisk::shim {

enum class LogLevel : int { Error = 0, Warn = 1, Info = 2, Debug = 3 };

// The level comes from TMSDISK_LOG (error|warn|info|debug, default warn), read on first use.
bool log_enabled(LogLevel level) noexcept;

// Writes "[tmsdisk pid:tid] level: message\n" to stderr when `level` is enabled. Never fails, never
// allocates; long messages are truncated.
void log(LogLevel level, const char* fmt, ...) noexcept __attribute__((format(printf, 2, 3)));

}  // namespace tmsdisk::shim

#define TMS_LOG(level, ...)                                                            \
  do {                                                                                 \
    if (::tmsdisk::shim::log_enabled(level)) ::tmsdisk::shim::log(level, __VA_ARGS__); \
  } while (0)
#define TMS_ERROR(...) TMS_LOG(::tmsdisk::shim::LogLevel::Error, __VA_ARGS__)
#define TMS_WARN(...) TMS_LOG(::tmsdisk::shim::LogLevel::Warn, __VA_ARGS__)
#define TMS_INFO(...) TMS_LOG(::tmsdisk::shim::LogLevel::Info, __VA_ARGS__)
#define TMS_DEBUG(...) TMS_LOG(::tmsdisk::shim::LogLevel::Debug, __VA_ARGS__)

// Logs at most once per call site for the life of the process.
#define TMS_LOG_ONCE(level, ...)                                                                  \
  do {                                                                                            \
    static std::atomic<bool> tms_logged_once_{false};                                             \
    if (!tms_logged_once_.exchange(true, std::memory_order_relaxed)) TMS_LOG(level, __VA_ARGS__); \
  } while (0)
