// SPDX-License-Identifier: Apache-2.0
// Storage internals: the disk space a reservation gives back (holes punched, a data file's tail cut
// off), given back on a thread of its own instead of the caller's.
//
// Punching gigabytes of blocks costs the filesystem about a second (measured on an H200 node: 1.04 s
// for 4 GiB of chunks that held data and became zero). RankStore::reserve() runs on the daemon's one
// event loop, where that second held up every other rank's requests and added to the pause itself.
// Nothing waits for that space: the reservation's own data chunks are preallocated before it, and
// the chunks given back are never written in this generation (zero chunks and free extents have no
// Location). So the store hands them to a BackgroundPunch after the reservation is recorded, and
// waits for it (or stops it) before anything can reuse or free those ranges: its next reservation,
// removal and destruction. A late punch thus never lands on blocks a later write of the store made.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage::detail {

// What one reservation gives back, file by file (one per root).
struct PunchPlan {
  struct File {
    // The data file. `owned` is a dup of the store's descriptor, so the work never depends on the
    // store's own staying open; `fd` is owned.get(), or the store's descriptor when no dup could be
    // made (the plan then runs on the caller's thread, see RankStore::Impl::reserve_locked).
    UniqueFd owned;
    int fd = -1;
    uint64_t truncate_to = UINT64_MAX;                   // cut the file to this size first (UINT64_MAX: keep it)
    uint64_t size = 0;                                   // its size before the cut, for the log
    std::vector<std::pair<uint64_t, uint64_t>> punches;  // offset, length: kIoAlignment-aligned
  };
  std::vector<File> files;
  std::string what;  // names the rank in the log: "<uid>/<job>/rank<R>-<pid>"

  bool empty() const noexcept;
  // Bytes punched and cut off (an upper bound on what the filesystem gets back: some may be holes).
  uint64_t bytes() const noexcept;
};

// Runs `plan` on the caller's thread: truncations first, then the punches, each split in pieces of
// at most kPunchPiece so that `stop` (when given) is heard within one piece. Best effort, as a hole
// is only space: returns false when something was not done (stopped, or the filesystem refused), so
// that the store no longer takes its free and zero ranges for holes.
bool run_punch_plan(const PunchPlan& plan, const std::atomic<bool>* stop) noexcept;

// Keeps at most one plan running at a time, on a thread of its own (all signals blocked there: they
// are the main thread's). Used by one thread, the store's.
class BackgroundPunch {
 public:
  // Bounds how long stop() waits: one fallocate(PUNCH_HOLE) of this much (about 16 ms at the 4 GB/s
  // measured above).
  static constexpr uint64_t kPunchPiece = uint64_t{64} << 20;

  BackgroundPunch() = default;
  ~BackgroundPunch();  // stop()
  BackgroundPunch(const BackgroundPunch&) = delete;
  BackgroundPunch& operator=(const BackgroundPunch&) = delete;

  // Starts `plan` (its descriptors owned: File::owned) on a new thread, after waiting for the plan
  // before it. Where no thread can be started, it runs here and now, as it did before it moved off.
  void start(PunchPlan plan) noexcept;
  // Returns once the plan started last is done; at once if there is none. True when every plan since
  // the last call did all it was asked (false: see run_punch_plan). `who` waits, in the log.
  bool wait(const char* who) noexcept;
  // True while the plan started last is still running (without waiting for it).
  bool busy() const noexcept { return state_ && !state_->finished.load(std::memory_order_acquire); }
  // Stops the running plan at its next piece and returns once its thread is gone (what it did not
  // punch stays allocated). For a store whose files are about to go, or whose daemon stops.
  void stop() noexcept;

 private:
  struct State {
    PunchPlan plan;
    std::atomic<bool> stop{false};
    std::atomic<bool> finished{false};
    bool complete = false;  // written by the thread before `finished`
  };
  // Joins the thread; `who` says in the log what waits for it.
  void join(const char* who) noexcept;

  std::shared_ptr<State> state_;
  std::thread thread_;
  bool complete_ = true;  // no plan since the last wait() failed
};

}  // namespace tmsdisk::storage::detail
