// SPDX-License-Identifier: Apache-2.0
// The rank's figures, state and reports to tmsdiskd (rank_report.h).
#include "rank_report.h"

#include <time.h>

#include <algorithm>

#include "tags.h"

namespace tmsdisk::shim {
namespace {

constexpr int kReportIntervalMs = 1000;

uint64_t unix_ms() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000ull + static_cast<uint64_t>(ts.tv_nsec) / 1000000ull;
}

// Between operations the state follows the registry: a free of the last paused allocation makes a
// paused rank running without any pause or resume. During one, the operation's own state stands.
uint8_t current_state(uint8_t last, const RegistryTotals& t) {
  const auto s = static_cast<proto::RankState>(last);
  if (s == proto::RankState::Pausing || s == proto::RankState::Resuming) return last;
  return static_cast<uint8_t>(settled_state(t));
}

}  // namespace

proto::RankState settled_state(const RegistryTotals& t) noexcept {
  if (t.paused_allocations == 0) return proto::RankState::Running;
  return t.paused_allocations == t.managed_allocations ? proto::RankState::Paused : proto::RankState::PartiallyPaused;
}

EngineStatus RankReport::status() const {
  EngineStatus s;
  s.totals = registry().totals();
  std::lock_guard lock(mu_);
  s.stats = last_;
  s.connected = connected_;
  s.session_id = session_id_;
  s.last_error = last_error_;
  s.last_message = last_message_;
  s.stats.state = current_state(s.stats.state, s.totals);
  s.stats.resident_bytes = s.totals.resident_bytes;
  s.stats.paused_bytes = s.totals.paused_bytes;
  s.stats.damaged_allocations = s.totals.damaged_allocations;
  s.stats.damaged_bytes = s.totals.damaged_bytes;
  s.stats.unmanaged_bytes = s.totals.unmanaged_bytes;
  s.stats.managed_allocations = s.totals.managed_allocations;
  return s;
}

void RankReport::set_state(proto::RankState s) {
  std::lock_guard lock(mu_);
  last_.state = static_cast<uint8_t>(s);
}

void RankReport::record(bool pausing, const OpResult& r) {
  const proto::RankState state = settled_state(registry().totals());
  {
    std::lock_guard lock(mu_);
    last_.state = static_cast<uint8_t>(state);
    // A no-op changed nothing: the last pause and resume figures stay those of operations that ran
    // (a repeated `tmsctl pause` must not turn them to zeros), and so does the time of the last change,
    // which says since when the rank is in its state. A failure counts as a change: it may have
    // released part of the memory. last_error_ and last_message_ are what the latest call said,
    // no-op or not (tmsdisk_status documents them so).
    if (r.outcome == proto::Outcome::Done) {
      if (r.code() == 0 && pausing) {
        last_.last_pause_bytes = r.bytes;
        last_.last_pause_ns = r.nanos;
        last_.last_pause_skipped = r.skipped;
      } else if (r.code() == 0) {
        last_.last_resume_bytes = r.bytes;
        last_.last_resume_ns = r.nanos;
        last_.last_resume_skipped = r.skipped;
      }
      last_.last_change_unix_ms = unix_ms();
    }
    last_error_ = r.code();
    last_message_ = r.message();
  }
}

void RankReport::session_opened(uint64_t session_id) {
  std::lock_guard lock(mu_);
  connected_ = true;
  session_id_ = session_id;
}

void RankReport::session_closed() {
  std::lock_guard lock(mu_);
  connected_ = false;
  session_id_ = 0;
}

void RankReport::send() {
  reported_version_ = registry().version();
  last_report_ms_ = now_ms();
  proto::Report r;
  r.stats = make_stats();
  (void)session_.send(session_.next_id(), r);
}

void RankReport::send_if_due() {
  if (session_.connected() && registry().version() != reported_version_ &&
      now_ms() - last_report_ms_ >= kReportIntervalMs)
    send();
}

proto::RankStats RankReport::make_stats() const {
  const RegistryTotals t = registry().totals();
  proto::RankStats s;
  {
    std::lock_guard lock(mu_);
    s = last_;
  }
  s.state = current_state(s.state, t);
  s.resident_bytes = t.resident_bytes;
  s.paused_bytes = t.paused_bytes;
  s.unmanaged_bytes = t.unmanaged_bytes;
  s.managed_allocations = t.managed_allocations;
  s.damaged_allocations = t.damaged_allocations;
  s.damaged_bytes = t.damaged_bytes;
  s.damaged.clear();
  if (t.damaged_allocations) {
    for (const auto& a : registry().snapshot()) {  // address order: the first ones by address
      if (s.damaged.size() == proto::kMaxDamagedRanges) break;
      const uint8_t reason = a->damage.load();
      if (a->state.load() != AllocState::Paused || reason == 0) continue;
      s.damaged.push_back({.address = a->base, .size = a->size, .reason = reason, .chunk = a->damaged_chunk.load()});
    }
    // The registry may have changed between the two looks: keep the report consistent.
    s.damaged_allocations = std::max<uint32_t>(s.damaged_allocations, static_cast<uint32_t>(s.damaged.size()));
  }
  s.tags.clear();
  for (const TagTotals& t : registry().tag_totals()) {
    if (s.tags.size() == proto::kMaxTagsReported) break;
    s.tags.push_back({.tag = tag_name(t.tag),
                      .policy = static_cast<uint8_t>(t.policy),
                      .resident_bytes = t.resident_bytes,
                      .paused_bytes = t.paused_bytes});
  }
  return s;
}

}  // namespace tmsdisk::shim
