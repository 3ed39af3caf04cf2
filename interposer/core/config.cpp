// SPDX-License-Identifier: Apache-2.0
// Environment settings of the shim (config.h).
#include "config.h"

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <optional>

#include "log.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {
namespace {

const char* env(const char* name) noexcept {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// A size from the environment in units of 2^`shift` bytes, as bytes; `fallback` when unset. A value
// that is not a plain integer, or does not fit in 64 bits as bytes, is refused: said once, and the
// fallback is used, so a typo never sizes anything.
uint64_t env_size(const char* name, unsigned shift, const char* unit, uint64_t fallback) {
  const char* text = env(name);
  if (!text) return fallback;
  const std::optional<uint64_t> v = parse_plain_integer(text);
  if (v && *v <= (UINT64_MAX >> shift)) return *v << shift;
  TMS_ERROR("%s=%s is refused: it must be a plain integer number of %s (no sign, suffix or spaces); using %s", name,
            text, unit, fallback ? std::to_string(fallback >> shift).c_str() : "the daemon's default");
  return fallback;
}

Config* load() {
  auto* c = new Config;  // never freed: hooks may run during static destruction
  c->min_bytes = env_size("TMSDISK_MIN_BYTES", 0, "bytes", kDefaultMinBytes);
  const char* sock = env("TMSDISK_SOCKET");
  c->socket_path = sock ? sock : kSystemSocket;
  c->socket_explicit = sock != nullptr;
  c->private_socket = private_socket_path();
  const char* job = nullptr;
  for (const char* name : {"TMSDISK_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RAY_JOB_ID"}) {
    if ((job = env(name))) break;
  }
  c->job = sanitize_job(job ? job : "default");
  c->rank = parse_rank(env("RANK"));
  if (c->rank < 0) c->rank = parse_rank(env("SLURM_PROCID"));
  if (const char* dir = env("TMS_DISK_BACKUP_DIR")) c->backup_dir = dir;
  c->staging_budget_bytes = env_size("TMS_DISK_BACKUP_CHUNK_MB", 20, "MiB", 0);
  bool valid = true;
  const char* touch = env("TMSDISK_ON_TOUCH");
  c->on_touch = parse_on_touch(touch, &valid);
  if (!valid) TMS_WARN("TMSDISK_ON_TOUCH=%s is not wait, resume or fail; using wait", touch);
  if (const char* scan = env("TMSDISK_ZERO_SCAN")) {
    c->zero_scan = std::string_view(scan) != "0";
    if (std::string_view(scan) != "0" && std::string_view(scan) != "1")
      TMS_WARN("TMSDISK_ZERO_SCAN=%s is not 0 or 1; scanning for zero chunks", scan);
  }
  if (const char* tier = env("TMSDISK_HOST_TIER")) {
    c->host_tier = std::string_view(tier) != "0";
    if (std::string_view(tier) != "0" && std::string_view(tier) != "1")
      TMS_WARN("TMSDISK_HOST_TIER=%s is not 0 or 1; using the node's host tier", tier);
  }
  if (const char* tier = env("TMSDISK_STORE_HOST_TIER")) {
    c->store_host_tier = std::string_view(tier) != "0";
    if (std::string_view(tier) != "0" && std::string_view(tier) != "1")
      TMS_WARN("TMSDISK_STORE_HOST_TIER=%s is not 0 or 1; objects use the node's host tier", tier);
  }
  if (const char* text = env("TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS")) {
    const std::optional<uint64_t> ms = parse_plain_integer(text);
    if (ms && *ms <= static_cast<uint64_t>(std::numeric_limits<int>::max()))
      c->pause_callback_timeout_ms = static_cast<int>(*ms);
    else
      TMS_ERROR(
          "TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS=%s is refused: it must be a plain integer number of milliseconds; "
          "using %d",
          text, kDefaultPauseCallbackTimeoutMs);
  }
  return c;
}

}  // namespace

const Config& config() noexcept {
  static std::once_flag once;
  static Config* cfg = nullptr;
  std::call_once(once, [] {
    try {
      cfg = load();
    } catch (...) {
      static Config fallback;  // out of memory at startup: defaults, no job name
      cfg = &fallback;
    }
    TMS_DEBUG("config: min_bytes=%llu socket=%s job=%s rank=%lld staging_budget_bytes=%llu on_touch=%d",
              static_cast<unsigned long long>(cfg->min_bytes), cfg->socket_path.c_str(), cfg->job.c_str(),
              static_cast<long long>(cfg->rank), static_cast<unsigned long long>(cfg->staging_budget_bytes),
              static_cast<int>(cfg->on_touch));
  });
  return *cfg;
}

OnTouch parse_on_touch(const char* text, bool* valid) noexcept {
  *valid = true;
  if (!text || !*text) return OnTouch::Wait;
  const std::string_view t = text;
  if (t == "wait") return OnTouch::Wait;
  if (t == "resume") return OnTouch::Resume;
  if (t == "fail") return OnTouch::Fail;
  *valid = false;
  return OnTouch::Wait;
}

int64_t parse_rank(const char* text) noexcept {
  if (!text || !*text || *text == '-') return -1;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < 0) return -1;
  return v;
}

std::string sanitize_job(std::string_view job) {
  std::string out;
  for (char ch : job) {
    if (out.size() == proto::kMaxNameLength) break;
    out.push_back(proto::job_name_char(ch) ? ch : '_');
  }
  if (!out.empty() && out[0] == '.') out[0] = '_';
  if (out.empty()) out = "default";
  return out;
}

}  // namespace tmsdisk::shim
