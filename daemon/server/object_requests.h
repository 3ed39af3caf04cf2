// SPDX-License-Identifier: Apache-2.0
// A rank's requests on its store of named objects (object_store.h) that are not chunk I/O:
// STORE_OPEN (with the object's host-tier memory, through the tier broker), STORE_COMMIT and
// STORE_REMOVE. Their chunks travel as STORE_WRITE and STORE_READ
// through ChunkIo, as a pause's do. The objects count against the user's max-chunks-per-uid with
// the chunks their pauses reserve: the daemon's memory for records is the same either way.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "chunk_io.h"
#include "object_store.h"
#include "session_table.h"
#include "tier_broker.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

class ObjectRequests {
 public:
  ObjectRequests(storage::Roots& roots, SessionTable& sessions, TierBroker& tier, uint32_t max_chunks_per_uid)
      : roots_(roots), sessions_(sessions), tier_(tier), max_chunks_per_uid_(max_chunks_per_uid) {}

  // STORE_OPEN `request_id`: the object opened (made when new), then its host-tier memory placed
  // (kStoreOpenHost: the tier broker answers once it is made, or now when the object lives on disk)
  // or counted again after a daemon restart (kStoreOpenHeld: `fd` is that memory). The reply to send
  // now; none when the tier broker answers.
  std::optional<proto::Message> open(Session& s, uint64_t request_id, const proto::StoreOpen& m, UniqueFd& fd);
  // STORE_COMMIT `request_id`: a discard now; a commit through `chunks` (ChunkIo::commit_object), which
  // answers once its files are flushed. The reply to send now, if any.
  std::optional<proto::Message> commit(Session& s, uint64_t request_id, const proto::StoreCommit& m, ChunkIo& chunks);
  // The reply to send now.
  proto::Message remove(Session& s, const proto::StoreRemove& m);  // its host-tier memory goes back too

 private:
  // The object on disk, made when new: STORE_OPENED, or the refusal.
  proto::Message open_on_disk(Session& s, const proto::StoreOpen& m);

  storage::Roots& roots_;
  SessionTable& sessions_;
  TierBroker& tier_;
  uint32_t max_chunks_per_uid_;
};

}  // namespace tmsdisk::server
