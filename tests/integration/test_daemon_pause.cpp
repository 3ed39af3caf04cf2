// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, a pause and a resume through the daemon: striping, the pause state a manifest holds, sets
// that replace one another, and chunks that need not move (README.md, "What moves").
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "daemon_fixture.h"
#include "disk_faults.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

const std::vector<BlobSize> kBlobs = {{1, 160 * MiB}, {2, 100 * MiB + 12345}, {3, 3 * 4096 + 1}, {4, 40 * MiB}};

// A READ of the first 4 MiB of `blob` is refused (the blob is not in the stored set).
bool read_of_first_chunk_refused(ShimClient& c, uint64_t blob) {
  proto::Read gone;
  gone.slot = 0;
  gone.length = 4 * MiB;
  gone.blob = blob;
  return expect_error(c, gone) != 0;
}

// WRITEs chunk `off` of `blob` (4 MiB chunks) from slot 0 filled with the pattern: the WRITTEN, or the error.
Result<proto::Written> write_one(ShimClient& c, uint64_t blob, uint64_t off) {
  fill_pattern(blob, off, c.slot(0), 4 * MiB);
  auto r = c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = blob, .offset = off}});
  if (!r) return std::move(r).error();
  if (!std::holds_alternative<proto::Written>(*r)) return make_error(EPROTO, "WRITE answered with something else");
  return std::get<proto::Written>(*r);
}

struct timespec mtime_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mtim;
}

}  // namespace

TEST_CASE("round trip of a few hundred MiB striped over two roots, repeated pauses keep disk usage constant") {
  Daemon d(2);
  d.start();
  auto c = d.shim({.job = "rt", .rank = 3});
  REQUIRE(c.welcome().slot_count == 8);
  const std::string dir0 = d.rank_dir(0, "rt", 3, ::getpid());
  const std::string dir1 = d.rank_dir(1, "rt", 3, ::getpid());
  CHECK(c.welcome().rank_dir == dir0);

  uint64_t usage = 0;
  for (int cycle = 1; cycle <= 3; ++cycle) {
    REQUIRE(c.reserve(kBlobs));
    auto w = c.write_all(kBlobs, fill_pattern);
    INFO((w ? "" : w.error().describe()));
    REQUIRE(w);
    REQUIRE(c.commit(proto::CommitState::Paused));
    CHECK(fs::exists(dir0 + "/data"));
    CHECK(fs::exists(dir1 + "/data"));
    CHECK(fs::exists(dir0 + "/manifest"));
    struct stat st {};
    REQUIRE(::stat(dir0.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    const uint64_t now = dir_bytes(dir0) + dir_bytes(dir1);
    if (cycle == 1) usage = now;
    CHECK(now == usage);  // files are overwritten in place, never grown by a repeat
    auto r = c.read_all(kBlobs, check_pattern);
    INFO((r ? "" : r.error().describe()));
    REQUIRE(r);
    REQUIRE(c.commit(proto::CommitState::Resumed));
  }
  uint64_t total = 0;
  for (auto& b : kBlobs) total += b.size;
  CHECK(usage >= total);

  c.close();
  CHECK(eventually([&] { return d.session_count() == 0; }));
  CHECK(!fs::exists(dir0));
  CHECK(!fs::exists(dir1));
}

TEST_CASE("the manifest is the one pause state: the daemon numbers pauses, answers PAUSE_STATE, refuses a new set") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "owner", .rank = 2});
  const uint64_t token = c.welcome().token;
  auto state = [](ShimClient& s) {
    auto r = s.call(proto::PauseState{});
    REQUIRE(r);
    REQUIRE(std::holds_alternative<proto::PauseStateReply>(*r));
    return std::get<proto::PauseStateReply>(*r);
  };
  CHECK(state(c).paused == 0);
  CHECK(state(c).generation == 0);
  const std::vector<BlobSize> blobs = {{1, 8 * MiB + 17}};
  for (uint64_t generation = 1; generation <= 2; ++generation) {
    REQUIRE(c.reserve(blobs));
    REQUIRE(c.write_all(blobs, fill_pattern));
    CHECK(state(c).paused == 0);  // written, not committed
    REQUIRE(c.commit(proto::CommitState::Paused));
    CHECK(state(c).paused == 1);
    CHECK(state(c).generation == generation);
    if (generation == 2) break;
    REQUIRE(c.read_all(blobs, check_pattern));
    REQUIRE(c.commit(proto::CommitState::Resumed));
    CHECK(state(c).paused == 0);
    CHECK(state(c).generation == generation);  // a resume keeps the number of the pause it ended
  }
  // While the committed pause holds the only copy, a new set is refused, and says why.
  auto busy = c.call(proto::Reserve{.flags = proto::kReserveFirst | proto::kReserveLast, .blobs = blobs});
  REQUIRE_FALSE(busy);
  CHECK(busy.error().errnum() == EBUSY);
  CHECK_THAT(busy.error().message, Catch::Contains("committed pause"));

  // A daemon restart keeps it: the manifest, not the rank, says what is paused.
  d.proc.kill9();
  c.close();
  d.start();
  auto again = d.shim({.job = "owner", .rank = 2, .token = token});
  CHECK(again.welcome().restored == 1);
  CHECK(state(again).paused == 1);
  CHECK(state(again).generation == 2);
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
  CHECK(state(again).paused == 0);
  REQUIRE(again.reserve(blobs));
}

TEST_CASE("a committed pause gives way to a set that carries it: two parts paused one after another, resumed apart") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "carry", .rank = 0});
  const uint64_t token = c.welcome().token;
  auto reserve = [&](std::vector<BlobSize> blobs, std::vector<uint64_t> carry) {
    return c.call(proto::Reserve{
        .flags = proto::kReserveFirst | proto::kReserveLast, .blobs = std::move(blobs), .carry = std::move(carry)});
  };
  const std::vector<BlobSize> a = {{1, 8 * MiB + 17}}, b = {{2, 6 * MiB}};
  const std::vector<BlobSize> both = {{1, 8 * MiB + 17}, {2, 6 * MiB}};
  // Part A pauses and commits; part B pauses after it, carrying A (which is not written again).
  REQUIRE(c.reserve(a));
  REQUIRE(c.write_all(a, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  auto refused = reserve(both, {});
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EBUSY);
  auto carried = reserve(both, {1});
  INFO((carried ? std::string() : carried.error().describe()));
  REQUIRE(carried);
  REQUIRE(c.write_all(b, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  // Through a daemon restart, both parts are there.
  d.proc.kill9();
  c.close();
  d.start();
  c = d.shim({.job = "carry", .rank = 0, .token = token});
  REQUIRE(c.welcome().restored == 1);
  // A resumes alone: read back, then B carried on its own and committed paused again.
  REQUIRE(c.read_all(a, check_pattern));
  REQUIRE(reserve(b, {2}));
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(b, check_pattern));
  CHECK(read_of_first_chunk_refused(c, 1));  // A's extents went back with its resume
  REQUIRE(c.commit(proto::CommitState::Resumed));
  // A carried blob must be one the store holds, whole: refused otherwise.
  auto unknown = reserve(both, {3});
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().errnum() == EINVAL);
}

TEST_CASE("a smaller set after a larger one recycles extents and drops vanished blobs") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "shrink"});
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  std::vector<BlobSize> fewer = {{2, 100 * MiB + 12345}, {5, 8 * MiB}};
  REQUIRE(c.reserve(fewer));
  REQUIRE(c.write_all(fewer, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(fewer, check_pattern));
  CHECK(read_of_first_chunk_refused(c, 1));
}

TEST_CASE("zero chunks are neither written nor read, and a pause of unchanged bytes writes nothing, across a restart") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "skip", .rank = 0});
  const uint64_t token = c.welcome().token;
  // Blob 1: chunks 1 and 2 (of 4) are zero; blob 2: all data.
  const std::vector<BlobSize> blobs = {{1, 16 * MiB}, {2, 8 * MiB}};
  const std::vector<proto::ChunkRun> zero = {{1, 1, 2}};
  const std::string dir = d.rank_dir(0, "skip", 0, ::getpid());
  // Pauses and returns how many chunks were unchanged; *reserved gets the data file's mtime once the
  // reservation (which punches the zero chunks' ranges) is made.
  auto pause = [&](ShimClient& s, struct timespec* reserved = nullptr) {
    REQUIRE(s.reserve(blobs, zero));
    if (reserved) *reserved = mtime_of(dir + "/data");
    int unchanged = 0;
    for (const auto& [blob, off] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {1, 12 * MiB}, {2, 0}, {2, 4 * MiB}}) {
      auto w = write_one(s, blob, off);
      INFO((w ? "" : w.error().describe()));
      REQUIRE(w);
      unchanged += w->unchanged;
    }
    REQUIRE(s.commit(proto::CommitState::Paused));
    return unchanged;
  };
  auto resume = [&](ShimClient& s) {
    for (const auto& [blob, off] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {1, 12 * MiB}, {2, 0}, {2, 4 * MiB}}) {
      auto r = s.call(proto::Read{{.slot = 0, .length = 4 * MiB, .blob = blob, .offset = off}});
      INFO((r ? "" : r.error().describe()));
      REQUIRE(r);
      CHECK(check_pattern(blob, off, s.slot(0), 4 * MiB));
    }
    REQUIRE(s.commit(proto::CommitState::Resumed));
  };

  CHECK(pause(c) == 0);
  // A zero chunk has nothing stored: a WRITE or READ of it is refused, saying so.
  for (const proto::Message& m :
       {proto::Message{proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = 4 * MiB}}},
        proto::Message{proto::Read{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = 8 * MiB}}}}) {
    auto refused = c.call(m);
    REQUIRE_FALSE(refused);
    CHECK(refused.error().errnum() == EINVAL);
    CHECK_THAT(refused.error().describe(), Catch::Contains("reserved as zero"));
  }
  struct stat st {};
  REQUIRE(::stat((dir + "/data").c_str(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 < 20 * MiB);  // 16 MiB of data, not 24
  resume(c);

  // The same bytes again: every chunk is answered unchanged and the data file is not written.
  struct timespec before {};
  CHECK(pause(c, &before) == 4);
  const auto after = mtime_of(dir + "/data");
  CHECK((after.tv_sec == before.tv_sec && after.tv_nsec == before.tv_nsec));
  resume(c);

  // A daemon restarted after the resume adopts the committed manifest: still unchanged.
  CHECK(d.proc.stop() == 0);
  c.close();
  d.start();
  auto again = d.shim({.job = "skip", .rank = 0, .token = token});
  CHECK(pause(again) == 4);
  resume(again);

  // Restarted mid-pause: nothing is provably held, every chunk is rewritten.
  REQUIRE(again.reserve(blobs, zero));
  CHECK(d.proc.stop() == 0);
  again.close();
  d.start();
  auto third = d.shim({.job = "skip", .rank = 0, .token = token});
  CHECK(pause(third) == 0);
  resume(third);
}

TEST_CASE("a data file changed outside tmsdiskd while the memory is resident is written again, across a restart too") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "damaged", .rank = 0});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 16 * MiB}};
  const std::string data = d.rank_dir(0, "damaged", 0, ::getpid()) + "/data";
  // Pauses all four chunks and returns how many were unchanged; resumes them, each verified.
  auto pause = [&](ShimClient& s) {
    REQUIRE(s.reserve(blobs));
    int unchanged = 0;
    for (uint64_t off = 0; off < 16 * MiB; off += 4 * MiB) {
      auto w = write_one(s, 1, off);
      INFO((w ? "" : w.error().describe()));
      REQUIRE(w);
      unchanged += w->unchanged;
    }
    REQUIRE(s.commit(proto::CommitState::Paused));
    return unchanged;
  };
  auto resume = [&](ShimClient& s) {
    for (uint64_t off = 0; off < 16 * MiB; off += 4 * MiB) {
      auto r = s.call(proto::Read{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}});
      INFO((r ? "" : r.error().describe()));
      REQUIRE(r);
      CHECK(check_pattern(1, off, s.slot(0), 4 * MiB));
    }
    REQUIRE(s.commit(proto::CommitState::Resumed));
  };
  CHECK(pause(c) == 0);
  resume(c);
  CHECK(pause(c) == 4);
  resume(c);

  // A byte flipped while the memory is resident: the next pause writes the file's chunks again.
  flip_byte(data, 4 * MiB + 100, 0x01);
  CHECK(pause(c) == 0);
  resume(c);

  // The same across a restart: the manifest's word is not enough.
  flip_byte(data, 8 * MiB + 100, 0x01);
  CHECK(d.proc.stop() == 0);
  c.close();
  d.start();
  auto again = d.shim({.job = "damaged", .rank = 0, .token = token});
  CHECK(pause(again) == 0);
  resume(again);
  CHECK(pause(again) == 4);  // rewritten and committed: trusted again
  resume(again);

  // Another file put in its place (a copy, one byte flipped) while the daemon is down.
  CHECK(d.proc.stop() == 0);
  again.close();
  {
    std::ifstream in(data, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() >= 16 * MiB);
    bytes[12 * MiB + 100] = static_cast<char>(bytes[12 * MiB + 100] ^ 0x01);
    std::ofstream(data + ".new", std::ios::binary) << bytes;
    REQUIRE(::rename((data + ".new").c_str(), data.c_str()) == 0);
  }
  d.start();
  auto third = d.shim({.job = "damaged", .rank = 0, .token = token});
  CHECK(pause(third) == 0);
  resume(third);

  // Another file put in its place while the daemon runs: the next pause writes to the file at that
  // name, not to the one the daemon had open, so a daemon restarted while the rank is paused finds
  // what it paused.
  {
    std::ifstream in(data, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() >= 16 * MiB);
    bytes[100] = static_cast<char>(bytes[100] ^ 0x01);
    std::ofstream(data + ".new", std::ios::binary) << bytes;
    REQUIRE(::rename((data + ".new").c_str(), data.c_str()) == 0);
  }
  CHECK(pause(third) == 0);
  CHECK(d.proc.stop() == 0);
  third.close();
  d.start();
  auto fourth = d.shim({.job = "damaged", .rank = 0, .token = token});
  resume(fourth);
}
