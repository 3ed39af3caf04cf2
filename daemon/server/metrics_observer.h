// SPDX-License-Identifier: Apache-2.0
// What the chunk I/O and the control router report for the metrics (Metrics, metrics.h, implements
// it): a leaf, so that they do not include the metrics and the metrics include neither of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "io_engine.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::server {

// Why a pause did not write some bytes (the metrics count them by reason).
enum class SkipReason : std::size_t {
  zero,       // chunks all zero, named by the RESERVE: they take no disk space
  unchanged,  // the rank's file already held those very bytes
};

class MetricsObserver {
 public:
  virtual ~MetricsObserver() = default;

  // The control router's COMMANDs: `command_id` asked session `session_id` for `op`. Each is counted
  // once, by the rank's answer or by the loss of its connection, whichever comes first.
  virtual void command_sent(uint64_t command_id, uint64_t session_id, proto::CommandOp op) = 0;
  virtual void command_answered(uint64_t command_id, const proto::CommandDone& answer) = 0;
  virtual void session_lost(uint64_t session_id) = 0;

  // The chunk I/O's: a chunk written (a pause) or read (a resume), `bytes` long, completed and checked.
  virtual void moved(io::Op op, uint64_t bytes) = 0;
  // Bytes a pause did not write: zero chunks (at their reservation), and chunks the data file already
  // held (unchanged).
  virtual void skipped(SkipReason reason, uint64_t bytes) = 0;
};

}  // namespace tmsdisk::server
