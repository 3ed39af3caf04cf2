// SPDX-License-Identifier: Apache-2.0
// End to end on simcuda: one damaged chunk in a rank's backup does not stop the process.
// A program with two allocations is paused, a byte of one allocation's backup is flipped on disk,
// and `tmsctl resume` then restores the other one: it is usable while the damaged one stays paused,
// named by its address, size and reason in the resume's answer and in `tmsctl status`, until the
// file is repaired and a plain resume restores it bit-exact, or `tmsctl resume --accept-loss`
// replaces it with zeros. The real tmsdiskd verifies the checksums; the real shim holds the calls.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include "disk_faults.h"
#include "e2e.h"

using namespace tmsdisk;
using namespace tmsdisk::e2e;

namespace {

constexpr int kNotPermitted = 800;  // CUDA_ERROR_NOT_PERMITTED: what TMSDISK_ON_TOUCH=fail returns

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The rank's `tmsctl --json status` entry.
json rank_status(const Node& node) {
  auto [rc, out] = node.tmsctl({"status"});
  json j = json::parse(out, nullptr, false);
  REQUIRE(rc == 0);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 1);
  return j[0];
}

// A program with two allocations (8 MiB and 6 MiB, patterned), paused, with one byte of its backup
// flipped in the second chunk (2 MiB chunks) of whichever allocation the data file holds first, and
// resumed: the resume restores one allocation and not the other.
struct DamagedRank {
  Node node;
  std::unique_ptr<Proc> prog;
  std::map<int, std::string> addr;  // allocation id -> "0x..."
  std::string data;                 // the rank's data file
  static constexpr uint64_t kFlipAt = 2 * MiB + 100;
  int damaged = 0, intact = 0;  // allocation ids
  Outcome first_resume;

  explicit DamagedRank(const std::string& on_touch) {
    node.start_daemon();
    Env env = node.shim_env("dmg", 0);
    if (!on_touch.empty()) env["TMSDISK_ON_TOUCH"] = on_touch;
    prog = std::make_unique<Proc>(std::vector<std::string>{CUDA_PATTERN_PATH}, env);
    REQUIRE(prog->line() == "ready");
    addr[1] = ok_addr(prog->cmd("alloc 1 8388608 direct"));
    addr[2] = ok_addr(prog->cmd("alloc 2 6291456 direct"));
    REQUIRE_FALSE(addr[1].empty());
    REQUIRE_FALSE(addr[2].empty());
    auto paused = node.pause(prog->pid());
    INFO(paused.text);
    REQUIRE(paused.ok());

    data = node.rank_dir("dmg", 0, prog->pid()) + "/data";
    flip_byte(data, kFlipAt);
    first_resume = node.resume(prog->pid());
    INFO(first_resume.text);
    REQUIRE_FALSE(first_resume.ok());
    REQUIRE(first_resume.size() == 1);
    // The answer names the damaged allocation as the program knows it: its address.
    for (int id : {1, 2})
      if (first_resume[0].message.find(addr[id] + " ") != std::string::npos) damaged = id;
    REQUIRE(damaged != 0);
    intact = damaged == 1 ? 2 : 1;
    CHECK(first_resume[0].message.find(addr[intact]) == std::string::npos);
  }
  std::string size_text() const { return damaged == 1 ? "8.0 MiB" : "6.0 MiB"; }
  uint64_t size() const { return damaged == 1 ? 8 * MiB : 6 * MiB; }
  std::string id(int n) const { return std::to_string(n); }
};

}  // namespace

TEST_CASE("a damaged chunk: the resume names the lost range, the intact allocation runs, a repaired file restores it") {
  DamagedRank r("");  // TMSDISK_ON_TOUCH unset: wait
  const RankOutcome& first = r.first_resume[0];
  CHECK(first.error == EBADMSG);
  CHECK(first.message.find(r.addr[r.damaged] + " (" + r.size_text() + "; checksum mismatch in chunk 1)") !=
        std::string::npos);
  CHECK(first.message.find("--accept-loss") != std::string::npos);  // and what to do about it
  CHECK(first.message.find("blob") == std::string::npos);           // not the shim's internal id

  // The intact allocation is usable: with the default policy (wait), a copy from it completes.
  r.prog->send("check " + r.id(r.intact));
  CHECK(r.prog->line(30000) == "ok");

  json st = rank_status(r.node);
  INFO(st.dump());
  CHECK(st["state"] == "partially-paused");
  CHECK(st["damaged"]["allocations"] == 1);
  CHECK(st["damaged"]["bytes"] == r.size());
  REQUIRE(st["damaged"]["ranges"].size() == 1);
  CHECK(st["damaged"]["ranges"][0]["address"] == r.addr[r.damaged]);
  CHECK(st["damaged"]["ranges"][0]["size"] == r.size());
  CHECK(st["damaged"]["ranges"][0]["reason"] == "checksum-mismatch");
  CHECK(st["damaged"]["ranges"][0]["chunk"] == 1);
  const Captured table = run_captured({TMSCTL_PATH, "--socket", r.node.socket, "status"}, r.node.sim_env());
  CHECK(table.out.find("damaged: 1 allocation(s), " + r.size_text() + ": " + r.addr[r.damaged] + " (" + r.size_text() +
                       "; checksum mismatch in chunk 1)") != std::string::npos);

  // A pause now would reserve over what can still be saved: refused, naming the damage.
  auto refused = r.node.pause(r.prog->pid());
  INFO(refused.text);
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].error == EBUSY);
  CHECK(refused[0].message.find(r.addr[r.damaged]) != std::string::npos);

  // A copy from the damaged allocation is held (wait) until a resume restores it: the program's
  // answer comes once the repaired file has been read back, with the right bytes.
  r.prog->send("check " + r.id(r.damaged));
  flip_byte(r.data, DamagedRank::kFlipAt);  // repaired
  auto again = r.node.resume(r.prog->pid());
  INFO(again.text);
  REQUIRE(again.ok());
  CHECK(again[0].bytes == r.size());  // the damaged allocation only: the other was resident
  CHECK(r.prog->line(30000) == "ok");
  CHECK(r.prog->cmd("check") == "ok 2");  // bit-exact, both
  st = rank_status(r.node);
  CHECK(st["state"] == "running");
  CHECK(st["damaged"]["allocations"] == 0);
  CHECK(st["damaged"]["ranges"].empty());
  r.prog->cmd("exit");
  CHECK(r.prog->wait() == 0);
}

TEST_CASE("a damaged chunk under TMSDISK_ON_TOUCH=fail: copies from it fail, resume --accept-loss maps zeros") {
  DamagedRank r("fail");
  // Touching the damaged range fails at once; the intact allocation is unaffected.
  CHECK(r.prog->cmd("check " + r.id(r.damaged)) == "err copy " + std::to_string(kNotPermitted));
  CHECK(r.prog->cmd("check " + r.id(r.intact)) == "ok");
  CHECK(rank_status(r.node)["damaged"]["allocations"] == 1);

  // The file is not repaired: the user accepts the loss, and is told so.
  const Captured accepted = run_captured(
      {TMSCTL_PATH, "--socket", r.node.socket, "resume", "--pid", std::to_string(r.prog->pid()), "--accept-loss"},
      r.node.sim_env());
  INFO(accepted.out << accepted.err);
  CHECK(accepted.rc == 0);
  CHECK(accepted.out.find("DATA LOST: 1 allocation(s)") != std::string::npos);
  CHECK(accepted.out.find(r.addr[r.damaged] + " (" + r.size_text() + "; checksum mismatch in chunk 1)") !=
        std::string::npos);

  // Zero-filled memory at the same address, usable again; the intact allocation still holds its data.
  CHECK(r.prog->cmd("zeros " + r.id(r.damaged)) == "ok");
  CHECK(r.prog->cmd("addr " + r.id(r.damaged)) == "ok " + r.addr[r.damaged]);
  CHECK(r.prog->cmd("check " + r.id(r.intact)) == "ok");
  json st = rank_status(r.node);
  INFO(st.dump());
  CHECK(st["state"] == "running");
  CHECK(st["damaged"]["allocations"] == 0);
  CHECK(st["damaged"]["ranges"].empty());
  // Nothing is paused any more, anywhere: the next resume has nothing to do, and a pause works.
  auto noop = r.node.resume(r.prog->pid());
  INFO(noop.text);
  CHECK(noop.ok());
  CHECK(noop[0].outcome == "no-op");
  auto paused = r.node.pause(r.prog->pid());
  INFO(paused.text);
  CHECK(paused.ok());
  r.prog->cmd("exit");
}

TEST_CASE("a damaged chunk under TMSDISK_ON_TOUCH=resume: touching it resumes again, which restores a repaired file") {
  DamagedRank r("resume");
  CHECK(r.prog->cmd("check " + r.id(r.intact)) == "ok");
  // Still damaged: the automatic resume fails once, and so does the call.
  CHECK(r.prog->cmd("check " + r.id(r.damaged)) == "err copy " + std::to_string(kNotPermitted));
  CHECK(rank_status(r.node)["damaged"]["allocations"] == 1);
  flip_byte(r.data, DamagedRank::kFlipAt);  // repaired
  CHECK(r.prog->cmd("check " + r.id(r.damaged)) == "ok");
  const json st = rank_status(r.node);
  CHECK(st["state"] == "running");
  CHECK(st["damaged"]["allocations"] == 0);
  r.prog->cmd("exit");
}

TEST_CASE("freeing the damaged allocation leaves the rank running, and the next resume has nothing left to do") {
  DamagedRank r("");
  REQUIRE(r.prog->cmd("free " + r.id(r.damaged)) == "ok");
  // Nothing is paused any more: the state says so without a resume.
  CHECK(eventually([&] {
    const json st = rank_status(r.node);
    return st["state"] == "running" && st["damaged"]["allocations"] == 0;
  }));
  auto resumed = r.node.resume(r.prog->pid());
  INFO(resumed.text);
  CHECK(resumed.ok());
  CHECK(rank_status(r.node)["state"] == "running");
  CHECK(r.prog->cmd("check") == "ok 1");
  // The daemon no longer holds a pause of this rank: a new pause is not refused as "already paused".
  auto paused = r.node.pause(r.prog->pid());
  INFO(paused.text);
  CHECK(paused.ok());
  CHECK(paused[0].outcome == "done");
  r.prog->cmd("exit");
}

TEST_CASE(
    "a manifest deleted while tmsdiskd was stopped: the resume is refused naming it, the data file and the rank "
    "live on, --accept-loss gives zeros") {
  Node node;
  node.start_daemon();
  Env env = node.shim_env("nomanifest", 0);
  env["TMSDISK_ON_TOUCH"] = "fail";  // touching the memory that stays paused fails at once
  Proc prog({CUDA_PATTERN_PATH}, env);
  REQUIRE(prog.line() == "ready");
  const std::string addr = ok_addr(prog.cmd("alloc 1 8388608 direct"));
  REQUIRE_FALSE(addr.empty());
  auto paused = node.pause(prog.pid());
  INFO(paused.text);
  REQUIRE(paused.ok());
  const std::string dir = node.rank_dir("nomanifest", 0, prog.pid());
  REQUIRE(node.daemon.stop() == 0);
  const std::string data = file_bytes(dir + "/data");
  REQUIRE(data.size() >= 8 * MiB);
  REQUIRE(fs::remove(dir + "/manifest"));
  node.start_daemon();  // on the same root; the shim reconnects with its session token
  REQUIRE(eventually([&] { return node.status().size() == 1; }, std::chrono::seconds(60)));

  // Before, the daemon truncated the data file to 0 bytes here, and the resume said only "blob 1 is
  // not in the reserved set".
  auto resumed = node.resume(prog.pid());
  INFO(resumed.text);
  REQUIRE_FALSE(resumed.ok());
  REQUIRE(resumed.size() == 1);
  const std::string& why = resumed[0].message;
  CHECK(why.find(addr + " (8.0 MiB; chunk 0 is missing from the backup)") != std::string::npos);
  CHECK(why.find("the pause record " + dir + "/manifest is missing") != std::string::npos);
  CHECK(why.find(dir + "/data (" + std::to_string(data.size()) + " bytes) is kept untouched") != std::string::npos);
  CHECK(why.find("--accept-loss") != std::string::npos);
  CHECK(file_bytes(dir + "/data") == data);

  // The program runs on: its paused allocation stays paused (touching it fails, as asked), the rest works.
  CHECK(prog.cmd("check 1") == "err copy " + std::to_string(kNotPermitted));
  CHECK(prog.cmd("addr 1") == "ok " + addr);
  json st = rank_status(node);
  INFO(st.dump());
  CHECK(st["damaged"]["allocations"] == 1);
  REQUIRE(st["damaged"]["ranges"].size() == 1);
  CHECK(st["damaged"]["ranges"][0]["reason"] == "missing");

  // The user gives the memory up: zeros at the same address, and the files serve the next pause.
  const Captured accepted = run_captured(
      {TMSCTL_PATH, "--socket", node.socket, "resume", "--pid", std::to_string(prog.pid()), "--accept-loss"},
      node.sim_env());
  INFO(accepted.out << accepted.err);
  CHECK(accepted.rc == 0);
  CHECK(accepted.out.find("DATA LOST: 1 allocation(s)") != std::string::npos);
  CHECK(prog.cmd("zeros 1") == "ok");
  auto again = node.pause(prog.pid());
  INFO(again.text);
  CHECK(again.ok());
  auto back = node.resume(prog.pid());
  INFO(back.text);
  CHECK(back.ok());
  CHECK(prog.cmd("zeros 1") == "ok");
  prog.cmd("exit");
  CHECK(prog.wait() == 0);
}
