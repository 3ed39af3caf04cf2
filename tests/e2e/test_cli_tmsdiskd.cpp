// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's command line and config file as a user meets them: the daemon run as a subprocess, its
// exit status and messages asserted. No GPU or simcuda needed.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>

#include "e2e.h"
#include "tmsdisk/common/private_daemon.h"

using namespace tmsdisk::e2e;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

// tmsdiskd run with `args` until it exits (killed after 60 s): its status and what it printed. Every
// case names its config file (/dev/null when the case is about the command line), so that one
// installed on this machine cannot change the outcome.
Captured tmsdiskd(std::vector<std::string> args, const Env& env = {}) {
  args.insert(args.begin(), TMSDISK_DAEMON_PATH);
  return run_captured(args, env, 60000);
}

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

std::size_t line_count(const std::string& text) {
  return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
}

// A usage or config error: exit status 2, nothing on stdout, and each problem one line of its own
// that starts with "tmsdiskd: ".
void check_refused(const Captured& c, std::size_t problems = 1) {
  INFO("stdout: " << c.out << "\nstderr: " << c.err);
  CHECK(c.rc == 2);
  CHECK(c.out.empty());
  CHECK(line_count(c.err) == problems);
  std::istringstream lines(c.err);
  for (std::string line; std::getline(lines, line);) CHECK_THAT(line, StartsWith("tmsdiskd: "));
}

struct Files {
  TempDir dir{test_tmp_root(), "cli-tmsdiskd"};
  std::string root = dir / "root";
  std::string socket = dir / "d.sock";
  Files() { fs::create_directories(root); }
  // A config file whose first line is a valid root, so that the line under test is the only problem.
  std::string conf(const std::string& rest) {
    return write_file(dir / "tmsdiskd.conf", "root = [\"" + root + "\"]\n" + rest);
  }
};

}  // namespace

TEST_CASE("tmsdiskd --help exits 0 and teaches the config file") {
  Captured c = run_captured({TMSDISK_DAEMON_PATH, "--help"}, {});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK(c.out.find("--config") != std::string::npos);
  CHECK(c.out.find("--check-config") != std::string::npos);
  CHECK(c.out.find("--idle-exit-s") != std::string::npos);
}

TEST_CASE("an unknown key in the config file is refused with its file, line and the valid keys") {
  Files f;
  const std::string conf = f.conf("staging-budget-mb = 64\n\nbogus-key = 1\n");
  Captured c = tmsdiskd({"--config", conf});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: " + conf + ":4: unknown key \"bogus-key\" (valid keys: root, socket, "));
  CHECK_THAT(c.err, Contains("idle-exit-s"));
}

TEST_CASE("a near miss of a key is refused with the key that was meant, in the file given with --config") {
  Files f;
  Captured c = tmsdiskd({"--config", f.conf("staging_mb = 64\n")});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: " + f.dir / "tmsdiskd.conf" +
                     ":2: unknown key \"staging_mb\": did you mean staging-budget-mb? (staging-mb was renamed)\n");

  // The file named is the one blamed, not the default one (a daemon once reported `rot` in
  // this file against /etc/tmsdisk/tmsdiskd.conf).
  const std::string other = write_file(f.dir / "other.conf", "rot = [\"" + f.root + "\"]\n");
  c = tmsdiskd({"--config", other});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: " + other + ":1: unknown key \"rot\": did you mean root?\n");

  // Renamed keys are refused with their new name rather than ignored.
  c = tmsdiskd({"--config", f.conf("slot-mb = 4\n")});
  check_refused(c);
  CHECK_THAT(c.err, Contains(":2: unknown key \"slot-mb\": renamed, use chunk-mb = N"));
}

TEST_CASE("a syntax error in the config file is refused with its file, line and column") {
  Files f;
  // The unclosed bracket used to be accepted, and the daemon started.
  const std::string conf = write_file(f.dir / "broken.conf", "root = [\"" + f.root + "\"\nchunk-mb = 8\n");
  Captured c = tmsdiskd({"--config", conf, "--socket", f.socket});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: " + conf + ":2:1: "));
  CHECK_THAT(c.err, Contains("array"));
  CHECK_FALSE(fs::exists(f.socket));
}

TEST_CASE("bad values in the config file name the file, line, key and the valid form, each on its line") {
  Files f;
  const std::string conf = f.conf("socket = \"" + f.socket + "\"\n" +
                                  "staging-budget-mb = \"lots\"\n"
                                  "log-level = \"loud\"\n"
                                  "chunk-mb = 65\n"
                                  "allow-uid = 1000.5\n"
                                  "sweep-interval = [60]\n");
  Captured c = tmsdiskd({"--config", conf});
  check_refused(c, 5);
  CHECK_THAT(c.err, Contains("tmsdiskd: " + conf +
                             ":3: staging-budget-mb = \"lots\": expected an integer from 2 to 1048576 (MiB)\n"));
  CHECK_THAT(c.err, Contains("tmsdiskd: " + conf +
                             ":4: log-level = \"loud\": expected one of \"trace\", \"debug\", \"info\", \"warn\", "
                             "\"error\"\n"));
  CHECK_THAT(c.err, Contains("tmsdiskd: " + conf + ":5: chunk-mb = 65: expected an integer from 1 to 64 (MiB)\n"));
  CHECK_THAT(c.err, Contains("tmsdiskd: " + conf + ":6: allow-uid = 1000.5: expected an array of integers"));
  CHECK_THAT(c.err, Contains("tmsdiskd: " + conf + ":7: sweep-interval = [ 60 ]: expected an integer from 0 to"));
}

TEST_CASE("a key only the command line takes is refused in the config file") {
  Files f;
  Captured c = tmsdiskd({"--config", f.conf("private = true\n")});
  check_refused(c);
  CHECK_THAT(c.err, Contains(f.dir / "tmsdiskd.conf" + ":2: private is a command-line option only"));
}

TEST_CASE("a bad value on the command line names the option and the valid form") {
  Files f;
  const std::vector<std::string> base{"--config", "/dev/null", "--root", f.root, "--socket", f.socket};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), base.begin(), base.end());
    return tmsdiskd(extra);
  };
  Captured c = with({"--staging-budget-mb", "lots"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: --staging-budget-mb lots: expected an integer from 2 to 1048576 (MiB)\n");
  c = with({"--log-level", "loud"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: --log-level loud: expected one of trace, debug, info, warn, error\n");
  c = with({"--allow-uid", "1000", "--allow-uid", "bob"});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: --allow-uid bob: expected an integer from 0 to 4294967294"));
  c = with({"--queue-depth"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: --queue-depth needs a value (--queue-depth N): expected an integer from 1 to 4096\n");
  CHECK_FALSE(fs::exists(f.socket));
}

TEST_CASE("unknown and renamed options are refused with the option that was meant") {
  Files f;
  Captured c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "--bogus"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: unknown option --bogus (tmsdiskd --help lists the options)\n");
  c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "--staging-mb", "64"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: unknown option --staging-mb: renamed, use --staging-budget-mb N\n");
  c = tmsdiskd({"--config", "/dev/null", "--rot", f.root});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: unknown option --rot: did you mean --root?\n");
  c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "stray"});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: unexpected argument \"stray\""));
}

TEST_CASE("settings valid alone but not together are refused, naming both options") {
  Files f;
  // The message used to name no option: "the staging buffer must hold at least two slots".
  Captured c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "--staging-budget-mb", "4", "--chunk-mb", "4"});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: staging-budget-mb (4) must be at least 2 x chunk-mb (4)"));
  c = tmsdiskd({"--config", f.conf("staging-budget-mb = 8192\n"), "--check-config"});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: staging-budget-mb (8192) must be at most max-staging-budget-mb (4096)\n");
  c = tmsdiskd({"--config", "/dev/null", "--socket", f.socket});
  check_refused(c);
  CHECK_THAT(c.err, StartsWith("tmsdiskd: no storage root: pass --root DIR"));
  CHECK_THAT(c.err, Contains("/dev/null"));
}

TEST_CASE("a --config file that does not exist is an error, while the default one may be absent") {
  Files f;
  const std::string missing = f.dir / "missing.conf";
  Captured c = tmsdiskd({"--config", missing, "--root", f.root});
  check_refused(c);
  CHECK(c.err == "tmsdiskd: --config " + missing +
                     ": cannot read it: No such file or directory (name an existing file, or leave out --config)\n");

  if (fs::exists(TMSDISK_DEFAULT_CONFIG)) {
    WARN(TMSDISK_DEFAULT_CONFIG " exists on this machine: its absence is not checked");
    return;
  }
  c = tmsdiskd({"--check-config", "--root", f.root});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK_THAT(c.out, StartsWith("tmsdiskd: " TMSDISK_DEFAULT_CONFIG ": absent"));
}

TEST_CASE("tmsdiskd --check-config passes the example config and prints the effective settings, starting nothing") {
  Files f;
  const std::string example = TMSDISK_SOURCE_DIR "/systemd/tmsdiskd.conf.example";
  const std::string socket = f.dir / "run/tmsdisk/d.sock";
  Captured c = tmsdiskd({"--check-config", "--config", example, "--socket", socket});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK(c.err.empty());
  CHECK_THAT(c.out, StartsWith("tmsdiskd: " + example + ": ok\n"));
  CHECK_THAT(c.out, Contains("\nroot = [ \"/var/lib/tmsdisk\" ]\n"));
  CHECK_THAT(c.out, Contains("\nsocket = \"" + socket + "\"\n"));  // the command line over the file
  CHECK_THAT(c.out, Contains("\nidle-exit-s = 60\n"));
  std::istringstream lines(c.out.substr(c.out.find('\n') + 1));
  // One `key = value` line per setting (and a TOML comment) after the verdict.
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("# ", 0) != 0) CHECK_THAT(line, Contains(" = "));
  CHECK_FALSE(fs::exists(f.dir / "run"));  // no socket directory made, nothing bound
}

TEST_CASE("the command line wins over the config file, which wins over the defaults") {
  Files f;
  const std::string conf = f.conf("staging-budget-mb = 64\nchunk-mb = 4\nallow-uid = [1000, 1001]\n");
  Captured c = tmsdiskd({"--check-config", "--config", conf, "--staging-budget-mb", "32", "--allow-uid", "7"});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK_THAT(c.out, Contains("\nstaging-budget-mb = 32\n"));
  CHECK_THAT(c.out, Contains("\nchunk-mb = 4\n"));
  CHECK_THAT(c.out, Contains("\nallow-uid = [ 7 ]\n"));
  CHECK_THAT(c.out, Contains("\nqueue-depth = 64\n"));
}

TEST_CASE("a missing socket directory is created, mode 0755, as systemd's RuntimeDirectory= would") {
  Files f;
  fs::create_directories(f.dir / "run");
  const std::string socket = f.dir / "run/tmsdisk/d.sock";
  DaemonProcess d;
  const mode_t old_umask = ::umask(077);  // the mode is the daemon's choice, not the umask's
  const int rc = d.start(TMSDISK_DAEMON_PATH, {"--config", "/dev/null", "--root", f.root, "--socket", socket});
  ::umask(old_umask);
  INFO(d.log());
  REQUIRE(rc == 0);
  struct stat st {};
  REQUIRE(::lstat((f.dir / "run/tmsdisk").c_str(), &st) == 0);
  CHECK(S_ISDIR(st.st_mode));
  CHECK((st.st_mode & 07777) == 0755);
  REQUIRE(::lstat(socket.c_str(), &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  CHECK(d.stop() == 0);
}

TEST_CASE("a socket directory that cannot be created is reported with what to do instead") {
  Files f;
  // Two levels missing: only one is created, as RuntimeDirectory= would.
  Captured c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "--socket", f.dir / "none/tmsdisk/d.sock"});
  INFO(c.err);
  CHECK(c.rc == 1);
  CHECK_THAT(c.err, Contains("cannot create the socket directory " + f.dir / "none/tmsdisk"));
  CHECK_THAT(c.err, Contains("mkdir -m 0755") && Contains("--socket PATH") && Contains("--private"));
  CHECK_FALSE(fs::exists(f.dir / "none"));

  // A dangling symlink where the directory goes is not followed: nothing is made where it points.
  fs::create_directories(f.dir / "run");
  fs::create_directory_symlink(f.dir / "elsewhere", f.dir / "run/tmsdisk");
  c = tmsdiskd({"--config", "/dev/null", "--root", f.root, "--socket", f.dir / "run/tmsdisk/d.sock"});
  CHECK(c.rc == 1);
  CHECK_FALSE(fs::exists(f.dir / "elsewhere"));
}

TEST_CASE("an exit-when-idle daemon that no session reaches leaves after --idle-exit-s, with status 0") {
  Files f;
  Captured c = tmsdiskd(
      {"--config", "/dev/null", "--root", f.root, "--socket", f.socket, "--exit-when-idle", "--idle-exit-s", "1"});
  INFO(c.err);
  CHECK(c.rc == 0);  // on its own: run_captured would have killed it after 60 s (status 137)
  CHECK_THAT(c.err, Contains("no session came in 1 s"));
  CHECK_FALSE(fs::exists(f.socket));
}

TEST_CASE("a private daemon that no session reaches leaves after --idle-exit-s, with status 0") {
  Files f;
  const std::string runtime = f.dir / "xdg";
  fs::create_directories(runtime);
  fs::permissions(runtime, fs::perms::owner_all);
  Captured c = tmsdiskd({"--config", "/dev/null", "--private", "--idle-exit-s", "1"},
                        {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", f.root}});
  INFO(c.err);
  CHECK(c.rc == 0);
  std::ifstream log(runtime + "/tmsdisk/tmsdiskd.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  INFO(text);
  CHECK_THAT(text, Contains("no session came in 1 s"));
}

TEST_CASE("a private daemon with a missing TMS_DISK_BACKUP_DIR says it does not exist, and --detach exits 1") {
  Files f;
  const std::string runtime = f.dir / "xdg";
  fs::create_directories(runtime);
  fs::permissions(runtime, fs::perms::owner_all);
  const std::string missing = f.dir / "missing";
  for (bool detach : {false, true}) {
    std::vector<std::string> args{"--config", "/dev/null", "--private"};
    if (detach) args.push_back("--detach");
    Captured c = tmsdiskd(args, {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", missing}});
    INFO("detach " << detach << ": " << c.err);
    CHECK(c.rc == 1);  // the parent of --detach waits for the daemon's outcome, not only for the fork
    CHECK_THAT(c.err, Contains("TMS_DISK_BACKUP_DIR=" + missing + " does not exist"));
    CHECK_FALSE(c.err.find("Not a directory") != std::string::npos);
  }
  const std::string file = write_file(f.dir / "plain", "");
  Captured c = tmsdiskd({"--config", "/dev/null", "--private", "--detach"},
                        {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", file}});
  INFO(c.err);
  CHECK(c.rc == 1);
  CHECK_THAT(c.err, Contains("TMS_DISK_BACKUP_DIR=" + file + " is not a directory"));
}

TEST_CASE("tmsdiskd --private refuses a socket directory another user made, saying whose it is and what to do") {
  if (::geteuid() != 0) skip("making a directory that belongs to another user needs root");
  Files f;
  const std::string runtime = f.dir / "xdg";
  fs::create_directories(runtime + "/tmsdisk");
  fs::permissions(runtime, fs::perms::owner_all);
  REQUIRE(::chown((runtime + "/tmsdisk").c_str(), 65534, 65534) == 0);  // "nobody" got there first
  Captured c = tmsdiskd({"--config", "/dev/null", "--private", "--detach"},
                        {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", f.root}});
  INFO(c.err);
  CHECK(c.rc == 1);
  CHECK_THAT(c.err, Contains(runtime + "/tmsdisk belongs to another user (uid 65534), not to you (uid 0)"));
  CHECK_THAT(c.err, Contains("XDG_RUNTIME_DIR"));
  CHECK_FALSE(fs::exists(runtime + "/tmsdisk/tmsdiskd.sock"));
}

TEST_CASE("tmsdiskd --private --detach exits 0 once the daemon serves, and lets go of its stderr") {
  Files f;
  const std::string runtime = f.dir / "xdg";
  fs::create_directories(runtime);
  fs::permissions(runtime, fs::perms::owner_all);
  // run_captured reads stderr to its end: it returns only once the daemon has let go of it too.
  Captured c = tmsdiskd({"--config", "/dev/null", "--private", "--detach", "--idle-exit-s", "30"},
                        {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", f.root}});
  INFO(c.err);
  CHECK(c.rc == 0);
  CHECK(c.err.empty());
  const std::string socket = runtime + "/tmsdisk/tmsdiskd.sock";
  // Served already when the parent exits: no waiting for the socket to appear.
  CHECK(tmsdisk::socket_answers(socket));
  // A second start finds the first one's lock and says so with a status of its own, which the
  // starters of a private daemon take as "served by the other one".
  Captured again = tmsdiskd({"--config", "/dev/null", "--private", "--detach"},
                            {{"XDG_RUNTIME_DIR", runtime}, {"TMS_DISK_BACKUP_DIR", f.root}});
  INFO(again.err);
  CHECK(again.rc == tmsdisk::kExitAlreadyServed);
  CHECK_THAT(again.err, Contains("another tmsdiskd already serves " + socket));
  std::ifstream log(runtime + "/tmsdisk/tmsdiskd.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Contains("serving " + socket));
  // The daemon is no child of ours and writes no pid file: it is the process holding its lock open.
  const std::string lock = socket + ".lock";
  pid_t daemon = -1;
  for (const auto& proc : fs::directory_iterator("/proc")) {
    std::error_code ec;
    for (const auto& fd : fs::directory_iterator(proc.path() / "fd", ec))
      if (fs::read_symlink(fd.path(), ec) == lock)
        daemon = static_cast<pid_t>(std::atoi(proc.path().filename().c_str()));
    if (daemon > 0) break;
  }
  REQUIRE(daemon > 0);
  REQUIRE(::kill(daemon, SIGTERM) == 0);
  CHECK(eventually([&] { return !tmsdisk::socket_answers(socket); }));
}

TEST_CASE("an exit-when-idle daemon stays while a session is connected, and leaves after it") {
  Files f;
  DaemonProcess d;
  REQUIRE(d.start(TMSDISK_DAEMON_PATH,
                  {"--config", "/dev/null", "--root", f.root, "--socket", f.socket, "--staging-budget-mb", "16",
                   "--chunk-mb", "2", "--exit-when-idle", "--idle-exit-s", "5"}) == 0);
  // Connected right after start, well within the 5 s even on a loaded machine.
  auto session = ShimClient::connect(f.socket, {.job = "idle"});
  REQUIRE(session);
  // Past the idle time, with the session open: still there. (A bounded wait is the only way to see
  // that something does not happen; the session was opened long before it ran out.)
  CHECK(d.wait_exit(std::chrono::seconds(6)) == -1);
  session->close();
  CHECK(d.wait_exit(std::chrono::seconds(60)) == 0);
}

TEST_CASE("the man page documents every option --help lists") {
  Captured help = run_captured({TMSDISK_DAEMON_PATH, "--help"}, {});
  REQUIRE(help.rc == 0);
  std::ifstream in(TMSDISK_SOURCE_DIR "/man/tmsdiskd.8");
  const std::string man((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE_FALSE(man.empty());
  const std::string options =
      man.substr(man.find(".SH OPTIONS"), man.find(".SH EXIT STATUS") - man.find(".SH OPTIONS"));
  // In roff a dash is \-: --staging-budget-mb is written \-\-staging\-budget\-mb, and must not be only
  // the start of a longer name (\-\-max\-ipc\-exports of \-\-max\-ipc\-exports\-per\-uid).
  auto documented = [&](const std::string& option) {
    std::string roff;
    for (char ch : option) roff += ch == '-' ? "\\-" : std::string(1, ch);
    for (auto at = options.find(roff); at != std::string::npos; at = options.find(roff, at + 1)) {
      const auto next = at + roff.size();
      if (next == options.size() || !(std::islower(static_cast<unsigned char>(options[next])) || options[next] == '\\'))
        return true;
    }
    return false;
  };
  std::istringstream lines(help.out);
  int listed = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  -", 0) != 0) continue;  // option lines; descriptions are indented further
    const auto start = line.find("--");
    const auto end = line.find_first_of(" =", start);
    const std::string option = line.substr(start, end == std::string::npos ? end : end - start);
    INFO(option);
    CHECK(documented(option));
    ++listed;
  }
  CHECK(listed > 20);
}

TEST_CASE("a flag given a value it cannot read names the values it takes; --version prints the version") {
  Files f;
  const std::vector<std::string> base{"--config", "/dev/null", "--root", f.root, "--check-config"};
  auto with = [&](const std::string& extra) {
    std::vector<std::string> args = base;
    args.push_back(extra);
    return tmsdiskd(args);
  };
  Captured c = with("--host-tier-keep=maybe");
  check_refused(c);
  // It used to say "a flag: give it alone, without a value", while =false is the documented way off.
  CHECK(c.err ==
        "tmsdiskd: --host-tier-keep=maybe: expected true or false (also yes/no, on/off, 1/0); --host-tier-keep alone "
        "means true\n");
  c = with("--host-tier-keep=false");
  INFO(c.out << c.err);
  CHECK(c.rc == 0);
  CHECK_THAT(c.out, Contains("\nhost-tier-keep = false\n"));
  c = with("--host-tier-ahead=no");
  CHECK(c.rc == 0);
  CHECK_THAT(c.out, Contains("\nhost-tier-ahead = false\n"));

  Captured v = tmsdiskd({"--version"});
  INFO(v.out << v.err);
  CHECK(v.rc == 0);
  CHECK(v.out == "tmsdiskd (tmsdisk) " TMSDISK_VERSION "\n");
}

TEST_CASE("tmsdiskd --check-config says the storage roots are checked at start, and how to check one now") {
  Files f;
  Captured c = tmsdiskd({"--check-config", "--config", "/dev/null", "--root", f.dir / "not-there"});
  INFO(c.out << c.err);
  CHECK(c.rc == 0);  // a root is the starting daemon's to check (and perhaps its own to create)
  CHECK_THAT(c.out, Contains("\n# the storage roots are not checked here but when tmsdiskd starts; "
                             "`tmsctl doctor --root DIR` checks one now"));
}
