// SPDX-License-Identifier: Apache-2.0
// Helpers of the end-to-end tests: child processes driven line by line, and a node with its own
// tmsdiskd, simcuda ledger and tmsctl, so that a case reads `node.pause("job")`, `node.status()`.
// Header-only (it uses Catch2, nlohmann_json and tmsdisk_ctl, which the e2e suites link), included by
// one test file each; the paths of the binaries come from the suite's compile definitions.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "daemon_fixture.h"
#include "test_support.h"

extern char** environ;

namespace tmsdisk::e2e {

namespace fs = std::filesystem;
using namespace tmsdisk::testing;
using nlohmann::json;

using Env = std::map<std::string, std::string>;

// The current environment, minus anything that would leak between tests, plus `extra`.
inline std::vector<std::string> make_env(const Env& extra) {
  Env env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string k = kv.substr(0, eq);
    if (k == "LD_PRELOAD" || k.rfind("TMSDISK_", 0) == 0 || k.rfind("TMS_DISK_", 0) == 0 ||
        k.rfind("SIMCUDA_", 0) == 0 || k == "RANK" || k == "XDG_RUNTIME_DIR")
      continue;
    env[k] = kv.substr(eq + 1);
  }
  for (auto& [k, v] : extra) env[k] = v;
  std::vector<std::string> out;
  for (auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

// Starts `argv` with `env` (make_env) and the given descriptors as its stdin, stdout and stderr
// (-1: keep the test's own). Returns the child's pid.
inline pid_t spawn(const std::vector<std::string>& argv, const Env& env, int in, int out, int err) {
  auto envs = make_env(env);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fds[3] = {in, out, err};
    for (int i = 0; i < 3; ++i)
      if (fds[i] >= 0) ::dup2(fds[i], i);
    std::vector<char*> a, e;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    for (auto& s : envs) e.push_back(const_cast<char*>(s.c_str()));
    e.push_back(nullptr);
    ::execve(a[0], a.data(), e.data());
    ::_exit(127);
  }
  return pid;
}

// A child process with line-oriented stdin/stdout.
class Proc {
 public:
  Proc(const std::vector<std::string>& argv, const Env& env) {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    pid_ = spawn(argv, env, in[0], out[1], -1);
    ::close(in[0]);
    ::close(out[1]);
    to_.reset(in[1]);
    from_.reset(out[0]);
  }
  ~Proc() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }

  // Reads one line (the program's answer); empty on EOF or timeout.
  std::string line(int timeout_ms = 120000) {
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      pollfd p{from_.get(), POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) return {};
      char tmp[4096];
      ssize_t n = ::read(from_.get(), tmp, sizeof(tmp));
      if (n <= 0) return {};
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }
  void send(const std::string& c) {
    std::string l = c + "\n";
    REQUIRE(::write(to_.get(), l.data(), l.size()) == static_cast<ssize_t>(l.size()));
  }
  std::string cmd(const std::string& c) {
    std::string l = c + "\n";
    REQUIRE(::write(to_.get(), l.data(), l.size()) == static_cast<ssize_t>(l.size()));
    return line();
  }
  int wait() {
    to_.reset();
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  UniqueFd to_, from_;
  std::string buf_;
};

// Runs a command to completion; returns {exit status, stdout}.
inline std::pair<int, std::string> run(const std::vector<std::string>& argv, const Env& env) {
  Proc p(argv, env);
  std::string out, l;
  while (!(l = p.line()).empty() || false) out += l + "\n";
  return {p.wait(), out};
}

// What a command printed and how it ended (run_captured).
struct Captured {
  int rc = -1;      // exit status, 128 + signal if killed
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs a command to completion with stdin from /dev/null, collecting stdout and stderr apart (the CLI
// tests assert on each). A command still running after `timeout_ms` is killed (rc 128 + SIGKILL).
inline Captured run_captured(const std::vector<std::string>& argv, const Env& env, int timeout_ms = 120000) {
  int out[2], err[2];
  REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
  UniqueFd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  REQUIRE(null);
  const pid_t pid = spawn(argv, env, null.get(), out[1], err[1]);
  ::close(out[1]);
  ::close(err[1]);
  UniqueFd from_out(out[0]), from_err(err[0]);
  Captured c;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool killed = false;
  while (from_out || from_err) {
    pollfd p[2] = {{from_out ? from_out.get() : -1, POLLIN, 0}, {from_err ? from_err.get() : -1, POLLIN, 0}};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0 || ::poll(p, 2, static_cast<int>(left)) == 0) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char tmp[4096];
      ssize_t n = ::read(p[i].fd, tmp, sizeof(tmp));
      if (n > 0) {
        (i == 0 ? c.out : c.err).append(tmp, static_cast<size_t>(n));
      } else {
        (i == 0 ? from_out : from_err).reset();
      }
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  c.rc = killed || WIFSIGNALED(status) ? 128 + (killed ? SIGKILL : WTERMSIG(status)) : WEXITSTATUS(status);
  return c;
}

// One rank's accounting as `tmsctl status` shows it.
struct Totals {
  uint64_t resident = 0, paused = 0;
  std::map<std::string, uint64_t> unmanaged;  // by reason, as named in the JSON
  std::string state;
  bool operator==(const Totals&) const = default;
};

// One rank as `tmsctl status` lists it.
struct RankStatus {
  std::string job;
  int64_t rank = -1;
  pid_t pid = 0;
  Totals totals;
  uint64_t disk_bytes = 0;       // reserved in its files
  uint64_t host_tier_bytes = 0;  // of the node's host tier, held now
  bool host_tier_kept = false;   // ... empty, kept for the rank's next pause
};

// One rank's part in a `tmsctl pause` or `resume`.
struct RankOutcome {
  std::string job;
  int64_t rank = -1;
  pid_t pid = 0;
  bool ok = false;
  int error = 0;  // errno, 0 when ok
  uint64_t bytes = 0;
  // What of `bytes` did not go through the disk, and what did (moved).
  uint64_t zero_bytes = 0, unchanged_bytes = 0, host_bytes = 0, moved_bytes = 0;
  uint64_t discarded_bytes = 0;  // under a discard policy: released unsaved, zero-filled on resume
  std::string message;
  std::string outcome;  // "done", or "no-op": the rank was already in the state asked for
};

// What a `tmsctl pause` or `resume` did: tmsctl's exit status and each rank's part, in rank order.
// `text` is what tmsctl printed, for INFO(), so a failure shows the whole answer.
struct Outcome {
  int rc = -1;
  std::vector<RankOutcome> ranks;
  std::string text;
  bool ok() const { return rc == 0; }  // tmsctl succeeded: every rank did
  std::size_t size() const { return ranks.size(); }
  const RankOutcome& operator[](std::size_t i) const { return ranks.at(i); }
};

// The node's daemon is the tests' one tmsdiskd fixture (daemon_fixture.h), on one root, at its own log
// level, with 16 MiB of staging and chunks of 2 MiB.
struct Node {
  Daemon tmsdiskd{Daemon::Options{.log_level = "", .args = {"--staging-budget-mb", "16", "--chunk-mb", "2"}}};
  // The fixture's, by the names the cases use: `root` may be pointed elsewhere before the daemon starts.
  const TempDir& dir = tmsdiskd.dir;
  const std::string& socket = tmsdiskd.socket;
  std::string& root = tmsdiskd.roots.front();
  DaemonProcess& daemon = tmsdiskd.proc;
  std::string sim_state = dir / "simcuda-state";
  uint64_t device_mb = 512;

  void start_daemon(const std::vector<std::string>& extra = {}) { tmsdiskd.start(extra); }
  Env sim_env() const {
    return {{"LD_LIBRARY_PATH", SIMCUDA_DIR},
            {"SIMCUDA_STATE", sim_state},
            {"SIMCUDA_DEVICE_MEM_MB", std::to_string(device_mb)}};
  }
  Env shim_env(const std::string& job, int rank) const {
    Env e = sim_env();
    e["LD_PRELOAD"] = SHIM_PATH;
    e["TMSDISK_SOCKET"] = socket;
    e["TMSDISK_JOB"] = job;
    e["RANK"] = std::to_string(rank);
    e["TMSDISK_LOG"] = "info";
    return e;
  }
  // A second process (without the shim) asking for `mib` MiB of device memory.
  bool probe(uint64_t mib) const { return run({CUDA_PROBE_PATH, std::to_string(mib)}, sim_env()).first == 0; }

  // `tmsctl pause|resume` of every rank of `job`, or of one process; see Outcome.
  Outcome pause(const std::string& job) const { return control("pause", {"--job", job}); }
  Outcome resume(const std::string& job) const { return control("resume", {"--job", job}); }
  Outcome pause(pid_t pid) const { return control("pause", {"--pid", std::to_string(pid)}); }
  Outcome resume(pid_t pid) const { return control("resume", {"--pid", std::to_string(pid)}); }
  // Every rank `tmsctl status` lists; empty if tmsctl failed.
  std::vector<RankStatus> status() const;
  // `tmsctl --json args...`: its exit status and what it printed.
  std::pair<int, std::string> tmsctl(const std::vector<std::string>& args) const {
    std::vector<std::string> argv{TMSCTL_PATH, "--socket", socket, "--json"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, sim_env());
  }
  // `tmsctl --json <verb> <selector...>` for pause and resume, its answer parsed.
  Outcome control(const std::string& verb, const std::vector<std::string>& selector) const;
  std::string rank_dir(const std::string& job, int rank, pid_t pid) const {
    return tmsdiskd.rank_dir(0, job, rank, pid);
  }
};

inline Outcome Node::control(const std::string& verb, const std::vector<std::string>& selector) const {
  std::vector<std::string> args{verb};
  args.insert(args.end(), selector.begin(), selector.end());
  Outcome o;
  std::tie(o.rc, o.text) = tmsctl(args);
  json j = json::parse(o.text, nullptr, false);
  if (!j.is_array()) return o;
  for (auto& r : j)
    o.ranks.push_back({.job = r.value("job", ""),
                       .rank = r.value("rank", int64_t{-1}),
                       .pid = r.value("pid", pid_t{0}),
                       .ok = r.value("ok", false),
                       .error = r.value("errno", 0),
                       .bytes = r.value("bytes", uint64_t{0}),
                       .zero_bytes = r.value("zero_bytes", uint64_t{0}),
                       .unchanged_bytes = r.value("unchanged_bytes", uint64_t{0}),
                       .host_bytes = r.value("host_bytes", uint64_t{0}),
                       .moved_bytes = r.value("moved_bytes", uint64_t{0}),
                       .discarded_bytes = r.value("discarded_bytes", uint64_t{0}),
                       .message = r.value("message", ""),
                       .outcome = r.value("outcome", "")});
  return o;
}

inline std::vector<RankStatus> Node::status() const {
  auto [rc, out] = tmsctl({"status"});
  json j = json::parse(out, nullptr, false);
  if (rc != 0 || !j.is_array()) return {};
  std::vector<RankStatus> ranks;
  for (auto& s : j) {
    RankStatus r{.job = s.value("job", ""), .rank = s.value("rank", int64_t{-1}), .pid = s.value("pid", pid_t{0})};
    r.totals.resident = s.value("resident_bytes", uint64_t{0});
    r.totals.paused = s.value("paused_bytes", uint64_t{0});
    r.totals.state = s.value("state", "");
    r.disk_bytes = s.value("disk_bytes", uint64_t{0});
    r.host_tier_bytes = s.value("host_tier_bytes", uint64_t{0});
    r.host_tier_kept = s.value("host_tier_kept", false);
    for (auto& [k, v] : s["unmanaged_bytes"].items()) r.totals.unmanaged[k] = v.get<uint64_t>();
    ranks.push_back(std::move(r));
  }
  return ranks;
}

// The status of the rank with `pid`, or of the only rank when pid is 0; empty if there is none.
inline Totals totals(const Node& node, pid_t pid = 0) {
  auto ranks = node.status();
  if (pid == 0) return ranks.size() == 1 ? ranks[0].totals : Totals{};
  for (auto& r : ranks)
    if (r.pid == pid) return r.totals;
  return {};
}

inline uint64_t accounted(const Totals& t) {
  uint64_t sum = t.resident + t.paused;
  for (auto& [k, v] : t.unmanaged) sum += v;
  return sum;
}

inline std::string show(const Totals& t) {
  std::ostringstream o;
  o << "state=" << t.state << " resident=" << t.resident << " paused=" << t.paused;
  for (auto& [k, v] : t.unmanaged) o << " " << k << "=" << v;
  return o.str();
}

inline std::string ok_addr(const std::string& answer) {
  auto sp = answer.rfind(' ');
  return answer.rfind("ok ", 0) == 0 && sp != std::string::npos ? answer.substr(sp + 1) : "";
}

}  // namespace tmsdisk::e2e
