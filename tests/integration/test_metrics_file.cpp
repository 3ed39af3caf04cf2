// SPDX-License-Identifier: Apache-2.0
// tmsdiskd --metrics-file: a real daemon on a temp socket and root, a client playing the rank's part
// (its pause and resume move real chunks through the daemon), tmsctl's requests; the file it writes
// for node-exporter's textfile collector read back with the tests' own parser of the format. The
// interval is an hour throughout: what the cases see is written at start and after each operation.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <thread>

#include "client.h"
#include "daemon_fixture.h"
#include "metrics_file.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;

namespace {

// The daemon fixture with a metrics file in a textfile collector's directory, and a rank's part in
// tmsctl's pause and resume.
struct MetricsNode : Daemon {
  std::string root = roots[0];
  std::string textfile_dir = dir / "textfile";
  std::string metrics = textfile_dir + "/tmsdisk.prom";

  MetricsNode() : Daemon(Options{.staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB}) {}
  void start(const std::string& metrics_file) {
    Daemon::start({"--metrics-file", metrics_file, "--metrics-interval-s", "3600"});
  }
  ShimClient rank(const std::string& job, int64_t rank) { return shim({.job = job, .rank = rank}); }
  // tmsctl pause or resume of `job`; `answer` plays the one rank's part once the COMMAND reaches it,
  // and gives its answer (none: the rank went without one).
  ctl::ControlAnswer control(proto::CommandOp op, const std::string& job, ShimClient& rank,
                             const std::function<std::optional<proto::CommandDone>(const proto::Command&)>& answer) {
    auto client = ctl::Client::connect(socket);
    REQUIRE(client);
    Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
    std::thread asker([&] {
      proto::Control req;
      req.op = static_cast<uint8_t>(op);
      req.match = proto::kMatchJob;
      req.job = job;
      results = client->control(req, ctl::Deadline::fixed(std::chrono::seconds(60)));
    });
    auto cmd = rank.receive();
    const proto::Command* command = cmd ? std::get_if<proto::Command>(&cmd->body) : nullptr;
    if (command) {
      if (const auto done = answer(*command))
        CHECK(proto::send_message(rank.fd(), proto::encode(cmd->request_id, *done)) == 0);
    }
    asker.join();
    REQUIRE(command);
    INFO((results ? "" : results.error().describe()));
    REQUIRE(results);
    return std::move(results.value());
  }
  // The file as node-exporter would read it now, checked line by line against the format.
  ParsedExposition read_metrics() const { return testing::read_metrics(metrics); }
};

proto::CommandDone done(uint64_t bytes, uint64_t nanos) {
  return {.bytes = bytes, .nanos = nanos, .outcome = static_cast<uint8_t>(proto::Outcome::Done)};
}

}  // namespace

TEST_CASE("the metrics file counts a pause and a resume as each completes, with the bytes moved and its duration") {
  MetricsNode node;
  fs::create_directories(node.textfile_dir);
  node.start(node.metrics);
  {
    // Written before the daemon said it was ready: nothing counted yet, the version and the root named.
    const ParsedExposition e = node.read_metrics();
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 0);
    CHECK(e.value("tmsdisk_build_info", {{"version", TMSDISK_VERSION}}) == 1);
    CHECK(e.value("tmsdisk_disk_bytes", {{"root", node.root}}) == 0);
    CHECK(e.value("tmsdisk_start_time_seconds") > 0);
  }

  auto rank = node.rank("metrics", 0);
  const std::vector<proto::BlobSize> blobs = {{1, 20 * MiB}, {2, 5 * MiB + 12345}};
  const uint64_t paused_bytes = 25 * MiB + 12345;
  auto paused = node.control(proto::CommandOp::Pause, "metrics", rank, [&](const proto::Command&) {
    REQUIRE(rank.reserve(blobs));
    REQUIRE(rank.write_all(blobs, fill_pattern));
    REQUIRE(rank.commit(proto::CommitState::Paused));
    return std::optional(done(paused_bytes, 1'500'000'000));
  });
  REQUIRE(paused.results.size() == 1);
  REQUIRE(paused.results[0].code == 0);
  {
    // Read as soon as tmsctl has the result: the daemon wrote the file before passing it on.
    const ParsedExposition e = node.read_metrics();
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 1);
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "failed"}}) == 0);
    CHECK(e.value("tmsdisk_resumes_total", {{"result", "ok"}}) == 0);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "pause"}, {"tier", "disk"}}) == paused_bytes);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "pause"}}) == 1);
    CHECK(e.value("tmsdisk_operation_duration_seconds_sum", {{"op", "pause"}}) == 1.5);
    CHECK(e.value("tmsdisk_operation_duration_seconds_bucket", {{"op", "pause"}, {"le", "2.5"}}) == 1);
    CHECK(e.value("tmsdisk_sessions", {{"state", "connected"}}) == 1);
    CHECK(e.value("tmsdisk_staging_bytes") == rank.welcome().staging_budget_bytes);
    // The root holds what the rank's files take, as `tmsctl status` counts it.
    auto sessions = ctl::Client::connect(node.socket)->list_sessions();
    REQUIRE(sessions);
    REQUIRE(sessions->size() == 1);
    CHECK(e.value("tmsdisk_disk_bytes", {{"root", node.root}}) == sessions->front().disk_bytes);
    CHECK(sessions->front().disk_bytes >= paused_bytes);
  }

  auto resumed = node.control(proto::CommandOp::Resume, "metrics", rank, [&](const proto::Command&) {
    REQUIRE(rank.read_all(blobs, check_pattern));
    REQUIRE(rank.commit(proto::CommitState::Resumed));
    return std::optional(done(paused_bytes, 2'000'000'000));
  });
  REQUIRE(resumed.results.size() == 1);
  REQUIRE(resumed.results[0].code == 0);
  {
    const ParsedExposition e = node.read_metrics();
    CHECK(e.value("tmsdisk_resumes_total", {{"result", "ok"}}) == 1);
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 1);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "resume"}, {"tier", "disk"}}) == paused_bytes);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", "pause"}, {"tier", "disk"}}) == paused_bytes);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "resume"}}) == 1);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "pause"}}) == 1);
  }

  // Only the file: each write went to a temp file beside it, renamed over it.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(node.textfile_dir)) names.push_back(entry.path().filename());
  CHECK(names == std::vector<std::string>{"tmsdisk.prom"});
  // A stopped daemon's figures must not look current: the file goes with it.
  CHECK(node.proc.stop() == 0);
  CHECK_FALSE(fs::exists(node.metrics));
}

TEST_CASE("failures are counted by cause - a rank whose connection drops before it answers, as disconnected") {
  MetricsNode node;
  fs::create_directories(node.textfile_dir);
  node.start(node.metrics);
  auto full = node.rank("full", 0);
  auto refused = node.control(proto::CommandOp::Pause, "full", full, [](const proto::Command&) {
    return std::optional(proto::CommandDone{.code = ENOSPC, .message = "not enough disk space"});
  });
  REQUIRE(refused.results.size() == 1);
  CHECK(refused.results[0].code == ENOSPC);
  auto noop = node.control(proto::CommandOp::Resume, "full", full, [](const proto::Command&) {
    return std::optional(
        proto::CommandDone{.message = "nothing is paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)});
  });
  REQUIRE(noop.results.size() == 1);

  auto gone = node.rank("gone", 0);
  auto lost = node.control(proto::CommandOp::Resume, "gone", gone, [&](const proto::Command&) {
    gone.close();  // asked, then gone without an answer
    return std::optional<proto::CommandDone>();
  });
  REQUIRE(lost.results.size() == 1);
  CHECK(lost.results[0].code == ECONNRESET);

  const ParsedExposition e = node.read_metrics();
  CHECK(e.value("tmsdisk_pauses_total", {{"result", "failed"}}) == 1);
  CHECK(e.value("tmsdisk_operation_failures_total", {{"op", "pause"}, {"cause", "enospc"}}) == 1);
  CHECK(e.value("tmsdisk_resumes_total", {{"result", "no_op"}}) == 1);
  CHECK(e.value("tmsdisk_resumes_total", {{"result", "failed"}}) == 1);
  CHECK(e.value("tmsdisk_operation_failures_total", {{"op", "resume"}, {"cause", "disconnected"}}) == 1);
  // Neither a refusal nor a no-op is a duration worth a bucket.
  CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "pause"}}) == 0);
  CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", "resume"}}) == 0);
}

TEST_CASE("a metrics file that cannot be written is logged once - the daemon serves on and writes it once it can") {
  MetricsNode node;
  node.start(node.metrics);  // its directory does not exist yet
  auto rank = node.rank("nowhere", 0);
  auto nothing_to_do = [](const proto::Command&) {
    return std::optional(
        proto::CommandDone{.message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)});
  };
  for (int i = 0; i < 3; ++i)
    REQUIRE(node.control(proto::CommandOp::Pause, "nowhere", rank, nothing_to_do).results.size() == 1);
  const std::string log = node.proc.log();
  INFO(log);
  std::size_t complaints = 0;
  for (auto at = log.find("metrics: cannot write"); at != std::string::npos;
       at = log.find("metrics: cannot write", at + 1))
    ++complaints;
  CHECK(complaints == 1);  // at start; the three writes after each pause failed the same way, unlogged

  fs::create_directories(node.textfile_dir);
  REQUIRE(node.control(proto::CommandOp::Pause, "nowhere", rank, nothing_to_do).results.size() == 1);
  const ParsedExposition e = node.read_metrics();
  CHECK(e.value("tmsdisk_pauses_total", {{"result", "no_op"}}) == 4);
  CHECK_THAT(node.proc.log(), Catch::Matchers::Contains("is written again"));
}

namespace {

// Whether `path` is a regular file holding exactly `text`.
bool holds(const std::string& path, const std::string& text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()) == text;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  return names;
}

}  // namespace

TEST_CASE("a metrics directory swapped for a symbolic link after start - what the link points at is never touched") {
  MetricsNode node;
  fs::create_directories(node.textfile_dir);
  node.start(node.metrics);
  REQUIRE(fs::exists(node.metrics));
  // The owner of the directory above (Debian: `prometheus`) moves the directory aside and puts a link to
  // a private directory of root's in its place, naming a file root holds there.
  const std::string victim = node.dir / "private";
  fs::create_directories(victim);
  fs::permissions(victim, fs::perms::owner_all);
  const std::string precious = victim + "/tmsdisk.prom";
  std::ofstream(precious) << "precious\n";
  const std::string aside = node.dir / "aside";
  fs::rename(node.textfile_dir, aside);
  fs::create_directory_symlink(victim, node.textfile_dir);

  auto rank = node.rank("swapped", 0);
  REQUIRE(node.control(proto::CommandOp::Pause, "swapped", rank,
                       [](const proto::Command&) {
                         return std::optional(proto::CommandDone{
                             .message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)});
                       })
              .results.size() == 1);
  // Written where the daemon opened it: the directory moved aside.
  CHECK(holds(precious, "precious\n"));
  CHECK(names_in(victim) == std::vector<std::string>{"tmsdisk.prom"});
  {
    std::ifstream in(aside + "/tmsdisk.prom");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const ParsedExposition e = parse_exposition(text);
    CHECK(e.value("tmsdisk_pauses_total", {{"result", "no_op"}}) == 1);
  }
  // Stopping removes the file it wrote, not the one the link names.
  CHECK(node.proc.stop() == 0);
  CHECK(holds(precious, "precious\n"));
  CHECK_FALSE(fs::exists(aside + "/tmsdisk.prom"));
}

TEST_CASE("a metrics directory that is a symbolic link at start is refused, saying so, and its target untouched") {
  MetricsNode node;
  const std::string real = node.dir / "real";
  fs::create_directories(real);
  fs::create_directory_symlink(real, node.textfile_dir);
  node.start(node.metrics);
  CHECK_THAT(node.proc.log(), Catch::Matchers::Contains("is a symbolic link"));
  CHECK(names_in(real).empty());
  CHECK(node.proc.stop() == 0);
  CHECK(names_in(real).empty());
}
