// SPDX-License-Identifier: Apache-2.0
// The daemon's host tier (daemon/server/host_tier.h): how much of the node's budget a rank gets, what
// the node can spare (MemAvailable, cgroup limits, over fake /proc and /sys files), and the memory
// itself: made sealed with its pages faulted in, and recognized (or not) when a rank hands it back.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "host_tier.h"
#include "sizes.h"
#include "temp_dir.h"

using namespace tmsdisk;
using namespace tmsdisk::server;
using tmsdisk::testing::GiB;
using tmsdisk::testing::MiB;
using tmsdisk::testing::TempDir;
using tmsdisk::testing::test_tmp_root;
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kChunk = 8 * MiB;

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

}  // namespace

TEST_CASE("a grant is the smallest of the ask, the fair share, what is left and what the node can spare") {
  const SpareMemory plenty{};
  const uint64_t budget = 16 * GiB;
  // Alone on the node: all it asks, in whole chunks (rounded up).
  TierPlan p = plan_grant(100 * MiB + 1, kChunk, budget, 0, fair_share(budget, 1, 1), plenty);
  CHECK(p.bytes == 104 * MiB);
  CHECK(p.note.empty());
  // Four ranks, a budget for two: each gets a quarter, and the note says why.
  p = plan_grant(8 * GiB, kChunk, budget, 0, fair_share(budget, 1, 4), plenty);
  CHECK(p.bytes == 4 * GiB);
  CHECK(p.note.find("fair share") != std::string::npos);
  // What other ranks hold is not granted again.
  p = plan_grant(8 * GiB, kChunk, budget, 14 * GiB, fair_share(budget, 1, 2), plenty);
  CHECK(p.bytes == 2 * GiB);
  CHECK(p.note.find("other ranks hold") != std::string::npos);
  p = plan_grant(8 * GiB, kChunk, budget, 17 * GiB, fair_share(budget, 1, 2), plenty);  // over it after adoptions
  CHECK(p.bytes == 0);
  // Off: nothing, and the note says which setting.
  p = plan_grant(8 * GiB, kChunk, 0, 0, fair_share(0, 1, 1), plenty);
  CHECK(p.bytes == 0);
  CHECK(p.note.find("host-tier-mb") != std::string::npos);
}

TEST_CASE("the budget is split between users first, then between each user's ranks") {
  const uint64_t budget = 256 * MiB;
  // Sixteen ranks of one user and one of another: the lone rank's user has half, not a seventeenth.
  CHECK(fair_share(budget, 2, 1).bytes == 128 * MiB);
  CHECK(fair_share(budget, 2, 16).bytes == 8 * MiB);
  // One user alone splits the whole budget between its ranks, as before.
  CHECK(fair_share(budget, 1, 16).bytes == 16 * MiB);
  const TierPlan p = plan_grant(256 * MiB, kChunk, budget, 0, fair_share(budget, 2, 1), SpareMemory{});
  CHECK(p.bytes == 128 * MiB);
  CHECK(p.note.find("2 users") != std::string::npos);
}

TEST_CASE("a budget larger than the memory the node can spare grants only what it can spare, in whole chunks") {
  const SpareMemory scarce{.bytes = 3 * GiB + 5 * MiB, .limited_by = "MemAvailable"};
  const uint64_t budget = 1024 * GiB;
  TierPlan p = plan_grant(64 * GiB, kChunk, budget, 0, fair_share(budget, 1, 1), scarce);
  CHECK(p.bytes == 3 * GiB);
  CHECK(p.note.find("MemAvailable") != std::string::npos);
  CHECK(plan_grant(64 * GiB, kChunk, budget, 0, fair_share(budget, 1, 1), SpareMemory{.bytes = MiB, .limited_by = "x"})
            .bytes == 0);
}

TEST_CASE("the node's spare memory: MemAvailable less what the tier always leaves, and every cgroup's headroom") {
  TempDir dir{test_tmp_root(), "host-tier"};
  const fs::path meminfo = fs::path(dir.path()) / "meminfo";
  write_file(meminfo, "MemTotal:       104857600 kB\nMemFree:        1000 kB\nMemAvailable:   52428800 kB\n");
  const fs::path self = fs::path(dir.path()) / "cgroup";
  const fs::path root = fs::path(dir.path()) / "sys";

  // No cgroup file: MemAvailable (50 GiB) less 5% of 100 GiB.
  SpareMemory s = spare_memory(meminfo, (fs::path(dir.path()) / "absent").string(), root.string());
  CHECK(s.bytes == 50 * GiB - 5 * GiB);
  CHECK(s.limited_by == "MemAvailable");

  // A service cgroup without a limit under a slice with one: the slice's headroom, less the margin.
  write_file(self, "0::/system.slice/tmsdiskd.service\n");
  write_file(root / "system.slice/tmsdiskd.service/memory.max", "max\n");
  write_file(root / "system.slice/tmsdiskd.service/memory.current", "1000\n");
  write_file(root / "system.slice/memory.max", std::to_string(10 * GiB) + "\n");
  write_file(root / "system.slice/memory.current", std::to_string(2 * GiB) + "\n");
  s = spare_memory(meminfo, self.string(), root.string());
  CHECK(s.bytes == 8 * GiB - 64 * MiB);
  CHECK(s.limited_by.find("/system.slice") != std::string::npos);

  // A tighter limit on the service itself wins.
  write_file(root / "system.slice/tmsdiskd.service/memory.max", std::to_string(GiB) + "\n");
  s = spare_memory(meminfo, self.string(), root.string());
  CHECK(s.bytes == GiB - 1000 - 64 * MiB);
  CHECK(s.limited_by.find("tmsdiskd.service") != std::string::npos);

  // Used up: nothing to spare, never a wrapped-around number.
  write_file(root / "system.slice/tmsdiskd.service/memory.current", std::to_string(GiB) + "\n");
  CHECK(spare_memory(meminfo, self.string(), root.string()).bytes == 0);
}

TEST_CASE("tier memory is sealed with its pages in; handed back, it is recognized and counted by its pages") {
  auto made = make_tier_memory(3 * MiB);
  REQUIRE(made);
  const int fd = made->get();
  struct stat st {};
  REQUIRE(::fstat(fd, &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_size) == 3 * MiB);
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 >= 3 * MiB);  // faulted in by the daemon
  const int seals = ::fcntl(fd, F_GET_SEALS);
  CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));
  CHECK(::ftruncate(fd, static_cast<off_t>(64 * MiB)) != 0);  // a rank cannot grow what the budget counts
  auto bytes = tier_memory_bytes(fd);
  REQUIRE(bytes);
  CHECK(*bytes == 3 * MiB);

  // Anything else is refused: a plain file, an unsealed memfd of another name.
  UniqueFd other(::memfd_create("something-else", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(other);
  REQUIRE(::ftruncate(other.get(), static_cast<off_t>(MiB)) == 0);
  CHECK(tier_memory_bytes(other.get()).error().errnum() == EINVAL);
  UniqueFd file(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  CHECK(tier_memory_bytes(file.get()).error().errnum() == EINVAL);

  // A sparse memfd of the right name and seals claims only the pages it holds, not its size.
  UniqueFd sparse(::memfd_create("tmsdisk-host-tier", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(sparse);
  REQUIRE(::ftruncate(sparse.get(), static_cast<off_t>(GiB)) == 0);
  REQUIRE(::fcntl(sparse.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  auto claimed = tier_memory_bytes(sparse.get());
  REQUIRE(claimed);
  CHECK(*claimed == 0);
}

TEST_CASE("host-tier memory taken back leaves nothing to a holder that kept a mapping and a descriptor") {
  // What a rank (or an attacker) could keep after its grant stops counting: the daemon's punch frees
  // the pages it faulted in, and the holder's mapping then sees fresh zero pages of its own.
  auto made = make_tier_memory(4 * MiB);
  REQUIRE(made);
  UniqueFd kept(::fcntl(made->get(), F_DUPFD_CLOEXEC, 0));
  REQUIRE(kept);
  void* p = ::mmap(nullptr, 4 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, kept.get(), 0);
  REQUIRE(p != MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(p);
  bytes[0] = 0xab;
  bytes[4 * MiB - 1] = 0xcd;
  struct stat st {};
  REQUIRE(::fstat(kept.get(), &st) == 0);
  REQUIRE(static_cast<uint64_t>(st.st_blocks) * 512 >= 4 * MiB);

  auto held = hold_tier_memory(std::move(made.value()), 4 * MiB);
  REQUIRE(held);
  REQUIRE(held->bytes == 4 * MiB);
  auto revoked = revoke_tier_memory(*held);
  INFO((revoked ? "" : revoked.error().describe()));
  CHECK(revoked);
  CHECK(held->bytes == 0);
  CHECK_FALSE(held->fd);
  REQUIRE(::fstat(kept.get(), &st) == 0);
  CHECK(st.st_blocks == 0);
  CHECK(bytes[0] == 0);
  CHECK(bytes[4 * MiB - 1] == 0);
  ::munmap(p, 4 * MiB);
}
