// SPDX-License-Identifier: Apache-2.0
// Adversarial suite, family 4: the node's host tier against clients that do not play by its rules.
//
// Host-tier memory is a memfd whose pages tmsdiskd faulted in (charged to the daemon, counted against
// host-tier-mb). A client that keeps its descriptor or mapping after the daemon stops counting it
// (TIER_RELEASE, or a session closed) must be left with nothing the daemon paid for; TIER_ADOPT, after
// a restart, counts only what the rank's own records say it was granted, once per memfd; and one
// user's many ranks cannot take another user's part of the budget.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "adversarial.h"
#include "other_user.h"

using namespace tmsdisk;
using namespace tmsdisk::adversarial;

namespace {

constexpr uint32_t kChunk = 1 * MiB;

// Bytes of pages the file behind `fd` holds now.
uint64_t pages_of(int fd) {
  struct stat st {};
  REQUIRE(::fstat(fd, &st) == 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

// TIER_ASK on `c`: the grant's bytes, its memfd in `*memory`.
uint64_t ask(ShimClient& c, uint64_t bytes, UniqueFd* memory, uint8_t flags = 0) {
  auto r = c.call(proto::TierAsk{.bytes = bytes, .flags = flags}, -1, memory);
  INFO((r ? "" : r.error().describe()));
  REQUIRE(r);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*r));
  return std::get<proto::TierGrant>(*r).bytes;
}

uint64_t tier_used(const Daemon& d) {
  ctl::Client::HostTier node;
  auto listed = d.control().list_sessions(ctl::Deadline::fixed(ctl::kAnswerLimit), &node);
  REQUIRE(listed);
  return node.used_bytes;
}

// A memfd made to look like host-tier memory (name and seals), `bytes` of it faulted in by this process.
UniqueFd forged_tier_memory(uint64_t bytes) {
  UniqueFd fd(::memfd_create("tmsdisk-host-tier", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(fd);
  REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  std::vector<uint8_t> page(4096, 0x5a);
  for (uint64_t off = 0; off < bytes; off += page.size())
    REQUIRE(::pwrite(fd.get(), page.data(), page.size(), static_cast<off_t>(off)) == 4096);
  REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
  return fd;
}

// A committed pause whose one blob of `bytes` lies wholly in the rank's host tier (nothing written).
void pause_into_host_tier(ShimClient& c, uint64_t bytes) {
  proto::Reserve r;
  r.flags = proto::kReserveFirst | proto::kReserveLast;
  r.blobs = {{1, bytes}};
  r.host_runs = {{.blob = 1, .first_chunk = 0, .count = bytes / kChunk}};
  auto reserved = c.call(r);
  INFO((reserved ? "" : reserved.error().describe()));
  REQUIRE(reserved);
  REQUIRE(c.commit(proto::CommitState::Paused));
}

int errnum_of(const Result<proto::Message>& r) {
  return r ? 0 : r.error().errnum();
}

}  // namespace

TEST_CASE(
    "host-tier memory a client keeps after TIER_RELEASE or after closing its session holds no page of the daemon's") {
  // The attack: connect / TIER_ASK / close, and TIER_ASK / TIER_RELEASE, keeping every memfd and
  // mapping. Before, the daemon stopped counting and the client held all the pages, charged to the
  // daemon: past the budget, past the client's own cgroup.
  Daemon d(kSmallSessions);
  d.start({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  std::vector<UniqueFd> kept;
  std::vector<std::pair<uint8_t*, uint64_t>> maps;
  auto keep_mapped = [&](UniqueFd fd, uint64_t bytes) {
    REQUIRE(pages_of(fd.get()) >= bytes);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(p != MAP_FAILED);
    static_cast<uint8_t*>(p)[0] = 0x77;
    maps.emplace_back(static_cast<uint8_t*>(p), bytes);
    kept.push_back(std::move(fd));
  };
  for (int i = 0; i < 4; ++i) {
    auto c = d.shim({.job = "closer", .rank = i});
    UniqueFd memory;
    const uint64_t got = ask(c, 16 * MiB, &memory);
    REQUIRE(got == 16 * MiB);
    keep_mapped(std::move(memory), got);
    c.close();
  }
  auto c = d.shim({.job = "releaser"});
  for (int i = 0; i < 3; ++i) {
    UniqueFd memory;
    const uint64_t got = ask(c, 16 * MiB, &memory);
    REQUIRE(got == 16 * MiB);
    keep_mapped(std::move(memory), got);
    REQUIRE(c.call(proto::TierRelease{}));
  }
  CHECK(eventually([&] { return tier_used(d) == 0; }));
  // Taken back: every page of every memfd the client kept is gone (punched by the daemon's worker),
  // and its mappings read fresh zero pages (its own, if it touches them).
  for (std::size_t i = 0; i < kept.size(); ++i) {
    INFO("memfd " << i);
    CHECK(eventually([&] { return pages_of(kept[i].get()) == 0; }));
    CHECK(maps[i].first[0] == 0);
  }
  for (auto& [p, n] : maps) ::munmap(p, n);
  d.check_serving();
}

TEST_CASE("TIER_ADOPT counts only memory an earlier daemon's records vouch for, once per memfd") {
  Daemon d(kSmallSessions);
  d.start({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  // Not after a restart: this daemon counts what it granted itself; a forged memfd is refused.
  {
    auto fresh = d.shim({.job = "fresh"});
    UniqueFd forged = forged_tier_memory(8 * MiB);
    auto r = fresh.call(proto::TierAdopt{}, forged.get());
    CHECK(errnum_of(r) == EPERM);
    CHECK(tier_used(d) == 0);
  }
  // Two ranks pause into their host tier; the daemon restarts.
  auto a = d.shim({.job = "adopt", .rank = 0});
  auto b = d.shim({.job = "adopt", .rank = 1});
  const uint64_t token_a = a.welcome().token, token_b = b.welcome().token;
  UniqueFd memory_a, memory_b;
  REQUIRE(ask(a, 16 * MiB, &memory_a) == 16 * MiB);
  REQUIRE(ask(b, 8 * MiB, &memory_b) == 8 * MiB);
  pause_into_host_tier(a, 16 * MiB);
  pause_into_host_tier(b, 8 * MiB);
  REQUIRE(d.proc.stop() == 0);
  a.close();
  b.close();
  d.start({"--host-tier-mb", "64", "--host-tier-ahead=false"});
  auto a2 = d.shim({.job = "adopt", .rank = 0, .token = token_a});
  auto b2 = d.shim({.job = "adopt", .rank = 1, .token = token_b});
  REQUIRE(a2.welcome().restored == 1);
  REQUIRE(b2.welcome().restored == 1);

  // Its own memory: counted, once.
  auto adopted = a2.call(proto::TierAdopt{}, memory_a.get());
  INFO((adopted ? "" : adopted.error().describe()));
  CHECK(adopted);
  CHECK(tier_used(d) == 16 * MiB);
  CHECK(errnum_of(a2.call(proto::TierAdopt{}, memory_a.get())) == EBUSY);
  // Another rank's memory: refused, counted once already.
  CHECK(errnum_of(b2.call(proto::TierAdopt{}, memory_a.get())) == EEXIST);
  // A forged memfd with fewer pages than b's records keep there: refused.
  UniqueFd small = forged_tier_memory(4 * MiB);
  CHECK(errnum_of(b2.call(proto::TierAdopt{}, small.get())) == EINVAL);
  // One larger than its records: counted only as much as they keep (8 MiB), not its 32.
  UniqueFd large = forged_tier_memory(32 * MiB);
  REQUIRE(b2.call(proto::TierAdopt{}, large.get()));
  CHECK(tier_used(d) == 24 * MiB);
  auto listed = d.control().list_sessions();
  REQUIRE(listed);
  for (const auto& s : *listed) CHECK(s.host_tier_bytes == (s.rank == 0 ? 16 * MiB : 8 * MiB));
}

TEST_CASE("one user's many idle ranks give way to another user's pause: the budget is split between users first") {
  if (::geteuid() != 0) skip("needs root to act as a second user (other_user.h)");
  Daemon d(kSmallSessions);
  d.start({"--host-tier-mb", "256"});  // keep and ahead on (the defaults)
  // Sixteen ranks of root's take the whole budget ahead of their pauses and keep it, idle.
  std::vector<ShimClient> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(d.shim({.job = "idle", .rank = i}));
  std::vector<UniqueFd> memories;
  for (auto& c : idle) {
    UniqueFd memory;
    REQUIRE(ask(c, 64 * MiB, &memory, proto::kTierAskAhead) == 16 * MiB);
    memories.push_back(std::move(memory));
  }
  REQUIRE(tier_used(d) == 256 * MiB);

  // Another user's rank pauses: its user's part is half the budget, and root's kept memory is asked
  // back for it. The child reports what it was granted, in MiB, as its exit status.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(1);
    auto c = d.try_shim({.job = "pausing"});
    if (!c) ::_exit(c.error().errnum() == EACCES ? kUnreachable : 3);
    auto r = c->call(proto::TierAsk{.bytes = 256 * MiB, .flags = 0});
    if (!r || !std::holds_alternative<proto::TierGrant>(*r)) ::_exit(2);
    ::_exit(static_cast<int>(std::get<proto::TierGrant>(*r).bytes / MiB));
  }
  // Root's ranks do what a shim does when asked back: release.
  int released = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::vector<pollfd> fds;
    for (auto& c : idle) fds.push_back({c.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
    for (std::size_t i = 0; i < idle.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      auto m = idle[i].receive();
      REQUIRE(m);
      if (!std::holds_alternative<proto::TierReclaim>(m->body)) continue;
      memories[i].reset();
      REQUIRE(idle[i].call(proto::TierRelease{}));
      ++released;
    }
  }
  if (done == 0) done = ::waitpid(child, &status, 0);
  REQUIRE(done == child);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == kUnreachable) skip("uid 65534 cannot reach the test socket");
  INFO("released by root's ranks: " << released);
  CHECK(WEXITSTATUS(status) == 128);
  CHECK(released == 8);
}
