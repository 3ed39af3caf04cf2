// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, the node's host-memory tier through the daemon: its budget across a reconnect, a reclaim
// that meets an ask ahead, and objects of a rank's store that live in it.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "client.h"
#include "daemon_fixture.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

// True once `fd` has something to read, within `ms`: a wait for a message the test is sure comes (a
// receive() would block for good if it did not).
bool arrives_within(int fd, int ms) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  return ::poll(&p, 1, ms) == 1;
}

}  // namespace

TEST_CASE("a rank that reconnects to the same daemon keeps its host-tier memory counted against the budget") {
  // The rank holds the memory (its descriptor); the daemon's count of it must survive the rank's
  // session turning orphan and being taken over, or other ranks are granted past the budget.
  Daemon d;
  d.start({"--host-tier-mb", "16", "--host-tier-ahead=false"});
  auto c = d.shim({.job = "tierback"});
  const uint64_t token = c.welcome().token;
  UniqueFd memory;
  auto granted = c.call(proto::TierAsk{.bytes = 8 * MiB, .flags = 0}, -1, &memory);
  INFO((granted ? "" : granted.error().describe()));
  REQUIRE(granted);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*granted));
  const uint64_t bytes = std::get<proto::TierGrant>(*granted).bytes;
  REQUIRE(bytes == 8 * MiB);
  REQUIRE(memory);
  const std::vector<BlobSize> blobs = {{1, 4 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  c.close();  // the process lives: an orphan, with the memory still the rank's
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(d.sessions().at(0).host_tier_bytes == bytes);
  auto again = d.shim({.job = "tierback", .token = token});
  CHECK(again.welcome().adopted == 1);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].host_tier_bytes == bytes);
  ctl::Client::HostTier node;
  REQUIRE(d.control().list_sessions(ctl::Deadline::fixed(ctl::kAnswerLimit), &node));
  CHECK(node.used_bytes == bytes);
}

TEST_CASE("an ask ahead that crosses a TIER_RECLAIM is told to release, and the pausing rank gets the memory") {
  // The rank forgets a reclaim once it answered an ask of its own; told to reuse, it would keep the
  // memory and the pausing rank would wait the whole kReclaimWait for nothing.
  Daemon d;
  d.start({"--host-tier-mb", "16"});  // keep and ahead on (the defaults)
  auto kept = d.shim({.job = "kept"});
  UniqueFd memory;
  auto ahead = kept.call(proto::TierAsk{.bytes = 16 * MiB, .flags = proto::kTierAskAhead}, -1, &memory);
  INFO((ahead ? "" : ahead.error().describe()));
  REQUIRE(ahead);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*ahead));
  REQUIRE(std::get<proto::TierGrant>(*ahead).bytes == 16 * MiB);
  REQUIRE(memory);

  // A second rank pauses: the budget is all kept by the first, so the daemon asks for it back.
  auto pausing = d.shim({.job = "pausing"});
  auto pause_ask = pausing.send(proto::TierAsk{.bytes = 16 * MiB, .flags = 0});
  REQUIRE(pause_ask);
  REQUIRE(arrives_within(kept.fd(), 10000));
  auto reclaim = kept.receive();
  REQUIRE(reclaim);
  CHECK(std::holds_alternative<proto::TierReclaim>(reclaim->body));
  CHECK((reclaim->request_id & proto::kDaemonRequestBit) != 0);

  // The first rank asks ahead again before it acted on the reclaim (it crossed on the wire).
  auto again = kept.call(proto::TierAsk{.bytes = 16 * MiB, .flags = proto::kTierAskAhead});
  REQUIRE(again);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*again));
  CHECK(std::get<proto::TierGrant>(*again).flags == proto::kTierReleaseFirst);
  CHECK(std::get<proto::TierGrant>(*again).bytes == 0);
  REQUIRE(kept.call(proto::TierRelease{}));
  memory.reset();

  // The pausing rank's ask is answered with memory, not after the wait with none.
  REQUIRE(arrives_within(pausing.fd(), 10000));
  auto granted = pausing.receive();
  REQUIRE(granted);
  CHECK(granted->request_id == *pause_ask);
  REQUIRE(std::holds_alternative<proto::TierGrant>(granted->body));
  CHECK(std::get<proto::TierGrant>(granted->body).bytes > 0);
}

// ------------------------------------------------------------------------------------------------
// Objects in the host tier (STORE_OPEN with kStoreOpenHost, tier_broker.h)

namespace {

// STORE_OPEN of `name` (`size` bytes) with `flags`, `fd` riding along; the answer, and the memory
// that came with it.
struct Opened {
  proto::StoreOpened reply;
  UniqueFd memory;
};
Result<Opened> store_open(ShimClient& c, const std::string& name, uint64_t size, uint8_t flags, int fd = -1) {
  Opened out;
  auto r = c.call(proto::StoreOpen{.name = name, .size = size, .flags = flags}, fd, &out.memory);
  if (!r) return std::move(r).error();
  const auto* opened = std::get_if<proto::StoreOpened>(&*r);
  if (!opened) return make_error(EPROTO, "not STORE_OPENED");
  out.reply = *opened;
  return out;
}

uint64_t node_tier_used(Daemon& d) {
  ctl::Client::HostTier node;
  REQUIRE(d.control().list_sessions(ctl::Deadline::fixed(ctl::kAnswerLimit), &node));
  return node.used_bytes;
}

}  // namespace

TEST_CASE("an object in the host tier gets memory of its own, counted before the rank's pause, back when removed") {
  Daemon d;
  d.start({"--host-tier-mb", "16", "--host-tier-ahead=false"});
  auto c = d.shim({.job = "objtier", .chunk_bytes = 2 * MiB});
  const uint64_t chunk = c.welcome().chunk_bytes;
  REQUIRE(chunk == 2 * MiB);
  const uint64_t size = 2 * chunk + 4096;  // three chunks of memory

  auto first = store_open(c, "adam.b0", size, proto::kStoreOpenHost);
  INFO((first ? "" : first.error().describe()));
  REQUIRE(first);
  CHECK(first->reply.created == 1);
  REQUIRE(first->reply.host_bytes == 3 * chunk);
  REQUIRE(first->memory);
  struct stat st {};
  REQUIRE(::fstat(first->memory.get(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_size) >= first->reply.host_bytes);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].object_host_bytes == 3 * chunk);
  CHECK(listed[0].object_bytes == 0);  // nothing of it on disk
  CHECK(node_tier_used(d) == 3 * chunk);

  // All or nothing: an object larger than what is left of the budget lives on disk, all of it.
  auto large = store_open(c, "adam.b1", 6 * chunk, proto::kStoreOpenHost);
  REQUIRE(large);
  CHECK(large->reply.host_bytes == 0);
  CHECK_FALSE(large->memory);
  // An object that exists may hold bytes on disk: it stays there.
  auto plain = store_open(c, "adam.b2", chunk, 0);
  REQUIRE(plain);
  auto again = store_open(c, "adam.b2", chunk, proto::kStoreOpenHost);
  REQUIRE(again);
  CHECK(again->reply.created == 0);
  CHECK(again->reply.host_bytes == 0);

  // The rank's pause gets what is left of its share.
  UniqueFd pause_memory;
  auto granted = c.call(proto::TierAsk{.bytes = 16 * MiB, .flags = 0}, -1, &pause_memory);
  REQUIRE(granted);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*granted));
  CHECK(std::get<proto::TierGrant>(*granted).bytes == 16 * MiB - 3 * chunk);
  CHECK(node_tier_used(d) == 16 * MiB);

  // Removed: its memory goes back to the node.
  auto removed = c.call(proto::StoreRemove{.name = "adam.b0"});
  REQUIRE(removed);
  CHECK(d.sessions().at(0).object_host_bytes == 0);
  CHECK(node_tier_used(d) == 16 * MiB - 3 * chunk);
}

TEST_CASE("after a daemon restart an object's host-tier memory is counted again once, and only an earlier object's") {
  Daemon d;
  d.start({"--host-tier-mb", "16", "--host-tier-ahead=false"});
  auto c = d.shim({.job = "objheld", .rank = 0, .chunk_bytes = 2 * MiB});
  const uint64_t token = c.welcome().token;
  const uint64_t size = 4 * MiB;
  auto placed = store_open(c, "masters", size, proto::kStoreOpenHost);
  REQUIRE(placed);
  REQUIRE(placed->reply.host_bytes == size);
  REQUIRE(placed->memory);
  // Handing back on the daemon that granted it is no restart: refused.
  auto early = store_open(c, "masters", size, proto::kStoreOpenHeld, placed->memory.get());
  REQUIRE(early);  // the same memory, counted already for this very object: answered with its count
  CHECK(early->reply.host_bytes == size);

  d.proc.kill9();
  c.close();
  d.start({"--host-tier-mb", "16", "--host-tier-ahead=false"});
  auto back = d.shim({.job = "objheld", .rank = 0, .chunk_bytes = 2 * MiB, .token = token});
  CHECK(node_tier_used(d) == 0);
  auto held = store_open(back, "masters", size, proto::kStoreOpenHeld, placed->memory.get());
  INFO((held ? "" : held.error().describe()));
  REQUIRE(held);
  CHECK(held->reply.host_bytes == size);
  CHECK(node_tier_used(d) == size);
  // Once: the same memory under another name, or again, is not counted twice.
  auto twice = store_open(back, "masters", size, proto::kStoreOpenHeld, placed->memory.get());
  REQUIRE(twice);
  CHECK(node_tier_used(d) == size);
  // An object made after the restart claims no memory the daemon did not grant.
  auto fresh = store_open(back, "moments", size, 0);
  REQUIRE(fresh);
  UniqueFd own(::memfd_create("tmsdisk-tier", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(own);
  REQUIRE(::ftruncate(own.get(), static_cast<off_t>(size)) == 0);
  auto claim = store_open(back, "moments", size, proto::kStoreOpenHeld, own.get());
  REQUIRE_FALSE(claim);
  CHECK(claim.error().errnum() == EPERM);
  // Without the memory, refused too.
  auto bare = store_open(back, "masters", size, proto::kStoreOpenHeld);
  REQUIRE_FALSE(bare);
  CHECK(node_tier_used(d) == size);
}
