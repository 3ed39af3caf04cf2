// SPDX-License-Identifier: Apache-2.0
// Holds back the disk space rank stores give back after a reservation (background_punch.h) until a
// test releases it, and tells the test when a store starts waiting for it. Header-only; the test
// links tmsdisk_storage (directly or through tmsdisk_server).
#pragma once

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "storage_testing.h"

namespace tmsdisk::testing {

// One per test at a time: the storage hooks are plain function pointers, so the state is static.
// Installs the hooks on construction; releases what it holds and removes them on destruction,
// however the test ends (a store being destroyed waits for what is held).
class PunchGate {
 public:
  PunchGate() {
    {
      std::lock_guard lock(mu());
      state() = {};
    }
    prev_hook_ = storage::testing::set_punch_hook(&on_punch);
    prev_wait_hook_ = storage::testing::set_punch_wait_hook(&on_wait);
  }
  ~PunchGate() {
    release();
    storage::testing::set_punch_hook(prev_hook_);
    storage::testing::set_punch_wait_hook(prev_wait_hook_);
  }
  PunchGate(const PunchGate&) = delete;
  PunchGate& operator=(const PunchGate&) = delete;

  // Lets every punch through from now on.
  void release() {
    std::lock_guard lock(mu());
    state().released = true;
    cv().notify_all();
  }
  // Holds punches again (those already let through go on).
  void hold() {
    std::lock_guard lock(mu());
    state().released = false;
  }
  // Punches (and truncations) that reached the gate, held or let through.
  int entered() {
    std::lock_guard lock(mu());
    return state().entered;
  }
  // Times a store started waiting for punches still running.
  int waits() {
    std::lock_guard lock(mu());
    return state().waits;
  }
  // Whether `n` punches reached the gate (within a bound that only shows that nothing hung).
  bool wait_entered(int n) {
    std::unique_lock lock(mu());
    return cv().wait_for(lock, kHang, [&] { return state().entered >= n; });
  }
  // Blocks until a store starts waiting for the held punches, or `done` (set by the caller's other
  // thread, followed by notify()) says that what might have waited finished first. True for the
  // first: the finishing thread did wait.
  bool store_waits_before(const std::atomic<bool>& done) {
    std::unique_lock lock(mu());
    cv().wait_for(lock, kHang, [&] { return state().waits > 0 || done.load(); });
    return state().waits > 0 && !done.load();
  }
  // Runs `action` on another thread while punches are held and tells whether it waited for them (it
  // began to wait, and had not finished, before they were let through); then lets them through and
  // joins the thread.
  bool waits_for_punches(const std::function<void()>& action) {
    std::atomic<bool> done{false};
    std::thread other([&] {
      action();
      done = true;
      notify();
    });
    const bool waited = store_waits_before(done) && !done.load();
    release();
    other.join();
    return waited;
  }
  // Wakes store_waits_before() (call after setting its flag).
  static void notify() {
    std::lock_guard lock(mu());
    cv().notify_all();
  }

 private:
  static constexpr auto kHang = std::chrono::seconds(60);
  struct State {
    int entered = 0;
    int waits = 0;
    bool released = false;
  };
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::condition_variable& cv() {
    static std::condition_variable c;
    return c;
  }
  static State& state() {
    static State s;
    return s;
  }
  // Held at most kHang: a store that wrongly punches on the caller's thread then fails the test's
  // checks instead of hanging it.
  static void on_punch(std::size_t, uint64_t, uint64_t) {
    std::unique_lock lock(mu());
    ++state().entered;
    cv().notify_all();
    cv().wait_for(lock, kHang, [] { return state().released; });
  }
  static void on_wait() {
    std::lock_guard lock(mu());
    ++state().waits;
    cv().notify_all();
  }

  storage::testing::PunchHook prev_hook_ = nullptr;
  storage::testing::PunchWaitHook prev_wait_hook_ = nullptr;
};

}  // namespace tmsdisk::testing
