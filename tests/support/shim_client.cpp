// SPDX-License-Identifier: Apache-2.0
// The shim-role test client (shim_client.h).
#include "shim_client.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::testing {

ShimClient::ShimClient(ShimClient&& o) noexcept
    : fd_(std::move(o.fd_)),
      staging_(std::exchange(o.staging_, nullptr)),
      welcome_(o.welcome_),
      next_request_(o.next_request_) {}

ShimClient& ShimClient::operator=(ShimClient&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::move(o.fd_);
    staging_ = std::exchange(o.staging_, nullptr);
    welcome_ = o.welcome_;
    next_request_ = o.next_request_;
  }
  return *this;
}

ShimClient::~ShimClient() {
  close();
}

void ShimClient::close() {
  if (staging_) ::munmap(staging_, welcome_.staging_budget_bytes);
  staging_ = nullptr;
  fd_.reset();
}

Result<ShimClient> ShimClient::connect(const std::string& socket, const Options& o) {
  proto::Hello h;
  h.role = static_cast<uint8_t>(proto::Role::Shim);
  h.job = o.job;
  h.rank = o.rank;
  h.staging_budget_bytes = o.staging_budget_bytes;
  h.chunk_bytes = o.chunk_bytes;
  h.token = o.token;
  h.backup_dir = o.backup_dir;
  if (o.dir_fd >= 0) h.flags |= proto::kHelloRankDir;
  // A generous limit: a daemon that never answers fails the test with a reason, not a CTest timeout.
  auto reply = proto::connect_and_hello(socket, h, 60'000, o.dir_fd);
  if (!reply) return make_error(reply.error, reply.message);
  UniqueFd staging_fd(std::exchange(reply.fd, -1));
  if (!staging_fd) return make_error(EPROTO, "WELCOME without the staging memfd");
  ShimClient c;
  c.fd_.reset(std::exchange(reply.sock, -1));
  c.welcome_ = reply.welcome;
  c.next_request_ = 2;  // HELLO was request 1
  void* p = ::mmap(nullptr, c.welcome_.staging_budget_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, staging_fd.get(), 0);
  if (p == MAP_FAILED) return errno_error("mmap staging");
  c.staging_ = static_cast<uint8_t*>(p);
  return c;
}

Result<uint64_t> ShimClient::send(const proto::Message& m, int fd) {
  const uint64_t id = next_request_++;
  auto bytes = proto::encode(id, m);
  if (bytes.empty()) return make_error(EINVAL, "encode failed");
  if (int rc = proto::send_message(fd_.get(), bytes, fd); rc < 0) return make_error(-rc, "send");
  return id;
}

Result<proto::Envelope> ShimClient::receive(UniqueFd* fd) {
  std::vector<uint8_t> buf;
  int passed = -1;
  long n = proto::recv_message(fd_.get(), buf, &passed);
  UniqueFd owned(passed);
  if (fd) *fd = std::move(owned);
  if (n == 0) return make_error(ECONNRESET, "daemon closed the connection");
  if (n < 0) return make_error(static_cast<int>(-n), "recv");
  auto d = proto::decode(buf);
  if (!d.envelope) return make_error(d.code, d.error);
  return std::move(*d.envelope);
}

Result<proto::Message> ShimClient::call(const proto::Message& m, int fd, UniqueFd* reply_fd) {
  auto id = send(m, fd);
  if (!id) return std::move(id).error();
  for (;;) {
    auto env = receive(reply_fd);
    if (!env) return std::move(env).error();
    if (env->request_id == 0) {
      notices_.push_back(std::move(*env));
      continue;
    }
    if (env->request_id != *id) return make_error(EPROTO, "answer to another request");
    if (auto* e = std::get_if<proto::ErrorReply>(&env->body)) return make_error(e->code, e->message);
    return std::move(env->body);
  }
}

Status ShimClient::reserve(const std::vector<proto::BlobSize>& blobs) {
  return reserve(blobs, {});
}

Status ShimClient::reserve(const std::vector<proto::BlobSize>& blobs, const std::vector<proto::ChunkRun>& zero_runs) {
  proto::Reserve r;
  r.flags = proto::kReserveFirst | proto::kReserveLast;
  r.blobs = blobs;
  r.zero_runs = zero_runs;
  auto reply = call(r);
  if (!reply) return std::move(reply).error();
  return {};
}

Status ShimClient::commit(proto::CommitState state) {
  proto::Commit c;
  c.state = static_cast<uint8_t>(state);
  auto reply = call(c);
  if (!reply) return std::move(reply).error();
  return {};
}

namespace {

// Runs chunk requests over every blob with all slots busy. `before(slot, blob, off, len)` prepares a
// slot before a request; `after(...)` consumes it once answered.
template <class Req, class Before, class After>
Status pipeline(ShimClient& c, const std::vector<proto::BlobSize>& blobs, Before before, After after) {
  const uint32_t chunk_bytes = c.welcome().chunk_bytes;
  std::vector<uint32_t> free_slots;
  for (uint32_t i = c.welcome().slot_count; i-- > 0;) free_slots.push_back(i);
  struct InFlight {
    uint32_t slot;
    uint64_t blob, offset;
    uint32_t len;
  };
  std::map<uint64_t, InFlight> in_flight;
  std::optional<Error> first_error;
  auto reap_one = [&]() -> Status {
    auto env = c.receive();
    if (!env) return std::move(env).error();
    auto it = in_flight.find(env->request_id);
    if (it == in_flight.end()) return make_error(EPROTO, "answer to an unknown request");
    InFlight f = it->second;
    in_flight.erase(it);
    free_slots.push_back(f.slot);
    if (auto* e = std::get_if<proto::ErrorReply>(&env->body)) {
      if (!first_error) first_error = make_error(e->code, e->message);
    } else if (!after(f.slot, f.blob, f.offset, f.len)) {
      if (!first_error)
        first_error =
            make_error(EBADMSG, "data mismatch in blob " + std::to_string(f.blob) + " at " + std::to_string(f.offset));
    }
    return {};
  };
  for (const auto& b : blobs) {
    for (uint64_t off = 0; off < b.size && !first_error; off += chunk_bytes) {
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(chunk_bytes, b.size - off));
      while (free_slots.empty())
        if (auto st = reap_one(); !st) return st;
      const uint32_t slot = free_slots.back();
      free_slots.pop_back();
      before(slot, b.id, off, len);
      Req r;
      r.slot = slot;
      r.length = len;
      r.blob = b.id;
      r.offset = off;
      auto id = c.send(r);
      if (!id) return std::move(id).error();
      in_flight.emplace(*id, InFlight{slot, b.id, off, len});
    }
  }
  while (!in_flight.empty())
    if (auto st = reap_one(); !st) return st;
  if (first_error) return *first_error;
  return {};
}

}  // namespace

Status ShimClient::write_all(const std::vector<proto::BlobSize>& blobs,
                             const std::function<void(uint64_t, uint64_t, uint8_t*, uint32_t)>& fill) {
  return pipeline<proto::Write>(
      *this, blobs,
      [&](uint32_t slot, uint64_t blob, uint64_t off, uint32_t len) { fill(blob, off, this->slot(slot), len); },
      [](uint32_t, uint64_t, uint64_t, uint32_t) { return true; });
}

Status ShimClient::read_all(const std::vector<proto::BlobSize>& blobs,
                            const std::function<bool(uint64_t, uint64_t, const uint8_t*, uint32_t)>& verify,
                            bool poison_slots) {
  return pipeline<proto::Read>(
      *this, blobs,
      [&](uint32_t slot, uint64_t, uint64_t, uint32_t len) {
        if (poison_slots) std::memset(this->slot(slot), 0xEE, len);
      },
      [&](uint32_t slot, uint64_t blob, uint64_t off, uint32_t len) {
        return verify(blob, off, this->slot(slot), len);
      });
}

}  // namespace tmsdisk::testing
