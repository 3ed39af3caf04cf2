// SPDX-License-Identifier: Apache-2.0
// End to end on the simulated driver: unmodified CUDA programs run with the real libtmsdisk.so
// preloaded, the real tmsdiskd, and the real tmsctl. Each TEST_CASE is its own CTest test.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <sstream>
#include <thread>

#include "client.h"
#include "e2e.h"
#include "in_process_daemon.h"
#include "server.h"
#include "small_filesystem.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/private_daemon.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

namespace {

uint64_t disk_usage(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto& e : fs::recursive_directory_iterator(dir, ec)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// `count` ranks of `job`, each launched by `tmsctl run` (RANK set) and holding `allocs` allocations
// of `bytes`, ready once the daemon lists them all.
std::vector<std::unique_ptr<Proc>> launch_ranks(const Node& node, const std::string& job, int count, int allocs,
                                                uint64_t bytes) {
  std::vector<std::unique_ptr<Proc>> ranks;
  for (int r = 0; r < count; ++r) {
    Env env = node.sim_env();
    env["RANK"] = std::to_string(r);
    ranks.push_back(std::make_unique<Proc>(
        std::vector<std::string>{TMSCTL_PATH, "--socket", node.socket, "run", "--job", job, "--", CUDA_PATTERN_PATH},
        env));
    REQUIRE(ranks.back()->line() == "ready");
    for (int a = 1; a <= allocs; ++a)
      REQUIRE_FALSE(
          ok_addr(ranks.back()->cmd("alloc " + std::to_string(a) + " " + std::to_string(bytes) + " direct")).empty());
  }
  REQUIRE(eventually([&] { return node.status().size() == static_cast<std::size_t>(count); }));
  return ranks;
}

}  // namespace

TEST_CASE("tmsctl pause frees device memory for another process - resume restores every byte at the same addresses") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("e2e", 0));
  REQUIRE(prog.line() == "ready");
  std::map<int, std::string> addr;
  addr[1] = ok_addr(prog.cmd("alloc 1 67108864 direct"));    // 64 MiB
  addr[2] = ok_addr(prog.cmd("alloc 2 50331648 procaddr"));  // 48 MiB
  addr[3] = ok_addr(prog.cmd("alloc 3 33558528 dlsym"));     // 32 MiB + 4 KiB
  addr[4] = ok_addr(prog.cmd("alloc 4 65536 direct"));       // small: stays native
  for (auto& [id, a] : addr) REQUIRE_FALSE(a.empty());
  REQUIRE(prog.cmd("check") == "ok 4");
  CHECK_FALSE(node.probe(200));  // the device is too full for a second user

  const std::string dir = node.rank_dir("e2e", 0, prog.pid());
  uint64_t usage = 0;
  for (int cycle = 0; cycle < 5; ++cycle) {
    auto pj = node.pause("e2e");
    INFO(pj.text);
    REQUIRE(pj.ok());
    REQUIRE(pj.size() == 1);
    CHECK(pj[0].ok);
    CHECK(pj[0].bytes >= 64 * MiB + 48 * MiB + 32 * MiB);

    auto ranks = node.status();
    REQUIRE(ranks.size() == 1);
    CHECK(ranks[0].totals.state == "paused");
    CHECK(ranks[0].totals.resident == 0);

    CHECK(node.probe(200));  // the freed memory is usable by another process now
    CHECK(fs::exists(dir + "/data"));
    const uint64_t now = disk_usage(dir);
    if (cycle == 0) usage = now;
    CHECK(now == usage);

    auto rj = node.resume("e2e");
    INFO(rj.text);
    REQUIRE(rj.ok());
    CHECK(rj[0].ok);
    REQUIRE(prog.cmd("check") == "ok 4");
    for (auto& [id, a] : addr) CHECK(prog.cmd("addr " + std::to_string(id)) == "ok " + a);
    CHECK_FALSE(node.probe(200));

    // The program lives on between pauses: frees and allocates again (same sizes, so disk usage
    // must stay where it is).
    REQUIRE(prog.cmd("free 2") == "ok");
    addr[2] = ok_addr(prog.cmd("alloc 2 50331648 " + std::string(cycle % 2 ? "direct" : "dlsym")));
    REQUIRE_FALSE(addr[2].empty());
  }
  prog.cmd("exit");
  CHECK(prog.wait() == 0);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("the in-process C API pauses and resumes from inside the program") {
  Node node;
  node.device_mb = 256;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("api", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 134217728 direct")).empty());
  REQUIRE(prog.cmd("check") == "ok 1");
  CHECK_FALSE(node.probe(200));
  REQUIRE(prog.cmd("api pause") == "ok");
  CHECK(node.probe(200));
  REQUIRE(prog.cmd("api resume") == "ok");
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("tmsctl run starts two ranks of one job and tmsctl pause --job pauses both") {
  Node node;
  node.start_daemon();
  auto ranks = launch_ranks(node, "duo", 2, 1, 32 * MiB);
  auto j = node.pause("duo");
  INFO(j.text);
  REQUIRE(j.ok());
  REQUIRE(j.size() == 2);
  CHECK(j[0].rank == 0);
  CHECK(j[1].rank == 1);
  auto rj = node.resume("duo");
  REQUIRE(rj.ok());
  for (auto& p : ranks) CHECK(p->cmd("check") == "ok 1");
}

TEST_CASE("two tmsctl pause at once of the same ranks: every rank answers both, none is left without an answer") {
  // A COMMAND that reaches a rank while it awaits the daemon's reply to its own request must never
  // be taken for that reply (the daemon's request ids have their own range).
  Node node;
  node.start_daemon();
  auto ranks = launch_ranks(node, "race", 2, 2, 16 * MiB);
  for (int round = 0; round < 3; ++round) {
    auto first = std::async(std::launch::async, [&] {
      return node.control("pause", {"--job", "race", "--timeout", "60"});
    });
    auto second = node.control("pause", {"--job", "race", "--timeout", "60"});
    auto one = first.get();
    INFO(one.text);
    INFO(second.text);
    for (const Outcome* o : {&one, &second}) {
      REQUIRE(o->size() == 2);
      for (const auto& r : o->ranks) {
        // Paused, already paused, or busy with the other pause: never a protocol error, never silence.
        CHECK((r.ok || r.error == EBUSY));
        CHECK(r.message.find("Protocol") == std::string::npos);
        CHECK(r.message.find("no answer") == std::string::npos);
      }
    }
    for (const auto& r : node.status()) CHECK(r.totals.state == "paused");
    REQUIRE(node.resume("race").ok());
    for (auto& p : ranks) CHECK(p->cmd("check") == "ok 2");
  }
}

TEST_CASE("tmsctl says no-op for a pause or resume with nothing to do - status keeps the last real figures") {
  Node node;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("noop", 0));
  REQUIRE(prog.line() == "ready");
  // The rank's last pause and resume as `tmsctl status` reports them: {bytes, ns} each.
  auto last_figures = [&] {
    auto [rc, out] = node.tmsctl({"status"});
    INFO(out);
    json j = json::parse(out, nullptr, false);
    REQUIRE(rc == 0);
    REQUIRE((j.is_array() && j.size() == 1));
    return std::pair{j[0]["last_pause"], j[0]["last_resume"]};
  };

  // The first managed allocation connects the rank; once freed there is nothing to pause.
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 16777216 direct")).empty());
  REQUIRE(prog.cmd("free 1") == "ok");
  REQUIRE(eventually([&] { return node.status().size() == 1; }));
  auto none = node.pause("noop");
  INFO(none.text);
  REQUIRE(none.ok());
  REQUIRE(none.size() == 1);
  CHECK(none[0].outcome == "no-op");
  CHECK(none[0].message == "no managed allocations to pause");

  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33554432 direct")).empty());
  auto first = node.pause("noop");
  INFO(first.text);
  REQUIRE(first.ok());
  REQUIRE(first.size() == 1);
  CHECK(first[0].outcome == "done");
  CHECK(first[0].bytes == 32 * MiB);
  const json pause_figures = last_figures().first;
  CHECK(pause_figures.value("bytes", uint64_t{0}) == 32 * MiB);
  CHECK(pause_figures.value("ns", uint64_t{0}) > 0);

  auto again = node.pause("noop");
  INFO(again.text);
  REQUIRE(again.ok());  // nothing to do is no failure: exit status 0
  REQUIRE(again.size() == 1);
  CHECK(again[0].ok);
  CHECK(again[0].outcome == "no-op");
  CHECK(again[0].bytes == 0);
  CHECK(again[0].message == "already paused");
  CHECK(last_figures().first == pause_figures);

  auto resumed = node.resume("noop");
  INFO(resumed.text);
  REQUIRE(resumed.ok());
  CHECK(resumed[0].outcome == "done");
  CHECK(resumed[0].bytes == 32 * MiB);
  const auto [pause_kept, resume_figures] = last_figures();
  CHECK(pause_kept == pause_figures);
  CHECK(resume_figures.value("bytes", uint64_t{0}) == 32 * MiB);
  CHECK(resume_figures.value("ns", uint64_t{0}) > 0);

  auto resumed_again = node.resume("noop");
  INFO(resumed_again.text);
  REQUIRE(resumed_again.ok());
  CHECK(resumed_again[0].outcome == "no-op");
  CHECK(resumed_again[0].bytes == 0);
  CHECK(resumed_again[0].message == "nothing is paused");
  CHECK(last_figures() == std::pair{pause_figures, resume_figures});
  CHECK(prog.cmd("check") == "ok 1");
}

TEST_CASE("without a daemon the shim starts a private one, which leaves when the last process exits") {
  Node node;  // no daemon started
  if (fs::exists(kSystemSocket)) skip("a system tmsdiskd socket exists on this machine");
  const std::string xdg = node.dir / "xdg";
  fs::create_directories(xdg);
  ::chmod(xdg.c_str(), 0700);
  Env env = node.sim_env();
  env["LD_PRELOAD"] = SHIM_PATH;
  env["XDG_RUNTIME_DIR"] = xdg;
  env["TMS_DISK_BACKUP_DIR"] = node.root;
  env["TMSDISK_JOB"] = "private";
  env["TMSDISK_LOG"] = "info";
  const std::string socket = xdg + "/tmsdisk/tmsdiskd.sock";
  {
    Proc prog({CUDA_PATTERN_PATH}, env);
    REQUIRE(prog.line() == "ready");
    REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
    REQUIRE(prog.cmd("api pause") == "ok");
    CHECK(fs::exists(socket));
    CHECK(fs::exists(node.rank_dir("private", prog.pid(), prog.pid()) + "/data"));  // undeclared rank: the pid
    REQUIRE(prog.cmd("api resume") == "ok");
    CHECK(prog.cmd("check") == "ok 1");
    prog.cmd("exit");
    CHECK(prog.wait() == 0);
  }
  CHECK(eventually([&] { return !socket_answers(socket); }));
  CHECK(eventually([&] { return disk_usage(node.root) == 0; }));
}

// ------------------------------------------------------------------------------------------------
// Failure paths: the program keeps running with its data, the command says what happened, and a
// later pause succeeds.

TEST_CASE("ENOSPC at pause leaves every allocation resident and intact - a smaller pause then succeeds") {
  std::string why_not;
  auto small = SmallFilesystem::mount(64, &why_not);
  if (!small) skip(why_not);
  Node node;
  node.root = small->path();
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("full", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 50331648 direct")).empty());  // 48 MiB
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33554432 direct")).empty());  // 32 MiB: 80 MiB > the disk
  auto j = node.pause("full");
  INFO(j.text);
  CHECK_FALSE(j.ok());
  REQUIRE(j.size() == 1);
  CHECK_FALSE(j[0].ok);
  CHECK(j[0].error == ENOSPC);
  CHECK(j[0].message.find("space") != std::string::npos);
  CHECK(prog.cmd("check") == "ok 2");  // nothing was released
  REQUIRE(prog.cmd("free 2") == "ok");
  auto j2 = node.pause("full");
  INFO(j2.text);
  CHECK(j2.ok());
  auto j3 = node.resume("full");
  CHECK(j3.ok());
  CHECK(prog.cmd("check") == "ok 1");
}

namespace {
// A server on a thread of this process, on the node's root and socket, with injected I/O faults.
struct NodeDaemon : InProcessDaemon {
  NodeDaemon(const Node& node, std::function<int(const io::Request&, int)> fault)
      : InProcessDaemon(config_for(node), std::move(fault)) {}
  static server::Config config_for(const Node& node) {
    server::Config cfg;
    cfg.roots = {node.root};
    cfg.socket_path = node.socket;
    cfg.staging_budget_bytes = 16 * server::kMiB;
    cfg.chunk_bytes = 2 * server::kMiB;
    return cfg;
  }
};
}  // namespace

TEST_CASE("a write error mid-pause is reported - released allocations resume, the rest never left - a retry succeeds") {
  Node node;
  std::atomic<int> writes{0};
  std::atomic<bool> armed{true};
  NodeDaemon d(node, [&](const io::Request& r, int raw) {
    // The 20th chunk written fails once: after the first allocation (16 chunks of 2 MiB) is complete.
    if (r.op == io::Op::Write && writes.fetch_add(1) == 19 && armed.exchange(false)) return -EIO;
    return raw;
  });
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("eio", 0));
  REQUIRE(prog.line() == "ready");
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 1 33554432 direct")).empty());
  REQUIRE_FALSE(ok_addr(prog.cmd("alloc 2 33554432 procaddr")).empty());
  const std::string answer = prog.cmd("api pause");
  CHECK(answer == "err " + std::to_string(EIO));
  REQUIRE(prog.cmd("api resume") == "ok");  // brings back whatever the failed pause had released
  CHECK(prog.cmd("check") == "ok 2");
  REQUIRE(prog.cmd("api pause") == "ok");
  REQUIRE(prog.cmd("api resume") == "ok");
  CHECK(prog.cmd("check") == "ok 2");
}

TEST_CASE("a daemon killed mid-pause: the program keeps its data and resumes through the restarted daemon") {
  Node node;
  node.device_mb = 1024;
  node.start_daemon();
  Proc prog({CUDA_PATTERN_PATH}, node.shim_env("crash", 0));
  REQUIRE(prog.line() == "ready");
  for (int id = 1; id <= 6; ++id)
    REQUIRE_FALSE(ok_addr(prog.cmd("alloc " + std::to_string(id) + " 67108864 direct")).empty());
  auto ctl = ctl::Client::connect(node.socket);
  REQUIRE(ctl);
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  req.match = proto::kMatchJob;
  req.job = "crash";
  bool killed = false;
  auto r = ctl->control(req, [&](const proto::Progress& p) {
    if (!killed && p.done_bytes > 0 && p.done_bytes < p.total_bytes) {
      node.daemon.kill9();
      killed = true;
    }
  });
  if (!killed) skip("the pause finished before it reported progress; nothing was interrupted");
  REQUIRE_FALSE(r);  // the daemon vanished under tmsctl
  node.start_daemon();
  // The shim reconnects with its session token; then resume brings back what the pause released.
  REQUIRE(eventually(
      [&] {
        auto c = ctl::Client::connect(node.socket);
        if (!c) return false;
        auto s = c->list_sessions();
        return s && s->size() == 1;
      },
      std::chrono::seconds(60)));
  auto rj = node.resume("crash");
  INFO(rj.text);
  CHECK(rj.ok());
  CHECK(prog.cmd("check") == "ok 6");
  auto pj = node.pause("crash");
  INFO(pj.text);
  CHECK(pj.ok());
  auto rj2 = node.resume("crash");
  CHECK(rj2.ok());
  CHECK(prog.cmd("check") == "ok 6");
}
