// SPDX-License-Identifier: Apache-2.0
// simcuda streams, events and built-in kernels: every stream has a worker thread that runs its
// queue in order, so asynchronous work really completes later than the call that queued it.
#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "simcuda_internal.h"
#include "tmsdisk/common/signal_blocked_thread.h"

namespace simcuda {
namespace {

using Kind = CUstream_st::Kind;

bool ready(const Op& op) {
  for (const Dep& dep : op.deps) {
    if (dep.stream->completed < dep.seq) return false;
  }
  return true;
}

void worker_main(std::shared_ptr<CUstream_st> s) {
  pthread_setname_np(pthread_self(), s->kind == Kind::Legacy ? "simcuda-null" : "simcuda-stream");
  Driver& d = *s->driver;
  std::unique_lock<std::mutex> lk(d.work_mu);
  for (;;) {
    d.work_cv.wait(lk, [&] { return !s->queue.empty() && ready(s->queue.front()); });
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    if (op.run) {
      lk.unlock();
      CUresult r = CUDA_SUCCESS;
      // A poisoned context runs nothing more; queued work still "completes" so nobody waits forever.
      if (s->ctx->sticky.load() == CUDA_SUCCESS) {
        try {
          r = op.run();
        } catch (...) {
          r = CUDA_ERROR_UNKNOWN;
        }
      }
      if (r != CUDA_SUCCESS) {
        int expected = CUDA_SUCCESS;
        s->ctx->sticky.compare_exchange_strong(expected, r);
      }
      op.run = nullptr;  // drop what it captured outside the lock
      lk.lock();
    }
    if (op.event && op.event->gen == op.event_gen) {
      op.event->stamped = true;
      op.event->when = std::chrono::steady_clock::now();
    }
    s->completed = op.seq;
    d.work_cv.notify_all();
    if (op.exit) return;
  }
}

// Threads started inside the host program block every signal, so its handlers keep running on its
// own threads only.
void start_worker(const std::shared_ptr<CUstream_st>& s) {
  tmsdisk::start_signal_blocked_thread(worker_main, s).detach();
}

// Caller holds work_mu.
void retire_locked(Driver& d, const std::shared_ptr<CUstream_st>& s) {
  if (s->retired) return;
  s->retired = true;
  Op e;
  e.exit = true;
  e.seq = ++s->enqueued;
  s->queue.push_back(std::move(e));
  d.streams.erase(s.get());
  d.work_cv.notify_all();
}

// Caller holds work_mu. The legacy stream waits for every blocking stream of its context, and a
// blocking stream waits for the legacy stream: CUDA's implicit NULL-stream synchronization.
uint64_t enqueue_locked(Driver& d, const std::shared_ptr<CUstream_st>& s, Op op) {
  if (s->kind == Kind::Legacy) {
    for (const auto& o : s->ctx->streams) {
      if (o != s && o->blocking() && o->completed < o->enqueued) op.deps.push_back({o, o->enqueued});
    }
  } else if (s->blocking()) {
    const auto& l = s->ctx->legacy;
    if (l && l != s && l->completed < l->enqueued) op.deps.push_back({l, l->enqueued});
  }
  op.seq = ++s->enqueued;
  s->queue.push_back(std::move(op));
  d.work_cv.notify_all();
  return s->enqueued;
}

// Caller holds work_mu.
CUresult can_enqueue(const std::shared_ptr<CUstream_st>& s) {
  if (s->retired) return s->kind == Kind::User ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_CONTEXT_IS_DESTROYED;
  return static_cast<CUresult>(s->ctx->sticky.load());
}

// The per-thread default streams this thread created; retired when the thread exits.
struct PerThreadStreams {
  uint64_t epoch = 0;
  std::vector<std::pair<CUctx_st*, std::shared_ptr<CUstream_st>>> v;
  ~PerThreadStreams() {
    Driver* d = driver();
    if (d == nullptr || d->epoch != epoch) return;
    std::lock_guard<std::mutex> lk(d->work_mu);
    for (auto& [c, s] : v) {
      auto& list = c->streams;
      list.erase(std::remove(list.begin(), list.end(), s), list.end());
      retire_locked(*d, s);
    }
  }
};
thread_local PerThreadStreams t_per_thread;

CUresult per_thread_stream(Driver& d, CUctx_st* c, std::shared_ptr<CUstream_st>* out) {
  auto& pts = t_per_thread;
  if (pts.epoch != d.epoch) {
    pts.v.clear();
    pts.epoch = d.epoch;
  }
  {
    std::lock_guard<std::mutex> lk(d.work_mu);
    for (auto& [ctx, s] : pts.v) {
      if (ctx == c && !s->retired) {
        *out = s;
        return CUDA_SUCCESS;
      }
    }
  }
  auto s = new_stream(d, c, Kind::PerThread, 0, 0);
  pts.v.erase(std::remove_if(pts.v.begin(), pts.v.end(), [c](const auto& e) { return e.first == c; }), pts.v.end());
  pts.v.emplace_back(c, s);
  *out = s;
  return CUDA_SUCCESS;
}

struct Builtin {
  const char* name;
  Kernel kernel;
};
constexpr Builtin kBuiltins[] = {
    {"simcuda_fill_u32", Kernel::Fill},
    {"simcuda_add_u32", Kernel::Add},
    {"simcuda_noop", Kernel::Noop},
    {"tmsdisk_nonzero_chunks", Kernel::NonzeroChunks},
};

}  // namespace

std::shared_ptr<CUstream_st> new_stream(Driver& d, CUctx_st* ctx, CUstream_st::Kind kind, unsigned flags,
                                        int priority) {
  auto s = std::make_shared<CUstream_st>();
  s->driver = &d;
  s->ctx = ctx;
  s->kind = kind;
  s->flags = flags;
  s->priority = priority;
  s->id = d.new_id();
  start_worker(s);
  std::lock_guard<std::mutex> lk(d.work_mu);
  ctx->streams.push_back(s);
  if (kind == Kind::Legacy) ctx->legacy = s;
  if (kind == Kind::User) d.streams.emplace(s.get(), s);
  return s;
}

void retire_streams(Driver& d, CUctx_st* ctx) {
  std::unique_lock<std::mutex> lk(d.work_mu);
  std::vector<std::shared_ptr<CUstream_st>> old;
  old.swap(ctx->streams);
  ctx->legacy.reset();
  for (auto& s : old) retire_locked(d, s);
  d.work_cv.wait(lk, [&] {
    return std::all_of(old.begin(), old.end(), [](const auto& s) { return s->completed == s->enqueued; });
  });
}

CUresult resolve_stream(Driver& d, CUstream h, bool ptds, std::shared_ptr<CUstream_st>* out) {
  if (h == nullptr) h = ptds ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
  if (h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
    CUctx_st* c = nullptr;
    if (CUresult r = current_context(d, &c); r != CUDA_SUCCESS) return r;
    if (h == CU_STREAM_PER_THREAD) return per_thread_stream(d, c, out);
    std::lock_guard<std::mutex> lk(d.work_mu);
    if (!c->legacy) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = c->legacy;
    return CUDA_SUCCESS;
  }
  std::lock_guard<std::mutex> lk(d.work_mu);
  auto it = d.streams.find(h);
  if (it == d.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  *out = it->second;
  return CUDA_SUCCESS;
}

CUresult enqueue(Driver& d, const std::shared_ptr<CUstream_st>& s, Op op, uint64_t* seq) {
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (CUresult r = can_enqueue(s); r != CUDA_SUCCESS) return r;
  uint64_t n = enqueue_locked(d, s, std::move(op));
  if (seq != nullptr) *seq = n;
  return CUDA_SUCCESS;
}

CUresult run_sync(Driver& d, const std::shared_ptr<CUstream_st>& s, std::function<CUresult()> run) {
  auto result = std::make_shared<std::atomic<int>>(-1);
  Op op;
  op.run = [run = std::move(run), result] {
    CUresult r = run();
    result->store(r);
    return r;
  };
  uint64_t seq = 0;
  if (CUresult r = enqueue(d, s, std::move(op), &seq); r != CUDA_SUCCESS) return r;
  {
    std::unique_lock<std::mutex> lk(d.work_mu);
    d.work_cv.wait(lk, [&] { return s->completed >= seq; });
  }
  int r = result->load();
  return r < 0 ? static_cast<CUresult>(s->ctx->sticky.load()) : static_cast<CUresult>(r);
}

void wait_stream(Driver& d, const std::shared_ptr<CUstream_st>& s) {
  std::unique_lock<std::mutex> lk(d.work_mu);
  uint64_t target = s->enqueued;
  if (s->kind == Kind::Legacy && !s->retired) target = enqueue_locked(d, s, Op{});
  d.work_cv.wait(lk, [&] { return s->completed >= target; });
}

CUresult sync_context(Driver& d, CUctx_st* ctx) {
  std::unique_lock<std::mutex> lk(d.work_mu);
  std::vector<std::pair<std::shared_ptr<CUstream_st>, uint64_t>> targets;
  for (const auto& s : ctx->streams) targets.emplace_back(s, s->enqueued);
  d.work_cv.wait(lk, [&] {
    return std::all_of(targets.begin(), targets.end(), [](const auto& t) { return t.first->completed >= t.second; });
  });
  return static_cast<CUresult>(ctx->sticky.load());
}

CUresult query_stream(Driver& d, const std::shared_ptr<CUstream_st>& s) {
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (s->completed < s->enqueued) return CUDA_ERROR_NOT_READY;
  if (s->kind == Kind::Legacy) {
    for (const auto& o : s->ctx->streams) {
      if (o->blocking() && o->completed < o->enqueued) return CUDA_ERROR_NOT_READY;
    }
  }
  return static_cast<CUresult>(s->ctx->sticky.load());
}

CUresult destroy_stream(Driver& d, CUstream h) {
  if (h == nullptr || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard<std::mutex> lk(d.work_mu);
  auto it = d.streams.find(h);
  if (it == d.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto s = it->second;
  auto& list = s->ctx->streams;
  list.erase(std::remove(list.begin(), list.end(), s), list.end());
  // Like the driver, return at once; queued work still runs, then the worker exits.
  retire_locked(d, s);
  return CUDA_SUCCESS;
}

std::shared_ptr<CUevent_st> find_event(Driver& d, CUevent e) {
  std::lock_guard<std::mutex> lk(d.work_mu);
  auto it = d.events.find(e);
  return it == d.events.end() ? nullptr : it->second;
}

CUresult event_create(Driver& d, CUevent* out, unsigned flags) {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  constexpr unsigned kAll = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if ((flags & ~kAll) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  CUctx_st* c = nullptr;
  if (CUresult r = current_context(d, &c); r != CUDA_SUCCESS) return r;
  auto e = std::make_shared<CUevent_st>();
  e->ctx = c;
  e->flags = flags;
  std::lock_guard<std::mutex> lk(d.work_mu);
  d.events.emplace(e.get(), e);
  *out = e.get();
  return CUDA_SUCCESS;
}

CUresult event_record(Driver& d, CUevent e, CUstream h, bool ptds) {
  auto ev = find_event(d, e);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (CUresult r = can_enqueue(s); r != CUDA_SUCCESS) return r;
  Op marker;
  marker.event = ev;
  marker.event_gen = ++ev->gen;
  ev->stamped = false;
  ev->seq = enqueue_locked(d, s, std::move(marker));
  ev->stream = s;
  return CUDA_SUCCESS;
}

CUresult event_query(Driver& d, CUevent e) {
  auto ev = find_event(d, e);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (!ev->stream) return CUDA_SUCCESS;  // never recorded: complete, as in CUDA
  if (ev->stream->completed < ev->seq) return CUDA_ERROR_NOT_READY;
  return static_cast<CUresult>(ev->stream->ctx->sticky.load());
}

CUresult event_sync(Driver& d, CUevent e) {
  auto ev = find_event(d, e);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  std::unique_lock<std::mutex> lk(d.work_mu);
  if (!ev->stream) return CUDA_SUCCESS;
  auto s = ev->stream;
  uint64_t seq = ev->seq;
  d.work_cv.wait(lk, [&] { return s->completed >= seq; });
  return static_cast<CUresult>(s->ctx->sticky.load());
}

CUresult event_destroy(Driver& d, CUevent e) {
  std::lock_guard<std::mutex> lk(d.work_mu);
  // A pending record keeps the object alive until its marker has run.
  return d.events.erase(e) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult event_elapsed(Driver& d, float* ms, CUevent a, CUevent b) {
  if (ms == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto ea = find_event(d, a);
  auto eb = find_event(d, b);
  if (!ea || !eb) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (((ea->flags | eb->flags) & CU_EVENT_DISABLE_TIMING) != 0) return CUDA_ERROR_INVALID_HANDLE;
  if (!ea->stream || !eb->stream) return CUDA_ERROR_INVALID_HANDLE;
  if (!ea->stamped || !eb->stamped) return CUDA_ERROR_NOT_READY;
  *ms = std::chrono::duration<float, std::milli>(eb->when - ea->when).count();
  return CUDA_SUCCESS;
}

CUresult stream_wait_event(Driver& d, CUstream h, CUevent e, bool ptds) {
  auto ev = find_event(d, e);
  if (!ev) return CUDA_ERROR_INVALID_HANDLE;
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> lk(d.work_mu);
  if (CUresult r = can_enqueue(s); r != CUDA_SUCCESS) return r;
  if (!ev->stream) return CUDA_SUCCESS;  // waiting on a never-recorded event is a no-op
  Op wait;
  wait.deps.push_back({ev->stream, ev->seq});
  enqueue_locked(d, s, std::move(wait));
  return CUDA_SUCCESS;
}

CUresult module_load(Driver& d, CUmodule* out, const void* image) {
  if (out == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* c = nullptr;
  if (CUresult r = current_context(d, &c); r != CUDA_SUCCESS) return r;
  // Any image loads: the module always holds the built-in kernels, whatever the bytes say.
  auto m = std::make_unique<CUmod_st>();
  m->ctx = c;
  for (const Builtin& b : kBuiltins) {
    m->functions.push_back(std::make_unique<CUfunc_st>(CUfunc_st{b.kernel, b.name, m.get()}));
  }
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  for (auto& f : m->functions) d.functions.emplace(f.get(), m.get());
  *out = m.get();
  d.modules.emplace(m.get(), std::move(m));
  return CUDA_SUCCESS;
}

CUresult module_unload(Driver& d, CUmodule m) {
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  auto it = d.modules.find(m);
  if (it == d.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  for (auto& f : it->second->functions) d.functions.erase(f.get());
  d.modules.erase(it);
  return CUDA_SUCCESS;
}

void unload_context_modules(Driver& d, CUctx_st* ctx) {
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  for (auto it = d.modules.begin(); it != d.modules.end();) {
    if (it->second->ctx == ctx) {
      for (auto& f : it->second->functions) d.functions.erase(f.get());
      it = d.modules.erase(it);
    } else {
      ++it;
    }
  }
}

CUresult module_get_function(Driver& d, CUfunction* out, CUmodule m, const char* name) {
  if (out == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  auto it = d.modules.find(m);
  if (it == d.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  for (auto& f : it->second->functions) {
    if (strcmp(f->name, name) == 0) {
      *out = f.get();
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_NOT_FOUND;
}

CUresult launch_kernel(Driver& d, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, CUstream h, void** params, void** extra, bool ptds) {
  Kernel k;
  {
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    if (d.functions.count(f) == 0) return CUDA_ERROR_INVALID_HANDLE;
    k = f->kernel;
  }
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return CUDA_ERROR_INVALID_VALUE;
  if (uint64_t{bx} * by * bz > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (k == Kernel::NonzeroChunks) {
    // (u64 base, u64 bytes, u64 chunk_bytes, u64 flags), as the shim passes them.
    if (params == nullptr || gy != 1 || gz != 1) return CUDA_ERROR_INVALID_VALUE;
    uint64_t v[4];
    for (int i = 0; i < 4; ++i) {
      if (params[i] == nullptr) return CUDA_ERROR_INVALID_VALUE;
      memcpy(&v[i], params[i], sizeof v[i]);
    }
    if (v[2] == 0) return CUDA_ERROR_INVALID_VALUE;
    std::shared_ptr<CUstream_st> s;
    if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
    const int dev = s->ctx->device;
    const uint64_t chunks = gx;
    Op op;
    op.run = [&d, v, chunks, dev] { return do_nonzero_chunks(d, v[0], v[1], v[2], v[3], chunks, dev); };
    return enqueue(d, s, std::move(op));
  }
  // Arguments are copied now: kernelParams usually point into the caller's stack frame.
  CUdeviceptr ptr = 0;
  uint32_t value = 0;
  size_t count = 0;
  if (k != Kernel::Noop) {
    if (params != nullptr) {
      if (params[0] == nullptr || params[1] == nullptr || params[2] == nullptr) return CUDA_ERROR_INVALID_VALUE;
      memcpy(&ptr, params[0], sizeof ptr);
      memcpy(&value, params[1], sizeof value);
      memcpy(&count, params[2], sizeof count);
    } else if (extra != nullptr) {
      // CU_LAUNCH_PARAM_BUFFER_POINTER: the arguments packed with natural alignment (8, 4+pad, 8).
      const char* buf = nullptr;
      size_t size = 0;
      for (void** p = extra; *p != CU_LAUNCH_PARAM_END; p += 2) {
        if (p[0] == CU_LAUNCH_PARAM_BUFFER_POINTER) {
          buf = static_cast<const char*>(p[1]);
        } else if (p[0] == CU_LAUNCH_PARAM_BUFFER_SIZE) {
          size = *static_cast<const size_t*>(p[1]);
        } else {
          return CUDA_ERROR_INVALID_VALUE;
        }
      }
      if (buf == nullptr || size < 24) return CUDA_ERROR_INVALID_VALUE;
      memcpy(&ptr, buf, sizeof ptr);
      memcpy(&value, buf + 8, sizeof value);
      memcpy(&count, buf + 16, sizeof count);
    } else {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  std::shared_ptr<CUstream_st> s;
  if (CUresult r = resolve_stream(d, h, ptds, &s); r != CUDA_SUCCESS) return r;
  int dev = s->ctx->device;
  Op op;
  // A bad pointer is not an error at launch, as on a GPU: the kernel faults later and poisons the
  // context with CUDA_ERROR_ILLEGAL_ADDRESS.
  op.run = [&d, k, ptr, value, count, dev] { return do_kernel(d, k, ptr, value, count, dev); };
  return enqueue(d, s, std::move(op));
}

}  // namespace simcuda
