// SPDX-License-Identifier: Apache-2.0
// The one tmsdiskd fixture of the tests that drive a real daemon over its socket: a child process on a
// temp socket and temp roots, the clients a case talks to it with, and what a hostile case checks
// afterwards (it still serves, it holds no descriptor more). Header-only, for Catch2 test programs
// that link tmsdisk_ctl and define TMSDISK_DAEMON_PATH.
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "client.h"
#include "test_support.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::testing {

// Descriptors open in process `pid` right now (/proc/<pid>/fd), or -1 when they cannot be counted.
inline int open_fds(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// What process `pid`'s descriptors name, one per line (for a failure's message).
inline std::string describe_fds(pid_t pid) {
  std::string out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::error_code link_ec;
    out += e.path().filename().string() + " -> " + std::filesystem::read_symlink(e.path(), link_ec).string() + "\n";
  }
  return out;
}

// The sessions the daemon on `socket` lists (`tmsctl status`); 999 if it does not answer. A session
// whose shim went and whose I/O is still in flight is not listed.
inline std::size_t listed_sessions(const std::string& socket) {
  auto c = ctl::Client::connect(socket);
  if (!c) return 999;
  auto s = c->list_sessions();
  return s ? s->size() : 999;
}

// The errno with which the request `m` failed (the daemon's ERROR answer), 0 when it succeeded.
inline int expect_error(ShimClient& c, const proto::Message& m) {
  auto r = c.call(m);
  if (r) return 0;
  return r.error().errnum();
}

// The bytes the files under `dir` take on disk (allocated blocks, holes not counted).
inline uint64_t dir_bytes(const std::string& dir) {
  uint64_t total = 0;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// A session of two 64 KiB chunks (128 KiB of staging).
// A child process that runs `work` (a client's requests) and then waits to be killed; returns its
// pid once `work` succeeded (a failed one fails the test).
inline pid_t fork_client(const std::function<bool()>& work) {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    if (!work()) ::_exit(1);
    char x = 1;
    (void)!::write(ready[1], &x, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char x = 0;
  const bool ok = ::read(ready[0], &x, 1) == 1;
  ::close(ready[0]);
  REQUIRE(ok);
  return child;
}

inline ShimClient::Options small_session(const std::string& job, int64_t rank = 0) {
  return {.job = job, .rank = rank, .staging_budget_bytes = 128 << 10, .chunk_bytes = 64 << 10};
}

// A tmsdiskd child on its own socket and roots (root0, root1, ... under one temp directory), started
// with debug logging (unless the options say otherwise) and whatever options a case adds (see
// DaemonProcess).
struct Daemon {
  struct Options {
    int roots = 1;
    // What a shim-role session asks for unless the case says otherwise.
    uint64_t staging_budget_bytes = 32 * MiB;
    uint32_t chunk_bytes = 4 * MiB;
    // The daemon's --log-level; empty: its own default.
    std::string log_level = "debug";
    // Options every start() passes, before a case's own.
    std::vector<std::string> args;
  };

  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::vector<std::string> roots;
  DaemonProcess proc;
  Options options;

  explicit Daemon(int nroots = 1) : Daemon(Options{.roots = nroots}) {}
  explicit Daemon(Options o) : options(o) {
    for (int i = 0; i < o.roots; ++i) {
      roots.push_back(dir / ("root" + std::to_string(i)));
      std::filesystem::create_directories(roots.back());
    }
  }
  std::vector<std::string> args(const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> a{"--socket", socket};
    if (!options.log_level.empty()) a.insert(a.end(), {"--log-level", options.log_level});
    for (auto& r : roots) a.insert(a.end(), {"--root", r});
    a.insert(a.end(), options.args.begin(), options.args.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  void start(const std::vector<std::string>& extra = {}) {
    int rc = proc.start(TMSDISK_DAEMON_PATH, args(extra));
    INFO(proc.log());
    REQUIRE(rc == 0);
  }
  // A shim-role session, with the fixture's sizes where the options give none.
  Result<ShimClient> try_shim(ShimClient::Options o = {}) const {
    if (!o.staging_budget_bytes) o.staging_budget_bytes = options.staging_budget_bytes;
    if (!o.chunk_bytes) o.chunk_bytes = options.chunk_bytes;
    return ShimClient::connect(socket, o);
  }
  ShimClient shim(ShimClient::Options o = {}) const {
    auto c = try_shim(std::move(o));
    INFO((c ? "" : c.error().describe()));
    REQUIRE(c);
    return std::move(c.value());
  }
  ctl::Client control() const {
    auto c = ctl::Client::connect(socket);
    INFO((c ? "" : c.error().describe()));
    REQUIRE(c);
    return std::move(c.value());
  }
  std::size_t session_count() const { return listed_sessions(socket); }
  // What LIST_SESSIONS answers (`tmsctl status`), empty if it fails.
  std::vector<proto::SessionInfo> sessions() const {
    auto c = ctl::Client::connect(socket);
    if (!c) return {};
    auto s = c->list_sessions();
    return s ? std::move(s).value() : std::vector<proto::SessionInfo>{};
  }
  // Whether the one session listed is an orphan (its shim's connection gone, its files kept).
  bool one_orphan() const {
    auto s = sessions();
    return s.size() == 1 && s[0].orphaned == 1;
  }
  std::string rank_dir(std::size_t root, const std::string& job, int64_t rank, pid_t pid,
                       uid_t uid = ::getuid()) const {
    return roots[root] + "/" + std::to_string(uid) + "/" + job + "/rank" + std::to_string(rank) + "-" +
           std::to_string(pid);
  }
  int fds() const { return open_fds(proc.pid()); }

  // The daemon still serves a well-formed client: a control client lists the sessions, and a
  // shim-role client pauses and resumes two chunks (reserve, write, commit, read back verified,
  // commit). Resumed, the canary's session and files go when this returns (a session closed mid-pause
  // would rightly be kept as an orphan while this process lives).
  void check_serving(const std::string& job = "canary") const {
    auto ctl = control();
    auto list = ctl.list_sessions();
    INFO((list ? "" : list.error().describe()));
    CHECK(list);
    static int64_t next_rank = 0;
    auto c = shim({.job = job, .rank = next_rank++});
    const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
    auto reserved = c.reserve(blobs);
    INFO((reserved ? "" : reserved.error().describe()));
    REQUIRE(reserved);
    auto written = c.write_all(blobs, fill_pattern);
    INFO((written ? "" : written.error().describe()));
    REQUIRE(written);
    REQUIRE(c.commit(proto::CommitState::Paused));
    auto read = c.read_all(blobs, check_pattern);
    INFO((read ? "" : read.error().describe()));
    CHECK(read);
    CHECK(c.commit(proto::CommitState::Resumed));
  }

  // The daemon holds no more descriptors than `baseline` once what it was handed is closed (its
  // reaper thread closes passed descriptors, sessions end after their I/O: waited for, not slept on).
  void check_fds(int baseline) const {
    REQUIRE(baseline > 0);
    int now = -1;
    const bool back = eventually([&] { return (now = fds()) <= baseline; }, std::chrono::seconds(20));
    INFO("daemon descriptors: " << baseline << " before, " << now << " after:\n" << describe_fds(proc.pid()));
    CHECK(back);
  }
};

}  // namespace tmsdisk::testing
