// SPDX-License-Identifier: Apache-2.0
// The shim's settings: each environment variable read once, on first use, and cached.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "on_touch.h"
#include "tmsdisk/common/plain_integer.h"

namespace tmsdisk::shim {

inline constexpr uint64_t kDefaultMinBytes = 2ull << 20;
// How long a pause waits for the tmsdisk_on_pause callbacks (PyTorch's empty_cache of thousands of
// cached blocks takes a second or two; a callback blocked on the GIL would never return).
inline constexpr int kDefaultPauseCallbackTimeoutMs = 30000;

struct Config {
  uint64_t min_bytes = kDefaultMinBytes;  // TMSDISK_MIN_BYTES: smaller allocations stay native
  std::string socket_path;                // TMSDISK_SOCKET, else the system daemon's socket
  bool socket_explicit = false;           // TMSDISK_SOCKET was set: never fall back to a private daemon
  std::string private_socket;             // where this user's private daemon listens
  std::string job;                        // TMSDISK_JOB, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, RAY_JOB_ID
  int64_t rank = -1;                      // RANK, SLURM_PROCID
  std::string backup_dir;                 // TMS_DISK_BACKUP_DIR
  uint64_t staging_budget_bytes = 0;      // TMS_DISK_BACKUP_CHUNK_MB in bytes; 0: the daemon's default
  OnTouch on_touch = OnTouch::Wait;       // TMSDISK_ON_TOUCH: wait | resume | fail
  bool zero_scan = true;                  // TMSDISK_ZERO_SCAN=0: every chunk is data (no device scan)
  bool host_tier = true;                  // TMSDISK_HOST_TIER=0: never ask for host-tier memory
  bool store_host_tier = true;            // TMSDISK_STORE_HOST_TIER=0: the store's objects stay on disk
  int pause_callback_timeout_ms = kDefaultPauseCallbackTimeoutMs;  // TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS
};

// Reads the environment the first time it is called; later calls return the same object. Never
// called from a static initializer.
const Config& config() noexcept;

// Pure parsers, exposed for tests. Sizes in the environment are read with the one parser
// (common/plain_integer.h).
using tmsdisk::parse_plain_integer;
// wait | resume | fail (empty: wait); anything else gives wait and *valid = false.
OnTouch parse_on_touch(const char* text, bool* valid) noexcept;
// A non-negative rank, or -1 when empty or invalid.
int64_t parse_rank(const char* text) noexcept;
// Keeps [A-Za-z0-9._-] (others become '_'), at most 64 characters, never starting with '.';
// "default" when nothing is left.
std::string sanitize_job(std::string_view job);

}  // namespace tmsdisk::shim
