// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's metrics (daemon/server/metrics.h): the exposition its formatter writes, read back with the
// tests' own parser (exposition_parser.h); how results are counted; the file written atomically and
// its failures logged once per distinct error.
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

#include "exposition_parser.h"
#include "metrics.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::server;
using namespace tmsdisk::testing;

namespace {

ParsedExposition parsed(const std::string& text) {
  ParsedExposition e = parse_exposition(text);
  INFO(text);
  for (const auto& p : e.problems) UNSCOPED_INFO(p);
  CHECK(e.problems.empty());
  return e;
}

proto::CommandDone answer(int code, uint64_t bytes, uint64_t nanos, proto::Outcome outcome = proto::Outcome::Done) {
  proto::CommandDone d;
  d.code = code;
  d.bytes = bytes;
  d.nanos = nanos;
  d.outcome = static_cast<uint8_t>(outcome);
  return d;
}

Metrics fresh_metrics() {
  return Metrics("0.1.0", std::chrono::system_clock::time_point(std::chrono::seconds(1764000000)));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("a histogram's buckets are cumulative, in increasing order, and end in +Inf equal to the count") {
  Histogram h(kDurationBuckets);
  for (double seconds : {0.05, 0.1, 3.0, 4000.0}) h.observe(seconds);
  Exposition out;
  out.family("tmsdisk_test_seconds", "histogram", "test");
  const std::vector<Label> labels = {{"op", "pause"}};
  h.write(out, "tmsdisk_test_seconds", labels);
  const ParsedExposition e = parsed(out.text());

  const auto buckets = e.all("tmsdisk_test_seconds_bucket");
  REQUIRE(buckets.size() == std::size(kDurationBuckets) + 1);
  double previous_bound = -1, previous_count = 0;
  for (const auto* b : buckets) {
    CHECK(b->labels.at("op") == "pause");
    const double bound = b == buckets.back() ? std::numeric_limits<double>::infinity() : std::stod(b->labels.at("le"));
    CHECK(bound > previous_bound);
    CHECK(b->value >= previous_count);  // cumulative: never fewer than the bucket below
    previous_bound = bound;
    previous_count = b->value;
  }
  CHECK(buckets.back()->labels.at("le") == "+Inf");
  // The bound is inclusive (le): 0.1 falls in le="0.1".
  CHECK(e.value("tmsdisk_test_seconds_bucket", {{"op", "pause"}, {"le", "0.1"}}) == 2);
  CHECK(e.value("tmsdisk_test_seconds_bucket", {{"op", "pause"}, {"le", "2.5"}}) == 2);
  CHECK(e.value("tmsdisk_test_seconds_bucket", {{"op", "pause"}, {"le", "5"}}) == 3);
  CHECK(e.value("tmsdisk_test_seconds_bucket", {{"op", "pause"}, {"le", "3600"}}) == 3);
  CHECK(e.value("tmsdisk_test_seconds_bucket", {{"op", "pause"}, {"le", "+Inf"}}) == 4);
  CHECK(e.value("tmsdisk_test_seconds_count", {{"op", "pause"}}) == 4);
  CHECK(e.value("tmsdisk_test_seconds_sum", {{"op", "pause"}}) == Approx(4003.15));
}

TEST_CASE("label values are escaped as the exposition format wants: backslash, double quote, newline") {
  CHECK(escape_label_value("plain /nvme0/tmsdisk") == "plain /nvme0/tmsdisk");
  CHECK(escape_label_value("a\\b\"c\nd") == "a\\\\b\\\"c\\nd");
  // A root directory may be named with any of them; its sample stays one line and reads back as named.
  const std::string odd_root = "/mnt/we\\ird \"root\"\nname";
  Metrics m = fresh_metrics();
  MetricsSnapshot now;
  now.disk_bytes = {{"/nvme0/tmsdisk", 1}, {odd_root, 4096}};
  const std::string text = m.format(now);
  CHECK(text.find("root=\"/mnt/we\\\\ird \\\"root\\\"\\nname\"} 4096\n") != std::string::npos);
  const ParsedExposition e = parsed(text);
  CHECK(e.value("tmsdisk_disk_bytes", {{"root", odd_root}}) == 4096);
  CHECK(e.value("tmsdisk_disk_bytes", {{"root", "/nvme0/tmsdisk"}}) == 1);
}

TEST_CASE("every family has HELP and TYPE and a tmsdisk_ name, and every known label set is there from the start") {
  Metrics m = fresh_metrics();
  const ParsedExposition e = parsed(m.format({}));
  const std::regex valid_name("^tmsdisk_[a-z0-9_]+$");
  for (const auto& [name, type] : e.type) {
    INFO(name);
    CHECK(std::regex_match(name, valid_name));
    CHECK(e.help.count(name));
    if (type == "counter") CHECK(name.ends_with("_total"));
  }
  CHECK(e.type.at("tmsdisk_operation_duration_seconds") == "histogram");
  CHECK(e.value("tmsdisk_build_info", {{"version", "0.1.0"}}) == 1);
  CHECK(e.value("tmsdisk_start_time_seconds") == 1764000000);
  // At 0 before anything happened, so that the first failure is a change rate() can see.
  for (const char* result : {"ok", "failed", "no_op"}) {
    CHECK(e.value("tmsdisk_pauses_total", {{"result", result}}) == 0);
    CHECK(e.value("tmsdisk_resumes_total", {{"result", result}}) == 0);
  }
  for (const char* op : {"pause", "resume"}) {
    for (const char* cause : {"enospc", "enomem", "eio", "timeout", "disconnected", "other"})
      CHECK(e.value("tmsdisk_operation_failures_total", {{"op", op}, {"cause", cause}}) == 0);
    CHECK(e.value("tmsdisk_moved_bytes_total", {{"op", op}, {"tier", "disk"}}) == 0);
    CHECK(e.value("tmsdisk_operation_duration_seconds_count", {{"op", op}}) == 0);
  }
  CHECK(e.value("tmsdisk_sessions", {{"state", "connected"}}) == 0);
  CHECK(e.value("tmsdisk_sessions", {{"state", "orphaned"}}) == 0);
  CHECK(e.value("tmsdisk_staging_bytes") == 0);
}

TEST_CASE("failure causes come from the errno a rank answered with") {
  CHECK(failure_cause(ENOSPC) == FailureCause::enospc);
  CHECK(failure_cause(EDQUOT) == FailureCause::enospc);
  CHECK(failure_cause(ENOMEM) == FailureCause::enomem);
  CHECK(failure_cause(EIO) == FailureCause::eio);
  CHECK(failure_cause(EBADMSG) == FailureCause::eio);  // a checksum mismatch on resume
  CHECK(failure_cause(ETIMEDOUT) == FailureCause::timeout);
  CHECK(failure_cause(ECONNRESET) == FailureCause::disconnected);
  CHECK(failure_cause(EPIPE) == FailureCause::disconnected);
  CHECK(failure_cause(EBUSY) == FailureCause::other);
  CHECK(failure_cause(EPERM) == FailureCause::other);
}

TEST_CASE("each command is counted once, by its answer or by its rank's lost connection, and counters only grow") {
  Metrics m = fresh_metrics();
  int written = 0;
  m.on_recorded([&] { ++written; });
  std::vector<ParsedExposition> seen{parsed(m.format({}))};

  // Session 1 pauses (1.5 s, 4 chunks of 4 MiB written) and resumes; session 2 is refused for space.
  m.command_sent(10, 1, proto::CommandOp::Pause);
  m.command_sent(11, 2, proto::CommandOp::Pause);
  for (int i = 0; i < 4; ++i) m.moved(io::Op::Write, 4 << 20);
  m.command_answered(10, answer(0, 16 << 20, 1'500'000'000));
  m.command_answered(11, answer(ENOSPC, 0, 2'000'000));
  m.command_answered(11, answer(ENOSPC, 0, 2'000'000));  // a repeat of a counted answer: not counted again
  m.command_answered(99, answer(0, 1, 1));               // no such command
  CHECK(written == 2);
  seen.push_back(parsed(m.format({})));
  const ParsedExposition& after_pause = seen.back();
  CHECK(after_pause.value("tmsdisk_pauses_total", {{"result", "ok"}}) == 1);
  CHECK(after_pause.value("tmsdisk_pauses_total", {{"result", "failed"}}) == 1);
  CHECK(after_pause.value("tmsdisk_operation_failures_total", {{"op", "pause"}, {"cause", "enospc"}}) == 1);
  CHECK(after_pause.value("tmsdisk_moved_bytes_total", {{"op", "pause"}, {"tier", "disk"}}) == 16 << 20);
  // Only the success is timed: a refusal's milliseconds would pull the distribution of real pauses down.
  CHECK(after_pause.value("tmsdisk_operation_duration_seconds_count", {{"op", "pause"}}) == 1);
  CHECK(after_pause.value("tmsdisk_operation_duration_seconds_sum", {{"op", "pause"}}) == 1.5);
  CHECK(after_pause.value("tmsdisk_operation_duration_seconds_bucket", {{"op", "pause"}, {"le", "1"}}) == 0);
  CHECK(after_pause.value("tmsdisk_operation_duration_seconds_bucket", {{"op", "pause"}, {"le", "2.5"}}) == 1);

  // Session 1 is asked to resume twice (two tmsctls); its connection drops before either answer.
  // Session 2's own resume, a no-op, stays its own.
  m.command_sent(12, 1, proto::CommandOp::Resume);
  m.command_sent(13, 1, proto::CommandOp::Resume);
  m.command_sent(14, 2, proto::CommandOp::Resume);
  m.session_lost(1);
  m.command_answered(12, answer(0, 16 << 20, 1));  // too late: counted as lost already
  m.command_answered(14, answer(0, 0, 1000, proto::Outcome::NoOp));
  seen.push_back(parsed(m.format({})));
  const ParsedExposition& after_resume = seen.back();
  CHECK(after_resume.value("tmsdisk_resumes_total", {{"result", "failed"}}) == 2);
  CHECK(after_resume.value("tmsdisk_resumes_total", {{"result", "no_op"}}) == 1);
  CHECK(after_resume.value("tmsdisk_resumes_total", {{"result", "ok"}}) == 0);
  CHECK(after_resume.value("tmsdisk_operation_failures_total", {{"op", "resume"}, {"cause", "disconnected"}}) == 2);
  CHECK(after_resume.value("tmsdisk_operation_duration_seconds_count", {{"op", "resume"}}) == 0);

  // No counter, bucket, sum or count ever went down from one exposition to the next.
  for (std::size_t i = 1; i < seen.size(); ++i) {
    for (const auto& s : seen[i - 1].samples) {
      const bool counted = s.name.ends_with("_total") || s.name.ends_with("_bucket") || s.name.ends_with("_count") ||
                           s.name.ends_with("_sum");
      if (!counted) continue;
      INFO(s.name << " in exposition " << i);
      const auto later = seen[i].value(s.name, s.labels);
      REQUIRE(later);
      CHECK(*later >= s.value);
    }
  }
}

TEST_CASE("the file is replaced atomically, readable by others, with no temp file left beside it") {
  TempDir dir;
  const std::string path = dir / "tmsdisk.prom";
  MetricsFile file(path);
  REQUIRE(file.write("# HELP tmsdisk_x x\n# TYPE tmsdisk_x gauge\ntmsdisk_x 1\n"));
  REQUIRE(file.write("# HELP tmsdisk_x x\n# TYPE tmsdisk_x gauge\ntmsdisk_x 2\n"));
  CHECK(read_file(path) == "# HELP tmsdisk_x x\n# TYPE tmsdisk_x gauge\ntmsdisk_x 2\n");
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0644);  // node-exporter reads it as another user
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path())) names.push_back(entry.path().filename());
  CHECK(names == std::vector<std::string>{"tmsdisk.prom"});
  file.remove();
  CHECK_FALSE(fs::exists(path));
}

TEST_CASE("a write that fails is logged once per distinct error, and the recovery once") {
  std::ostringstream log;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
  TempDir dir;
  const std::string missing = dir / "textfile";
  MetricsFile file(missing + "/tmsdisk.prom");
  for (int i = 0; i < 3; ++i) CHECK_FALSE(file.write("tmsdisk_x 1\n"));
  fs::create_directory(missing);
  fs::permissions(missing, fs::perms::owner_read | fs::perms::owner_exec);  // another error: read-only
  const bool as_root = ::geteuid() == 0;                                    // root writes there anyway
  for (int i = 0; i < 3; ++i) file.write("tmsdisk_x 1\n");
  fs::permissions(missing, fs::perms::owner_all);
  for (int i = 0; i < 3; ++i) CHECK(file.write("tmsdisk_x 1\n"));
  spdlog::set_default_logger(previous);

  const std::string text = log.str();
  INFO(text);
  auto count = [&](const std::string& what) {
    std::size_t n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  CHECK(count("No such file or directory") == 1);
  if (!as_root) CHECK(count("Permission denied") == 1);
  CHECK(count("cannot write " + missing + "/tmsdisk.prom") == (as_root ? 1 : 2));
  CHECK(count("is written again") == 1);
}
