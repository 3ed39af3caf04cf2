// SPDX-License-Identifier: Apache-2.0
// tmsctl's command line as a user meets it: tmsctl run as a subprocess against a real tmsdiskd (and
// simcuda ranks where a rank is needed), its exit status, stdout and stderr asserted.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>

#include "e2e.h"
#include "tmsdisk/common/paths.h"

using namespace tmsdisk::e2e;

namespace {

// `tmsctl args...` with nothing added (unlike Node::tmsctl, which puts --socket and --json first).
Captured tmsctl(const std::vector<std::string>& args, const Env& env = {}) {
  std::vector<std::string> argv{TMSCTL_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_captured(argv, env);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::size_t lines(const std::string& text) {
  return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
}

// A usage error: exit status 2, one line on stderr, nothing on stdout.
void check_usage_error(const Captured& c, const std::vector<std::string>& must_name) {
  INFO("stdout: " << c.out << "\nstderr: " << c.err);
  CHECK(c.rc == 2);
  CHECK(c.out.empty());
  CHECK(lines(c.err) == 1);
  for (const auto& part : must_name) CHECK(contains(c.err, part));
}

}  // namespace

TEST_CASE("tmsctl --help exits 0 and lists the commands") {
  Captured c = tmsctl({"--help"});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  for (const char* cmd : {"status", "pause", "resume", "gc", "env", "run"}) CHECK(contains(c.out, cmd));
}

TEST_CASE(
    "the global options --json and --socket work before and after the command and every command's --help lists them") {
  Node node;
  node.start_daemon();
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--json", "--socket", node.socket, "status"},
                                               std::vector<std::string>{"status", "--json", "--socket", node.socket},
                                               std::vector<std::string>{"--socket", node.socket, "status", "--json"},
                                               std::vector<std::string>{"gc", "--json", "--socket", node.socket}}) {
    Captured c = tmsctl(args);
    INFO(c.out << c.err);
    CHECK(c.rc == 0);
    CHECK_FALSE(json::parse(c.out, nullptr, false).is_discarded());
  }
  Captured text = tmsctl({"status", "--socket", node.socket});
  CHECK(text.rc == 0);
  CHECK(contains(text.out, "no ranks connected to " + node.socket));

  for (const char* cmd : {"status", "pause", "resume", "gc", "env", "run"}) {
    Captured help = tmsctl({cmd, "--help"});
    INFO(cmd << ": " << help.out);
    CHECK(help.rc == 0);
    CHECK(contains(help.out, "--json"));
    CHECK(contains(help.out, "--socket"));
    CHECK(contains(help.out, "--timeout"));  // every command gives up in time
  }
}

TEST_CASE("every usage error exits 2 with one line naming the mistake and the valid choices") {
  SECTION("no command") {
    check_usage_error(tmsctl({}), {"no command given", "status", "pause", "run"});
  }
  SECTION("an unknown command") {
    check_usage_error(tmsctl({"bogus"}), {"unknown command 'bogus'", "status", "resume", "gc"});
  }
  SECTION("an unknown option") {
    check_usage_error(tmsctl({"pause", "--jbo", "x"}), {"unknown option --jbo", "--job", "--rank", "--all"});
  }
  SECTION("an option without its value") {
    check_usage_error(tmsctl({"pause", "--job"}), {"--job needs a value"});
  }
  SECTION("a negative rank") {
    Captured c = tmsctl({"pause", "--rank", "-1"});
    check_usage_error(c, {"--rank", "'-1' is not a rank number"});
    CHECK(c.err.size() < 200);  // not a double's full range spelled out
  }
  SECTION("a value outside its choices") {
    check_usage_error(tmsctl({"env", "--on-touch", "sometimes"}), {"--on-touch", "wait, resume, fail"});
  }
  SECTION("no ranks selected") {
    check_usage_error(tmsctl({"resume"}), {"say which ranks", "--job", "--all"});
  }
  SECTION("run without a command") {
    check_usage_error(tmsctl({"run", "--job", "j"}), {"no command given", "tmsctl run [options] -- COMMAND"});
  }
  SECTION("with --json the answer is a JSON object on stdout") {
    Captured c = tmsctl({"--json", "bogus"});
    INFO(c.out << c.err);
    CHECK(c.rc == 2);
    json j = json::parse(c.out, nullptr, false);
    REQUIRE(j.is_object());
    CHECK(j.value("ok", true) == false);
    CHECK(j.value("usage", false) == true);
    CHECK(contains(j.value("error", ""), "unknown command 'bogus'"));
  }
}

TEST_CASE("run --help shows --no-start-daemon as a plain flag") {
  Captured c = tmsctl({"run", "--help"});
  CHECK(c.rc == 0);
  CHECK(contains(c.out, "--no-start-daemon"));
  CHECK_FALSE(contains(c.out, "{false}"));
}

TEST_CASE("a selector that matches no rank says so without a stray strerror, as JSON with --json") {
  Node node;
  node.start_daemon();
  Captured c = tmsctl({"pause", "--job", "nobody", "--socket", node.socket});
  INFO(c.out << c.err);
  CHECK(c.rc == 1);
  CHECK(contains(c.err, "tmsctl pause --job nobody: no running rank matches"));
  CHECK_FALSE(contains(c.err, "No such file or directory"));

  Captured j = tmsctl({"pause", "--job", "nobody", "--socket", node.socket, "--json"});
  INFO(j.out << j.err);
  CHECK(j.rc == 1);
  json answer = json::parse(j.out, nullptr, false);
  REQUIRE(answer.is_object());
  CHECK(answer.value("ok", true) == false);
  CHECK(answer.value("usage", true) == false);
  CHECK(contains(answer.value("error", ""), "no running rank matches"));
  CHECK(answer.value("errno", 0) == ENOENT);
}

TEST_CASE("status lists an orphaned session: state orphaned, since when, what it keeps and until when") {
  Node node;
  node.start_daemon();
  // A rank that pauses and loses its connection while its process lives: an orphan, which counts
  // against max-sessions-per-uid and used to be missing from `tmsctl status`.
  auto rank = ShimClient::connect(node.socket, {.job = "gone", .rank = 7});
  INFO((rank ? "" : rank.error().describe()));
  REQUIRE(rank);
  const std::vector<tmsdisk::proto::BlobSize> blobs = {{1, 4 * MiB}};
  REQUIRE(rank->reserve(blobs));
  REQUIRE(rank->write_all(blobs, fill_pattern));
  REQUIRE(rank->commit(tmsdisk::proto::CommitState::Paused));
  rank->close();
  const std::string pid = std::to_string(::getpid());

  json entry;
  REQUIRE(eventually([&] {
    Captured c = tmsctl({"status", "--json", "--socket", node.socket});
    json j = json::parse(c.out, nullptr, false);
    if (c.rc != 0 || !j.is_array() || j.size() != 1 || j[0].value("state", "") != "orphaned") return false;
    entry = j[0];
    return true;
  }));
  INFO(entry.dump(2));
  CHECK(entry.value("job", "") == "gone");
  CHECK(entry.value("rank", -1) == 7);
  CHECK(entry.value("pid", 0) == ::getpid());
  CHECK(entry.value("disk_bytes", uint64_t{0}) >= 4 * MiB);
  REQUIRE(entry["orphaned"].is_object());
  CHECK(entry["orphaned"].value("since_unix_ms", uint64_t{0}) > 0);
  CHECK(entry["orphaned"].value("kept_until", "") == "it reconnects with its session token or pid " + pid + " exits");

  Captured text = tmsctl({"status", "--socket", node.socket});
  INFO(text.out << text.err);
  CHECK(text.rc == 0);
  CHECK(contains(text.out, " orphaned "));  // the state column
  CHECK(contains(text.out, "orphaned: lost its connection at "));
  CHECK(contains(text.out,
                 "(4.0 MiB on disk) are kept, and count against max-sessions-per-uid, until it reconnects "
                 "with its session token or pid " +
                     pid + " exits"));

  // A pause or resume of only that rank says why nothing can be done now.
  Captured resume = tmsctl({"resume", "--job", "gone", "--socket", node.socket});
  INFO(resume.out << resume.err);
  CHECK(resume.rc == 1);
  CHECK(contains(resume.err, "lost their connection to tmsdiskd (orphaned in `tmsctl status`)"));
}

TEST_CASE("result lines say paused, resumed and verified, or nothing to do, and a no-op keeps the last figures") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("said", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
  auto text = [&](const char* verb) { return tmsctl({verb, "--job", "said", "--socket", node.socket}); };
  auto last_pause_bytes = [&] {
    auto [rc, out] = node.tmsctl({"status"});
    json j = json::parse(out, nullptr, false);
    return j.is_array() && j.size() == 1 ? j[0]["last_pause"].value("bytes", uint64_t{0}) : uint64_t{0};
  };

  Captured paused = text("pause");
  INFO(paused.out << paused.err);
  CHECK(paused.rc == 0);
  CHECK(contains(paused.out, "said rank 0 (pid " + std::to_string(prog.pid()) + "): paused 32.0 MiB in "));
  CHECK(last_pause_bytes() == 32 * MiB);

  Captured again = text("pause");
  INFO(again.out << again.err);
  CHECK(again.rc == 0);
  CHECK(contains(again.out, "already paused (nothing to do)"));
  CHECK(last_pause_bytes() == 32 * MiB);  // the no-op did not overwrite the real figures

  Captured resumed = text("resume");
  INFO(resumed.out << resumed.err);
  CHECK(resumed.rc == 0);
  CHECK(contains(resumed.out, "resumed and verified 32.0 MiB in "));

  Captured running = text("resume");
  INFO(running.out << running.err);
  CHECK(running.rc == 0);
  CHECK(contains(running.out, "(nothing to do)"));
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("tmsctl run refuses what cannot work before the program starts") {
  Node node;
  node.start_daemon();  // --chunk-mb 2: the staging budget must be 4 MiB or more
  const std::string marker = node.dir / "started";
  auto run_marked = [&](std::vector<std::string> options, const Env& env = {}) {
    std::vector<std::string> args{"run", "--socket", node.socket};
    args.insert(args.end(), options.begin(), options.end());
    args.insert(args.end(), {"--", "/usr/bin/touch", marker});
    Captured c = tmsctl(args, env);
    if (c.rc != 0) CHECK_FALSE(fs::exists(marker));  // refused means the program never ran
    return c;
  };

  SECTION("a staging budget below two of the daemon's chunks runs the program (its rank gets smaller chunks)") {
    Captured c = run_marked({"--staging-budget-mb", "1"});
    INFO(c.err);
    CHECK(c.rc == 0);
    CHECK(fs::exists(marker));
  }
  SECTION("the same budget inherited through TMS_DISK_BACKUP_CHUNK_MB") {
    Captured c = run_marked({}, {{"TMS_DISK_BACKUP_CHUNK_MB", "1"}});
    INFO(c.err);
    CHECK(c.rc == 0);
    CHECK(fs::exists(marker));
  }
  SECTION("a staging budget the daemon does not allow") {
    Captured c = run_marked({"--staging-budget-mb", "999999"});
    check_usage_error(c, {"--staging-budget-mb 999999", "max-staging-budget-mb"});
  }
  SECTION("a job name the daemon would refuse") {
    check_usage_error(run_marked({"--job", "a/b"}), {"--job 'a/b'", "letters, digits"});
  }
  SECTION("a library that does not exist") {
    Captured c = run_marked({}, {{"TMSDISK_LIBRARY", "/nonexistent/libtmsdisk.so"}});
    INFO(c.err);
    CHECK(c.rc == 1);
    CHECK(contains(c.err, "TMSDISK_LIBRARY=/nonexistent/libtmsdisk.so cannot be preloaded"));
    CHECK(contains(c.err, "No such file or directory"));
  }
  SECTION("a library that is not an ELF shared object") {
    const std::string text = node.dir / "not-a-library.so";
    std::ofstream(text) << "#!/bin/sh\n";
    Captured c = run_marked({}, {{"TMSDISK_LIBRARY", text}});
    INFO(c.err);
    CHECK(c.rc == 1);
    CHECK(contains(c.err, "not an ELF file"));
  }
  SECTION("and runs the program when all is well") {
    Captured c = run_marked({"--staging-budget-mb", "4"});
    INFO(c.out << c.err);
    CHECK(c.rc == 0);
    CHECK(fs::exists(marker));
  }
}

namespace {

// Seconds since `start`, for checking that a command gave up when it should have.
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("tmsctl run says at once why the private daemon could not start, in the daemon's words") {
  Node node;  // no daemon started
  if (fs::exists(tmsdisk::kSystemSocket)) skip("a system tmsdiskd socket exists on this machine");
  const std::string runtime = node.dir / "xdg";
  fs::create_directories(runtime);
  fs::permissions(runtime, fs::perms::owner_all);
  const std::string missing = node.dir / "missing";
  const std::string marker = node.dir / "started";
  const auto start = std::chrono::steady_clock::now();
  Captured c =
      tmsctl({"run", "--", "/usr/bin/touch", marker}, {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", missing}});
  const double took = seconds_since(start);
  INFO(c.err);
  CHECK(c.rc == 1);
  CHECK_FALSE(fs::exists(marker));
  CHECK(contains(c.err, "could not start a private tmsdiskd"));
  CHECK(contains(c.err, "TMS_DISK_BACKUP_DIR=" + missing + " does not exist"));
  // The daemon stopped before it had a log: none is named.
  CHECK_FALSE(contains(c.err, "tmsdiskd.log"));
  CHECK_FALSE(fs::exists(runtime + "/tmsdisk/tmsdiskd.log"));
  // Told by the daemon's exit, not found out by waiting for its socket (10 s) to give up.
  CHECK(took < 10);
}

TEST_CASE("a stopped daemon does not hang tmsctl: every command gives up at --timeout naming the socket") {
  Node node;
  node.start_daemon();
  REQUIRE(::kill(node.daemon.pid(), SIGSTOP) == 0);
  // Continued before the node stops it, whatever fails below.
  struct Continue {
    pid_t pid;
    ~Continue() { ::kill(pid, SIGCONT); }
  } resume_daemon{node.daemon.pid()};

  for (const std::vector<std::string>& command :
       {std::vector<std::string>{"status"}, std::vector<std::string>{"gc"}, std::vector<std::string>{"pause", "--all"},
        std::vector<std::string>{"resume", "--job", "j"}, std::vector<std::string>{"run"}}) {
    std::vector<std::string> args = command;
    args.insert(args.end(), {"--timeout", "1", "--socket", node.socket});
    if (command[0] == "run") args.insert(args.end(), {"--", "/bin/true"});
    const auto start = std::chrono::steady_clock::now();
    Captured c = tmsctl(args);
    INFO(command[0] << ": " << c.out << c.err);
    CHECK(c.rc == 1);  // not killed by run_captured's own limit (137), which it was before: it waited forever
    CHECK(seconds_since(start) < 30);
    CHECK(contains(c.err, "tmsdiskd at " + node.socket + " did not answer within 1 s"));
    CHECK(contains(c.err, "systemctl status tmsdiskd"));
    CHECK(lines(c.err) == 1);
  }
  // env prints the environment even without a daemon (a launcher may start one later): in time.
  const auto env_start = std::chrono::steady_clock::now();
  Captured env = tmsctl({"env", "--timeout", "1", "--socket", node.socket});
  INFO(env.out << env.err);
  CHECK(env.rc == 0);
  CHECK(seconds_since(env_start) < 30);
  CHECK(contains(env.out, "export TMSDISK_SOCKET="));

  Captured j = tmsctl({"--json", "status", "--timeout", "0.5", "--socket", node.socket});
  INFO(j.out << j.err);
  CHECK(j.rc == 1);
  json answer = json::parse(j.out, nullptr, false);
  REQUIRE(answer.is_object());
  CHECK(answer.value("ok", true) == false);
  CHECK(answer.value("errno", 0) == ETIMEDOUT);
  CHECK(contains(answer.value("error", ""), "did not answer within 0.5 s"));
}

TEST_CASE("a rank that never answers: pause prints the answers it has, names the silent rank, exits 1") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("quiet", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 8388608 direct")).empty());
  // A session that takes its COMMANDs and never answers them: a wedged rank, or, under root's
  // `pause --all`, another user's process.
  auto silent = ShimClient::connect(node.socket, {.job = "quiet", .rank = 1});
  INFO((silent ? "" : silent.error().describe()));
  REQUIRE(silent);
  const std::string silent_pid = std::to_string(::getpid());

  const auto start = std::chrono::steady_clock::now();
  Captured text = tmsctl({"pause", "--all", "--timeout", "4", "--socket", node.socket});
  INFO(text.out << text.err);
  CHECK(text.rc == 1);
  CHECK(seconds_since(start) < 60);  // it used to wait for the silent rank forever
  const std::string answered = "quiet rank 0 (pid " + std::to_string(prog.pid()) + "): paused 8.0 MiB in ";
  const std::string unanswered =
      "quiet rank 1 (pid " + silent_pid + "): no answer within 4 s (still pausing? see `tmsctl status`)";
  CHECK(contains(text.out, answered));
  CHECK(contains(text.out, unanswered));
  CHECK(text.out.find(answered) < text.out.find(unanswered));  // the answers first, then who gave none
  CHECK(lines(text.out) == 2);
  CHECK(contains(text.err, "tmsctl pause: 1 of 2 rank(s) did not answer in time"));

  Captured j = tmsctl({"pause", "--job", "quiet", "--timeout", "4", "--json", "--socket", node.socket});
  INFO(j.out << j.err);
  CHECK(j.rc == 1);
  json ranks = json::parse(j.out, nullptr, false);
  REQUIRE(ranks.is_array());
  REQUIRE(ranks.size() == 2);
  CHECK(ranks[0].value("rank", -1) == 0);
  CHECK(ranks[0].value("ok", false) == true);
  CHECK(ranks[0].value("answered", false) == true);
  CHECK(ranks[0].value("outcome", "") == "no-op");  // already paused by the first command
  CHECK(ranks[1].value("rank", -1) == 1);
  CHECK(ranks[1].value("pid", 0) == ::getpid());
  CHECK(ranks[1].value("ok", true) == false);
  CHECK(ranks[1].value("answered", true) == false);
  CHECK(ranks[1].value("outcome", "") == "unknown");
  CHECK(ranks[1].value("errno", 0) == ETIMEDOUT);
  CHECK(contains(ranks[1].value("message", ""), "no answer within 4 s"));

  // The requests tmsctl gave up on left the daemon serving: the rank that answered resumes intact.
  Captured resumed = tmsctl({"resume", "--pid", std::to_string(prog.pid()), "--socket", node.socket});
  INFO(resumed.out << resumed.err);
  CHECK(resumed.rc == 0);
  CHECK(contains(resumed.out, "resumed and verified 8.0 MiB in "));
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("a selector before the command, a mistyped command and --version are answered in words") {
  SECTION("a command's option before the command says to put it after") {
    check_usage_error(tmsctl({"--job", "J", "pause"}), {"put --job after the command: tmsctl pause --job J"});
    check_usage_error(tmsctl({"--all", "resume"}), {"put --all after the command: tmsctl resume --all"});
  }
  SECTION("a command one or two typing mistakes away is named") {
    check_usage_error(tmsctl({"staus"}), {"unknown command 'staus': did you mean status?", "commands: status"});
    Captured j = tmsctl({"--json", "--socket", "/x", "resum", "--all"});
    INFO(j.out << j.err);
    CHECK(j.rc == 2);
    CHECK(contains(json::parse(j.out, nullptr, false).value("error", ""), "did you mean resume?"));
    Captured far = tmsctl({"bogus"});
    INFO(far.err);
    CHECK_FALSE(contains(far.err, "did you mean"));
  }
  SECTION("--version prints the project's version") {
    Captured c = tmsctl({"--version"});
    INFO(c.out << c.err);
    CHECK(c.rc == 0);
    CHECK(c.out == "tmsctl (tmsdisk) " TMSDISK_VERSION "\n");
  }
}

TEST_CASE("pause and resume --tag \"\" are usage errors: an empty tag must not mean the whole process") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("whole", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 8388608 direct")).empty());
  // The rank connects on its control thread after the allocation returns: listed first, so that a
  // pause that went through would have found it.
  REQUIRE(eventually([&] { return node.status().size() == 1; }));
  for (const char* verb : {"pause", "resume"}) {
    Captured c = tmsctl({verb, "--all", "--tag", "", "--socket", node.socket});
    check_usage_error(c, {"--tag ''", "1 to 63", std::string("leave out --tag to ") + verb + " the whole process"});
  }
  Captured j = tmsctl({"pause", "--job", "whole", "--tag=", "--json", "--socket", node.socket});
  INFO(j.out << j.err);
  CHECK(j.rc == 2);
  json answer = json::parse(j.out, nullptr, false);
  REQUIRE(answer.is_object());
  CHECK(answer.value("usage", false) == true);
  // Nothing was paused: it used to pause (and discard) all of it.
  const auto ranks = node.status();
  REQUIRE(ranks.size() == 1);
  CHECK(ranks[0].totals.state == "running");
  CHECK(ranks[0].totals.paused == 0);
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("an untimed pause held by a silent rank says on the terminal whom it waits for and when it gives up") {
  Node node;
  node.start_daemon();
  // A session that takes its COMMAND and never answers it, as in the case above.
  auto silent = ShimClient::connect(node.socket, {.job = "hush", .rank = 3});
  INFO((silent ? "" : silent.error().describe()));
  REQUIRE(silent);
  // The progress line is for people: only a terminal on stderr gets it.
  tmsdisk::UniqueFd master(::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC));
  REQUIRE(master);
  REQUIRE(::grantpt(master.get()) == 0);
  REQUIRE(::unlockpt(master.get()) == 0);
  tmsdisk::UniqueFd terminal(::open(::ptsname(master.get()), O_RDWR | O_NOCTTY | O_CLOEXEC));
  tmsdisk::UniqueFd null(::open("/dev/null", O_RDWR | O_CLOEXEC));
  REQUIRE(terminal);
  REQUIRE(null);
  const pid_t pid =
      spawn({TMSCTL_PATH, "pause", "--all", "--socket", node.socket}, {}, null.get(), null.get(), terminal.get());
  terminal.reset();
  const std::string waiting = "pause: waiting for hush rank 3 (pid " + std::to_string(::getpid()) + "): nothing for ";
  const std::string until = "gives up after 120 s without a word (--timeout S sets a limit)";
  std::string seen;
  // Read until the line has come (about a second in), not for the 120 s the command would wait.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!(contains(seen, waiting) && contains(seen, until)) && std::chrono::steady_clock::now() < give_up) {
    pollfd p{master.get(), POLLIN, 0};
    if (::poll(&p, 1, 1000) <= 0) continue;
    char buf[512];
    const ssize_t n = ::read(master.get(), buf, sizeof(buf));
    if (n <= 0) break;
    seen.append(buf, static_cast<std::size_t>(n));
  }
  int status = 0;
  const bool still_waiting = ::waitpid(pid, &status, WNOHANG) == 0;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  INFO(seen);
  CHECK(still_waiting);
  CHECK(contains(seen, waiting));
  CHECK(contains(seen, until));
}

TEST_CASE("tmsctl run refuses a private socket directory another user made, saying whose it is and what to do") {
  if (::geteuid() != 0) skip("making a directory that belongs to another user needs root");
  if (fs::exists(tmsdisk::kSystemSocket)) skip("a system tmsdiskd socket exists on this machine");
  Node node;  // no daemon started
  const std::string runtime = node.dir / "xdg";
  fs::create_directories(runtime / fs::path("tmsdisk"));
  fs::permissions(runtime, fs::perms::owner_all);
  REQUIRE(::chown((runtime + "/tmsdisk").c_str(), 65534, 65534) == 0);  // "nobody" got there first
  const std::string marker = node.dir / "started";
  Captured c = tmsctl({"run", "--", "/usr/bin/touch", marker}, {{"XDG_RUNTIME_DIR", runtime}});
  INFO(c.err);
  CHECK(c.rc == 1);
  CHECK_FALSE(fs::exists(marker));
  CHECK(contains(c.err, runtime + "/tmsdisk belongs to another user (uid 65534), not to you (uid 0)"));
  CHECK(contains(c.err, "ask its owner or root to remove it"));
  CHECK(contains(c.err, "XDG_RUNTIME_DIR"));
  CHECK(lines(c.err) == 1);
}
