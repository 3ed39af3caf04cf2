// SPDX-License-Identifier: Apache-2.0
// Chunk I/O (chunk_io.h).
#include "chunk_io.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstring>
#include <new>

namespace tmsdisk::server {
proto::ErrorReply error_reply(int code, const std::string& message) {
  proto::ErrorReply e;
  e.code = code > 0 ? code : EIO;
  e.message = message.substr(0, proto::kMaxTextLength);
  return e;
}

ChunkIo::SetCounts ChunkIo::sets_of_uid(uid_t uid, uint64_t except) {
  SetCounts n;
  for (auto& [sid, other] : sessions_.all()) {
    if (sid == except || other.cred.uid != uid) continue;
    n.pending_blobs += other.pending_reserve.size();
    n.reserved_blobs += other.store->blob_count();
    n.pending_chunks += other.pending_chunks;
    n.reserved_chunks += other.store->chunk_count() + object_chunks(other);
  }
  return n;
}

namespace {

// Reserving (fallocate, the manifest) and committing (fdatasync, the manifest) run on the event loop
// and cost file system time that no figure of the rank shows: a slow one is said in the log, with
// what it did, so that a pause's wall time can be taken apart. (The holes a reservation punches are
// punched after it, off the loop; the store logs how long that took, background_punch.h.)
constexpr double kSlowStorageSeconds = 0.1;

class StorageTimer {
 public:
  explicit StorageTimer(uint64_t session) : session_(session), start_(std::chrono::steady_clock::now()) {}
  void done(const char* what) const {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (s >= kSlowStorageSeconds)
      spdlog::info("session {}: {} took {:.2f} s", session_, what, s);
    else
      spdlog::debug("session {}: {} took {:.3f} s", session_, what, s);
  }

 private:
  uint64_t session_;
  std::chrono::steady_clock::time_point start_;
};

// a + b, or UINT64_MAX where that overflows (a count past every limit either way).
uint64_t add_saturated(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

// A chunk request goes to the rank's pause store or, for STORE_WRITE and STORE_READ, to its object
// store; both answer the same calls (object_store.h).
Result<storage::RankStore::Location> locate(Session& s, uint64_t blob, uint64_t offset, uint32_t length, io::Op op,
                                            bool object) {
  if (!object) return s.store->locate(blob, offset, length);
  if (!s.objects) return make_error(ENOENT, "no object is open on this session (STORE_OPEN first)");
  return op == io::Op::Write ? s.objects->locate_write(blob, offset, length)
                             : s.objects->locate_read(blob, offset, length);
}

}  // namespace

proto::Message ChunkIo::reserve(Session& s, const proto::Reserve& m) {
  if (s.io_in_flight) return error_reply(EBUSY, "RESERVE while chunks are still in flight");
  if (m.flags & proto::kReserveFirst) {
    s.pending_reserve.clear();
    s.pending_zero_runs.clear();
    s.pending_host_runs.clear();
    s.pending_carry.clear();
    s.pending_chunks = 0;
  }
  // A refused set is dropped whole (its memory with it): the shim starts again with kReserveFirst.
  auto refuse = [&](int code, std::string why) {
    std::vector<storage::BlobSize>().swap(s.pending_reserve);
    std::vector<storage::ChunkRun>().swap(s.pending_zero_runs);
    std::vector<storage::ChunkRun>().swap(s.pending_host_runs);
    std::vector<uint64_t>().swap(s.pending_carry);
    s.pending_chunks = 0;
    spdlog::warn("session {}: reservation refused: {}", s.id, why);
    return error_reply(code, why);
  };
  const std::size_t in_set = s.pending_reserve.size() + m.blobs.size();
  if (in_set > kMaxReserveBlobs)
    return refuse(E2BIG, fmt::format("more than {} blobs in one reservation; raise TMSDISK_MIN_BYTES so that fewer, "
                                     "larger allocations are paused",
                                     kMaxReserveBlobs));
  if (s.pending_zero_runs.size() + m.zero_runs.size() + s.pending_host_runs.size() + m.host_runs.size() >
      kMaxReserveZeroRuns)
    return refuse(E2BIG,
                  fmt::format("more than {} runs of zero or host-tier chunks in one reservation", kMaxReserveZeroRuns));
  // Carried blobs are blobs of the set (the store checks each at the last message): no more of them
  // than a set may hold.
  if (s.pending_carry.size() + m.carry.size() > kMaxReserveBlobs)
    return refuse(E2BIG, fmt::format("more than {} carried blobs in one reservation", kMaxReserveBlobs));
  const uint64_t chunk = s.store->chunk_bytes();
  uint64_t chunks_in_set = s.pending_chunks;
  for (const auto& b : m.blobs) chunks_in_set = add_saturated(chunks_in_set, b.size / chunk + (b.size % chunk != 0));
  if (chunks_in_set > kMaxReserveChunks)
    return refuse(E2BIG, fmt::format("more than {} chunks in one reservation; pause less at once, or use a larger "
                                     "chunk (TMS_DISK_BACKUP_CHUNK_MB)",
                                     kMaxReserveChunks));
  const bool limited = s.cred.uid != 0;
  const SetCounts others = limited ? sets_of_uid(s.cred.uid, s.id) : SetCounts{};
  // Pending and reserved sets are bounded separately: a rank reserving a new set holds both for a
  // while, and must not be refused for it.
  auto over_quota = [&](std::size_t total, const char* what) {
    return refuse(EDQUOT, fmt::format("uid {} would have {} allocations {}, more than {} (max-blobs-per-uid): pause "
                                      "fewer ranks at once, raise TMSDISK_MIN_BYTES so that fewer, larger allocations "
                                      "are paused, or ask the administrator to raise max-blobs-per-uid",
                                      s.cred.uid, total, what, max_blobs_per_uid_));
  };
  auto over_chunk_quota = [&](uint64_t total, const char* what) {
    return refuse(EDQUOT, fmt::format("uid {} would have {} chunks {}, more than {} (max-chunks-per-uid): pause fewer "
                                      "ranks or less memory at once, or ask the administrator to raise "
                                      "max-chunks-per-uid",
                                      s.cred.uid, total, what, max_chunks_per_uid_));
  };
  const bool last = m.flags & proto::kReserveLast;
  if (limited && others.pending_blobs + in_set > max_blobs_per_uid_)
    return over_quota(others.pending_blobs + in_set, "in reservations being sent");
  if (limited && last && others.reserved_blobs + in_set > max_blobs_per_uid_)
    return over_quota(others.reserved_blobs + in_set, "reserved");
  if (limited && add_saturated(others.pending_chunks, chunks_in_set) > max_chunks_per_uid_)
    return over_chunk_quota(add_saturated(others.pending_chunks, chunks_in_set), "in reservations being sent");
  // The rank's own objects count with what others reserved: a reservation replaces the rank's set, not them.
  const uint64_t kept = add_saturated(others.reserved_chunks, object_chunks(s));
  if (limited && last && add_saturated(kept, chunks_in_set) > max_chunks_per_uid_)
    return over_chunk_quota(add_saturated(kept, chunks_in_set), "reserved");
  // The wire's words become the store's here (storage.h).
  for (const auto& b : m.blobs) s.pending_reserve.push_back({.id = b.id, .size = b.size});
  auto add_runs = [](std::vector<storage::ChunkRun>& to, const std::vector<proto::ChunkRun>& from) {
    for (const auto& r : from) to.push_back({.blob = r.blob, .first_chunk = r.first_chunk, .count = r.count});
  };
  add_runs(s.pending_zero_runs, m.zero_runs);
  add_runs(s.pending_host_runs, m.host_runs);
  s.pending_carry.insert(s.pending_carry.end(), m.carry.begin(), m.carry.end());
  s.pending_chunks = chunks_in_set;
  if (!last) return proto::OkReply{};
  auto blobs = std::move(s.pending_reserve);
  auto zero_runs = std::move(s.pending_zero_runs);
  auto host_runs = std::move(s.pending_host_runs);
  auto carry = std::move(s.pending_carry);
  s.pending_reserve.clear();
  s.pending_zero_runs.clear();
  s.pending_host_runs.clear();
  s.pending_carry.clear();
  s.pending_chunks = 0;
  // The store checks the zero runs against the whole set (a run may name a blob of an earlier
  // message): refused, the set is dropped like any other refusal.
  const StorageTimer timer(s.id);
  auto st = s.store->reserve(blobs, zero_runs, host_runs, carry);
  timer.done("reserving the pause's disk space");
  if (!st) {
    spdlog::warn("session {}: reservation refused: {}", s.id, st.error().describe());
    return error_reply(st.error().errnum(), st.error().describe());
  }
  if (metrics_) metrics_->skipped(SkipReason::zero, s.store->zero_bytes(carry));  // carried ones were counted before
  return proto::OkReply{};
}

proto::Message ChunkIo::commit(Session& s, const proto::Commit& m) {
  if (s.io_in_flight) return error_reply(EBUSY, "COMMIT while chunks are still in flight");
  const StorageTimer timer(s.id);
  auto st = s.store->commit(static_cast<storage::CommitState>(m.state));
  timer.done(m.state == static_cast<uint8_t>(proto::CommitState::Paused) ? "committing a pause"
                                                                         : "committing a resume");
  if (!st) return error_reply(st.error().errnum(), st.error().describe());
  return proto::OkReply{};
}

proto::Message ChunkIo::pause_state(Session& s) {
  // "Paused" also while a lost record keeps the files: a rank with every allocation resident then
  // commits a resume (freeing them for its next pause), one with paused memory resumes it first.
  return proto::PauseStateReply{.paused = static_cast<uint8_t>(s.store->awaits_resume() ? 1 : 0),
                                .generation = s.store->generation()};
}

std::optional<proto::Message> ChunkIo::write(Session& s, uint64_t request_id, const proto::Write& m) {
  return start(s, request_id, m, io::Op::Write, false);
}

std::optional<proto::Message> ChunkIo::read(Session& s, uint64_t request_id, const proto::Read& m) {
  return start(s, request_id, m, io::Op::Read, false);
}

std::optional<proto::Message> ChunkIo::write(Session& s, uint64_t request_id, const proto::StoreWrite& m) {
  return start(s, request_id, m, io::Op::Write, true);
}

std::optional<proto::Message> ChunkIo::read(Session& s, uint64_t request_id, const proto::StoreRead& m) {
  return start(s, request_id, m, io::Op::Read, true);
}

// Shared validation of WRITE and READ; on success the slot is marked busy and the WRITE handed to a
// hash worker, or the READ queued (its chunk goes to a hash worker once read: on_completions()).
std::optional<proto::Message> ChunkIo::start(Session& s, uint64_t request_id, const proto::ChunkRef& m, io::Op op,
                                             bool object) {
  StagingBuffer& buf = *s.staging;
  if (m.slot >= buf.slot_count())
    return error_reply(ERANGE, fmt::format("slot {} out of range (session has {})", m.slot, buf.slot_count()));
  if (buf.busy(m.slot)) return error_reply(EBUSY, fmt::format("slot {} already has I/O in flight", m.slot));
  if (m.length > buf.chunk_bytes()) return error_reply(ERANGE, "chunk longer than a slot");
  if (object && !s.objects) return error_reply(ENOENT, "no object is open on this session (STORE_OPEN first)");
  // The pause store validates the chunk here; the object store when the WRITE opens a version of it
  // (locate_write() has nothing to say before) or the READ is opened.
  if (!object)
    if (auto loc = s.store->locate(m.blob, m.offset, m.length); !loc)
      return error_reply(loc.error().errnum(), loc.error().describe());
  const uint64_t tag = next_tag_++;
  Pending p{.session_id = s.id,
            .request_id = request_id,
            .op = op,
            .slot = m.slot,
            .object = object,
            .blob = m.blob,
            .offset = m.offset,
            .length = m.length,
            .ticket = {},
            .sum = {}};
  if (op == io::Op::Write) {
    // Hashed before it is written, by a hash worker (the WRITEs in flight side by side): bytes the
    // file already holds there are not written again (on_hashed()), and the hash of the others is
    // what end_write() seals. What the store found recorded for the chunk is taken now.
    auto ticket =
        object ? s.objects->open_write(m.blob, m.offset, m.length) : s.store->open_write(m.blob, m.offset, m.length);
    if (!ticket) return error_reply(ticket.error().errnum(), ticket.error().describe());
    p.ticket = *ticket;
    if (auto refused = queue_hash(s, tag, p)) return refused;
  } else {
    // A chunk never sealed is refused before any I/O; the data is verified once read.
    auto ticket =
        object ? s.objects->open_read(m.blob, m.offset, m.length) : s.store->open_read(m.blob, m.offset, m.length);
    if (!ticket) return error_reply(ticket.error().errnum(), ticket.error().describe());
    p.read_xxh64 = ticket->xxh64;
    if (auto refused = queue_io(s, tag, p)) return refused;
  }
  buf.set_busy(m.slot, true);
  ++s.io_in_flight;
  return std::nullopt;
}

std::optional<proto::Message> ChunkIo::commit_object(Session& s, uint64_t request_id, const proto::StoreCommit& m) {
  auto files = s.objects->begin_commit(m.handle, m.offset, m.length);
  if (!files) {
    spdlog::warn("session {}: {}", s.id, files.error().describe());
    return error_reply(files.error().errnum(), files.error().describe());
  }
  const uint64_t id = next_tag_++;
  try {
    ObjectCommit& c = commits_[id];
    c.session_id = s.id;
    c.request_id = request_id;
    c.range = m;
    for (const auto& f : *files) queue_flush(s, id, c, f);
  } catch (const std::bad_alloc&) {
    // Flushes already queued complete into a commit that is gone (on_completions() skips them).
    commits_.erase(id);
    return error_reply(ENOMEM, "daemon out of memory queueing a commit's flushes");
  }
  ++s.io_in_flight;
  return std::nullopt;
}

void ChunkIo::queue_flush(Session& s, uint64_t id, ObjectCommit& c, const storage::ObjectStore::FileToFlush& file) {
  const uint64_t tag = next_tag_++;
  c.files.emplace_back(tag, file.path);
  Pending p;
  p.session_id = s.id;
  p.request_id = c.request_id;
  p.op = io::Op::Sync;
  p.commit = id;
  pending_.emplace(tag, p);
  try {
    engine_.queue(io::Request{.op = io::Op::Sync, .fd = file.fd, .tag = tag});
  } catch (...) {
    pending_.erase(tag);
    throw;
  }
  ++c.flushes;
}

void ChunkIo::flushed(Session& s, uint64_t tag, const Pending& p, int result,
                      const std::function<void(Session&, uint64_t, const proto::Message&)>& reply) {
  auto it = commits_.find(p.commit);
  if (it == commits_.end()) return;
  ObjectCommit& c = it->second;
  if (result < 0 && c.error == 0) {
    c.error = result;
    for (const auto& [t, path] : c.files)
      if (t == tag) c.failed = path;
  }
  if (--c.flushes > 0) return;
  const proto::StoreCommit& r = c.range;
  std::optional<proto::Message> answer;
  if (!c.log && c.error != 0) {
    // The new versions may not be on disk: nothing is recorded, they stay pending (commit again or discard).
    answer = error_reply(-c.error, fmt::format("cannot flush {}: {}", c.failed, std::strerror(-c.error)));
  } else if (!c.log) {
    auto log = s.objects->write_commit(r.handle, r.offset, r.length);
    if (!log) {
      answer = error_reply(log.error().errnum(), log.error().describe());
    } else {
      c.log = true;
      c.files.clear();
      try {
        queue_flush(s, p.commit, c, *log);
        return;
      } catch (const std::bad_alloc&) {
        c.error = -ENOMEM;  // the record is cut off the log below, as after a failed flush
      }
    }
  }
  if (!answer) {
    Status st = s.objects->end_commit(r.handle, r.offset, r.length, c.error);
    answer =
        st ? proto::Message{proto::OkReply{}} : proto::Message{error_reply(st.error().errnum(), st.error().describe())};
  }
  if (const auto* refused = std::get_if<proto::ErrorReply>(&*answer))
    spdlog::warn("session {}: committing [{}, +{}) of object {}: {}", s.id, r.offset, r.length, r.handle,
                 refused->message);
  const uint64_t request_id = c.request_id;
  commits_.erase(it);
  --s.io_in_flight;
  if (s.conn_id == 0) {
    sessions_.maybe_destroy(s.id);
    return;
  }
  reply(s, request_id, *answer);
}

std::optional<proto::Message> ChunkIo::queue_io(Session& s, uint64_t tag, Pending p) {
  auto loc = locate(s, p.blob, p.offset, p.length, p.op, p.object);
  if (!loc) return error_reply(loc.error().errnum(), loc.error().describe());
  io::Request req;
  req.op = p.op;
  req.fd = loc->fd;
  req.buf = s.staging->slot(p.slot);
  req.buf_index = s.staging->buf_index();
  req.length = loc->io_length;
  req.offset = loc->file_offset;
  req.tag = tag;
  req.async = loc->in_memory;
  p.hashing = false;
  try {
    pending_.emplace(tag, p);
    engine_.queue(req);
  } catch (const std::bad_alloc&) {
    pending_.erase(tag);
    return error_reply(ENOMEM, "daemon out of memory queueing I/O");
  }
  return std::nullopt;
}

// The store seals a chunk once it is on disk; a READ comes here only when it failed (one read
// intact is verified by a hash worker first: settle_read()).
proto::Message ChunkIo::finish(Session& s, const Pending& p, int result) {
  const char* what = p.op == io::Op::Write ? "write" : "read";
  if (result < 0) {
    const int e = -result;
    spdlog::error("session {}: {} of blob {} at offset {} failed: {}", s.id, what, p.blob, p.offset, std::strerror(e));
    return error_reply(e,
                       fmt::format("{} of blob {} at offset {} failed: {}", what, p.blob, p.offset, std::strerror(e)));
  }
  if (p.op == io::Op::Write) {
    auto sum = p.object ? s.objects->end_write(p.blob, p.offset, p.length, p.sum)
                        : s.store->end_write(p.blob, p.offset, p.length, p.sum);
    if (!sum) {
      spdlog::error("session {}: cannot seal blob {} at offset {}: {}", s.id, p.blob, p.offset, sum.error().describe());
      return error_reply(sum.error().errnum(), sum.error().describe());
    }
    if (metrics_) metrics_->moved(p.op, p.length);
    return proto::Written{};
  }
  return error_reply(EIO, "internal: a READ's completion was not verified");  // on_completions() prevents it
}

std::optional<proto::Message> ChunkIo::queue_hash(Session& s, uint64_t tag, Pending p) {
  p.hashing = true;
  const bool xxh64 = p.op == io::Op::Write ? p.ticket.xxh64 : p.read_xxh64;
  bool queued = false;
  try {
    pending_.emplace(tag, p);
    queued = hashers_.submit({.tag = tag, .bytes = s.staging->slot(p.slot), .length = p.length, .xxh64 = xxh64});
  } catch (const std::bad_alloc&) {
    pending_.erase(tag);
    return error_reply(ENOMEM, "daemon out of memory queueing a chunk's hash");
  }
  if (!queued) {
    pending_.erase(tag);
    return error_reply(ESHUTDOWN, "the daemon is stopping");
  }
  return std::nullopt;
}

proto::Message ChunkIo::settle_read(Session& s, const Pending& p, const storage::Checksum128& sum) {
  auto verified = p.object ? s.objects->settle_read(p.blob, p.offset, p.length, sum)
                           : s.store->settle_read(p.blob, p.offset, p.length, sum);
  if (!verified) {
    spdlog::error("session {}: blob {} at offset {}: {}", s.id, p.blob, p.offset, verified.error().describe());
    return error_reply(verified.error().errnum(), verified.error().describe());
  }
  if (metrics_) metrics_->moved(p.op, p.length);
  return proto::ReadDone{};
}

bool ChunkIo::release(Session& s, const Pending& p) {
  s.staging->set_busy(p.slot, false);
  --s.io_in_flight;
  if (s.conn_id != 0) return true;
  sessions_.maybe_destroy(s.id);
  return false;
}

void ChunkIo::on_completions(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply) {
  completions_.clear();
  engine_.reap(completions_);
  for (const auto& done : completions_) {
    auto it = pending_.find(done.tag);
    if (it == pending_.end() || it->second.hashing) continue;
    const Pending p = it->second;
    pending_.erase(it);
    Session* s = sessions_.find(p.session_id);
    if (!s) continue;
    if (p.op == io::Op::Sync) {
      flushed(*s, done.tag, p, done.result, reply);
      continue;
    }
    if (p.op == io::Op::Read && done.result >= 0 && s->conn_id != 0) {
      // Read: a hash worker verifies it (on_hashed() answers); the slot stays busy meanwhile.
      auto refused = queue_hash(*s, done.tag, p);
      if (refused && release(*s, p)) reply(*s, p.request_id, *refused);
      continue;
    }
    if (release(*s, p)) reply(*s, p.request_id, finish(*s, p, done.result));
  }
}

void ChunkIo::on_hashed(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply) {
  hashed_.clear();
  hashers_.finished(hashed_);
  for (const auto& done : hashed_) {
    auto it = pending_.find(done.tag);
    if (it == pending_.end() || !it->second.hashing) continue;
    Pending p = it->second;
    pending_.erase(it);
    Session* s = sessions_.find(p.session_id);
    if (!s) continue;
    // A shim that has gone is answered nothing, and what its chunk holds stays unknown (open_write()).
    if (s->conn_id == 0) {
      release(*s, p);
      continue;
    }
    if (p.op == io::Op::Read) {
      const proto::Message answer = settle_read(*s, p, done.sum);
      if (release(*s, p)) reply(*s, p.request_id, answer);
      continue;
    }
    auto plan = p.object ? s->objects->settle_write(p.blob, p.offset, p.length, p.ticket, done.sum)
                         : s->store->settle_write(p.blob, p.offset, p.length, p.ticket, done.sum);
    std::optional<proto::Message> answer;
    if (!plan) {
      answer = error_reply(plan.error().errnum(), plan.error().describe());
    } else if (plan->unchanged) {
      if (metrics_) metrics_->skipped(SkipReason::unchanged, p.length);
      answer = proto::Written{.unchanged = 1};
    } else {
      p.sum = plan->sum;
      answer = queue_io(*s, done.tag, p);  // nullopt: queued, answered once written
    }
    if (!answer) continue;
    if (release(*s, p)) reply(*s, p.request_id, *answer);
  }
}

}  // namespace tmsdisk::server
