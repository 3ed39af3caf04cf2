// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's settings table (daemon/options.h): every setting reads the same from the command line
// and the config file, and what is wrong is said with the file, line, key and the valid form.
#include <catch2/catch.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "options.h"
#include "tmsdisk/common/staging_budget.h"

using namespace tmsdisk;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

struct Outcome {
  Invocation invocation;
  std::string out, err;
};

Outcome invoke(std::vector<std::string> args) {
  args.insert(args.begin(), "tmsdiskd");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  Outcome o{parse_invocation(static_cast<int>(argv.size()), argv.data(), "/nonexistent/tmsdiskd.conf", out, err)};
  o.out = out.str();
  o.err = err.str();
  return o;
}

}  // namespace

TEST_CASE("every setting has a distinct name, a help text, and a value name unless it is a flag") {
  std::vector<std::string_view> names;
  for (const Setting& s : daemon_settings()) {
    INFO(s.name);
    CHECK(std::find(names.begin(), names.end(), s.name) == names.end());
    names.push_back(s.name);
    CHECK_FALSE(s.help.empty());
    CHECK(find_setting(s.name) == &s);
    DaemonOptions o;
    CHECK(std::holds_alternative<bool*>(s.target(o)) == s.value_name.empty());
  }
}

TEST_CASE("the effective settings are a config file that reads back to the same settings") {
  DaemonOptions changed;
  REQUIRE(
      apply_config_text("root = [\"/a\", \"/b\"]\nstaging-budget-mb = 64\nchunk-mb = 4\nallow-gid = [7]\n"
                        "allow-tmpfs = true\nlog-level = \"debug\"\nidle-exit-s = 5\nsocket = \"/x/\\\"q\\\".sock\"\n",
                        "a.conf", changed)
          .empty());
  CHECK(changed.config.roots == std::vector<std::string>{"/a", "/b"});
  CHECK(changed.config.staging_budget_bytes == 64 * server::kMiB);
  CHECK(changed.config.idle_exit_s == 5);
  CHECK(changed.config.socket_path == "/x/\"q\".sock");
  const std::string text = effective_settings(changed);
  // Every config key is written, each on its line.
  for (const Setting& s : daemon_settings())
    if (!s.command_line_only)
      CHECK_THAT(text, Contains("\n" + std::string(s.name) + " = ") || StartsWith(std::string(s.name) + " = "));
  DaemonOptions again;
  REQUIRE(apply_config_text(text, "effective", again).empty());
  CHECK(effective_settings(again) == text);
}

TEST_CASE("a single string is a root list of one") {
  DaemonOptions o;
  REQUIRE(apply_config_text("root = \"/nvme0\"\nallow-uid = 1000\n", "a.conf", o).empty());
  CHECK(o.config.roots == std::vector<std::string>{"/nvme0"});
  CHECK(o.config.allowed_uids == std::vector<uint32_t>{1000});
}

TEST_CASE("config problems carry the file and the line, in the order of the file") {
  DaemonOptions o;
  const Problems p = apply_config_text(
      "queue-depth = 0\nchunk-mb = \"8\"\nroot = [1]\nexit-when-idle = 1\n"
      "staging-budget-mb = 2.5\nmax-sessions-per-uid = -1\n",
      "t.conf", o);
  REQUIRE(p.size() == 6);
  CHECK(p[0] == "t.conf:1: queue-depth = 0: expected an integer from 1 to 4096");
  CHECK(p[1] == "t.conf:2: chunk-mb = \"8\": expected an integer from 1 to 64 (MiB)");
  CHECK_THAT(p[2], StartsWith("t.conf:3: root = [ 1 ]: expected an array of paths, e.g. root = [\""));
  CHECK(p[3] == "t.conf:4: exit-when-idle = 1: expected true or false");
  CHECK_THAT(p[4], StartsWith("t.conf:5: staging-budget-mb = 2.5: expected an integer"));
  CHECK_THAT(p[5], StartsWith("t.conf:6: max-sessions-per-uid = -1: expected an integer from 0 to"));
  // A refused value leaves the default.
  CHECK(o.config.queue_depth == DaemonOptions{}.config.queue_depth);
}

TEST_CASE("unknown names get the closest setting, the new name of a renamed one, or the list") {
  CHECK(hint_for_unknown("rot", Source::config_file) == ": did you mean root?");
  CHECK(hint_for_unknown("chunk_mb", Source::config_file) == ": did you mean chunk-mb?");
  CHECK(hint_for_unknown("Staging-Budget", Source::config_file) == ": did you mean staging-budget-mb?");
  CHECK(hint_for_unknown("slot-mb", Source::config_file) == ": renamed, use chunk-mb = N");
  CHECK(hint_for_unknown("max_staging_mb", Source::config_file) ==
        ": did you mean max-staging-budget-mb? (max-staging-mb was renamed)");
  CHECK(hint_for_unknown("--staging-mb", Source::command_line) == ": renamed, use --staging-budget-mb N");
  CHECK(hint_for_unknown("--idle-exit", Source::command_line) == ": did you mean --idle-exit-s?");
  CHECK_THAT(hint_for_unknown("bogus-key", Source::config_file), StartsWith(" (valid keys: root, socket, "));
  // Command-line-only options are not offered as keys.
  CHECK_THAT(hint_for_unknown("bogus-key", Source::config_file), !Contains("check-config"));
  CHECK(hint_for_unknown("detatch", Source::command_line) == ": did you mean --detach?");
}

TEST_CASE("the command line wins over the config file and is checked the same way") {
  auto o = invoke({"--root", "/r", "--staging-budget-mb", "64", "--chunk-mb", "4", "--allow-uid", "1", "--allow-uid",
                   "2", "--idle-exit-s", "3", "--exit-when-idle"});
  INFO(o.err);
  REQUIRE_FALSE(o.invocation.exit_now);
  const auto& c = o.invocation.options.config;
  CHECK(c.roots == std::vector<std::string>{"/r"});
  CHECK(c.staging_budget_bytes == 64 * server::kMiB);
  CHECK(c.chunk_bytes == 4 * server::kMiB);
  CHECK(c.allowed_uids == std::vector<uint32_t>{1, 2});
  CHECK(c.idle_exit_s == 3);
  CHECK(c.exit_when_idle);
  CHECK(o.invocation.options.config_file == "/nonexistent/tmsdiskd.conf");  // the default, absent: fine

  o = invoke({"--root", "/r", "--chunk-mb", "65"});
  CHECK(o.invocation.exit_now == kExitUsage);
  CHECK(o.err == "tmsdiskd: --chunk-mb 65: expected an integer from 1 to 64 (MiB)\n");
  o = invoke({"--root", "/r", "--idle-exit-s", "0"});
  CHECK(o.invocation.exit_now == kExitUsage);
  CHECK(o.err == "tmsdiskd: --idle-exit-s 0: expected an integer from 1 to 86400 (s)\n");
}

TEST_CASE("cross-field checks name the options, and a private daemon needs no root") {
  DaemonOptions o;
  o.config.roots = {"/r"};
  o.config.chunk_bytes = 64 * server::kMiB;
  o.config.staging_budget_bytes = 100 * server::kMiB;
  o.config.max_staging_budget_bytes = 50 * server::kMiB;
  const Problems p = check_consistency(o);
  REQUIRE(p.size() == 2);
  CHECK_THAT(p[0], StartsWith("staging-budget-mb (100) must be at least 2 x chunk-mb (64)"));
  CHECK(p[1] == "staging-budget-mb (100) must be at most max-staging-budget-mb (50)");
  // The server refuses the same, in the same words.
  CHECK(server::inconsistencies(o.config) == p);
  // Exactly two chunks is enough: the rule tmsctl and a HELLO check too (staging_budget.h).
  o.config.staging_budget_bytes = min_staging_budget_bytes(o.config.chunk_bytes);
  o.config.max_staging_budget_bytes = o.config.staging_budget_bytes;
  CHECK(server::inconsistencies(o.config).empty());
  o.config.staging_budget_bytes -= 4096;
  CHECK(server::inconsistencies(o.config).size() == 1);
  CHECK(min_staging_budget_mib(8 * server::kMiB + 1) == 17);

  DaemonOptions none;
  none.config_file = "x.conf";
  REQUIRE(check_consistency(none).size() == 1);
  CHECK_THAT(check_consistency(none)[0], StartsWith("no storage root") && Contains("x.conf"));
  none.private_mode = true;
  CHECK(check_consistency(none).empty());
}

TEST_CASE("tmsdiskd --help and --check-config exit 0 and print to stdout") {
  auto o = invoke({"--help"});
  CHECK(o.invocation.exit_now == 0);
  CHECK_THAT(o.out, Contains("--idle-exit-s"));
  o = invoke({"--check-config", "--root", "/r"});
  CHECK(o.invocation.exit_now == 0);
  CHECK(o.err.empty());
  CHECK_THAT(o.out, StartsWith("tmsdiskd: /nonexistent/tmsdiskd.conf: absent") && Contains("\nroot = [ \"/r\" ]\n"));
}

TEST_CASE("metrics-file may be empty, meaning none, where another path may not; its interval is checked") {
  DaemonOptions o;
  REQUIRE(apply_config_text("metrics-file = \"/var/lib/node_exporter/textfile_collector/tmsdisk.prom\"\n"
                            "metrics-interval-s = 60\n",
                            "a.conf", o)
              .empty());
  CHECK(o.config.metrics_file == "/var/lib/node_exporter/textfile_collector/tmsdisk.prom");
  CHECK(o.config.metrics_interval_s == 60);
  CHECK(apply_config_text("metrics-file = \"\"\n", "a.conf", o).empty());
  CHECK(o.config.metrics_file.empty());
  CHECK_FALSE(apply_config_text("socket = \"\"\n", "a.conf", o).empty());
  const Problems p = apply_config_text("metrics-interval-s = 0\n", "a.conf", o);
  REQUIRE(p.size() == 1);
  CHECK_THAT(p[0], Contains("metrics-interval-s = 0: expected an integer from 1 to 3600 (s)"));
}

TEST_CASE("hash-threads is 0 (automatic) by default and takes 0 to 64 from the file and the command line") {
  CHECK(DaemonOptions{}.config.hash_threads == 0);
  DaemonOptions o;
  REQUIRE(apply_config_text("hash-threads = 6\n", "a.conf", o).empty());
  CHECK(o.config.hash_threads == 6);
  const Problems p = apply_config_text("hash-threads = 65\n", "a.conf", o);
  REQUIRE(p.size() == 1);
  CHECK_THAT(p[0], Contains("hash-threads = 65: expected an integer from 0 to 64"));
  CHECK(o.config.hash_threads == 6);
  auto given = invoke({"--root", "/r", "--hash-threads", "3"});
  CHECK_FALSE(given.invocation.exit_now);
  CHECK(given.invocation.options.config.hash_threads == 3);
  auto refused = invoke({"--root", "/r", "--hash-threads", "-1"});
  CHECK(refused.invocation.exit_now == kExitUsage);
  CHECK_THAT(refused.err, Contains("--hash-threads -1: expected an integer from 0 to 64"));
}
