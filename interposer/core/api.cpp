// SPDX-License-Identifier: Apache-2.0
// The in-process C API (tmsdisk.h) and one-time initialization.
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "api_outcome.h"
#include "config.h"
#include "driver.h"
#include "engine.h"
#include "log.h"
#include "pause_callbacks.h"
#include "registry.h"
#include "shim.h"
#include "tags.h"
#include "vmm.h"

#ifndef TMSDISK_VERSION
#define TMSDISK_VERSION "unknown"
#endif

namespace tmsdisk::shim {

namespace {

void start_engine() noexcept {
  if (Engine* e = Engine::instance()) e->ensure_started();
}

}  // namespace

void ensure_init() noexcept {
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      // Fork children drop the parent's session and reconnect lazily (Engine::fork_child).
      if (int rc = ::pthread_atfork(&Engine::fork_prepare, &Engine::fork_parent, &Engine::fork_child); rc != 0)
        TMS_WARN("pthread_atfork failed: %s; fork children may inherit a broken session", std::strerror(rc));
      (void)config();
      vmm_on_managed(&start_engine);
    });
  } catch (...) {
  }
}

namespace {

int run(proto::CommandOp op, uint8_t flags = 0, const char* tag = nullptr) noexcept {
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return -ENOMEM;
  try {
    const Status done = e->run(op, flags, tag ? std::string(tag) : std::string());
    return done ? 0 : -done.error().errnum();
  } catch (...) {
    return -ENOMEM;
  }
}

}  // namespace

int api_pause() noexcept {
  return run(proto::CommandOp::Pause);
}
int api_resume() noexcept {
  return run(proto::CommandOp::Resume);
}
int api_resume_accept_loss() noexcept {
  return run(proto::CommandOp::Resume, proto::kAcceptLoss);
}

int api_status(struct tmsdisk_status* status, std::size_t size) noexcept {
  if (!status) return -EINVAL;
  try {
    struct tmsdisk_status out {};
    EngineStatus s;
    if (Engine* e = Engine::existing()) {
      s = e->status();
    } else {
      s.totals = registry().totals();
    }
    out.state = s.stats.state;
    out.connected = s.connected ? 1 : 0;
    out.enabled = driver().usable ? 1 : 0;
    out.managed_allocations = s.totals.managed_allocations;
    out.paused_allocations = s.totals.paused_allocations;
    out.last_error = s.last_error;
    out.session_id = s.session_id;
    out.resident_bytes = s.totals.resident_bytes;
    out.paused_bytes = s.totals.paused_bytes;
    for (std::size_t i = 0; i < TMSDISK_UNMANAGED_REASONS && i < s.totals.unmanaged_bytes.size(); ++i)
      out.unmanaged_bytes[i] = s.totals.unmanaged_bytes[i];
    out.last_pause_bytes = s.stats.last_pause_bytes;
    out.last_pause_ns = s.stats.last_pause_ns;
    out.last_resume_bytes = s.stats.last_resume_bytes;
    out.last_resume_ns = s.stats.last_resume_ns;
    out.damaged_allocations = s.totals.damaged_allocations;
    out.damaged_bytes = s.totals.damaged_bytes;
    const std::size_t n = std::min(s.last_message.size(), sizeof(out.last_message) - 1);
    std::memcpy(out.last_message, s.last_message.data(), n);
    std::memcpy(status, &out, std::min(size, sizeof(out)));
    return 0;
  } catch (...) {
    return -ENOMEM;
  }
}

int api_set_backup_dir(const char* path) noexcept {
  if (!path || !*path) return -EINVAL;
  ensure_init();
  Engine* e = Engine::instance();
  if (!e) return -ENOMEM;
  try {
    return api_outcome(e->set_backup_dir(path), "tmsdisk_set_backup_dir");
  } catch (...) {
    return -ENOMEM;
  }
}

int api_on_pause(void (*callback)(void* arg), void* arg) noexcept {
  // Registration only: no thread, no session. The first pause (which starts the engine) runs it.
  return add_pause_callback(callback, arg);
}

int api_tag_push(const char* tag, int policy) noexcept {
  return push_tag(tag, policy);
}
int api_tag_pop() noexcept {
  return pop_tag();
}
int api_pause_tag(const char* tag) noexcept {
  if (tag && !valid_tag_name(tag)) return -EINVAL;
  return run(proto::CommandOp::Pause, 0, tag);
}
int api_resume_tag(const char* tag) noexcept {
  if (tag && !valid_tag_name(tag)) return -EINVAL;
  return run(proto::CommandOp::Resume, 0, tag);
}
int api_resume_tag_accept_loss(const char* tag) noexcept {
  if (tag && !valid_tag_name(tag)) return -EINVAL;
  return run(proto::CommandOp::Resume, proto::kAcceptLoss, tag);
}

int api_tags(struct tmsdisk_tag_info* out, std::size_t count, std::size_t size) noexcept {
  if ((count && !out) || (count && size == 0)) return -EINVAL;
  try {
    const std::vector<TagTotals> totals = registry().tag_totals();
    std::vector<struct tmsdisk_tag_info> found(totals.size());
    for (std::size_t i = 0; i < totals.size(); ++i) {
      tmsdisk_tag_info& t = found[i];
      t.policy = static_cast<uint32_t>(totals[i].policy);
      t.allocations = totals[i].allocations;
      t.paused_allocations = totals[i].paused_allocations;
      t.resident_bytes = totals[i].resident_bytes;
      t.paused_bytes = totals[i].paused_bytes;
      const std::string name = tag_name(totals[i].tag);
      std::memcpy(t.tag, name.data(), std::min(name.size(), sizeof(t.tag) - 1));
    }
    for (std::size_t i = 0; i < found.size() && i < count; ++i) {
      std::memcpy(reinterpret_cast<char*>(out) + i * size, &found[i], std::min(size, sizeof(found[i])));
    }
    return static_cast<int>(std::min<std::size_t>(found.size(), INT32_MAX));
  } catch (...) {
    return -ENOMEM;
  }
}

const char* api_version() noexcept {
  return "tmsdisk " TMSDISK_VERSION;
}

}  // namespace tmsdisk::shim
