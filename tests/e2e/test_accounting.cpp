// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: `tmsctl status` accounting adds up for every allocation path the shim
// knows, before and after a pause, and pointer queries on paused memory answer as for a
// native allocation.
#include <sstream>

#include "e2e.h"

using namespace tmsdisk::e2e;

namespace {

constexpr uint64_t kMinBytes = 1 * MiB;

// "ready k=v k=v ..." -> {k: v}.
std::map<std::string, long long> parse_ready(const std::string& line) {
  std::map<std::string, long long> out;
  std::istringstream in(line);
  std::string word;
  in >> word;
  if (word != "ready") return out;
  while (in >> word) {
    auto eq = word.find('=');
    if (eq != std::string::npos) out[word.substr(0, eq)] = std::stoll(word.substr(eq + 1));
  }
  return out;
}

}  // namespace

TEST_CASE("status adds up - resident + paused + unmanaged by reason is what the program allocated, paused or not") {
  Node node;
  node.device_mb = 48;
  node.start_daemon();
  Env env = node.shim_env("acct", 0);
  env["TMSDISK_MIN_BYTES"] = std::to_string(kMinBytes);
  Proc prog({CUDA_ACCOUNTING_PATH}, env);
  const std::string ready = prog.line();
  INFO(ready);
  auto got = parse_ready(ready);
  REQUIRE(got.count("managed") == 1);
  REQUIRE(got["retain"] == 0);  // the shim hands out the real handle of its cuMemAlloc memory
  REQUIRE(got["export"] == 0);  // created exportable (legacy IPC goes through such exports)
  const uint64_t managed = got["managed"], small = got["small"], unified = got["managed-memory"], pool = got["pool"],
                 exported = got["exported"];
  // The shim counts the bytes asked for, not their rounding to the granularity.
  Totals want;
  want.state = "running";
  want.resident = managed;
  want.unmanaged = {{"small", small}, {"managed-memory", unified}, {"pool", pool}, {"exported", exported}};
  Totals t;
  CHECK(eventually([&] { return (t = totals(node)) == want; }));
  INFO("running: " << show(t));
  const uint64_t allocated = managed + small + unified + pool + exported;
  CHECK(accounted(t) == allocated);
  REQUIRE(prog.cmd("query") == "ok");
  // The pool keeps what cuMemFreeAsync gave back: the device is short of it until a trim.
  CHECK_FALSE(node.probe(30));

  auto pj = node.pause("acct");
  INFO(pj.text);
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == managed);
  want.state = "paused";
  want.resident = 0;
  want.paused = managed;
  CHECK(eventually([&] { return (t = totals(node)) == want; }));
  INFO("paused: " << show(t));
  CHECK(accounted(t) == allocated);
  // Pointer queries answer the user's base and size without touching the paused memory.
  CHECK(prog.cmd("query") == "ok");
  // Paused memory and the pool's idle memory (trimmed) went back to the device.
  CHECK(node.probe(30));

  auto rj = node.resume("acct");
  INFO(rj.text);
  REQUIRE(rj.ok());
  want.state = "running";
  want.resident = managed;
  want.paused = 0;
  CHECK(eventually([&] { return (t = totals(node)) == want; }));
  INFO("resumed: " << show(t));
  CHECK(accounted(t) == allocated);
  CHECK(prog.cmd("query") == "ok");
  CHECK(prog.cmd("check") == "ok");
  CHECK(prog.cmd("exit") == "ok");
  CHECK(prog.wait() == 0);
}

TEST_CASE(
    "cuMemRetainAllocationHandle on cuMemAlloc memory keeps it resident for good - pauses leave it mapped and intact") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("retained", 0);
  env["TMSDISK_MIN_BYTES"] = std::to_string(kMinBytes);
  Proc prog({CUDA_ACCOUNTING_PATH}, env);
  const std::string ready = prog.line();
  INFO(ready);
  auto got = parse_ready(ready);
  REQUIRE(got.count("exported") == 1);
  REQUIRE(got["retain"] == 0);
  const uint64_t managed = got["managed"], exported = got["exported"];
  Totals t;
  CHECK(eventually([&] {
    t = totals(node);
    return t.unmanaged.count("exported") && t.unmanaged["exported"] == exported && t.resident == managed;
  }));
  INFO(show(t));
  for (int cycle = 0; cycle < 3; ++cycle) {
    INFO("cycle " << cycle);
    auto pj = node.pause("retained");
    INFO(pj.text);
    REQUIRE(pj.ok());
    CHECK(pj[0].bytes == managed);  // the retained allocation is not moved
    CHECK(eventually([&] {
      t = totals(node);
      return t.state == "paused" && t.paused == managed && t.unmanaged["exported"] == exported;
    }));
    INFO(show(t));
    // Still mapped, with its data: a host read of paused memory would fault on simcuda.
    CHECK(prog.cmd("peek") == "ok");
    auto rj = node.resume("retained");
    INFO(rj.text);
    REQUIRE(rj.ok());
    CHECK(eventually([&] {
      t = totals(node);
      return t.state == "running" && t.resident == managed && t.unmanaged["exported"] == exported;
    }));
    CHECK(prog.cmd("check") == "ok");
  }
  CHECK(prog.cmd("exit") == "ok");
  CHECK(prog.wait() == 0);
}
