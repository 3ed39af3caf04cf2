// SPDX-License-Identifier: Apache-2.0
// Memory PyTorch's caching allocator holds but no tensor uses is not paused. `tmsctl run`
// puts the start-up module (python/startup/sitecustomize.py) on PYTHONPATH; it registers a
// tmsdisk_on_pause callback that calls torch.cuda.empty_cache() before each pause. CI has no torch:
// a fake one (tests/e2e/python) holds "tensors" and a "cache" on simcuda through ctypes, and counts
// the calls of its empty_cache in a marker file. Every wait is bounded (Proc::line answers "" after
// its timeout), so a deadlock fails a case instead of hanging it. Each TEST_CASE is its own CTest test.
#include <catch2/catch.hpp>
#include <fstream>
#include <string>

#include "e2e.h"
#include "skip.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

namespace {

constexpr uint64_t kTensorMiB = 32;
constexpr uint64_t kCacheMiB = 64;
constexpr int kAnswerMs = 60000;  // a pause of 96 MiB on simcuda takes well under a second

// A Python program that allocates tensors and a cache through the fake torch (torch_cache_app.py),
// started with `tmsctl run [run_options] -- python3 ...`.
struct App {
  const Node& node;
  std::string marker;
  Proc proc;

  App(const Node& n, const std::vector<std::string>& run_options, const std::vector<std::string>& app_options = {},
      const Env& extra = {})
      : node(n), marker(n.dir / "empty_cache.calls"), proc(argv(n, run_options, app_options), env(n, marker, extra)) {}

  static std::vector<std::string> argv(const Node& n, const std::vector<std::string>& run_options,
                                       const std::vector<std::string>& app_options) {
    std::vector<std::string> a{TMSCTL_PATH, "run", "--socket", n.socket, "--job", "torch"};
    a.insert(a.end(), run_options.begin(), run_options.end());
    a.insert(a.end(), {"--", PYTHON3_PATH, std::string(TORCH_APP_DIR) + "/torch_cache_app.py",
                       std::to_string(kTensorMiB), std::to_string(kCacheMiB)});
    a.insert(a.end(), app_options.begin(), app_options.end());
    return a;
  }
  static Env env(const Node& n, const std::string& marker, const Env& extra) {
    Env e = n.sim_env();
    e["FAKE_TORCH_MARKER"] = marker;
    e["TMSDISK_LOG"] = "debug";  // the start-up module's lines too, for a failing case's output
    for (auto& [k, v] : extra) e[k] = v;
    return e;
  }
  std::string cmd(const std::string& c) {
    proc.send(c);
    return proc.line(kAnswerMs);
  }
  // How many times the fake torch.cuda.empty_cache() ran.
  int empty_cache_calls() const {
    std::ifstream in(marker);
    int n = 0;
    for (std::string l; std::getline(in, l);) ++n;
    return n;
  }
};

void require_python() {
  if (std::string(PYTHON3_PATH).empty()) skip("no python3 was found when the build was configured");
}

// The node's daemon started (the cases need python3: skipped without it).
Node& started(Node& node) {
  require_python();
  node.start_daemon();
  return node;
}

// A node, and the app launched on it with `tmsctl run`, ready.
struct Launched {
  Node node;
  App app;
  explicit Launched(const std::vector<std::string>& run_options, const std::vector<std::string>& app_options = {},
                    const Env& extra = {})
      : app(started(node), run_options, app_options, extra) {
    REQUIRE(app.proc.line(kAnswerMs) == "ready");
  }
};

// `tmsctl pause` moves the cache with the tensors, no empty_cache() having run; the resume restores
// the tensors.
void pause_whole_and_resume(const Node& node, App& app) {
  auto p = node.pause(app.proc.pid());
  INFO(p.text);
  REQUIRE(p.ok());
  REQUIRE(p.size() == 1);
  CHECK(p[0].bytes == (kTensorMiB + kCacheMiB) * MiB);
  CHECK(app.empty_cache_calls() == 0);
  REQUIRE(node.resume(app.proc.pid()).ok());
  CHECK(app.cmd("check") == "ok");
}

}  // namespace

TEST_CASE("tmsctl run: a pause moves PyTorch's tensors, not its cache, and the resume restores them bit-exact") {
  Launched launched({});
  Node& node = launched.node;
  App& app = launched.app;
  REQUIRE(app.cmd("callbacks") == "registered yes");
  CHECK(app.empty_cache_calls() == 0);

  auto p = node.pause(app.proc.pid());
  INFO(p.text);
  REQUIRE(p.ok());
  REQUIRE(p.size() == 1);
  CHECK(p[0].bytes == kTensorMiB * MiB);
  CHECK(app.empty_cache_calls() == 1);
  CHECK(totals(node, app.proc.pid()).paused == kTensorMiB * MiB);

  auto r = node.resume(app.proc.pid());
  INFO(r.text);
  REQUIRE(r.ok());
  CHECK(r[0].bytes == kTensorMiB * MiB);
  CHECK(app.empty_cache_calls() == 1);  // not on resume
  CHECK(app.cmd("check") == "ok");

  // The next pause asks again (the cache is empty now: nothing more is freed).
  p = node.pause(app.proc.pid());
  INFO(p.text);
  REQUIRE(p.ok());
  CHECK(p[0].bytes == kTensorMiB * MiB);
  CHECK(app.empty_cache_calls() == 2);
  REQUIRE(node.resume(app.proc.pid()).ok());
  CHECK(app.cmd("check") == "ok");
}

TEST_CASE("tmsctl run --keep-torch-cache: the cache is paused with the tensors") {
  Launched launched({"--keep-torch-cache"});
  Node& node = launched.node;
  App& app = launched.app;
  CHECK(app.cmd("callbacks") == "registered no");
  pause_whole_and_resume(node, app);
}

TEST_CASE("a program that imports no torch gets no call: its memory is paused whole") {
  Launched launched({}, {"--no-torch"});
  Node& node = launched.node;
  App& app = launched.app;
  CHECK(app.cmd("callbacks") == "registered yes");  // registered, but torch is not in sys.modules
  pause_whole_and_resume(node, app);
}

TEST_CASE("a program that pauses itself through ctypes.CDLL empties its cache first and does not hang") {
  // ctypes.CDLL releases the GIL while tmsdisk_pause() waits for the control thread, so the callback,
  // which takes the GIL on the shim's thread, runs.
  Launched launched({});
  Node& node = launched.node;
  App& app = launched.app;
  REQUIRE(app.cmd("pause-self") == "paused 0");
  CHECK(app.empty_cache_calls() == 1);
  const Totals paused = totals(node, app.proc.pid());
  INFO(show(paused));
  CHECK(paused.paused == kTensorMiB * MiB);
  REQUIRE(app.cmd("resume-self") == "resumed 0");
  CHECK(app.empty_cache_calls() == 1);
  CHECK(app.cmd("check") == "ok");
}

TEST_CASE("a program that pauses itself holding the GIL (ctypes.PyDLL) is paused without its callback, in time") {
  // The callback cannot take the GIL until tmsdisk_pause() returns: the pause stops waiting for it
  // after TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS and moves the cache too. The callback then runs late,
  // while the process is paused, and frees the paused cache (a free of paused memory is allowed).
  Launched launched({}, {}, {{"TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS", "300"}});
  Node& node = launched.node;
  App& app = launched.app;
  REQUIRE(app.cmd("pause-gil") == "paused 0");
  // What the pause itself moved: the cache with the tensors (its callback had not run).
  auto [rc, out] = node.tmsctl({"status"});
  INFO(out);
  const json j = json::parse(out, nullptr, false);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 1);
  CHECK(j[0]["last_pause"].value("bytes", uint64_t{0}) == (kTensorMiB + kCacheMiB) * MiB);
  // The program waits for commands with the GIL released: the late callback runs now, alongside.
  REQUIRE(app.cmd("resume-self") == "resumed 0");
  CHECK(app.cmd("check") == "ok");
  CHECK(eventually([&] { return app.empty_cache_calls() == 1; }));
  // The cache it freed (paused or resumed by then) is gone: only the tensors stay.
  CHECK(eventually([&] { return totals(node, app.proc.pid()).resident == kTensorMiB * MiB; }));
  CHECK(app.cmd("check") == "ok");
}

TEST_CASE("the sitecustomize that the start-up module hides on the path still runs") {
  Launched launched({}, {}, {{"PYTHONPATH", std::string(TORCH_APP_DIR) + "/usersite"}});
  App& app = launched.app;
  CHECK(app.cmd("site") == "site yes");
  CHECK(app.cmd("callbacks") == "registered yes");
}

TEST_CASE(
    "tmsctl env: the start-up module's directory first on PYTHONPATH, the user's after it, or off with the flag") {
  Node node;
  node.start_daemon();
  Env env = node.sim_env();
  env["PYTHONPATH"] = "/opt/site:/opt/more";
  auto [rc, out] = run({TMSCTL_PATH, "--socket", node.socket, "--json", "env"}, env);
  INFO(out);
  REQUIRE(rc == 0);
  json j = json::parse(out, nullptr, false);
  REQUIRE(j.is_object());
  CHECK(j.value("PYTHONPATH", "") == std::string(PYTHON_STARTUP_DIR) + ":/opt/site:/opt/more");
  CHECK(j.value("TMSDISK_TORCH_EMPTY_CACHE", "") == "1");

  // Inside a launch that has it already: not twice.
  env["PYTHONPATH"] = j.value("PYTHONPATH", "");
  std::tie(rc, out) = run({TMSCTL_PATH, "--socket", node.socket, "--json", "env"}, env);
  j = json::parse(out, nullptr, false);
  REQUIRE(j.is_object());
  CHECK(j.value("PYTHONPATH", "") == std::string(PYTHON_STARTUP_DIR) + ":/opt/site:/opt/more");

  env["PYTHONPATH"] = "/opt/site";
  std::tie(rc, out) = run({TMSCTL_PATH, "--socket", node.socket, "--json", "env", "--keep-torch-cache"}, env);
  INFO(out);
  REQUIRE(rc == 0);
  j = json::parse(out, nullptr, false);
  REQUIRE(j.is_object());
  // The module's directory stays first (it holds the tmsdisk package too); the module itself is off.
  CHECK(j.value("PYTHONPATH", "") == std::string(PYTHON_STARTUP_DIR) + ":/opt/site");
  CHECK(j.value("TMSDISK_TORCH_EMPTY_CACHE", "") == "0");
}
