// SPDX-License-Identifier: Apache-2.0
// Chunk I/O (chunk_io.h).
#include "chunk_io.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <new>

namespace tmsdisk::server {
proto::ErrorReply error_reply(int code, const std::string& message) {
  proto::ErrorReply e;
  e.code = code > 0 ? code : EIO;
  e.message = message.substr(0, proto::kMaxTextLength);
  return e;
}

ChunkIo::BlobCounts ChunkIo::blobs_of_uid(uid_t uid, uint64_t except) {
  BlobCounts n;
  for (auto& [sid, other] : sessions_.all()) {
    if (sid == except || other.cred.uid != uid) continue;
    n.pending += other.pending_reserve.size();
    n.reserved += other.store->blob_count();
  }
  return n;
}

proto::Message ChunkIo::reserve(Session& s, const proto::Reserve& m) {
  if (s.io_in_flight) return error_reply(EBUSY, "RESERVE while chunks are still in flight");
  if (m.flags & proto::kReserveFirst) s.pending_reserve.clear();
  // A refused set is dropped whole (its memory with it): the shim starts again with kReserveFirst.
  auto refuse = [&](int code, std::string why) {
    std::vector<proto::BlobSize>().swap(s.pending_reserve);
    spdlog::warn("session {}: reservation refused: {}", s.id, why);
    return error_reply(code, why);
  };
  const std::size_t in_set = s.pending_reserve.size() + m.blobs.size();
  if (in_set > kMaxReserveBlobs)
    return refuse(E2BIG, fmt::format("more than {} blobs in one reservation; raise TMSDISK_MIN_BYTES so that fewer, "
                                     "larger allocations are paused",
                                     kMaxReserveBlobs));
  const bool limited = s.cred.uid != 0;
  const BlobCounts others = limited ? blobs_of_uid(s.cred.uid, s.id) : BlobCounts{};
  // Pending and reserved blobs are bounded separately: a rank reserving a new set holds both for a
  // while, and must not be refused for it.
  auto over_quota = [&](std::size_t total, const char* what) {
    return refuse(EDQUOT, fmt::format("uid {} would have {} allocations {}, more than {} (max-blobs-per-uid): pause "
                                      "fewer ranks at once, raise TMSDISK_MIN_BYTES so that fewer, larger allocations "
                                      "are paused, or ask the administrator to raise max-blobs-per-uid",
                                      s.cred.uid, total, what, max_blobs_per_uid_));
  };
  if (limited && others.pending + in_set > max_blobs_per_uid_)
    return over_quota(others.pending + in_set, "in reservations being sent");
  if (limited && (m.flags & proto::kReserveLast) && others.reserved + in_set > max_blobs_per_uid_)
    return over_quota(others.reserved + in_set, "reserved");
  s.pending_reserve.insert(s.pending_reserve.end(), m.blobs.begin(), m.blobs.end());
  if (!(m.flags & proto::kReserveLast)) return proto::OkReply{};
  auto blobs = std::move(s.pending_reserve);
  s.pending_reserve.clear();
  if (auto st = s.store->reserve(blobs); !st) {
    spdlog::warn("session {}: reservation refused: {}", s.id, st.error().describe());
    return error_reply(st.error().errnum(), st.error().describe());
  }
  return proto::OkReply{};
}

proto::Message ChunkIo::commit(Session& s, const proto::Commit& m) {
  if (s.io_in_flight) return error_reply(EBUSY, "COMMIT while chunks are still in flight");
  if (auto st = s.store->commit(static_cast<proto::CommitState>(m.state)); !st)
    return error_reply(st.error().errnum(), st.error().describe());
  return proto::OkReply{};
}

proto::Message ChunkIo::pause_state(Session& s) {
  // "Paused" also while a lost record keeps the files: a rank with every allocation resident then
  // commits a resume (freeing them for its next pause), one with paused memory resumes it first.
  return proto::PauseStateReply{.paused = static_cast<uint8_t>(s.store->awaits_resume() ? 1 : 0),
                                .generation = s.store->generation()};
}

std::optional<proto::Message> ChunkIo::write(Session& s, uint64_t request_id, const proto::Write& m) {
  return start(s, request_id, m, io::Op::Write);
}

std::optional<proto::Message> ChunkIo::read(Session& s, uint64_t request_id, const proto::Read& m) {
  return start(s, request_id, m, io::Op::Read);
}

// Shared validation of WRITE and READ; on success the slot is marked busy and the I/O queued.
std::optional<proto::Message> ChunkIo::start(Session& s, uint64_t request_id, const proto::ChunkRef& m, io::Op op) {
  StagingBuffer& buf = *s.staging;
  if (m.slot >= buf.slot_count())
    return error_reply(ERANGE, fmt::format("slot {} out of range (session has {})", m.slot, buf.slot_count()));
  if (buf.busy(m.slot)) return error_reply(EBUSY, fmt::format("slot {} already has I/O in flight", m.slot));
  if (m.length > buf.chunk_bytes()) return error_reply(ERANGE, "chunk longer than a slot");
  auto loc = s.store->locate(m.blob, m.offset, m.length);
  if (!loc) return error_reply(loc.error().errnum(), loc.error().describe());
  if (op == io::Op::Read) {
    // A chunk never sealed is refused before any I/O; the store verifies the data once read.
    if (auto sealed = s.store->expected_checksum(m.blob, m.offset); !sealed)
      return error_reply(sealed.error().errnum(), sealed.error().describe());
  }
  io::Request req;
  req.op = op;
  req.fd = loc->fd;
  req.buf = buf.slot(m.slot);
  req.buf_index = buf.buf_index();
  req.length = loc->io_length;
  req.offset = loc->file_offset;
  req.tag = next_tag_++;
  try {
    engine_.queue(req);
  } catch (const std::bad_alloc&) {
    return error_reply(ENOMEM, "daemon out of memory queueing I/O");
  }
  pending_.emplace(req.tag, Pending{s.id, request_id, op, m.slot, m.blob, m.offset, m.length});
  buf.set_busy(m.slot, true);
  ++s.io_in_flight;
  return std::nullopt;
}

// The store seals a chunk once it is on disk and verifies one once it is back in the slot.
proto::Message ChunkIo::finish(Session& s, const Pending& p, int result) {
  const char* what = p.op == io::Op::Write ? "write" : "read";
  if (result < 0) {
    const int e = -result;
    spdlog::error("session {}: {} of blob {} at offset {} failed: {}", s.id, what, p.blob, p.offset, std::strerror(e));
    return error_reply(e,
                       fmt::format("{} of blob {} at offset {} failed: {}", what, p.blob, p.offset, std::strerror(e)));
  }
  const auto bytes = s.staging->bytes_of(p.slot, p.length);
  if (p.op == io::Op::Write) {
    auto sum = s.store->seal(p.blob, p.offset, bytes);
    if (!sum) {
      spdlog::error("session {}: cannot seal blob {} at offset {}: {}", s.id, p.blob, p.offset, sum.error().describe());
      return error_reply(sum.error().errnum(), sum.error().describe());
    }
    if (on_moved) on_moved(p.op, p.length);
    return proto::Written{};
  }
  auto sum = s.store->verify(p.blob, p.offset, bytes);
  if (!sum) {
    spdlog::error("session {}: blob {} at offset {}: {}", s.id, p.blob, p.offset, sum.error().describe());
    return error_reply(sum.error().errnum(), sum.error().describe());
  }
  if (on_moved) on_moved(p.op, p.length);
  return proto::ReadDone{};
}

void ChunkIo::on_completions(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply) {
  completions_.clear();
  engine_.reap(completions_);
  for (const auto& done : completions_) {
    auto it = pending_.find(done.tag);
    if (it == pending_.end()) continue;
    const Pending p = it->second;
    pending_.erase(it);
    Session* s = sessions_.find(p.session_id);
    if (!s) continue;
    s->staging->set_busy(p.slot, false);
    --s->io_in_flight;
    if (s->conn_id == 0) {
      sessions_.maybe_destroy(s->id);
      continue;
    }
    reply(*s, p.request_id, finish(*s, p, done.result));
  }
}

}  // namespace tmsdisk::server
