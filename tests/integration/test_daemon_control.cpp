// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, tmsctl's requests through the daemon: long answers, each rank's outcome as it comes,
// deadlines, and a pause that meets a HELLO.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>
#include <utility>

#include "client.h"
#include "daemon_fixture.h"
#include "in_process_daemon.h"
#include "server.h"
#include "test_support.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

// The next message on a raw control connection, within `timeout_ms`; fails the test otherwise.
proto::Message next_message(int sock, int timeout_ms) {
  pollfd p{sock, POLLIN, 0};
  REQUIRE(::poll(&p, 1, timeout_ms) == 1);
  std::vector<uint8_t> buf;
  REQUIRE(proto::recv_message(sock, buf) > 0);
  auto d = proto::decode(buf);
  INFO(d.error);
  REQUIRE(d.envelope);
  return std::move(d.envelope->body);
}

}  // namespace

TEST_CASE("a long per-rank answer reaches tmsctl whole, over as many result pages as it needs") {
  Daemon d;
  d.start();
  // Enough ranks that their full-length answers take more than one 64 KiB message.
  constexpr int kRanks = 70;
  std::vector<ShimClient> ranks;
  for (int r = 0; r < kRanks; ++r)
    ranks.push_back(d.shim({.job = "long", .rank = r, .staging_budget_bytes = 256 * 1024, .chunk_bytes = 128 * 1024}));
  auto text_of = [](int rank) {
    std::string t =
        "not enough disk space: needs 104.9 GiB on /var/tmp/x, 64.0 GiB free: free space, add a root, "
        "or pause less; rank " +
        std::to_string(rank) + " ";
    while (t.size() < proto::kMaxTextLength) t += static_cast<char>('a' + t.size() % 26);
    return t;
  };
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
    req.match = proto::kMatchJob;
    req.job = "long";
    req.timeout_ms = 60000;
    results = ctl.control(req);
  });
  for (int r = 0; r < kRanks; ++r) {
    auto cmd = ranks[r].receive();
    REQUIRE(cmd);
    REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
    proto::CommandDone done;
    done.code = ENOSPC;
    done.message = text_of(r);
    REQUIRE(proto::send_message(ranks[r].fd(), proto::encode(cmd->request_id, done)) == 0);
  }
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == kRanks);
  CHECK(results->unanswered.empty());
  for (const auto& r : results->results) {
    CHECK(r.code == ENOSPC);
    CHECK(r.message == text_of(static_cast<int>(r.rank)));
  }
}

TEST_CASE(
    "each rank's outcome reaches tmsctl: a no-op as the rank said, a rank that exited as done, a silent one "
    "as unanswered at the daemon's deadline") {
  Daemon d;
  d.start();
  auto noop = d.shim({.job = "outcome", .rank = 0});
  auto moved = d.shim({.job = "outcome", .rank = 1});
  auto gone = d.shim({.job = "outcome", .rank = 2});
  auto silent = d.shim({.job = "outcome", .rank = 3});
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
    req.match = proto::kMatchJob;
    req.job = "outcome";
    req.timeout_ms = 3000;  // the daemon's deadline, for the silent rank; the client's own is far longer
    results = ctl.control(req, ctl::Deadline::fixed(std::chrono::seconds(120)));
  });
  auto answer = [](ShimClient& rank, proto::CommandDone done) {
    auto cmd = rank.receive();
    REQUIRE(cmd);
    REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
    REQUIRE(proto::send_message(rank.fd(), proto::encode(cmd->request_id, done)) == 0);
  };
  answer(noop, {.nanos = 1000, .message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)});
  answer(moved, {.bytes = 4 * MiB, .nanos = 2000, .outcome = static_cast<uint8_t>(proto::Outcome::Done)});
  auto cmd = gone.receive();
  REQUIRE(cmd);
  gone.close();  // asked, then gone without an answer
  REQUIRE(silent.receive());
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 3);
  const auto& r = results->results;  // sorted by rank
  CHECK(r[0].code == 0);
  CHECK(r[0].outcome == static_cast<uint8_t>(proto::Outcome::NoOp));
  CHECK(r[0].bytes == 0);
  CHECK(r[0].message == "already paused");
  CHECK(r[1].code == 0);
  CHECK(r[1].outcome == static_cast<uint8_t>(proto::Outcome::Done));
  CHECK(r[1].bytes == 4 * MiB);
  CHECK(r[2].code == ECONNRESET);
  CHECK(r[2].outcome == static_cast<uint8_t>(proto::Outcome::Done));
  // No result made up for the silent rank: it is named as one that did not answer.
  REQUIRE(results->unanswered.size() == 1);
  CHECK(results->unanswered[0].rank == 3);
  CHECK(results->unanswered[0].session_id == silent.welcome().session_id);
  CHECK(results->unanswered[0].pid == ::getpid());
}

TEST_CASE("each rank's result reaches tmsctl as soon as it answers: a silent rank holds back no other's") {
  Daemon d;
  d.start();
  auto quick = d.shim({.job = "stream", .rank = 0});
  auto silent = d.shim({.job = "stream", .rank = 1});
  // A raw control connection, to see each message when it comes.
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  auto ctl = proto::connect_and_hello(d.socket, hello, 10000);
  INFO(ctl.message);
  REQUIRE(ctl);
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  req.match = proto::kMatchJob;
  req.job = "stream";
  req.timeout_ms = 120000;  // the silent rank's deadline: far beyond every wait below
  REQUIRE(proto::send_message(ctl.sock, proto::encode(2, req)) == 0);

  // First, whom the daemon asked, so that a tmsctl that gives up can name who did not answer.
  proto::Message first = next_message(ctl.sock, 10000);
  auto* targets = std::get_if<proto::ControlTargets>(&first);
  REQUIRE(targets);
  CHECK(targets->last == 1);
  REQUIRE(targets->ranks.size() == 2);
  CHECK(targets->ranks[0].rank == 0);
  CHECK(targets->ranks[0].session_id == quick.welcome().session_id);
  CHECK(targets->ranks[1].rank == 1);
  CHECK(targets->ranks[1].session_id == silent.welcome().session_id);
  CHECK(targets->ranks[1].pid == ::getpid());
  CHECK(targets->ranks[1].job == "stream");

  // One rank answers, the other keeps its COMMAND unanswered.
  auto cmd = quick.receive();
  REQUIRE(cmd);
  REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
  proto::CommandDone done{.bytes = 4 * MiB, .nanos = 1000, .outcome = static_cast<uint8_t>(proto::Outcome::Done)};
  REQUIRE(proto::send_message(quick.fd(), proto::encode(cmd->request_id, done)) == 0);
  auto silent_cmd = silent.receive();
  REQUIRE(silent_cmd);
  REQUIRE(std::holds_alternative<proto::Command>(silent_cmd->body));

  // The answer comes now, not at the silent rank's deadline two minutes away (it used to wait for
  // every rank), on a page that says more are to come.
  proto::Message second = next_message(ctl.sock, 30000);
  auto* page = std::get_if<proto::ControlResult>(&second);
  REQUIRE(page);
  CHECK(page->last == 0);
  REQUIRE(page->results.size() == 1);
  CHECK(page->results[0].session_id == quick.welcome().session_id);
  CHECK(page->results[0].bytes == 4 * MiB);

  // tmsctl gives up and leaves; the silent rank's late answer goes nowhere, and the daemon forgets
  // the request: the same ranks answer the next one, on a new connection, in full.
  ::close(std::exchange(ctl.sock, -1));
  proto::CommandDone late{.code = ETIMEDOUT, .message = "late", .outcome = static_cast<uint8_t>(proto::Outcome::Done)};
  REQUIRE(proto::send_message(silent.fd(), proto::encode(silent_cmd->request_id, late)) == 0);
  auto again = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    req.timeout_ms = 0;
    results = again.control(req, ctl::Deadline::fixed(std::chrono::seconds(60)));
  });
  for (ShimClient* rank : {&quick, &silent}) {
    auto c = rank->receive();
    REQUIRE(c);
    REQUIRE(std::holds_alternative<proto::Command>(c->body));
    proto::CommandDone noop{.message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)};
    REQUIRE(proto::send_message(rank->fd(), proto::encode(c->request_id, noop)) == 0);
  }
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 2);
  CHECK(results->unanswered.empty());
  for (const auto& r : results->results) CHECK(r.message == "already paused");
}

TEST_CASE("a pause asked while a matching rank's HELLO is served waits for it and asks that rank too") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) { c.hooks.before_staging = gate.staging_hook("late"); });
  std::future<Result<ShimClient>> late;
  ReleaseAtEnd release_at_end{gate};
  late = std::async(std::launch::async, [&] {
    return ShimClient::connect(d.socket, {.job = "late", .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
  });
  REQUIRE(gate.wait_entered(1));  // its HELLO is in, its session is not there yet
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  auto ctl = proto::connect_and_hello(d.socket, hello, 60'000);
  INFO(ctl.message);
  REQUIRE(ctl);
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  req.match = proto::kMatchJob;
  req.job = "late";
  REQUIRE(proto::send_message(ctl.sock, proto::encode(2, req)) == 0);

  gate.release();
  auto h = late.get();
  REQUIRE(h);
  // The rank was asked (it was no session when the pause came, so it used to be "no running rank").
  proto::Message first = next_message(ctl.sock, 60'000);
  auto* targets = std::get_if<proto::ControlTargets>(&first);
  INFO((std::holds_alternative<proto::ErrorReply>(first) ? std::get<proto::ErrorReply>(first).message : ""));
  REQUIRE(targets);
  REQUIRE(targets->ranks.size() == 1);
  CHECK(targets->ranks[0].session_id == h->welcome().session_id);
  auto cmd = h->receive();
  REQUIRE(cmd);
  CHECK(std::holds_alternative<proto::Command>(cmd->body));
}

TEST_CASE("a client's own deadline names the ranks that did not answer and keeps the answers it has") {
  Daemon d;
  d.start();
  auto quick = d.shim({.job = "late", .rank = 0});
  auto silent = d.shim({.job = "late", .rank = 1});
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Resume);
    req.match = proto::kMatchJob;
    req.job = "late";  // no daemon deadline: only the client's
    results = ctl.control(req, ctl::Deadline::fixed(std::chrono::seconds(5)));
  });
  auto cmd = quick.receive();
  REQUIRE(cmd);
  proto::CommandDone done{.message = "nothing is paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)};
  REQUIRE(proto::send_message(quick.fd(), proto::encode(cmd->request_id, done)) == 0);
  REQUIRE(silent.receive());
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 1);
  CHECK(results->results[0].rank == 0);
  CHECK(results->results[0].message == "nothing is paused");
  REQUIRE(results->unanswered.size() == 1);
  CHECK(results->unanswered[0].rank == 1);
}
