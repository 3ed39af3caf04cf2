// SPDX-License-Identifier: Apache-2.0
// Chunk I/O: a shim's RESERVE, WRITE, READ and COMMIT against its rank store and the I/O engine.
// A WRITE or READ becomes one engine request on the session's staging slot; when it completes, the
// store seals what was written or verifies what was read, and the reply goes back to the shim. A
// WRITE is hashed first, by a hash worker (hash_workers.h), and one whose bytes the rank's file
// already holds is answered then, Written{.unchanged = 1}, with no I/O. A READ's chunk is
// hashed by a hash worker once read, and the store compares that sum with the one it sealed. From the
// request to its answer the slot is busy and counts as I/O in flight, hashing included.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hash_workers.h"
#include "io_engine.h"
#include "metrics_observer.h"
#include "session_table.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

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

  // `hash_threads`: the hash workers (at least one); `before_hash` (tests only) runs on one before
  // each chunk it hashes.
  ChunkIo(io::Engine& engine, SessionTable& sessions, uint32_t max_blobs_per_uid, uint32_t max_chunks_per_uid,
          unsigned hash_threads, std::function<void()> before_hash = {})
      : engine_(engine),
        sessions_(sessions),
        max_blobs_per_uid_(max_blobs_per_uid),
        max_chunks_per_uid_(max_chunks_per_uid),
        hashers_(hash_threads, std::move(before_hash)) {}

  // Each returns the reply to send now.
  proto::Message reserve(Session& s, const proto::Reserve& m);
  proto::Message commit(Session& s, const proto::Commit& m);
  // What the rank's manifest says: a committed pause or not (the shim asks; it keeps no copy).
  proto::Message pause_state(Session& s);
  // nullopt when the request was queued: its reply comes from on_completions().
  std::optional<proto::Message> write(Session& s, uint64_t request_id, const proto::Write& m);
  std::optional<proto::Message> read(Session& s, uint64_t request_id, const proto::Read& m);
  // The same for a chunk of one of the rank's objects (object_store.h): written to a new version of
  // the chunk that its range's STORE_COMMIT makes current, or read from the current one.
  std::optional<proto::Message> write(Session& s, uint64_t request_id, const proto::StoreWrite& m);
  std::optional<proto::Message> read(Session& s, uint64_t request_id, const proto::StoreRead& m);
  // STORE_COMMIT `request_id` of a range of one of the rank's objects (ObjectStore::begin_commit):
  // the data files its new versions lie in flushed, then the objects log with the range's record,
  // each through the engine (an fdatasync waits for the device: on the event loop, which serves every
  // rank, it would hold up them all), and the range current once both are. nullopt when the flushes
  // were queued (the reply comes from on_completions()), else the refusal to send now. The commit
  // counts as I/O in flight until it is done: nothing else changes the rank's objects meanwhile
  // (ObjectRequests refuses), and its session stays until then.
  std::optional<proto::Message> commit_object(Session& s, uint64_t request_id, const proto::StoreCommit& m);

  // Reaps the engine's completions and hands each reply to `reply` (session, request id, message).
  // A session whose shim has gone is offered to SessionTable::maybe_destroy instead.
  void on_completions(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply);
  // The same for the chunks hashed: WRITEs answered unchanged, or their write queued (its reply comes
  // from on_completions()); READs answered verified, or with the mismatch.
  void on_hashed(const std::function<void(Session&, uint64_t, const proto::Message&)>& reply);
  // Readable while on_hashed() has something to do (the event loop polls it).
  int hash_event_fd() const noexcept { return hashers_.event_fd(); }
  unsigned hash_threads() const noexcept { return hashers_.threads(); }
  // Waits for the chunks being hashed and stops the hash workers (the daemon stops: nothing reads a
  // staging buffer after this). Requests still waiting for a worker are never answered.
  void stop_hashing() noexcept { hashers_.stop(); }

  // Told each chunk written or read and checked (the metrics' moved bytes), and the bytes a pause
  // skipped: a reservation's zero chunks, each unchanged chunk. Null: nobody counts.
  void set_metrics(MetricsObserver* metrics) noexcept { metrics_ = metrics; }

 private:
  struct Pending {
    uint64_t session_id = 0;
    uint64_t request_id = 0;
    io::Op op = io::Op::Write;
    uint32_t slot = 0;
    bool object = false;  // a chunk of an object (blob is its handle), not of the pause store
    uint64_t blob = 0;
    uint64_t offset = 0;
    uint32_t length = 0;
    bool hashing = false;                    // with its hash worker (a WRITE before, a READ after its I/O)
    storage::RankStore::WriteTicket ticket;  // a WRITE's, from RankStore::open_write()
    bool read_xxh64 = false;                 // a READ's chunk is verified with XXH3-64 (RankStore::open_read())
    storage::Checksum128 sum;                // a write's, hashed before it started: sealed once it completes
    uint64_t commit = 0;                     // a flush (op Sync): its object commit, in commits_
  };
  // An object commit whose files are being flushed (commit_object()).
  struct ObjectCommit {
    uint64_t session_id = 0;
    uint64_t request_id = 0;
    proto::StoreCommit range;
    unsigned flushes = 0;                                 // queued and not completed
    bool log = false;                                     // the log's flush (after the data files')
    int error = 0;                                        // the first flush that failed: -errno
    std::string failed;                                   // ... of this file
    std::vector<std::pair<uint64_t, std::string>> files;  // engine tag -> file, of the flushes queued
  };

  std::optional<proto::Message> start(Session& s, uint64_t request_id, const proto::ChunkRef& m, io::Op op,
                                      bool object);
  // Queues the engine request of `p` under engine tag `tag`, and records it in pending_. nullopt on
  // success, else the error reply (nothing recorded).
  std::optional<proto::Message> queue_io(Session& s, uint64_t tag, Pending p);
  proto::Message finish(Session& s, const Pending& p, int result);
  // Queues the flush of `file` for object commit `id`.
  void queue_flush(Session& s, uint64_t id, ObjectCommit& c, const storage::ObjectStore::FileToFlush& file);
  // A flush of an object commit completed with `result`: its next step once every flush of this one is in.
  void flushed(Session& s, uint64_t tag, const Pending& p, int result,
               const std::function<void(Session&, uint64_t, const proto::Message&)>& reply);
  // Hands the slot of `p` to a hash worker (a WRITE's chunk before it is written, a READ's once read),
  // recording `p` under `tag`; nullopt when queued (on_hashed() goes on), else the error reply
  // (nothing recorded).
  std::optional<proto::Message> queue_hash(Session& s, uint64_t tag, Pending p);
  // The answer to a READ whose chunk hashed to `sum`: ReadDone, or the store's refusal.
  proto::Message settle_read(Session& s, const Pending& p, const storage::Checksum128& sum);
  // The slot of `p` is free again and the session has one request fewer in flight; false (and the
  // session offered to SessionTable::maybe_destroy) when its shim has gone, so nobody is answered.
  bool release(Session& s, const Pending& p);

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
  std::map<uint64_t, Pending> pending_;       // by tag: the engine's, or the hash worker's for a chunk being hashed
  std::map<uint64_t, ObjectCommit> commits_;  // by id
  uint64_t next_tag_ = 1;
  std::vector<io::Completion> completions_;
  std::vector<HashWorkers::Done> hashed_;
  // Its jobs read sessions' staging slots: the server stops it (stop_hashing(), or destroying this)
  // before the sessions go.
  HashWorkers hashers_;
  MetricsObserver* metrics_ = nullptr;
};

}  // namespace tmsdisk::server
