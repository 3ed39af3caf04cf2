// SPDX-License-Identifier: Apache-2.0
// Giving a reservation's space back off the caller's thread (background_punch.h).
#include "background_punch.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <new>
#include <system_error>

#include "storage_testing.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/signal_blocked_thread.h"

namespace tmsdisk::storage {

namespace testing {
namespace {
std::atomic<PunchHook> g_punch_hook{nullptr};
std::atomic<PunchWaitHook> g_punch_wait_hook{nullptr};
}  // namespace
PunchHook set_punch_hook(PunchHook hook) noexcept {
  return g_punch_hook.exchange(hook);
}
PunchWaitHook set_punch_wait_hook(PunchWaitHook hook) noexcept {
  return g_punch_wait_hook.exchange(hook);
}
}  // namespace testing

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// As chunk_io's StorageTimer: what takes this long is said at info, so a pause's wall time can be
// taken apart from the log; the rest at debug.
constexpr double kSlowSeconds = 0.1;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

template <class... Args>
void log_timed(double seconds, fmt::format_string<Args...> format, Args&&... args) {
  spdlog::log(seconds >= kSlowSeconds ? spdlog::level::info : spdlog::level::debug, format,
              std::forward<Args>(args)...);
}

bool punch_piece(std::size_t root, int fd, uint64_t offset, uint64_t length) {
  if (auto hook = testing::g_punch_hook.load()) hook(root, offset, length);
  while (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                     static_cast<off_t>(length)) != 0) {
    if (errno != EINTR) return false;
  }
  return true;
}

bool truncate_file(std::size_t root, int fd, uint64_t size, uint64_t old_size) {
  if (auto hook = testing::g_punch_hook.load()) hook(root, size, old_size > size ? old_size - size : 0);
  while (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (errno != EINTR) return false;
  }
  return true;
}

// Runs `plan` and says in the log how long it took (the caller's StorageTimer no longer covers it).
bool run_and_log(const PunchPlan& plan, const std::atomic<bool>* stop, const char* where) {
  const auto start = Clock::now();
  const bool complete = run_punch_plan(plan, stop);
  const double s = seconds_since(start);
  if (stop && stop->load())
    log_timed(s, "{}: giving back the reservation's unused disk space ({}, {}) stopped after {:.3f} s", plan.what,
              human_bytes(plan.bytes()), where, s);
  else
    log_timed(s, "{}: giving back the reservation's unused disk space ({}, {}) took {:.3f} s{}", plan.what,
              human_bytes(plan.bytes()), where, s, complete ? "" : " (some of it refused by the filesystem)");
  return complete;
}

}  // namespace

bool PunchPlan::empty() const noexcept {
  return std::all_of(files.begin(), files.end(),
                     [](const File& f) { return f.truncate_to == UINT64_MAX && f.punches.empty(); });
}

uint64_t PunchPlan::bytes() const noexcept {
  uint64_t total = 0;
  for (const auto& f : files) {
    if (f.truncate_to != UINT64_MAX && f.size > f.truncate_to) total += f.size - f.truncate_to;
    for (const auto& p : f.punches) total += p.second;
  }
  return total;
}

bool run_punch_plan(const PunchPlan& plan, const std::atomic<bool>* stop) noexcept {
  auto stopped = [&] { return stop && stop->load(std::memory_order_relaxed); };
  bool complete = true;
  for (std::size_t r = 0; r < plan.files.size(); ++r) {
    const auto& f = plan.files[r];
    if (f.truncate_to == UINT64_MAX) continue;
    if (stopped()) return false;
    complete = truncate_file(r, f.fd, f.truncate_to, f.size) && complete;
  }
  for (std::size_t r = 0; r < plan.files.size(); ++r) {
    const auto& f = plan.files[r];
    for (const auto& [offset, length] : f.punches) {
      for (uint64_t done = 0; done < length;) {
        if (stopped()) return false;
        const uint64_t piece = std::min(BackgroundPunch::kPunchPiece, length - done);
        // Where punching is not supported the range just stays allocated: space, never correctness.
        complete = punch_piece(r, f.fd, offset + done, piece) && complete;
        done += piece;
      }
    }
  }
  return complete;
}

BackgroundPunch::~BackgroundPunch() {
  stop();
}

void BackgroundPunch::start(PunchPlan plan) noexcept {
  join("the next reservation");
  if (plan.empty()) return;
  std::shared_ptr<State> state;
  try {
    state = std::make_shared<State>();
    state->plan = std::move(plan);
    // Signals stay with the main thread (the daemon's SIGTERM handling).
    thread_ = start_signal_blocked_thread([state] {
      state->complete = run_and_log(state->plan, &state->stop, "in the background");
      state->finished.store(true, std::memory_order_release);
    });
    state_ = std::move(state);
  } catch (const std::exception&) {
    // No memory or no thread: given back here and now, as before it moved off.
    const PunchPlan& p = state ? state->plan : plan;
    complete_ = run_and_log(p, nullptr, "on the caller's thread: no thread could be started") && complete_;
  }
}

bool BackgroundPunch::wait(const char* who) noexcept {
  join(who);
  return std::exchange(complete_, true);
}

void BackgroundPunch::stop() noexcept {
  if (!thread_.joinable()) return;
  state_->stop.store(true, std::memory_order_relaxed);
  join("removing or closing the store");
}

void BackgroundPunch::join(const char* who) noexcept {
  if (!thread_.joinable()) return;
  const bool running = !state_->finished.load(std::memory_order_acquire);
  const auto start = Clock::now();
  if (running) {
    if (auto hook = testing::g_punch_wait_hook.load()) hook();
  }
  thread_.join();
  complete_ = state_->complete && complete_;
  if (running) {
    const double s = seconds_since(start);
    log_timed(s, "{}: {} waited {:.3f} s for the disk space of the reservation before it to be given back",
              state_->plan.what, who, s);
  }
  state_.reset();
}

}  // namespace detail
}  // namespace tmsdisk::storage
