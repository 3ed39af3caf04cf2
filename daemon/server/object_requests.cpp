// SPDX-License-Identifier: Apache-2.0
// STORE_OPEN, STORE_COMMIT and STORE_REMOVE (object_requests.h).
#include "object_requests.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cerrno>

#include "chunk_io.h"

namespace tmsdisk::server {
namespace {

uint64_t chunks_of(uint64_t bytes, uint64_t chunk) noexcept {
  return bytes / chunk + (bytes % chunk != 0);
}

proto::Message refusal(const Session& s, const Error& e) {
  spdlog::warn("session {}: {}", s.id, e.describe());
  return error_reply(e.errnum(), e.describe());
}

void warn(const std::string& what) {
  spdlog::warn("{}", what);
}

}  // namespace

std::optional<proto::Message> ObjectRequests::open(Session& s, uint64_t request_id, const proto::StoreOpen& m,
                                                   UniqueFd& fd) {
  proto::Message reply = open_on_disk(s, m);
  auto* opened = std::get_if<proto::StoreOpened>(&reply);
  if (!opened || m.flags == 0) return reply;
  if (m.flags == proto::kStoreOpenHost) {
    tier_.place_object(s, request_id, m.name, m.size, *opened);
    return std::nullopt;
  }
  if (!fd) return error_reply(EINVAL, "STORE_OPEN with kStoreOpenHeld without the object's memory");
  auto counted = tier_.adopt_object(s, m.name, m.size, fd);
  if (!counted) return refusal(s, counted.error());
  opened->host_bytes = *counted;
  return reply;
}

proto::Message ObjectRequests::open_on_disk(Session& s, const proto::StoreOpen& m) {
  if (!s.objects) {
    auto opened = storage::ObjectStore::open(roots_of(s, roots_), s.store->dir_fds(), s.store->file_names(),
                                             s.store->chunk_bytes(), warn);
    if (!opened) return refusal(s, opened.error());
    s.objects = std::move(*opened);
  }
  // A new object counts against the user's chunks before it is recorded: refused here, nothing of
  // it exists, and no byte of it ever moves.
  const bool exists = s.objects->contains(m.name);
  const uint64_t adding = chunks_of(m.size, s.store->chunk_bytes()) + storage::kObjectOverheadChunks;
  // The daemon keeps 24 bytes for each chunk of an object: one rank's objects are bounded for root
  // too, as one reservation is.
  if (!exists && s.objects->chunk_count() + adding > ChunkIo::kMaxReserveChunks)
    return refusal(s, make_error(E2BIG, fmt::format("object '{}' ({} bytes) would make the rank's objects more than "
                                                    "{} chunks: store less, or use a larger chunk "
                                                    "(TMS_DISK_BACKUP_CHUNK_MB)",
                                                    m.name, m.size, ChunkIo::kMaxReserveChunks)));
  if (s.cred.uid != 0 && !exists) {
    uint64_t held = 0;
    for (auto& [sid, other] : sessions_.all()) {
      if (other.cred.uid != s.cred.uid) continue;
      held += other.store->chunk_count() + other.pending_chunks + object_chunks(other);
    }
    if (held + adding > max_chunks_per_uid_)
      return refusal(s,
                     make_error(EDQUOT, fmt::format("uid {} would hold {} chunks with object '{}' ({} bytes), more "
                                                    "than {} (max-chunks-per-uid): store less, remove objects no "
                                                    "longer needed, or ask the administrator to raise "
                                                    "max-chunks-per-uid",
                                                    s.cred.uid, held + adding, m.name, m.size, max_chunks_per_uid_)));
  }
  auto handle = s.objects->open_object(m.name, m.size);
  if (!handle) return refusal(s, handle.error());
  return proto::StoreOpened{.handle = *handle, .created = static_cast<uint8_t>(exists ? 0 : 1)};
}

std::optional<proto::Message> ObjectRequests::commit(Session& s, uint64_t request_id, const proto::StoreCommit& m,
                                                     ChunkIo& chunks) {
  if (!s.objects) return error_reply(ENOENT, "no object is open on this session (STORE_OPEN first)");
  // A chunk still in flight may be one of the range: its extent must stay as it is under the engine.
  // (Another commit's flushes count as in flight too: one commit at a time.)
  if (s.io_in_flight) return error_reply(EBUSY, "STORE_COMMIT while chunks are still in flight");
  if (!(m.flags & proto::kStoreDiscard)) return chunks.commit_object(s, request_id, m);
  if (Status st = s.objects->discard_range(m.handle, m.offset, m.length); !st) return refusal(s, st.error());
  return proto::OkReply{};
}

proto::Message ObjectRequests::remove(Session& s, const proto::StoreRemove& m) {
  if (!s.objects) return error_reply(ENOENT, fmt::format("no object '{}'", m.name));
  // A chunk in flight may be one of it: its extent must not be freed under the engine.
  if (s.io_in_flight) return error_reply(EBUSY, "STORE_REMOVE while chunks are still in flight");
  if (Status st = s.objects->remove_object(m.name); !st) return refusal(s, st.error());
  tier_.remove_object(s, m.name);
  return proto::OkReply{};
}

}  // namespace tmsdisk::server
