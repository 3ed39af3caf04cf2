// SPDX-License-Identifier: Apache-2.0
// Helpers of the end-to-end tests: child processes driven line by line, and a node with its own
// tmsdiskd, simcuda ledger and tmsctl. Header-only, included by one test file each.
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
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "test_support.h"

extern char** environ;

namespace tmsdisk::e2e {

namespace fs = std::filesystem;
using namespace tmsdisk::testing;
using nlohmann::json;

inline constexpr uint64_t MiB = 1ull << 20;

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

// A child process with line-oriented stdin/stdout.
class Proc {
 public:
  Proc(const std::vector<std::string>& argv, const Env& env) {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    auto envs = make_env(env);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      std::vector<char*> a, e;
      for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
      a.push_back(nullptr);
      for (auto& s : envs) e.push_back(const_cast<char*>(s.c_str()));
      e.push_back(nullptr);
      ::execve(a[0], a.data(), e.data());
      ::_exit(127);
    }
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

struct Node {
  TempDir dir{test_tmp_root(), "e2e"};
  std::string socket = dir / "d.sock";
  std::string root = dir / "root";
  std::string sim_state = dir / "simcuda-state";
  DaemonProcess daemon;
  uint64_t device_mb = 512;

  Node() { fs::create_directories(root); }
  void start_daemon(std::vector<std::string> extra = {}) {
    std::vector<std::string> args{"--socket", socket, "--root", root, "--staging-mb", "16", "--slot-mb", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    int rc = daemon.start(TMSDISK_DAEMON_PATH, args);
    INFO(daemon.log());
    REQUIRE(rc == 0);
  }
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
  std::pair<int, json> tmsctl(const std::vector<std::string>& args) const {
    std::vector<std::string> argv{TMSCTL_PATH, "--socket", socket, "--json"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto [rc, out] = run(argv, sim_env());
    INFO(out);
    json j = json::parse(out, nullptr, false);
    return {rc, j};
  }
  std::string rank_dir(const std::string& job, int rank, pid_t pid) const {
    return root + "/" + std::to_string(::getuid()) + "/" + job + "/rank" + std::to_string(rank) + "-" +
           std::to_string(pid);
  }
};

// One rank's accounting as `tmsctl status` shows it.
struct Totals {
  uint64_t resident = 0, paused = 0;
  std::map<std::string, uint64_t> unmanaged;  // by reason, as named in the JSON
  std::string state;
  bool operator==(const Totals&) const = default;
};

// The status of the rank with `pid`, or of the only rank when pid is 0; empty if there is none.
inline Totals totals(const Node& node, pid_t pid = 0) {
  Totals t;
  auto [rc, j] = node.tmsctl({"status"});
  if (rc != 0 || !j.is_array() || (pid == 0 && j.size() != 1)) return t;
  for (auto& s : j) {
    if (pid != 0 && s.value("pid", 0) != pid) continue;
    t.resident = s.value("resident_bytes", uint64_t{0});
    t.paused = s.value("paused_bytes", uint64_t{0});
    t.state = s.value("state", "");
    for (auto& [k, v] : s["unmanaged_bytes"].items()) t.unmanaged[k] = v.get<uint64_t>();
  }
  return t;
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
