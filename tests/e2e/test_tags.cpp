// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: tags (README.md, "Tags: pause part of a process"). Allocations a thread
// makes inside a region carry its tag and policy; `tmsctl pause --tag` and tmsdisk_pause_tag move
// only those, the rest of the program runs; regions nest; discard releases memory unsaved and resumes
// it zero-filled at the same address; resident memory is never paused; another thread's region does
// not tag this thread's memory. Each TEST_CASE is its own CTest test.
#include <catch2/catch.hpp>
#include <string>

#include "e2e.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

TEST_CASE("only the tagged allocations move, and the rest of the program runs while they are paused") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("tags", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());  // untagged
  REQUIRE(prog.cmd("tag push weights backup") == "ok");
  const std::string weights = ok_addr(prog.cmd("alloc 2 16777216 direct"));
  REQUIRE_FALSE(weights.empty());
  REQUIRE(prog.cmd("tag pop") == "ok");

  auto p = node.control("pause", {"--job", "tags", "--tag", "weights"});
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == 16 * MiB);
  CHECK(p[0].moved_bytes == 16 * MiB);
  // The untagged memory is still the program's: calls naming it run while the weights are paused.
  CHECK(prog.cmd("check 1") == "ok");
  RankStatus r = node.status().at(0);
  CHECK(r.totals.paused == 16 * MiB);
  CHECK(r.totals.resident == 32 * MiB);

  // A tag nobody carries is nothing to do, for a rank and for the job.
  auto none = node.control("pause", {"--job", "tags", "--tag", "kv_cache"});
  INFO(none.text);
  REQUIRE(none.ok());
  CHECK(none[0].outcome == "no-op");

  auto back = node.control("resume", {"--job", "tags", "--tag", "weights"});
  INFO(back.text);
  REQUIRE(back.ok());
  CHECK(back[0].bytes == 16 * MiB);
  CHECK(prog.cmd("check") == "ok 2");
  CHECK(prog.cmd("addr 2") == "ok " + weights);
  // "untagged" is a tag like the others.
  REQUIRE(node.control("pause", {"--job", "tags", "--tag", "untagged"}).ok());
  CHECK(node.status().at(0).totals.paused == 32 * MiB);
  REQUIRE(node.control("resume", {"--job", "tags"}).ok());
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("regions nest: the innermost tag wins, the outer one comes back when it ends") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("nest", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("tag push outer backup") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 8388608 direct")).empty());
  REQUIRE(prog.cmd("tag push inner backup") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 4194304 direct")).empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 3 8388608 direct")).empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  CHECK(prog.cmd("tag pop") == "err 2");  // ENOENT: nothing left to pop
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 4 4194304 direct")).empty());

  REQUIRE(prog.cmd("api pause-tag outer") == "ok");
  CHECK(node.status().at(0).totals.paused == 16 * MiB);  // 1 and 3
  CHECK(prog.cmd("check 2") == "ok");
  CHECK(prog.cmd("check 4") == "ok");
  REQUIRE(prog.cmd("api resume-tag outer") == "ok");
  REQUIRE(prog.cmd("api pause-tag inner") == "ok");
  CHECK(node.status().at(0).totals.paused == 4 * MiB);
  REQUIRE(prog.cmd("api resume-tag inner") == "ok");
  CHECK(prog.cmd("check") == "ok 4");
  // Bad names are refused, never taken for "every allocation".
  CHECK(prog.cmd("tag push bad/name backup") == "err 22");
  CHECK(prog.cmd("tag push fine discardish") == "err 22");
  CHECK(prog.cmd("api pause-tag bad/name") == "err 22");
}

TEST_CASE("discard releases the memory unsaved and resumes it zero-filled at the same address") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("discard", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("tag push kv_cache discard") == "ok");
  const std::string cache = ok_addr(prog.cmd("alloc 1 67108864 direct"));
  REQUIRE_FALSE(cache.empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33554432 direct")).empty());

  // The whole process: the weights are saved, the cache is not.
  auto p = node.pause("discard");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == 96 * MiB);
  CHECK(p[0].discarded_bytes == 64 * MiB);
  CHECK(p[0].moved_bytes == 32 * MiB);
  CHECK(node.status().at(0).disk_bytes == 32 * MiB);
  // Another process can have all of it.
  CHECK(node.probe(96));
  auto r = node.resume("discard");
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].discarded_bytes == 64 * MiB);
  CHECK(r[0].moved_bytes == 32 * MiB);
  CHECK(prog.cmd("addr 1") == "ok " + cache);
  CHECK(prog.cmd("zeros 1") == "ok");
  CHECK(prog.cmd("check 2") == "ok");

  // The cache alone: no daemon work, no disk; the weights run on meanwhile.
  REQUIRE(prog.cmd("refill 1") == "ok");
  auto c = node.control("pause", {"--job", "discard", "--tag", "kv_cache"});
  INFO(c.text);
  REQUIRE(c.ok());
  CHECK(c[0].discarded_bytes == 64 * MiB);
  CHECK(c[0].moved_bytes == 0);
  CHECK(prog.cmd("check 2") == "ok");
  // tmsctl status tells the tags and policies apart, in words and in JSON.
  auto [rc, text] = run({TMSCTL_PATH, "--socket", node.socket, "status"}, node.sim_env());
  INFO(text);
  CHECK(rc == 0);
  CHECK(text.find("kv_cache (discard) 64.0 MiB paused") != std::string::npos);
  CHECK(text.find("untagged (backup) 32.0 MiB resident") != std::string::npos);
  auto [jrc, js] = node.tmsctl({"status"});
  CHECK(jrc == 0);
  const json ranks = json::parse(js, nullptr, false);
  REQUIRE(ranks.is_array());
  bool listed = false;
  for (const auto& t : ranks.at(0).at("tags"))
    listed |= t.value("tag", "") == "kv_cache" && t.value("policy", "") == "discard" &&
              t.value("paused_bytes", uint64_t{0}) == 64 * MiB;
  CHECK(listed);
  REQUIRE(node.control("resume", {"--job", "discard", "--tag", "kv_cache"}).ok());
  CHECK(prog.cmd("zeros 1") == "ok");
}

TEST_CASE("a tag whose policy is resident is never paused, and status says why it stays") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("resident", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("tag push pinned resident") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 16777216 direct")).empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 16777216 direct")).empty());
  auto p = node.pause("resident");
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == 16 * MiB);
  RankStatus r = node.status().at(0);
  CHECK(r.totals.unmanaged["resident-by-request"] == 16 * MiB);
  REQUIRE(node.resume("resident").ok());
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("an allocation made by another thread while this one has a tag active is not tagged") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("threads", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("tag push mine backup") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 8388608 direct")).empty());   // this thread: tagged
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 16777216 thread")).empty());  // another thread: untagged
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE(prog.cmd("api pause-tag mine") == "ok");
  CHECK(node.status().at(0).totals.paused == 8 * MiB);
  REQUIRE(prog.cmd("api resume-tag mine") == "ok");
  REQUIRE(prog.cmd("api pause-tag untagged") == "ok");
  CHECK(node.status().at(0).totals.paused == 16 * MiB);
  REQUIRE(prog.cmd("api resume-tag untagged") == "ok");
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE(
    "backed-up tags pause one after another, then the whole process over them, and resume apart: the others stay "
    "paused, every byte comes back") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("two", 0);
  env["TMSDISK_ON_TOUCH"] = "fail";  // a call held at the gate fails (CUDA_ERROR_NOT_PERMITTED) instead of waiting
  Proc prog({CUDA_PATTERN_PATH}, env);
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("tag push a backup") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 8388608 direct")).empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE(prog.cmd("tag push b backup") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 8388608 direct")).empty());
  REQUIRE(prog.cmd("tag pop") == "ok");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 3 4194304 direct")).empty());  // untagged, stays resident
  REQUIRE(node.control("pause", {"--job", "two", "--tag", "a"}).ok());
  // b pauses while a stays paused: only b's bytes move (a is carried as the daemon stores it).
  auto second = node.control("pause", {"--job", "two", "--tag", "b"});
  INFO(second.text);
  REQUIRE(second.ok());
  CHECK(second[0].bytes == 8 * MiB);
  CHECK(second[0].moved_bytes == 8 * MiB);
  CHECK(node.status().at(0).totals.paused == 16 * MiB);
  CHECK(prog.cmd("check 3") == "ok");  // the untagged memory runs on
  // A pause of the whole process over paused tags carries them too: only the untagged bytes move.
  auto whole = node.pause("two");
  INFO(whole.text);
  REQUIRE(whole.ok());
  CHECK(whole[0].bytes == 4 * MiB);
  CHECK(whole[0].moved_bytes == 4 * MiB);
  CHECK(node.status().at(0).totals.paused == 20 * MiB);
  // a comes back alone; b and the untagged memory stay paused. Memory no tag covers is paused only
  // by a whole pause and any kernel may reach it: the whole process stays held until it is back.
  auto a_back = node.control("resume", {"--job", "two", "--tag", "a"});
  INFO(a_back.text);
  REQUIRE(a_back.ok());
  CHECK(a_back[0].bytes == 8 * MiB);
  CHECK(a_back.text.find("stays held") != std::string::npos);
  CHECK(node.status().at(0).totals.paused == 12 * MiB);
  CHECK(prog.cmd("check 1") == "err copy 800");
  // a pauses again beside them.
  REQUIRE(node.control("pause", {"--job", "two", "--tag", "a"}).ok());
  CHECK(node.status().at(0).totals.paused == 20 * MiB);
  auto all_back = node.control("resume", {"--job", "two"});
  INFO(all_back.text);
  REQUIRE(all_back.ok());
  CHECK(all_back[0].bytes == 20 * MiB);
  CHECK(prog.cmd("check") == "ok 3");
  // With every allocation tagged, one tag brought back alone after a whole pause runs on while the
  // others stay: only calls naming them are held.
  REQUIRE(prog.cmd("free 3") == "ok");
  REQUIRE(node.pause("two").ok());
  auto b_back = node.control("resume", {"--job", "two", "--tag", "b"});
  INFO(b_back.text);
  REQUIRE(b_back.ok());
  CHECK(b_back.text.find("stays held") == std::string::npos);
  CHECK(prog.cmd("check 2") == "ok");
  CHECK(prog.cmd("edit 2 4096") == "ok");
  CHECK(prog.cmd("check 1") == "err copy 800");
  CHECK(node.status().at(0).totals.paused == 8 * MiB);
  REQUIRE(node.control("resume", {"--job", "two"}).ok());
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("tags on two devices pause one after another and resume together from the other device") {
  // torch_memory_saver's multi-device example: a tag per device, each paused with its own device current,
  // all resumed with device 0 current; each allocation comes back on its own device, intact.
  Node node;
  node.start_daemon();
  Env env = node.shim_env("devices", 0);
  env["SIMCUDA_DEVICE_COUNT"] = std::to_string(2);  // (a literal here trips GCC 12's -Wrestrict)
  Proc prog({CUDA_PATTERN_PATH}, env);
  REQUIRE(prog.line() == "ready");
  for (int device = 0; device < 2; ++device) {
    const std::string n = std::to_string(device);
    REQUIRE(prog.cmd("device " + n) == "ok");
    REQUIRE(prog.cmd("tag push on_device_" + n + " backup") == "ok");
    REQUIRE_FALSE(ok_addr(prog.cmd("alloc " + std::to_string(device + 1) + " 8388608 direct")).empty());
    REQUIRE(prog.cmd("tag pop") == "ok");
  }
  REQUIRE(prog.cmd("device 0") == "ok");
  REQUIRE(prog.cmd("api pause-tag on_device_0") == "ok");
  REQUIRE(prog.cmd("device 1") == "ok");
  REQUIRE(prog.cmd("api pause-tag on_device_1") == "ok");  // carries device 0's
  CHECK(node.status().at(0).totals.paused == 16 * MiB);
  REQUIRE(prog.cmd("device 0") == "ok");
  REQUIRE(prog.cmd("api resume") == "ok");
  CHECK(node.status().at(0).totals.paused == 0);
  CHECK(prog.cmd("check") == "ok 2");
  CHECK(prog.cmd("ordinal 1") == "ok 0");
  CHECK(prog.cmd("ordinal 2") == "ok 1");
  // The whole process, both devices at once, and back.
  REQUIRE(prog.cmd("api pause") == "ok");
  CHECK(node.status().at(0).totals.paused == 16 * MiB);
  REQUIRE(prog.cmd("api resume") == "ok");
  CHECK(prog.cmd("check") == "ok 2");
}
