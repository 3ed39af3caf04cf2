// SPDX-License-Identifier: Apache-2.0
// The daemon's sessions: one per rank process, opened by HELLO within its user's quotas, with its
// rank store and staging buffer. A session whose connection drops while its files hold the only
// copy of its memory (or while it shares memory through legacy IPC) stays as an orphan until its
// rank reconnects with the session token (adoption) or exits.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "config.h"
#include "host_tier.h"
#include "ipc_exports.h"
#include "object_store.h"
#include "staging_buffer.h"
#include "staging_workers.h"
#include "storage.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

struct Session {
  uint64_t id = 0;
  uint64_t conn_id = 0;  // 0 once the shim disconnected (teardown waits for I/O in flight)
  uint64_t token = 0;
  ucred cred{};
  std::string job;
  int64_t rank = -1;
  std::string relative_dir;  // "<uid>/<job>/rank<R>-<pid>", what the sweep must not touch
  StagingPtr staging;        // null for an orphan
  // Staging counted against the quotas; an orphan keeps its charge (its rank may reconnect).
  uint64_t staging_charge = 0;
  std::size_t io_in_flight = 0;
  std::unique_ptr<storage::RankStore> store;
  // The directory of the rank's choosing its store lives in (HELLO's kHelloRankDir, SET_RANK_DIR), as
  // roots of one; null when it lives under the daemon's roots. roots_of() gives whichever it is.
  std::unique_ptr<storage::Roots> own_roots;
  // The rank's named objects (object_store.h), opened with its first STORE_OPEN, or with the session
  // when its files hold some already (a daemon restart); null until then. Its files live in the
  // rank's directory and go with it.
  std::unique_ptr<storage::ObjectStore> objects;
  uint64_t start_time = 0;  // of the rank's process, with cred.pid its identity
  UniqueFd pidfd;           // readable once the rank's process has exited (-1 on kernels without pidfd)
  bool orphan = false;      // connection gone, process alive, files hold its only copy: kept
  bool adopted = false;     // continues an orphan: its files, exports and opens carried over
  // When it became an orphan: `tmsctl status` says since when.
  uint64_t orphaned_unix_ms = 0;
  // A reservation being sent (RESERVE messages before the one with kReserveLast): its blobs, their
  // runs of zero and host-tier chunks, and its chunks (those included) as counted against
  // max-chunks-per-uid.
  std::vector<storage::BlobSize> pending_reserve;  // in the store's words (storage.h), as received
  std::vector<storage::ChunkRun> pending_zero_runs;
  std::vector<storage::ChunkRun> pending_host_runs;
  std::vector<uint64_t> pending_carry;  // blobs of the set being sent that stay paused as stored
  uint64_t pending_chunks = 0;
  // Host-tier memory the rank holds (granted, or handed back after a daemon restart) and a grant
  // being made for it (host_tier.h): both count against the node's budget until the rank releases it
  // or the session ends, and then the memory is taken back (revoke_tier_memory).
  TierMemory host_tier;
  uint64_t host_tier_pending = 0;
  // The session continues a rank's store from disk, left by an earlier daemon (not an orphan of this
  // one): the only kind that may hand host-tier memory back (TIER_ADOPT), once.
  bool from_earlier_daemon = false;
  bool host_tier_adopted = false;
  // That memory holds nothing now: the rank resumed and keeps it for its next pause (TIER_KEEP); and
  // the daemon asked for it back (TIER_RECLAIM) for another rank's pause (tier_broker.h).
  bool host_tier_kept = false;
  bool host_tier_reclaimed = false;
  bool host_tier_pending_ahead = false;  // the grant being made was asked for ahead of a pause: kept once made
  bool host_tier_releasing = false;      // told to release first (kTierReleaseFirst); its TIER_RELEASE is due
  // Host-tier memory the rank's objects live in (STORE_OPEN with kStoreOpenHost), by object name (a
  // handle is one store's, a name the rank's), and a grant being made for one: counted against the
  // node's budget and the rank's fair share before its pause memory, never reclaimed (the only copy
  // of the object), taken back when the object is removed or the session ends (tier_broker.h).
  std::map<std::string, TierMemory> object_memory;
  uint64_t object_memory_pending = 0;
  // Objects the earlier daemon's records held when this session continued them: the only ones whose
  // host-tier memory the rank may hand back (kStoreOpenHeld), each once.
  std::set<std::string> objects_held_before;
  proto::RankStats stats;
  std::map<uint64_t, uint64_t> commands;  // our Command request id -> control op id
};

// Chunks the objects of `s` count against max-chunks-per-uid (0 without objects).
inline uint64_t object_chunks(const Session& s) noexcept {
  return s.objects ? s.objects->chunk_count() : 0;
}

// Host-tier memory the objects of `s` live in, and that being made for one.
inline uint64_t object_host_bytes(const Session& s) noexcept {
  uint64_t bytes = s.object_memory_pending;
  for (const auto& [name, memory] : s.object_memory) bytes += memory.bytes;
  return bytes;
}

// The roots the rank's files are on: the directory it chose, or the daemon's own.
inline storage::Roots& roots_of(Session& s, storage::Roots& daemon_roots) noexcept {
  return s.own_roots ? *s.own_roots : daemon_roots;
}

// A client may act on sessions of its own uid; root on all.
inline bool may_act_on(uid_t client, const Session& s) {
  return client == 0 || client == s.cred.uid;
}

uint64_t random_token();
uint64_t unix_ms();

class SessionTable {
 public:
  // Epoll key of an orphan's pidfd: its session id with this bit set.
  static constexpr uint64_t kOrphanKeyBit = 1ull << 63;

  // `notify_users` tells an exporter how many processes have its legacy IPC export open now; `workers`
  // take back the host-tier memory of sessions that end.
  SessionTable(const Config& config, storage::Roots& roots, io::Engine& engine, IpcExports& ipc,
               StagingWorkers& workers, int epoll_fd, std::function<void(const IpcExports::Users&)> notify_users);

  // The staging buffer a HELLO asks for.
  struct StagingShape {
    uint32_t chunk_bytes = 0;
    uint32_t slot_count = 0;
  };

  // Opening the session HELLO asks for takes two steps, because its staging buffer is built off the
  // event loop (staging_workers.h) in between. begin_open(), for the peer `cred` on connection
  // `conn_id`: validates the job, backup directory and sizes, and enforces the per-user and
  // daemon-wide quotas, counting the sessions still being opened; the opening is charged from then
  // on, so HELLOs that arrive together cannot oversubscribe. Cheap: no file or buffer is made.
  // With kHelloRankDir, `dir` is the directory the rank chose (checked here: storage::Roots::
  // open_rank_directory), unless it is one of the daemon's roots.
  Result<StagingShape> begin_open(const ucred& cred, uint64_t conn_id, const proto::Hello& h, UniqueFd dir);
  // Once the buffer is built: adopts the orphan the rank reconnects to (same rank directory and
  // token), creates or adopts its store, and the session takes over the opening's charge. On an
  // error the opening is gone too (its buffer with it).
  Result<Session*> finish_open(uint64_t conn_id, StagingPtr staging);
  // The opening's buffer could not be built, or its connection closed first: its charge goes.
  void abandon_open(uint64_t conn_id);
  // The connections whose HELLO is being served, for a rank that `wanted` selects (its peer, job, rank).
  std::vector<uint64_t> openings_where(
      const std::function<bool(const ucred&, const std::string& job, int64_t rank)>& wanted) const;

  Session* find(uint64_t id);
  std::map<uint64_t, Session>& all() noexcept { return sessions_; }
  const std::map<uint64_t, Session>& all() const noexcept { return sessions_; }
  // Host-tier memory the sessions hold (in use or kept) and that is being made for them: what counts
  // against the node's budget (tier_broker.h).
  uint64_t host_tier_used() const noexcept;
  // The node's host-tier budget in bytes (host-tier-mb; 0: off), which every reader takes from here.
  uint64_t host_tier_budget() const noexcept { return config_.host_tier_bytes; }
  // No session, and none being opened.
  bool empty() const noexcept { return sessions_.empty() && openings_.empty(); }
  bool had_session() const noexcept { return had_session_; }

  // SET_RANK_DIR: the rank's files go to directory `dir` (`named` as the rank called it): a new, empty
  // store there, the old one's files removed. Refused (files where they were) while anything of the
  // rank is paused, being paused or resumed, or I/O of it is in flight, or while it stores objects.
  Status move_files(Session& s, UniqueFd dir, const std::string& named);

  // The shim's connection closed: the session goes once no I/O of it is in flight (the kernel may
  // still use its staging pages), its files with it, unless it becomes an orphan.
  void detach(uint64_t id);
  // Removes a detached session whose I/O is done, or keeps it as an orphan (see above).
  void maybe_destroy(uint64_t id);
  // An orphan's process exited (pidfd readable), or the sweep found it gone: its files go now.
  void reap_orphan(uint64_t id);
  // Reaps orphans whose process is gone, and IPC exports of sessions that vanished; returns the
  // relative directories the sweep must leave alone.
  std::set<std::string> reap_dead();

 private:
  // A HELLO between begin_open() and finish_open().
  struct Opening {
    ucred cred{};
    proto::Hello hello;
    storage::RankIdentity id;
    std::string relative_dir;
    uint32_t chunk_bytes = 0;
    uint64_t staging_charge = 0;
    UniqueFd pidfd;
    std::unique_ptr<storage::Roots> own_roots;  // the directory the rank chose, checked
  };

  // The roots a rank's directory `dir` (kHelloRankDir, SET_RANK_DIR) makes: null for one of the
  // daemon's roots (its usual layout), else the directory as roots of one, once checked.
  Result<std::unique_ptr<storage::Roots>> rank_chosen_roots(const ucred& cred, UniqueFd dir, const std::string& named);

  Status check_quotas(const ucred& cred, uint64_t staging) const;
  void forget_orphan(uint64_t id);
  static bool rank_alive(const Session& s);

  const Config& config_;
  storage::Roots& roots_;
  io::Engine& engine_;
  IpcExports& ipc_;
  StagingWorkers& workers_;
  int epoll_fd_;
  std::function<void(const IpcExports::Users&)> notify_users_;
  std::map<uint64_t, Session> sessions_;
  std::map<uint64_t, Opening> openings_;  // by connection id
  uint64_t next_id_ = 1;
  bool had_session_ = false;
};

}  // namespace tmsdisk::server
