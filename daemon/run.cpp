// SPDX-License-Identifier: Apache-2.0
// tmsdiskd once its options are parsed (run.h): detaching, the private per-user daemon's settings,
// logging, socket activation, limits and signals around Server::run().
#include "run.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>

#include "systemd.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/private_daemon.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk {
namespace {
server::Server* g_server = nullptr;

// Creates `path` as a directory private to this user, or accepts it if it already is one: a
// directory another user created (the /tmp fallback is public) or opened up is refused, not fixed.
Status make_private_dir(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return errno_error("cannot create " + path.string());
  // The words tmsctl run and the shim use for the same refusal: whose the directory is, what to do.
  if (std::string why = private_dir_problem((path / "tmsdiskd.sock").string()); !why.empty())
    return make_error(EPERM, why);
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno_error("cannot look at " + path.string());
  return {};
}

// Settings of the private per-user daemon, from the environment (DESIGN.md "Embedded default").
Status configure_private(server::Config& config) {
  config.socket_path = private_socket_path();
  if (auto st = make_private_dir(std::filesystem::path(config.socket_path).parent_path()); !st) return st;
  std::string root;
  if (const char* dir = std::getenv("TMS_DISK_BACKUP_DIR"); dir && *dir) {
    // The user's own choice (perhaps a group project directory): used as it is, never chmod'ed.
    root = dir;
    const std::string what = "TMS_DISK_BACKUP_DIR=" + root;
    // The cause in words of its own (no errno text after it, which would only repeat it).
    struct stat st {};
    if (::stat(root.c_str(), &st) != 0) {
      if (errno == ENOENT)
        return make_error(0, what +
                                 " does not exist: create it, or unset TMS_DISK_BACKUP_DIR to use "
                                 "$SCRATCH/tmsdisk-<uid>, else /var/tmp/tmsdisk-<uid>");
      return errno_error("cannot use " + what);
    }
    if (!S_ISDIR(st.st_mode)) return make_error(0, what + " is not a directory");
  } else {
    const char* scratch = std::getenv("SCRATCH");
    root = fmt::format("{}/tmsdisk-{}", scratch && *scratch ? scratch : "/var/tmp", ::getuid());
    if (auto st = make_private_dir(root); !st) return st;
  }
  config.roots = {root};
  config.exit_when_idle = true;
  return {};
}

// Creates the socket's directory when it is missing, as systemd's RuntimeDirectory= does for the
// service: a daemon started by hand with the default socket would otherwise fail on a missing
// /run/tmsdisk. One level only, mode 0755 whatever the umask (every user connects
// through it), and never through a symlink: mkdir() does not follow one, and the mode is set on the
// directory opened with O_NOFOLLOW. A path that exists is left as it is.
Status make_socket_dir(const std::string& socket_path) {
  const std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty()) return {};
  const std::string remedy =
      fmt::format("create it (mkdir -m 0755 {}), pass --socket PATH in a directory you can write to, or use --private",
                  dir.string());
  if (::mkdir(dir.c_str(), 0755) != 0) {
    if (errno == EEXIST) return {};
    return errno_error(fmt::format("cannot create the socket directory {} ({})", dir.string(), remedy));
  }
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd || ::fchmod(fd.get(), 0755) != 0)
    return errno_error(fmt::format("cannot set mode 0755 on the socket directory {} ({})", dir.string(), remedy));
  spdlog::info("created the socket directory {} (mode 0755)", dir.string());
  return {};
}

void on_signal(int) {
  if (g_server) g_server->stop();
}

// --detach, in the parent: waits for the daemon (`child`) to write one byte on `ready`, the sign that
// it serves its socket, or to close it by exiting. Returns the parent's exit status: 0 once it
// serves, else the daemon's own status (it has said why on the stderr both share), so that whoever
// started tmsdiskd learns of a failure at once rather than by waiting for a socket.
int await_detached(UniqueFd ready, pid_t child) {
  char byte = 0;
  ssize_t n;
  while ((n = ::read(ready.get(), &byte, 1)) < 0 && errno == EINTR) {
  }
  if (n == 1) return 0;
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    std::fprintf(stderr, "tmsdiskd: the daemon was killed by signal %d before it served\n", WTERMSIG(status));
  return kExitRuntimeFailure;
}

// --detach, in the daemon: tells the parent that it serves. A private daemon logs to its file, so it
// first lets go of the stdio it inherited (a terminal, or the pipe of the tmsctl or shim that started
// it, which waits for the parent's exit and would otherwise still see a writer).
void report_ready(UniqueFd& ready, bool private_mode) {
  if (!ready) return;
  if (private_mode) {
    if (UniqueFd null(::open("/dev/null", O_RDWR | O_CLOEXEC)); null)
      for (int fd = 0; fd <= 2; ++fd) ::dup2(null.get(), fd);
  }
  const char byte = 1;
  while (::write(ready.get(), &byte, 1) < 0 && errno == EINTR) {
  }
  ready.reset();
}
}  // namespace

int run_daemon(DaemonOptions o) {
  UniqueFd ready;  // --detach: the pipe to the parent, written once the daemon serves
  if (o.detach) {
    // Before anything starts a thread or opens a ring, a lock or a socket. The parent stays until the
    // daemon serves or fails, and exits with that outcome.
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      std::perror("tmsdiskd: pipe");
      return kExitRuntimeFailure;
    }
    UniqueFd read_end(fds[0]), write_end(fds[1]);
    pid_t child = ::fork();
    if (child < 0) {
      std::perror("tmsdiskd: fork");
      return kExitRuntimeFailure;
    }
    if (child > 0) {
      write_end.reset();
      return await_detached(std::move(read_end), child);
    }
    ready = std::move(write_end);
    ::setsid();
  }
  if (o.private_mode) {
    if (auto st = configure_private(o.config); !st) {
      std::fprintf(stderr, "tmsdiskd --private: %s\n", st.error().describe().c_str());
      return kExitRuntimeFailure;
    }
    const std::string log = std::filesystem::path(o.config.socket_path).parent_path() / "tmsdiskd.log";
    spdlog::set_default_logger(spdlog::basic_logger_mt("tmsdiskd", log));
    spdlog::flush_on(spdlog::level::info);
  } else {
    spdlog::set_default_logger(spdlog::stderr_logger_mt("tmsdiskd"));
  }
  spdlog::set_level(spdlog::level::from_str(o.log_level));
  // journald adds its own timestamps; keep the line short.
  spdlog::set_pattern(::getenv("JOURNAL_STREAM") ? "[%l] %v" : "%Y-%m-%d %H:%M:%S.%e [%l] %v");

  // Socket activation: systemd passes the listening socket as fd 3.
  if (systemd::listen_fds() == 1) {
    o.config.listen_fd = 3;  // SD_LISTEN_FDS_START
    ::fcntl(o.config.listen_fd, F_SETFL, ::fcntl(o.config.listen_fd, F_GETFL) | O_NONBLOCK);
  }

  // Every session holds a few descriptors per root; the default soft limit of 1024 would cap a node
  // at a few dozen ranks. The hard limit is the administrator's (LimitNOFILE=).
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  auto created = [&]() -> Result<std::unique_ptr<server::Server>> {
    if (auto st = make_socket_dir(o.config.socket_path); !st) return std::move(st).error();
    return server::Server::create(o.config);
  }();
  if (!created) {
    spdlog::error("cannot start: {}", created.error().describe());
    // The private daemon's log is a file no one is watching yet: its starter reads stderr.
    if (o.private_mode)
      std::fprintf(stderr, "tmsdiskd --private: cannot start: %s\n", created.error().describe().c_str());
    systemd::notify(fmt::format("STATUS=failed: {}", created.error().describe()).c_str());
    // Another daemon holding the socket's lock is a status of its own: for the ranks that raced to
    // start the private daemon, the winner serves them (private_daemon.h).
    return created.error().errnum() == EADDRINUSE ? kExitAlreadyServed : kExitRuntimeFailure;
  }
  std::unique_ptr<server::Server> instance = std::move(created).value();
  g_server = instance.get();
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  spdlog::info("serving {} with {} root(s)", o.config.socket_path, o.config.roots.size());
  systemd::notify("READY=1");
  report_ready(ready, o.private_mode);
  auto st = instance->run();
  systemd::notify("STOPPING=1");
  g_server = nullptr;
  if (!st) {
    spdlog::error("stopped on error: {}", st.error().describe());
    return kExitRuntimeFailure;
  }
  spdlog::info("stopped");
  return 0;
}

}  // namespace tmsdisk
