// SPDX-License-Identifier: Apache-2.0
// The node's host-memory tier at run time (host_tier.h has its arithmetic and its memory): answers a
// pausing rank's TIER_ASK, hands over the memory the staging workers made for it, and takes memory
// that ranks kept after resuming back when a pausing rank needs it.
//
// Kept memory (host-tier-keep, on by default): making and pinning the tier's memory costs seconds for
// a few GiB (the kernel zeroes every page, CUDA walks every page), copying into it a fraction of one.
// A rank that resumed keeps its memory, mapped and registered, for its next pause (TIER_KEEP), and
// reuses it then (a TIER_GRANT with kTierReuse). Kept memory stays counted against the budget; when
// another rank's pause needs it, the daemon sends its holders TIER_RECLAIM and the ask waits (at most
// kReclaimWait) for their TIER_RELEASE. A rank that holds less than it could get now, or more than
// its fair share, is told to release first and ask again (kTierReleaseFirst), so that the sum never
// exceeds the budget, not even for a moment; a pausing rank waits for memory so on its way back as
// for reclaimed memory. Reclaims go first to the users who hold most beyond their part of the budget.
// Memory that holds paused chunks is never reclaimed: it is the only copy until the rank resumes. When the node runs
// short of memory (the sweep timer's check), kept memory is taken back too.
//
// Objects (kStoreOpenHost, object_requests.h): a new object of the rank's store lives in host-tier
// memory of its own, all of it or none, when the rank's fair share less what it holds already and the
// node have room; else on disk. Its memory counts against the rank's share before a pause's (a
// pause's grant is what is left), is never reclaimed nor kept for another use (it is the object's
// only copy), and goes back with the object or the session. A daemon that restarts counts it again
// when the rank hands it back (kStoreOpenHeld), as for paused chunks.
//
// Asked ahead (kTierAskAhead): with keep on, the memory is the rank's from its first pause on; a rank
// whose memory stopped growing asks for it before that pause, so that even the first one only copies.
// Such an ask takes only what is free (it never reclaims nor waits) and its memory is kept at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "host_tier.h"
#include "session_table.h"
#include "staging_workers.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

class TierBroker {
 public:
  using Send = std::function<void(uint64_t conn_id, uint64_t request_id, const proto::Message&, int fd)>;
  // How long a pausing rank's ask waits for kept memory to come back before it takes what is free.
  static constexpr std::chrono::milliseconds kReclaimWait{5000};
  // Objects of one rank that live in host-tier memory: each holds a descriptor of the daemon's, and
  // the daemon's descriptors are every user's. Past it, a new object lives on disk.
  static constexpr std::size_t kMaxHostObjectsPerRank = 1024;

  TierBroker(SessionTable& sessions, StagingWorkers& workers, bool keep, bool ahead, Send send)
      : sessions_(sessions), workers_(workers), keep_(keep), ahead_(keep && ahead), send_(std::move(send)) {}

  // TIER_ASK from `s` on its connection: answered now, once its memory is made (built()), or once kept
  // memory came back (expire()). `flags`: kTierAsk*.
  void ask(Session& s, uint64_t request_id, uint64_t bytes, uint8_t flags);
  void built(StagingWorkers::TierBuilt& t);
  void release(Session& s);  // TIER_RELEASE (the caller answers OK)
  void keep(Session& s);     // TIER_KEEP
  // TIER_ADOPT: `fd` is memory a daemon granted before this one started; it holds paused chunks.
  // Counted once per memfd, for a session continued from an earlier daemon's records, as much as those
  // records keep in host memory (host_tier.h). Takes `fd` only when it counts it.
  Status adopt(Session& s, UniqueFd& fd);
  // STORE_OPEN with kStoreOpenHost of the new object `name` (`bytes` long), whose answer so far is
  // `opened`: answered once its memory is made (built()), or now with host_bytes 0 (it lives on disk).
  void place_object(Session& s, uint64_t request_id, const std::string& name, uint64_t bytes,
                    const proto::StoreOpened& opened);
  // kStoreOpenHeld: `fd` is the memory object `name` (`bytes` long) lives in, handed back to a daemon
  // that did not count it; counted as the object's size, for an object the earlier daemon's records
  // held (once). Returns the bytes counted; takes `fd` only when it counts it.
  Result<uint64_t> adopt_object(Session& s, const std::string& name, uint64_t bytes, UniqueFd& fd);
  // The object was removed: its memory (if any) goes back.
  void remove_object(Session& s, const std::string& name);
  // Answers the asks waiting for kept memory once it is back or their wait is over. Returns ms until
  // the next such deadline, or -1 when none waits.
  int expire();
  // The sweep timer: when the node can spare nothing more, kept memory goes back.
  void check_memory();

 private:
  struct Waiting {
    uint64_t session_id = 0;
    uint64_t conn_id = 0;
    uint64_t request_id = 0;
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point deadline;
  };

  // The fair share of a rank of user `uid` (host_tier.h).
  FairShare share_of(uid_t uid) const;
  // ... of rank `s` for a pause: what its objects hold of it already is not its pause's.
  FairShare pause_share_of(const Session& s) const;
  void object_built(StagingWorkers::TierBuilt& t);
  TierPlan plan_for(const Session& s, uint64_t bytes) const;
  // The grant a fully free budget would give `s` now.
  uint64_t fair_ask(const Session& s, uint64_t bytes) const;
  // TIER_RECLAIM to ranks keeping memory (largest first) until `short_by` is covered; true while any
  // reclaim is outstanding.
  bool reclaim(const Session& asker, uint64_t short_by);
  void grant(Session& s, uint64_t request_id, TierPlan plan, uint64_t asked, bool ahead = false);
  void ask_ahead(Session& s, uint64_t request_id, uint64_t bytes);
  bool waits(uint64_t session_id) const;
  // The node's budget (host-tier-mb), as the session table holds it.
  uint64_t budget() const noexcept { return sessions_.host_tier_budget(); }

  SessionTable& sessions_;
  StagingWorkers& workers_;
  const bool keep_;
  const bool ahead_;  // host-tier-ahead (only with keep)
  Send send_;
  std::vector<Waiting> waiting_;
  // STORE_OPENED answers waiting for their object's memory, by session and request id.
  std::map<std::pair<uint64_t, uint64_t>, proto::StoreOpened> placing_;
};

}  // namespace tmsdisk::server
