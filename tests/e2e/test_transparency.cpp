// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: a pause that may arrive at any moment (the gate and TMSDISK_ON_TOUCH),
// application-managed VMM, and peer access replayed on resume.
#include "e2e.h"

using namespace tmsdisk::e2e;

namespace {

// The state tmsctl status reports for the first rank (each case runs one).
std::string rank_state(const Node& node) {
  auto ranks = node.status();
  return ranks.empty() ? "?" : ranks[0].totals.state;
}

}  // namespace

TEST_CASE("threads launching and copying on several streams while tmsctl pauses and resumes 100 times") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_TOUCH_PATH, "4"}, node.shim_env("busy", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("start") == "ok");
  for (int cycle = 0; cycle < 100; ++cycle) {
    INFO("cycle " << cycle);
    auto pj = node.pause("busy");
    INFO(pj.text);
    REQUIRE(pj.ok());
    auto rj = node.resume("busy");
    INFO(rj.text);
    REQUIRE(rj.ok());
  }
  // Every worker's data is what its adds made, and no queued work ever met unmapped memory (simcuda
  // would have poisoned the context with CUDA_ERROR_ILLEGAL_ADDRESS).
  const std::string done = prog.cmd("stop");
  INFO(done);
  REQUIRE(done.rfind("ok ", 0) == 0);
  CHECK(std::stoull(done.substr(3)) > 0);
  CHECK(prog.cmd("launch") == "ok 0");
  CHECK(prog.cmd("probe 1") == "ok");
}

TEST_CASE("TMSDISK_ON_TOUCH=wait - a launch during a pause returns only after the resume") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("wait", 0);
  env["TMSDISK_ON_TOUCH"] = "wait";
  Proc prog({CUDA_TOUCH_PATH, "1"}, env);
  REQUIRE(prog.line() == "ready");
  auto pj = node.pause("wait");
  REQUIRE(pj.ok());
  prog.send("launch");
  CHECK(prog.line(300).empty());  // held at the gate
  CHECK(rank_state(node) == "paused");
  auto rj = node.resume("wait");
  REQUIRE(rj.ok());
  CHECK(prog.line() == "ok 0");  // it returned with the process running again
  CHECK(prog.cmd("probe 1") == "ok");
}

TEST_CASE("TMSDISK_ON_TOUCH=resume - a launch during a pause resumes the process and proceeds") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("autoresume", 0);
  env["TMSDISK_ON_TOUCH"] = "resume";
  Proc prog({CUDA_TOUCH_PATH, "1"}, env);
  REQUIRE(prog.line() == "ready");
  auto pj = node.pause("autoresume");
  REQUIRE(pj.ok());
  CHECK(rank_state(node) == "paused");
  CHECK(prog.cmd("launch") == "ok 0");
  CHECK(rank_state(node) == "running");
  CHECK(prog.cmd("probe 1") == "ok");
}

TEST_CASE("TMSDISK_ON_TOUCH=fail - a launch or stream write during a pause fails and the data stays paused") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("failfast", 0);
  env["TMSDISK_ON_TOUCH"] = "fail";
  Proc prog({CUDA_TOUCH_PATH, "1"}, env);
  REQUIRE(prog.line() == "ready");
  CHECK(prog.cmd("memop 7") == "ok 7");  // a stream memory operation writes while nothing is paused
  CHECK(prog.cmd("memop 0") == "ok 0");
  auto pj = node.pause("failfast");
  REQUIRE(pj.ok());
  CHECK(prog.cmd("launch") == "err 800");   // CUDA_ERROR_NOT_PERMITTED
  CHECK(prog.cmd("memop 5") == "err 800");  // stream memory operations pass the gate too
  CHECK(rank_state(node) == "paused");
  auto rj = node.resume("failfast");
  REQUIRE(rj.ok());
  CHECK(prog.cmd("probe 0") == "ok");  // neither the failed launch nor the failed write ran
  CHECK(prog.cmd("launch") == "ok 0");
  CHECK(prog.cmd("probe 1") == "ok");
}

TEST_CASE("a pause requested during a stream capture is refused with EBUSY - after the capture it succeeds") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_TOUCH_PATH, "1"}, node.shim_env("capture", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("capture begin") == "ok");
  auto pj = node.pause("capture");
  INFO(pj.text);
  CHECK_FALSE(pj.ok());
  REQUIRE(pj.size() == 1);
  CHECK(pj[0].error == EBUSY);
  CHECK(pj[0].message.find("capture") != std::string::npos);
  CHECK(rank_state(node) == "running");
  CHECK(prog.cmd("launch") == "ok 0");  // the refused pause left the gate open
  REQUIRE(prog.cmd("capture end") == "ok");
  auto pj2 = node.pause("capture");
  INFO(pj2.text);
  CHECK(pj2.ok());
  auto rj = node.resume("capture");
  CHECK(rj.ok());
  CHECK(prog.cmd("probe 1") == "ok");
}

TEST_CASE("an expandable-segments style allocator is paused and resumed mid-life, then grows and shrinks on") {
  Node node;
  node.device_mb = 64;
  node.start_daemon();
  Proc prog({CUDA_VMM_APP_PATH}, node.shim_env("segments", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE(prog.cmd("grow 20") == "ok 20");
  REQUIRE(prog.cmd("shrink 5") == "ok 15");
  REQUIRE(prog.cmd("grow 3") == "ok 18");
  REQUIRE(prog.cmd("add 7") == "ok");
  CHECK_FALSE(node.probe(40));
  for (int cycle = 0; cycle < 3; ++cycle) {
    INFO("cycle " << cycle);
    auto pj = node.pause("segments");
    INFO(pj.text);
    REQUIRE(pj.ok());
    CHECK(pj[0].bytes == 18 * 2 * MiB);
    CHECK(node.probe(40));  // the application's own physical memory was handed back
    auto rj = node.resume("segments");
    INFO(rj.text);
    REQUIRE(rj.ok());
    REQUIRE(prog.cmd("check") == "ok 18");
    // Its handles (tokens) still work: shrink releases them, grow maps new ones.
    REQUIRE(prog.cmd("shrink 4") == "ok 14");
    REQUIRE(prog.cmd("grow 4") == "ok 18");
    REQUIRE(prog.cmd("add 1") == "ok");
    REQUIRE(prog.cmd("check") == "ok 18");
  }
  // A pause with TMSDISK_ON_TOUCH=wait holds the allocator's next map until the resume.
  auto pj = node.pause("segments");
  REQUIRE(pj.ok());
  prog.send("grow 1");
  CHECK(prog.line(300).empty());
  auto rj = node.resume("segments");
  REQUIRE(rj.ok());
  CHECK(prog.line() == "ok 19");
  CHECK(prog.cmd("check") == "ok 19");
}

TEST_CASE("peer access enabled with cuCtxEnablePeerAccess opens managed memory to the peer, and again after a resume") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("peer", 0);
  env["SIMCUDA_DEVICE_COUNT"] = std::to_string(2);  // (a literal here trips GCC 12's -Wrestrict)
  env["TMSDISK_MIN_BYTES"] = std::to_string(1 * MiB);
  Proc prog({CUDA_PEER_PATH}, env);
  REQUIRE(prog.line() == "ready");
  // VMM memory is not opened by peer access by itself: the shim grants it, to the buffer allocated
  // before and to the one allocated after.
  CHECK(prog.cmd("access") == "ok 3 3");
  CHECK(prog.cmd("copy") == "ok");
  for (int cycle = 0; cycle < 2; ++cycle) {
    INFO("cycle " << cycle);
    auto pj = node.pause("peer");
    INFO(pj.text);
    REQUIRE(pj.ok());
    CHECK(pj[0].bytes >= 8 * MiB);
    auto rj = node.resume("peer");
    INFO(rj.text);
    REQUIRE(rj.ok());
    // New physical memory, the same rights for the peer.
    CHECK(prog.cmd("access") == "ok 3 3");
    CHECK(prog.cmd("copy") == "ok");
  }
  CHECK(prog.cmd("exit") == "ok");
  CHECK(prog.wait() == 0);
}
