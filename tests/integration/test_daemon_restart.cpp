// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, a daemon restart over a rank's files: the manifest and checksums it finds (version 1
// included), chunks acknowledged before it died, and files damaged or deleted while it was down.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>

#include "daemon_fixture.h"
#include "disk_faults.h"
#include "manifest_v1.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

// The bytes of a file, to show that nothing in it changed.
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

proto::Read read_of(uint64_t blob, uint64_t offset, uint32_t length) {
  proto::Read rd;
  rd.slot = 1;
  rd.length = length;
  rd.blob = blob;
  rd.offset = offset;
  return rd;
}

// A rank (job "lost", rank 3) pauses blob 4 and the daemon stops; `damage` does what it does to the
// rank's directory while no daemon runs; the daemon starts on the same roots and the rank reconnects
// with its token, as the shim does. `data` receives the data file's bytes before the damage.
ShimClient paused_rank_after_restart(Daemon& d, const std::function<void(const std::string& dir)>& damage,
                                     std::string& data) {
  d.start();
  auto c = d.shim({.job = "lost", .rank = 3});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{4, 12 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  data = file_bytes(dir + "/data");
  REQUIRE(data.size() >= 12 * MiB);
  damage(dir);
  d.start();
  return d.shim({.job = "lost", .rank = 3, .token = token});
}

// What every use of a rank's files with a lost record gets: its resume, a new pause and a pause
// commit are refused with `what` (the file and why) and the way out; the data file is untouched.
void check_refused_and_kept(Daemon& d, ShimClient& rank, const std::string& what, const std::string& data) {
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  const std::string kept = dir + "/data (" + std::to_string(data.size()) + " bytes) is kept untouched";
  // The resume: its first READ. It used to find the data file truncated to 0 bytes and said only
  // "blob 4 is not in the reserved set".
  auto read = rank.call(read_of(4, 0, 4 * MiB));
  REQUIRE_FALSE(read);
  INFO(read.error().message);
  CHECK(read.error().errnum() == EUCLEAN);  // the shim counts the allocation as damaged (missing)
  CHECK_THAT(read.error().message,
             Catch::StartsWith(what) && Catch::Contains(kept) && Catch::Contains("--accept-loss"));
  // Asked whether to resume first, the daemon says so: a rank with every allocation resident closes
  // the record by committing a resume; one with paused memory resumes, and is refused as above.
  auto state = rank.call(proto::PauseState{});
  REQUIRE(state);
  CHECK(std::get<proto::PauseStateReply>(*state).paused == 1);
  // A new set would truncate and punch the data file.
  auto reserve = rank.reserve({{4, 12 * MiB}});
  REQUIRE_FALSE(reserve);
  CHECK(reserve.error().errnum() == EBUSY);
  CHECK_THAT(reserve.error().message, Catch::Contains(what));
  auto commit = rank.commit(proto::CommitState::Paused);
  REQUIRE_FALSE(commit);
  CHECK(commit.error().errnum() == EBUSY);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].disk_bytes == data.size());
  CHECK(file_bytes(dir + "/data") == data);
}

}  // namespace

TEST_CASE("a corrupted byte in a backup file is detected on read") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "corrupt"});
  const std::vector<BlobSize> blobs = {{1, 20 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string data = d.rank_dir(0, "corrupt", 0, ::getpid()) + "/data";
  flip_byte(data, 4 * MiB + 100, 0x01);
  // The page cache may hold the old byte for a buffered fallback; O_DIRECT reads see the disk.
  auto r = c.read_all(blobs, check_pattern);
  REQUIRE_FALSE(r);
  CHECK(r.error().errnum() == EBADMSG);
  CHECK(fs::exists(data));  // the file is kept for inspection
}

TEST_CASE("files of a live rank survive a daemon restart and the rank resumes from the manifest") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "restart", .rank = 2});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{7, 30 * MiB + 5}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "restart", 2, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  CHECK(fs::exists(dir + "/data"));
  d.start();  // the startup sweep must keep a live owner's files
  CHECK(fs::exists(dir + "/manifest"));
  auto wrong = ShimClient::connect(
      d.socket,
      {.job = "restart", .rank = 2, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB, .token = token + 1});
  REQUIRE_FALSE(wrong);
  auto again = d.shim({.job = "restart", .rank = 2, .token = token});
  CHECK(again.welcome().restored == 1);
  auto r = again.read_all(blobs, check_pattern);
  INFO((r ? "" : r.error().describe()));
  CHECK(r);
}

TEST_CASE(
    "a rank paused under a version-1 manifest resumes through the restarted daemon, READs verified with XXH3-64") {
  // A version-1 manifest holds 64-bit sums (XXH3-64): the hash workers verify each READ with the kind
  // its chunk was sealed with (a 128-bit check would refuse every one of them).
  Daemon d;
  d.start();
  auto c = d.shim({.job = "v1"});
  const uint64_t token = c.welcome().token;
  const uint32_t chunk = c.welcome().chunk_bytes;
  constexpr uint32_t kChunks = 4;
  const uint64_t size = uint64_t{kChunks - 1} * chunk + 4096;
  const std::vector<BlobSize> blobs = {{5, size}};
  auto length = [&](uint32_t i) {
    return static_cast<uint32_t>(std::min<uint64_t>(chunk, size - uint64_t{i} * chunk));
  };
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "v1", 0, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  // The manifest as that daemon wrote it: XXH3-64 of each chunk's bytes; the last one's sum is wrong.
  std::string why;
  auto m = storage::decode_manifest(file_bytes(dir + "/manifest"), why);
  INFO(why);
  REQUIRE(m);
  auto& sums = m->blobs[0].sums;
  REQUIRE(sums.size() == kChunks);
  for (uint32_t i = 0; i < kChunks; ++i) {
    std::vector<uint8_t> bytes(length(i));
    fill_pattern(5, uint64_t{i} * chunk, bytes.data(), bytes.size());
    sums[i] = {XXH3_64bits(bytes.data(), bytes.size()), 0};
  }
  sums[kChunks - 1].low ^= 1;
  std::ofstream(dir + "/manifest", std::ios::binary | std::ios::trunc) << storage_test::encode_manifest_v1(*m);
  d.start();
  auto again = d.shim({.job = "v1", .token = token});
  CHECK(again.welcome().restored == 1);
  for (uint32_t i = 0; i < kChunks; ++i) {
    std::memset(again.slot(0), 0, chunk);
    auto r = again.call(proto::Read{{.slot = 0, .length = length(i), .blob = 5, .offset = uint64_t{i} * chunk}});
    INFO("chunk " << i << (r ? "" : ": " + r.error().describe()));
    if (i + 1 < kChunks) {
      REQUIRE(r);
      CHECK(std::holds_alternative<proto::ReadDone>(*r));
      CHECK(check_pattern(5, uint64_t{i} * chunk, again.slot(0), length(i)));
    } else {
      REQUIRE_FALSE(r);
      CHECK(r.error().errnum() == EBADMSG);
    }
  }
}

TEST_CASE("chunks acknowledged before the daemon died mid-pause can be read back; one never written is refused") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "crash", .rank = 1});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 8 * MiB}, {2, 8 * MiB}};
  REQUIRE(c.reserve(blobs));
  // Blob 1 is fully written and acknowledged (the shim would now release it); blob 2 never is.
  std::vector<uint64_t> acked;
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {
    fill_pattern(1, off, c.slot(0), 4 * MiB);
    auto r = c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}});
    REQUIRE(r);
    REQUIRE(std::holds_alternative<proto::Written>(*r));
    acked.push_back(off);
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  d.start();
  auto again = d.shim({.job = "crash", .rank = 1, .token = token});
  CHECK(again.welcome().restored == 0);  // not a committed pause...
  for (uint64_t off : acked) {           // ...but every acknowledged chunk is recoverable, verified
    proto::Read rd;                      // by the store's journaled checksums (the rank sends none)
    rd.slot = 1;
    rd.length = 4 * MiB;
    rd.blob = 1;
    rd.offset = off;
    auto r = again.call(rd);
    INFO((r ? "" : r.error().describe()));
    REQUIRE(r);
    CHECK(std::holds_alternative<proto::ReadDone>(*r));
    CHECK(check_pattern(1, off, again.slot(1), 4 * MiB));
  }
  proto::Read never;
  never.slot = 1;
  never.length = 4 * MiB;
  never.blob = 2;
  CHECK(expect_error(again, never) == ENODATA);
}

TEST_CASE("after a daemon restart mid-pause the store verifies chunks written before it without the rank's checksums") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "sealed", .rank = 1});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 8 * MiB}};
  REQUIRE(c.reserve(blobs));
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {
    fill_pattern(1, off, c.slot(0), 4 * MiB);
    REQUIRE(c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}}));
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  // The second chunk is corrupted on disk while no daemon runs.
  const std::string data = d.rank_dir(0, "sealed", 1, ::getpid()) + "/data";
  flip_byte(data, 4 * MiB + 100, 0x01);
  d.start();
  auto again = d.shim({.job = "sealed", .rank = 1, .token = token});
  CHECK(again.welcome().restored == 0);
  proto::Read rd;
  rd.slot = 1;
  rd.length = 4 * MiB;
  rd.blob = 1;
  rd.offset = 0;
  auto good = again.call(rd);
  INFO((good ? "" : good.error().describe()));
  REQUIRE(good);
  CHECK(check_pattern(1, 0, again.slot(1), 4 * MiB));
  rd.offset = 4 * MiB;
  auto bad = again.call(rd);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
}

TEST_CASE("a manifest deleted while the daemon was down: the data file is kept, the resume refused naming it") {
  Daemon d;
  std::string data;
  auto rank = paused_rank_after_restart(
      d, [](const std::string& dir) { REQUIRE(fs::remove(dir + "/manifest")); }, data);
  CHECK(rank.welcome().restored == 0);
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  check_refused_and_kept(d, rank,
                         "the pause record " + dir +
                             "/manifest is missing: without it tmsdiskd cannot "
                             "tell where this rank's paused memory lies in its data file",
                         data);

  // The rank's connection drops: its files are kept for it, an orphan (they may hold its memory).
  const uint64_t token = rank.welcome().token;
  rank.close();
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(file_bytes(dir + "/data") == data);
  auto again = d.shim({.job = "lost", .rank = 3, .token = token});
  CHECK(again.call(read_of(4, 0, 4 * MiB)).error().errnum() == EUCLEAN);

  // The user accepts the loss: the shim maps zeros and commits the resume. The files serve again.
  REQUIRE(again.commit(proto::CommitState::Resumed));
  auto state = again.call(proto::PauseState{});
  REQUIRE(state);
  CHECK(std::get<proto::PauseStateReply>(*state).paused == 0);
  const std::vector<BlobSize> blobs = {{4, 12 * MiB}};
  REQUIRE(again.reserve(blobs));
  REQUIRE(again.write_all(blobs, fill_pattern));
  REQUIRE(again.commit(proto::CommitState::Paused));
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
}

TEST_CASE("a corrupted manifest: the data file is kept, the resume refused saying it is unreadable and why") {
  Daemon d;
  std::string data;
  auto rank = paused_rank_after_restart(
      d, [](const std::string& dir) { flip_byte(dir + "/manifest", 40, 0x01); }, data);
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  check_refused_and_kept(
      d, rank,
      "the pause record " + dir + "/manifest is unreadable (checksum mismatch: the file is torn or was modified)",
      data);
}

TEST_CASE("a checksum journal deleted after the daemon died mid-pause: the chunks it sealed are kept, not removed") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "lost", .rank = 3});
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve({{4, 8 * MiB}}));
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {  // acknowledged: the shim may release the memory
    fill_pattern(4, off, c.slot(0), 4 * MiB);
    REQUIRE(c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 4, .offset = off}}));
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  const std::string data = file_bytes(dir + "/data");
  REQUIRE(fs::remove(dir + "/sums"));
  d.start();
  auto rank = d.shim({.job = "lost", .rank = 3, .token = token});
  auto read = rank.call(read_of(4, 0, 4 * MiB));
  REQUIRE_FALSE(read);
  CHECK(read.error().errnum() == EUCLEAN);
  CHECK_THAT(read.error().message, Catch::StartsWith("the checksum journal " + dir +
                                                     "/sums of the pause in progress when tmsdiskd stopped "
                                                     "is missing"));
  // Every chunk passed for never written before, so the daemon deemed the files of no use to the rank:
  // a dropped connection removed them.
  rank.close();
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(file_bytes(dir + "/data") == data);
}
