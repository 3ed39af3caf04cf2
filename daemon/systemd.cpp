// SPDX-License-Identifier: Apache-2.0
// libsystemd's sd_notify and sd_listen_fds, resolved once with dlopen (see systemd.h).
#include "systemd.h"

#include <dlfcn.h>

#include <mutex>

namespace tmsdisk::systemd {
namespace {

struct Api {
  int (*notify)(int, const char*) = nullptr;
  int (*listen_fds)(int) = nullptr;
};

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = ::dlopen("libsystemd.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    a.notify = reinterpret_cast<int (*)(int, const char*)>(::dlsym(lib, "sd_notify"));
    a.listen_fds = reinterpret_cast<int (*)(int)>(::dlsym(lib, "sd_listen_fds"));
  });
  return a;
}

}  // namespace

void notify(const char* state) noexcept {
  if (api().notify) api().notify(0, state);
}

int listen_fds() noexcept {
  return api().listen_fds ? api().listen_fds(1) : 0;
}

}  // namespace tmsdisk::systemd
