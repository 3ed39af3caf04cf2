// SPDX-License-Identifier: Apache-2.0
// The gate (gate.h). Each application thread owns a cache-line record with its count of calls in
// flight; entering increments it (seq_cst) and then reads the shared `closed` word (seq_cst). The
// pause side stores `closed` and then reads every record, so in the single total order of seq_cst
// operations either the thread sees the gate closed or the pause sees the thread inside (Dekker).
#include "gate.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "config.h"
#include "driver.h"
#include "log.h"

namespace tmsdisk::shim::gate {
namespace {

struct alignas(64) Record {
  std::atomic<uint32_t> active{0};  // gated calls of the owning thread in flight
  std::atomic<bool> in_use{false};  // owned by a live thread
  Record* next = nullptr;           // records are never freed, only reused
};

std::atomic<Record*> g_records{nullptr};
// The shared word every gated call reads: 0 on the fast path. kClosed while paused (every call is
// held); kLost while some memory is lost (a call is held if it names it).
constexpr uint32_t kClosed = 1;
constexpr uint32_t kLost = 2;
std::atomic<uint32_t> g_closed{0};
std::atomic<AutoResume> g_auto_resume{nullptr};
// Calls of threads whose record could not be allocated (out of memory): counted here instead.
std::atomic<uint32_t> g_anonymous{0};
thread_local Record* t_record __attribute__((tls_model("initial-exec"))) = nullptr;

pthread_key_t g_key;
pthread_once_t g_key_once = PTHREAD_ONCE_INIT;
bool g_key_ok = false;

// Slow-path state: threads held at the closed gate sleep on this condition. Constructed in place
// so a fork child can start with a fresh (unlocked) mutex.
struct Waiters {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;  // bumped when the gate opens, when the lost ranges change and when an operation ends
  bool op_running = false;
  std::size_t held = 0;  // threads waiting on `cv`
};
alignas(Waiters) unsigned char g_waiters_storage[sizeof(Waiters)];
std::atomic<Waiters*> g_waiters{nullptr};

Waiters& waiters() noexcept {
  Waiters* w = g_waiters.load(std::memory_order_acquire);
  if (w) return *w;
  static std::once_flag once;
  try {
    std::call_once(once, [] { g_waiters.store(new (g_waiters_storage) Waiters, std::memory_order_release); });
  } catch (...) {
  }
  return *g_waiters.load(std::memory_order_acquire);
}

// Lost ranges: few (one per damaged allocation) and read only on the slow path, so a plain list
// under a mutex. Sorted by base.
std::mutex g_lost_mu;
std::vector<Range> g_lost;
// Bumped (under g_lost_mu) on every change of g_lost. A thread held for lost memory waits for it to
// move from the value it read before looking at the list, so no change between its look and its
// wait goes unnoticed.
std::atomic<uint64_t> g_lost_version{0};

// Stream captures: few and rarely changing, so a plain list under a mutex.
struct Capture {
  CUstream stream;
  bool per_thread;
  pthread_t thread;
};
std::mutex g_capture_mu;
std::vector<Capture> g_captures;

void release_record(void* p) {
  auto* r = static_cast<Record*>(p);
  r->active.store(0, std::memory_order_release);
  r->in_use.store(false, std::memory_order_release);
  t_record = nullptr;
}

void make_key() {
  g_key_ok = ::pthread_key_create(&g_key, &release_record) == 0;
}

Record* acquire_record() noexcept {
  ::pthread_once(&g_key_once, &make_key);
  Record* r = nullptr;
  for (Record* it = g_records.load(std::memory_order_acquire); it; it = it->next) {
    bool expected = false;
    if (!it->in_use.load(std::memory_order_relaxed) &&
        it->in_use.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
      r = it;
      break;
    }
  }
  if (!r) {
    r = new (std::nothrow) Record;
    if (!r) return nullptr;
    r->in_use.store(true, std::memory_order_relaxed);
    Record* head = g_records.load(std::memory_order_relaxed);
    do {
      r->next = head;
    } while (!g_records.compare_exchange_weak(head, r, std::memory_order_release, std::memory_order_relaxed));
  }
  // Without the key the record is never handed back when the thread exits: it leaks, harmlessly.
  if (g_key_ok) ::pthread_setspecific(g_key, r);
  t_record = r;
  return r;
}

void pause_briefly(int round) noexcept {
  if (round < 64) {
    sched_yield();
    return;
  }
  timespec ts{0, round < 1000 ? 20000 : 200000};  // a call in flight is usually microseconds
  ::nanosleep(&ts, nullptr);
}

enum class Entry : uint8_t { Inside, Closed, Lost };

// *lost_version receives g_lost_version as it was before the call's ranges were looked at.
Entry try_enter(Record* r, const char* what, TouchCheck check, const void* ctx, uint64_t* lost_version) noexcept {
  std::atomic<uint32_t>& active = r ? r->active : g_anonymous;
  active.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t word = g_closed.load(std::memory_order_seq_cst);
  if (word == 0) return Entry::Inside;
  *lost_version = g_lost_version.load(std::memory_order_acquire);
  if (word == kLost) {
    // Decided while counted inside: a pause that closes the gate now waits for this call (Dekker,
    // as on the fast path).
    const Touch touch = check ? check(ctx) : Touch::Unseen;
    if (touch == Touch::Clear) return Entry::Inside;
    if (touch == Touch::Unseen) {
      TMS_LOG_ONCE(LogLevel::Warn,
                   "%s while some memory is lost (a resume could not restore it): a launch does not say which "
                   "memory it reads, so it proceeds; a kernel that reads lost memory faults on the unmapped range",
                   what);
      return Entry::Inside;
    }
  }
  active.fetch_sub(1, std::memory_order_release);
  return (word & kClosed) ? Entry::Closed : Entry::Lost;
}

// The gate is closed, or the call touches lost memory: follow the policy. CUDA_SUCCESS means "try to
// enter again". *resumed_once: this call already ran an automatic resume (one per call: a second
// would only read the same damaged chunk again).
CUresult held(const char* what, Entry why, uint64_t lost_version, bool* resumed_once) noexcept {
  const OnTouch policy = config().on_touch;
  const bool lost_memory = why == Entry::Lost;
  if (policy == OnTouch::Fail) {
    if (lost_memory)
      TMS_LOG_ONCE(LogLevel::Error,
                   "%s touches paused memory (a tag paused on its own, or an allocation whose backup is "
                   "damaged): returning CUDA_ERROR_NOT_PERMITTED (TMSDISK_ON_TOUCH=fail); see `tmsctl status`",
                   what);
    else
      TMS_LOG_ONCE(LogLevel::Info, "%s while paused: returning CUDA_ERROR_NOT_PERMITTED (TMSDISK_ON_TOUCH=fail)", what);
    return kGateClosedError;
  }
  // Still held for the same reason: the closed bit for a closed gate; for lost memory, the list the
  // call was found to touch (its ranges are looked at again once the list changes).
  auto still_held = [&] {
    if (lost_memory) return g_lost_version.load(std::memory_order_acquire) == lost_version;
    return (g_closed.load(std::memory_order_acquire) & kClosed) != 0;
  };
  Waiters& w = waiters();
  std::unique_lock lock(w.mu);
  const uint64_t gen = w.generation;
  if (policy == OnTouch::Resume && lost_memory && *resumed_once) {
    TMS_WARN("%s touches memory the automatic resume could not restore; the call returns CUDA_ERROR_NOT_PERMITTED",
             what);
    return kGateClosedError;
  }
  if (policy == OnTouch::Resume && !w.op_running && still_held()) {
    lock.unlock();
    if (lost_memory)
      TMS_WARN("%s touches memory a resume could not restore: resuming again (TMSDISK_ON_TOUCH=resume)", what);
    else
      TMS_INFO("%s while paused: resuming automatically (TMSDISK_ON_TOUCH=resume)", what);
    const AutoResume resume = g_auto_resume.load(std::memory_order_acquire);
    if (!resume) {
      TMS_WARN("%s: no automatic resume is registered; the call returns CUDA_ERROR_NOT_PERMITTED", what);
      return kGateClosedError;
    }
    const Status resumed = resume();
    if (resumed || resumed.error().errnum() != EBUSY) *resumed_once = true;  // it ran (EBUSY: another did)
    // Lost memory may stay lost after a resume that restored the rest: enter() looks again and, if
    // this call still touches it, fails (above: one automatic resume per call).
    if (resumed || (!lost_memory && (g_closed.load(std::memory_order_acquire) & kClosed) == 0)) return CUDA_SUCCESS;
    if (resumed.error().errnum() != EBUSY) {
      TMS_WARN("%s: the automatic resume failed (%s: %s); the call returns CUDA_ERROR_NOT_PERMITTED", what,
               std::strerror(resumed.error().errnum()), resumed.error().message.c_str());
      return kGateClosedError;
    }
    lock.lock();
  }
  // Wait for the gate to open (closed), for the lost ranges to change (lost memory: a resume restored
  // it, the loss was accepted or it was freed), or (resume policy) for the running operation to end.
  ++w.held;
  w.cv.wait(lock, [&] { return !still_held() || (policy == OnTouch::Resume && w.generation != gen); });
  --w.held;
  return CUDA_SUCCESS;
}

}  // namespace

void set_auto_resume(AutoResume fn) noexcept {
  g_auto_resume.store(fn, std::memory_order_release);
}

CUresult enter(const char* what, TouchCheck check, const void* ctx) noexcept {
  Record* r = t_record;
  if (!r) r = acquire_record();
  uint64_t lost_version = 0;
  Entry entry = try_enter(r, what, check, ctx, &lost_version);
  if (entry == Entry::Inside) return CUDA_SUCCESS;
  bool resumed_once = false;
  try {
    for (;;) {
      if (CUresult e = held(what, entry, lost_version, &resumed_once); e != CUDA_SUCCESS) return e;
      entry = try_enter(r, what, check, ctx, &lost_version);
      if (entry == Entry::Inside) return CUDA_SUCCESS;
    }
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;  // std::system_error from a lock: never thrown in practice
  }
}

void leave() noexcept {
  Record* r = t_record;
  (r ? r->active : g_anonymous).fetch_sub(1, std::memory_order_release);
}

void begin_op() noexcept {
  Waiters& w = waiters();
  std::lock_guard lock(w.mu);
  w.op_running = true;
}

void end_op() noexcept {
  Waiters& w = waiters();
  {
    std::lock_guard lock(w.mu);
    w.op_running = false;
    ++w.generation;
  }
  w.cv.notify_all();
}

void close() noexcept {
  g_closed.fetch_or(kClosed, std::memory_order_seq_cst);
}

bool drain(int timeout_ms) noexcept {
  timespec start{};
  ::clock_gettime(CLOCK_MONOTONIC, &start);
  auto expired = [&] {
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >= timeout_ms;
  };
  for (int round = 0; g_anonymous.load(std::memory_order_seq_cst) != 0; ++round) {
    if (expired()) return false;
    pause_briefly(round);
  }
  for (Record* r = g_records.load(std::memory_order_acquire); r; r = r->next) {
    for (int round = 0; r->active.load(std::memory_order_seq_cst) != 0; ++round) {
      if (expired()) return false;
      pause_briefly(round);
    }
  }
  return true;
}

void open() noexcept {
  Waiters& w = waiters();
  {
    std::lock_guard lock(w.mu);
    g_closed.fetch_and(~kClosed, std::memory_order_seq_cst);
    ++w.generation;
  }
  w.cv.notify_all();
}

bool is_closed() noexcept {
  return (g_closed.load(std::memory_order_acquire) & kClosed) != 0;
}

namespace {

// Publishes the lost list's state in the shared word and wakes the threads it holds. Caller holds
// g_lost_mu (never the waiters' mutex first: held() looks at the list without holding it).
void lost_changed_locked() noexcept {
  g_lost_version.fetch_add(1, std::memory_order_release);
  Waiters& w = waiters();
  {
    std::lock_guard lock(w.mu);
    if (g_lost.empty())
      g_closed.fetch_and(~kLost, std::memory_order_seq_cst);
    else
      g_closed.fetch_or(kLost, std::memory_order_seq_cst);
    ++w.generation;
  }
  w.cv.notify_all();
}

}  // namespace

void set_lost(std::vector<Range> ranges) noexcept {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.base < b.base; });
  std::lock_guard lock(g_lost_mu);
  g_lost.swap(ranges);
  lost_changed_locked();
}

void forget_lost(CUdeviceptr base) noexcept {
  std::lock_guard lock(g_lost_mu);
  const auto it = std::find_if(g_lost.begin(), g_lost.end(), [&](const Range& r) { return r.base == base; });
  if (it == g_lost.end()) return;
  g_lost.erase(it);
  lost_changed_locked();
}

bool lost(CUdeviceptr base, std::size_t size) noexcept {
  if (size == 0) return false;
  const CUdeviceptr end = size > UINT64_MAX - base ? UINT64_MAX : base + size;  // bounding ranges may saturate
  std::lock_guard lock(g_lost_mu);
  for (const Range& r : g_lost) {
    if (r.base >= end) break;  // sorted: every later range starts beyond the call's
    if (base < r.base + r.size) return true;
  }
  return false;
}

std::size_t held_count() noexcept {
  Waiters& w = waiters();
  std::lock_guard lock(w.mu);
  return w.held;
}

void capture_begin(CUstream stream, bool per_thread) noexcept {
  try {
    std::lock_guard lock(g_capture_mu);
    g_captures.push_back({stream, per_thread, ::pthread_self()});
  } catch (...) {
    TMS_LOG_ONCE(LogLevel::Warn, "out of memory recording a stream capture; a pause will not see it");
  }
}

void capture_end(CUstream stream, bool per_thread) noexcept {
  std::lock_guard lock(g_capture_mu);
  // The legacy and per-thread default streams (handles 0, 1, 2) belong to the calling thread.
  const bool thread_local_handle = stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
  for (auto it = g_captures.begin(); it != g_captures.end(); ++it) {
    if (it->stream == stream && it->per_thread == per_thread &&
        (!thread_local_handle || ::pthread_equal(it->thread, ::pthread_self()))) {
      g_captures.erase(it);
      return;
    }
  }
}

Status no_capture_active() {
  const DriverApi& api = driver().api;
  std::lock_guard lock(g_capture_mu);
  for (auto it = g_captures.begin(); it != g_captures.end();) {
    const bool thread_local_handle =
        it->stream == nullptr || it->stream == CU_STREAM_LEGACY || it->stream == CU_STREAM_PER_THREAD;
    if (!thread_local_handle && api.cuStreamIsCapturing) {
      CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
      if (api.cuStreamIsCapturing(it->stream, &st) != CUDA_SUCCESS || st == CU_STREAM_CAPTURE_STATUS_NONE) {
        it = g_captures.erase(it);  // ended without us seeing it, or the stream is gone
        continue;
      }
    }
    return make_error(EBUSY,
                      "a CUDA stream capture (graph recording) is active; pausing now would hold work the capture "
                      "needs. Retry once cuStreamEndCapture has been called");
  }
  return {};
}

void fork_prepare() noexcept {
  g_lost_mu.lock();
  waiters().mu.lock();
  g_capture_mu.lock();
}

void fork_parent() noexcept {
  g_capture_mu.unlock();
  waiters().mu.unlock();
  g_lost_mu.unlock();
}

void fork_child() noexcept {
  // Only this thread survived: no other can be inside a gated call, and their records are free.
  for (Record* r = g_records.load(std::memory_order_relaxed); r; r = r->next) {
    if (r == t_record) continue;
    r->active.store(0, std::memory_order_relaxed);
    r->in_use.store(false, std::memory_order_relaxed);
  }
  g_anonymous.store(0, std::memory_order_relaxed);
  g_capture_mu.unlock();
  g_lost_mu.unlock();  // the child keeps the lost ranges: its memory is the parent's copy, as unmapped
  g_captures.clear();
  // The condition may list waiters that do not exist here: start over with a fresh one (the old
  // mutex is held by this thread since fork_prepare and is simply overwritten).
  if (Waiters* w = g_waiters.load(std::memory_order_relaxed)) {
    const uint64_t gen = w->generation;
    w = new (g_waiters_storage) Waiters;
    w->generation = gen + 1;
  }
}

}  // namespace tmsdisk::shim::gate
