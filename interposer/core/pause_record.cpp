// SPDX-License-Identifier: Apache-2.0
// The rank's pause as tmsdiskd records it (pause_record.h).
#include "pause_record.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <variant>

namespace tmsdisk::shim {
namespace {

constexpr std::size_t kReserveBatch = 3000;  // blobs per RESERVE message (16 bytes each, < 64 KiB)

}  // namespace

Status PauseRecord::reserve(const std::vector<TransferJob>& jobs,
                            const std::vector<std::shared_ptr<Allocation>>& carried) {
  // Blobs and their runs of zero and host chunks, in messages of at most kReserveBatch entries; a run
  // follows its blob, in the same message or a later one. Carried blobs (paused already, another
  // tag's) are named in the set and in `carry`: the daemon keeps them as it stores them.
  proto::Reserve m;
  m.flags = proto::kReserveFirst;
  auto send = [&](bool last) -> Status {
    if (last) m.flags |= proto::kReserveLast;
    const uint64_t id = session_.next_id();
    proto::Envelope reply;
    if (int e = session_.send(id, m); e < 0)
      return make_error(-e, fmt::format("cannot send RESERVE: {}", std::strerror(-e)));
    if (Status st = session_.await_reply(id, reply); !st) return st;
    if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
      return make_error(err->code, "tmsdiskd refused the reservation: " + err->message);
    if (!std::holds_alternative<proto::OkReply>(reply.body)) return make_error(EPROTO, "unexpected answer to RESERVE");
    m = proto::Reserve{};
    return {};
  };
  auto full = [&] {
    return m.blobs.size() + m.zero_runs.size() + m.host_runs.size() + m.carry.size() >= kReserveBatch;
  };
  for (const auto& a : carried) {
    if (full())
      if (Status st = send(false); !st) return st;
    m.blobs.push_back({a->id, a->size});
    m.carry.push_back(a->id);
  }
  for (const TransferJob& j : jobs) {
    if (full())
      if (Status st = send(false); !st) return st;
    m.blobs.push_back({j.a->id, j.a->size});
    for (const ChunkPlace where : {ChunkPlace::Zero, ChunkPlace::Host}) {
      Status st = for_each_run(j, where, [&](uint64_t first, uint64_t count) -> Status {
        if (full())
          if (Status sent = send(false); !sent) return sent;
        (where == ChunkPlace::Zero ? m.zero_runs : m.host_runs).push_back({j.a->id, first, count});
        return {};
      });
      if (!st) return st;
    }
  }
  return send(true);
}

Result<bool> PauseRecord::committed() {
  const uint64_t id = session_.next_id();
  proto::Envelope reply;
  if (int e = session_.send(id, proto::PauseState{}); e < 0)
    return make_error(-e, fmt::format("cannot ask tmsdiskd for the pause state: {}", std::strerror(-e)));
  if (Status st = session_.await_reply(id, reply); !st) return std::move(st).error();
  if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
    return make_error(err->code, "tmsdiskd cannot tell the pause state: " + err->message);
  const auto* state = std::get_if<proto::PauseStateReply>(&reply.body);
  if (!state) return make_error(EPROTO, "unexpected answer to PAUSE_STATE");
  return state->paused != 0;
}

OpResult PauseRecord::commit(proto::CommitState state, uint64_t bytes, const char* done) {
  proto::Commit c;
  c.state = static_cast<uint8_t>(state);
  const uint64_t id = session_.next_id();
  proto::Envelope reply;
  const Status sent = [&]() -> Status {
    if (int e = session_.send(id, c); e < 0)
      return make_error(-e, fmt::format("cannot send COMMIT: {}", std::strerror(-e)));
    return session_.await_reply(id, reply);
  }();
  if (!sent)
    return OpResult{make_error(sent.error().errnum(), fmt::format("{}, but {}", done, sent.error().message)), bytes};
  if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
    return OpResult{make_error(err->code, fmt::format("{}, but the commit failed: {}", done, err->message)), bytes};
  return OpResult{{}, bytes};
}

}  // namespace tmsdisk::shim
