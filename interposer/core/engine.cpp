// SPDX-License-Identifier: Apache-2.0
// Pause/resume engine and control thread (engine.h).
#include "engine.h"

#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>
#include <string_view>
#include <type_traits>

#include "config.h"
#include "driver.h"
#include "gate.h"
#include "log.h"
#include "tmsdisk/common/private_daemon.h"
#include "tmsdisk/protocol/socket.h"
#include "vmm.h"

namespace tmsdisk::shim {
namespace {

constexpr int kReportIntervalMs = 1000;
constexpr int kTickMs = 100;                 // progress messages at most this often
constexpr int64_t kReplyTimeoutMs = 120000;  // the daemon answers every chunk well within this
constexpr int kHandshakeTimeoutS = 10;
constexpr int kPrivateDaemonStartMs = 10000;
constexpr int kDrainTimeoutMs = 60000;  // calls already inside the gate when a pause starts
constexpr std::size_t kReserveBatch = 3000;  // blobs per RESERVE message (16 bytes each, < 64 KiB)
constexpr int64_t kMaxConnectBackoffMs = 30000;

std::atomic<Engine*> g_engine{nullptr};

int64_t now_ms() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}
uint64_t now_ns() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}
uint64_t unix_ms() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000ull + static_cast<uint64_t>(ts.tv_nsec) / 1000000ull;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

std::string cuda_failure(const char* what, CUresult r) {
  return format("%s failed: %s (%d)", what, cu_error_name(r), static_cast<int>(r));
}

// CommandDone and Error texts must fit the protocol and carry no control characters.
std::string wire_text(std::string s, std::size_t max) {
  if (s.size() > max) s.resize(max);
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') c = ' ';
  return s;
}

}  // namespace

struct Engine::Job {
  std::shared_ptr<Allocation> a;
  int ctx = -1;
  uint64_t next_offset = 0;  // first byte not yet handed to a slot
  uint64_t chunks = 0;
  uint64_t done = 0;  // chunks acknowledged (pause) or copied back (resume)
  uint32_t in_flight = 0;
  int error = 0;
  std::string message;
  CUmemGenericAllocationHandle handle = 0;  // resume: the new physical memory
  bool mapped = false;
  bool complete = false;
};

Registry& registry() noexcept {
  // Never destroyed: hooks can run during static destruction and from threads still alive at exit.
  alignas(Registry) static unsigned char storage[sizeof(Registry)];
  static Registry* r = new (storage) Registry;
  return *r;
}

// tmsdiskd for the private daemon: $TMSDISK_DAEMON, else beside this library (paths.h: install tree,
// then build tree), else on PATH.
static std::string find_daemon() {
  if (const char* env = std::getenv("TMSDISK_DAEMON"); env && *env) return env;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&start_private_daemon), &info) && info.dli_fname) {
    std::string dir = info.dli_fname;
    dir = dir.substr(0, dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/'));
    if (std::string p = find_daemon_beside_shim(dir); !p.empty()) return p;
  }
  if (const char* path = std::getenv("PATH")) {
    std::string_view rest = path;
    while (!rest.empty()) {
      auto colon = rest.find(':');
      std::string p = std::string(rest.substr(0, colon)) + "/tmsdiskd";
      if (::access(p.c_str(), X_OK) == 0) return p;
      rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    }
  }
  return {};
}

int start_private_daemon() noexcept {
  try {
    const std::string daemon = find_daemon();
    if (daemon.empty()) {
      TMS_WARN("no tmsdiskd found beside libtmsdisk.so or on PATH (set TMSDISK_DAEMON) to start a private daemon");
      return -ENOENT;
    }
    int rc = spawn_private_daemon(daemon, config().private_socket, kPrivateDaemonStartMs);
    if (rc < 0)
      TMS_WARN("could not start a private tmsdiskd (%s): %s; its log is beside %s", daemon.c_str(), std::strerror(-rc),
               config().private_socket.c_str());
    else
      TMS_INFO("using the private tmsdiskd at %s", config().private_socket.c_str());
    return rc;
  } catch (...) {
    return -ENOMEM;
  }
}

// ---------------------------------------------------------------------------------------------
// Instance and fork handling

Engine* Engine::instance() noexcept {
  Engine* e = g_engine.load(std::memory_order_acquire);
  if (e) return e;
  static std::mutex create_mu;
  std::lock_guard lock(create_mu);
  e = g_engine.load(std::memory_order_acquire);
  if (!e) {
    e = new (std::nothrow) Engine;  // never deleted: see engine.h
    g_engine.store(e, std::memory_order_release);
  }
  return e;
}

Engine* Engine::existing() noexcept {
  return g_engine.load(std::memory_order_acquire);
}

void Engine::fork_prepare() noexcept {
  gate::fork_prepare();
  registry().lock_for_fork();
  if (Engine* e = existing()) e->mu_.lock();
}

void Engine::fork_parent() noexcept {
  if (Engine* e = existing()) e->mu_.unlock();
  registry().unlock_after_fork();
  gate::fork_parent();
}

void Engine::fork_child() noexcept {
  // The child has no control thread and must not share the parent's session: the daemon knows the
  // parent's pid, and the staging pages are the parent's. Drop all of it (the old object is leaked,
  // its locks may be held by threads that do not exist here) and start again lazily.
  if (Engine* old = existing()) {
    if (old->sock_ >= 0) ::close(old->sock_);
    if (old->wake_fd_ >= 0) ::close(old->wake_fd_);
    if (old->staging_) ::munmap(old->staging_, old->staging_bytes_);  // its CUDA registration is the parent's
    g_engine.store(new (std::nothrow) Engine, std::memory_order_release);
  }
  registry().unlock_after_fork();
  gate::fork_child();
}

// ---------------------------------------------------------------------------------------------
// Application side

void Engine::ensure_started() noexcept {
  if (started_.load(std::memory_order_acquire)) return;
  std::lock_guard lock(mu_);
  if (thread_started_) return;
  if (wake_fd_ < 0) wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    TMS_LOG_ONCE(LogLevel::Error, "cannot create the control thread's eventfd: %s", std::strerror(errno));
    return;
  }
  // Threads started inside the host block every signal: a SIGINT, SIGCHLD or profiler signal meant
  // for the application must never be delivered to ours (heaptrack learned this the hard way).
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  const int rc = pthread_create(&thread, &attr, &Engine::thread_main, this);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (rc != 0) {
    TMS_LOG_ONCE(LogLevel::Error, "cannot start the control thread: %s", std::strerror(rc));
    return;
  }
  pthread_setname_np(thread, "tmsdisk-ctl");
  thread_started_ = true;
  started_.store(true, std::memory_order_release);
}

int Engine::post(std::function<void()> task, bool wait) noexcept {
  try {
    ensure_started();
    auto req = std::make_unique<Request>();
    req->task = std::move(task);
    req->detached = !wait;
    Request* r = req.get();
    {
      std::lock_guard lock(mu_);
      if (!thread_started_) return -ESRCH;
      queue_.push_back(r);
      req.release();  // the queue owns it until done (detached) or until we take it back below
    }
    const uint64_t one = 1;
    ssize_t w;
    do {
      w = ::write(wake_fd_, &one, sizeof(one));
    } while (w < 0 && errno == EINTR);
    if (!wait) return 0;
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return r->done; });
    const int code = r->result.code;
    delete r;
    return code ? -code : 0;
  } catch (...) {
    return -ENOMEM;
  }
}

int Engine::run(proto::CommandOp op, OpResult* out) noexcept {
  try {
    ensure_started();
    Request req;
    req.op = op;
    {
      std::unique_lock lock(mu_);
      if (!thread_started_) {
        if (out) *out = OpResult{EAGAIN, 0, 0, "the tmsdisk control thread could not be started"};
        return -EAGAIN;
      }
      if (busy_ || std::any_of(queue_.begin(), queue_.end(), [](const Request* q) { return !q->task; })) {
        if (out) *out = OpResult{EBUSY, 0, 0, "another pause or resume is running"};
        return -EBUSY;
      }
      queue_.push_back(&req);
    }
    const uint64_t one = 1;
    ssize_t w;
    do {
      w = ::write(wake_fd_, &one, sizeof(one));
    } while (w < 0 && errno == EINTR);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return req.done; });
    if (out) *out = req.result;
    return req.result.code ? -req.result.code : 0;
  } catch (...) {
    if (out) *out = OpResult{ENOMEM, 0, 0, "out of memory"};
    return -ENOMEM;
  }
}

EngineStatus Engine::status() const {
  EngineStatus s;
  s.totals = registry().totals();
  std::lock_guard lock(mu_);
  s.stats = last_;
  s.connected = connected_;
  s.session_id = session_id_;
  s.last_error = last_error_;
  s.last_message = last_message_;
  s.stats.resident_bytes = s.totals.resident_bytes;
  s.stats.paused_bytes = s.totals.paused_bytes;
  s.stats.unmanaged_bytes = s.totals.unmanaged_bytes;
  s.stats.managed_allocations = s.totals.managed_allocations;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Control thread

void* Engine::thread_main(void* self) noexcept {
  mark_shim_thread();  // CUDA and dlsym calls from here go straight to the driver
  auto* engine = static_cast<Engine*>(self);
  for (;;) {
    try {
      engine->control_loop();
    } catch (...) {
      // Out of memory somewhere in a step: log, breathe, carry on. The thread must not die, or
      // callers of tmsdisk_pause() would wait forever.
      TMS_ERROR("control thread: unexpected failure; continuing");
      ::usleep(100000);
    }
  }
  return nullptr;
}

void Engine::control_loop() {
  for (;;) {
    int64_t now = now_ms();
    if (sock_ < 0 && staging_) release_staging();
    if (sock_ < 0 && now >= next_connect_ms_) {
      std::string why;
      if (connect_session(&why) < 0) {
        if (!unreachable_logged_) {
          TMS_WARN("%s; allocations keep working, pause and resume fail until it is reachable", why.c_str());
          unreachable_logged_ = true;
        } else {
          TMS_DEBUG("%s", why.c_str());
        }
        next_connect_ms_ = now + connect_backoff_ms_;
        connect_backoff_ms_ = std::min(connect_backoff_ms_ * 2, kMaxConnectBackoffMs);
      }
    }
    now = now_ms();
    int timeout = kReportIntervalMs;
    if (sock_ < 0) timeout = static_cast<int>(std::clamp<int64_t>(next_connect_ms_ - now, 0, kMaxConnectBackoffMs));
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {sock_, POLLIN, 0}};
    const int n = ::poll(fds, sock_ >= 0 ? 2 : 1, timeout);
    if (n < 0 && errno != EINTR) {
      TMS_ERROR("control thread: poll failed: %s", std::strerror(errno));
      ::usleep(100000);
      continue;
    }
    if (n > 0 && (fds[0].revents & POLLIN)) {
      uint64_t count;
      while (::read(wake_fd_, &count, sizeof(count)) < 0 && errno == EINTR) {
      }
      serve_requests();
    }
    if (n > 0 && sock_ >= 0 && fds[1].revents) serve_socket();
    if (sock_ >= 0 && registry().version() != reported_version_ && now_ms() - last_report_ms_ >= kReportIntervalMs)
      send_report();
  }
}

void Engine::serve_requests() {
  for (;;) {
    Request* req;
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) return;
      req = queue_.front();
      queue_.pop_front();
      busy_ = !req->task;
    }
    if (req->task) {
      try {
        req->task();
      } catch (...) {
        TMS_ERROR("control thread: an IPC request ran out of memory");
        req->result.code = ENOMEM;  // the waiter must not read the task's results as a success
      }
      if (req->detached) {
        delete req;
      } else {
        {
          std::lock_guard lock(mu_);
          req->done = true;
        }
        cv_.notify_all();
      }
      if (deferred_command_) {
        const proto::Envelope cmd = std::move(*deferred_command_);
        deferred_command_.reset();
        serve_command(cmd);
      }
      continue;
    }
    OpResult result;
    try {
      result = execute(req->op, 0);
    } catch (...) {
      result = OpResult{ENOMEM, 0, 0, "out of memory"};
    }
    {
      std::lock_guard lock(mu_);
      req->result = std::move(result);
      req->done = true;
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void Engine::serve_socket() {
  proto::Envelope env;
  if (receive(env, 0) <= 0) return;
  if (!std::holds_alternative<proto::Command>(env.body)) return handle_other(env);
  serve_command(env);
}

void Engine::serve_command(const proto::Envelope& env) {
  const auto* cmd = std::get_if<proto::Command>(&env.body);
  {
    std::lock_guard lock(mu_);
    if (busy_) {
      // Cannot happen while this thread is the only one running operations; kept for safety.
      proto::CommandDone done;
      done.code = EBUSY;
      done.message = "another pause or resume is running";
      (void)send(env.request_id, done);
      return;
    }
    busy_ = true;
  }
  OpResult r;
  try {
    r = execute(static_cast<proto::CommandOp>(cmd->op), env.request_id);
  } catch (...) {
    r = OpResult{ENOMEM, 0, 0, "out of memory"};
  }
  {
    std::lock_guard lock(mu_);
    busy_ = false;
  }
  proto::CommandDone done;
  done.code = r.code;
  done.bytes = r.bytes;
  done.nanos = r.nanos;
  done.message = wire_text(r.message, proto::kMaxTextLength);
  if (sock_ >= 0) (void)send(env.request_id, done);
}

OpResult Engine::execute(proto::CommandOp op, uint64_t command_request) {
  const uint64_t t0 = now_ns();
  const bool pausing = op == proto::CommandOp::Pause;
  bool gated = false;
  OpResult r;
  if (op != proto::CommandOp::Pause && op != proto::CommandOp::Resume) {
    r = OpResult{EINVAL, 0, 0, "unknown operation"};
  } else if (!driver().usable) {
    r = OpResult{ENOTSUP, 0, 0, "libcuda.so.1 is missing or lacks required entry points; tmsdisk is disabled"};
  } else {
    std::string why;
    const int e = sock_ < 0 ? connect_session(&why) : 0;
    if (e < 0) {
      r = OpResult{-e, 0, 0, why};
    } else {
      // Pause: no application thread may submit work from here on, and what was submitted before
      // finishes (pause() synchronizes) before a byte moves. The gate opens again once nothing is
      // paused (after a resume, or a pause that released nothing), and only after the state says so.
      gate::begin_op();
      bool drained = true;
      if (pausing) {
        gate::close();
        drained = gate::drain(kDrainTimeoutMs);
      }
      std::string busy;
      if (!drained) {
        // A call inside the gate does not return (e.g. a copy queued behind a collective whose peer
        // is held at its own gate): give up rather than hold the process forever. Nothing moved;
        // the gate reopens below since nothing is paused.
        r = OpResult{ETIMEDOUT, 0, 0,
                     format("CUDA calls in flight did not finish within %d s; pause refused (pause ranks that "
                            "run collectives only while no collective is in flight)",
                            kDrainTimeoutMs / 1000)};
      } else if (pausing && gate::capture_active(&busy)) {
        r = OpResult{EBUSY, 0, 0, busy};
      } else {
        std::unique_lock lock(op_lock_);
        r = pausing ? pause(command_request) : resume(command_request);
      }
      gated = true;
    }
  }
  r.nanos = now_ns() - t0;

  const RegistryTotals t = registry().totals();
  proto::RankState state = proto::RankState::Running;
  if (t.paused_allocations > 0)
    state =
        t.paused_allocations == t.managed_allocations ? proto::RankState::Paused : proto::RankState::PartiallyPaused;
  {
    std::lock_guard lock(mu_);
    last_.state = static_cast<uint8_t>(state);
    if (r.code == 0 && pausing) {
      last_.last_pause_bytes = r.bytes;
      last_.last_pause_ns = r.nanos;
    } else if (r.code == 0) {
      last_.last_resume_bytes = r.bytes;
      last_.last_resume_ns = r.nanos;
    }
    last_.last_change_unix_ms = unix_ms();
    last_error_ = r.code;
    last_message_ = r.message;
  }
  if (gated) {
    if (t.paused_allocations == 0) gate::open();
    gate::end_op();
  }
  const char* what = pausing ? "pause" : "resume";
  if (r.code) {
    TMS_WARN("%s failed: %s (%s)", what, r.message.c_str(), std::strerror(r.code));
  } else {
    const double secs = static_cast<double>(r.nanos) / 1e9;
    TMS_INFO("%s: %llu bytes in %.3f s (%.2f GB/s)%s%s", what, static_cast<unsigned long long>(r.bytes), secs,
             secs > 0 ? static_cast<double>(r.bytes) / secs / 1e9 : 0.0, r.message.empty() ? "" : "; ",
             r.message.c_str());
  }
  if (sock_ >= 0) send_report();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Pause

OpResult Engine::pause(uint64_t command_request) {
  const DriverApi& api = driver().api;
  OpResult res;
  std::vector<std::shared_ptr<Allocation>> resident, paused;
  for (auto& a : registry().snapshot()) {
    if (a->pinned.load() >= 0 && a->state.load() == AllocState::Resident) continue;  // stays resident for good
    (a->state.load() == AllocState::Paused ? paused : resident).push_back(std::move(a));
  }
  if (resident.empty()) {
    res.message = paused.empty() ? "no managed allocations to pause" : "already paused";
    return res;
  }
  if (committed_paused_) {
    // The daemon refuses a new reservation while a committed pause holds the only copy of data.
    res.code = EBUSY;
    res.message = format("already paused; %zu allocation(s) made since stay resident until a resume", resident.size());
    return res;
  }
  if (!paused.empty()) {
    // An earlier pause stopped half-way. A new reservation would drop the checksums of what it
    // released, so bring those allocations back first, then pause everything.
    TMS_INFO("restoring %zu allocation(s) left paused by an earlier failed pause", paused.size());
    OpResult back = resume_list(paused, command_request);
    if (back.code) {
      back.message = "cannot restore allocations left paused by an earlier failed pause: " + back.message;
      return back;
    }
    resident.insert(resident.end(), paused.begin(), paused.end());
  }
  set_state(proto::RankState::Pausing);

  // 1. Let every context finish what it was doing with this memory.
  std::vector<CUcontext> contexts;
  for (const auto& a : resident)
    if (std::find(contexts.begin(), contexts.end(), a->ctx) == contexts.end()) contexts.push_back(a->ctx);
  for (CUcontext ctx : contexts) {
    CtxScope scope(api, ctx);
    if (!scope.ok()) return OpResult{EIO, 0, 0, "cannot make an allocation's context current (was it destroyed?)"};
    if (CUresult r = api.cuCtxSynchronize(); r != CUDA_SUCCESS)
      return OpResult{EIO, 0, 0, cuda_failure("cuCtxSynchronize", r)};
  }
  // Peer devices granted access (cuCtxEnablePeerAccess, application access lists) may have kernels
  // still writing this memory from their own contexts: synchronize their primary contexts too, those
  // that are active (retaining an inactive one would create it).
  if (api.cuDevicePrimaryCtxGetState && api.cuDevicePrimaryCtxRetain && api.cuDevicePrimaryCtxRelease_v2 &&
      api.cuDeviceGet) {
    std::vector<int> peers;
    for (const auto& a : resident)
      for (const CUmemAccessDesc& d : a->access)
        if (d.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
            std::find(peers.begin(), peers.end(), d.location.id) == peers.end())
          peers.push_back(d.location.id);
    for (int ordinal : peers) {
      CUdevice dev;
      unsigned int flags = 0;
      int active = 0;
      CUcontext primary = nullptr;
      if (api.cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS ||
          api.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active ||
          api.cuDevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS)
        continue;
      CUresult r = CUDA_SUCCESS;
      if (std::find(contexts.begin(), contexts.end(), primary) == contexts.end()) {
        CtxScope scope(api, primary);
        r = scope.ok() ? api.cuCtxSynchronize() : CUDA_ERROR_INVALID_CONTEXT;
      }
      api.cuDevicePrimaryCtxRelease_v2(dev);
      if (r != CUDA_SUCCESS) return OpResult{EIO, 0, 0, cuda_failure("cuCtxSynchronize (peer device)", r)};
    }
  }
  vmm_trim_pools();  // pool memory stays resident; what the pools keep unused goes back now

  // Exported through legacy IPC: the daemon must not keep the old physical memory alive, and what
  // another process has open stays resident. Whatever this pause leaves resident gets its export
  // back on the way out.
  std::vector<std::shared_ptr<Allocation>> revoked;
  struct Reexport {
    Engine* engine;
    std::vector<std::shared_ptr<Allocation>>& list;
    ~Reexport() {
      for (auto& a : list)
        if (a->state.load() == AllocState::Resident) engine->ipc_refresh(*a);
    }
  } reexport{this, revoked};
  ipc_revoke(resident, revoked);
  if (resident.empty()) {
    res.message = "every allocation stays resident: other processes have them open through legacy IPC";
    return res;
  }

  std::vector<Job> jobs(resident.size());
  uint64_t total = 0;
  for (std::size_t i = 0; i < resident.size(); ++i) {
    std::string why;
    Job& j = jobs[i];
    j.a = resident[i];
    j.ctx = ctx_index(j.a->ctx, &why);
    if (j.ctx < 0) return OpResult{EIO, 0, 0, why};
    j.chunks = (j.a->size + slot_bytes_ - 1) / slot_bytes_;
    total += j.a->size;
  }
  for (Job& j : jobs) {
    j.a->chunk_sums.assign(j.chunks, 0);
    j.a->sums_chunk_bytes = slot_bytes_;
  }
  register_staging(resident.front()->ctx);

  // 2. Reserve disk space for every byte; refused (ENOSPC...) means nothing changed.
  for (std::size_t first = 0; first < jobs.size(); first += kReserveBatch) {
    const std::size_t end = std::min(jobs.size(), first + kReserveBatch);
    proto::Reserve m;
    m.flags =
        static_cast<uint8_t>((first == 0 ? proto::kReserveFirst : 0) | (end == jobs.size() ? proto::kReserveLast : 0));
    for (std::size_t i = first; i < end; ++i) m.blobs.push_back({jobs[i].a->id, jobs[i].a->size});
    const uint64_t id = next_request_++;
    proto::Envelope reply;
    std::string why;
    if (int e = send(id, m); e < 0) return OpResult{-e, 0, 0, format("cannot send RESERVE: %s", std::strerror(-e))};
    if (int e = await_reply(id, reply, &why); e < 0) return OpResult{-e, 0, 0, why};
    if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
      return OpResult{err->code, 0, 0, "tmsdiskd refused the reservation: " + err->message};
    if (!std::holds_alternative<proto::OkReply>(reply.body))
      return OpResult{EPROTO, 0, 0, "unexpected answer to RESERVE"};
  }

  // 3./4. Chunk by chunk: device -> slot, slot -> disk; an allocation's memory goes once all of its
  // chunks are acknowledged.
  int fail = 0;
  std::string fail_msg;
  auto set_fail = [&](int code, std::string msg) {
    if (!fail) {
      fail = code;
      fail_msg = std::move(msg);
    }
  };
  uint64_t done_bytes = 0, released_bytes = 0;
  std::size_t released = 0, cursor = 0;
  int64_t last_activity = now_ms();
  maybe_progress(command_request, 0, total, true);
  for (;;) {
    while (!fail) {
      while (cursor < jobs.size() && jobs[cursor].next_offset >= jobs[cursor].a->size) ++cursor;
      if (cursor == jobs.size()) break;
      const int s = free_slot();
      if (s < 0) break;
      Job& j = jobs[cursor];
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(slot_bytes_, j.a->size - j.next_offset));
      std::string why;
      CUevent ev = slot_event(j.ctx, static_cast<std::size_t>(s), &why);
      if (!ev) {
        set_fail(EIO, why);
        break;
      }
      CtxScope scope(api, ctxs_[static_cast<std::size_t>(j.ctx)].ctx);
      CUstream stream = ctxs_[static_cast<std::size_t>(j.ctx)].stream;
      CUresult r = api.cuMemcpyDtoHAsync_v2(staging_ + static_cast<std::size_t>(s) * slot_bytes_,
                                            j.a->base + j.next_offset, len, stream);
      if (r == CUDA_SUCCESS) r = api.cuEventRecord(ev, stream);
      if (r != CUDA_SUCCESS) {
        set_fail(EIO, cuda_failure("copying device memory to the staging buffer", r));
        break;
      }
      slots_[static_cast<std::size_t>(s)] =
          Slot{SlotState::Copying, 0, static_cast<int>(cursor), j.next_offset, len, j.ctx};
      j.next_offset += len;
      ++j.in_flight;
    }

    bool copying = false;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = slots_[s];
      if (slot.state != SlotState::Copying) continue;
      Job& j = jobs[static_cast<std::size_t>(slot.job)];
      const CUresult q = api.cuEventQuery(ctxs_[static_cast<std::size_t>(slot.ctx)].events[s]);
      if (q == CUDA_ERROR_NOT_READY) {
        copying = true;
        continue;
      }
      last_activity = now_ms();
      if (q != CUDA_SUCCESS) set_fail(EIO, cuda_failure("copying device memory to the staging buffer", q));
      if (fail) {
        slot = Slot{};
        --j.in_flight;
        continue;
      }
      proto::Write w;
      w.slot = static_cast<uint32_t>(s);
      w.length = slot.length;
      w.blob = j.a->id;
      w.offset = slot.offset;
      const uint64_t id = next_request_++;
      if (int e = send(id, w); e < 0) {
        set_fail(-e, format("cannot send WRITE to tmsdiskd: %s", std::strerror(-e)));
        slot = Slot{};
        --j.in_flight;
        continue;
      }
      slot.state = SlotState::InDaemon;
      slot.request = id;
    }
    bool in_daemon = false;
    for (const Slot& slot : slots_) in_daemon |= slot.state == SlotState::InDaemon;
    if (!copying && !in_daemon) {
      if (fail || cursor == jobs.size()) break;
      if (free_slot() < 0) {
        set_fail(EBUSY, "every staging slot is still held by an earlier request the daemon never answered");
        break;
      }
      continue;
    }

    proto::Envelope env;
    const int got = next_message(env, copying);
    if (copying && got == 0) {
      maybe_progress(command_request, done_bytes, total, false);
      continue;  // a copy finished: harvest it
    }
    if (got < 0) {
      set_fail(-got, "lost the connection to tmsdiskd during the pause");
      for (Slot& slot : slots_) {
        if (slot.state == SlotState::InDaemon) {
          --jobs[static_cast<std::size_t>(slot.job)].in_flight;
          slot = Slot{};
        }
      }
      continue;
    }
    if (got == 0) {
      if (now_ms() - last_activity > kReplyTimeoutMs) {
        set_fail(ETIMEDOUT,
                 format("tmsdiskd did not answer within %lld s", static_cast<long long>(kReplyTimeoutMs / 1000)));
        for (Slot& slot : slots_) {
          if (slot.state == SlotState::InDaemon) {
            --jobs[static_cast<std::size_t>(slot.job)].in_flight;
            slot.state = SlotState::Lost;  // freed if the answer ever comes
          }
        }
      }
      maybe_progress(command_request, done_bytes, total, false);
      continue;
    }
    last_activity = now_ms();
    const int s = slot_awaiting(env.request_id);
    if (s < 0) {
      handle_other(env);
      continue;
    }
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    Job& j = jobs[static_cast<std::size_t>(slot.job)];
    const uint32_t len = slot.length;
    const uint64_t slot_offset = slot.offset;
    --j.in_flight;
    slot = Slot{};
    if (const auto* written = std::get_if<proto::Written>(&env.body)) {
      j.a->chunk_sums[slot_offset / slot_bytes_] = written->checksum;
      ++j.done;
      done_bytes += len;
      if (!fail && j.done == j.chunks) {
        // Invariant 1: every chunk of this allocation is on disk with its checksum.
        Allocation& a = *j.a;
        CtxScope scope(api, a.ctx);
        if (CUresult r = api.cuMemUnmap(a.base, a.mapped); r != CUDA_SUCCESS) {
          set_fail(EIO, cuda_failure("cuMemUnmap", r));  // still mapped: the allocation stays resident
        } else {
          if (CUresult r = api.cuMemRelease(a.handle); r != CUDA_SUCCESS)
            TMS_ERROR("blob %llu: %s; its physical memory may leak", static_cast<unsigned long long>(a.id),
                      cuda_failure("cuMemRelease", r).c_str());
          a.handle = 0;
          a.state.store(AllocState::Paused);
          released_bytes += a.size;
          ++released;
        }
      }
    } else if (const auto* err = std::get_if<proto::ErrorReply>(&env.body)) {
      set_fail(err->code, "tmsdiskd: " + err->message);
    } else {
      set_fail(EPROTO, "unexpected answer to WRITE");
    }
    maybe_progress(command_request, done_bytes, total, false);
  }
  maybe_progress(command_request, done_bytes, total, true);

  if (fail) {
    res.code = fail;
    res.bytes = released_bytes;
    res.message = released ? format("%s; %zu of %zu allocation(s) are paused, the others stay resident",
                                    fail_msg.c_str(), released, jobs.size())
                           : fail_msg + "; every allocation stays resident";
    return res;
  }

  // 5. The daemon syncs the data and commits its manifest.
  OpResult committed =
      commit(proto::CommitState::Paused, ++generation_, released_bytes, "every allocation was written and released");
  if (committed.code) return committed;
  committed_paused_ = true;
  res.bytes = released_bytes;
  return res;
}

// ---------------------------------------------------------------------------------------------
// Resume

OpResult Engine::resume(uint64_t command_request) {
  std::vector<std::shared_ptr<Allocation>> paused;
  for (auto& a : registry().snapshot())
    if (a->state.load() == AllocState::Paused) paused.push_back(std::move(a));
  if (paused.empty() && !committed_paused_) return OpResult{0, 0, 0, "nothing is paused"};
  return resume_list(std::move(paused), command_request);
}

void Engine::map_job(Job& j) {
  const DriverApi& api = driver().api;
  Allocation& a = *j.a;
  CtxScope scope(api, a.ctx);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = api.cuMemCreate(&h, a.mapped, &a.prop, 0);
  if (r != CUDA_SUCCESS) {
    j.error = r == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : EIO;
    j.message = format("blob %llu: %s", static_cast<unsigned long long>(a.id), cuda_failure("cuMemCreate", r).c_str());
    return;
  }
  r = api.cuMemMap(a.base, a.mapped, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(h);
    j.error = EIO;
    j.message = format("blob %llu: %s", static_cast<unsigned long long>(a.id), cuda_failure("cuMemMap", r).c_str());
    return;
  }
  // Application mappings paused before their first cuMemSetAccess have no rights to restore.
  if (!a.access.empty()) r = api.cuMemSetAccess(a.base, a.mapped, a.access.data(), a.access.size());
  if (r != CUDA_SUCCESS) {
    api.cuMemUnmap(a.base, a.mapped);
    api.cuMemRelease(h);
    j.error = EIO;
    j.message =
        format("blob %llu: %s", static_cast<unsigned long long>(a.id), cuda_failure("cuMemSetAccess", r).c_str());
    return;
  }
  j.handle = h;
  j.mapped = true;
}

void Engine::unmap_job(Job& j) noexcept {
  if (!j.mapped) return;
  const DriverApi& api = driver().api;
  CtxScope scope(api, j.a->ctx);
  api.cuMemUnmap(j.a->base, j.a->mapped);
  api.cuMemRelease(j.handle);
  j.handle = 0;
  j.mapped = false;
}

OpResult Engine::resume_list(std::vector<std::shared_ptr<Allocation>> list, uint64_t command_request) {
  const DriverApi& api = driver().api;
  set_state(proto::RankState::Resuming);
  std::vector<Job> jobs(list.size());
  uint64_t total = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    std::string why;
    Job& j = jobs[i];
    j.a = std::move(list[i]);
    j.ctx = ctx_index(j.a->ctx, &why);
    if (j.ctx < 0) return OpResult{EIO, 0, 0, why};
    j.chunks = (j.a->size + slot_bytes_ - 1) / slot_bytes_;
    total += j.a->size;
  }
  if (!jobs.empty()) register_staging(jobs.front().a->ctx);

  int fatal = 0;
  std::string fatal_msg;
  auto set_fatal = [&](int code, std::string msg) {
    if (!fatal) {
      fatal = code;
      fatal_msg = std::move(msg);
    }
  };
  uint64_t done_bytes = 0, resumed_bytes = 0;
  std::size_t cursor = 0, resumed = 0;
  int64_t last_activity = now_ms();
  maybe_progress(command_request, 0, total, true);
  uint64_t map_ns = 0;
  for (;;) {
    // Ask for chunks while slots are free. Reads need no device memory (they fill staging slots), so
    // they start at once; physical memory is created when an allocation's first chunk is back.
    while (!fatal) {
      while (cursor < jobs.size() && (jobs[cursor].error || jobs[cursor].next_offset >= jobs[cursor].a->size)) ++cursor;
      if (cursor == jobs.size()) break;
      const int s = free_slot();
      if (s < 0) break;
      Job& j = jobs[cursor];
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(slot_bytes_, j.a->size - j.next_offset));
      proto::Read m;
      m.slot = static_cast<uint32_t>(s);
      m.length = len;
      m.blob = j.a->id;
      m.offset = j.next_offset;
      const uint64_t chunk = j.next_offset / slot_bytes_;
      if (j.a->sums_chunk_bytes == slot_bytes_ && chunk < j.a->chunk_sums.size()) m.checksum = j.a->chunk_sums[chunk];
      const uint64_t id = next_request_++;
      if (int e = send(id, m); e < 0) {
        set_fatal(-e, format("cannot send READ to tmsdiskd: %s", std::strerror(-e)));
        break;
      }
      slots_[static_cast<std::size_t>(s)] =
          Slot{SlotState::InDaemon, id, static_cast<int>(cursor), j.next_offset, len, j.ctx};
      j.next_offset += len;
      ++j.in_flight;
    }

    bool copying = false;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = slots_[s];
      if (slot.state != SlotState::Copying) continue;
      Job& j = jobs[static_cast<std::size_t>(slot.job)];
      const CUresult q = api.cuEventQuery(ctxs_[static_cast<std::size_t>(slot.ctx)].events[s]);
      if (q == CUDA_ERROR_NOT_READY) {
        copying = true;
        continue;
      }
      last_activity = now_ms();
      const uint32_t len = slot.length;
      slot = Slot{};
      --j.in_flight;
      if (q != CUDA_SUCCESS) {
        set_fatal(EIO, cuda_failure("copying the staging buffer to device memory", q));
        if (!j.error) {
          j.error = EIO;
          j.message = fatal_msg;
        }
        continue;
      }
      done_bytes += len;
      if (++j.done == j.chunks && !j.error) {
        // Every chunk verified by the daemon and copied back: the data may become visible.
        j.a->handle = j.handle;
        j.handle = 0;
        j.mapped = false;
        j.complete = true;
        j.a->state.store(AllocState::Resident);
        resumed_bytes += j.a->size;
        ++resumed;
      }
    }
    for (Job& j : jobs)
      if (j.error && j.mapped && j.in_flight == 0) unmap_job(j);  // stays paused; the file is kept

    bool in_daemon = false;
    for (const Slot& slot : slots_) in_daemon |= slot.state == SlotState::InDaemon;
    if (!copying && !in_daemon) {
      if (fatal || cursor == jobs.size()) break;
      if (free_slot() < 0) {
        set_fatal(EBUSY, "every staging slot is still held by an earlier request the daemon never answered");
        break;
      }
      continue;
    }

    proto::Envelope env;
    const int got = next_message(env, copying);
    if (copying && got == 0) {
      maybe_progress(command_request, done_bytes, total, false);
      continue;  // a copy finished: harvest it
    }
    if (got < 0 || (got == 0 && now_ms() - last_activity > kReplyTimeoutMs)) {
      const bool lost = got < 0;
      set_fatal(lost ? -got : ETIMEDOUT,
                lost ? std::string("lost the connection to tmsdiskd during the resume")
                     : format("tmsdiskd did not answer within %lld s", static_cast<long long>(kReplyTimeoutMs / 1000)));
      for (Slot& slot : slots_) {
        if (slot.state != SlotState::InDaemon) continue;
        Job& j = jobs[static_cast<std::size_t>(slot.job)];
        --j.in_flight;
        if (!j.error) {
          j.error = fatal;
          j.message = fatal_msg;
        }
        if (lost)
          slot = Slot{};
        else
          slot.state = SlotState::Lost;
      }
      continue;
    }
    if (got == 0) {
      maybe_progress(command_request, done_bytes, total, false);
      continue;
    }
    last_activity = now_ms();
    const int s = slot_awaiting(env.request_id);
    if (s < 0) {
      handle_other(env);
      continue;
    }
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    Job& j = jobs[static_cast<std::size_t>(slot.job)];
    if (std::holds_alternative<proto::ReadDone>(env.body) && !j.error && !fatal && !j.mapped) {
      // Created and mapped here, while the daemon reads the chunks queued behind this one: the disk
      // never waits for the driver. A failure to get the memory affects this allocation only.
      const uint64_t t0 = now_ns();
      map_job(j);
      map_ns += now_ns() - t0;
      if (j.error) TMS_WARN("%s", j.message.c_str());
    }
    if (std::holds_alternative<proto::ReadDone>(env.body) && !j.error && !fatal) {
      const CtxResources& cr = ctxs_[static_cast<std::size_t>(slot.ctx)];
      std::string why;
      CUevent ev = slot_event(slot.ctx, static_cast<std::size_t>(s), &why);
      CUresult r = CUDA_ERROR_INVALID_HANDLE;
      if (ev) {
        CtxScope scope(api, cr.ctx);
        r = api.cuMemcpyHtoDAsync_v2(j.a->base + slot.offset, staging_ + static_cast<std::size_t>(s) * slot_bytes_,
                                     slot.length, cr.stream);
        if (r == CUDA_SUCCESS) r = api.cuEventRecord(ev, cr.stream);
      }
      if (r == CUDA_SUCCESS) {
        slot.state = SlotState::Copying;
        slot.request = 0;
        continue;
      }
      set_fatal(EIO, ev ? cuda_failure("copying the staging buffer to device memory", r) : why);
      j.error = EIO;
      j.message = fatal_msg;
    } else if (const auto* err = std::get_if<proto::ErrorReply>(&env.body)) {
      // Checksum mismatch (EBADMSG), read error (EIO)...: this allocation stays paused.
      if (!j.error) {
        j.error = err->code;
        j.message = format("blob %llu: %s", static_cast<unsigned long long>(j.a->id), err->message.c_str());
        TMS_WARN("%s", j.message.c_str());
      }
    } else if (!std::holds_alternative<proto::ReadDone>(env.body)) {
      set_fatal(EPROTO, "unexpected answer to READ");
    }
    slot = Slot{};
    --j.in_flight;
    maybe_progress(command_request, done_bytes, total, false);
  }
  maybe_progress(command_request, done_bytes, total, true);
  TMS_INFO("resume: creating and mapping physical memory for %zu allocation(s) took %.3f s, overlapped with the reads",
           jobs.size(), static_cast<double>(map_ns) / 1e9);
  for (Job& j : jobs) {
    if (!j.complete) unmap_job(j);
    else if (j.a->export_id) ipc_refresh(*j.a);
  }

  OpResult res;
  res.bytes = resumed_bytes;
  if (resumed < jobs.size()) {
    const Job* first = nullptr;
    for (const Job& j : jobs)
      if (!j.complete && j.error) {
        first = &j;
        break;
      }
    res.code = first ? first->error : (fatal ? fatal : EIO);
    res.message = format("%zu of %zu allocation(s) stay paused: %s", jobs.size() - resumed, jobs.size(),
                         first ? first->message.c_str() : fatal_msg.c_str());
    return res;
  }

  OpResult committed =
      commit(proto::CommitState::Resumed, generation_, resumed_bytes, "every allocation is resident again");
  if (committed.code) return committed;
  committed_paused_ = false;
  return res;
}

OpResult Engine::commit(proto::CommitState state, uint64_t generation, uint64_t bytes, const char* done) {
  proto::Commit c;
  c.state = static_cast<uint8_t>(state);
  c.generation = generation;
  const uint64_t id = next_request_++;
  proto::Envelope reply;
  std::string why;
  int e = send(id, c);
  if (e == 0)
    e = await_reply(id, reply, &why);
  else
    why = format("cannot send COMMIT: %s", std::strerror(-e));
  if (e < 0) return OpResult{-e, bytes, 0, std::string(done) + ", but " + why};
  if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
    return OpResult{err->code, bytes, 0, std::string(done) + ", but the commit failed: " + err->message};
  return OpResult{0, bytes, 0, {}};
}

// ---------------------------------------------------------------------------------------------
// Session

int Engine::connect_session(std::string* why) {
  const Config& cfg = config();
  if (staging_) release_staging();
  int fd = proto::connect_seqpacket(cfg.socket_path);
  if (fd < 0 && !cfg.socket_explicit && start_private_daemon() == 0) fd = proto::connect_seqpacket(cfg.private_socket);
  if (fd < 0) {
    *why = cfg.socket_explicit
               ? format("cannot reach tmsdiskd at %s (TMSDISK_SOCKET): %s", cfg.socket_path.c_str(), std::strerror(-fd))
               : format("cannot reach tmsdiskd at %s, nor start a private one at %s: %s", cfg.socket_path.c_str(),
                        cfg.private_socket.c_str(), std::strerror(-fd));
    return fd;
  }
  int sock = fd;
  auto fail = [&](int code, std::string msg) {
    ::close(sock);
    *why = std::move(msg);
    return -code;
  };
  timeval tv{kHandshakeTimeoutS, 0};
  ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));

  proto::Hello h;
  h.role = static_cast<uint8_t>(proto::Role::Shim);
  h.rank = cfg.rank;
  int devices = 0;
  if (driver().api.cuDeviceGetCount && driver().api.cuDeviceGetCount(&devices) != CUDA_SUCCESS) devices = 0;
  h.device_count = static_cast<uint32_t>(std::max(devices, 0));
  h.job = cfg.job;
  h.backup_dir = cfg.backup_dir.size() <= proto::kMaxPathLength ? cfg.backup_dir : std::string();
  h.token = token_;
  h.staging_bytes = cfg.staging_bytes;
  const uint64_t hello_id = next_request_++;
  auto bytes = proto::encode(hello_id, h);
  if (bytes.empty()) return fail(EINVAL, "cannot encode HELLO");
  if (int e = proto::send_message(sock, bytes); e < 0)
    return fail(-e, format("cannot send HELLO to tmsdiskd: %s", std::strerror(-e)));
  int memfd = -1;
  long n = proto::recv_message(sock, rx_, &memfd);
  if (n <= 0) {
    if (memfd >= 0) ::close(memfd);
    return fail(n == 0 ? ECONNRESET : static_cast<int>(-n),
                format("tmsdiskd did not answer HELLO: %s",
                       n == 0 ? "connection closed" : std::strerror(static_cast<int>(-n))));
  }
  auto decoded = proto::decode(rx_);
  auto close_memfd = [&] {
    if (memfd >= 0) ::close(memfd);
    memfd = -1;
  };
  if (!decoded.envelope) {
    close_memfd();
    return fail(decoded.code ? decoded.code : EPROTO, "bad answer to HELLO: " + decoded.error);
  }
  if (const auto* err = std::get_if<proto::ErrorReply>(&decoded.envelope->body)) {
    close_memfd();
    return fail(err->code, "tmsdiskd refused the session: " + err->message);
  }
  const auto* w = std::get_if<proto::Welcome>(&decoded.envelope->body);
  if (!w) {
    close_memfd();
    return fail(EPROTO, "unexpected answer to HELLO");
  }
  struct stat st {};
  if (memfd < 0 || w->slot_bytes == 0 || w->slot_count == 0 ||
      uint64_t{w->slot_count} * w->slot_bytes > w->staging_bytes || ::fstat(memfd, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < w->staging_bytes) {
    close_memfd();
    return fail(EPROTO, "tmsdiskd's WELCOME has no usable staging buffer");
  }
  void* p = ::mmap(nullptr, w->staging_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  const int map_errno = errno;
  close_memfd();
  if (p == MAP_FAILED) return fail(map_errno, format("cannot map the staging buffer: %s", std::strerror(map_errno)));

  timeval none{0, 0};
  ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));  // poll() decides how long to wait
  sock_ = sock;
  staging_ = static_cast<uint8_t*>(p);
  staging_bytes_ = w->staging_bytes;
  slot_bytes_ = w->slot_bytes;
  slots_.assign(w->slot_count, Slot{});
  staging_registered_ = false;
  token_ = w->token;
  const std::size_t paused = registry().totals().paused_allocations;
  committed_paused_ = w->restored != 0;
  if (paused && !w->restored)
    TMS_WARN(
        "tmsdiskd has no committed pause of this process; its %zu paused allocation(s) will be read back "
        "against the checksums it acknowledged",
        paused);
  {
    std::lock_guard lock(mu_);
    connected_ = true;
    session_id_ = w->session_id;
  }
  connect_backoff_ms_ = 1000;
  unreachable_logged_ = false;
  ipc_session_started(w->adopted != 0);
  TMS_INFO("session %llu with tmsdiskd: %u slots of %u bytes, directory %s",
           static_cast<unsigned long long>(w->session_id), w->slot_count, w->slot_bytes, w->rank_dir.c_str());
  send_report();
  return 0;
}

void Engine::drop_session(const char* why) {
  if (sock_ < 0) return;
  ::close(sock_);
  sock_ = -1;
  // Whatever the daemon held is gone with the connection; the staging mapping is released once no
  // copy can be writing into it (control loop, between operations).
  for (Slot& s : slots_)
    if (s.state == SlotState::InDaemon || s.state == SlotState::Lost) s = Slot{};
  {
    std::lock_guard lock(mu_);
    connected_ = false;
    session_id_ = 0;
  }
  const std::size_t paused = registry().totals().paused_allocations;
  if (paused)
    TMS_ERROR("connection to tmsdiskd lost (%s) while %zu allocation(s) are paused; reconnecting", why, paused);
  else
    TMS_WARN("connection to tmsdiskd lost (%s); reconnecting", why);
  next_connect_ms_ = now_ms() + 1000;
}

void Engine::release_staging() noexcept {
  if (!staging_) return;
  const DriverApi& api = driver().api;
  if (staging_registered_ && api.cuMemHostUnregister) {
    CtxScope scope(api, registered_ctx_);
    api.cuMemHostUnregister(staging_);
  }
  ::munmap(staging_, staging_bytes_);
  staging_ = nullptr;
  staging_bytes_ = 0;
  staging_registered_ = false;
  registered_ctx_ = nullptr;
  for (Slot& s : slots_) s = Slot{};
}

void Engine::register_staging(CUcontext ctx) {
  const DriverApi& api = driver().api;
  if (staging_registered_ || !staging_ || !api.cuMemHostRegister_v2) return;
  CtxScope scope(api, ctx);
  const CUresult r = api.cuMemHostRegister_v2(staging_, staging_bytes_, CU_MEMHOSTREGISTER_PORTABLE);
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    staging_registered_ = true;
    registered_ctx_ = ctx;
  } else {
    TMS_LOG_ONCE(LogLevel::Warn, "cannot pin the staging buffer (%s); copies will be slower",
                 cuda_failure("cuMemHostRegister", r).c_str());
  }
}

int Engine::send(uint64_t request_id, const proto::Message& body, int fd) {
  if (sock_ < 0) return -ENOTCONN;
  auto bytes = proto::encode(request_id, body);
  if (bytes.empty()) return -EMSGSIZE;
  const int e = proto::send_message(sock_, bytes, fd);
  if (e == -EPIPE || e == -ECONNRESET) drop_session(std::strerror(-e));
  return e;
}

int Engine::slot_awaiting(uint64_t request_id) const noexcept {
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].state == SlotState::InDaemon && slots_[i].request == request_id) return static_cast<int>(i);
  return -1;
}

int Engine::next_message(proto::Envelope& env, bool copying) {
  if (!copying) return receive(env, kTickMs);
  const int got = receive(env, 0);
  if (got != 0) return got;
  const DriverApi& api = driver().api;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s].state != SlotState::Copying) continue;
    (void)api.cuEventSynchronize(ctxs_[static_cast<std::size_t>(slots_[s].ctx)].events[s]);
    break;
  }
  return 0;
}

int Engine::receive(proto::Envelope& env, int timeout_ms, UniqueFd* fd) {
  if (sock_ < 0) return -ENOTCONN;
  pollfd p{sock_, POLLIN, 0};
  const int n = ::poll(&p, 1, timeout_ms);
  if (n <= 0) return 0;
  int passed = -1;
  const long got = proto::recv_message(sock_, rx_, &passed);
  UniqueFd owned(passed);
  if (fd) *fd = std::move(owned);
  if (got == -EMSGSIZE || got == -EINTR || got == -EAGAIN) return 0;
  if (got <= 0) {
    const int e = got == 0 ? ECONNRESET : static_cast<int>(-got);
    drop_session(got == 0 ? "tmsdiskd closed the connection" : std::strerror(e));
    return -e;
  }
  auto decoded = proto::decode(rx_);
  if (!decoded.envelope) {
    TMS_WARN("ignoring a bad message from tmsdiskd: %s", decoded.error.c_str());
    return 0;
  }
  env = std::move(*decoded.envelope);
  return 1;
}

int Engine::await_reply(uint64_t request_id, proto::Envelope& reply, std::string* why, UniqueFd* fd) {
  const int64_t deadline = now_ms() + kReplyTimeoutMs;
  for (;;) {
    const int64_t left = deadline - now_ms();
    if (left <= 0) {
      *why = format("tmsdiskd did not answer within %lld s", static_cast<long long>(kReplyTimeoutMs / 1000));
      return -ETIMEDOUT;
    }
    UniqueFd passed;
    const int got = receive(reply, static_cast<int>(std::min<int64_t>(left, kReportIntervalMs)), &passed);
    if (got < 0) {
      *why = format("lost the connection to tmsdiskd: %s", std::strerror(-got));
      return got;
    }
    if (got == 0) continue;
    if (reply.request_id == request_id) {
      if (fd) *fd = std::move(passed);
      return 0;
    }
    handle_other(reply);
  }
}

void Engine::handle_other(const proto::Envelope& env) {
  if (std::holds_alternative<proto::Command>(env.body) && !deferred_command_) {
    bool running;
    {
      std::lock_guard lock(mu_);
      running = busy_;
    }
    if (!running) {
      deferred_command_ = env;  // an IPC exchange is waiting for its reply: the command runs right after
      return;
    }
  }
  if (std::holds_alternative<proto::Command>(env.body)) {
    proto::CommandDone done;
    done.code = EBUSY;
    done.message = "another pause or resume is running";
    (void)send(env.request_id, done);
    return;
  }
  for (Slot& s : slots_) {
    if (s.state == SlotState::Lost && s.request == env.request_id) {
      s = Slot{};  // the late answer frees the slot
      return;
    }
  }
  if (const auto* users = std::get_if<proto::IpcUsers>(&env.body)) return on_ipc_users(*users);
  if (const auto* err = std::get_if<proto::ErrorReply>(&env.body)) {
    TMS_WARN("tmsdiskd: %s (%s)", err->message.c_str(), std::strerror(err->code));
    return;
  }
  TMS_DEBUG("ignoring %s (request %llu) from tmsdiskd",
            proto::type_name(std::visit([](const auto& m) { return std::decay_t<decltype(m)>::kType; }, env.body)),
            static_cast<unsigned long long>(env.request_id));
}

proto::RankStats Engine::make_stats() {
  const RegistryTotals t = registry().totals();
  proto::RankStats s;
  {
    std::lock_guard lock(mu_);
    s = last_;
  }
  s.resident_bytes = t.resident_bytes;
  s.paused_bytes = t.paused_bytes;
  s.unmanaged_bytes = t.unmanaged_bytes;
  s.managed_allocations = t.managed_allocations;
  return s;
}

void Engine::send_report() {
  reported_version_ = registry().version();
  last_report_ms_ = now_ms();
  proto::Report r;
  r.stats = make_stats();
  (void)send(next_request_++, r);
}

void Engine::maybe_progress(uint64_t command_request, uint64_t done, uint64_t total, bool force) {
  if (command_request == 0 || sock_ < 0) return;  // only a daemon command has someone watching
  const int64_t now = now_ms();
  if (!force && now - last_progress_ms_ < kTickMs) return;
  last_progress_ms_ = now;
  proto::Progress p;
  p.done_bytes = std::min(done, total);
  p.total_bytes = total;
  (void)send(command_request, p);
}

void Engine::set_state(proto::RankState s) {
  {
    std::lock_guard lock(mu_);
    last_.state = static_cast<uint8_t>(s);
  }
  if (sock_ >= 0) send_report();
}

int Engine::free_slot() const noexcept {
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].state == SlotState::Free) return static_cast<int>(i);
  return -1;
}

int Engine::ctx_index(CUcontext ctx, std::string* why) {
  for (std::size_t i = 0; i < ctxs_.size(); ++i)
    if (ctxs_[i].ctx == ctx) return static_cast<int>(i);
  const DriverApi& api = driver().api;
  CtxScope scope(api, ctx);
  if (!scope.ok()) {
    *why = "cannot make an allocation's context current (was it destroyed?)";
    return -1;
  }
  CtxResources cr;
  cr.ctx = ctx;
  // Non-blocking: the shim's copies must not wait on, or be waited on by, the legacy default stream.
  if (CUresult r = api.cuStreamCreate(&cr.stream, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
    *why = cuda_failure("cuStreamCreate", r);
    return -1;
  }
  ctxs_.push_back(std::move(cr));
  return static_cast<int>(ctxs_.size() - 1);
}

CUevent Engine::slot_event(int ctx, std::size_t slot, std::string* why) {
  CtxResources& cr = ctxs_[static_cast<std::size_t>(ctx)];
  if (cr.events.size() < slots_.size()) cr.events.resize(slots_.size(), nullptr);
  if (!cr.events[slot]) {
    const DriverApi& api = driver().api;
    CtxScope scope(api, cr.ctx);
    if (CUresult r = api.cuEventCreate(&cr.events[slot], CU_EVENT_DISABLE_TIMING); r != CUDA_SUCCESS) {
      cr.events[slot] = nullptr;
      *why = cuda_failure("cuEventCreate", r);
    }
  }
  return cr.events[slot];
}

}  // namespace tmsdisk::shim
