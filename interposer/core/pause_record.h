// SPDX-License-Identifier: Apache-2.0
// The rank's pause as tmsdiskd records it: the reservation of file extents for a pause (RESERVE), its
// commit or the resume's (COMMIT), and whether the daemon's manifest holds a committed pause
// (PAUSE_STATE). The manifest is the one record of that: the shim keeps no copy that could disagree
// with it (a resume whose commit failed left the two apart once).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "daemon_session.h"
#include "op_result.h"
#include "registry.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"
#include "transfer.h"

namespace tmsdisk::shim {

class PauseRecord {
 public:
  explicit PauseRecord(DaemonSession& session) : session_(session) {}

  // Asks the daemon for file extents for every disk chunk of `jobs`, recording their zero and host
  // chunks, and keeps `carried` blobs (paused already, another tag's) as the daemon stores them.
  // Refused: nothing changed.
  Status reserve(const std::vector<TransferJob>& jobs, const std::vector<std::shared_ptr<Allocation>>& carried = {});
  // The last step of a pause or resume: the daemon syncs the data and commits its manifest. `done`
  // says what already happened (for the message of a failure); `bytes` is what moved.
  OpResult commit(proto::CommitState state, uint64_t bytes, const char* done);
  // Whether the daemon's manifest holds a committed pause of this rank.
  Result<bool> committed();

 private:
  DaemonSession& session_;
};

}  // namespace tmsdisk::shim
