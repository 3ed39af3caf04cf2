// SPDX-License-Identifier: Apache-2.0
// Environment settings of the shim (config.h).
#include "config.h"

#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "log.h"
#include "tmsdisk/common/paths.h"

namespace tmsdisk::shim {
namespace {

const char* env(const char* name) noexcept {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

Config* load() {
  auto* c = new Config;  // never freed: hooks may run during static destruction
  c->min_bytes = parse_bytes(env("TMSDISK_MIN_BYTES"), kDefaultMinBytes);
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
  const uint64_t mb = parse_bytes(env("TMS_DISK_BACKUP_CHUNK_MB"), 0);
  c->staging_bytes = mb > (UINT64_MAX >> 20) ? 0 : mb << 20;
  bool valid = true;
  const char* touch = env("TMSDISK_ON_TOUCH");
  c->on_touch = parse_on_touch(touch, &valid);
  if (!valid) TMS_WARN("TMSDISK_ON_TOUCH=%s is not wait, resume or fail; using wait", touch);
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
    TMS_DEBUG("config: min_bytes=%llu socket=%s job=%s rank=%lld staging_bytes=%llu on_touch=%d",
              static_cast<unsigned long long>(cfg->min_bytes), cfg->socket_path.c_str(), cfg->job.c_str(),
              static_cast<long long>(cfg->rank), static_cast<unsigned long long>(cfg->staging_bytes),
              static_cast<int>(cfg->on_touch));
  });
  return *cfg;
}

uint64_t parse_bytes(const char* text, uint64_t fallback) noexcept {
  if (!text || !*text) return fallback;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text || *text == '-') return fallback;
  unsigned shift = 0;
  switch (*end) {
    case '\0': break;
    case 'k':
    case 'K':
      shift = 10;
      ++end;
      break;
    case 'm':
    case 'M':
      shift = 20;
      ++end;
      break;
    case 'g':
    case 'G':
      shift = 30;
      ++end;
      break;
    default: return fallback;
  }
  if (shift && (*end == 'i' || *end == 'I')) ++end;
  if (shift && (*end == 'b' || *end == 'B')) ++end;
  if (*end != '\0') return fallback;
  if (shift && v > (UINT64_MAX >> shift)) return fallback;
  return static_cast<uint64_t>(v) << shift;
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
    if (out.size() == 64) break;
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
                    ch == '_' || ch == '-';
    out.push_back(ok ? ch : '_');
  }
  if (!out.empty() && out[0] == '.') out[0] = '_';
  if (out.empty()) out = "default";
  return out;
}

}  // namespace tmsdisk::shim
