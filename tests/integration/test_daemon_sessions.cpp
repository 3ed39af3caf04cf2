// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, sessions that end: a client that vanishes or is killed, orphans kept while their rank
// lives, the gc of dead ranks, a reconnect with a token.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>

#include "daemon_fixture.h"
#include "other_user.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

uint64_t now_unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

}  // namespace

TEST_CASE("a client that vanishes mid-transfer leaves no files and does not disturb others") {
  Daemon d;
  d.start();
  auto other = d.shim({.job = "bystander", .rank = 1});
  REQUIRE(other.reserve({{1, 16 * MiB}}));
  pid_t child = ::fork();
  if (child == 0) {
    auto c = ShimClient::connect(d.socket, {.job = "vanish", .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
    if (!c || !c->reserve({{1, 64 * MiB}})) ::_exit(1);
    for (uint32_t s = 0; s < c->welcome().slot_count; ++s) {
      proto::Write w;
      w.slot = s;
      w.length = 4 * MiB;
      w.blob = 1;
      w.offset = uint64_t{s} * 4 * MiB;
      (void)c->send(w);
    }
    ::_exit(0);  // gone with writes in flight
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK(eventually([&] { return d.session_count() == 1; }));
  CHECK(eventually([&] { return !fs::exists(d.roots[0] + "/" + std::to_string(::getuid()) + "/vanish"); }));
  REQUIRE(other.write_all({{1, 16 * MiB}}, fill_pattern));
  REQUIRE(other.read_all({{1, 16 * MiB}}, check_pattern));
}

TEST_CASE("killing a client with SIGKILL removes its directory") {
  Daemon d;
  d.start();
  const pid_t child = fork_client([&] {
    auto c = ShimClient::connect(d.socket, {.job = "killed", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
    return c && c->reserve({{1, 8 * MiB}}) && c->write_all({{1, 8 * MiB}}, fill_pattern);
  });
  const std::string dir = d.rank_dir(0, "killed", 0, child);
  REQUIRE(fs::exists(dir + "/data"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("the daemon's gc removes directories of dead ranks and keeps live ones") {
  Daemon d;
  d.start();
  auto live = d.shim({.job = "gc"});
  // A dead rank's directory as a crashed daemon would leave it: owner names a finished process.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string dead = d.rank_dir(0, "gc", 9, child);
  fs::create_directories(dead);
  {
    std::ofstream(dead + "/owner") << "tmsdisk-owner 1\npid " << child << "\nstart_time 1\ntoken 1\nuid " << ::getuid()
                                   << "\njob gc\nrank 9\n";
    std::ofstream(dead + "/data") << std::string(8192, 'x');
  }
  auto ctl = d.control();
  auto r = ctl.gc();
  REQUIRE(r);
  CHECK(r->removed_dirs == 1);
  CHECK(!fs::exists(dead));
  CHECK(fs::exists(d.rank_dir(0, "gc", 0, ::getpid())));
}

TEST_CASE("a live rank that loses its connection while paused keeps its files until it reconnects or exits") {
  Daemon d;
  d.start();
  const std::vector<BlobSize> blobs = {{1, 12 * MiB}};
  {
    auto c = d.shim({.job = "orphan", .rank = 4});
    const uint64_t token = c.welcome().token;
    REQUIRE(c.reserve(blobs));
    REQUIRE(c.write_all(blobs, fill_pattern));
    REQUIRE(c.commit(proto::CommitState::Paused));
    c.close();  // the process lives on: its paused memory exists only in these files
    const std::string dir = d.rank_dir(0, "orphan", 4, ::getpid());
    REQUIRE(eventually([&] { return d.one_orphan(); }));
    CHECK(fs::exists(dir + "/data"));
    auto wrong = ShimClient::connect(
        d.socket, {.job = "orphan", .rank = 4, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
    REQUIRE_FALSE(wrong);  // without the token nobody takes them over
    CHECK(wrong.error().errnum() == EPERM);
    auto again = d.shim({.job = "orphan", .rank = 4, .token = token});
    CHECK(again.welcome().restored == 1);
    REQUIRE(again.read_all(blobs, check_pattern));
    REQUIRE(again.commit(proto::CommitState::Resumed));
    again.close();  // resumed: nothing to keep
    CHECK(eventually([&] { return !fs::exists(dir); }));
  }
  // A child that pauses, drops its connection and then exits: the files go when it does.
  int go[2];
  REQUIRE(::pipe(go) == 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(go[1]);
    auto c = ShimClient::connect(
        d.socket, {.job = "orphan", .rank = 5, .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
    if (!c || !c->reserve(blobs) || !c->write_all(blobs, fill_pattern) || !c->commit(proto::CommitState::Paused))
      ::_exit(1);
    c->close();
    char x;
    (void)!::read(go[0], &x, 1);  // wait until the parent has seen the files kept
    ::_exit(0);
  }
  ::close(go[0]);
  const std::string dir = d.rank_dir(0, "orphan", 5, child);
  REQUIRE(eventually([&] { return fs::exists(dir + "/manifest") && d.one_orphan(); }));
  CHECK(fs::exists(dir + "/data"));
  ::close(go[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("an orphan is listed by LIST_SESSIONS as orphaned, since when and with what it keeps on disk") {
  Daemon d;
  d.start();
  const std::vector<BlobSize> blobs = {{1, 12 * MiB}};
  auto c = d.shim({.job = "listed", .rank = 2});
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const uint64_t before = now_unix_ms();
  c.close();  // the process lives on: its paused memory exists only in the rank's files
  // Before, the session vanished from the list while it still counted against the per-user limit.
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  const proto::SessionInfo orphan = d.sessions().at(0);
  CHECK(orphan.job == "listed");
  CHECK(orphan.rank == 2);
  CHECK(orphan.pid == ::getpid());
  CHECK(orphan.orphaned_unix_ms >= before);
  CHECK(orphan.orphaned_unix_ms <= now_unix_ms());
  CHECK(orphan.disk_bytes >= 12 * MiB);

  // It cannot be paused or resumed until it reconnects, and the refusal says why.
  auto ctl = d.control();
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Resume);
  req.match = proto::kMatchJob;
  req.job = "listed";
  auto refused = ctl.control(req);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == ENOTCONN);
  CHECK_THAT(refused.error().message, Catch::Contains("lost their connection") && Catch::Contains("orphaned"));

  auto again = d.shim({.job = "listed", .rank = 2, .token = token});
  CHECK(again.welcome().adopted == 1);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].orphaned == 0);
  CHECK(listed[0].orphaned_unix_ms == 0);
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
}

TEST_CASE("the per-user session limit's refusal counts the orphans among the sessions") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-sessions-per-uid", "2"});
  CHECK(as_other_user([&] {
          const ShimClient::Options options{
              .job = "lim", .rank = 0, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB};
          auto orphan = ShimClient::connect(d.socket, options);
          if (!orphan) return orphan.error().errnum() == EACCES ? kUnreachable : 11;
          const std::vector<BlobSize> blobs = {{1, 8 * MiB}};
          if (!orphan->reserve(blobs) || !orphan->write_all(blobs, fill_pattern) ||
              !orphan->commit(proto::CommitState::Paused))
            return 12;
          orphan->close();  // this process lives on: the session stays, an orphan
          if (!eventually([&] { return d.one_orphan(); })) return 13;
          ShimClient::Options second = options;
          second.rank = 1;
          auto live = ShimClient::connect(d.socket, second);
          if (!live) return 14;
          ShimClient::Options third = options;
          third.rank = 2;
          auto refused = ShimClient::connect(d.socket, third);
          if (refused || refused.error().errnum() != EDQUOT) return 15;
          const std::string& why = refused.error().message;
          if (why.find("already has 2 sessions (1 orphaned") == std::string::npos) return 16;
          if (why.find("kept for reconnection until each reconnects with its session token or its process exits") ==
              std::string::npos)
            return 17;
          if (why.find("tmsctl status") == std::string::npos) return 18;
          return 0;
        }) == 0);
}

TEST_CASE("a rank whose session ended with nothing to keep reconnects with its token and starts afresh") {
  Daemon d;
  d.start();
  auto first = d.shim({.job = "again", .rank = 0});
  const uint64_t token = first.welcome().token;
  const std::string dir = first.welcome().rank_dir;
  first.close();  // nothing paused: the session and its directory go
  CHECK(eventually([&] { return !fs::exists(dir); }));
  auto again = ShimClient::connect(
      d.socket, {.job = "again", .rank = 0, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB, .token = token});
  INFO((again ? "" : again.error().describe()));
  REQUIRE(again);
  CHECK(again->welcome().adopted == 0);
  CHECK(again->welcome().rank_dir == dir);
  CHECK(fs::exists(dir));
  REQUIRE(again->reserve({{1, 4 * MiB}}));  // a working session
}
