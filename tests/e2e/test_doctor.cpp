// SPDX-License-Identifier: Apache-2.0
// `tmsctl doctor` run as an operator would, on simcuda and a real tmsdiskd, with each problem made on
// purpose: a tmpfs root, no driver, a device without VMM, no daemon, a low RLIMIT_MEMLOCK, a small
// disk. What cannot be staged here (io_uring disabled, seccomp, systemd states) is tested on the
// decision functions in tests/unit/test_doctor_decisions.cpp.
#include <dlfcn.h>

#include <fstream>

#include "e2e.h"
#include "tmsdisk/common/paths.h"

using namespace tmsdisk::e2e;

namespace {

Captured doctor(const std::vector<std::string>& args, const Env& env) {
  std::vector<std::string> argv{TMSCTL_PATH, "doctor"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_captured(argv, env);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
bool contains(const json& text, const std::string& part) {
  return text.is_string() && contains(text.get<std::string>(), part);
}

// The text line about `subject` ("ok    SUBJECT: detail"), without its status column; empty if none.
std::string line_about(const std::string& out, const std::string& subject, std::string* status = nullptr) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() < 6 || line.compare(6, subject.size() + 1, subject + ":") != 0) continue;
    if (status) *status = line.substr(0, line.find(' '));
    return line.substr(6);
  }
  return {};
}

// The --json answer, parsed; fails the test if it is not the doctor's object.
json parse(const Captured& c) {
  INFO("stdout: " << c.out << "\nstderr: " << c.err);
  json out = json::parse(c.out, nullptr, false);
  REQUIRE(out.is_object());
  REQUIRE(out["checks"].is_array());
  return out;
}

// The check named `name` whose subject contains `subject`; fails the test if there is none.
json check(const json& out, const std::string& name, const std::string& subject = "") {
  for (const auto& c : out["checks"])
    if (c.value("name", "") == name && contains(c.value("subject", ""), subject)) return c;
  INFO(out.dump(2));
  FAIL("no check " << name << " about '" << subject << "'");
  return {};
}

bool has_check(const json& out, const std::string& name) {
  for (const auto& c : out["checks"])
    if (c.value("name", "") == name) return true;
  return false;
}

bool has_cap_ipc_lock() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("CapEff:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> 14) & 1;
  return false;
}

// Runs what follows under `ulimit -l 64` (KiB) and without CAP_IPC_LOCK, with which io_uring charges
// nothing to RLIMIT_MEMLOCK (a root test run has it: setpriv drops it from the bounding set, which
// for root is what exec grants). Skips the test where that cannot be arranged.
std::vector<std::string> low_memlock(const std::vector<std::string>& command) {
  std::vector<std::string> argv{"/bin/sh", "-c", "ulimit -l 64 && exec \"$@\"", "sh"};
  if (has_cap_ipc_lock()) {
    std::string setpriv;
    for (const char* p : {"/usr/bin/setpriv", "/bin/setpriv"})
      if (::access(p, X_OK) == 0) setpriv = p;
    if (setpriv.empty())
      skip(
          "this test runs with CAP_IPC_LOCK, which lifts RLIMIT_MEMLOCK, and setpriv (util-linux) is not here to "
          "drop it");
    argv.insert(argv.end(), {setpriv, "--bounding-set", "-ipc_lock"});
  }
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

}  // namespace

TEST_CASE("a healthy node: the root, the driver and its VMM, and the daemon with its version are ok") {
  Node node;
  if (on_tmpfs(node.root))
    skip("the test's directory " + node.root +
         " is on tmpfs, where doctor rightly refuses a root; set "
         "TMSDISK_TEST_TMP to a directory on disk");
  node.device_mb = 1;  // the root's free space holds it wherever the test runs
  node.start_daemon();
  const Captured c = doctor({"--socket", node.socket}, node.sim_env());
  INFO("stdout: " << c.out << "\nstderr: " << c.err);
  CHECK(c.rc == 0);
  CHECK(c.err.empty());
  CHECK(contains(c.out, "ok    daemon: tmsdiskd " TMSDISK_VERSION " at " + node.socket + "\n"));
  for (const std::string& subject :
       {"root " + node.root + ": filesystem", "root " + node.root + ": O_DIRECT", "root " + node.root + ": free space",
        std::string("CUDA driver"), std::string("device 0 (simcuda device 0)")}) {
    std::string status;
    const std::string line = line_about(c.out, subject, &status);
    INFO(subject);
    CHECK(status == "ok");
    CHECK_FALSE(contains(line, "Fix:"));
  }
  CHECK(contains(line_about(c.out, "device 0 (simcuda device 0)"), "virtual memory management"));
  CHECK(contains(line_about(c.out, "root " + node.root + ": free space"), "1.0 MiB of device memory"));
  // Which roots were checked, and how to check the others.
  CHECK(
      contains(c.out, "roots checked: " + node.root + " (the daemon's first root); check the others with --root DIR"));
  CHECK(contains(c.out, "\ndoctor: "));
  CHECK(contains(c.out, " 0 FAIL\n"));
}

TEST_CASE("with --json, every check has a name, subject, status, detail and fix, and the summary counts them") {
  Node node;
  node.device_mb = 1;
  node.start_daemon();
  const Captured c = doctor({"--json", "--socket", node.socket}, node.sim_env());
  const json out = parse(c);
  CHECK(c.err.empty());
  for (const char* name : {"daemon", "systemd.socket", "driver", "device", "root.filesystem", "root.direct_io",
                           "root.space", "io_uring", "memlock"}) {
    INFO(name);
    CHECK(has_check(out, name));
  }
  std::map<std::string, std::size_t> counted;
  for (const auto& ch : out["checks"]) {
    INFO(ch.dump());
    for (const char* key : {"name", "subject", "status", "detail", "fix"}) CHECK(ch[key].is_string());
    const std::string status = ch.value("status", "");
    CHECK((status == "ok" || status == "warn" || status == "FAIL"));
    CHECK(ch.value("fix", "").empty() == (status == "ok"));  // every problem says what to do
    ++counted[status];
  }
  CHECK(out["summary"]["ok"] == counted["ok"]);
  CHECK(out["summary"]["warn"] == counted["warn"]);
  CHECK(out["summary"]["fail"] == counted["FAIL"]);
  CHECK(out["ok"] == (counted["FAIL"] == 0));
  CHECK(c.rc == (counted["FAIL"] == 0 ? 0 : 1));
  CHECK(check(out, "daemon")["detail"] == "tmsdiskd " TMSDISK_VERSION " at " + node.socket);
  CHECK(out["roots"]["checked"] == json::array({node.root}));
  CHECK(out["roots"]["source"] == "daemon");
}

TEST_CASE("a root on tmpfs FAILs, saying the paused memory would stay in RAM and where to put it instead") {
  if (!on_tmpfs("/dev/shm")) skip("no tmpfs at /dev/shm to put a root on");
  TempDir shm("/dev/shm", "tmsdisk-doctor");
  Node node;
  const Env env = node.sim_env();
  const std::vector<std::string> args{"--socket", node.dir / "absent.sock", "--root", shm.path()};
  const Captured text = doctor(args, env);
  INFO("stdout: " << text.out << "\nstderr: " << text.err);
  CHECK(text.rc == 1);
  std::string status;
  const std::string line = line_about(text.out, "root " + shm.path() + ": filesystem", &status);
  CHECK(status == "FAIL");
  CHECK(contains(line, "on tmpfs: paused GPU memory would stay in RAM"));
  CHECK(contains(line, ". Fix: use a directory on a local NVMe filesystem"));
  CHECK(contains(text.out, "roots checked: " + shm.path() + " (given with --root)"));

  std::vector<std::string> json_args = args;
  json_args.push_back("--json");
  const json fs = check(parse(doctor(json_args, env)), "root.filesystem", shm.path());
  CHECK(fs["status"] == "FAIL");
  CHECK(contains(fs["detail"], "RAM"));
  CHECK(contains(fs["fix"], "NVMe"));
}

TEST_CASE("the O_DIRECT verdict is the daemon's own, and probing a root leaves nothing in it") {
  Node node;
  const json out = parse(doctor({"--json", "--socket", node.dir / "absent.sock", "--root", node.root}, node.sim_env()));
  const json direct = check(out, "root.direct_io", node.root);
  INFO(direct.dump());
  CHECK(fs::is_empty(node.root));
  // tmsdiskd probes the root as it starts, with the same function, and says when it falls back.
  node.start_daemon();
  const bool daemon_buffered = contains(node.daemon.log(), "does not support O_DIRECT");
  CHECK(daemon_buffered == contains(direct["detail"], "refuses O_DIRECT"));
  if (!daemon_buffered) CHECK(direct["status"] == "ok");
}

TEST_CASE("without a CUDA driver the driver FAILs, and free space is told without a comparison") {
  // The doctor inherits this test's library path, on which simcuda is not.
  if (void* real = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    ::dlclose(real);
    skip("a CUDA driver (libcuda.so.1) is loadable here, so there is no missing driver to find");
  }
  Node node;
  const Captured c = doctor({"--json", "--socket", node.dir / "absent.sock", "--root", node.root}, {});
  const json out = parse(c);
  CHECK(c.rc == 1);
  const json driver = check(out, "driver");
  CHECK(driver["status"] == "FAIL");
  CHECK(contains(driver["detail"], "cannot load libcuda.so.1"));
  CHECK(contains(driver["fix"], "install the NVIDIA driver"));
  CHECK_FALSE(has_check(out, "device"));
  const json space = check(out, "root.space");
  CHECK(space["status"] == "ok");
  CHECK(contains(space["detail"], "free (no CUDA driver answered: the device memory to hold is unknown)"));
}

TEST_CASE("a device without virtual memory management FAILs: the shim could pause nothing on it") {
  Node node;
  Env env = node.sim_env();
  env["SIMCUDA_VIRTUAL_MEMORY_MANAGEMENT"] = "0";
  const Captured c = doctor({"--json", "--socket", node.dir / "absent.sock", "--root", node.root}, env);
  const json out = parse(c);
  CHECK(c.rc == 1);
  CHECK(check(out, "driver")["status"] == "ok");
  const json device = check(out, "device", "device 0");
  CHECK(device["status"] == "FAIL");
  CHECK(contains(device["detail"], "no virtual memory management"));
  CHECK(contains(device["detail"], "nothing on it can be paused"));
  CHECK(contains(device["fix"], "cuMemCreate/cuMemMap"));
}

TEST_CASE("no daemon at the socket FAILs with the command that starts one there") {
  Node node;
  const std::string socket = node.dir / "absent.sock";
  SECTION("text") {
    const Captured c = doctor({"--socket", socket, "--root", node.root}, node.sim_env());
    INFO("stdout: " << c.out << "\nstderr: " << c.err);
    CHECK(c.rc == 1);
    std::string status;
    const std::string line = line_about(c.out, "daemon", &status);
    CHECK(status == "FAIL");
    CHECK(contains(line, "no tmsdiskd answers at " + socket + " (No such file or directory)"));
    CHECK(contains(line, "Fix: start a daemon there: `tmsdiskd --socket " + socket + " --root DIR`"));
    // The root given is still checked.
    CHECK(contains(c.out, "root " + node.root + ": filesystem: "));
  }
  SECTION("no --root either: nothing names a root, and the doctor says how to name them") {
    const json out = parse(doctor({"--json", "--socket", socket}, node.sim_env()));
    CHECK(check(out, "daemon")["status"] == "FAIL");
    const json roots = check(out, "roots");
    CHECK(roots["status"] == "warn");
    CHECK(contains(roots["fix"], "--root DIR"));
    CHECK_FALSE(has_check(out, "root.filesystem"));
    CHECK(out["roots"]["source"] == "none");
  }
}

TEST_CASE("the daemon's RLIMIT_MEMLOCK below the staging it pins warns, naming that daemon and how to raise it") {
  Node node;
  node.device_mb = 1;
  std::vector<std::string> daemon{TMSDISK_DAEMON_PATH,   "--socket", node.socket,  "--root", node.root,
                                  "--staging-budget-mb", "16",       "--chunk-mb", "2"};
  const std::vector<std::string> argv = low_memlock(daemon);
  const int rc = node.daemon.start(argv[0], std::vector<std::string>(argv.begin() + 1, argv.end()));
  INFO(node.daemon.log());
  REQUIRE(rc == 0);
  // The doctor itself keeps its own limit: what it reports is the daemon's.
  const json out = parse(doctor({"--json", "--socket", node.socket}, node.sim_env()));
  const json memlock = check(out, "memlock");
  INFO(memlock.dump());
  CHECK(memlock["status"] == "warn");
  CHECK(memlock["subject"] == "memlock of tmsdiskd (pid " + std::to_string(node.daemon.pid()) + ")");
  CHECK(contains(memlock["detail"], "RLIMIT_MEMLOCK is 64.0 KiB, less than the 1 rank x 16.0 MiB of staging"));
  // The service's unit where systemd runs; else the limit of the shell that starts the daemon.
  const bool systemd = fs::is_directory("/run/systemd/system");
  CHECK(contains(memlock["fix"], systemd ? "LimitMEMLOCK=infinity" : "ulimit -l unlimited"));
  if (!systemd) CHECK_FALSE(contains(memlock["fix"], "systemctl"));
}

TEST_CASE("where systemd is not the init system, no fix names systemctl: the system daemon is started by hand") {
  if (fs::is_directory("/run/systemd/system")) skip("systemd is the init system here (/run/systemd/system)");
  if (fs::exists(tmsdisk::kSystemSocket)) skip("a system tmsdiskd socket exists on this machine");
  Node node;
  // The system socket, where nothing answers: the fix is how to start the node's daemon.
  const json out = parse(doctor({"--json", "--socket", tmsdisk::kSystemSocket, "--root", node.root}, node.sim_env()));
  const json daemon = check(out, "daemon");
  INFO(out.dump(2));
  CHECK(daemon["status"] == "FAIL");
  CHECK(contains(daemon["fix"], "ulimit -l unlimited; exec tmsdiskd --config "));
  for (const auto& c : out["checks"]) CHECK_FALSE(contains(c.value("fix", ""), "systemctl"));
}

TEST_CASE("without a daemon, this shell's RLIMIT_MEMLOCK is checked, which a private daemon would inherit") {
  Node node;
  const Captured c = run_captured(
      low_memlock({TMSCTL_PATH, "doctor", "--json", "--socket", node.dir / "absent.sock", "--root", node.root}),
      node.sim_env());
  const json memlock = check(parse(c), "memlock");
  INFO(memlock.dump());
  CHECK(memlock["status"] == "warn");
  CHECK(memlock["subject"] == "memlock of this shell");
  // The daemon's default staging budget, for the one GPU simcuda has.
  CHECK(contains(memlock["detail"], "RLIMIT_MEMLOCK is 64.0 KiB, less than the 1 rank x 256.0 MiB of staging"));
  CHECK(contains(memlock["fix"], "ulimit -l unlimited"));
}

TEST_CASE("a root with less free space than the node's device memory warns with both figures") {
  Node node;
  Env env = node.sim_env();
  env["SIMCUDA_DEVICE_COUNT"] = "64";
  env["SIMCUDA_DEVICE_MEM_MB"] = std::to_string(1 << 24);  // 16 TiB each: 1 PiB in all
  const json out = parse(doctor({"--json", "--socket", node.dir / "absent.sock", "--root", node.root}, env));
  const json space = check(out, "root.space");
  INFO(space.dump());
  CHECK(space["status"] == "warn");
  CHECK(contains(space["detail"], "less than the node's 1.0 PiB of device memory"));
  CHECK(contains(space["fix"], "add roots on other NVMe drives"));
}

TEST_CASE("doctor --help teaches the checks, --root and the global options, and tmsctl --help lists doctor") {
  const Captured help = run_captured({TMSCTL_PATH, "doctor", "--help"}, {});
  INFO(help.out << help.err);
  CHECK(help.rc == 0);
  for (const char* part : {"--root DIR", "--json", "--socket", "tmpfs", "O_DIRECT", "io_uring", "memlock",
                           "virtual memory", "tmsdiskd.socket", "Exit status"})
    CHECK(contains(help.out, part));
  const Captured top = run_captured({TMSCTL_PATH, "--help"}, {});
  CHECK(contains(top.out, "doctor"));
  // A usage error is still one line and exit status 2.
  const Captured bad = run_captured({TMSCTL_PATH, "doctor", "--rot", "/x"}, {});
  CHECK(bad.rc == 2);
  CHECK(contains(bad.err, "unknown option --rot for doctor"));
}
