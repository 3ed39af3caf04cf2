// SPDX-License-Identifier: Apache-2.0
// tmsdiskd: parses options (command line and config file), then runs the server until SIGTERM.
#include <fcntl.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <spdlog/sinks/basic_file_sink.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <filesystem>

#include "server.h"
#include "systemd.h"
#include "tmsdisk/common/paths.h"

namespace {
tmsdisk::server::Server* g_server = nullptr;

// Creates `path` as a directory private to this user, or accepts it if it already is one: a
// directory another user created (the /tmp fallback is public) or opened up is refused, not fixed.
tmsdisk::Status make_private_dir(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return tmsdisk::errno_error("cannot create " + path.string());
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077) != 0)
    return tmsdisk::make_error(EPERM, path.string() + " must be a directory of this user with mode 0700; remove it "
                                                      "(another user may have created it) or set XDG_RUNTIME_DIR");
  return {};
}

// Settings of the private per-user daemon, from the environment (DESIGN.md "Embedded default").
tmsdisk::Status configure_private(tmsdisk::server::Config& config) {
  config.socket_path = tmsdisk::private_socket_path();
  if (auto st = make_private_dir(std::filesystem::path(config.socket_path).parent_path()); !st) return st;
  std::string root;
  if (const char* dir = std::getenv("TMS_DISK_BACKUP_DIR"); dir && *dir) {
    // The user's own choice (perhaps a group project directory): used as it is, never chmod'ed.
    root = dir;
    struct stat st{};
    if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return tmsdisk::make_error(ENOTDIR, "TMS_DISK_BACKUP_DIR=" + root + " is not a directory");
  } else {
    const char* scratch = std::getenv("SCRATCH");
    root = std::string(scratch && *scratch ? scratch : "/var/tmp") + "/tmsdisk-" + std::to_string(::getuid());
    if (auto st = make_private_dir(root); !st) return st;
  }
  config.roots = {root};
  config.exit_when_idle = true;
  return {};
}
void on_signal(int) { if (g_server) g_server->stop(); }
}  // namespace

int main(int argc, char** argv) {
  tmsdisk::server::Config config;
  std::string log_level = "info";
  CLI::App app{
      "tmsdiskd: the tmsdisk node daemon. Owns the NVMe directories where paused GPU memory is kept, the\n"
      "staging buffers shared with each rank, and the file I/O (io_uring, O_DIRECT). Ranks started with\n"
      "`tmsctl run` (or LD_PRELOAD=libtmsdisk.so) connect to it; `tmsctl pause/resume/status` drive it."};
  app.set_config("--config", "/etc/tmsdisk/tmsdiskd.conf",
                 "TOML/INI file with the same keys as the long options (e.g. root = [\"/nvme0\", \"/nvme1\"])");
  app.add_option("--root", config.roots, "storage root directory; repeat once per NVMe (chunks stripe across them)");
  bool private_mode = false;
  app.add_flag("--private", private_mode,
               "run as this user's private daemon (what `tmsctl run` and the shim start when no daemon answers): "
               "socket under $XDG_RUNTIME_DIR/tmsdisk, root $TMS_DISK_BACKUP_DIR, else $SCRATCH/tmsdisk-<uid>, else "
               "/var/tmp/tmsdisk-<uid>; logs to tmsdiskd.log beside the socket; exits after its last session");
  app.add_option("--socket", config.socket_path, "Unix socket ranks and tmsctl connect to")->capture_default_str();
  app.add_option("--staging-mb", config.staging_mb, "default staging (chunk budget) per rank, MiB")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--max-staging-mb", config.max_staging_mb, "largest staging a rank may ask for (TMS_DISK_BACKUP_CHUNK_MB), MiB")
      ->capture_default_str();
  app.add_option("--max-staging-per-uid-mb", config.max_staging_per_uid_mb,
                 "pinned staging all sessions of one user may hold together, MiB (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-total-staging-mb", config.max_total_staging_mb, "pinned staging of all sessions together, MiB")
      ->capture_default_str();
  app.add_option("--max-sessions-per-uid", config.max_sessions_per_uid, "sessions (ranks) one user may hold (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-ipc-exports-per-uid", config.max_ipc_exports_per_uid,
                 "allocations one user may share through legacy CUDA IPC at once; each holds one of the daemon's "
                 "file descriptors (root: unlimited)")
      ->capture_default_str();
  app.add_option("--max-ipc-exports", config.max_ipc_exports,
                 "legacy CUDA IPC exports of all users together (keep well below the descriptor limit)")
      ->capture_default_str();
  app.add_option("--slot-mb", config.slot_mb, "bytes per I/O request and staging slot, MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--allow-uid", config.allowed_uids, "uids allowed to connect (default: everyone; root always)");
  app.add_option("--allow-gid", config.allowed_gids, "groups whose members may connect");
  app.add_flag("--allow-tmpfs", config.allow_tmpfs, "accept tmpfs/ramfs roots (data would stay in RAM; for tests)");
  app.add_option("--sweep-interval", config.sweep_interval_s, "seconds between sweeps for dead ranks' files (0: startup only)")
      ->capture_default_str();
  app.add_option("--queue-depth", config.queue_depth, "io_uring submission queue entries")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_flag("--exit-when-idle", config.exit_when_idle, "exit after the last session ends (private per-user daemon)");
  bool detach = false;
  app.add_flag("--detach", detach, "fork into the background (how the shim and tmsctl start a private daemon)");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));
  CLI11_PARSE(app, argc, argv);

  if (detach) {
    // Before anything opens a ring, a lock or a socket: the parent only tells its caller "started".
    pid_t child = ::fork();
    if (child < 0) {
      std::perror("tmsdiskd: fork");
      return 1;
    }
    if (child > 0) return 0;
    ::setsid();
  }
  if (private_mode) {
    if (auto st = configure_private(config); !st) {
      std::fprintf(stderr, "tmsdiskd --private: %s\n", st.error().describe().c_str());
      return 1;
    }
    const std::string log = std::filesystem::path(config.socket_path).parent_path() / "tmsdiskd.log";
    spdlog::set_default_logger(spdlog::basic_logger_mt("tmsdiskd", log));
    spdlog::flush_on(spdlog::level::info);
  } else if (config.roots.empty()) {
    std::fprintf(stderr, "tmsdiskd: no storage root: pass --root DIR (once per NVMe), set root in %s, or use --private\n",
                 "/etc/tmsdisk/tmsdiskd.conf");
    return 2;
  } else {
    spdlog::set_default_logger(spdlog::stderr_logger_mt("tmsdiskd"));
  }
  spdlog::set_level(spdlog::level::from_str(log_level));
  // journald adds its own timestamps; keep the line short.
  spdlog::set_pattern(::getenv("JOURNAL_STREAM") ? "[%l] %v" : "%Y-%m-%d %H:%M:%S.%e [%l] %v");

  // Socket activation: systemd passes the listening socket as fd 3.
  if (tmsdisk::systemd::listen_fds() == 1) {
    config.listen_fd = 3;  // SD_LISTEN_FDS_START
    ::fcntl(config.listen_fd, F_SETFL, ::fcntl(config.listen_fd, F_GETFL) | O_NONBLOCK);
  }

  // Every session holds a few descriptors per root; the default soft limit of 1024 would cap a node
  // at a few dozen ranks. The hard limit is the administrator's (LimitNOFILE=).
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  auto server = tmsdisk::server::Server::create(config);
  if (!server) {
    spdlog::error("cannot start: {}", server.error().describe());
    tmsdisk::systemd::notify(("STATUS=failed: " + server.error().describe()).c_str());
    return 1;
  }
  g_server = server->get();
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  spdlog::info("serving {} with {} root(s)", config.socket_path, config.roots.size());
  tmsdisk::systemd::notify("READY=1");
  auto st = (*server)->run();
  tmsdisk::systemd::notify("STOPPING=1");
  g_server = nullptr;
  if (!st) {
    spdlog::error("stopped on error: {}", st.error().describe());
    return 1;
  }
  spdlog::info("stopped");
  return 0;
}
