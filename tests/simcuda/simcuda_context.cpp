// SPDX-License-Identifier: Apache-2.0
// simcuda contexts: one primary context per device, cuCtxCreate contexts, and the per-thread stack
// of current contexts.
#include <algorithm>

#include "simcuda_internal.h"

namespace simcuda {
namespace {

// The calling thread's context stack. The epoch tells stacks inherited across fork (which name the
// parent's abandoned contexts) from the current driver's.
struct CtxStack {
  uint64_t epoch = 0;
  std::vector<CUctx_st*> v;
};
thread_local CtxStack t_stack;

std::vector<CUctx_st*>& stack(Driver& d) {
  if (t_stack.epoch != d.epoch) {
    t_stack.v.clear();
    t_stack.epoch = d.epoch;
  }
  return t_stack.v;
}

// Caller holds ctx_mu. Starts the context's legacy stream, so that no thread can see the context
// active without one (ctx_mu is taken before work_mu, never the other way round).
void activate(Driver& d, CUctx_st* c) {
  c->active = true;
  c->sticky.store(CUDA_SUCCESS);
  new_stream(d, c, CUstream_st::Kind::Legacy, 0, 0);
}

// Drains and stops the context's streams, then frees what was allocated in it: native allocations,
// pinned host memory, IPC imports and modules. VMM memory belongs to no context and stays.
void teardown(Driver& d, CUctx_st* c) {
  retire_streams(d, c);
  free_context_memory(d, c);
  unload_context_modules(d, c);
}

}  // namespace

bool valid_device(Driver& d, int device) {
  return device >= 0 && device < d.cfg.device_count;
}

CUresult current_context(Driver& d, CUctx_st** out) {
  auto& s = stack(d);
  if (s.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  CUctx_st* c = s.back();
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  auto it = d.contexts.find(c);
  // Documented meaning of CONTEXT_IS_DESTROYED: destroyed, or a primary context not initialized.
  if (it == d.contexts.end() || !c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  *out = c;
  return CUDA_SUCCESS;
}

std::shared_ptr<CUctx_st> find_context(Driver& d, CUcontext c) {
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  auto it = d.contexts.find(c);
  return it == d.contexts.end() ? nullptr : it->second;
}

void ctx_stack_push(Driver& d, CUctx_st* c) {
  stack(d).push_back(c);
}

CUctx_st* ctx_stack_top(Driver& d) {
  auto& s = stack(d);
  return s.empty() ? nullptr : s.back();
}

CUresult ctx_stack_pop(Driver& d, CUctx_st** out) {
  auto& s = stack(d);
  if (s.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (out != nullptr) *out = s.back();
  s.pop_back();
  return CUDA_SUCCESS;
}

void ctx_stack_set(Driver& d, CUctx_st* c) {
  auto& s = stack(d);
  if (c == nullptr) {
    if (!s.empty()) s.pop_back();
  } else if (s.empty()) {
    s.push_back(c);
  } else {
    s.back() = c;
  }
}

void ctx_stack_remove(Driver& d, CUctx_st* c) {
  auto& s = stack(d);
  s.erase(std::remove(s.begin(), s.end(), c), s.end());
}

CUresult create_context(Driver& d, int device, unsigned flags, CUctx_st** out) {
  if (!valid_device(d, device)) return CUDA_ERROR_INVALID_DEVICE;
  auto c = std::make_shared<CUctx_st>();
  c->device = device;
  c->flags = flags;
  c->id = d.new_id();
  {
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    activate(d, c.get());
    d.contexts.emplace(c.get(), c);
    d.all_contexts.push_back(c);
  }
  ctx_stack_push(d, c.get());
  *out = c.get();
  return CUDA_SUCCESS;
}

CUresult destroy_context(Driver& d, CUcontext c) {
  {
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    auto it = d.contexts.find(c);
    if (it == d.contexts.end() || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    c->active = false;
    d.contexts.erase(it);
  }
  teardown(d, c);
  ctx_stack_remove(d, c);
  return CUDA_SUCCESS;
}

CUresult primary_retain(Driver& d, int device, CUctx_st** out) {
  if (!valid_device(d, device)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  CUctx_st*& p = d.primaries[static_cast<size_t>(device)];
  if (p == nullptr) {
    auto c = std::make_shared<CUctx_st>();
    c->device = device;
    c->primary = true;
    c->id = d.new_id();
    d.contexts.emplace(c.get(), c);
    d.all_contexts.push_back(c);
    p = c.get();
  }
  if (p->primary_refs++ == 0) activate(d, p);
  *out = p;
  return CUDA_SUCCESS;
}

CUresult primary_release(Driver& d, int device) {
  if (!valid_device(d, device)) return CUDA_ERROR_INVALID_DEVICE;
  CUctx_st* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    p = d.primaries[static_cast<size_t>(device)];
    if (p == nullptr || p->primary_refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--p->primary_refs > 0) return CUDA_SUCCESS;
    p->active = false;
  }
  teardown(d, p);
  return CUDA_SUCCESS;
}

CUresult primary_reset(Driver& d, int device) {
  if (!valid_device(d, device)) return CUDA_ERROR_INVALID_DEVICE;
  CUctx_st* p = nullptr;
  {
    std::lock_guard<std::mutex> lk(d.ctx_mu);
    p = d.primaries[static_cast<size_t>(device)];
    if (p == nullptr || !p->active) return CUDA_SUCCESS;
  }
  teardown(d, p);
  // Reset frees the context's state but keeps its retain count: users that still hold it get a
  // fresh, working context.
  std::lock_guard<std::mutex> lk(d.ctx_mu);
  if (p->primary_refs > 0) activate(d, p);
  return CUDA_SUCCESS;
}

}  // namespace simcuda
