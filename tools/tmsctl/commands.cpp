// SPDX-License-Identifier: Apache-2.0
// tmsctl's subcommands: status, pause/resume, gc, env, run.
#include "commands.h"

#include <limits.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "client.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/private_daemon.h"

namespace tmsdisk::ctl {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string socket_of(const Common& c) {
  return c.socket.empty() ? default_socket_path() : c.socket;
}

int fail(const std::string& what, const Error& e) {
  std::fprintf(stderr, "tmsctl %s: %s\n", what.c_str(), e.describe().c_str());
  return 1;
}

double gb_per_s(uint64_t bytes, uint64_t nanos) {
  return nanos ? static_cast<double>(bytes) / static_cast<double>(nanos) : 0.0;
}

// A rank that declared none (no RANK/SLURM_PROCID) is shown as "-".
std::string rank_text(int64_t rank) {
  return rank < 0 ? "-" : std::to_string(rank);
}

std::string rate_text(uint64_t bytes, uint64_t nanos) {
  if (!nanos) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB/s", gb_per_s(bytes, nanos));
  return buf;
}

uint64_t unmanaged_total(const proto::RankStats& s) {
  uint64_t t = 0;
  for (auto b : s.unmanaged_bytes) t += b;
  return t;
}

fs::path self_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return {};
  buf[n] = '\0';
  return fs::path(buf).parent_path();
}

// $`env`, else what `find` sees beside this executable (paths.h: install tree, then build tree),
// made canonical: it goes into LD_PRELOAD and messages.
std::string find_next_to_self(const char* env, std::string (*find)(const std::string&)) {
  if (const char* e = std::getenv(env); e && *e) return e;
  const std::string found = find(self_dir().string());
  if (found.empty()) return {};
  std::error_code ec;
  fs::path p = fs::weakly_canonical(found, ec);
  return ec ? found : p.string();
}

std::string find_daemon() {
  return find_next_to_self("TMSDISK_DAEMON", find_daemon_beside_tmsctl);
}

}  // namespace

std::string find_shim_library() {
  return find_next_to_self("TMSDISK_LIBRARY", find_shim_beside_tmsctl);
}

int cmd_status(const Common& common) {
  auto client = Client::connect(socket_of(common));
  if (!client) return fail("status", client.error());
  auto sessions = client->list_sessions();
  if (!sessions) return fail("status", sessions.error());
  if (common.json) {
    json out = json::array();
    for (const auto& s : *sessions) {
      json unmanaged = json::object();
      for (std::size_t i = 0; i < proto::kUnmanagedReasons; ++i)
        if (s.stats.unmanaged_bytes[i])
          unmanaged[proto::unmanaged_name(static_cast<proto::Unmanaged>(i))] = s.stats.unmanaged_bytes[i];
      out.push_back({{"session", s.session_id},
                     {"pid", s.pid},
                     {"uid", s.uid},
                     {"job", s.job},
                     {"rank", s.rank},
                     {"state", proto::state_name(static_cast<proto::RankState>(s.stats.state))},
                     {"resident_bytes", s.stats.resident_bytes},
                     {"paused_bytes", s.stats.paused_bytes},
                     {"unmanaged_bytes", unmanaged},
                     {"managed_allocations", s.stats.managed_allocations},
                     {"disk_bytes", s.disk_bytes},
                     {"last_pause", {{"bytes", s.stats.last_pause_bytes}, {"ns", s.stats.last_pause_ns}}},
                     {"last_resume", {{"bytes", s.stats.last_resume_bytes}, {"ns", s.stats.last_resume_ns}}},
                     {"last_change_unix_ms", s.stats.last_change_unix_ms}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  if (sessions->empty()) {
    std::printf("no ranks connected to %s\n", client->socket_path().c_str());
    return 0;
  }
  std::printf("%-16s %5s %8s %-16s %10s %10s %10s %10s %s\n", "JOB", "RANK", "PID", "STATE", "RESIDENT", "PAUSED",
              "UNMANAGED", "DISK", "LAST PAUSE / RESUME");
  for (const auto& s : *sessions) {
    std::string last = "-";
    if (s.stats.last_pause_ns || s.stats.last_resume_ns)
      last = human_bytes(s.stats.last_pause_bytes) + " " + rate_text(s.stats.last_pause_bytes, s.stats.last_pause_ns) +
             " / " + rate_text(s.stats.last_resume_bytes, s.stats.last_resume_ns);
    std::printf("%-16s %5s %8d %-16s %10s %10s %10s %10s %s\n", s.job.c_str(), rank_text(s.rank).c_str(), s.pid,
                proto::state_name(static_cast<proto::RankState>(s.stats.state)),
                human_bytes(s.stats.resident_bytes).c_str(), human_bytes(s.stats.paused_bytes).c_str(),
                human_bytes(unmanaged_total(s.stats)).c_str(), human_bytes(s.disk_bytes).c_str(), last.c_str());
    // Why the unmanaged bytes are not paused, so that nobody has to guess what stayed on the GPU.
    std::string why;
    for (std::size_t i = 0; i < proto::kUnmanagedReasons; ++i) {
      if (!s.stats.unmanaged_bytes[i]) continue;
      why += (why.empty() ? "" : ", ") + std::string(proto::unmanaged_name(static_cast<proto::Unmanaged>(i))) + " " +
             human_bytes(s.stats.unmanaged_bytes[i]);
    }
    if (!why.empty()) std::printf("%-16s %5s %8s   unmanaged: %s\n", "", "", "", why.c_str());
  }
  return 0;
}

int cmd_control(const Common& common, const Selector& sel, bool pause) {
  const char* verb = pause ? "pause" : "resume";
  proto::Control req;
  req.op = static_cast<uint8_t>(pause ? proto::CommandOp::Pause : proto::CommandOp::Resume);
  if (sel.all) {
    if (!sel.job.empty() || sel.rank >= 0 || sel.pid > 0) {
      std::fprintf(stderr, "tmsctl %s: --all cannot be combined with --job, --rank or --pid\n", verb);
      return 2;
    }
    req.match = proto::kMatchAll;
  }
  if (!sel.job.empty()) req.match |= proto::kMatchJob, req.job = sel.job;
  if (sel.rank >= 0) req.match |= proto::kMatchRank, req.rank = sel.rank;
  if (sel.pid > 0) req.match |= proto::kMatchPid, req.pid = sel.pid;
  if (req.match == 0) {
    std::fprintf(stderr, "tmsctl %s: say which ranks: --job J, --rank R, --pid P, or --all\n", verb);
    return 2;
  }
  req.timeout_ms = static_cast<uint32_t>(std::lround(sel.timeout_s * 1000));

  auto client = Client::connect(socket_of(common));
  if (!client) return fail(verb, client.error());

  const bool tty = !common.json && ::isatty(STDERR_FILENO);
  const auto start = std::chrono::steady_clock::now();
  std::map<uint64_t, proto::Progress> progress;
  auto on_progress = [&](const proto::Progress& p) {
    if (!tty) return;
    progress[p.session_id] = p;
    uint64_t done = 0, total = 0;
    for (auto& [id, q] : progress) done += q.done_bytes, total += q.total_bytes;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
    const int width = 30;
    const int filled = total ? static_cast<int>(width * static_cast<double>(done) / static_cast<double>(total)) : 0;
    std::fprintf(stderr, "\r%s [%-*s] %s / %s  %.2f GB/s  ETA %.0fs ", verb, width, std::string(filled, '#').c_str(),
                 human_bytes(done).c_str(), human_bytes(total).c_str(), rate / 1e9, eta);
  };
  auto results = client->control(req, on_progress);
  if (tty && !progress.empty()) std::fprintf(stderr, "\n");
  if (!results) return fail(verb, results.error());

  int failed = 0;
  json out = json::array();
  for (const auto& r : *results) {
    if (r.code != 0) ++failed;
    if (common.json) {
      out.push_back({{"job", r.job},
                     {"rank", r.rank},
                     {"pid", r.pid},
                     {"ok", r.code == 0},
                     {"outcome", proto::outcome_name(static_cast<proto::Outcome>(r.outcome))},
                     {"errno", r.code},
                     {"bytes", r.bytes},
                     {"ns", r.nanos},
                     {"gb_per_s", gb_per_s(r.bytes, r.nanos)},
                     {"message", r.message}});
    } else if (r.code == 0) {
      std::printf("%s rank %s (pid %d): %s in %.2f s (%.2f GB/s)\n", r.job.c_str(), rank_text(r.rank).c_str(), r.pid,
                  human_bytes(r.bytes).c_str(), static_cast<double>(r.nanos) / 1e9, gb_per_s(r.bytes, r.nanos));
    } else {
      std::printf("%s rank %s (pid %d): FAILED: %s (%s)\n", r.job.c_str(), rank_text(r.rank).c_str(), r.pid,
                  r.message.c_str(), std::strerror(r.code));
    }
  }
  if (common.json) std::printf("%s\n", out.dump(2).c_str());
  if (failed && !common.json)
    std::fprintf(stderr, "tmsctl %s: %d of %zu rank(s) failed\n", verb, failed, results->size());
  return failed ? 1 : 0;
}

int cmd_gc(const Common& common) {
  auto client = Client::connect(socket_of(common));
  if (!client) return fail("gc", client.error());
  auto r = client->gc();
  if (!r) return fail("gc", r.error());
  if (common.json)
    std::printf("%s\n", json{{"removed_dirs", r->removed_dirs}, {"removed_bytes", r->removed_bytes}}.dump(2).c_str());
  else
    std::printf("removed %u directories of dead ranks (%s)\n", r->removed_dirs, human_bytes(r->removed_bytes).c_str());
  return 0;
}

namespace {

// The variables a launch needs, in a stable order. `root` is where the daemon keeps files.
std::vector<std::pair<std::string, std::string>> launch_env(const std::string& socket, const std::string& root,
                                                            const LaunchOptions& launch, std::string& error) {
  std::vector<std::pair<std::string, std::string>> env;
  const std::string lib = find_shim_library();
  if (lib.empty()) {
    error = "cannot find libtmsdisk.so next to tmsctl; set TMSDISK_LIBRARY to its path";
    return {};
  }
  std::string preload = lib;
  if (const char* old = std::getenv("LD_PRELOAD"); old && *old && std::string(old).find(lib) == std::string::npos)
    preload += std::string(":") + old;
  env.emplace_back("LD_PRELOAD", preload);
  env.emplace_back("TMSDISK_SOCKET", socket);
  if (!root.empty() && !std::getenv("TMS_DISK_BACKUP_DIR")) env.emplace_back("TMS_DISK_BACKUP_DIR", root);
  if (launch.staging_budget_mb) env.emplace_back("TMS_DISK_BACKUP_CHUNK_MB", std::to_string(launch.staging_budget_mb));
  if (!launch.job.empty()) env.emplace_back("TMSDISK_JOB", launch.job);
  if (launch.min_mb) env.emplace_back("TMSDISK_MIN_BYTES", std::to_string(launch.min_mb << 20));
  if (!launch.on_touch.empty()) env.emplace_back("TMSDISK_ON_TOUCH", launch.on_touch);
  return env;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

int cmd_env(const Common& common, const LaunchOptions& launch) {
  const std::string socket = socket_of(common);
  std::string root;
  if (auto client = Client::connect(socket)) root = client->first_root();
  std::string error;
  auto env = launch_env(socket, root, launch, error);
  if (env.empty()) {
    std::fprintf(stderr, "tmsctl env: %s\n", error.c_str());
    return 1;
  }
  if (common.json) {
    json out = json::object();
    for (auto& [k, v] : env) out[k] = v;
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    for (auto& [k, v] : env) std::printf("export %s=%s\n", k.c_str(), shell_quote(v).c_str());
  }
  return 0;
}

int cmd_run(const Common& common, const LaunchOptions& launch, const std::vector<std::string>& command) {
  std::string socket = socket_of(common);
  auto client = Client::connect(socket);
  if (!client && launch.start_daemon && common.socket.empty() && !std::getenv("TMSDISK_SOCKET")) {
    // No system daemon: start (or join) this user's private one, as the shim itself would.
    const std::string daemon = find_daemon();
    if (daemon.empty()) {
      std::fprintf(stderr, "tmsctl run: no tmsdiskd answers and none was found next to tmsctl (set TMSDISK_DAEMON)\n");
      return 1;
    }
    socket = private_socket_path();
    if (int rc = spawn_private_daemon(daemon, socket, 10000); rc < 0) {
      std::fprintf(stderr, "tmsctl run: could not start a private tmsdiskd (%s); see %s\n", std::strerror(-rc),
                   (fs::path(socket).parent_path() / "tmsdiskd.log").c_str());
      return 1;
    }
    client = Client::connect(socket);
  }
  if (!client) return fail("run", client.error());
  std::string error;
  auto env = launch_env(socket, client->first_root(), launch, error);
  if (env.empty()) {
    std::fprintf(stderr, "tmsctl run: %s\n", error.c_str());
    return 1;
  }
  for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "tmsctl run: cannot run %s: %s\n", argv[0], std::strerror(errno));
  return 127;
}

}  // namespace tmsdisk::ctl
