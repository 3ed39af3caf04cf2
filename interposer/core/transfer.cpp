// SPDX-License-Identifier: Apache-2.0
// The transfer pipeline (transfer.h): one loop for pause and resume.
#include "transfer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <string>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {
namespace {

constexpr int kTickMs = 100;  // the pipeline's poll interval; progress messages at most this often
// To storage, the chunks are dealt into lanes that share the slots (see run()). Four lanes of eight
// slots with the default staging; fewer where there are too few slots for each lane to keep two
// requests in flight.
constexpr std::size_t kMaxPauseLanes = 4;
constexpr std::size_t kMinSlotsPerLane = 2;

// A lane of the pipeline: a contiguous part of the disk chunks (job after job, each job's in address
// order). `job` and `offset` name its next chunk once settled; `left` counts its chunks not started.
struct Lane {
  std::size_t job = 0;
  uint64_t offset = 0;
  uint64_t left = 0;
};

// Whether chunk `i` of `j` goes through the staging slots (what count_disk_chunks counts).
bool on_disk(const TransferJob& j, uint64_t i) noexcept {
  return place_at(j.place, i) == ChunkPlace::Disk;
}

// `count` lanes of (nearly) equal numbers of disk chunks, in order, each set on its first chunk.
std::vector<Lane> deal_lanes(const std::vector<TransferJob>& jobs, std::size_t count, uint32_t chunk_bytes) {
  uint64_t total = 0;
  for (const TransferJob& j : jobs) total += j.chunks;
  std::vector<Lane> lanes(count);
  std::size_t job = 0;
  uint64_t before = 0;  // disk chunks of the jobs before `job`
  for (std::size_t k = 0; k < count; ++k) {
    const uint64_t first = total * k / count;
    lanes[k].left = total * (k + 1) / count - first;
    while (job < jobs.size() && before + jobs[job].chunks <= first) before += jobs[job++].chunks;
    lanes[k].job = job;
    if (job == jobs.size()) continue;  // an empty lane (fewer chunks than lanes)
    uint64_t i = 0;                    // the lane's first chunk: disk chunk number (first - before) of `job`
    for (uint64_t skip = first - before;; ++i) {
      if (!on_disk(jobs[job], i)) continue;
      if (skip == 0) break;
      --skip;
    }
    lanes[k].offset = i * chunk_bytes;
  }
  return lanes;
}

// Moves `lane` onto its next chunk to start, past chunks that do not go through the disk and those
// of a job that failed (they never start); false once it has none left.
bool settle(Lane& lane, const std::vector<TransferJob>& jobs, uint32_t chunk_bytes) noexcept {
  while (lane.left > 0) {
    if (lane.job >= jobs.size()) {  // cannot happen while the counts agree; never read past the jobs
      lane.left = 0;
      break;
    }
    const TransferJob& j = jobs[lane.job];
    if (lane.offset >= j.size) {
      ++lane.job;
      lane.offset = 0;
    } else if (!on_disk(j, lane.offset / chunk_bytes)) {
      lane.offset += chunk_bytes;
    } else if (j.error) {
      --lane.left;
      lane.offset += chunk_bytes;
    } else {
      return true;
    }
  }
  return false;
}

Error cuda_error(const char* what, CUresult r) {
  return make_error(EIO, fmt::format("{} failed: {} ({})", what, cu_error_name(r), static_cast<int>(r)));
}

const char* copy_what(Direction dir) {
  return dir == Direction::ToStorage ? "copying device memory to the staging buffer"
                                     : "copying the staging buffer to device memory";
}

}  // namespace

uint64_t place_bytes(const TransferJob& j, ChunkPlace where, uint32_t chunk_bytes) noexcept {
  const uint64_t size = j.size;
  uint64_t bytes = 0;
  for (uint64_t i = 0; i < j.place.size() && i * chunk_bytes < size; ++i)
    if (j.place[i] == where) bytes += std::min<uint64_t>(chunk_bytes, size - i * chunk_bytes);
  return bytes;
}

void count_disk_chunks(TransferJob& j, uint32_t chunk_bytes) noexcept {
  const uint64_t size = j.size;
  const uint64_t all = chunk_bytes ? (size + chunk_bytes - 1) / chunk_bytes : 0;
  uint64_t elsewhere = 0;
  for (uint64_t i = 0; i < j.place.size() && i < all; ++i) elsewhere += on_disk(j, i) ? 0 : 1;
  j.chunks = all - elsewhere;
}

void ProgressReporter::update(uint64_t done, bool force) {
  if (request_ == 0 || !session_ || !session_->connected()) return;  // only a daemon command has someone watching
  const int64_t now = now_ms();
  if (!force && now - last_ms_ < kTickMs) return;
  last_ms_ = now;
  proto::Progress p;
  p.done_bytes = std::min(done, total_);
  p.total_bytes = total_;
  (void)session_->send(request_, p);
}

Result<int> TransferPipeline::context(CUcontext ctx) {
  for (std::size_t i = 0; i < ctxs_.size(); ++i)
    if (ctxs_[i].ctx == ctx) return static_cast<int>(i);
  const DriverApi& api = driver().api;
  CtxScope scope(api, ctx);
  if (!scope.ok()) return make_error(EIO, "cannot make an allocation's context current (was it destroyed?)");
  CtxResources cr;
  cr.ctx = ctx;
  // Non-blocking: the shim's copies must not wait on, or be waited on by, the legacy default stream.
  if (CUresult r = api.cuStreamCreate(&cr.stream, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS)
    return cuda_error("cuStreamCreate", r);
  ctxs_.push_back(std::move(cr));
  return static_cast<int>(ctxs_.size() - 1);
}

void TransferPipeline::warm(CUcontext ctx) {
  Result<int> index = context(ctx);
  if (!index) return;
  for (std::size_t slot = 0; slot < slots_.count(); ++slot)
    if (!slot_event(*index, slot)) return;
}

Result<CUevent> TransferPipeline::slot_event(int ctx, std::size_t slot) {
  CtxResources& cr = ctxs_[static_cast<std::size_t>(ctx)];
  if (cr.events.size() < slots_.count()) cr.events.resize(slots_.count(), nullptr);
  if (!cr.events[slot]) {
    const DriverApi& api = driver().api;
    CtxScope scope(api, cr.ctx);
    if (CUresult r = api.cuEventCreate(&cr.events[slot], CU_EVENT_DISABLE_TIMING); r != CUDA_SUCCESS) {
      cr.events[slot] = nullptr;
      return cuda_error("cuEventCreate", r);
    }
  }
  return cr.events[slot];
}

Status TransferPipeline::start_copy(Direction dir, TransferJob& j, std::size_t s) {
  const DriverApi& api = driver().api;
  const Slot& slot = slots_[s];
  Result<CUevent> ev = slot_event(slot.ctx, s);
  if (!ev) return std::move(ev).error();
  const CtxResources& cr = ctxs_[static_cast<std::size_t>(slot.ctx)];
  CtxScope scope(api, cr.ctx);
  CUresult r = dir == Direction::ToStorage
                   ? api.cuMemcpyDtoHAsync_v2(slots_.data(s), j.base + slot.offset, slot.length, cr.stream)
                   : api.cuMemcpyHtoDAsync_v2(j.base + slot.offset, slots_.data(s), slot.length, cr.stream);
  if (r == CUDA_SUCCESS) r = api.cuEventRecord(*ev, cr.stream);
  if (r != CUDA_SUCCESS) return cuda_error(copy_what(dir), r);
  return {};
}

Result<uint64_t> TransferPipeline::start_request(Direction dir, const TransferJob& j, std::size_t s) {
  const Slot& slot = slots_[s];
  const uint64_t id = session_.next_id();
  const proto::ChunkRef chunk{
      .slot = static_cast<uint32_t>(s), .length = slot.length, .blob = j.blob, .offset = j.blob_offset + slot.offset};
  const bool out = dir == Direction::ToStorage;
  const int e = j.object
                    ? (out ? session_.send(id, proto::StoreWrite{chunk}) : session_.send(id, proto::StoreRead{chunk}))
                    : (out ? session_.send(id, proto::Write{chunk}) : session_.send(id, proto::Read{chunk}));
  if (e < 0)
    return make_error(-e, fmt::format("cannot send {} to tmsdiskd: {}", dir == Direction::ToStorage ? "WRITE" : "READ",
                                      std::strerror(-e)));
  return id;
}

int TransferPipeline::next_message(proto::Envelope& env, bool copying) {
  if (!copying) return session_.receive(env, kTickMs);
  const int got = session_.receive(env, 0);
  if (got != 0) return got;
  const DriverApi& api = driver().api;
  for (std::size_t s = 0; s < slots_.count(); ++s) {
    if (slots_[s].state != SlotState::Copying) continue;
    (void)api.cuEventSynchronize(ctxs_[static_cast<std::size_t>(slots_[s].ctx)].events[s]);
    break;
  }
  return 0;
}

Status TransferPipeline::queue_local(Direction dir, TransferJob& j) {
  if (j.local_queued || j.place.empty()) return {};
  j.local_queued = true;
  const DriverApi& api = driver().api;
  const CtxResources& cr = ctxs_[static_cast<std::size_t>(j.ctx)];
  CtxScope scope(api, cr.ctx);
  const uint64_t chunk = slots_.chunk_bytes();
  const bool out = dir == Direction::ToStorage;
  // The host chunks, a copy per run: the k-th host chunk of the job lies at host + k * chunk.
  uint64_t k = 0;
  Status st = for_each_run(j, ChunkPlace::Host, [&](uint64_t first, uint64_t count) -> Status {
    const uint64_t from = first * chunk, to = std::min<uint64_t>((first + count) * chunk, j.size);
    uint8_t* host = j.host + k * chunk;
    k += count;
    const CUresult r = out ? api.cuMemcpyDtoHAsync_v2(host, j.base + from, to - from, cr.stream)
                           : api.cuMemcpyHtoDAsync_v2(j.base + from, host, to - from, cr.stream);
    if (r != CUDA_SUCCESS)
      return cuda_error(out ? "copying device memory to the host tier" : "copying the host tier to device memory", r);
    return {};
  });
  if (!st || out) return st;
  if (!api.cuMemsetD8Async) return make_error(ENOSYS, "the driver has no cuMemsetD8Async to set zero chunks");
  // One memset per run of zero chunks, queued before the chunks read back: they run in that order.
  return for_each_run(j, ChunkPlace::Zero, [&](uint64_t first, uint64_t count) -> Status {
    const uint64_t from = first * chunk, to = std::min<uint64_t>((first + count) * chunk, j.size);
    if (CUresult r = api.cuMemsetD8Async(j.base + from, 0, to - from, cr.stream); r != CUDA_SUCCESS)
      return cuda_error("setting zero chunks (cuMemsetD8Async)", r);
    return {};
  });
}

std::optional<Error> TransferPipeline::run_plain(Direction dir, std::vector<TransferJob>& jobs) {
  for (TransferJob& j : jobs) count_disk_chunks(j, slots_.chunk_bytes());
  TransferSteps steps;
  steps.finished = [](TransferJob&) -> Status { return {}; };
  ProgressReporter progress(&session_, 0);
  uint64_t done = 0;
  if (std::optional<Error> failed = run(dir, jobs, steps, progress, &done)) return failed;
  for (const TransferJob& j : jobs)
    if (j.error) return j.error;
  return std::nullopt;
}

Status TransferPipeline::drain(int ctx) {
  const DriverApi& api = driver().api;
  const CtxResources& cr = ctxs_[static_cast<std::size_t>(ctx)];
  CtxScope scope(api, cr.ctx);
  CUevent done = nullptr;
  CUresult r = api.cuEventCreate(&done, CU_EVENT_DISABLE_TIMING);
  if (r == CUDA_SUCCESS) r = api.cuEventRecord(done, cr.stream);
  if (r == CUDA_SUCCESS) r = api.cuEventSynchronize(done);
  if (done) api.cuEventDestroy_v2(done);
  if (r != CUDA_SUCCESS) return cuda_error("waiting for the host-tier copies and zero chunks", r);
  return {};
}

// One run of the pipeline: the state run() shares between its steps.
class TransferPipeline::Run {
 public:
  Run(TransferPipeline& p, Direction dir, std::vector<TransferJob>& jobs, const TransferSteps& steps,
      ProgressReporter& progress, uint64_t* done_bytes, uint64_t* unchanged_bytes)
      : p_(p),
        dir_(dir),
        out_(dir == Direction::ToStorage),
        chunk_bytes_(p.slots_.chunk_bytes()),
        jobs_(jobs),
        steps_(steps),
        progress_(progress),
        done_bytes_(done_bytes),
        unchanged_bytes_(unchanged_bytes) {}

  std::optional<Error> go() {
    *done_bytes_ = 0;
    if (unchanged_bytes_) *unchanged_bytes_ = 0;
    start_local();
    deal();
    last_activity_ = now_ms();
    for (;;) {
      start_chunks();
      const bool copying = harvest_copies();
      for (TransferJob& j : jobs_)
        if (j.error && j.in_flight == 0) abandon(j);
      if (!copying && !p_.slots_.any(SlotState::InDaemon)) {
        if (fatal_ || next_lane() < 0) break;
        if (p_.slots_.free_slot() < 0) {
          fail_all(
              make_error(EBUSY, "every staging slot is still held by an earlier request the daemon never answered"));
          break;
        }
        continue;
      }
      take_message(copying);
    }
    finish_local();
    progress_.update(*done_bytes_, true);
    return fatal_;
  }

 private:
  // The whole transfer stops: no new copy or request starts; what is in flight is still collected.
  void fail_all(Error e) {
    if (!fatal_) fatal_ = std::move(e);
  }
  // A failure in the path of one job stops everything, and the job carries the transfer's error.
  void fail(TransferJob& j, Error e) {
    fail_all(std::move(e));
    if (!j.error) j.error = *fatal_;
  }
  void free_slot(TransferJob& j, Slot& slot) {
    slot = Slot{};
    --j.in_flight;
  }
  // A job is done: its host chunks, which moved with it, count as done too.
  void finish(TransferJob& j) {
    if (Status st = steps_.finished(j); !st) return fail_all(std::move(st).error());
    j.complete = true;
    if (j.host) *done_bytes_ += place_bytes(j, ChunkPlace::Host, chunk_bytes_);
  }
  // A chunk's last step is done. A job finishes once all are, unless it failed (or, to storage,
  // anything failed: memory is released only while every step so far succeeded).
  void chunk_done(TransferJob& j, uint32_t len) {
    *done_bytes_ += len;
    if (++j.done != j.chunks || j.error || (out_ && fatal_)) return;
    finish(j);
  }
  // A failed job gives its memory back (from storage) once nothing queued for it still runs: its
  // host-tier copies and zero memsets are not tracked by slots.
  void abandon(TransferJob& j) {
    if (!steps_.abandoned) return;
    if (j.local_queued) (void)p_.drain(j.ctx);
    j.local_queued = false;
    steps_.abandoned(j);
  }

  // To storage, every job's host-tier copies go first, on its stream: its disk chunks' copies run
  // after them, so a job whose last disk chunk is acknowledged has its host chunks copied too.
  // Jobs with no disk chunk: to storage, done at once when nothing of them moves (the daemon recorded
  // their zero chunks with the reservation), else once their host-tier copies ran (at the end); from
  // storage, their memory is mapped, their host chunks copied back and zero chunks set, and they are
  // done once that ran (at the end).
  void start_local() {
    for (TransferJob& j : jobs_) {
      if (j.error || (out_ && fatal_)) continue;
      if (out_) {
        if (Status st = p_.queue_local(dir_, j); !st) {
          fail(j, std::move(st).error());
          continue;
        }
        if (j.chunks != 0) continue;
        if (j.host)
          only_local_.push_back(&j);
        else
          finish(j);
        continue;
      }
      if (j.chunks != 0) continue;
      Status st = steps_.before_copy ? steps_.before_copy(j) : Status{};
      if (st) st = p_.queue_local(dir_, j);
      if (!st) {
        j.error = std::move(st).error();
        abandon(j);
        continue;
      }
      only_local_.push_back(&j);
    }
  }

  // The disk chunks, job after job, each job's in address order. To storage they are dealt into
  // lanes, contiguous parts of that order, and each free slot goes to the lane that holds the fewest:
  // the daemon answers an unchanged chunk once hashed but a changed one only once written, so where
  // the changed chunks are clustered (a LoRA run's adapters in one region, a frozen base in the rest)
  // their lane waits on the disk while the other lanes' chunks are hashed, and the pause takes the
  // longer of the two instead of their sum. Each lane starts its part in address order. From storage
  // every chunk is read: one lane, in order.
  void deal() {
    const std::size_t count =
        out_ ? std::clamp<std::size_t>(p_.slots_.count() / kMinSlotsPerLane, 1, kMaxPauseLanes) : std::size_t{1};
    lanes_ = deal_lanes(jobs_, count, chunk_bytes_);
  }

  // The lane whose next chunk starts next: one with chunks left and the fewest slots copying or in
  // the daemon; -1 when every lane is done.
  int next_lane() {
    std::array<uint32_t, kMaxPauseLanes> held{};
    for (std::size_t s = 0; s < p_.slots_.count(); ++s) {
      const Slot& slot = p_.slots_[s];
      const bool busy = slot.state == SlotState::Copying || slot.state == SlotState::InDaemon;
      if (busy && slot.lane >= 0 && static_cast<std::size_t>(slot.lane) < lanes_.size())
        ++held[static_cast<std::size_t>(slot.lane)];
    }
    int best = -1;
    for (std::size_t k = 0; k < lanes_.size(); ++k)
      if (settle(lanes_[k], jobs_, chunk_bytes_) && (best < 0 || held[k] < held[static_cast<std::size_t>(best)]))
        best = static_cast<int>(k);
    return best;
  }

  // Starts chunks while slots are free: to storage with the copy out of the device; from storage
  // with the READ (reads need no device memory, so they start at once).
  void start_chunks() {
    while (!fatal_) {
      const int k = next_lane();
      if (k < 0) return;
      const int s = p_.slots_.free_slot();
      if (s < 0) return;
      Lane& lane = lanes_[static_cast<std::size_t>(k)];
      TransferJob& j = jobs_[lane.job];
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(chunk_bytes_, j.size - lane.offset));
      Slot& slot = p_.slots_[static_cast<std::size_t>(s)];
      slot = Slot{
          out_ ? SlotState::Copying : SlotState::InDaemon, 0, static_cast<int>(lane.job), lane.offset, len, j.ctx, k};
      Status started;
      if (out_ && !j.host_memory) {
        started = p_.start_copy(dir_, j, static_cast<std::size_t>(s));
      } else {
        // Host memory is copied into the slot here, at once: the chunk goes to the daemon now.
        if (out_) std::memcpy(p_.slots_.data(s), reinterpret_cast<const void*>(j.base + lane.offset), len);
        slot.state = SlotState::InDaemon;
        if (Result<uint64_t> id = p_.start_request(dir_, j, static_cast<std::size_t>(s)))
          slot.request = *id;
        else
          started = std::move(id).error();
      }
      if (!started) {
        slot = Slot{};
        fail_all(std::move(started).error());
        return;
      }
      --lane.left;
      lane.offset += chunk_bytes_;
      ++j.in_flight;
    }
  }

  // Harvests finished copies: to storage, the chunk goes to the daemon; from storage, it is done.
  // Whether a copy is still running.
  bool harvest_copies() {
    const DriverApi& api = driver().api;
    bool copying = false;
    for (std::size_t s = 0; s < p_.slots_.count(); ++s) {
      Slot& slot = p_.slots_[s];
      if (slot.state != SlotState::Copying) continue;
      TransferJob& j = jobs_[static_cast<std::size_t>(slot.job)];
      const CUresult q = api.cuEventQuery(p_.ctxs_[static_cast<std::size_t>(slot.ctx)].events[s]);
      if (q == CUDA_ERROR_NOT_READY) {
        copying = true;
        continue;
      }
      last_activity_ = now_ms();
      if (q != CUDA_SUCCESS) {
        fail(j, cuda_error(copy_what(dir_), q));
        free_slot(j, slot);
        continue;
      }
      if (!out_) {
        const uint32_t len = slot.length;
        free_slot(j, slot);
        chunk_done(j, len);
        continue;
      }
      if (fatal_) {
        free_slot(j, slot);
        continue;
      }
      Result<uint64_t> id = p_.start_request(dir_, j, s);
      if (!id) {
        fail_all(std::move(id).error());
        free_slot(j, slot);
        continue;
      }
      slot.state = SlotState::InDaemon;
      slot.request = *id;
    }
    return copying;
  }

  // The daemon's next answer, or a copy finishing, or silence.
  void take_message(bool copying) {
    proto::Envelope env;
    const int got = p_.next_message(env, copying);
    if (got < 0 || (got == 0 && !copying && now_ms() - last_activity_ > kReplyTimeoutMs)) return lose_daemon(got);
    if (got == 0) {
      progress_.update(*done_bytes_, false);
      return;  // a copy finished (harvest it), or a tick passed
    }
    last_activity_ = now_ms();
    const int s = p_.slots_.awaiting(env.request_id);
    if (s < 0) return p_.session_.other(env);
    answer(env, static_cast<std::size_t>(s));
    progress_.update(*done_bytes_, false);
  }

  // Connection gone (`got` < 0): whatever the daemon held is gone with it. Timed out: a slot is
  // freed only if its answer ever comes.
  void lose_daemon(int got) {
    const bool lost = got < 0;
    fail_all(
        lost ? make_error(-got, fmt::format("lost the connection to tmsdiskd during the {}", out_ ? "pause" : "resume"))
             : make_error(ETIMEDOUT, fmt::format("tmsdiskd did not answer within {} s", kReplyTimeoutMs / 1000)));
    for (std::size_t s = 0; s < p_.slots_.count(); ++s) {
      Slot& slot = p_.slots_[s];
      if (slot.state != SlotState::InDaemon) continue;
      TransferJob& j = jobs_[static_cast<std::size_t>(slot.job)];
      --j.in_flight;
      if (!j.error) j.error = *fatal_;
      if (lost)
        slot = Slot{};
      else
        slot.state = SlotState::Lost;
    }
    if (!lost) progress_.update(*done_bytes_, false);
  }

  // The daemon's answer for slot `s`.
  void answer(const proto::Envelope& env, std::size_t s) {
    Slot& slot = p_.slots_[s];
    TransferJob& j = jobs_[static_cast<std::size_t>(slot.job)];
    const bool answered =
        out_ ? std::holds_alternative<proto::Written>(env.body) : std::holds_alternative<proto::ReadDone>(env.body);
    if (answered && out_) {
      const uint32_t len = slot.length;
      if (unchanged_bytes_ && std::get<proto::Written>(env.body).unchanged) *unchanged_bytes_ += len;
      free_slot(j, slot);
      chunk_done(j, len);
      return;
    }
    if (answered && !j.error && !fatal_ && steps_.before_copy) {
      // From storage, a failure to get the memory affects this allocation only. Its host chunks are
      // copied back and its zero chunks set first, on the stream its chunks are copied on: done
      // when its last copy is.
      Status st = steps_.before_copy(j);
      if (st) st = p_.queue_local(dir_, j);
      if (!st) j.error = std::move(st).error();
    }
    if (answered && !j.error && !fatal_ && j.host_memory) {
      std::memcpy(reinterpret_cast<void*>(j.base + slot.offset), p_.slots_.data(s), slot.length);
      const uint32_t len = slot.length;
      free_slot(j, slot);
      chunk_done(j, len);
      return;
    }
    if (answered && !j.error && !fatal_) {
      Status copied = p_.start_copy(dir_, j, s);
      if (copied) {
        slot.state = SlotState::Copying;
        slot.request = 0;
        return;
      }
      fail(j, std::move(copied).error());
    } else if (const auto* err = std::get_if<proto::ErrorReply>(&env.body)) {
      refused(j, slot, *err);
    } else if (!answered) {
      fail_all(make_error(EPROTO, fmt::format("unexpected answer to {}", out_ ? "WRITE" : "READ")));
    }
    free_slot(j, slot);
  }

  // The daemon refused a chunk: to storage the whole transfer stops; from storage (checksum
  // mismatch EBADMSG, read error EIO...) only this job does, and it stays in storage.
  void refused(TransferJob& j, const Slot& slot, const proto::ErrorReply& err) {
    if (out_) return fail_all(make_error(err.code, fmt::format("tmsdiskd: {}", err.message)));
    if (j.error) return;
    j.error = make_error(err.code, fmt::format("blob {}: {}", j.blob, err.message));
    j.refused_offset = slot.offset;
    j.refusal = err.message;
    TMS_WARN("%s", j.error->message.c_str());
  }

  // The jobs with no disk chunk are done once what was queued for them ran; whatever did not
  // complete is unmapped by the caller, so nothing queued for it may still run.
  void finish_local() {
    std::vector<int> drained;
    for (TransferJob* j : only_local_) {
      if (fatal_) break;
      if (std::find(drained.begin(), drained.end(), j->ctx) == drained.end()) {
        if (Status st = p_.drain(j->ctx); !st) {
          fail_all(std::move(st).error());
          break;
        }
        drained.push_back(j->ctx);
      }
      finish(*j);
    }
    for (TransferJob& j : jobs_)
      if (j.local_queued && !j.complete && std::find(drained.begin(), drained.end(), j.ctx) == drained.end()) {
        (void)p_.drain(j.ctx);
        drained.push_back(j.ctx);
      }
  }

  TransferPipeline& p_;
  const Direction dir_;
  const bool out_;
  const uint32_t chunk_bytes_;
  std::vector<TransferJob>& jobs_;
  const TransferSteps& steps_;
  ProgressReporter& progress_;
  uint64_t* const done_bytes_;
  uint64_t* const unchanged_bytes_;
  std::optional<Error> fatal_;
  std::vector<Lane> lanes_;
  std::vector<TransferJob*> only_local_;
  int64_t last_activity_ = 0;
};

std::optional<Error> TransferPipeline::run(Direction dir, std::vector<TransferJob>& jobs, const TransferSteps& steps,
                                           ProgressReporter& progress, uint64_t* done_bytes,
                                           uint64_t* unchanged_bytes) {
  return Run(*this, dir, jobs, steps, progress, done_bytes, unchanged_bytes).go();
}

}  // namespace tmsdisk::shim
