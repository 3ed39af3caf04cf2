// SPDX-License-Identifier: Apache-2.0
// A tmsdiskd server running on a thread of the test process, for tests that inject I/O faults into
// its engine, set its test hooks or read its accounting, and a gate that holds its workers at those
// hooks. Header-only: include it from targets that link tmsdisk_server.
#pragma once

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "server.h"
#include "temp_dir.h"

namespace tmsdisk::testing {

struct InProcessDaemon {
  std::unique_ptr<server::Server> srv;
  std::thread loop;

  InProcessDaemon(server::Config cfg, std::function<int(const io::Request&, int)> fault) {
    cfg.hooks.io_fault = std::move(fault);
    auto s = server::Server::create(cfg);
    INFO((s ? "" : s.error().describe()));
    REQUIRE(s);
    srv = std::move(s.value());
    loop = std::thread([this] { (void)srv->run(); });
  }
  ~InProcessDaemon() {
    srv->stop();
    loop.join();
  }
  InProcessDaemon(const InProcessDaemon&) = delete;
  InProcessDaemon& operator=(const InProcessDaemon&) = delete;
};

// A server on a thread of this process, on its own temp root and socket, with injected I/O faults.
struct FaultyDaemon {
  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::unique_ptr<InProcessDaemon> daemon;
  explicit FaultyDaemon(std::function<int(const io::Request&, int)> fault) {
    std::filesystem::create_directories(dir / "root");
    server::Config cfg;
    cfg.roots = {dir / "root"};
    cfg.socket_path = socket;
    daemon = std::make_unique<InProcessDaemon>(cfg, std::move(fault));
  }
};

// A daemon on a thread of this process, for tests that set its test hooks or read its accounting.
struct LocalDaemon {
  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::unique_ptr<InProcessDaemon> daemon;
  explicit LocalDaemon(const std::function<void(server::Config&)>& adjust = {}) {
    std::filesystem::create_directories(dir / "root");
    server::Config cfg;
    cfg.roots = {dir / "root"};
    cfg.socket_path = socket;
    if (adjust) adjust(cfg);
    daemon = std::make_unique<InProcessDaemon>(cfg, nullptr);
  }
  server::Server& server() { return *daemon->srv; }
};

// Holds the daemon's workers that reach a test hook (Config::hooks: before_staging, before_hash)
// until released, and counts them: how many came, and how many it held at once. Shared with the
// hooks, which the workers may call until the daemon is gone.
class HoldGate {
 public:
  // A before_hash hook: holds every caller.
  std::function<void()> hook() const {
    return [st = state_] { hold(*st); };
  }
  // ... that holds its callers only while `armed` is set.
  std::function<void()> hook_while(std::shared_ptr<std::atomic<bool>> armed) const {
    return [st = state_, armed = std::move(armed)] {
      if (armed->load()) hold(*st);
    };
  }
  // A before_staging hook: holds the staging buffers of the HELLOs of `job` only, in the slow path.
  std::function<void(const std::string&)> staging_hook(std::string job) const {
    return [st = state_, job = std::move(job)](const std::string& of) {
      if (of == job) hold(*st);
    };
  }
  // Whether `n` callers reached the hook (within a bound that only shows that nothing hung).
  bool wait_entered(int n) {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_for(lock, std::chrono::seconds(60), [&] { return state_->entered >= n; });
  }
  bool holding() {
    std::lock_guard lock(state_->mu);
    return state_->entered > 0 && !state_->released;
  }
  int most_at_once() {
    std::lock_guard lock(state_->mu);
    return state_->most;
  }
  void release() {
    std::lock_guard lock(state_->mu);
    state_->released = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    int entered = 0, inside = 0, most = 0;
    bool released = false;
  };
  static void hold(State& st) {
    std::unique_lock lock(st.mu);
    ++st.entered;
    st.most = std::max(st.most, ++st.inside);
    st.cv.notify_all();
    st.cv.wait(lock, [&] { return st.released; });
    --st.inside;
  }
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Releases the gate when a test ends, however it ends: the daemon waits for its workers when it stops.
struct ReleaseAtEnd {
  HoldGate& gate;
  ~ReleaseAtEnd() { gate.release(); }
};

}  // namespace tmsdisk::testing
