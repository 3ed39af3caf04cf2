// SPDX-License-Identifier: Apache-2.0
// What a pause or resume did (OpResult): shared by the engine that runs it and the control thread
// that answers whoever asked.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "tmsdisk/common/result.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

// What a pause or resume did: failed (with why) or not; the bytes that moved all the same (a failed
// pause: what it released), and what is worth saying of a success. A no-op (the rank was already in
// the state asked for) is a success that says which state ("already paused").
struct OpResult {
  OpResult() = default;
  OpResult(Status s, uint64_t moved = 0, uint64_t took = 0, std::string what = {})
      : status(std::move(s)), bytes(moved), nanos(took), note(std::move(what)) {}
  static OpResult no_op(std::string state) {
    OpResult r({}, 0, 0, std::move(state));
    r.outcome = proto::Outcome::NoOp;
    return r;
  }

  Status status;
  uint64_t bytes = 0;
  uint64_t nanos = 0;
  std::string note;
  proto::Outcome outcome = proto::Outcome::Done;
  proto::Skipped skipped;  // of `bytes`, what did not move (zero chunks, unchanged chunks)

  int code() const noexcept { return status ? 0 : status.error().errnum(); }
  const std::string& message() const noexcept { return status ? note : status.error().message; }
};

}  // namespace tmsdisk::shim
