// SPDX-License-Identifier: Apache-2.0
// tmsdiskd: parses options (command line and config file) and runs the daemon (run.h).
#include <CLI/CLI.hpp>

#include "run.h"

int main(int argc, char** argv) {
  tmsdisk::DaemonOptions o;
  auto& config = o.config;
  CLI::App app{
      "tmsdiskd: the tmsdisk node daemon. Owns the NVMe directories where paused GPU memory is kept, the\n"
      "staging buffers shared with each rank, and the file I/O (io_uring, O_DIRECT). Ranks started with\n"
      "`tmsctl run` (or LD_PRELOAD=libtmsdisk.so) connect to it; `tmsctl pause/resume/status` drive it."};
  app.set_config("--config", "/etc/tmsdisk/tmsdiskd.conf",
                 "TOML/INI file with the same keys as the long options (e.g. root = [\"/nvme0\", \"/nvme1\"])");
  app.add_option("--root", config.roots, "storage root directory; repeat once per NVMe (chunks stripe across them)");
  app.add_flag("--private", o.private_mode,
               "run as this user's private daemon (what `tmsctl run` and the shim start when no daemon answers): "
               "socket under $XDG_RUNTIME_DIR/tmsdisk, root $TMS_DISK_BACKUP_DIR, else $SCRATCH/tmsdisk-<uid>, else "
               "/var/tmp/tmsdisk-<uid>; logs to tmsdiskd.log beside the socket; exits after its last session");
  app.add_option("--socket", config.socket_path, "Unix socket ranks and tmsctl connect to")->capture_default_str();
  app.add_option("--staging-budget-mb", config.staging_budget_mb, "default staging budget per rank (pinned host memory), MiB")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--max-staging-budget-mb", config.max_staging_budget_mb,
                 "largest staging a rank may ask for (TMS_DISK_BACKUP_CHUNK_MB), MiB")
      ->capture_default_str();
  app.add_option("--max-staging-per-uid-mb", config.max_staging_per_uid_mb,
                 "pinned staging all sessions of one user may hold together, MiB (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-total-staging-mb", config.max_total_staging_mb, "pinned staging of all sessions together, MiB")
      ->capture_default_str();
  app.add_option("--max-sessions-per-uid", config.max_sessions_per_uid,
                 "sessions (ranks) one user may hold (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-ipc-exports-per-uid", config.max_ipc_exports_per_uid,
                 "allocations one user may share through legacy CUDA IPC at once; each holds one of the daemon's "
                 "file descriptors (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-ipc-exports", config.max_ipc_exports,
                 "legacy CUDA IPC exports of all users together (keep well below the descriptor limit)")
      ->capture_default_str();
  app.add_option("--chunk-mb", config.chunk_mb, "chunk size (bytes per request and per checksum), MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--allow-uid", config.allowed_uids, "uids allowed to connect (default: everyone; root always)");
  app.add_option("--allow-gid", config.allowed_gids, "groups whose members may connect");
  app.add_flag("--allow-tmpfs", config.allow_tmpfs, "accept tmpfs/ramfs roots (data would stay in RAM; for tests)");
  app.add_option("--sweep-interval", config.sweep_interval_s,
                 "seconds between sweeps for dead ranks' files (0: startup only)")
      ->capture_default_str();
  app.add_option("--queue-depth", config.queue_depth, "io_uring submission queue entries")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_flag("--exit-when-idle", config.exit_when_idle, "exit after the last session ends (private per-user daemon)");
  app.add_flag("--detach", o.detach, "fork into the background (how the shim and tmsctl start a private daemon)");
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn, error")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  CLI11_PARSE(app, argc, argv);
  return tmsdisk::run_daemon(std::move(o));
}
