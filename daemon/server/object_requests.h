// SPDX-License-Identifier: Apache-2.0
// A rank's requests on its store of named objects (object_store.h) that are not chunk I/O:
// STORE_OPEN, STORE_COMMIT and STORE_REMOVE. Their chunks travel as STORE_WRITE and STORE_READ
// through ChunkIo, as a pause's do. The objects count against the user's max-chunks-per-uid with
// the chunks their pauses reserve: the daemon's memory for records is the same either way.
#pragma once

#include <cstdint>
#include <memory>

#include "object_store.h"
#include "session_table.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

class ObjectRequests {
 public:
  ObjectRequests(storage::Roots& roots, SessionTable& sessions, uint32_t max_chunks_per_uid)
      : roots_(roots), sessions_(sessions), max_chunks_per_uid_(max_chunks_per_uid) {}

  // Each returns the reply to send now.
  proto::Message open(Session& s, const proto::StoreOpen& m);
  proto::Message commit(Session& s, const proto::StoreCommit& m);
  proto::Message remove(Session& s, const proto::StoreRemove& m);

 private:
  storage::Roots& roots_;
  SessionTable& sessions_;
  uint32_t max_chunks_per_uid_;
};

}  // namespace tmsdisk::server
