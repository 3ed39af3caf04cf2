// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: the node's host-memory tier (README.md, "The host tier"). With host-tier-mb
// set, a pause keeps what the rank's fair share allows in host memory the daemon grants and writes
// only the rest; ranks share the budget; the memory is the rank's, so a daemon killed and restarted
// while it is paused loses nothing, and a rank killed while paused frees its share. A rank that
// resumed keeps its memory for its next pause, which reuses it, until another rank's pause needs it
// (host-tier-keep); a rank whose memory stopped growing gets its memory before its first pause
// (host-tier-ahead). Each TEST_CASE is its own CTest test. The cases about other things start the
// daemon with --host-tier-ahead=false: whether a rank sat still long enough to ask ahead must not
// change them.
#include <signal.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "e2e.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

namespace {

// The rank of `pid` as `tmsctl status` lists it (pid 0: the only one).
RankStatus rank_of(const Node& node, pid_t pid = 0) {
  for (const auto& r : node.status())
    if (pid == 0 || r.pid == pid) return r;
  return {};
}

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Host-tier memory the daemon made (each grant of new memory logs it once; a reuse does not).
int grants_made(const Node& node) {
  return count_of(node.daemon.log(), "of host-tier memory, made in");
}

}  // namespace

TEST_CASE("with a budget larger than the pause, its data goes to host memory, none to disk, and comes back whole") {
  Node node;
  node.start_daemon({"--host-tier-mb", "256", "--host-tier-ahead=false"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("tier", 0));
  REQUIRE(prog.line() == "ready");
  const std::string addr = ok_addr(prog.cmd("alloc 1 67108864 direct"));
  REQUIRE_FALSE(addr.empty());
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 16777216 direct sparse 8388608")).empty());  // 2 data chunks, 6 zero

  auto p = node.pause("tier");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == 80 * MiB);
  CHECK(p[0].host_bytes == 64 * MiB + 4 * MiB);
  CHECK(p[0].zero_bytes == 12 * MiB);
  CHECK(p[0].moved_bytes == 0);
  RankStatus held = rank_of(node);
  CHECK(held.host_tier_bytes == 68 * MiB);
  CHECK(held.disk_bytes == 0);
  CHECK(held.totals.state == "paused");
  // The words say it too, and the node's budget is shown.
  auto [rc, text] = run({TMSCTL_PATH, "--socket", node.socket, "status"}, node.sim_env());
  CHECK(rc == 0);
  CHECK(text.find("host tier: 68.0 MiB of 256.0 MiB in use on this node") != std::string::npos);

  auto r = node.resume("tier");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].host_bytes == 68 * MiB);
  CHECK(r[0].moved_bytes == 0);
  CHECK(prog.cmd("check") == "ok 2");
  CHECK(prog.cmd("addr 1") == "ok " + addr);
  // Kept for the next pause (host-tier-keep is on by default), still counted against the budget.
  REQUIRE(eventually([&] { return rank_of(node).host_tier_kept; }));
  CHECK(rank_of(node).host_tier_bytes == 68 * MiB);
  std::tie(rc, text) = run({TMSCTL_PATH, "--socket", node.socket, "status"}, node.sim_env());
  CHECK(text.find("host tier: holds 68.0 MiB (empty, kept for its next pause)") != std::string::npos);
  CHECK(text.find("host tier: 68.0 MiB of 256.0 MiB in use on this node") != std::string::npos);

  // The next pause reuses it: no new memory made, the same bytes in the tier, whole again.
  CHECK(prog.cmd("edit 1 4096") == "ok");
  p = node.pause("tier");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 68 * MiB);
  CHECK(p[0].moved_bytes == 0);
  CHECK(grants_made(node) == 1);
  CHECK_FALSE(rank_of(node).host_tier_kept);
  REQUIRE(node.resume("tier").ok());
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("with host-tier-keep=false a resume gives the memory back and the next pause gets new memory") {
  Node node;
  node.start_daemon({"--host-tier-mb", "256", "--host-tier-ahead=false", "--host-tier-keep=false"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("nokeep", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
  for (int round = 1; round <= 2; ++round) {
    auto p = node.pause("nokeep");
    INFO(p.text);
    REQUIRE(p.ok());
    CHECK(p[0].host_bytes == 32 * MiB);
    REQUIRE(node.resume("nokeep").ok());
    CHECK(prog.cmd("check") == "ok 1");
    // Given back after the resume answered (nobody waits for the unpinning).
    CHECK(eventually([&] { return rank_of(node).host_tier_bytes == 0; }));
    CHECK(grants_made(node) == round);
  }
}

TEST_CASE("memory a rank kept goes to another rank's pause that needs it, and the sum stays within the budget") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  Proc a({CUDA_PATTERN_PATH}, node.shim_env("keeper", 0));
  REQUIRE(a.line() == "ready");
  REQUIRE_FALSE(ok_addr(a.cmd("alloc 1 67108864 direct")).empty());
  // Alone on the node, the rank gets the whole budget and keeps it after its resume.
  REQUIRE(node.pause("keeper").ok());
  REQUIRE(node.resume("keeper").ok());
  REQUIRE(eventually([&] { return rank_of(node, a.pid()).host_tier_kept; }));
  CHECK(rank_of(node, a.pid()).host_tier_bytes == 64 * MiB);

  // A second rank pauses: its fair share (half) is held by the first, which is asked to give it back.
  Proc b({CUDA_PATTERN_PATH}, node.shim_env("taker", 0));
  REQUIRE(b.line() == "ready");
  REQUIRE_FALSE(ok_addr(b.cmd("alloc 1 67108864 direct")).empty());
  REQUIRE(eventually([&] { return node.status().size() == 2; }));
  auto p = node.pause("taker");
  INFO(p.text);
  INFO(node.daemon.log());
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 32 * MiB);
  CHECK(rank_of(node, a.pid()).host_tier_bytes == 0);
  CHECK(rank_of(node, b.pid()).host_tier_bytes == 32 * MiB);

  // The first rank pauses again: what is left is its fair share; the sum is the budget.
  p = node.pause("keeper");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 32 * MiB);
  uint64_t held = 0;
  for (const auto& r : node.status()) held += r.host_tier_bytes;
  CHECK(held == 64 * MiB);
  REQUIRE(node.resume("taker").ok());
  REQUIRE(node.resume("keeper").ok());
  CHECK(a.cmd("check") == "ok 1");
  CHECK(b.cmd("check") == "ok 1");
}

TEST_CASE("a rank that kept more than its fair share now gives it back and gets its share anew") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  Proc a({CUDA_PATTERN_PATH}, node.shim_env("big", 0));
  REQUIRE(a.line() == "ready");
  REQUIRE_FALSE(ok_addr(a.cmd("alloc 1 67108864 direct")).empty());
  REQUIRE(node.pause("big").ok());
  REQUIRE(node.resume("big").ok());
  REQUIRE(eventually([&] { return rank_of(node).host_tier_kept; }));
  // Another rank arrives (it does not pause): the first one's share is now half the budget.
  Proc b({CUDA_PATTERN_PATH}, node.shim_env("idle", 0));
  REQUIRE(b.line() == "ready");
  REQUIRE_FALSE(ok_addr(b.cmd("alloc 1 4194304 direct")).empty());
  REQUIRE(eventually([&] { return node.status().size() == 2; }));
  CHECK(a.cmd("edit 1 100") == "ok");
  auto p = node.pause("big");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 32 * MiB);
  CHECK(p[0].moved_bytes == 32 * MiB);
  CHECK(rank_of(node, a.pid()).host_tier_bytes == 32 * MiB);
  CHECK(grants_made(node) == 2);
  REQUIRE(node.resume("big").ok());
  CHECK(a.cmd("check") == "ok 1");
}

TEST_CASE("past the budget the pause spills to disk, and a second pause uses the tier again") {
  Node node;
  node.start_daemon({"--host-tier-mb", "24", "--host-tier-ahead=false"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("spill", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 67108864 direct")).empty());
  for (int round = 0; round < 2; ++round) {
    auto p = node.pause("spill");
    INFO(p.text);
    REQUIRE(p.ok());
    CHECK(p[0].host_bytes == 24 * MiB);
    CHECK(p[0].moved_bytes + p[0].unchanged_bytes == 40 * MiB);
    CHECK(rank_of(node).disk_bytes == 40 * MiB);
    auto r = node.resume("spill");
    INFO(r.text);
    REQUIRE(r.ok());
    CHECK(r[0].host_bytes == 24 * MiB);
    CHECK(r[0].moved_bytes == 40 * MiB);
    REQUIRE(prog.cmd("check") == "ok 1");
  }
}

TEST_CASE("two ranks share the budget: each gets half, the sum never passes it, both come back whole") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  Proc a({CUDA_PATTERN_PATH}, node.shim_env("pair", 0));
  Proc b({CUDA_PATTERN_PATH}, node.shim_env("pair", 1));
  REQUIRE(a.line() == "ready");
  REQUIRE(b.line() == "ready");
  REQUIRE_FALSE(ok_addr(a.cmd("alloc 1 67108864 direct")).empty());
  REQUIRE_FALSE(ok_addr(b.cmd("alloc 1 67108864 direct")).empty());
  REQUIRE(eventually([&] { return node.status().size() == 2; }));
  auto p = node.pause("pair");
  INFO(p.text);
  REQUIRE(p.ok());
  REQUIRE(p.size() == 2);
  uint64_t sum = 0;
  for (const auto& r : p.ranks) {
    CHECK(r.host_bytes == 32 * MiB);
    CHECK(r.moved_bytes + r.unchanged_bytes == 32 * MiB);
    sum += r.host_bytes;
  }
  CHECK(sum <= 64 * MiB);
  uint64_t held = 0;
  for (const auto& r : node.status()) held += r.host_tier_bytes;
  CHECK(held == 64 * MiB);
  auto r = node.resume("pair");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(a.cmd("check") == "ok 1");
  CHECK(b.cmd("check") == "ok 1");
}

TEST_CASE(
    "a daemon killed while a rank is paused with chunks in the tier: the new daemon counts them, resume is whole") {
  Node node;
  node.start_daemon({"--host-tier-mb", "32", "--host-tier-ahead=false"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("restart", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 67108864 direct")).empty());
  auto p = node.pause("restart");
  INFO(p.text);
  REQUIRE(p.ok());
  REQUIRE(p[0].host_bytes == 32 * MiB);

  node.daemon.kill9();
  node.start_daemon({"--host-tier-mb", "32", "--host-tier-ahead=false"});
  // The shim reconnects and hands its host-tier memory to the new daemon, which counts it again.
  REQUIRE(eventually([&] { return rank_of(node).host_tier_bytes == 32 * MiB; }, std::chrono::seconds(60)));
  CHECK(rank_of(node).totals.state == "paused");
  auto r = node.resume("restart");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].host_bytes == 32 * MiB);
  CHECK(r[0].moved_bytes == 32 * MiB);
  CHECK(prog.cmd("check") == "ok 1");
  // Resumed, the rank keeps the memory for its next pause; the new daemon counts it as kept.
  CHECK(eventually([&] { return rank_of(node).host_tier_kept; }));
  CHECK(rank_of(node).host_tier_bytes == 32 * MiB);
}

TEST_CASE("a rank killed while paused frees its share of the tier at once: the next rank gets all of it") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  {
    Proc doomed({CUDA_PATTERN_PATH}, node.shim_env("doomed", 0));
    REQUIRE(doomed.line() == "ready");
    REQUIRE_FALSE(ok_addr(doomed.cmd("alloc 1 67108864 direct")).empty());
    auto p = node.pause("doomed");
    INFO(p.text);
    REQUIRE(p.ok());
    REQUIRE(p[0].host_bytes == 64 * MiB);
    ::kill(doomed.pid(), SIGKILL);
    doomed.wait();
  }
  REQUIRE(eventually([&] { return node.status().empty(); }));
  Proc next({CUDA_PATTERN_PATH}, node.shim_env("next", 0));
  REQUIRE(next.line() == "ready");
  REQUIRE_FALSE(ok_addr(next.cmd("alloc 1 67108864 direct")).empty());
  auto p = node.pause("next");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 64 * MiB);
  REQUIRE(node.resume("next").ok());
  CHECK(next.cmd("check") == "ok 1");
}

TEST_CASE("TMSDISK_HOST_TIER=0 keeps a rank on disk even where the node has a tier") {
  Node node;
  node.start_daemon({"--host-tier-mb", "256", "--host-tier-ahead=false"});
  Env env = node.shim_env("notier", 0);
  // A std::string, not a literal: GCC 12 at -O3 warns falsely (-Wrestrict) of an overlapping copy in
  // std::string's assignment from a short literal (GCC bug 105329).
  env["TMSDISK_HOST_TIER"] = std::string("0");
  Proc prog({CUDA_PATTERN_PATH}, env);
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
  auto p = node.pause("notier");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 0);
  CHECK(p[0].moved_bytes == 32 * MiB);
  REQUIRE(node.resume("notier").ok());
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("a rank whose memory stopped growing gets its host-tier memory before its first pause, which makes none") {
  Node node;
  node.start_daemon({"--host-tier-mb", "256"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("ahead", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 67108864 direct")).empty());
  // Asked for while the rank runs: held, kept (reclaimable), nothing paused.
  REQUIRE(eventually([&] { return rank_of(node).host_tier_bytes == 64 * MiB; }));
  CHECK(rank_of(node).host_tier_kept);
  CHECK(rank_of(node).totals.state == "running");
  CHECK(grants_made(node) == 1);
  CHECK(node.daemon.log().find("asked for ahead of a pause") != std::string::npos);

  auto p = node.pause("ahead");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 64 * MiB);
  CHECK(p[0].moved_bytes == 0);
  CHECK(grants_made(node) == 1);  // the pause reused it
  REQUIRE(node.resume("ahead").ok());
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("memory asked for ahead takes only what is free, and a pausing rank's share comes back to it") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64"});
  Proc a({CUDA_PATTERN_PATH}, node.shim_env("early", 0));
  REQUIRE(a.line() == "ready");
  REQUIRE_FALSE(ok_addr(a.cmd("alloc 1 67108864 direct")).empty());
  // Alone on the node: the whole budget, ahead of its pause.
  REQUIRE(eventually([&] { return rank_of(node, a.pid()).host_tier_bytes == 64 * MiB; }));

  // A second rank asks ahead too: nothing is free and nobody's memory is taken back for that.
  Proc b({CUDA_PATTERN_PATH}, node.shim_env("late", 0));
  REQUIRE(b.line() == "ready");
  REQUIRE_FALSE(ok_addr(b.cmd("alloc 1 67108864 direct")).empty());
  REQUIRE(eventually([&] {
    return node.daemon.log().find("host tier ahead of a pause: 0 B of the 64.0 MiB asked for") != std::string::npos;
  }));
  CHECK(rank_of(node, a.pid()).host_tier_bytes == 64 * MiB);
  CHECK(rank_of(node, b.pid()).host_tier_bytes == 0);

  // Its pause gets its fair share back from the first rank, and the sum stays within the budget.
  auto p = node.pause("late");
  INFO(p.text);
  INFO(node.daemon.log());
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 32 * MiB);
  CHECK(rank_of(node, a.pid()).host_tier_bytes + rank_of(node, b.pid()).host_tier_bytes <= 64 * MiB);
  REQUIRE(node.resume("late").ok());
  CHECK(b.cmd("check") == "ok 1");
  CHECK(a.cmd("check") == "ok 1");
}

TEST_CASE("memory asked for ahead that a pause found mostly zero is made again at the size the pause placed") {
  Node node;
  node.start_daemon({"--host-tier-mb", "512"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("sparse", 0));
  REQUIRE(prog.line() == "ready");
  // 256 MiB of which 4 chunks hold data: asked for whole ahead (zero chunks are found by the pause).
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 268435456 direct sparse 67108864")).empty());
  REQUIRE(eventually([&] { return rank_of(node).host_tier_bytes == 256 * MiB; }));
  auto p = node.pause("sparse");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 8 * MiB);
  CHECK(p[0].zero_bytes == 248 * MiB);
  REQUIRE(node.resume("sparse").ok());
  CHECK(prog.cmd("check") == "ok 1");
  // Not kept as it was: far more than the pause needed. Made again ahead of the next pause at the size
  // this one placed, so the budget counts what is used and the next pause still only copies.
  REQUIRE(eventually([&] { return rank_of(node).host_tier_bytes == 8 * MiB && rank_of(node).host_tier_kept; }));
  const auto grants = grants_made(node);
  p = node.pause("sparse");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 8 * MiB);
  CHECK(rank_of(node).host_tier_bytes == 8 * MiB);
  CHECK(grants_made(node) == grants);
  REQUIRE(node.resume("sparse").ok());
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("with host-tier-ahead=false the first pause makes the memory") {
  Node node;
  node.start_daemon({"--host-tier-mb", "256", "--host-tier-ahead=false"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("noahead", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
  // The rank asks once it has been still for a while, and is told why not.
  REQUIRE(eventually(
      [&] { return node.daemon.log().find("ahead of a pause; none: host-tier-ahead is off") != std::string::npos; }));
  CHECK(rank_of(node).host_tier_bytes == 0);
  auto p = node.pause("noahead");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].host_bytes == 32 * MiB);
  CHECK(grants_made(node) == 1);
  CHECK(node.daemon.log().find("asked for ahead of a pause") == std::string::npos);
  REQUIRE(node.resume("noahead").ok());
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("ranks that got memory ahead while alone give back what passes their share: four ranks, a budget for two") {
  Node node;
  node.start_daemon({"--host-tier-mb", "64"});
  // One after another, as ranks that finish loading at different times: the first two get 32 MiB
  // each ahead of their pause (their fair share then), the last two nothing (nothing is free).
  std::vector<std::unique_ptr<Proc>> ranks;
  for (int i = 0; i < 4; ++i) {
    ranks.push_back(std::make_unique<Proc>(std::vector<std::string>{CUDA_PATTERN_PATH}, node.shim_env("four", i)));
    Proc& p = *ranks.back();
    REQUIRE(p.line() == "ready");
    REQUIRE_FALSE(ok_addr(p.cmd("alloc 1 33554432 direct")).empty());
    if (i < 2) {
      REQUIRE(eventually([&] { return rank_of(node, p.pid()).host_tier_bytes == 32 * MiB; }));
    } else {
      REQUIRE(eventually([&] { return count_of(node.daemon.log(), "host tier ahead of a pause: 0 B") == i - 1; }));
    }
  }
  // All pause at once: those holding more than their share release it first, the others wait for it,
  // and every rank gets its share; the sum is the budget.
  auto p = node.pause("four");
  INFO(p.text);
  INFO(node.daemon.log());
  REQUIRE(p.ok());
  REQUIRE(p.size() == 4);
  for (const auto& r : p.ranks) CHECK(r.host_bytes == 16 * MiB);
  uint64_t held = 0;
  for (const auto& r : node.status()) held += r.host_tier_bytes;
  CHECK(held == 64 * MiB);
  REQUIRE(node.resume("four").ok());
  for (auto& r : ranks) CHECK(r->cmd("check") == "ok 1");
}
