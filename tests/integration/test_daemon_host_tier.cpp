// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, the node's host-memory tier through the daemon: its budget across a reconnect, and a
// reclaim that meets an ask ahead.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <poll.h>
#include <sys/socket.h>

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
