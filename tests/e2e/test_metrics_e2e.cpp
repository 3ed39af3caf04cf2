// SPDX-License-Identifier: Apache-2.0
// tmsdiskd --metrics-file with a real rank: an unmodified CUDA program on the simulated driver with
// the shim preloaded, paused and resumed by the real tmsctl; the Prometheus textfile read back with
// the tests' own parser of the format after each operation (the interval is an hour: what is seen was
// written because the operation completed).
#include <catch2/catch.hpp>

#include "e2e.h"
#include "metrics_file.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

TEST_CASE("a real rank's pause and resume are counted once each, with the bytes it paused moved to disk and back") {
  Node node;
  node.device_mb = 256;
  const std::string textfile_dir = node.dir / "textfile";
  const std::string metrics = textfile_dir + "/tmsdisk.prom";
  fs::create_directories(textfile_dir);
  node.start_daemon({"--metrics-file", metrics, "--metrics-interval-s", "3600"});
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("metrics", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 67108864 direct")).empty());  // 64 MiB
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33558528 dlsym")).empty());   // 32 MiB + 4 KiB
  REQUIRE(prog.cmd("check") == "ok 2");

  auto paused = node.pause("metrics");
  INFO(paused.text);
  REQUIRE(paused.ok());
  REQUIRE(paused.size() == 1);
  const uint64_t bytes = paused[0].bytes;
  CHECK(bytes == 64 * MiB + 32 * MiB + 4096);
  {
    const ParsedExposition e = read_metrics(metrics);
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 1);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "pause"}, {"tier", "disk"}}) == bytes);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "pause"}}) == 1);
    CHECK(e.value("tmsdisk_operation_duration_seconds_bucket", {{"op", "pause"}, {"le", "+Inf"}}) == 1);
    CHECK(e.value("tmsdisk_sessions", {{"state", "connected"}}) == 1);
    CHECK(e.value("tmsdisk_disk_bytes", {{"root", node.root}}) >= bytes);
  }

  auto resumed = node.resume("metrics");
  INFO(resumed.text);
  REQUIRE(resumed.ok());
  REQUIRE(prog.cmd("check") == "ok 2");
  {
    const ParsedExposition e = read_metrics(metrics);
    CHECK(e.value("tmsdisk_resumes_total", {{"result", "ok"}}) == 1);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "resume"}, {"tier", "disk"}}) == bytes);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "resume"}}) == 1);
  }

  // The program pauses itself: its bytes go through the daemon, which hears no result of it. The
  // tmsctl resume that follows is counted, and so are both directions' bytes; unchanged since the
  // first pause, the chunks are not written again, and are counted as skipped.
  REQUIRE(prog.cmd("api pause") == "ok");
  resumed = node.resume("metrics");
  REQUIRE(resumed.ok());
  REQUIRE(prog.cmd("check") == "ok 2");
  const ParsedExposition e = read_metrics(metrics);
  CHECK(e.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 1);
  CHECK(e.value("tmsdisk_resumes_total", {{"result", "ok"}}) == 2);
  CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "pause"}, {"tier", "disk"}}) == bytes);
  CHECK(e.value("tmsdisk_skipped_bytes_total", {{"op", "pause"}, {"reason", "unchanged"}}) == bytes);
  CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "resume"}, {"tier", "disk"}}) == 2 * bytes);
  prog.cmd("exit");
  CHECK(prog.wait() == 0);
}
