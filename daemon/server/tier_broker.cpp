// SPDX-License-Identifier: Apache-2.0
// The node's host-memory tier at run time (tier_broker.h).
#include "tier_broker.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <set>
#include <utility>

#include "chunk_io.h"
#include "tmsdisk/common/human.h"

namespace tmsdisk::server {

namespace {

uint64_t whole_chunks(uint64_t bytes, uint32_t chunk) {
  return chunk ? (bytes + chunk - 1) / chunk * chunk : 0;
}

// Whether some session counts the memory file (st_dev, st_ino) already, for its pauses or an object.
bool counted_anywhere(const std::map<uint64_t, Session>& sessions, dev_t dev, ino_t ino) {
  const auto same = [&](const TierMemory& m) { return m.bytes && m.dev == dev && m.ino == ino; };
  for (const auto& [id, s] : sessions) {
    if (same(s.host_tier)) return true;
    for (const auto& [name, memory] : s.object_memory)
      if (same(memory)) return true;
  }
  return false;
}

}  // namespace

FairShare TierBroker::share_of(uid_t uid) const {
  std::set<uid_t> users;
  std::size_t ranks = 0;
  for (const auto& [id, s] : sessions_.all()) {
    users.insert(s.cred.uid);
    ranks += s.cred.uid == uid;
  }
  return fair_share(budget(), users.size(), ranks);
}

FairShare TierBroker::pause_share_of(const Session& s) const {
  FairShare share = share_of(s.cred.uid);
  share.bytes = sub_floor(share.bytes, object_host_bytes(s));
  return share;
}

TierPlan TierBroker::plan_for(const Session& s, uint64_t bytes) const {
  const SpareMemory spare = budget() ? spare_memory() : SpareMemory{};
  // What `s` holds itself is not another rank's: it is what the rank would give up for this grant.
  return plan_grant(bytes, s.staging->chunk_bytes(), budget(), sessions_.host_tier_used() - s.host_tier.bytes,
                    pause_share_of(s), spare);
}

uint64_t TierBroker::fair_ask(const Session& s, uint64_t bytes) const {
  const uint32_t chunk = s.staging->chunk_bytes();
  const uint64_t fair = pause_share_of(s).bytes / chunk * chunk;
  return std::min(whole_chunks(bytes, chunk), fair);
}

bool TierBroker::waits(uint64_t session_id) const {
  return std::any_of(waiting_.begin(), waiting_.end(), [&](const Waiting& w) { return w.session_id == session_id; });
}

void TierBroker::ask(Session& s, uint64_t request_id, uint64_t bytes, uint8_t flags) {
  if (s.host_tier_pending || waits(s.id))
    return send_(s.conn_id, request_id, error_reply(EBUSY, "a host-tier ask of this rank is already being served"), -1);
  if (s.host_tier.bytes && !s.host_tier_kept)
    return send_(s.conn_id, request_id,
                 error_reply(EBUSY, "this rank's host-tier memory holds paused chunks: resume them first"), -1);
  if (flags & proto::kTierAskAhead) return ask_ahead(s, request_id, bytes);
  // Pausing: what the rank kept is in use again, and no longer anyone else's to reclaim.
  s.host_tier_kept = false;
  s.host_tier_reclaimed = false;
  TierPlan plan = plan_for(s, bytes);
  if (const uint64_t held = s.host_tier.bytes) {
    // Reused while it is no less than the rank could get now and no more than its fair share: making
    // and pinning it again is what keeping it saves.
    if (held >= plan.bytes && held <= pause_share_of(s).bytes) {
      spdlog::debug("session {}: reuses the {} of host-tier memory it kept", s.id, human_bytes(held));
      return send_(s.conn_id, request_id,
                   proto::TierGrant{.bytes = held,
                                    .note = {},
                                    .flags = static_cast<uint8_t>(proto::kTierReuse | (keep_ ? proto::kTierKeep : 0))},
                   -1);
    }
    spdlog::info("session {}: holds {} of host-tier memory, its share is now {}: release it and ask again", s.id,
                 human_bytes(held), human_bytes(plan.bytes));
    s.host_tier_releasing = true;
    return send_(s.conn_id, request_id, proto::TierGrant{.bytes = 0, .note = {}, .flags = proto::kTierReleaseFirst},
                 -1);
  }
  const uint64_t fair = fair_ask(s, bytes);
  if (plan.bytes < fair && reclaim(s, fair - plan.bytes)) {
    waiting_.push_back({.session_id = s.id,
                        .conn_id = s.conn_id,
                        .request_id = request_id,
                        .bytes = bytes,
                        .deadline = std::chrono::steady_clock::now() + kReclaimWait});
    return;
  }
  grant(s, request_id, std::move(plan), bytes);
}

void TierBroker::ask_ahead(Session& s, uint64_t request_id, uint64_t bytes) {
  if (!ahead_) {
    const char* why = keep_ ? "host-tier-ahead is off: host-tier memory is made at the first pause"
                            : "host-tier-keep is off: host-tier memory is made at each pause";
    spdlog::info("session {}: asked for host-tier memory ahead of a pause; none: {}", s.id, why);
    return send_(s.conn_id, request_id, proto::TierGrant{.bytes = 0, .note = why}, -1);
  }
  TierPlan plan = plan_for(s, bytes);
  if (const uint64_t held = s.host_tier.bytes) {
    // Kept already: enough for now, or to be made again larger (the rank releases, then asks again).
    // Asked back meanwhile (a TIER_RECLAIM crossed this ask, and the rank forgets it once answered):
    // released as the reclaim asks, or a pausing rank would wait for it in vain.
    if (held >= plan.bytes && !s.host_tier_reclaimed)
      return send_(s.conn_id, request_id,
                   proto::TierGrant{
                       .bytes = held, .note = {}, .flags = static_cast<uint8_t>(proto::kTierReuse | proto::kTierKeep)},
                   -1);
    s.host_tier_releasing = true;
    return send_(s.conn_id, request_id, proto::TierGrant{.bytes = 0, .note = {}, .flags = proto::kTierReleaseFirst},
                 -1);
  }
  // The rank runs: once made, its memory is kept (reclaimable) from the start (see built()).
  s.host_tier_reclaimed = false;
  grant(s, request_id, std::move(plan), bytes, /*ahead=*/true);
}

bool TierBroker::reclaim(const Session& asker, uint64_t short_by) {
  std::vector<Session*> kept;
  bool outstanding = false;
  uint64_t coming = 0;
  std::map<uid_t, uint64_t> held_by_user;
  for (auto& [id, s] : sessions_.all()) {
    held_by_user[s.cred.uid] += s.host_tier.bytes;
    if (&s == &asker || !s.host_tier.bytes) continue;
    if (s.host_tier_releasing) {
      // Its own ask was told to release first (it held more than its share): that memory is on its way
      // back as surely as a reclaimed one, and the asker waits for it the same way.
      outstanding = true;
      coming += s.host_tier.bytes;
      continue;
    }
    if (!s.host_tier_kept) continue;
    if (s.host_tier_reclaimed) {
      outstanding = true;
      coming += s.host_tier.bytes;
    } else if (s.conn_id) {
      kept.push_back(&s);
    }
  }
  // Kept memory of the users who hold most beyond their part of the budget goes first (one user's idle
  // ranks give way to another user's pause before anyone else's do), then the largest.
  // A user's part: the share of a user with one rank, every user with ranks on the node counted once.
  const uint64_t part = fair_share(budget(), held_by_user.size(), 1).bytes;
  std::map<uid_t, uint64_t> over;
  for (const auto& [uid, held] : held_by_user) over[uid] = held > part ? held - part : 0;
  std::sort(kept.begin(), kept.end(), [&](const Session* a, const Session* b) {
    const uint64_t oa = over[a->cred.uid], ob = over[b->cred.uid];
    return oa != ob ? oa > ob : a->host_tier.bytes > b->host_tier.bytes;
  });
  for (Session* s : kept) {
    if (coming >= short_by) break;
    spdlog::info("session {}: asking pid {} for the {} of host-tier memory it kept, for session {}'s pause", s->id,
                 s->cred.pid, human_bytes(s->host_tier.bytes), asker.id);
    send_(s->conn_id, proto::kDaemonRequestBit, proto::TierReclaim{}, -1);
    s->host_tier_reclaimed = true;
    coming += s->host_tier.bytes;
    outstanding = true;
  }
  return outstanding;
}

void TierBroker::grant(Session& s, uint64_t request_id, TierPlan plan, uint64_t asked, bool ahead) {
  if (budget() && !plan.note.empty())
    spdlog::info("session {}: host tier{}: {} of the {} asked for: {}", s.id, ahead ? " ahead of a pause" : "",
                 human_bytes(plan.bytes), human_bytes(asked), plan.note);
  if (plan.bytes == 0) {
    return send_(s.conn_id, request_id, proto::TierGrant{.bytes = 0, .note = proto::wire_text(plan.note)}, -1);
  }
  try {
    workers_.build_tier(s.id, s.conn_id, request_id, plan.bytes, std::move(plan.note));
    s.host_tier_pending = plan.bytes;
    s.host_tier_pending_ahead = ahead;
  } catch (const std::bad_alloc&) {
    send_(s.conn_id, request_id, proto::TierGrant{.bytes = 0, .note = "tmsdiskd is out of memory"}, -1);
  }
}

void TierBroker::built(StagingWorkers::TierBuilt& t) {
  if (!t.object.empty()) return object_built(t);
  Session* s = sessions_.find(t.session_id);
  bool ahead = false;
  if (s) {
    s->host_tier_pending = 0;
    ahead = std::exchange(s->host_tier_pending_ahead, false);
  }
  if (!s || s->conn_id != t.conn_id || !t.conn_id) return;  // the rank went meanwhile: the memory is freed
  if (!t.memory) {
    spdlog::warn("session {}: cannot get {} of host-tier memory ({}); this pause goes to disk", s->id,
                 human_bytes(t.bytes), t.error.describe());
    return send_(s->conn_id, t.request_id,
                 proto::TierGrant{.bytes = 0,
                                  .note = proto::wire_text("tmsdiskd could not get the memory: " + t.error.describe())},
                 -1);
  }
  // The daemon keeps its own descriptor: what it stops counting, it takes back (revoke_tier_memory).
  auto held = hold_tier_memory(std::move(t.memory), t.bytes);
  if (!held) {
    spdlog::warn("session {}: {}; this pause goes to disk", s->id, held.error().describe());
    return send_(s->conn_id, t.request_id,
                 proto::TierGrant{.bytes = 0, .note = proto::wire_text("tmsdiskd could not keep the memory")}, -1);
  }
  s->host_tier = std::move(held.value());
  s->host_tier_kept = ahead;  // a pause's memory is in use; memory asked for ahead is kept until a pause
  spdlog::info("session {}: granted {} of host-tier memory, made in {:.2f} s ({} of {} in use){}", s->id,
               human_bytes(t.bytes), t.seconds, human_bytes(sessions_.host_tier_used()), human_bytes(budget()),
               ahead ? ", asked for ahead of a pause" : "");
  send_(s->conn_id, t.request_id,
        proto::TierGrant{.bytes = t.bytes,
                         .note = proto::wire_text(t.note),
                         .flags = static_cast<uint8_t>(keep_ ? proto::kTierKeep : 0)},
        s->host_tier.fd.get());
}

void TierBroker::release(Session& s) {
  if (s.host_tier.bytes) {
    spdlog::debug("session {}: released {} of host-tier memory", s.id, human_bytes(s.host_tier.bytes));
    // No longer counted, so no longer usable: a rank that kept a mapping or a descriptor (against the
    // protocol) is left with pages it pays for itself.
    workers_.take_back_tier(std::move(s.host_tier));
  }
  s.host_tier = TierMemory{};
  s.host_tier_kept = false;
  s.host_tier_reclaimed = false;
  s.host_tier_releasing = false;
}

void TierBroker::keep(Session& s) {
  if (!s.host_tier.bytes) return;  // released meanwhile (a reclaim crossed the rank's resume)
  s.host_tier_kept = true;
  spdlog::debug("session {}: keeps {} of host-tier memory for its next pause", s.id, human_bytes(s.host_tier.bytes));
}

Status TierBroker::adopt(Session& s, UniqueFd& fd) {
  if (!s.from_earlier_daemon)
    return make_error(EPERM,
                      "TIER_ADOPT hands back host-tier memory an earlier tmsdiskd granted; this session did not come "
                      "from one (this daemon counts what it granted itself)");
  if (s.host_tier_adopted || s.host_tier.bytes || s.host_tier_pending)
    return make_error(EBUSY, "this rank's host-tier memory is counted already");
  // The record the earlier daemon wrote: the rank's paused chunks kept in host memory. Only that much
  // was granted for them; a memfd that merely looks like tier memory proves nothing more.
  const uint64_t recorded = s.store->holds_unresumed_data() ? s.store->host_tier_bytes() : 0;
  if (recorded == 0)
    return make_error(EINVAL, "this rank's records keep no paused chunk in host-tier memory: nothing to hand back");
  auto pages = tier_memory_bytes(fd.get());
  if (!pages) return std::move(pages).error();
  if (*pages < recorded)
    return make_error(EINVAL, fmt::format("the memory handed back holds {} of the {} the rank's paused chunks need",
                                          human_bytes(*pages), human_bytes(recorded)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_error("cannot stat the memory handed back");
  if (counted_anywhere(sessions_.all(), st.st_dev, st.st_ino))
    return make_error(EEXIST, "this host-tier memory is counted already");
  auto held = hold_tier_memory(std::move(fd), recorded);
  if (!held) return std::move(held).error();
  s.host_tier = std::move(held.value());
  s.host_tier_kept = false;
  s.host_tier_adopted = true;
  spdlog::info("session {}: pid {} holds {} of host-tier memory from before; counted against the budget", s.id,
               s.cred.pid, human_bytes(recorded));
  return {};
}

void TierBroker::place_object(Session& s, uint64_t request_id, const std::string& name, uint64_t bytes,
                              const proto::StoreOpened& opened) {
  const auto on_disk = [&](const std::string& why) {
    if (budget()) spdlog::info("session {}: object '{}' ({}) lives on disk: {}", s.id, name, human_bytes(bytes), why);
    send_(s.conn_id, request_id, opened, -1);
  };
  // An object that existed may hold committed bytes on disk: it stays where its bytes are.
  if (!opened.created) return on_disk("it existed already");
  if (s.object_memory.size() >= kMaxHostObjectsPerRank)
    return on_disk(fmt::format("the rank has {} objects in host-tier memory already", kMaxHostObjectsPerRank));
  const uint32_t chunk = s.staging->chunk_bytes();
  const uint64_t want = whole_chunks(bytes, chunk);
  // The object's share: the rank's, less what its objects and its pause memory hold already.
  FairShare share = share_of(s.cred.uid);
  const uint64_t held = object_host_bytes(s) + s.host_tier.bytes + s.host_tier_pending;
  if (budget() && share.bytes < held + want)
    return on_disk(fmt::format("the rank's share of the node's host tier is {}, and its objects and pause hold {}",
                               human_bytes(share.bytes), human_bytes(held)));
  share.bytes -= held;
  const SpareMemory spare = budget() ? spare_memory() : SpareMemory{};
  TierPlan plan = plan_grant(want, chunk, budget(), sessions_.host_tier_used(), share, spare);
  if (plan.bytes < want) return on_disk(plan.note.empty() ? "no room in the host tier" : plan.note);
  try {
    proto::StoreOpened placed = opened;
    placed.host_bytes = want;
    placing_[{s.id, request_id}] = placed;
    workers_.build_tier(s.id, s.conn_id, request_id, want, {}, name);
    s.object_memory_pending += want;
  } catch (const std::bad_alloc&) {
    placing_.erase({s.id, request_id});
    on_disk("tmsdiskd is out of memory");
  }
}

void TierBroker::object_built(StagingWorkers::TierBuilt& t) {
  auto placing = placing_.extract({t.session_id, t.request_id});
  Session* s = sessions_.find(t.session_id);
  if (s) s->object_memory_pending = sub_floor(s->object_memory_pending, t.bytes);
  // The rank went meanwhile: the memory is freed with `t`.
  if (!s || s->conn_id != t.conn_id || !t.conn_id || placing.empty()) return;
  proto::StoreOpened opened = placing.mapped();
  const auto on_disk = [&](const std::string& why) {
    spdlog::warn("session {}: object '{}' lives on disk: {}", s->id, t.object, why);
    opened.host_bytes = 0;
    send_(s->conn_id, t.request_id, opened, -1);
  };
  if (!t.memory) return on_disk("cannot get " + human_bytes(t.bytes) + " of host-tier memory: " + t.error.describe());
  // Removed while its memory was made (a client that did not wait for its STORE_OPENED): nothing to count.
  if (!s->objects || !s->objects->contains(t.object)) return on_disk("it was removed meanwhile");
  auto held = hold_tier_memory(std::move(t.memory), t.bytes);
  if (!held) return on_disk(held.error().describe());
  if (auto old = s->object_memory.find(t.object); old != s->object_memory.end())
    workers_.take_back_tier(std::move(old->second));
  TierMemory& memory = s->object_memory[t.object] = std::move(held.value());
  spdlog::info("session {}: object '{}' lives in {} of host-tier memory, made in {:.2f} s ({} of {} in use)", s->id,
               t.object, human_bytes(t.bytes), t.seconds, human_bytes(sessions_.host_tier_used()),
               human_bytes(budget()));
  send_(s->conn_id, t.request_id, opened, memory.fd.get());
}

Result<uint64_t> TierBroker::adopt_object(Session& s, const std::string& name, uint64_t bytes, UniqueFd& fd) {
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0) return errno_error("cannot stat the object's memory handed back");
  if (auto it = s.object_memory.find(name); it != s.object_memory.end()) {
    // Counted already: the session continues an orphan of this daemon, and the count came with it.
    if (it->second.dev == st.st_dev && it->second.ino == st.st_ino) return it->second.bytes;
    return make_error(EEXIST, fmt::format("object '{}' lives in other host-tier memory already", name));
  }
  if (!s.objects_held_before.contains(name))
    return make_error(EPERM, fmt::format("object '{}' was not in this rank's records when tmsdiskd started: only "
                                         "memory an earlier daemon granted is handed back",
                                         name));
  const uint64_t want = whole_chunks(bytes, s.staging->chunk_bytes());
  // The records say which objects existed, not where each lived: counted only as far as the rank
  // could be granted it now (its share, the budget), so that no rank claims more by handing back
  // memory than by asking. Refused, the rank writes the object to disk.
  const uint64_t holds = object_host_bytes(s) + s.host_tier.bytes + s.host_tier_pending;
  if (holds + want > share_of(s.cred.uid).bytes || sessions_.host_tier_used() + want > budget() ||
      s.object_memory.size() >= kMaxHostObjectsPerRank)
    return make_error(ENOSPC, fmt::format("object '{}': the rank's share of the node's host tier has no room for "
                                          "its {} now; write it to disk",
                                          name, human_bytes(want)));
  auto pages = tier_memory_bytes(fd.get());
  if (!pages) return std::move(pages).error();
  if (*pages < want)
    return make_error(EINVAL, fmt::format("the memory handed back holds {} of the {} object '{}' needs",
                                          human_bytes(*pages), human_bytes(want), name));
  if (counted_anywhere(sessions_.all(), st.st_dev, st.st_ino))
    return make_error(EEXIST, "this host-tier memory is counted already");
  auto held = hold_tier_memory(std::move(fd), want);
  if (!held) return std::move(held).error();
  s.objects_held_before.erase(name);
  s.object_memory[name] = std::move(held.value());
  spdlog::info("session {}: pid {} holds object '{}' in {} of host-tier memory from before; counted against the budget",
               s.id, s.cred.pid, name, human_bytes(want));
  return want;
}

void TierBroker::remove_object(Session& s, const std::string& name) {
  s.objects_held_before.erase(name);
  auto it = s.object_memory.find(name);
  if (it == s.object_memory.end()) return;
  workers_.take_back_tier(std::move(it->second));
  s.object_memory.erase(it);
}

int TierBroker::expire() {
  if (waiting_.empty()) return -1;
  const auto now = std::chrono::steady_clock::now();
  auto next = std::chrono::steady_clock::time_point::max();
  for (std::size_t i = 0; i < waiting_.size();) {
    const Waiting w = waiting_[i];
    Session* s = sessions_.find(w.session_id);
    if (!s || s->conn_id != w.conn_id || !w.conn_id) {
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));  // the rank went: nobody to answer
      continue;
    }
    TierPlan plan = plan_for(*s, w.bytes);
    const uint64_t fair = fair_ask(*s, w.bytes);
    if (plan.bytes < fair && now < w.deadline && reclaim(*s, fair - plan.bytes)) {
      next = std::min(next, w.deadline);
      ++i;
      continue;
    }
    if (plan.bytes < fair && now >= w.deadline)
      spdlog::warn("session {}: kept host-tier memory did not come back within {} s; granting what is free", s->id,
                   kReclaimWait.count() / 1000);
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    grant(*s, w.request_id, std::move(plan), w.bytes);
  }
  if (next == std::chrono::steady_clock::time_point::max()) return -1;
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count()) + 1;
}

void TierBroker::check_memory() {
  bool any_kept = false;
  // Memory still being made ahead of a pause is not held yet: the plan that started it saw it could be spared.
  for (const auto& [id, s] : sessions_.all())
    any_kept |= s.host_tier_kept && !s.host_tier_reclaimed && s.host_tier.bytes;
  if (!any_kept || spare_memory().bytes > 0) return;
  for (auto& [id, s] : sessions_.all()) {
    if (!s.host_tier_kept || s.host_tier_reclaimed || !s.conn_id || !s.host_tier.bytes) continue;
    spdlog::info("session {}: the node is short of memory: asking pid {} for the {} of host-tier memory it kept", s.id,
                 s.cred.pid, human_bytes(s.host_tier.bytes));
    send_(s.conn_id, proto::kDaemonRequestBit, proto::TierReclaim{}, -1);
    s.host_tier_reclaimed = true;
  }
}

}  // namespace tmsdisk::server
