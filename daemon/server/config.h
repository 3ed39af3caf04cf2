// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's settings as the server takes them, sizes in bytes (options.cpp fills them from the
// command line and the config file, in the user's MiB). A leaf: what reads settings includes this.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io_engine.h"
#include "tmsdisk/common/sizes.h"

namespace tmsdisk::server {

// The user's unit for sizes (the options' -mb names) is common/sizes.h's kMiB; Config holds bytes,
// converted in options.cpp.
using tmsdisk::kMiB;

// Where tests step into the server: each empty in tmsdiskd. A hook that blocks must return before
// the server is destroyed, which waits for it.
struct TestHooks {
  // Injected I/O faults: sees each raw result (bytes moved or -errno) and may replace it
  // (io::Engine::Options::fault).
  std::function<int(const io::Request&, int raw_result)> io_fault;
  // Runs on a staging worker before it builds the staging buffer of a HELLO (with its job name), and
  // may block there to hold that HELLO in the slow path.
  std::function<void(const std::string& job)> before_staging;
  // Runs on a hash worker before it hashes a WRITE's chunk, and may block there to hold that WRITE.
  std::function<void()> before_hash;
};

struct Config {
  std::vector<std::string> roots;  // one per NVMe; chunks stripe across them
  std::string socket_path = "/run/tmsdisk/tmsdiskd.sock";
  uint64_t staging_budget_bytes = 256 * kMiB;             // default per-rank staging (staging budget)
  uint64_t max_staging_budget_bytes = 4096 * kMiB;        // the most a rank may ask for
  uint64_t max_staging_per_uid_bytes = 32768 * kMiB;      // pinned staging one (non-root) user may hold
  uint64_t max_total_staging_bytes = 65536 * kMiB;        // pinned staging of all sessions together
  uint32_t max_sessions_per_uid = 256;                    // sessions one (non-root) user may hold
  uint32_t max_connections_per_uid = 512;                 // connections one (non-root) user may hold
  uint64_t max_unread_replies_bytes_per_uid = 64 * kMiB;  // replies queued for one (non-root) user's non-reading peers
  uint32_t max_blobs_per_uid = 262144;                    // allocations one (non-root) user's sessions may reserve
  uint32_t max_chunks_per_uid = 4194304;    // chunks (zero ones too) one (non-root) user's sessions may reserve
  uint32_t max_ipc_exports_per_uid = 4096;  // legacy IPC exports (one descriptor each) per user
  uint32_t max_ipc_exports = 16384;         // ... of all users together
  uint32_t chunk_bytes = 8 * kMiB;          // bytes per I/O request / slot
  uint64_t host_tier_bytes = 0;             // the node's host-memory tier (host_tier.h); 0: off
  bool host_tier_keep = true;               // ranks keep its memory between pauses (tier_broker.h)
  bool host_tier_ahead = true;              // and get it before their first pause (tier_broker.h)
  std::vector<uid_t> allowed_uids;          // empty and no groups: every uid may connect
  std::vector<gid_t> allowed_gids;
  bool allow_tmpfs = false;
  unsigned sweep_interval_s = 60;  // 0: sweep only at startup and on `tmsctl gc`
  unsigned queue_depth = 64;
  unsigned hash_threads = 0;  // threads hashing WRITEs' and READs' chunks; 0: automatic_hash_threads() (hash_workers.h)
  bool exit_when_idle = false;       // embedded per-user daemon: stop after last session
  unsigned idle_exit_s = 60;         // ... or when no session came this long after start
  std::string metrics_file;          // Prometheus textfile (metrics.h); empty: none
  unsigned metrics_interval_s = 15;  // ... written this often, and after each operation
  int listen_fd = -1;                // an already-listening socket (systemd activation)
  TestHooks hooks;                   // tests only; empty in tmsdiskd
};

}  // namespace tmsdisk::server
