// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's server: accepts shim and tmsctl connections, owns sessions, staging buffers and their
// rank stores, and moves chunks between staging slots and files through the I/O engine.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io_engine.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::server {

struct Config {
  std::vector<std::string> roots;  // one per NVMe; chunks stripe across them
  std::string socket_path = "/run/tmsdisk/tmsdiskd.sock";
  uint64_t staging_budget_mb = 256;             // default per-rank staging (staging budget)
  uint64_t max_staging_budget_mb = 4096;        // the most a rank may ask for
  uint64_t max_staging_per_uid_mb = 32768;      // pinned staging one (non-root) user may hold
  uint64_t max_total_staging_mb = 65536;        // pinned staging of all sessions together
  uint32_t max_sessions_per_uid = 256;          // sessions one (non-root) user may hold
  uint32_t max_connections_per_uid = 512;       // connections one (non-root) user may hold
  uint64_t max_unread_replies_mb_per_uid = 64;  // replies queued for one (non-root) user's non-reading peers
  uint32_t max_blobs_per_uid = 262144;          // allocations one (non-root) user's sessions may reserve
  uint32_t max_chunks_per_uid = 4194304;        // chunks (zero ones too) one (non-root) user's sessions may reserve
  uint32_t max_ipc_exports_per_uid = 4096;      // legacy IPC exports (one descriptor each) per user
  uint32_t max_ipc_exports = 16384;             // ... of all users together
  uint32_t chunk_mb = 8;                        // bytes per I/O request / slot
  uint64_t host_tier_mb = 0;                    // the node's host-memory tier (host_tier.h); 0: off
  bool host_tier_keep = true;                   // ranks keep its memory between pauses (tier_broker.h)
  bool host_tier_ahead = true;                  // and get it before their first pause (tier_broker.h)
  std::vector<uid_t> allowed_uids;              // empty and no groups: every uid may connect
  std::vector<gid_t> allowed_gids;
  bool allow_tmpfs = false;
  unsigned sweep_interval_s = 60;  // 0: sweep only at startup and on `tmsctl gc`
  unsigned queue_depth = 64;
  unsigned hash_threads = 0;  // threads hashing WRITEs' and READs' chunks; 0: automatic_hash_threads() (hash_workers.h)
  bool exit_when_idle = false;                           // embedded per-user daemon: stop after last session
  unsigned idle_exit_s = 60;                             // ... or when no session came this long after start
  std::string metrics_file;                              // Prometheus textfile (metrics.h); empty: none
  unsigned metrics_interval_s = 15;                      // ... written this often, and after each operation
  int listen_fd = -1;                                    // an already-listening socket (systemd activation)
  std::function<int(const io::Request&, int)> io_fault;  // tests only: injected I/O faults
  // Tests only: runs on a staging worker before it builds the staging buffer of a HELLO (with its
  // job name), and may block there to hold that HELLO in the slow path. It must return before the
  // server is destroyed, which waits for it.
  std::function<void(const std::string& job)> before_staging;
  // Tests only: runs on a hash worker before it hashes a WRITE's chunk, and may block there to hold
  // that WRITE. It must return before the server is destroyed, which waits for it.
  std::function<void()> before_hash;
};

// A connection is not read while the replies queued for it cost this much (or 256 of them wait):
// backpressure on a peer that sends requests without reading the answers.
inline constexpr std::size_t kReadPauseBytes = 64 << 10;
// Replies queued for one connection, root's too, beyond which it is closed (only replies it did not
// just ask for, such as I/O completions and a pause's progress, can take it there).
inline constexpr std::size_t kMaxOutboxBytes = 16 << 20;

// What is wrong with `config` as a whole: settings each valid alone but not together, named by the
// options that set them (tmsdiskd reports these before starting; Server::create() refuses them too).
std::vector<std::string> inconsistencies(const Config& config);

class Server {
 public:
  // Opens the roots (refusing tmpfs unless allowed), takes the single-instance lock, sweeps dead
  // ranks, and binds the socket (or adopts Config::listen_fd).
  static Result<std::unique_ptr<Server>> create(Config config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves until stop() is called (or, with exit_when_idle, the last session ends).
  Status run();

  // Asks run() to return. Async-signal-safe: a SIGTERM handler may call it.
  void stop() noexcept;

  const Config& config() const noexcept;

  // The most the daemon has held at once in replies queued for peers that do not read them, for one
  // connection and for one user, since it started (any thread; tests check the bounds with it).
  struct ReplyBacklog {
    uint64_t connection_bytes = 0;
    uint64_t uid_bytes = 0;
  };
  ReplyBacklog reply_backlog_peaks() const noexcept;

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tmsdisk::server
