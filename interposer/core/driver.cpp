// SPDX-License-Identifier: Apache-2.0
// Real-driver resolution and the lookup map behind the dlsym and cuGetProcAddress replacements.
#include "driver.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "log.h"

namespace tmsdisk::shim {
namespace {

thread_local int t_depth __attribute__((tls_model("initial-exec"))) = 0;

struct NameIndex {
  std::string_view name;
  int index;
};

constexpr auto make_sorted_names() {
  std::array<NameIndex, kHookCount> out{};
  for (std::size_t i = 0; i < kHookCount; ++i) out[i] = {kHooks[i].name, static_cast<int>(i)};
  std::sort(out.begin(), out.end(), [](const NameIndex& a, const NameIndex& b) { return a.name < b.name; });
  return out;
}
constexpr auto kSortedNames = make_sorted_names();

void load(Driver& d) {
  ReentryGuard guard;  // libcuda's constructors may call dlsym: those calls must not re-enter here
  DlsymFn sym = real_dlsym();
  if (!sym) {
    TMS_ERROR("cannot find glibc's dlsym; tmsdisk is disabled and passes every call through");
    return;
  }
  d.handle = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NODELETE | RTLD_LOCAL);
  if (!d.handle) {
    const char* why = ::dlerror();
    TMS_WARN("cannot load libcuda.so.1 (%s); tmsdisk is disabled and passes every call through", why ? why : "?");
    return;
  }
  char missing[512];
  std::size_t used = 0;
  missing[0] = '\0';
  auto note_missing = [&](const char* name) {
    int n = std::snprintf(missing + used, sizeof(missing) - used, "%s%s", used ? ", " : "", name);
    if (n > 0) used = std::min(sizeof(missing) - 1, used + static_cast<std::size_t>(n));
  };
  bool ok = true;
#define TMSDISK_X(name, params, args, base, since, variant, need)                       \
  d.api.name = reinterpret_cast<decltype(d.api.name)>(sym(d.handle, #name));            \
  d.real[static_cast<std::size_t>(HookId::name)] = reinterpret_cast<void*>(d.api.name); \
  if (!d.api.name && Need::need == Need::Required) {                                    \
    ok = false;                                                                         \
    note_missing(#name);                                                                \
  }
  TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X
#define TMSDISK_X(name, params, need)                                        \
  d.api.name = reinterpret_cast<decltype(d.api.name)>(sym(d.handle, #name)); \
  if (!d.api.name && Need::need == Need::Required) {                         \
    ok = false;                                                              \
    note_missing(#name);                                                     \
  }
  TMSDISK_DRIVER_CALLS(TMSDISK_X)
#undef TMSDISK_X
  (void)::dlerror();  // our failed look-ups must not show up in the host's dlerror()
  d.usable = ok;
  if (!ok) {
    TMS_ERROR("libcuda.so.1 lacks %s; tmsdisk is disabled and passes every call through", missing);
  } else {
    TMS_DEBUG("libcuda.so.1 resolved; %zu hooks active", kHookCount);
  }
}

// Objects in load order, as dl_iterate_phdr reports them (fixed array: this path must not allocate,
// since a preloaded malloc may resolve its own successor with dlsym(RTLD_NEXT, "malloc")).
struct LoadedObject {
  ElfW(Addr) addr;
  const char* name;
};
struct ObjectList {
  LoadedObject* objects;
  int count;
  int capacity;
};

int collect_object(dl_phdr_info* info, std::size_t, void* data) {
  auto* list = static_cast<ObjectList*>(data);
  if (list->count < list->capacity) list->objects[list->count++] = {info->dlpi_addr, info->dlpi_name};
  return 0;
}

// RTLD_NEXT relative to `caller`, not to the shim: glibc takes "next" from the return address, which
// inside this replacement would be ours. Walks the objects loaded after the caller's and returns the
// first definition that lives in the object being searched. Differs from glibc only for objects
// opened with RTLD_LOCAL after the caller (glibc skips them).
void* next_symbol(DlsymFn real, const char* name, const void* caller) {
  Dl_info info;
  link_map* caller_map = nullptr;
  if (!caller || !::dladdr1(caller, &info, reinterpret_cast<void**>(&caller_map), RTLD_DL_LINKMAP) || !caller_map)
    return real(RTLD_NEXT, name);
  LoadedObject objects[512];
  ObjectList list{objects, 0, 512};
  ::dl_iterate_phdr(collect_object, &list);
  int start = -1;
  for (int i = 0; i < list.count; ++i) {
    if (objects[i].addr == caller_map->l_addr && objects[i].name == caller_map->l_name) {
      start = i;
      break;
    }
  }
  if (start < 0) return real(RTLD_NEXT, name);
  for (int i = start + 1; i < list.count; ++i) {
    const char* object_name = objects[i].name;
    if (!object_name || !*object_name) continue;
    void* h = ::dlopen(object_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) continue;
    void* found = real(h, name);
    void* result = nullptr;
    if (found) {
      Dl_info where;
      link_map* owner = nullptr;
      // A definition found in one of this object's dependencies is that dependency's, which comes
      // up in its own turn (or came before the caller and must be skipped).
      if (!::dladdr1(found, &where, reinterpret_cast<void**>(&owner), RTLD_DL_LINKMAP) || !owner ||
          owner->l_addr == objects[i].addr)
        result = found;
    }
    ::dlclose(h);
    if (result) {
      (void)::dlerror();
      return result;
    }
  }
  return nullptr;  // dlerror() holds the last "undefined symbol" message
}

}  // namespace

ReentryGuard::ReentryGuard() noexcept : nested_(t_depth++ > 0) {}
ReentryGuard::~ReentryGuard() {
  --t_depth;
}
void mark_shim_thread() noexcept {
  ++t_depth;
}

DlsymFn real_dlsym() noexcept {
  static std::atomic<DlsymFn> cached{nullptr};
  DlsymFn fn = cached.load(std::memory_order_acquire);
  if (fn) return fn;
  for (const char* version : {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"}) {
    fn = reinterpret_cast<DlsymFn>(::dlvsym(RTLD_NEXT, "dlsym", version));
    if (fn) break;
  }
  (void)::dlerror();
  cached.store(fn, std::memory_order_release);
  return fn;
}

const Driver& driver() noexcept {
  static std::once_flag once;
  static Driver d;  // constant-initialized, trivially destructible
  try {
    std::call_once(once, [] { load(d); });
  } catch (...) {
    // call_once throws only when the system cannot create its synchronization: stay disabled.
  }
  return d;
}

void* hook_address(std::size_t index) noexcept {
  switch (static_cast<HookId>(index)) {
#define TMSDISK_X(name, ...) \
  case HookId::name: return reinterpret_cast<void*>(&hook::name);
    TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X
    default: return nullptr;
  }
}

int find_hook(std::string_view name) noexcept {
  if (name.size() < 2 || name[0] != 'c' || name[1] != 'u') return -1;
  auto it = std::lower_bound(kSortedNames.begin(), kSortedNames.end(), name,
                             [](const NameIndex& e, std::string_view n) { return e.name < n; });
  return it != kSortedNames.end() && it->name == name ? it->index : -1;
}

int resolve_by_base(std::span<const HookInfo> table, std::string_view base, int cuda_version, uint64_t flags) noexcept {
  if (cuda_version >= kNameResolutionLimit) return -1;
  const bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  int best = -1;
  for (std::size_t i = 0; i < table.size(); ++i) {
    const HookInfo& h = table[i];
    if (base != h.base || cuda_version < h.since) continue;
    // Per-thread requests fall back to the legacy function where no per-thread twin exists (as the
    // driver does); legacy requests never get a per-thread one.
    if (h.variant == Variant::PerThread && !per_thread) continue;
    // The newest variant introduced at or before the requested version wins; at equal versions a
    // per-thread request prefers the per-thread twin.
    if (best < 0 || h.since > table[best].since || (h.since == table[best].since && h.variant == Variant::PerThread))
      best = static_cast<int>(i);
  }
  return best;
}

void* substitute_proc(const char* symbol, void* found, int cuda_version, uint64_t flags) noexcept {
  if (!symbol || !found) return found;
  const Driver& d = driver();
  if (!d.usable) return found;
  for (std::size_t i = 0; i < kHookCount; ++i) {
    if (d.real[i] == found) return hook_address(i);
  }
  // The driver may hand out internal entry points rather than its exported symbols: fall back to
  // the table's knowledge of which variant the base name selects at this version.
  int i = resolve_by_base(kHooks, symbol, cuda_version, flags);
  if (i >= 0 && d.real[static_cast<std::size_t>(i)]) {
    TMS_DEBUG("cuGetProcAddress(%s, %d, %llu): substituting %s by name", symbol, cuda_version,
              static_cast<unsigned long long>(flags), kHooks[static_cast<std::size_t>(i)].name);
    return hook_address(static_cast<std::size_t>(i));
  }
  return found;
}

void* dlsym_hook(void* handle, const char* name, const void* caller) noexcept {
  DlsymFn real = real_dlsym();
  if (!real) return nullptr;
  void* found = handle == RTLD_NEXT ? next_symbol(real, name, caller) : real(handle, name);
  if (!found || !name || t_depth > 0) return found;
  const int i = find_hook(name);
  if (i < 0) return found;
  const Driver& d = driver();
  if (d.usable && d.real[static_cast<std::size_t>(i)] == found) return hook_address(static_cast<std::size_t>(i));
  return found;
}

const char* cu_error_name(CUresult r) noexcept {
  const char* name = nullptr;
  const Driver& d = driver();
  if (d.api.cuGetErrorName && d.api.cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA_ERROR_UNKNOWN";
}

}  // namespace tmsdisk::shim
