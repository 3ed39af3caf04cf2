// SPDX-License-Identifier: Apache-2.0
// Chunk I/O: a shim's RESERVE, WRITE, READ and COMMIT against its rank store and the I/O engine.
// A WRITE or READ becomes one engine request on the session's staging slot; when it completes, the
// store seals what was written or verifies what was read, and the reply goes back to the shim. A
// WRITE whose bytes the rank's file already holds is answered at once, Written{.unchanged = 1},
// with no I/O (issue 9).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "io_engine.h"
#include "session_table.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

// Why a pause did not write some bytes (issue 9; the metrics count them by reason).
enum class SkipReason : std::size_t {
  zero,       // chunks all zero, named by the RESERVE: they take no disk space
  unchanged,  // the rank's file already held those very bytes
};

// An error reply, its text bounded by the protocol.
proto::ErrorReply error_reply(int code, const std::string& message);

class ChunkIo {
 public:
  // A session's reservation, being sent or in its store, holds at most this many blobs. It bounds
  // the daemon's memory for one session (about 16 bytes a blob while sent, 300 once reserved) for
  // root too; other users are bounded together by Config::max_blobs_per_uid.
  static constexpr std::size_t kMaxReserveBlobs = 1 << 20;
  // ... and at most this many chunks (about 24 bytes each once reserved), zero ones included: those
  // take no disk space, so nothing else would bound them for root. Other users: max_chunks_per_uid.
  static constexpr uint64_t kMaxReserveChunks = uint64_t{1} << 26;
  // ... and its zero runs, while being sent (24 bytes each), at most this many.
  static constexpr std::size_t kMaxReserveZeroRuns = std::size_t{1} << 22;

  ChunkIo(io::Engine& engine, SessionTable& sessions, uint32_t max_blobs_per_uid, uint32_t max_chunks_per_uid)
      : engine_(engine),
        sessions_(sessions),
        max_blobs_per_uid_(max_blobs_per_uid),
        max_chunks_per_uid_(max_chunks_per_uid) {}

  // Each returns the reply to send now.
  proto::Message reserve(Session& s, const proto::Reserve& m);
  proto::Message commit(Session& s, const proto::Commit& m);
  // What the rank's manifest says: a committed pause or not (the shim asks; it keeps no copy).
  proto::Message pause_state(Session& s);
  // nullopt when the request was queued: its reply comes from on_completions().
  std::optional<proto::Message> write(Session& s, uint64_t request_id, const proto::Write& m);
  std::optional<proto::Message> read(Session& s, uint64_t request_id, const proto::Read& m);

  // Reaps the engine's completions and hands each reply to `reply` (session, request id, message).
  // A session whose shim has gone is offered to SessionTable::maybe_destroy instead.
  void on_completions(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply);

  // Told each chunk written or read and checked, with its length (the metrics' moved bytes).
  std::function<void(io::Op, uint64_t)> on_moved;
  // Told the bytes a pause skipped: a reservation's zero chunks, each unchanged chunk.
  std::function<void(SkipReason, uint64_t)> on_skipped;

 private:
  struct Pending {
    uint64_t session_id = 0;
    uint64_t request_id = 0;
    io::Op op = io::Op::Write;
    uint32_t slot = 0;
    uint64_t blob = 0;
    uint64_t offset = 0;
    uint32_t length = 0;
    storage::Checksum128 sum;  // a write's, hashed before it started: sealed once it completes
  };

  std::optional<proto::Message> start(Session& s, uint64_t request_id, const proto::ChunkRef& m, io::Op op);
  proto::Message finish(Session& s, const Pending& p, int result);

  // Blobs and chunks the sessions of `uid` other than `except` have in reservations being sent, and
  // reserved.
  struct SetCounts {
    std::size_t pending_blobs = 0;
    std::size_t reserved_blobs = 0;
    uint64_t pending_chunks = 0;
    uint64_t reserved_chunks = 0;
  };
  SetCounts sets_of_uid(uid_t uid, uint64_t except);

  io::Engine& engine_;
  SessionTable& sessions_;
  uint32_t max_blobs_per_uid_;
  uint32_t max_chunks_per_uid_;
  std::map<uint64_t, Pending> pending_;  // by engine tag
  uint64_t next_tag_ = 1;
  std::vector<io::Completion> completions_;
};

}  // namespace tmsdisk::server
