// SPDX-License-Identifier: Apache-2.0
// Pause/resume engine and control thread (engine.h).
#include "engine.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>
#include <type_traits>

#include "config.h"
#include "damage.h"
#include "device_memory.h"
#include "driver.h"
#include "gate.h"
#include "log.h"
#include "pause_callbacks.h"
#include "vmm.h"

namespace tmsdisk::shim {
namespace {

constexpr int kDrainTimeoutMs = 60000;  // calls already inside the gate when a pause starts

std::atomic<Engine*> g_engine{nullptr};

uint64_t now_ns() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}
// TMSDISK_ON_TOUCH=resume: a gated call found the gate closed (gate.h).
Status auto_resume() noexcept {
  Engine* e = Engine::instance();
  if (!e) return make_error(ENOMEM, "no memory");  // short enough to need no allocation
  return e->run(proto::CommandOp::Resume);
}

OpResult failed(const Error& e) {
  return OpResult{e};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Instance and fork handling

Engine* Engine::instance() noexcept {
  Engine* e = g_engine.load(std::memory_order_acquire);
  if (e) return e;
  static std::mutex create_mu;
  std::lock_guard lock(create_mu);
  e = g_engine.load(std::memory_order_acquire);
  if (!e) {
    e = new (std::nothrow) Engine;  // never deleted: see engine.h
    g_engine.store(e, std::memory_order_release);
    gate::set_auto_resume(&auto_resume);
  }
  return e;
}

Engine* Engine::existing() noexcept {
  return g_engine.load(std::memory_order_acquire);
}

void Engine::fork_prepare() noexcept {
  gate::fork_prepare();
  registry().lock_for_fork();
  if (Engine* e = existing()) {
    e->control_.lock_for_fork();
    e->report_.lock_for_fork();
  }
}

void Engine::fork_parent() noexcept {
  if (Engine* e = existing()) {
    e->report_.unlock_after_fork();
    e->control_.unlock_after_fork();
  }
  registry().unlock_after_fork();
  gate::fork_parent();
}

void Engine::fork_child() noexcept {
  // The child has no control thread and must not share the parent's session: the daemon knows the
  // parent's pid, and the staging pages are the parent's. Drop all of it (the old object is leaked,
  // its locks may be held by threads that do not exist here) and start again lazily.
  if (Engine* old = existing()) {
    old->session_.close_after_fork();
    old->control_.forget_after_fork();
    old->staging_.forget_after_fork();  // its CUDA registration is the parent's
    old->host_tier_.forget_after_fork();
    g_engine.store(new (std::nothrow) Engine, std::memory_order_release);
  }
  registry().unlock_after_fork();
  gate::fork_child();
  pause_callbacks_fork_child();
}

Engine::Engine()
    : host_tier_(session_, staging_, op_lock_,
                 [this](CUcontext ctx) {
                   if (config().zero_scan) zero_scan_.warm(ctx);
                   pipeline_.warm(ctx);
                 }),
      control_(session_,
               ControlSteps{
                   .operate = [this](proto::CommandOp op, uint8_t flags, uint64_t command_request,
                                     const std::string& tag) { return execute(op, flags, command_request, tag); },
                   .operated = [this] { host_tier_.settle(); },
                   // The staging mapping is released once no copy can be writing into it: here,
                   // between operations.
                   .disconnected =
                       [this] {
                         if (staging_.mapped()) staging_.release();
                       },
                   // A prefetch reads one batch per turn; a turn follows at once while more
                   // remains (a posted no-op wakes the thread), after any request or command.
                   .idle =
                       [this] {
                         host_tier_.tick(now_ms());
                         if (prefetch_.step()) control_.post([] {}, false);
                       },
                   .report = [this] { report_.send_if_due(); },
               }) {
  session_.on_other([this](const proto::Envelope& env) { handle_other(env); });
  session_.on_lost([this](const char* why) { session_lost(why); });
  session_.on_connect([this] { return connect_session(); });
  // An object's host-tier memory before the memory a pause to come would use. The op lock is only
  // tried: a thread that holds it may be waiting for this control thread.
  objects_.on_host_open([this] {
    std::unique_lock lock(op_lock_, std::try_to_lock);
    if (lock.owns_lock()) (void)host_tier_.yield_to_objects();
  });
  host_tier_.on_reuse([this] { views_.before_tier_reuse(); });
}

// ---------------------------------------------------------------------------------------------
// Application side

Status Engine::run(proto::CommandOp op, uint8_t flags, std::string tag) noexcept {
  return control_.run(op, flags, std::move(tag));
}

Status Engine::prefetch(const std::string& tag, bool wait) noexcept {
  try {
    OpResult r;
    Status st = control_.call([&]() -> Status { return (r = prefetch_.command(tag)).status; });
    if (!st || r.outcome != proto::Outcome::Done) return st;
    control_.post([] {}, false);  // a turn of the control thread: its idle step reads the first batch
    return wait ? prefetch_.wait() : Status{};
  } catch (...) {
    return make_error(ENOMEM, "out of memory starting a prefetch");
  }
}

Status Engine::set_backup_dir(const std::string& path) noexcept {
  return control_.call([&]() -> Status { return session_.set_backup_dir(path); });
}

EngineStatus Engine::status() const {
  return report_.status();
}

// ---------------------------------------------------------------------------------------------
// Operations

OpResult Engine::execute(proto::CommandOp op, uint8_t flags, uint64_t command_request, const std::string& tag) {
  prefetch_.stop();  // a pause or resume wins over a prefetch: what it read by now is used
  if (op == proto::CommandOp::Prefetch) {
    OpResult r = prefetch_.command(tag);
    if (r.code() == ENOSPC) return OpResult::no_op(r.message());  // a hint the node cannot take now
    if (r.status && r.outcome == proto::Outcome::Done) control_.post([] {}, false);
    return r;
  }
  const uint64_t t0 = now_ns();
  const bool pausing = op == proto::CommandOp::Pause;
  bool gated = false;
  OpResult r;
  Selection which;
  std::optional<TagId> tag_id;
  if (!tag.empty()) {
    which.all = false;
    which.name = tag;
    tag_id = find_tag(tag);
    which.tag = tag_id.value_or(kUntagged);
  }
  if (op != proto::CommandOp::Pause && op != proto::CommandOp::Resume) {
    r = OpResult{make_error(EINVAL, "unknown operation")};
  } else if (!tag.empty() && !valid_tag_name(tag)) {
    r = OpResult{make_error(EINVAL, "a tag is 1 to 63 of A-Z a-z 0-9 _ . -")};
  } else if (!tag.empty() && !tag_id) {
    r = OpResult::no_op(fmt::format("no allocation carries tag {}", tag));
  } else if (!driver().usable) {
    r = OpResult{make_error(ENOTSUP, "libcuda.so.1 is missing or lacks required entry points; tmsdisk is disabled")};
  } else {
    const Status connected = session_.connected() ? Status{} : connect_session();
    if (!connected) {
      r = failed(connected.error());
    } else {
      // Before the gate closes, the program may hand back memory it does not need (PyTorch's cache):
      // its frees and their synchronization must not be held. Only for a pause that has work to do:
      // with the gate closed (something paused already), a callback's CUDA calls would wait on it.
      if (pausing && !gate::is_closed() && registry().totals().resident_bytes > 0)
        (void)run_pause_callbacks(config().pause_callback_timeout_ms);
      // Pause: no application thread may submit work from here on, and what was submitted before
      // finishes (pause() synchronizes) before a byte moves. The gate opens again once nothing is
      // paused (after a resume, or a pause that released nothing), or nothing but memory whose backup
      // is damaged (then calls naming that memory are held), and only after the state says so.
      gate::begin_op();
      bool drained = true;
      if (pausing) {
        gate::close();
        drained = gate::drain(kDrainTimeoutMs);
      }
      Status no_capture;
      if (!drained) {
        // A call inside the gate does not return (e.g. a copy queued behind a collective whose peer
        // is held at its own gate): give up rather than hold the process forever. Nothing moved;
        // the gate reopens below since nothing is paused.
        r = OpResult{make_error(
            ETIMEDOUT, fmt::format("CUDA calls in flight did not finish within {} s; pause refused (pause ranks that "
                                   "run collectives only while no collective is in flight)",
                                   kDrainTimeoutMs / 1000))};
      } else if (pausing && !(no_capture = gate::no_capture_active())) {
        r = OpResult{std::move(no_capture).error()};
      } else {
        std::unique_lock lock(op_lock_);
        ProgressReporter progress(&session_, command_request);
        std::vector<std::shared_ptr<Allocation>> resident_before;
        if (pausing && which.all)
          for (auto& a : registry().snapshot())
            if (a->state.load() == AllocState::Resident) resident_before.push_back(std::move(a));
        r = pausing ? pause(progress, which) : resume(progress, (flags & proto::kAcceptLoss) != 0, which);
        // A pause of the whole process that paused anything holds the whole process, also when it failed
        // part-way: what it released or discarded is unmapped, and the program never said its kernels
        // would keep off it. (One refused before anything moved changes nothing; what an earlier failed
        // pause left paused and this one restored and paused again was paused already.)
        if (std::any_of(resident_before.begin(), resident_before.end(),
                        [](const auto& a) { return a->state.load() == AllocState::Paused; }))
          whole_process_paused_ = untagged_held_ = true;
        // A tag brought back alone after a whole pause: the program runs on with it, and only calls
        // naming what is still paused wait, as after a pause of tags, unless untagged memory the whole
        // pause took stays paused (settle_gate).
        if (!pausing && !which.all && r.outcome == proto::Outcome::Done && !r.code()) {
          whole_process_paused_ = false;
          if (which.tag == kUntagged) untagged_held_ = false;
        }
      }
      if (!pausing) host_tier_.after_resume();
      gated = true;
    }
  }
  r.nanos = now_ns() - t0;

  report_.record(pausing, r);
  if (gated) {
    {
      // A free of paused memory changes the lost ranges too (gate::forget_lost, under the shared
      // lock): this look at the registry and theirs must not cross.
      std::unique_lock lock(op_lock_);
      settle_gate();
    }
    gate::end_op();
  }
  const char* what = pausing ? "pause" : "resume";
  if (r.code()) {
    TMS_WARN("%s failed: %s (%s)", what, r.message().c_str(), std::strerror(r.code()));
  } else if (r.outcome == proto::Outcome::NoOp) {
    TMS_INFO("%s: nothing to do: %s", what, r.message().c_str());
  } else {
    const double secs = static_cast<double>(r.nanos) / 1e9;
    TMS_INFO("%s: %llu bytes in %.3f s (%.2f GB/s; %llu zero and %llu unchanged bytes not moved)%s%s", what,
             static_cast<unsigned long long>(r.bytes), secs, secs > 0 ? static_cast<double>(r.bytes) / secs / 1e9 : 0.0,
             static_cast<unsigned long long>(r.skipped.zero_bytes),
             static_cast<unsigned long long>(r.skipped.unchanged_bytes), r.message().empty() ? "" : "; ",
             r.message().c_str());
  }
  if (session_.connected()) send_report();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Pause and resume

OpResult Engine::pause(ProgressReporter& progress, const Selection& which) {
  std::vector<std::shared_ptr<Allocation>> resident, paused, damaged, discarding;
  std::vector<std::string> holding;  // tags outside the selection whose backed-up allocations are paused
  std::vector<std::shared_ptr<Allocation>> carried;  // ... those allocations
  for (auto& a : registry().snapshot()) {
    if (a->pinned.load() >= 0 && a->state.load() == AllocState::Resident) continue;  // stays resident for good
    const bool is_paused = a->state.load() == AllocState::Paused;
    if (!which.covers(*a)) {
      if (is_paused && a->policy != Policy::Discard) {
        std::string name = tag_name(a->tag);
        if (std::find(holding.begin(), holding.end(), name) == holding.end()) holding.push_back(std::move(name));
        carried.push_back(std::move(a));
      }
      continue;
    }
    if (a->policy == Policy::Discard) {
      if (!is_paused) discarding.push_back(std::move(a));
      continue;
    }
    if (is_paused && a->damage.load() != 0) damaged.push_back(a);
    (is_paused ? paused : resident).push_back(std::move(a));
  }
  if (!damaged.empty()) {
    // The committed pause still holds what can be saved of them (every chunk but the damaged one):
    // a new pause would reserve over it. The user decides first.
    return OpResult{make_error(EBUSY, fmt::format("pause refused: {} allocation(s) could not be restored by the last "
                                                  "resume because their backup is damaged: {}. First {}; then pause",
                                                  damaged.size(), damage_list(damaged), kDamageAdvice))};
  }
  if (resident.empty() && discarding.empty()) {
    if (!which.all) return OpResult::no_op(fmt::format("every allocation with tag {} is paused already", which.name));
    return OpResult::no_op(paused.empty() ? "no managed allocations to pause" : "already paused");
  }
  if (!resident.empty() && !holding.empty()) {
    // The rank's backed-up pause (one reservation, one manifest) holds other tags' data: once committed,
    // this pause's set carries it as it is stored. A pause of theirs that did not commit cannot be.
    Result<bool> holds = record_.committed();
    if (!holds) return failed(holds.error());
    if (!*holds) {
      std::string tags;
      for (const auto& t : holding) tags += (tags.empty() ? "" : ", ") + t;
      return OpResult{make_error(
          EBUSY, fmt::format("tag {} cannot be paused with a backup while the pause of tag(s) {} did not complete: "
                             "resume {} first",
                             which.name, tags, tags))};
    }
  } else {
    carried.clear();
  }
  OpResult dropped;
  if (!discarding.empty()) {
    dropped = discard(std::move(discarding));
    if (dropped.code() || resident.empty()) return dropped;
  }
  auto with_dropped = [&](OpResult r) {
    r.bytes += dropped.bytes;
    r.skipped.discarded_bytes += dropped.skipped.discarded_bytes;
    return r;
  };
  Result<bool> committed = record_.committed();
  if (!committed) return with_dropped(failed(committed.error()));
  if (*committed && !paused.empty()) {
    // What is paused already (tags paused one by one, or memory a whole pause left behind) was stored by
    // a committed pause: this one carries it as it is stored and saves only the rest.
    carried.insert(carried.end(), paused.begin(), paused.end());
    paused.clear();
  }
  if (*committed && carried.empty()) {
    // Every allocation is resident (a resume brought the data back but its commit failed, or what was
    // paused has been freed): the committed pause holds nothing the process still needs. Close it.
    TMS_INFO("tmsdiskd still records a committed pause though every allocation is resident; recording the resume");
    if (OpResult closed = record_.commit(proto::CommitState::Resumed, 0, "every allocation is resident"); closed.code())
      return with_dropped(std::move(closed));
  }
  if (!paused.empty()) {
    // An earlier pause stopped half-way. A new reservation would drop the checksums of what it
    // released, so resume those allocations first, then pause everything.
    TMS_INFO("restoring %zu allocation(s) left paused by an earlier failed pause", paused.size());
    OpResult back = resume_all(paused, progress);
    if (back.code()) {
      back.status = make_error(back.code(),
                               "cannot restore allocations left paused by an earlier failed pause: " + back.message());
      return with_dropped(std::move(back));
    }
    resident.insert(resident.end(), paused.begin(), paused.end());
  }
  return with_dropped(pause_all(std::move(resident), progress, std::move(carried)));
}

OpResult Engine::resume(ProgressReporter& progress, bool accept_loss, const Selection& which) {
  std::vector<std::shared_ptr<Allocation>> paused, refilling;
  std::vector<std::shared_ptr<Allocation>> staying;  // backed-up allocations outside the selection stay paused
  for (auto& a : registry().snapshot()) {
    if (a->state.load() != AllocState::Paused) continue;
    if (!which.covers(*a)) {
      if (a->policy != Policy::Discard) staying.push_back(std::move(a));
      continue;
    }
    (a->policy == Policy::Discard ? refilling : paused).push_back(std::move(a));
  }
  if (paused.empty() && refilling.empty()) {
    if (!which.all) return OpResult::no_op(fmt::format("nothing with tag {} is paused", which.name));
    // Nothing to bring back; a committed pause the daemon still records (its allocations were freed,
    // or an earlier resume's commit failed) is closed here.
    Result<bool> committed = record_.committed();
    if (!committed) return failed(committed.error());
    if (!*committed) return OpResult::no_op("nothing is paused");
  }
  OpResult r;
  const bool others = !staying.empty();
  const bool resuming = !paused.empty();
  if (!paused.empty() || refilling.empty()) r = resume_all(std::move(paused), progress, accept_loss, !others);
  if (others && resuming && !r.code()) {
    // The daemon's set still holds what was just resumed: it now carries only what stays paused, so
    // that this tag's next pause (or another's) finds the others where they are and nothing stale.
    if (Status st = record_.reserve({}, staying); !st) {
      TMS_WARN("the other tags' pause could not be recorded without this one (%s); it stays recorded with it",
               st.error().message.c_str());
    } else if (OpResult c = record_.commit(proto::CommitState::Paused, 0, "the other tags stay paused"); c.code()) {
      TMS_WARN("%s", c.message().c_str());
    }
  }
  if (!refilling.empty()) {
    OpResult z = refill(std::move(refilling));
    r.bytes += z.bytes;
    r.skipped.discarded_bytes += z.skipped.discarded_bytes;
    if (z.code() && !r.code()) r.status = std::move(z.status);
  }
  if (!r.code() && untagged_held_ && std::any_of(staying.begin(), staying.end(), [](const auto& a) {
        return a->tag == kUntagged && a->damage.load() == 0;
      })) {
    r.note = fmt::format("{}{}the process stays held while memory no tag covers is paused: resume the whole process",
                         r.note, r.note.empty() ? "" : "; ");
    TMS_WARN("tag %s resumed; %s", which.name.c_str(), r.note.c_str());
  }
  return r;
}

namespace {

// The bytes of j's chunks that hold data: what moves.
uint64_t data_bytes(const TransferJob& j, uint32_t chunk) {
  return j.a->size - place_bytes(j, ChunkPlace::Zero, chunk);
}

}  // namespace

Result<std::vector<TransferJob>> Engine::make_jobs(std::vector<std::shared_ptr<Allocation>> list, uint64_t* total) {
  const uint32_t chunk = staging_.chunk_bytes();
  std::vector<TransferJob> jobs(list.size());
  *total = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    TransferJob& j = jobs[i];
    j = allocation_job(std::move(list[i]));
    Result<int> ctx = pipeline_.context(j.a->ctx);
    if (!ctx) return std::move(ctx).error();
    j.ctx = *ctx;
    j.chunks = (j.a->size + chunk - 1) / chunk;
    j.place = j.a->placement;  // empty unless paused with zero or host chunks
    count_disk_chunks(j, chunk);
    if (std::find(j.place.begin(), j.place.end(), ChunkPlace::Host) != j.place.end()) {
      // Paused with host chunks: the host-tier memory holds them (it is kept while they are there).
      if (!host_tier_.memory().held())
        return make_error(EIO, fmt::format("blob {}: its host-tier memory is gone", j.a->id));
      j.host = host_tier_.memory().base() + j.a->host_offset;
    }
    *total += data_bytes(j, chunk);
  }
  return jobs;
}

OpResult Engine::pause_all(std::vector<std::shared_ptr<Allocation>> resident, ProgressReporter& progress,
                           std::vector<std::shared_ptr<Allocation>> carried) {
  set_state(proto::RankState::Pausing);

  // 1. Let every context finish what it was doing with this memory.
  if (Status st = synchronize_users(resident); !st) return OpResult{std::move(st)};
  vmm_trim_pools();  // pool memory stays resident; what the pools keep unused goes back now

  // Exported through legacy IPC: the daemon must not keep the old physical memory alive, and what
  // another process has open stays resident. Whatever this pause leaves resident gets its export
  // back on the way out.
  std::vector<std::shared_ptr<Allocation>> revoked;
  struct Reexport {
    IpcBroker* broker;
    std::vector<std::shared_ptr<Allocation>>& list;
    ~Reexport() {
      for (auto& a : list)
        if (a->state.load() == AllocState::Resident) broker->refresh(*a);
    }
  } reexport{&ipc_, revoked};
  ipc_.revoke(resident, revoked);
  // Done, not a no-op: the rank was not paused, and stays running only because other processes hold
  // its memory; 0 bytes is what this pause moved, and what its figures should say.
  if (resident.empty())
    return OpResult{{}, 0, 0, "every allocation stays resident: other processes have them open through legacy IPC"};

  uint64_t total = 0;
  auto made = make_jobs(resident, &total);
  if (!made) return failed(made.error());
  std::vector<TransferJob>& jobs = *made;
  staging_.register_with(resident.front()->ctx);

  // 2. Find the chunks that are all zero (nothing of them moves), then reserve disk space for every
  // other byte; refused (ENOSPC...) means nothing changed.
  const uint32_t chunk = staging_.chunk_bytes();
  for (TransferJob& j : jobs) {
    j.place.clear();  // what a failed pause found is stale now
    j.host = nullptr;
  }
  const uint64_t scan_start = now_ns();
  if (config().zero_scan)
    if (Status st = zero_scan_.scan(jobs, chunk, pipeline_); !st) return failed(st.error());
  total = 0;
  uint64_t covered = 0;
  for (TransferJob& j : jobs) {
    count_disk_chunks(j, chunk);
    total += data_bytes(j, chunk);
    covered += j.a->size;
  }
  if (config().zero_scan)
    TMS_INFO("zero-chunk scan: %llu of %llu bytes are zero chunks (%.3f s)",
             static_cast<unsigned long long>(covered - total), static_cast<unsigned long long>(covered),
             static_cast<double>(now_ns() - scan_start) / 1e9);
  // 3. What the node's host tier grants goes there by DMA; disk space for every other data chunk. The
  // reservation refused: nothing changed (the host-tier memory goes back).
  host_tier_.place(jobs, resident.front()->ctx);
  if (Status st = record_.reserve(jobs, carried); !st) return failed(st.error());

  // 4./5. Chunk by chunk: device -> slot, slot -> disk; an allocation's memory goes once all of its
  // chunks are acknowledged.
  uint64_t released_bytes = 0, released_zero = 0, released_host = 0;
  std::size_t released = 0;
  TransferSteps steps;
  steps.finished = [&](TransferJob& j) -> Status {
    // Invariant 1: every chunk of this allocation is on disk, sealed by the daemon's storage, in the
    // host-tier memory, or recorded as zero with the reservation.
    Allocation& a = *j.a;
    if (Status st = release_memory(a); !st) return st;
    a.placement = j.place;  // copied: the pipeline still walks j.place
    a.retained.clear();     // paused anew: this pause's chunks are the ones to read
    views_.moved(a, host_tier_.memory().fd(), chunk);
    a.state.store(AllocState::Paused);
    released_bytes += a.size;
    released_zero += a.size - data_bytes(j, chunk);
    released_host += place_bytes(j, ChunkPlace::Host, chunk);
    ++released;
    return {};
  };
  progress.start(total);
  uint64_t done_bytes = 0, unchanged_bytes = 0;
  auto result = [&](Status st) {
    OpResult r{std::move(st), released_bytes};
    r.skipped = {.zero_bytes = released_zero,
                 .unchanged_bytes = std::min(unchanged_bytes, released_bytes - released_zero - released_host),
                 .host_bytes = released_host};
    return r;
  };
  if (std::optional<Error> fail =
          pipeline_.run(Direction::ToStorage, jobs, steps, progress, &done_bytes, &unchanged_bytes)) {
    // (Not with a daemon that stopped answering or is gone: another exchange would only wait.)
    if (!carried.empty() && fail->errnum() != ETIMEDOUT && session_.connected())
      record_paused_after_failure(std::move(carried), jobs);
    return result(make_error(fail->errnum(), released ? fmt::format("{}; {} of {} allocation(s) are paused, the "
                                                                    "others stay resident",
                                                                    fail->message, released, jobs.size())
                                                      : fail->message + "; every allocation stays resident"));
  }

  // 6. The daemon syncs the data and commits its manifest.
  OpResult committed =
      record_.commit(proto::CommitState::Paused, released_bytes, "every allocation was written and released");
  if (committed.code()) return result(std::move(committed.status));
  return result({});
}

void Engine::record_paused_after_failure(std::vector<std::shared_ptr<Allocation>> paused,
                                         const std::vector<TransferJob>& jobs) {
  // This pause's reservation took the place of the committed pause that held the tags it carried.
  // Record again what is paused now, as resume() does for the tags that stay: the carried tags and
  // what this pause released (every chunk of it sealed). Otherwise a tag's next pause is refused and
  // a whole pause first brings everything back, which may need the device memory they freed.
  for (const TransferJob& j : jobs)
    if (j.a->state.load() == AllocState::Paused) paused.push_back(j.a);
  if (Status st = record_.reserve({}, paused); !st) {
    TMS_WARN("what stays paused after the failed pause could not be recorded again (%s); a resume restores it",
             st.error().message.c_str());
  } else if (OpResult c = record_.commit(proto::CommitState::Paused, 0, "what stays paused after a failed pause");
             c.code()) {
    TMS_WARN("%s", c.message().c_str());
  }
}

OpResult Engine::resume_all(std::vector<std::shared_ptr<Allocation>> paused, ProgressReporter& progress,
                            bool accept_loss, bool last) {
  set_state(proto::RankState::Resuming);
  uint64_t total = 0;
  auto made = make_jobs(std::move(paused), &total);
  if (!made) return failed(made.error());
  std::vector<TransferJob>& jobs = *made;
  if (!jobs.empty()) staging_.register_with(jobs.front().a->ctx);

  uint64_t resumed_bytes = 0, resumed_zero = 0, resumed_host = 0, map_ns = 0;
  std::size_t resumed = 0;
  const uint32_t chunk = staging_.chunk_bytes();
  TransferSteps steps;
  steps.before_copy = [&](TransferJob& j) -> Status {
    if (j.mapped) return {};
    // Created and mapped here, while the daemon reads the chunks queued behind this one: the disk
    // never waits for the driver.
    const uint64_t t0 = now_ns();
    Status st = map_job(j);
    map_ns += now_ns() - t0;
    if (!st) TMS_WARN("%s", st.error().message.c_str());
    return st;
  };
  steps.finished = [&](TransferJob& j) -> Status {
    // Every chunk verified by the daemon and copied back: the data may become visible.
    j.a->handle = j.handle;
    j.handle = 0;
    j.mapped = false;
    j.a->damage.store(0);
    const uint64_t host = place_bytes(j, ChunkPlace::Host, chunk);
    resumed_host += host;
    // Retained: the host chunks stay readable where they are until the memory is used again.
    j.a->retained = host && retain_host_copy() ? std::move(j.a->placement) : std::vector<ChunkPlace>{};
    j.a->retained_offset = j.a->host_offset;
    j.a->retained_generation = host_tier_.generation();
    if (j.a->retained.empty()) views_.drop(*j.a);  // no copy kept: a view of it goes, as TMS frees its copy
    j.a->placement.clear();
    j.a->state.store(AllocState::Resident);
    resumed_bytes += j.a->size;
    resumed_zero += j.a->size - data_bytes(j, chunk);
    ++resumed;
    return {};
  };
  steps.abandoned = unmap_job;  // stays paused; the file is kept
  progress.start(total);
  uint64_t done_bytes = 0;
  const std::optional<Error> fatal = pipeline_.run(Direction::FromStorage, jobs, steps, progress, &done_bytes);
  TMS_INFO("resume: creating and mapping physical memory for %zu allocation(s) took %.3f s, overlapped with the reads",
           jobs.size(), static_cast<double>(map_ns) / 1e9);
  for (TransferJob& j : jobs) {
    if (!j.complete)
      unmap_job(j);
    else if (j.a->export_id)
      ipc_.refresh(*j.a);
  }

  // What the daemon could not give back as written is damaged: it stays paused, unmapped, with its
  // file, while the rest of the process runs (settle_gate), until a resume restores it or, as asked
  // now, zero-filled memory replaces it. An allocation that failed otherwise (no device memory, the
  // daemon gone) keeps the damage found by an earlier resume, if any: its data is no better now.
  const uint32_t chunk_bytes = staging_.chunk_bytes();
  std::vector<std::shared_ptr<Allocation>> damaged;
  std::vector<std::string> zeroed;  // what each replaced allocation was, and why it was lost
  const TransferJob* other_failure = nullptr;
  // The daemon's account of a record it lost (EUCLEAN: which file, what it kept, what to do): the
  // damage alone would say only that chunks are missing.
  std::string lost_record;
  for (TransferJob& j : jobs) {
    if (j.complete) continue;
    if (j.error && j.error->errnum() == EUCLEAN && lost_record.empty()) lost_record = j.refusal;
    if (const uint8_t d = damage_of(j)) {
      j.a->damaged_chunk.store(chunk_bytes ? *j.refused_offset / chunk_bytes : 0);
      j.a->damage.store(d);
      TMS_ERROR("backup damaged: %s; the allocation stays paused and unmapped, its file is kept",
                damage_text(*j.a).c_str());
    }
    if (j.a->damage.load() == 0) {
      if (!other_failure && j.error) other_failure = &j;
      continue;
    }
    if (!accept_loss || fatal) {
      damaged.push_back(j.a);
      continue;
    }
    const std::string what = damage_text(*j.a);
    if (Status st = zero_fill(j); !st) {
      TMS_ERROR("cannot replace %s with zero-filled memory: %s", what.c_str(), st.error().message.c_str());
      damaged.push_back(j.a);
      continue;
    }
    TMS_ERROR("DATA LOST: %s is now zero-filled memory at the same address, as --accept-loss asked", what.c_str());
    j.a->handle = j.handle;
    j.handle = 0;
    j.mapped = false;
    j.a->state.store(AllocState::Resident);
    j.a->damage.store(0);
    j.a->placement.clear();
    if (j.a->export_id) ipc_.refresh(*j.a);
    zeroed.push_back(what);
  }
  const std::string lost_note = loss_note(zeroed);

  if (resumed + zeroed.size() < jobs.size()) {
    std::string message;
    int code = 0;
    if (!damaged.empty()) {
      message = fmt::format(
          "{} of {} allocation(s) could not be restored because their backup is damaged: {}. {}The "
          "other allocations are resident and the process runs; calls that touch the damaged memory "
          "follow TMSDISK_ON_TOUCH. To go on, {}",
          damaged.size(), jobs.size(), damage_list(damaged),
          lost_record.empty() ? "" : "tmsdiskd: " + lost_record + ". ", kDamageAdvice);
      code = damage_errno(damaged.front()->damage.load());
    }
    const std::size_t others = jobs.size() - resumed - zeroed.size() - damaged.size();
    if (others > 0 || fatal) {
      const Error* why = other_failure ? &*other_failure->error : fatal ? &*fatal : nullptr;
      if (!message.empty()) message += "; ";
      message += fmt::format("{} of {} allocation(s) stay paused: {}", others, jobs.size(),
                             why ? why->message : std::string());
      // The code says what a plain retry may fix (device memory, the daemon); the damage is named above.
      code = why ? why->errnum() : EIO;
    }
    if (!lost_note.empty()) message += "; " + lost_note;
    OpResult partial{make_error(code ? code : EIO, message), resumed_bytes};
    partial.skipped.zero_bytes = resumed_zero;
    partial.skipped.host_bytes = resumed_host;
    return partial;
  }

  if (last) {
    OpResult committed =
        record_.commit(proto::CommitState::Resumed, resumed_bytes, "every allocation is resident again");
    if (committed.code()) return committed;
  }
  OpResult done{{}, resumed_bytes, 0, lost_note};
  done.skipped.zero_bytes = resumed_zero;
  done.skipped.host_bytes = resumed_host;
  return done;
}

OpResult Engine::discard(std::vector<std::shared_ptr<Allocation>> list) {
  if (Status st = synchronize_users(list); !st) return failed(st.error());
  // Exported through legacy IPC: what another process has open stays resident, as in pause_all.
  std::vector<std::shared_ptr<Allocation>> revoked;
  ipc_.revoke(list, revoked);
  OpResult r;
  for (const auto& a : list) {
    if (Status st = release_memory(*a); !st) {
      r.status = std::move(st);
      continue;
    }
    a->placement.clear();
    a->state.store(AllocState::Paused);
    r.bytes += a->size;
  }
  for (auto& a : revoked)
    if (a->state.load() == AllocState::Resident) ipc_.refresh(*a);
  r.skipped.discarded_bytes = r.bytes;
  TMS_INFO("discarded %llu bytes (policy discard: not saved; zero-filled on resume)",
           static_cast<unsigned long long>(r.bytes));
  return r;
}

OpResult Engine::refill(std::vector<std::shared_ptr<Allocation>> list) {
  OpResult r;
  std::size_t failures = 0;
  for (const auto& a : list) {
    TransferJob j = allocation_job(a);
    if (Status st = zero_fill(j); !st) {
      if (failures++ == 0)
        r.status = make_error(st.error().errnum(), "cannot map discarded memory again: " + st.error().message);
      continue;
    }
    a->handle = j.handle;
    a->state.store(AllocState::Resident);
    if (a->export_id) ipc_.refresh(*a);
    r.bytes += a->size;
  }
  r.skipped.discarded_bytes = r.bytes;
  if (failures) TMS_WARN("%zu discarded allocation(s) stay unmapped: %s", failures, r.message().c_str());
  return r;
}

// ---------------------------------------------------------------------------------------------
// Session

Status Engine::connect_session() {
  if (staging_.mapped()) staging_.release();
  Result<DaemonSession::Welcomed> w = session_.hello();
  if (!w) return std::move(w).error();
  if (Status st = staging_.map(w->memfd.get(), w->welcome); !st) return st;  // the socket closes with `w`
  w->memfd.reset();
  session_.attach(*w);
  const proto::Welcome& welcome = w->welcome;
  const std::size_t paused = registry().totals().paused_allocations;
  if (paused && !welcome.restored)
    TMS_WARN(
        "tmsdiskd has no committed pause of this process; its %zu paused allocation(s) will be read back, "
        "verified against the checksums its storage journaled when it sealed each chunk",
        paused);
  report_.session_opened(welcome.session_id);
  ipc_.session_started(welcome.adopted != 0);
  host_tier_.session_started(welcome.adopted != 0);
  objects_.session_started();
  TMS_INFO("session %llu with tmsdiskd: %u slots of %u bytes, directory %s",
           static_cast<unsigned long long>(welcome.session_id), welcome.slot_count, welcome.chunk_bytes,
           welcome.rank_dir.c_str());
  send_report();
  return {};
}

void Engine::session_lost(const char* why) {
  // Whatever the daemon held is gone with the connection; the staging mapping is released once no
  // copy can be writing into it (control loop, between operations).
  staging_.drop_daemon_held();
  report_.session_closed();
  const std::size_t paused = registry().totals().paused_allocations;
  if (paused)
    TMS_ERROR("connection to tmsdiskd lost (%s) while %zu allocation(s) are paused; reconnecting", why, paused);
  else
    TMS_WARN("connection to tmsdiskd lost (%s); reconnecting", why);
}

void Engine::handle_other(const proto::Envelope& env) {
  if (std::holds_alternative<proto::Command>(env.body)) return control_.command_while_waiting(env);
  if (staging_.answer_lost(env.request_id)) return;  // the late answer frees the slot
  if (std::holds_alternative<proto::TierReclaim>(env.body)) return host_tier_.reclaim();
  if (const auto* users = std::get_if<proto::IpcUsers>(&env.body)) return ipc_.on_users(*users);
  if (const auto* err = std::get_if<proto::ErrorReply>(&env.body)) {
    TMS_WARN("tmsdiskd: %s (%s)", err->message.c_str(), std::strerror(err->code));
    return;
  }
  TMS_DEBUG("ignoring %s (request %llu) from tmsdiskd",
            proto::type_name(std::visit([](const auto& m) { return std::decay_t<decltype(m)>::kType; }, env.body)),
            static_cast<unsigned long long>(env.request_id));
}

void Engine::settle_gate() noexcept {
  bool held_paused = false;  // paused for another reason than a damaged backup: the gate stays closed
  // Nothing paused: the flags end. Decided before the snapshot below, which may fail for memory (the
  // rule after it covers this case too, when it can be taken).
  if (registry().totals().paused_allocations == 0) whole_process_paused_ = untagged_held_ = false;
  try {
    std::vector<gate::Range> lost;
    const auto allocations = registry().snapshot();
    // Only damaged memory left (a resume restored the rest): it is lost, not paused by anyone's pause.
    if (std::none_of(allocations.begin(), allocations.end(),
                     [](const auto& a) { return a->state.load() == AllocState::Paused && a->damage.load() == 0; }))
      whole_process_paused_ = untagged_held_ = false;
    for (const auto& a : allocations) {
      if (a->state.load() != AllocState::Paused) continue;
      // After a pause of part of the process (one tag), its memory is held back like lost memory:
      // calls naming it wait (TMSDISK_ON_TOUCH), the rest of the program runs. Untagged memory a whole
      // pause took holds the whole process while it is paused (untagged_held_).
      const bool held = whole_process_paused_ || (untagged_held_ && a->tag == kUntagged);
      if (a->damage.load() != 0 || !held)
        lost.push_back({a->base, a->mapped});
      else
        held_paused = true;
    }
    if (held_paused) {
      gate::close();
      gate::set_lost(std::move(lost));
    } else {
      gate::set_lost(std::move(lost));  // before opening: lost memory is never reachable unchecked
      gate::open();
    }
  } catch (...) {
    // Out of memory: closed while anything is paused, as before damaged memory could be told apart.
    if (registry().totals().paused_allocations > 0)
      gate::close();
    else
      gate::open();
  }
}

void Engine::paused_freed() noexcept {
  (void)control_.post(
      [this] {
        {
          std::unique_lock lock(op_lock_);
          settle_gate();
        }
        const RegistryTotals t = registry().totals();
        report_.set_state(settled_state(t));
        if (t.paused_allocations == 0 && session_.connected()) {
          // What the committed pause held is gone with the frees: the daemon's record says so too,
          // so that its files no longer count as the only copy of anything.
          Result<bool> committed = record_.committed();
          if (committed && *committed) {
            if (OpResult closed = record_.commit(proto::CommitState::Resumed, 0, "the paused allocations were freed");
                closed.code())
              TMS_WARN("%s", closed.message().c_str());
            else
              TMS_INFO("every paused allocation was freed: the pause is closed");
          }
        }
        if (session_.connected()) send_report();
      },
      false);
}

void Engine::send_report() {
  report_.send();
}

void Engine::set_state(proto::RankState s) {
  report_.set_state(s);
  if (session_.connected()) report_.send();
}

}  // namespace tmsdisk::shim
