// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: bytes that need not move do not. Chunks that are all zero are
// found on the device before the reservation, neither written nor read, and take no disk space;
// chunks the rank's file already holds are not rewritten. Each answer says what moved. Each
// TEST_CASE is its own CTest test.
#include <catch2/catch.hpp>
#include <string>

#include "e2e.h"
#include "small_filesystem.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

namespace {

constexpr uint64_t kChunk = 2 * MiB;  // Node's daemon runs with --chunk-mb 2

}  // namespace

TEST_CASE("a mostly-zero allocation pauses on a disk smaller than it, moving only its data, and resumes every byte") {
  std::string why_not;
  auto small = SmallFilesystem::mount(64, &why_not);
  if (!small) skip(why_not);
  Node node;
  node.root = small->path();
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("sparse", 0));
  REQUIRE(prog.line() == "ready");
  // 256 MiB, four times the disk; data in the first 4 KiB of every 32 MiB: 8 chunks of 2 MiB.
  const std::string addr = ok_addr(prog.cmd("alloc 1 268435456 direct sparse 33554432"));
  REQUIRE_FALSE(addr.empty());
  REQUIRE(prog.cmd("check") == "ok 1");
  CHECK_FALSE(node.probe(300));

  auto p = node.pause("sparse");
  INFO(p.text);
  REQUIRE(p.ok());
  REQUIRE(p.size() == 1);
  CHECK(p[0].bytes == 256 * MiB);
  CHECK(p[0].moved_bytes == 8 * kChunk);
  CHECK(p[0].zero_bytes == 256 * MiB - 8 * kChunk);
  CHECK(p[0].unchanged_bytes == 0);
  CHECK(node.probe(300));  // the whole allocation was released, its zero chunks too

  auto r = node.resume("sparse");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].bytes == 256 * MiB);
  CHECK(r[0].zero_bytes == 256 * MiB - 8 * kChunk);
  CHECK(r[0].moved_bytes == 8 * kChunk);
  CHECK(prog.cmd("check") == "ok 1");
  CHECK(prog.cmd("addr 1") == "ok " + addr);
}

TEST_CASE("a second pause rewrites only the chunks that changed: zero chunks that took data, and edited ones") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("again", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 67108864 direct sparse 8388608")).empty());  // 64 MiB, 8 data chunks
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33554432 direct")).empty());                 // 32 MiB, all data
  REQUIRE(node.pause("again").ok());
  REQUIRE(node.resume("again").ok());
  REQUIRE(prog.cmd("check") == "ok 2");

  // Unchanged since: nothing is written again.
  auto same = node.pause("again");
  INFO(same.text);
  REQUIRE(same.ok());
  CHECK(same[0].zero_bytes == 64 * MiB - 8 * kChunk);
  CHECK(same[0].unchanged_bytes == 8 * kChunk + 32 * MiB);
  CHECK(same[0].moved_bytes == 0);
  auto back = node.resume("again");
  INFO(back.text);
  REQUIRE(back.ok());
  CHECK(back[0].moved_bytes == 8 * kChunk + 32 * MiB);  // a resume reads every data chunk
  REQUIRE(prog.cmd("check") == "ok 2");

  // One byte in a data chunk of each, and one in a zero chunk of the first.
  REQUIRE(prog.cmd("edit 1 100") == "ok");
  REQUIRE(prog.cmd("edit 2 " + std::to_string(5 * MiB)) == "ok");
  REQUIRE(prog.cmd("edit 1 " + std::to_string(3 * MiB)) == "ok");
  auto changed = node.pause("again");
  INFO(changed.text);
  REQUIRE(changed.ok());
  CHECK(changed[0].zero_bytes == 64 * MiB - 9 * kChunk);
  CHECK(changed[0].moved_bytes == 3 * kChunk);
  CHECK(changed[0].unchanged_bytes == 7 * kChunk + 32 * MiB - kChunk);
  auto r = node.resume("again");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("an allocation that is all zero moves no byte, is released, and resumes as zeros at the same address") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("nothing", 0));
  REQUIRE(prog.line() == "ready");
  const std::string addr = ok_addr(prog.cmd("alloc 1 134217728 direct sparse 0"));
  REQUIRE_FALSE(addr.empty());
  CHECK_FALSE(node.probe(200));
  auto p = node.pause("nothing");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == 128 * MiB);
  CHECK(p[0].zero_bytes == 128 * MiB);
  CHECK(p[0].moved_bytes == 0);
  CHECK(node.probe(200));
  auto ranks = node.status();
  REQUIRE(ranks.size() == 1);
  CHECK(ranks[0].totals.state == "paused");
  auto r = node.resume("nothing");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].zero_bytes == 128 * MiB);
  CHECK(prog.cmd("zeros 1") == "ok");
  CHECK(prog.cmd("addr 1") == "ok " + addr);
  CHECK_FALSE(node.probe(200));
}

TEST_CASE("with TMSDISK_ZERO_SCAN=0 every chunk is written and read, zero or not") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("noscan", 0);
  env["TMSDISK_ZERO_SCAN"] = "0";
  Proc prog({CUDA_PATTERN_PATH}, env);
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct sparse 0")).empty());
  auto p = node.pause("noscan");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].zero_bytes == 0);
  CHECK(p[0].moved_bytes == 32 * MiB);
  auto r = node.resume("noscan");
  REQUIRE(r.ok());
  CHECK(r[0].moved_bytes == 32 * MiB);
  CHECK(prog.cmd("zeros 1") == "ok");
}

TEST_CASE("tmsctl says what a pause skipped, in words and in status") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("words", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct sparse 16777216")).empty());  // 2 data chunks of 16
  auto cap = run_captured({TMSCTL_PATH, "--socket", node.socket, "pause", "--job", "words"}, node.sim_env());
  INFO(cap.out << cap.err);
  REQUIRE(cap.rc == 0);
  CHECK(cap.out.find("paused 32.0 MiB in ") != std::string::npos);
  CHECK(cap.out.find(": 4.0 MiB written, 28.0 MiB zero, 0 B unchanged (not written)") != std::string::npos);
  auto [rc, out] = node.tmsctl({"status"});
  json j = json::parse(out, nullptr, false);
  REQUIRE((j.is_array() && j.size() == 1));
  CHECK(j[0]["last_pause"]["zero_bytes"] == 28 * MiB);
  CHECK(j[0]["last_pause"]["moved_bytes"] == 4 * MiB);
  auto text = run_captured({TMSCTL_PATH, "--socket", node.socket, "status"}, node.sim_env());
  INFO(text.out);
  CHECK(text.out.find("last pause: 4.0 MiB written, 28.0 MiB zero") != std::string::npos);
  auto r = run_captured({TMSCTL_PATH, "--socket", node.socket, "resume", "--job", "words"}, node.sim_env());
  INFO(r.out << r.err);
  CHECK(r.rc == 0);
  CHECK(r.out.find(": 4.0 MiB read, 28.0 MiB zero (set on the device)") != std::string::npos);
  CHECK(prog.cmd("check") == "ok 1");
}
