// SPDX-License-Identifier: Apache-2.0
// The real driver behind the hooks: loading libcuda, resolving the hook table, and the lookup map the
// dlsym and cuGetProcAddress replacements use to hand out hooks instead of driver functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "hook_table.h"

namespace tmsdisk::shim {

enum class Variant : uint8_t { Any, Legacy, PerThread };
enum class Need : uint8_t { Required, Optional };

struct HookInfo {
  const char* name;  // exported symbol
  const char* base;  // name cuGetProcAddress is asked for
  int since;         // first cudaVersion at which `base` resolves to `name`
  Variant variant;
  Need need;
};

enum class HookId : int {
#define TMSDISK_X(name, ...) name,
  TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X
      Count
};
inline constexpr std::size_t kHookCount = static_cast<std::size_t>(HookId::Count);

inline constexpr std::array<HookInfo, kHookCount> kHooks = {{
#define TMSDISK_X(name, params, args, base, since, variant, need) {#name, base, since, Variant::variant, Need::need},
    TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X
}};

// The shim's implementations of the intercepted entry points (hooks.cpp exports them under the
// driver's names).
namespace hook {
#define TMSDISK_X(name, params, ...) CUresult name params noexcept;
TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X
}  // namespace hook

// Typed pointers to the real driver functions.
struct DriverApi {
#define TMSDISK_X(name, params, ...) CUresult(*name) params = nullptr;
  TMSDISK_HOOKS(TMSDISK_X)
  TMSDISK_DRIVER_CALLS(TMSDISK_X)
#undef TMSDISK_X
};

struct Driver {
  DriverApi api;
  std::array<void*, kHookCount> real{};  // real function behind each hook, by HookId (null if absent)
  bool usable = false;                   // every Required entry resolved: the shim manages memory
  void* handle = nullptr;                // libcuda, or null if it could not be loaded
};

// Loads libcuda (RTLD_NOW|RTLD_NODELETE|RTLD_LOCAL) and resolves the table on first call. When
// libcuda or a required symbol is missing it says so once and returns a driver with usable = false:
// hooks then pass everything through.
const Driver& driver() noexcept;

// Address of the shim's implementation of a hook.
void* hook_address(std::size_t index) noexcept;

// Index of the hook exported as `name`, or -1. Cheap: rejects names not starting with "cu" at once.
int find_hook(std::string_view name) noexcept;

// The entry of `table` that cuGetProcAddress(base, cuda_version, flags) selects, or -1. Only versions
// below kNameResolutionLimit are answered: a newer driver may have introduced another variant with
// another signature, and those are substituted only when the pointer itself identifies the function.
inline constexpr int kNameResolutionLimit = (CUDA_VERSION / 1000 + 1) * 1000;
int resolve_by_base(std::span<const HookInfo> table, std::string_view base, int cuda_version, uint64_t flags) noexcept;

// What cuGetProcAddress should return for `symbol` once the real resolver returned `found`.
void* substitute_proc(const char* symbol, void* found, int cuda_version, uint64_t flags) noexcept;

// The dlsym replacement: resolves like glibc (including RTLD_NEXT relative to `caller`), then hands
// out the hook when the result is the real driver function of a hooked symbol.
void* dlsym_hook(void* handle, const char* name, const void* caller) noexcept;

// glibc's own dlsym (dlvsym GLIBC_2.34, else GLIBC_2.2.5).
using DlsymFn = void* (*)(void*, const char*);
DlsymFn real_dlsym() noexcept;

// "CUDA_ERROR_..." for logs; never null.
const char* cu_error_name(CUresult r) noexcept;

// Re-entrancy guard: driver calls made by the shim (and everything on its control thread) must reach
// the real driver even when they come back through a hook.
class ReentryGuard {
 public:
  ReentryGuard() noexcept;
  ~ReentryGuard();
  ReentryGuard(const ReentryGuard&) = delete;
  ReentryGuard& operator=(const ReentryGuard&) = delete;
  bool nested() const noexcept { return nested_; }

 private:
  bool nested_;
};
// Marks the calling thread as the shim's own for its whole life.
void mark_shim_thread() noexcept;

// A hook: runs `body(driver)`, unless the shim must stay out of the way (a call from its own
// threads, the shim disabled): then the driver's own function `Real` gets `args` unchanged. Returns
// CUDA_ERROR_NOT_FOUND when this libcuda lacks `Real`. Example:
//   return intercept<&DriverApi::cuMemUnmap>([&](const Driver& d) -> CUresult { ... }, ptr, size);
template <auto Real, typename Body, typename... Args>
CUresult intercept(Body&& body, Args... args) noexcept {
  ReentryGuard guard;
  const Driver& d = driver();
  const auto real = d.api.*Real;
  if (!real) return CUDA_ERROR_NOT_FOUND;
  if (guard.nested() || !d.usable) return real(args...);
  return body(d);
}

// The hook's own work, which may throw (allocation, locks): no exception leaves a hook, any becomes
// `on_failure`.
template <typename Fn>
CUresult no_throw(CUresult on_failure, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (...) {
    return on_failure;
  }
}

// Bookkeeping after the driver call succeeded: if it fails (out of memory), the call still
// succeeds; only what the shim tracks about it is lost.
template <typename Fn>
void best_effort(Fn&& fn) noexcept {
  try {
    fn();
  } catch (...) {
  }
}

// Makes `ctx` current on the calling thread for one scope (push/pop, so the caller's own current
// context is untouched).
class CtxScope {
 public:
  CtxScope(const DriverApi& api, CUcontext ctx) noexcept : api_(api) {
    ok_ = api.cuCtxPushCurrent_v2(ctx) == CUDA_SUCCESS;
  }
  ~CtxScope() {
    if (ok_) {
      CUcontext popped;
      api_.cuCtxPopCurrent_v2(&popped);
    }
  }
  CtxScope(const CtxScope&) = delete;
  CtxScope& operator=(const CtxScope&) = delete;
  bool ok() const noexcept { return ok_; }

 private:
  const DriverApi& api_;
  bool ok_;
};

}  // namespace tmsdisk::shim
