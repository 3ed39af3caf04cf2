// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: legacy CUDA IPC of memory the shim manages, brokered by tmsdiskd.
// One process exports a cuMemAlloc allocation with cuIpcGetMemHandle, another opens and reads it;
// a pause keeps it resident and correct while it is open, and pauses it normally once closed.
#include "e2e.h"

using namespace tmsdisk::e2e;

namespace {

constexpr uint64_t kBytes = 4 * MiB;
// CUresult values the programs print.
constexpr int kInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT: a process opening its own handle
constexpr int kInvalidHandle = 400;   // CUDA_ERROR_INVALID_HANDLE
constexpr int kNotPermitted = 800;    // CUDA_ERROR_NOT_PERMITTED: the exporter is paused

struct Pair {
  Node& node;
  Proc exporter;
  std::string handle;
  std::unique_ptr<Proc> importer;

  // `min_bytes`: the exporter's TMSDISK_MIN_BYTES (at or below kBytes, the shim manages the buffers).
  explicit Pair(Node& n, uint64_t min_bytes = 1 * MiB)
      : node(n), exporter({CUDA_IPC_PATH, "export", std::to_string(kBytes)}, env(n, 0, min_bytes)) {
    const std::string ready = exporter.line();
    INFO(ready);
    REQUIRE(ready.rfind("ready ", 0) == 0);
    handle = ready.substr(6);
  }
  static Env env(const Node& n, int rank, uint64_t min_bytes = 1 * MiB) {
    Env e = n.shim_env("ipc", rank);
    e["TMSDISK_MIN_BYTES"] = std::to_string(min_bytes);
    e["SIMCUDA_DEVICE_COUNT"] = std::to_string(2);
    return e;
  }
  std::string start_importer(int device = 0) {
    Env e = env(node, 1);
    e["CUDA_IPC_DEVICE"] = std::to_string(device);
    importer = std::make_unique<Proc>(std::vector<std::string>{CUDA_IPC_PATH, "import", handle}, e);
    return importer->line();
  }
  // The importer closes the handle and both exit cleanly.
  void close_and_exit() {
    CHECK(importer->cmd("close") == "ok");
    CHECK(importer->cmd("exit") == "ok");
    CHECK(importer->wait() == 0);
    CHECK(exporter.cmd("exit") == "ok");
    CHECK(exporter.wait() == 0);
  }
};

}  // namespace

TEST_CASE("legacy IPC - the importer reads and writes the exporter's memory, which stays resident while open") {
  Node node;
  node.start_daemon();
  Pair p(node);
  CHECK(p.exporter.cmd("selfopen") == "rc " + std::to_string(kInvalidContext));
  REQUIRE(p.start_importer() == "ready");
  CHECK(p.importer->cmd("check shared 1") == "ok");
  CHECK(p.importer->cmd("fill shared 7") == "ok");
  CHECK(p.exporter.cmd("check shared 7") == "ok");  // one memory, two processes

  // Open elsewhere: counted as exported by the exporter, as imported by the importer.
  Totals t;
  CHECK(eventually([&] {
    t = totals(node, p.exporter.pid());
    return t.resident == kBytes && t.unmanaged["exported"] == kBytes;
  }));
  INFO("exporter: " << show(t));
  CHECK(eventually([&] { return totals(node, p.importer->pid()).unmanaged["imported"] == kBytes; }));
  // The table says why, too.
  auto [trc, table] = run({TMSCTL_PATH, "--socket", node.socket, "status"}, node.sim_env());
  INFO(table);
  CHECK(trc == 0);
  CHECK(table.find("unmanaged: exported 4.0 MiB") != std::string::npos);
  CHECK(table.find("unmanaged: imported 4.0 MiB") != std::string::npos);

  // A pause moves the private buffer only; the shared one stays mapped for the importer.
  auto pj = node.pause(p.exporter.pid());
  INFO(pj.text);
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == kBytes);
  CHECK(eventually([&] {
    t = totals(node, p.exporter.pid());
    return t.paused == kBytes && t.resident == 0 && t.unmanaged["exported"] == kBytes;
  }));
  INFO("exporter paused: " << show(t));
  CHECK(p.importer->cmd("check shared 7") == "ok");
  CHECK(p.importer->cmd("fill shared 8") == "ok");

  // Closed: nobody else holds it, so the next pause takes it too.
  CHECK(p.importer->cmd("close") == "ok");
  CHECK(eventually([&] { return totals(node, p.exporter.pid()).unmanaged.count("exported") == 0; }));
  auto rj = node.resume(p.exporter.pid());
  INFO(rj.text);
  REQUIRE(rj.ok());
  CHECK(p.exporter.cmd("check shared 8") == "ok");
  CHECK(p.exporter.cmd("check private 2") == "ok");
  pj = node.pause(p.exporter.pid());
  INFO(pj.text);
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == 2 * kBytes);
  CHECK(eventually([&] { return totals(node, p.exporter.pid()).paused == 2 * kBytes; }));
  // Its memory is on disk now: the handle does not open until the exporter resumes.
  CHECK(p.importer->cmd("open") == "err " + std::to_string(kNotPermitted));

  rj = node.resume(p.exporter.pid());
  INFO(rj.text);
  REQUIRE(rj.ok());
  CHECK(p.exporter.cmd("check shared 8") == "ok");
  CHECK(p.exporter.cmd("check private 2") == "ok");
  // The same handle opens the resumed memory.
  CHECK(p.importer->cmd("open") == "ok");
  CHECK(p.importer->cmd("check shared 8") == "ok");
  CHECK(p.importer->cmd("fill shared 9") == "ok");
  CHECK(p.exporter.cmd("check shared 9") == "ok");
  p.close_and_exit();
}

TEST_CASE(
    "legacy IPC - an importer that dies without closing no longer holds the memory, nor does an exiting exporter") {
  Node node;
  node.start_daemon();
  Pair p(node);
  REQUIRE(p.start_importer() == "ready");
  CHECK(eventually([&] { return totals(node, p.exporter.pid()).unmanaged["exported"] == kBytes; }));
  ::kill(p.importer->pid(), SIGKILL);
  p.importer->wait();
  CHECK(eventually([&] { return totals(node, p.exporter.pid()).unmanaged.count("exported") == 0; }));
  auto pj = node.pause(p.exporter.pid());
  INFO(pj.text);
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == 2 * kBytes);
  auto rj = node.resume(p.exporter.pid());
  INFO(rj.text);
  REQUIRE(rj.ok());
  CHECK(p.exporter.cmd("check shared 1") == "ok");

  // Once the exporter exits, its handle names nothing.
  CHECK(p.exporter.cmd("exit") == "ok");
  CHECK(p.exporter.wait() == 0);
  CHECK(p.start_importer() == "err open " + std::to_string(kInvalidHandle));
}

TEST_CASE("legacy IPC - after a daemon restart, memory shared before stays resident for good and intact") {
  Node node;
  node.start_daemon();
  Pair p(node);
  REQUIRE(p.start_importer() == "ready");
  CHECK(p.importer->cmd("fill shared 5") == "ok");
  node.daemon.kill9();
  node.start_daemon();
  // Both shims reconnect; the new daemon knows nothing of the export, and the importer still maps it.
  REQUIRE(eventually(
      [&] {
        return totals(node, p.exporter.pid()).state == "running" && totals(node, p.importer->pid()).state == "running";
      },
      std::chrono::seconds(60)));
  auto pj = node.pause(p.exporter.pid());
  INFO(pj.text);
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == kBytes);  // the private buffer only
  Totals t;
  CHECK(eventually([&] {
    t = totals(node, p.exporter.pid());
    return t.paused == kBytes && t.unmanaged["exported"] == kBytes;
  }));
  INFO(show(t));
  CHECK(p.importer->cmd("check shared 5") == "ok");
  CHECK(p.importer->cmd("fill shared 6") == "ok");
  auto rj = node.resume(p.exporter.pid());
  INFO(rj.text);
  REQUIRE(rj.ok());
  CHECK(p.exporter.cmd("check shared 6") == "ok");
  CHECK(p.exporter.cmd("check private 2") == "ok");
  // Even with the importer gone, it stays: nobody can tell who else may still map it.
  CHECK(p.importer->cmd("close") == "ok");
  pj = node.pause(p.exporter.pid());
  REQUIRE(pj.ok());
  CHECK(pj[0].bytes == kBytes);
  rj = node.resume(p.exporter.pid());
  REQUIRE(rj.ok());
  CHECK(p.exporter.cmd("exit") == "ok");
  CHECK(p.exporter.wait() == 0);
}

TEST_CASE("legacy IPC - an importer on another device maps the memory for its own device") {
  Node node;
  node.start_daemon();
  Pair p(node);
  REQUIRE(p.start_importer(1) == "ready");
  CHECK(p.importer->cmd("check shared 1") == "ok");
  CHECK(p.importer->cmd("fill shared 3") == "ok");
  CHECK(p.exporter.cmd("check shared 3") == "ok");
  p.close_and_exit();
}

TEST_CASE("legacy IPC - memory below TMSDISK_MIN_BYTES is shared by the driver itself, through both shims") {
  Node node;
  node.start_daemon();
  Pair p(node, 2 * kBytes);  // native allocations: the driver shares them itself
  REQUIRE(p.start_importer() == "ready");
  CHECK(p.importer->cmd("check shared 1") == "ok");
  CHECK(p.importer->cmd("fill shared 4") == "ok");
  CHECK(p.exporter.cmd("check shared 4") == "ok");
  // Nothing went through the daemon: with no memory of its own to manage, the exporter's shim never
  // even opened a session.
  CHECK(totals(node, p.exporter.pid()).state.empty());
  p.close_and_exit();
}
