// SPDX-License-Identifier: Apache-2.0
// Storage: name validation, roots, rank directories, extents, checksums, manifests and the sweep.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "background_punch.h"
#include "checksum_journal.h"
#include "extent_allocator.h"
#include "manifest.h"
#include "manifest_v1.h"
#include "punch_gate.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"
#include "tmsdisk/common/proc.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using storage_test::encode_manifest_v1;
using storage_test::exists;
using storage_test::mode_of;
using storage_test::my_identity;
using storage_test::TempDir;
using storage_test::usage_of;

namespace {

constexpr uint32_t kChunk = 64 * 1024;

Roots open_roots(const std::vector<std::string>& paths) {
  auto r = Roots::open(paths, false);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  return std::move(r).value();
}

std::unique_ptr<RankStore> make_store(Roots& roots, const RankIdentity& id, uint32_t chunk = kChunk) {
  auto s = RankStore::create(roots, id, chunk);
  INFO((s ? std::string() : s.error().describe()));
  REQUIRE(s);
  return std::move(s).value();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// A pid that existed and is gone (reaped), with the start time it had: an owner that provably died.
pid_t dead_process(uint64_t& start_time) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  // Until reaped, the exited child is a zombie whose /proc/<pid>/stat is still readable.
  auto st = process_start_time(pid);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(st);
  start_time = *st;
  REQUIRE_FALSE(process_alive(pid, start_time));
  return pid;
}

RankIdentity dead_identity(const std::string& job, int64_t rank = 0) {
  uint64_t start = 0;
  pid_t pid = dead_process(start);
  RankIdentity id = storage_test::identity_of(pid, job, rank);
  id.start_time = start;
  return id;
}

void fill_checksums(RankStore& store, const std::vector<proto::BlobSize>& set, uint64_t salt = 0) {
  for (const auto& b : set) {
    for (uint64_t off = 0; off < b.size; off += kChunk)
      REQUIRE(store.record_checksum(b.id, off, Checksum128{b.id * 1000 + off + salt}));
  }
}

// Writes `fill` over the chunk through its Location, as the I/O engine would (aligned for O_DIRECT).
void write_chunk(const RankStore& store, uint64_t blob, uint64_t off, uint32_t len, unsigned char fill) {
  auto loc = store.locate(blob, off, len);
  REQUIRE(loc);
  void* buf = std::aligned_alloc(kIoAlignment, loc->io_length);
  REQUIRE(buf);
  std::memset(buf, fill, loc->io_length);
  ssize_t n = ::pwrite(loc->fd, buf, loc->io_length, static_cast<off_t>(loc->file_offset));
  std::free(buf);
  REQUIRE(n == static_cast<ssize_t>(loc->io_length));
}

bool chunk_is(const RankStore& store, uint64_t blob, uint64_t off, uint32_t len, unsigned char fill) {
  auto loc = store.locate(blob, off, len);
  REQUIRE(loc);
  auto* buf = static_cast<unsigned char*>(std::aligned_alloc(kIoAlignment, loc->io_length));
  REQUIRE(buf);
  ssize_t n = ::pread(loc->fd, buf, loc->io_length, static_cast<off_t>(loc->file_offset));
  bool same = n == static_cast<ssize_t>(loc->io_length) &&
              std::all_of(buf, buf + len, [fill](unsigned char c) { return c == fill; });
  std::free(buf);
  return same;
}

uint64_t offset_of(const RankStore& store, uint64_t blob, uint64_t off, uint64_t size) {
  auto loc = store.locate(blob, off, static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)));
  INFO((loc ? std::string() : loc.error().describe()));
  REQUIRE(loc);
  return loc->file_offset;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("valid_job_name accepts plain names and refuses traversal") {
  CHECK(proto::valid_job_name("job1"));
  CHECK(proto::valid_job_name("A-b_c.9"));
  CHECK(proto::valid_job_name(std::string(64, 'x')));
  CHECK_FALSE(proto::valid_job_name(std::string(65, 'x')));
  CHECK_FALSE(proto::valid_job_name(""));
  CHECK_FALSE(proto::valid_job_name("."));
  CHECK_FALSE(proto::valid_job_name(".."));
  CHECK_FALSE(proto::valid_job_name(".hidden"));
  CHECK_FALSE(proto::valid_job_name("../etc"));
  CHECK_FALSE(proto::valid_job_name("a/b"));
  CHECK_FALSE(proto::valid_job_name("/"));
  CHECK_FALSE(proto::valid_job_name(std::string_view("a\0b", 3)));
  CHECK_FALSE(proto::valid_job_name("a b"));
  CHECK_FALSE(proto::valid_job_name("caf\xc3\xa9"));
  CHECK_FALSE(proto::valid_job_name("a\nb"));
}

TEST_CASE("rank directory names map an undeclared rank to the pid") {
  RankIdentity id;
  id.uid = 7;
  id.job = "j";
  id.pid = 4242;
  id.rank = 3;
  CHECK(rank_dir_name(id) == "rank3-4242");
  CHECK(rank_relative_dir(id) == "7/j/rank3-4242");
  id.rank = -1;
  CHECK(rank_dir_name(id) == "rank4242-4242");
}

TEST_CASE("Roots::open refuses missing, symlinked, duplicate and non-directory roots") {
  TempDir tmp;
  std::filesystem::create_directory(tmp / "real");
  std::filesystem::create_directory_symlink(tmp / "real", tmp / "link");
  write_text(tmp / "file", "x");

  auto missing = Roots::open({tmp / "nope"}, false);
  REQUIRE_FALSE(missing);
  CHECK(missing.error().errnum() == ENOENT);
  CHECK_THAT(missing.error().message, Catch::Contains("does not exist"));

  auto link = Roots::open({tmp / "link"}, false);
  REQUIRE_FALSE(link);
  CHECK(link.error().errnum() == ELOOP);
  CHECK_THAT(link.error().message, Catch::Contains("symbolic link"));

  auto file = Roots::open({tmp / "file"}, false);
  REQUIRE_FALSE(file);
  CHECK(file.error().errnum() == ENOTDIR);

  auto dup = Roots::open({tmp / "real", tmp.path() + "//real/./"}, false);
  REQUIRE_FALSE(dup);
  CHECK_THAT(dup.error().message, Catch::Contains("same directory"));

  auto dots = Roots::open({tmp / "real/../real"}, false);
  REQUIRE_FALSE(dots);
  CHECK(dots.error().errnum() == EINVAL);

  auto none = Roots::open({}, false);
  REQUIRE_FALSE(none);
  CHECK_THAT(none.error().message, Catch::Contains("--root"));

  Roots ok = open_roots({tmp.path() + "//real/."});
  REQUIRE(ok.size() == 1);
  CHECK(ok[0].path == tmp / "real");
  auto free = ok.free_bytes(0);
  REQUIRE(free);
  CHECK(*free > 0);
  CHECK_FALSE(ok.free_bytes(1));
}

TEST_CASE("Roots::open makes a relative root absolute") {
  TempDir tmp;
  auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(tmp.path());
  std::filesystem::create_directory("rel");
  auto r = Roots::open({"rel"}, false);
  std::filesystem::current_path(cwd);
  REQUIRE(r);
  CHECK((*r)[0].path == tmp / "rel");
}

TEST_CASE("root_for matches TMS_DISK_BACKUP_DIR lexically under a root") {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "a/sub");
  std::filesystem::create_directories(tmp / "b");
  Roots roots = open_roots({tmp / "a", tmp / "b", tmp / "a/sub"});

  auto in_a = roots.root_for(tmp.path() + "/a//x/./y");
  REQUIRE(in_a);
  CHECK(*in_a == 0);
  auto exact = roots.root_for(tmp / "b");
  REQUIRE(exact);
  CHECK(*exact == 1);
  auto nested = roots.root_for(tmp / "a/sub/rank");  // the most specific root wins
  REQUIRE(nested);
  CHECK(*nested == 2);

  auto sibling = roots.root_for(tmp / "ab");  // a prefix of the string, not of the path
  REQUIRE_FALSE(sibling);
  CHECK_THAT(sibling.error().message, Catch::Contains("not under a storage root"));
  CHECK_THAT(sibling.error().message, Catch::Contains(tmp / "a"));

  auto escape = roots.root_for(tmp / "a/../../etc");
  REQUIRE_FALSE(escape);
  CHECK(escape.error().errnum() == EINVAL);
  CHECK_FALSE(roots.root_for("relative/path"));
  CHECK_FALSE(roots.root_for(""));
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("create makes the rank directory with its modes, owner and data file; remove deletes it") {
  ::umask(022);
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("job1", 3);
  auto store = make_store(roots, id);

  const std::string uid_dir = root / "1000";
  const std::string job_dir = uid_dir + "/job1";
  const std::string rank_dir = job_dir + "/rank3-" + std::to_string(::getpid());
  CHECK(store->dir_path() == rank_dir);
  CHECK(store->relative_dir() == "1000/job1/rank3-" + std::to_string(::getpid()));
  CHECK(mode_of(uid_dir) == 0711);
  CHECK(mode_of(job_dir) == 0711);
  CHECK(mode_of(rank_dir) == 0700);
  CHECK(mode_of(rank_dir + "/owner") == 0600);
  CHECK(mode_of(rank_dir + "/data") == 0600);
  CHECK_FALSE(exists(rank_dir + "/owner.tmp"));

  std::string owner = read_text(rank_dir + "/owner");
  CHECK_THAT(owner, Catch::Contains("pid " + std::to_string(::getpid()) + "\n"));
  CHECK_THAT(owner, Catch::Contains("start_time " + std::to_string(id.start_time) + "\n"));
  CHECK_THAT(owner, Catch::Contains("token 1234\n"));
  CHECK_THAT(owner, Catch::Contains("uid 1000\n"));
  CHECK_THAT(owner, Catch::Contains("job job1\n"));
  CHECK_THAT(owner, Catch::Contains("rank 3\n"));

  // The data file uses O_DIRECT exactly when the root says it can.
  std::vector<proto::BlobSize> set{{1, kChunk}};
  REQUIRE(store->reserve(set));
  auto loc = store->locate(1, 0, kChunk);
  REQUIRE(loc);
  int flags = ::fcntl(loc->fd, F_GETFL);
  CHECK(((flags & O_DIRECT) != 0) == loc->direct_io);
  CHECK(loc->direct_io == roots[0].direct_io);
  CHECK(loc->in_memory == roots[0].in_memory);  // the test roots are on a disk unless TMSDISK_TEST_TMP says otherwise

  // A second rank of the same job keeps the job directory alive when the first goes.
  auto other = make_store(roots, my_identity("job1", 4));
  REQUIRE(store->remove());
  CHECK_FALSE(exists(rank_dir));
  CHECK(exists(job_dir));
  CHECK(store->remove());  // idempotent
  CHECK_FALSE(store->locate(1, 0, kChunk));
  REQUIRE(other->remove());
  CHECK_FALSE(exists(job_dir));
  CHECK_FALSE(exists(uid_dir));
  CHECK(exists(root.path()));
}

TEST_CASE("an undeclared rank lives in rank<pid>-<pid>") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("job1", -1));
  std::string pid = std::to_string(::getpid());
  CHECK(store->dir_path() == root / ("1000/job1/rank" + pid + "-" + pid));
  CHECK(exists(store->dir_path()));
  REQUIRE(store->remove());
}

TEST_CASE("create refuses bad job names and chunk sizes") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  for (const std::string& job : std::vector<std::string>{"..", "a/b", "", ".x", std::string(65, 'j')}) {
    auto s = RankStore::create(roots, my_identity(job), kChunk);
    REQUIRE_FALSE(s);
    CHECK(s.error().errnum() == EINVAL);
  }
  CHECK_FALSE(RankStore::create(roots, my_identity(), 1000));
  CHECK_FALSE(RankStore::create(roots, my_identity(), 0));
  CHECK(entries(root.path()).empty());
}

TEST_CASE("symlinks planted inside a root are refused, never followed") {
  TempDir root;
  TempDir victim;
  write_text(victim / "precious", "keep me");
  Roots roots = open_roots({root.path()});
  const auto before = entries(victim.path());

  SECTION("as <root>/<uid>") {
    std::filesystem::create_directory_symlink(victim.path(), root / "1000");
    auto s = RankStore::create(roots, my_identity(), kChunk);
    REQUIRE_FALSE(s);
    CHECK((s.error().errnum() == ELOOP || s.error().errnum() == ENOTDIR));
    CHECK_THAT(s.error().message, Catch::Contains("symbolic link"));
  }
  SECTION("as <root>/<uid>/<job>") {
    std::filesystem::create_directory(root / "1000");
    std::filesystem::create_directory_symlink(victim.path(), root / "1000/job1");
    auto s = RankStore::create(roots, my_identity(), kChunk);
    REQUIRE_FALSE(s);
    CHECK((s.error().errnum() == ELOOP || s.error().errnum() == ENOTDIR));
    CHECK_THAT(s.error().message, Catch::Contains(root / "1000/job1"));
  }
  SECTION("as the rank directory") {
    std::filesystem::create_directories(root / "1000/job1");
    std::filesystem::create_directory_symlink(victim.path(), root / ("1000/job1/rank0-" + std::to_string(::getpid())));
    auto s = RankStore::create(roots, my_identity(), kChunk);
    REQUIRE_FALSE(s);
    CHECK((s.error().errnum() == ELOOP || s.error().errnum() == ENOTDIR));
  }
  SECTION("planted in the rank directory before remove()") {
    auto store = make_store(roots, my_identity());
    std::filesystem::create_directory_symlink(victim.path(), store->dir_path() + "/evil");
    REQUIRE(store->remove());
    CHECK_FALSE(exists(root / "1000"));
  }
  CHECK(entries(victim.path()) == before);
  CHECK(read_text(victim / "precious") == "keep me");
}

TEST_CASE("a failure on a later root leaves nothing on earlier roots") {
  TempDir a, b, victim;
  Roots roots = open_roots({a.path(), b.path()});
  std::filesystem::create_directory_symlink(victim.path(), b / "1000");
  auto s = RankStore::create(roots, my_identity(), kChunk);
  REQUIRE_FALSE(s);
  CHECK(entries(a.path()).empty());
  CHECK(entries(victim.path()).empty());
}

TEST_CASE("create replaces a dead process's directory and refuses a live one's") {
  TempDir root;
  Roots roots = open_roots({root.path()});

  RankIdentity dead = dead_identity("job1");
  {
    auto s = make_store(roots, dead);
    REQUIRE(s->reserve(std::vector<proto::BlobSize>{{1, kChunk}}));
    write_text(s->dir_path() + "/leftover", "x");
  }  // destroyed without remove(): as after a daemon crash
  dead.token = 99;
  auto again = make_store(roots, dead);
  CHECK_FALSE(exists(again->dir_path() + "/leftover"));
  CHECK_THAT(read_text(again->dir_path() + "/owner"), Catch::Contains("token 99\n"));
  REQUIRE(again->remove());

  { auto live = make_store(roots, my_identity()); }
  auto dup = RankStore::create(roots, my_identity(), kChunk);
  REQUIRE_FALSE(dup);
  CHECK(dup.error().errnum() == EEXIST);
  CHECK_THAT(dup.error().message, Catch::Contains("token"));
  CHECK(exists(root / ("1000/job1/rank0-" + std::to_string(::getpid()) + "/owner")));
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("extent allocator: growth, first fit, coalescing, reuse") {
  constexpr uint64_t P = 4096;
  ExtentAllocator a(P);
  CHECK(a.allocate(2 * P) == 0u);
  CHECK(a.allocate(P) == 2 * P);
  CHECK(a.allocate(3 * P) == 3 * P);
  CHECK(a.end() == 6 * P);
  CHECK(a.used_bytes() == 6 * P);
  CHECK_FALSE(a.allocate(0));
  CHECK_FALSE(a.allocate(P + 1));

  SECTION("first fit takes the lowest hole that is large enough") {
    REQUIRE(a.release(0, 2 * P));
    REQUIRE(a.release(3 * P, 3 * P));   // touches the end: stays free until trimmed
    CHECK(a.allocate(3 * P) == 3 * P);  // the hole at 0 is too small
    CHECK(a.allocate(P) == 0u);         // first fit: the lowest hole
    CHECK(a.allocate(P) == P);
    CHECK(a.free_bytes() == 0);
    CHECK(a.end() == 6 * P);
  }
  SECTION("neighbouring free extents coalesce") {
    REQUIRE(a.release(0, 2 * P));
    REQUIRE(a.release(3 * P, 3 * P));
    CHECK(a.free_extents().size() == 2);
    REQUIRE(a.release(2 * P, P));  // bridges both
    REQUIRE(a.free_extents().size() == 1);
    CHECK(a.free_extents().begin()->first == 0u);
    CHECK(a.free_extents().begin()->second == 6 * P);
    CHECK(a.allocate(6 * P) == 0u);  // reused whole, no growth
    CHECK(a.end() == 6 * P);
  }
  SECTION("a free tail grows instead of leaving a hole") {
    REQUIRE(a.release(3 * P, 3 * P));
    CHECK(a.allocate(5 * P) == 3 * P);
    CHECK(a.end() == 8 * P);
    CHECK(a.free_bytes() == 0);
  }
  SECTION("trim_tail drops the free end") {
    REQUIRE(a.release(2 * P, 4 * P));
    a.trim_tail();
    CHECK(a.end() == 2 * P);
    CHECK(a.free_extents().empty());
    CHECK(a.allocate(P) == 2 * P);
  }
  SECTION("bad releases are refused and change nothing") {
    REQUIRE(a.release(0, 2 * P));
    CHECK_FALSE(a.release(0, 2 * P));      // double free
    CHECK_FALSE(a.release(P, 2 * P));      // overlaps a free extent
    CHECK_FALSE(a.release(2 * P + 1, P));  // misaligned
    CHECK_FALSE(a.release(5 * P, 2 * P));  // past the end
    CHECK_FALSE(a.release(2 * P, 0));
    CHECK(a.free_bytes() == 2 * P);
    CHECK(a.free_extents().size() == 1);
  }
  SECTION("claim rebuilds used extents inside a free file") {
    ExtentAllocator b = ExtentAllocator::with_free_file(P, 8 * P);
    CHECK(b.claim(2 * P, 2 * P));
    CHECK(b.claim(6 * P, 2 * P));
    CHECK_FALSE(b.claim(3 * P, 2 * P));  // overlaps a used extent
    CHECK_FALSE(b.claim(8 * P, P));      // past the end
    CHECK(b.used_bytes() == 4 * P);
    CHECK(b.allocate(2 * P) == 0u);
    CHECK(b.allocate(2 * P) == 4 * P);
    CHECK(b.free_bytes() == 0);
  }
}

TEST_CASE("reserve lays out blobs, keeps unchanged ones and recycles dropped extents") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  const std::string data = store->dir_path() + "/data";

  // Blob 1: three full chunks and a 3392-byte tail rounded up to 4096.
  const uint64_t b1 = 3 * kChunk + 3392;
  std::vector<proto::BlobSize> set{{1, b1}, {2, kChunk}};
  REQUIRE(store->reserve(set));
  CHECK(store->disk_bytes() == 3 * kChunk + 4096 + kChunk);
  CHECK(store->missing_chunks() == 5);
  CHECK(store->blobs().size() == 2);
  const uint64_t off1 = offset_of(*store, 1, 0, b1);
  const uint64_t off2 = offset_of(*store, 2, 0, kChunk);
  CHECK(off1 % kIoAlignment == 0);
  CHECK(offset_of(*store, 1, 3 * kChunk, b1) == off1 + 3 * kChunk);
  auto tail = store->locate(1, 3 * kChunk, 3392);
  REQUIRE(tail);
  CHECK(tail->io_length == 4096);
  CHECK(usage_of(data).size == store->disk_bytes());
  CHECK(usage_of(data).blocks * 512 >= store->disk_bytes());  // preallocated, not sparse

  SECTION("repeating the same set keeps extents and disk usage constant") {
    const auto usage = usage_of(data);
    for (int i = 0; i < 5; ++i) {
      fill_checksums(*store, set, static_cast<uint64_t>(i));
      REQUIRE(store->commit(proto::CommitState::Paused));
      CHECK(store->generation() == static_cast<uint64_t>(i) + 1);  // each pause numbered by the store
      REQUIRE(store->commit(proto::CommitState::Resumed));
      REQUIRE(store->reserve(set));
      CHECK(store->disk_bytes() == 3 * kChunk + 4096 + kChunk);
      CHECK(usage_of(data) == usage);
      CHECK(offset_of(*store, 1, 0, b1) == off1);
      CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    }
  }
  SECTION("a dropped blob's extent is reused by a new one of the same size") {
    std::vector<proto::BlobSize> next{{2, kChunk}, {3, b1}};
    REQUIRE(store->reserve(next));
    CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    CHECK(offset_of(*store, 3, 0, b1) == off1);
    CHECK_FALSE(store->locate(1, 0, kChunk));
    CHECK(usage_of(data).size == 3 * kChunk + 4096 + kChunk);
  }
  SECTION("a resized blob moves, the file grows at the end, and shrinks when the tail frees") {
    std::vector<proto::BlobSize> bigger{{1, b1}, {2, 4 * kChunk}};
    REQUIRE(store->reserve(bigger));
    CHECK(offset_of(*store, 1, 0, b1) == off1);
    CHECK(offset_of(*store, 2, 0, 4 * kChunk) == off1 + 3 * kChunk + 4096);  // off2 + its old extent freed, merged
    CHECK(store->disk_bytes() == 3 * kChunk + 4096 + 4 * kChunk);
    CHECK(usage_of(data).size == store->disk_bytes());
    // The file is cut once the space a reservation gives back is given back, off the caller's thread.
    REQUIRE(store->reserve(std::vector<proto::BlobSize>{{1, b1}}));
    store->wait_for_punches();
    CHECK(usage_of(data).size == 3 * kChunk + 4096);
    REQUIRE(store->reserve(std::vector<proto::BlobSize>{}));
    CHECK(store->disk_bytes() == 0);
    store->wait_for_punches();
    CHECK(usage_of(data).size == 0);
  }
  SECTION("invalid sets are refused and change nothing") {
    auto dup = store->reserve(std::vector<proto::BlobSize>{{7, kChunk}, {7, kChunk}});
    REQUIRE_FALSE(dup);
    CHECK(dup.error().errnum() == EINVAL);
    CHECK_THAT(dup.error().message, Catch::Contains("twice"));
    auto huge = store->reserve(std::vector<proto::BlobSize>{{8, uint64_t{1} << 61}});
    REQUIRE_FALSE(huge);
    CHECK(huge.error().errnum() == EFBIG);
    // More than the disk holds: refused before touching it, with both numbers in the message.
    auto nospace = store->reserve(std::vector<proto::BlobSize>{{1, b1}, {9, uint64_t{1} << 59}});
    REQUIRE_FALSE(nospace);
    CHECK(nospace.error().errnum() == ENOSPC);
    CHECK_THAT(nospace.error().message, Catch::Contains("needs") && Catch::Contains("free"));
    CHECK(store->blobs().size() == 2);
    CHECK(offset_of(*store, 1, 0, b1) == off1);
    CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    CHECK(usage_of(data).size == 3 * kChunk + 4096 + kChunk);
  }
  REQUIRE(store->remove());
}

TEST_CASE("blobs stripe chunk by chunk over the roots") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  auto store = make_store(roots, my_identity());
  const uint64_t size = 4 * kChunk + 100;  // chunks 0,2,4 on root 0 (4 is the tail); 1,3 on root 1
  REQUIRE(store->reserve(std::vector<proto::BlobSize>{{5, size}}));
  CHECK(store->disk_bytes() == 2 * kChunk + 4096 + 2 * kChunk);
  auto c0 = store->locate(5, 0, kChunk);
  auto c1 = store->locate(5, kChunk, kChunk);
  auto c2 = store->locate(5, 2 * kChunk, kChunk);
  auto c3 = store->locate(5, 3 * kChunk, kChunk);
  auto c4 = store->locate(5, 4 * kChunk, 100);
  REQUIRE((c0 && c1 && c2 && c3 && c4));
  CHECK(c0->fd == c2->fd);
  CHECK(c0->fd == c4->fd);
  CHECK(c1->fd == c3->fd);
  CHECK(c0->fd != c1->fd);
  CHECK(c2->file_offset == c0->file_offset + kChunk);
  CHECK(c4->file_offset == c0->file_offset + 2 * kChunk);
  CHECK(c3->file_offset == c1->file_offset + kChunk);
  CHECK(c4->io_length == 4096);
  CHECK(usage_of(a.path() + "/" + store->relative_dir() + "/data").size == 2 * kChunk + 4096);
  CHECK(usage_of(b.path() + "/" + store->relative_dir() + "/data").size == 2 * kChunk);
  CHECK_FALSE(exists(b.path() + "/" + store->relative_dir() + "/manifest"));
  REQUIRE(store->remove());
  CHECK(entries(a.path()).empty());
  CHECK(entries(b.path()).empty());
}

namespace {
int g_fail_calls = 0;
int g_fail_at = 0;
int g_fail_errno = ENOSPC;
int fail_nth(std::size_t, uint64_t, uint64_t) {
  return ++g_fail_calls == g_fail_at ? g_fail_errno : 0;
}
}  // namespace

TEST_CASE("reserve is all or nothing when a preallocation fails") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  auto store = make_store(roots, my_identity());
  const std::string data_a = a.path() + "/" + store->relative_dir() + "/data";
  const std::string data_b = b.path() + "/" + store->relative_dir() + "/data";
  std::vector<proto::BlobSize> first{{1, 3 * kChunk}, {2, 2 * kChunk}};
  REQUIRE(store->reserve(first));
  fill_checksums(*store, first);
  write_chunk(*store, 2, 0, kChunk, 0xa5);
  write_chunk(*store, 2, kChunk, kChunk, 0x5a);
  const auto ua = usage_of(data_a);
  const auto ub = usage_of(data_b);
  const uint64_t disk = store->disk_bytes();
  const uint64_t o1 = offset_of(*store, 1, kChunk, 3 * kChunk);

  // The new set drops blob 2 and adds two blobs: four fresh extents; fail each one in turn so the
  // rollback runs after 0..3 successful preallocations spread over both roots.
  std::vector<proto::BlobSize> next{{1, 3 * kChunk}, {3, 8 * kChunk}, {4, 2 * kChunk}};
  int err = GENERATE(ENOSPC, EIO);
  int at = GENERATE(1, 2, 3, 4);
  g_fail_calls = 0;
  g_fail_at = at;
  g_fail_errno = err;
  auto prev = storage::testing::set_fallocate_hook(&fail_nth);
  auto st = store->reserve(next);
  storage::testing::set_fallocate_hook(prev);
  REQUIRE_FALSE(st);
  CHECK(st.error().errnum() == err);
  if (err == ENOSPC) {
    CHECK_THAT(st.error().message, Catch::Contains("needs") && Catch::Contains("free"));
  } else {
    CHECK_THAT(st.error().message, Catch::Contains("cannot preallocate"));
  }
  CHECK(usage_of(data_a) == ua);
  CHECK(usage_of(data_b) == ub);
  CHECK(store->disk_bytes() == disk);
  auto blobs = store->blobs();
  REQUIRE(blobs.size() == 2);
  CHECK(blobs[1].id == 2);
  CHECK(offset_of(*store, 1, kChunk, 3 * kChunk) == o1);
  CHECK(store->missing_chunks() == 0);  // checksums of the old set survive a refused reserve
  auto sum = store->expected_checksum(2, kChunk);
  REQUIRE(sum);
  CHECK(sum->low == 2 * 1000 + kChunk);
  // Blob 2 is dropped by the refused set and its space would have gone to blob 3: still intact.
  CHECK(chunk_is(*store, 2, 0, kChunk, 0xa5));
  CHECK(chunk_is(*store, 2, kChunk, kChunk, 0x5a));

  REQUIRE(store->reserve(next));
  CHECK(store->blobs().size() == 3);
  REQUIRE(store->remove());
}

TEST_CASE("locate validates blob, offset and length") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  const uint64_t size = 2 * kChunk + 10;
  REQUIRE(store->reserve(std::vector<proto::BlobSize>{{1, size}, {2, 0}}));

  auto unknown = store->locate(99, 0, kChunk);
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().errnum() == ENOENT);
  auto misaligned = store->locate(1, 4096, kChunk);
  REQUIRE_FALSE(misaligned);
  CHECK(misaligned.error().errnum() == EINVAL);
  auto short_len = store->locate(1, 0, kChunk - 4096);
  REQUIRE_FALSE(short_len);
  CHECK(short_len.error().errnum() == EINVAL);
  auto long_tail = store->locate(1, 2 * kChunk, kChunk);
  REQUIRE_FALSE(long_tail);
  CHECK_THAT(long_tail.error().message, Catch::Contains("is 10 bytes"));
  auto past = store->locate(1, 3 * kChunk, kChunk);
  REQUIRE_FALSE(past);
  CHECK_THAT(past.error().message, Catch::Contains("past the end"));
  CHECK_FALSE(store->locate(2, 0, 0));  // an empty blob has no chunk
  auto ok = store->locate(1, 2 * kChunk, 10);
  REQUIRE(ok);
  CHECK(ok->io_length == 4096);
  CHECK(store->missing_chunks() == 3);
  REQUIRE(store->remove());
}

TEST_CASE("checksums are kept per chunk and cleared by reserve") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  std::vector<proto::BlobSize> set{{1, 2 * kChunk}, {2, 100}};
  REQUIRE(store->reserve(set));
  CHECK(store->missing_chunks() == 3);

  auto none = store->expected_checksum(1, 0);
  REQUIRE_FALSE(none);
  CHECK(none.error().errnum() == ENODATA);
  CHECK(store->record_checksum(1, 0, Checksum128{42}));
  CHECK(store->missing_chunks() == 2);
  CHECK(store->record_checksum(1, 0, Checksum128{43}));  // rewriting a chunk replaces its checksum
  CHECK(store->missing_chunks() == 2);
  auto got = store->expected_checksum(1, 0);
  REQUIRE(got);
  CHECK(got->low == 43);

  CHECK_FALSE(store->record_checksum(3, 0, Checksum128{1}));
  CHECK_FALSE(store->record_checksum(1, 5, Checksum128{1}));
  CHECK_FALSE(store->record_checksum(1, 2 * kChunk, Checksum128{1}));
  CHECK(store->missing_chunks() == 2);
  CHECK_FALSE(store->expected_checksum(9, 0));

  CHECK(store->record_checksum(1, kChunk, Checksum128{7}));
  CHECK(store->record_checksum(2, 0, Checksum128{8}));
  CHECK(store->missing_chunks() == 0);
  REQUIRE(store->reserve(set));
  CHECK(store->missing_chunks() == 3);
  CHECK_FALSE(store->expected_checksum(2, 0));
  REQUIRE(store->remove());
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("commit writes a manifest that adopt restores after a daemon restart") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("job1", 2);
  std::vector<proto::BlobSize> set{{10, 5 * kChunk + 300}, {11, kChunk}, {12, 0}};
  uint64_t o10 = 0, o11 = 0;
  std::string manifest;
  {
    auto store = make_store(roots, id);
    manifest = store->dir_path() + "/manifest";
    REQUIRE(store->reserve(set));
    fill_checksums(*store, std::vector<proto::BlobSize>{{10, 5 * kChunk + 300}});
    auto incomplete = store->commit(proto::CommitState::Paused);
    REQUIRE_FALSE(incomplete);
    CHECK(incomplete.error().errnum() == EINVAL);
    CHECK_THAT(incomplete.error().message, Catch::Contains("1 of 7 chunks"));
    CHECK(exists(manifest));  // the reservation is recorded ("writing"), not a pause
    CHECK_FALSE(store->paused());

    fill_checksums(*store, set);
    REQUIRE(store->commit(proto::CommitState::Paused));
    CHECK(store->paused());
    CHECK(store->generation() == 1);  // the store numbers pauses
    CHECK(mode_of(manifest) == 0600);
    CHECK_FALSE(exists(manifest + ".tmp"));
    o10 = offset_of(*store, 10, 5 * kChunk, 5 * kChunk + 300);
    o11 = offset_of(*store, 11, 0, kChunk);

    auto busy = store->reserve(set);  // the paused data is the only copy
    REQUIRE_FALSE(busy);
    CHECK(busy.error().errnum() == EBUSY);
  }  // the daemon "exits" without removing anything

  {
    auto adopted = RankStore::adopt(roots, id, kChunk);
    INFO((adopted ? std::string() : adopted.error().describe()));
    REQUIRE(adopted);
    auto& store = **adopted;
    CHECK(store.paused());
    CHECK(store.generation() == 1);
    auto blobs = store.blobs();
    REQUIRE(blobs.size() == 3);
    CHECK(blobs[0].id == 10);
    CHECK(blobs[0].size == 5 * kChunk + 300);
    CHECK(blobs[2].size == 0);
    CHECK(store.missing_chunks() == 0);
    CHECK(offset_of(store, 10, 5 * kChunk, 5 * kChunk + 300) == o10);
    CHECK(offset_of(store, 11, 0, kChunk) == o11);
    auto sum = store.expected_checksum(10, 3 * kChunk);
    REQUIRE(sum);
    CHECK(sum->low == 10 * 1000 + 3 * kChunk);
    CHECK(store.disk_bytes() == (3 * kChunk) + (2 * kChunk + 4096) + kChunk);

    // Resume completes: the manifest says so, and the extents stay for the next pause.
    REQUIRE(store.commit(proto::CommitState::Resumed));
    CHECK_FALSE(store.paused());
  }
  {
    auto adopted = RankStore::adopt(roots, id, kChunk);
    REQUIRE(adopted);
    auto& store = **adopted;
    CHECK_FALSE(store.paused());
    CHECK(store.generation() == 1);  // a resume keeps the number of the pause it ended
    REQUIRE(store.reserve(set));
    CHECK(store.missing_chunks() == 7);
    CHECK(offset_of(store, 10, 5 * kChunk, 5 * kChunk + 300) == o10);
    CHECK(offset_of(store, 11, 0, kChunk) == o11);
    // New blobs after an adopt take free space, never space of the adopted extents.
    REQUIRE(store.reserve(std::vector<proto::BlobSize>{{10, 5 * kChunk + 300}, {11, kChunk}, {13, kChunk}}));
    uint64_t o13 = offset_of(store, 13, 0, kChunk);
    CHECK(o13 != o11);
    CHECK(o13 != offset_of(store, 10, 0, 5 * kChunk + 300));
    REQUIRE(store.remove());
  }
}

TEST_CASE("adopt refuses a wrong owner and starts empty without a manifest") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity();
  { auto store = make_store(roots, id); }

  RankIdentity wrong_token = id;
  wrong_token.token = 1;
  auto t = RankStore::adopt(roots, wrong_token, kChunk);
  REQUIRE_FALSE(t);
  CHECK(t.error().errnum() == EPERM);
  CHECK_THAT(t.error().message, Catch::Contains("another session"));

  RankIdentity wrong_start = id;
  wrong_start.start_time += 1;
  auto s = RankStore::adopt(roots, wrong_start, kChunk);
  REQUIRE_FALSE(s);
  CHECK(s.error().errnum() == EPERM);

  auto other_job = RankStore::adopt(roots, my_identity("job2"), kChunk);
  REQUIRE_FALSE(other_job);
  CHECK(other_job.error().errnum() == ENOENT);

  auto fresh = RankStore::adopt(roots, id, kChunk);
  REQUIRE(fresh);
  CHECK_FALSE((*fresh)->paused());
  CHECK((*fresh)->blobs().empty());
  REQUIRE((*fresh)->remove());
}

namespace {

// A store adopted with a lost record: every use of the files refused with `problem`, the files as
// they were (`data` is the data file's bytes before the loss).
void check_lost_record(RankStore& store, const std::string& data_path, const std::string& data) {
  const std::string& problem = store.record_problem();
  INFO(problem);
  REQUIRE_FALSE(problem.empty());
  CHECK_THAT(problem, Catch::Contains(data_path + " (" + std::to_string(data.size()) + " bytes) is kept untouched") &&
                          Catch::Contains("--accept-loss") && Catch::Contains("restart tmsdiskd"));
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());  // a closed connection keeps the session and its files
  CHECK_FALSE(store.paused());
  CHECK(store.disk_bytes() == data.size());
  auto located = store.locate(1, 0, kChunk);
  REQUIRE_FALSE(located);
  CHECK(located.error().errnum() == EUCLEAN);
  CHECK(located.error().message == problem);
  CHECK(store.expected_checksum(1, 0).error().errnum() == EUCLEAN);
  CHECK_FALSE(store.record_checksum(1, 0, Checksum128{5}));
  // A new set would recycle, truncate and punch the old extents: refused, as is a pause of nothing.
  auto reserved = store.reserve(std::vector<proto::BlobSize>{{1, 3 * kChunk}});
  REQUIRE_FALSE(reserved);
  CHECK(reserved.error().errnum() == EBUSY);
  CHECK(reserved.error().message == problem);
  auto committed = store.commit(proto::CommitState::Paused);
  REQUIRE_FALSE(committed);
  CHECK(committed.error().errnum() == EBUSY);
  CHECK(read_text(data_path) == data);
}

// A rank paused with 3 chunks of blob 1 written (bytes 0x11, 0x22, 0x33); returns its data file path.
std::string paused_rank(Roots& roots, const RankIdentity& id) {
  auto store = make_store(roots, id);
  const std::vector<proto::BlobSize> set{{1, 3 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 3; ++c)
    write_chunk(*store, 1, c * kChunk, kChunk, static_cast<unsigned char>(0x11 * (c + 1)));
  fill_checksums(*store, set);
  REQUIRE(store->commit(proto::CommitState::Paused));
  return store->dir_path() + "/data";
}  // the daemon "exits" without removing anything

}  // namespace

TEST_CASE(
    "a corrupt manifest keeps the data file untouched and refuses its use, saying the record is unreadable and why") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity();
  const std::string data_path = paused_rank(roots, id);
  const std::string manifest = std::filesystem::path(data_path).parent_path() / "manifest";
  const std::string data = read_text(data_path);
  REQUIRE(data.size() >= 3 * kChunk);
  const std::string good = read_text(manifest);
  REQUIRE(good.size() > 64);

  auto expect_lost = [&](const std::string& bytes, const char* why) {
    write_text(manifest, bytes);
    auto r = RankStore::adopt(roots, id, kChunk);
    INFO((r ? std::string() : r.error().describe()));
    REQUIRE(r);  // the rank gets its session: its memory stays paused, the process runs
    CHECK_THAT((*r)->record_problem(),
               Catch::StartsWith("the pause record " + manifest + " is unreadable (") && Catch::Contains(why));
    check_lost_record(**r, data_path, data);
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  expect_lost(flipped, "checksum mismatch");
  std::string magic = good;
  magic[0] = 'X';
  expect_lost(magic, "magic");
  expect_lost(good.substr(0, good.size() - 9), "checksum");
  expect_lost("", "too short");

  // Another chunk size is the session's mistake, not the record's: refused, and reconnecting as
  // before works.
  write_text(manifest, good);
  auto wrong_chunk = RankStore::adopt(roots, id, 2 * kChunk);
  REQUIRE_FALSE(wrong_chunk);
  CHECK_THAT(wrong_chunk.error().message, Catch::Contains("chunk size"));
  auto ok = RankStore::adopt(roots, id, kChunk);
  REQUIRE(ok);
  CHECK((*ok)->record_problem().empty());
  CHECK((*ok)->paused());
  CHECK(chunk_is(**ok, 1, 2 * kChunk, kChunk, 0x33));
  REQUIRE((*ok)->remove());
}

TEST_CASE("a deleted manifest never truncates the data file: its use is refused until the rank commits a resume") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("lost", 4);
  const std::string data0 = paused_rank(roots, id);
  const std::string dir0 = std::filesystem::path(data0).parent_path();
  const std::string data1 = b.path() + "/" + rank_relative_dir(id) + "/data";
  const std::string bytes0 = read_text(data0), bytes1 = read_text(data1);
  REQUIRE(bytes0.size() > 0);
  REQUIRE(bytes1.size() > 0);  // striped: chunk 1 lives on the second root
  REQUIRE(std::filesystem::remove(dir0 + "/manifest"));

  auto r = RankStore::adopt(roots, id, kChunk);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  RankStore& store = **r;
  const std::string& problem = store.record_problem();
  INFO(problem);
  CHECK_THAT(problem, Catch::StartsWith("the pause record " + dir0 +
                                        "/manifest is missing: without it tmsdiskd "
                                        "cannot tell where this rank's paused memory lies"));
  CHECK_THAT(problem,
             Catch::Contains("the data files " + data0 + " (" + std::to_string(bytes0.size()) + " bytes) and " + data1 +
                             " (" + std::to_string(bytes1.size()) + " bytes) are kept untouched"));
  CHECK(store.disk_bytes() == bytes0.size() + bytes1.size());
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());
  CHECK(store.locate(1, 0, kChunk).error().errnum() == EUCLEAN);
  CHECK(store.reserve(std::vector<proto::BlobSize>{{1, 3 * kChunk}}).error().errnum() == EBUSY);
  CHECK(read_text(data0) == bytes0);
  CHECK(read_text(data1) == bytes1);

  // The rank has every allocation resident again (it gave the paused ones up, --accept-loss): the
  // record stops mattering, and the files serve the next pause.
  REQUIRE(store.commit(proto::CommitState::Resumed));
  CHECK(store.record_problem().empty());
  CHECK_FALSE(store.awaits_resume());
  REQUIRE(store.reserve(std::vector<proto::BlobSize>{{1, 3 * kChunk}}));
  fill_checksums(store, std::vector<proto::BlobSize>{{1, 3 * kChunk}});
  REQUIRE(store.commit(proto::CommitState::Paused));
  REQUIRE(store.remove());
}

TEST_CASE("a rank that never reserved has empty data files: adopt without a manifest starts empty, no problem") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("fresh", 1);
  { auto store = make_store(roots, id); }
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  CHECK((*r)->record_problem().empty());
  CHECK_FALSE((*r)->awaits_resume());
  REQUIRE((*r)->reserve(std::vector<proto::BlobSize>{{1, kChunk}}));
  REQUIRE((*r)->remove());
}

TEST_CASE("a checksum journal deleted mid-pause: the chunks it sealed are kept, and their use refused naming it") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("nosums", 1);
  const std::vector<proto::BlobSize> set{{1, 3 * kChunk}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    for (uint64_t c = 0; c < 3; ++c) write_chunk(*store, 1, c * kChunk, kChunk, 0x44);
    fill_checksums(*store, set);  // every chunk acknowledged: the rank may have released all of it
    dir = store->dir_path();
  }  // the daemon dies before the pause is committed
  const std::string data = read_text(dir + "/data");
  REQUIRE(std::filesystem::remove(dir + "/sums"));
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  CHECK_THAT((*r)->record_problem(), Catch::StartsWith("the checksum journal " + dir +
                                                       "/sums of the pause in progress when tmsdiskd stopped "
                                                       "is missing"));
  // Before, the chunks passed for never written: nothing held, and a closed connection removed the files.
  check_lost_record(**r, dir + "/data", data);
  REQUIRE((*r)->remove());
}

TEST_CASE(
    "a corrupt record in the checksum journal: that chunk is refused, the others verify, nothing is reserved over it") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("badsum", 1);
  const std::vector<proto::BlobSize> set{{1, 3 * kChunk}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    fill_checksums(*store, set);
    dir = store->dir_path();
  }  // the daemon dies before the pause is committed
  std::string sums = read_text(dir + "/sums");
  REQUIRE(sums.size() == 3 * 40);
  sums[40 + 16] ^= 0x01;  // the checksum of chunk 1
  write_text(dir + "/sums", sums);
  const std::string data = read_text(dir + "/data");
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  RankStore& store = **r;
  CHECK(store.record_problem().empty());
  CHECK(store.expected_checksum(1, 0));
  CHECK(store.expected_checksum(1, 2 * kChunk));
  auto bad = store.expected_checksum(1, kChunk);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EUCLEAN);
  CHECK_THAT(bad.error().message,
             Catch::Contains("the record of this chunk in the checksum journal " + dir + "/sums is corrupt") &&
                 Catch::Contains(dir + "/data (" + std::to_string(data.size()) + " bytes) is kept untouched"));
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());
  auto reserved = store.reserve(set);
  REQUIRE_FALSE(reserved);
  CHECK(reserved.error().errnum() == EBUSY);
  CHECK_THAT(reserved.error().message, Catch::Contains("1 chunk(s)") && Catch::Contains(dir + "/sums"));
  CHECK(read_text(dir + "/data") == data);
  REQUIRE(store.commit(proto::CommitState::Resumed));  // every allocation resident again
  CHECK_FALSE(store.awaits_resume());
  REQUIRE(store.reserve(set));
  REQUIRE(store.remove());
}

TEST_CASE("create keeps a directory of its own pid whose owner file is gone when its data file holds bytes") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("noowner", 2);
  const std::string data_path = paused_rank(roots, id);
  const std::string dir = std::filesystem::path(data_path).parent_path();
  const std::string data = read_text(data_path);
  REQUIRE(std::filesystem::remove(dir + "/owner"));
  // Its adoption fails for the missing owner (ENOENT), after which the daemon used to start afresh and
  // replace the directory, paused data and all.
  auto again = RankStore::create(roots, id, kChunk);
  REQUIRE_FALSE(again);
  CHECK(again.error().errnum() == EEXIST);
  CHECK_THAT(again.error().message, Catch::Contains(dir + " has no valid owner file") &&
                                        Catch::Contains("data file of " + std::to_string(data.size()) + " bytes"));
  CHECK(read_text(data_path) == data);
  CHECK(exists(dir + "/manifest"));
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("sweep removes dead ranks' directories and nothing else") {
  TempDir root;
  TempDir victim;
  write_text(victim / "precious", "keep me");
  Roots roots = open_roots({root.path()});

  RankIdentity dead = dead_identity("jobA");
  RankIdentity held = dead_identity("jobC");
  RankIdentity live = my_identity("jobB");
  std::string dead_dir, held_dir, live_dir;
  uint64_t dead_bytes = 0;
  for (auto* id : {&dead, &held, &live}) {
    auto s = make_store(roots, *id);
    REQUIRE(s->reserve(std::vector<proto::BlobSize>{{1, 4 * kChunk}}));
    fill_checksums(*s, std::vector<proto::BlobSize>{{1, 4 * kChunk}});
    REQUIRE(s->commit(proto::CommitState::Paused));
    if (id == &dead) {
      dead_dir = s->dir_path();
      dead_bytes = s->disk_bytes();
    }
    if (id == &held) held_dir = s->dir_path();
    if (id == &live) live_dir = s->dir_path();
  }  // stores dropped without remove(), as after a daemon restart

  // Things that are not ours: left alone, reported.
  std::filesystem::create_directories(root / "1000/jobD/notarank");
  std::filesystem::create_directories(root / "1000/jobD/rank5-77");  // no owner file
  std::filesystem::create_directory_symlink(victim.path(), root / "1000/jobE");
  std::filesystem::create_directory(victim / "rank0-1");
  std::filesystem::copy_file(dead_dir + "/owner", victim / "rank0-1/owner");
  std::filesystem::create_directories(root / "lost+found-like");  // not a uid: silently skipped

  std::vector<std::string> warnings;
  std::vector<std::string> asked;
  auto r = sweep_dead_ranks(
      roots,
      [&](const std::string& rel) {
        asked.push_back(rel);
        return rel == rank_relative_dir(held);
      },
      [&](const std::string& w) { warnings.push_back(w); });
  REQUIRE(r);
  CHECK(r->removed_dirs == 1);
  CHECK(r->removed_bytes >= dead_bytes);
  CHECK_FALSE(exists(dead_dir));
  CHECK_FALSE(exists(root / "1000/jobA"));  // emptied job directory goes too
  CHECK(exists(held_dir + "/manifest"));
  CHECK(exists(live_dir + "/manifest"));
  CHECK(exists(live_dir + "/data"));
  // Only dead owners are put to the daemon; a live one is kept before it is even asked.
  CHECK(std::find(asked.begin(), asked.end(), rank_relative_dir(live)) == asked.end());
  CHECK(std::find(asked.begin(), asked.end(), rank_relative_dir(held)) != asked.end());

  CHECK(exists(root / "1000/jobD/notarank"));
  CHECK(exists(root / "1000/jobD/rank5-77"));
  CHECK(exists(root / "lost+found-like"));
  CHECK(read_text(victim / "precious") == "keep me");
  CHECK(exists(victim / "rank0-1/owner"));
  auto mentions = [&](const std::string& s) {
    return std::any_of(warnings.begin(), warnings.end(),
                       [&](const std::string& w) { return w.find(s) != std::string::npos; });
  };
  CHECK(mentions("jobD/notarank"));
  CHECK(mentions("jobD/rank5-77"));
  CHECK(mentions("jobE"));
  CHECK_FALSE(mentions("lost+found-like"));

  // The live rank's store can still be adopted after the sweep.
  auto again = RankStore::adopt(roots, live, kChunk);
  REQUIRE(again);
  CHECK((*again)->paused());
  REQUIRE((*again)->commit(proto::CommitState::Resumed));
  REQUIRE((*again)->remove());
}

TEST_CASE("a reservation survives a daemon restart mid-pause: adopt knows the extents and the checksums sealed") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("midpause", 1);
  std::vector<proto::BlobSize> set{{1, 3 * kChunk}, {2, kChunk + 100}};
  uint64_t o2 = 0;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    fill_checksums(*store, std::vector<proto::BlobSize>{{1, 3 * kChunk}});
    o2 = offset_of(*store, 2, kChunk, kChunk + 100);
  }  // the daemon dies before the pause is committed
  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& store = **adopted;
  CHECK_FALSE(store.paused());
  CHECK(store.blobs().size() == 2);
  CHECK(offset_of(store, 2, kChunk, kChunk + 100) == o2);
  // The checksum journal kept what was sealed: no checksum from the rank is needed.
  for (uint64_t off = 0; off < 3 * kChunk; off += kChunk) {
    auto sum = store.expected_checksum(1, off);
    REQUIRE(sum);
    CHECK(sum->low == 1000 + off);
  }
  auto never = store.expected_checksum(2, 0);
  REQUIRE_FALSE(never);
  CHECK(never.error().errnum() == ENODATA);
  CHECK(store.missing_chunks() == 2);
  CHECK(store.holds_unresumed_data());  // chunks the rank may have released
}

TEST_CASE("seal records what was written and verify refuses a chunk that changed, also after a restart") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("seal", 1);
  std::vector<proto::BlobSize> set{{1, 2 * kChunk}};
  std::vector<uint8_t> chunk(kChunk, 0x5a);
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    auto sum = store->seal(1, 0, chunk);
    REQUIRE(sum);
    CHECK(store->verify(1, 0, chunk));
    CHECK_FALSE(store->seal(1, 0, std::span<const uint8_t>(chunk).first(100)));  // not the chunk's length
    auto unsealed = store->verify(1, kChunk, chunk);
    REQUIRE_FALSE(unsealed);
    CHECK(unsealed.error().errnum() == ENODATA);
  }  // the daemon dies before the pause is committed
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  CHECK((*adopted)->verify(1, 0, chunk));
  chunk[100] ^= 1;
  auto bad = (*adopted)->verify(1, 0, chunk);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE((*adopted)->remove());
}

TEST_CASE("checksums journaled for an earlier reservation are not taken for the next one") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("rejournal", 1);
  std::vector<proto::BlobSize> set{{1, 2 * kChunk}};
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    fill_checksums(*store, set);
    REQUIRE(store->reserve(set));  // the same layout again: a new pause that wrote nothing yet
  }
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  CHECK((*adopted)->missing_chunks() == 2);
  CHECK_FALSE((*adopted)->expected_checksum(1, 0));
}

// ------------------------------------------------------------------------------------------------
// Zero chunks, unchanged chunks, XXH3-128 checksums and the version-1 formats.

namespace {

std::vector<uint8_t> filled(uint32_t len, uint8_t byte) {
  return std::vector<uint8_t>(len, byte);
}

// Writes `bytes` at (blob, off) as the daemon does: begin_write() first, then the data file and
// end_write() unless the store found it unchanged. Returns whether it was unchanged.
bool write_through(RankStore& store, uint64_t blob, uint64_t off, const std::vector<uint8_t>& bytes) {
  auto plan = store.begin_write(blob, off, bytes);
  INFO((plan ? std::string() : plan.error().describe()));
  REQUIRE(plan);
  if (plan->unchanged) return true;
  write_chunk(store, blob, off, static_cast<uint32_t>(bytes.size()), bytes.empty() ? 0 : bytes[0]);
  REQUIRE(store.end_write(blob, off, static_cast<uint32_t>(bytes.size()), plan->sum));
  return false;
}

uint64_t allocated_bytes(const std::string& path) {
  return usage_of(path).blocks * 512;
}

Manifest manifest_of(const std::string& dir) {
  std::string why;
  auto m = decode_manifest(read_text(dir + "/manifest"), why);
  INFO(why);
  REQUIRE(m);
  return *m;
}

}  // namespace

TEST_CASE("manifest version 2 round trip: chunk states and 128-bit sums; version 1 decodes as XXH3-64 sums") {
  Manifest m;
  m.state = kManifestPaused;
  m.generation = 7;
  m.chunk_bytes = kChunk;
  m.data_end = {5 * kChunk};
  m.blobs.push_back(
      {.id = 3,
       .size = 4 * kChunk + 100,
       .extents = {{0, 5 * kChunk}},
       .states = {ChunkState::Data, ChunkState::Zero, ChunkState::Data64, ChunkState::Missing, ChunkState::Data},
       .sums = {{1, 2}, {}, {3, 0}, {}, {~uint64_t{0}, 5}}});
  const std::string bytes = encode_manifest(m);
  std::string why;
  auto back = decode_manifest(bytes, why);
  INFO(why);
  REQUIRE(back);
  CHECK(back->version == kManifestVersion);
  CHECK(back->generation == 7);
  REQUIRE(back->blobs.size() == 1);
  CHECK(back->blobs[0].states == m.blobs[0].states);
  CHECK(back->blobs[0].sums == m.blobs[0].sums);
  // Every byte is covered by the trailing hash; an unknown chunk state is refused even with a valid hash.
  std::string edited = bytes;
  edited[edited.size() - 9] ^= 1;
  CHECK_FALSE(decode_manifest(edited, why));

  auto v1 = decode_manifest(encode_manifest_v1(m), why);
  INFO(why);
  REQUIRE(v1);
  CHECK(v1->version == kManifestVersion1);
  const auto& b = v1->blobs[0];
  CHECK(b.states == std::vector<ChunkState>{ChunkState::Data64, ChunkState::Missing, ChunkState::Data64,
                                            ChunkState::Missing, ChunkState::Data64});
  CHECK(b.sums[0] == Checksum128{1, 0});  // the low half only: version 1 kept 64 bits
  CHECK(b.sums[4] == Checksum128{~uint64_t{0}, 0});
}

TEST_CASE("the checksum journal records 128-bit sums in 40-byte records, and reads a version-1 journal") {
  TempDir dir;
  UniqueFd d(::open(dir.path().c_str(), O_PATH | O_DIRECTORY));
  REQUIRE(d);
  auto j = detail::ChecksumJournal::open(d.get(), true, dir.path() + "/sums");
  REQUIRE(j);
  j->set_seed(99);
  REQUIRE(j->record(1, 5, 1, Checksum128{0x1111, 0x2222}));
  CHECK(read_text(dir.path() + "/sums").size() == 2 * detail::kJournalRecordBytes);
  auto recs = j->load(3);
  REQUIRE(recs);
  CHECK_FALSE((*recs)[0].valid);
  CHECK_FALSE((*recs)[0].corrupt);  // a hole: never written
  REQUIRE((*recs)[1].valid);
  CHECK((*recs)[1].checksum == Checksum128{0x1111, 0x2222});
  // The high half is covered by the record's own hash.
  std::string sums = read_text(dir.path() + "/sums");
  sums[40 + 24] ^= 1;
  write_text(dir.path() + "/sums", sums);
  recs = j->load(2);
  REQUIRE(recs);
  CHECK((*recs)[1].corrupt);

  REQUIRE(j->reset());
  j->set_seed(7);
  j->use_version1_layout();
  REQUIRE(j->record(1, 5, 1, Checksum128{0x3333, 0x4444}));
  CHECK(read_text(dir.path() + "/sums").size() == 2 * detail::kJournalRecordBytesV1);
  recs = j->load(2);
  REQUIRE(recs);
  REQUIRE((*recs)[1].valid);
  CHECK((*recs)[1].checksum == Checksum128{0x3333, 0});
}

TEST_CASE("zero chunks take no disk space, are recorded at the reservation and are never written nor read") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("zero", 1);
  const std::vector<proto::BlobSize> set{{1, 8 * kChunk}, {2, kChunk + 100}};
  const std::vector<proto::ChunkRun> runs{{1, 2, 4}, {2, 1, 1}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();

    SECTION("runs naming another blob, past a blob's end or overlapping are refused and change nothing") {
      for (const auto& bad : {std::vector<proto::ChunkRun>{{9, 0, 1}}, std::vector<proto::ChunkRun>{{1, 6, 3}},
                              std::vector<proto::ChunkRun>{{1, 0, 3}, {1, 2, 1}}}) {
        auto st = store->reserve(set, bad);
        REQUIRE_FALSE(st);
        CHECK(st.error().errnum() == EINVAL);
        CHECK(store->blob_count() == 0);
        CHECK(usage_of(dir + "/data").size == 0);
      }
    }

    REQUIRE(store->reserve(set, runs));
    // Blob 1: chunks 0, 1, 6, 7 hold data; blob 2: chunk 0 (its chunk 1, 100 bytes, is zero).
    CHECK(store->disk_bytes() == 5 * kChunk);
    CHECK(store->zero_bytes() == 4 * kChunk + 100);
    CHECK(store->chunk_count() == 10);
    CHECK(allocated_bytes(dir + "/data") <= 5 * kChunk + 16384);
    CHECK(usage_of(dir + "/data").size >= 9 * kChunk);  // sparse: the layout's whole length
    CHECK(store->missing_chunks() == 5);

    for (auto refused : {store->locate(1, 2 * kChunk, kChunk).error(), store->locate(2, kChunk, 100).error(),
                         store->begin_write(1, 5 * kChunk, filled(kChunk, 0)).error(),
                         store->expected_checksum(1, 3 * kChunk).error()}) {
      CHECK(refused.errnum() == EINVAL);
      CHECK_THAT(refused.message, Catch::Contains("reserved as zero"));
    }
    CHECK_FALSE(store->commit(proto::CommitState::Paused));  // data chunks still missing
    for (uint64_t off : {0u, 1u, 6u, 7u}) CHECK_FALSE(write_through(*store, 1, off * kChunk, filled(kChunk, 0x61)));
    CHECK_FALSE(write_through(*store, 2, 0, filled(kChunk, 0x62)));
    CHECK(store->missing_chunks() == 0);
    REQUIRE(store->commit(proto::CommitState::Paused));
  }
  // The committed manifest keeps them zero: an adopting daemon refuses them too, and verifies the rest.
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(store.paused());
  CHECK(store.disk_bytes() == 5 * kChunk);
  CHECK(store.verify(1, kChunk, filled(kChunk, 0x61)));
  auto zero = store.verify(1, 4 * kChunk, filled(kChunk, 0));
  REQUIRE_FALSE(zero);
  CHECK(zero.error().errnum() == EINVAL);
  REQUIRE(store.remove());
}

TEST_CASE("a zero chunk becomes data and data becomes zero across generations, its blocks punched") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("zerogen", 1));
  const std::string data = store->dir_path() + "/data";
  const std::vector<proto::BlobSize> set{{1, 8 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 8; ++c) write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(c + 1)));
  REQUIRE(store->commit(proto::CommitState::Paused));
  REQUIRE(store->commit(proto::CommitState::Resumed));
  const uint64_t full = allocated_bytes(data);
  CHECK(full >= 8 * kChunk);

  REQUIRE(store->reserve(set, std::vector<proto::ChunkRun>{{1, 0, 6}}));
  CHECK(store->disk_bytes() == 2 * kChunk);
  store->wait_for_punches();
  CHECK(allocated_bytes(data) <= full - 6 * kChunk);
  CHECK(store->missing_chunks() == 2);
  // The kept data chunks still hold their bytes; the zero ones read back as zeros from the file.
  CHECK(chunk_is(*store, 1, 7 * kChunk, kChunk, 8));
  CHECK(write_through(*store, 1, 6 * kChunk, filled(kChunk, 7)));  // unchanged: never punched
  CHECK(write_through(*store, 1, 7 * kChunk, filled(kChunk, 8)));
  REQUIRE(store->commit(proto::CommitState::Paused));
  REQUIRE(store->commit(proto::CommitState::Resumed));

  // Zero again to data: allocated again, and written (what the file held there was punched).
  REQUIRE(store->reserve(set));
  CHECK(store->disk_bytes() == 8 * kChunk);
  CHECK(allocated_bytes(data) >= 8 * kChunk);
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 1)));
  CHECK(chunk_is(*store, 1, 0, kChunk, 1));
  REQUIRE(store->remove());
}

// The space a reservation gives back is punched off the caller's thread (background_punch.h). A
// store of 8 chunks that all held data, about to be reserved with every chunk zero; `full` gets the
// bytes its file then has allocated.
std::unique_ptr<RankStore> store_of_data(Roots& roots, const std::string& job, uint64_t& full) {
  auto store = make_store(roots, my_identity(job, 1));
  const std::vector<proto::BlobSize> set{{1, 8 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 8; ++c) write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(c + 1)));
  REQUIRE(store->commit(proto::CommitState::Paused));
  REQUIRE(store->commit(proto::CommitState::Resumed));
  full = allocated_bytes(store->dir_path() + "/data");
  REQUIRE(full >= 8 * kChunk);
  return store;
}

TEST_CASE("a reservation returns before the space it gives back is punched, and its blocks come back after") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  uint64_t full = 0;
  auto store = store_of_data(roots, "punchlater", full);
  const std::string data = store->dir_path() + "/data";
  const std::vector<proto::BlobSize> set{{1, 8 * kChunk}};
  const std::vector<proto::ChunkRun> all_zero{{1, 0, 8}};
  {
    tmsdisk::testing::PunchGate gate;
    REQUIRE(store->reserve(set, all_zero));
    // Returned, while the punch is held at the gate: nothing was given back on this thread.
    REQUIRE(gate.wait_entered(1));
    CHECK(allocated_bytes(data) >= full);
    CHECK(store->disk_bytes() == 0);  // what the layout counts, at once
    // The pause goes on meanwhile: nothing to write, committed, resumed.
    CHECK(store->missing_chunks() == 0);
    REQUIRE(store->commit(proto::CommitState::Paused));
    REQUIRE(store->commit(proto::CommitState::Resumed));
    CHECK(allocated_bytes(data) >= full);
    gate.release();
    store->wait_for_punches();
    CHECK(allocated_bytes(data) + 8 * kChunk <= full);

    // The same zero set again: its ranges are holes already, nothing is punched (nor waited for).
    const int punched = gate.entered();
    const int waits = gate.waits();
    REQUIRE(store->reserve(set, all_zero));
    store->wait_for_punches();
    CHECK(gate.entered() == punched);
    CHECK(gate.waits() == waits);
  }
  // A daemon restarted may have stopped before its punches: an adopting store punches them again.
  store.reset();
  auto adopted = RankStore::adopt(roots, my_identity("punchlater", 1), kChunk);
  REQUIRE(adopted);
  tmsdisk::testing::PunchGate gate;
  gate.release();
  REQUIRE((*adopted)->reserve(set, all_zero));
  (*adopted)->wait_for_punches();
  CHECK(gate.entered() >= 1);
  CHECK(allocated_bytes(data) + 8 * kChunk <= full);
  REQUIRE((*adopted)->remove());
}

TEST_CASE("the next reservation waits for the punches of the one before, and its data over their ranges reads back") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  uint64_t full = 0;
  auto store = store_of_data(roots, "punchwait", full);
  const std::string data = store->dir_path() + "/data";
  const std::vector<proto::BlobSize> set{{1, 8 * kChunk}};
  tmsdisk::testing::PunchGate gate;
  REQUIRE(store->reserve(set, std::vector<proto::ChunkRun>{{1, 0, 8}}));
  REQUIRE(gate.wait_entered(1));
  REQUIRE(store->commit(proto::CommitState::Paused));
  REQUIRE(store->commit(proto::CommitState::Resumed));

  // The next pause makes every chunk data again, over the very ranges still to be punched: its
  // reservation must not return before that punch has landed, or the punch would land on its writes.
  Status next;
  CHECK(gate.waits_for_punches([&] { next = store->reserve(set); }));
  REQUIRE(next);
  CHECK(allocated_bytes(data) >= 8 * kChunk);  // preallocated again after the punch
  for (uint64_t c = 0; c < 8; ++c)
    CHECK_FALSE(write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(0x40 + c))));
  REQUIRE(store->commit(proto::CommitState::Paused));
  store->wait_for_punches();
  for (uint64_t c = 0; c < 8; ++c) {
    CHECK(chunk_is(*store, 1, c * kChunk, kChunk, static_cast<uint8_t>(0x40 + c)));
    CHECK(store->verify(1, c * kChunk, filled(kChunk, static_cast<uint8_t>(0x40 + c))));
  }
  REQUIRE(store->remove());
}

TEST_CASE("removing or destroying a store stops its punches at the next piece and waits for them") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  // Three pieces to punch (BackgroundPunch::kPunchPiece each at most); no need to write them, only to
  // have them allocated.
  const uint64_t size = 2 * storage::detail::BackgroundPunch::kPunchPiece + 4 * kChunk;
  const std::vector<proto::BlobSize> set{{1, size}};
  auto store = make_store(roots, my_identity("punchstop", 1));
  const std::string dir = store->dir_path();
  REQUIRE(store->reserve(set));
  tmsdisk::testing::PunchGate gate;
  REQUIRE(store->reserve(set, std::vector<proto::ChunkRun>{{1, 0, size / kChunk}}));
  REQUIRE(gate.wait_entered(1));

  const bool remove = GENERATE(true, false);
  Status removed;
  CHECK(gate.waits_for_punches([&] {
    if (remove)
      removed = store->remove();
    else
      store.reset();
  }));
  CHECK(removed);
  CHECK(gate.entered() == 1);  // stopped after the piece it was punching: the other two never began
  CHECK(exists(dir) != remove);
  if (!remove) {
    // A daemon that stopped mid-punch: its successor adopts the set, and punches the zero chunks again.
    auto adopted = RankStore::adopt(roots, my_identity("punchstop", 1), kChunk);
    REQUIRE(adopted);
    REQUIRE((*adopted)->remove());
  }
}

TEST_CASE("a set larger than the free space is reserved when its data chunks fit") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  constexpr uint32_t kBig = 64 << 20;  // few chunks, however large the filesystem
  auto store = make_store(roots, my_identity("sparse", 1), kBig);
  auto free = roots.free_bytes(0);
  REQUIRE(free);
  const uint64_t chunks = *free / kBig + 8;
  const uint64_t size = chunks * kBig + 4096;  // the last chunk, 4 KiB, holds the only data
  const std::vector<proto::BlobSize> set{{1, size}};
  auto nospace = store->reserve(set);
  REQUIRE_FALSE(nospace);
  CHECK(nospace.error().errnum() == ENOSPC);
  REQUIRE(store->reserve(set, std::vector<proto::ChunkRun>{{1, 0, chunks}}));
  CHECK(store->disk_bytes() == 4096);
  CHECK(store->missing_chunks() == 1);
  CHECK(usage_of(store->dir_path() + "/data").size == size);
  REQUIRE(store->remove());
}

TEST_CASE("a WRITE of the bytes the file provably holds is unchanged; anything doubtful is rewritten") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("unchanged", 1);
  const std::vector<proto::BlobSize> set{{1, 3 * kChunk}, {2, kChunk}};
  auto pause_all = [&](RankStore& store, uint8_t fill) {
    int unchanged = 0;
    for (const auto& b : set)
      for (uint64_t off = 0; off < b.size; off += kChunk)
        unchanged += write_through(store, b.id, off, filled(kChunk, fill));
    REQUIRE(store.commit(proto::CommitState::Paused));
    for (const auto& b : set)
      for (uint64_t off = 0; off < b.size; off += kChunk) CHECK(store.verify(b.id, off, filled(kChunk, fill)));
    REQUIRE(store.commit(proto::CommitState::Resumed));
    return unchanged;
  };
  {
    auto store = make_store(roots, id);
    const std::string data = store->dir_path() + "/data";
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 0);  // first pause: nothing known
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 4);  // pause, resume, pause of the same bytes
    // Changed bytes are rewritten; the others stay unchanged.
    REQUIRE(store->reserve(set));
    CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x32)));
    CHECK(write_through(*store, 1, 0, filled(kChunk, 0x31)));
    CHECK(chunk_is(*store, 1, kChunk, kChunk, 0x32));
    // A write that started and did not complete makes the chunk unknown, even for the same bytes.
    auto started = store->begin_write(1, 2 * kChunk, filled(kChunk, 0x33));
    REQUIRE(started);
    CHECK_FALSE(started->unchanged);
    CHECK_FALSE(write_through(*store, 1, 2 * kChunk, filled(kChunk, 0x31)));
    CHECK(write_through(*store, 2, 0, filled(kChunk, 0x31)));
    REQUIRE(store->commit(proto::CommitState::Paused));
    // A read that fails its check: the chunk is rewritten next time.
    CHECK_FALSE(store->verify(2, 0, filled(kChunk, 0x30)));
    REQUIRE(store->commit(proto::CommitState::Resumed));
    REQUIRE(store->reserve(set));
    CHECK_FALSE(write_through(*store, 2, 0, filled(kChunk, 0x31)));
    // A resized blob has new extents: rewritten.
    const std::vector<proto::BlobSize> resized{{1, 4 * kChunk}, {2, kChunk}};
    REQUIRE(store->reserve(resized));
    CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x31)));
    REQUIRE(store->reserve(set));
    // Blob 2 kept its extents and was rewritten above, but in a generation never committed: nothing
    // recorded what the file looked like after that write, so it is not trusted across a reservation.
    // The extents of the resized blob 1 are given back meanwhile: a commit while they are still being
    // punched records nothing either (the punches change the file after it), so they are waited for.
    store->wait_for_punches();
    CHECK(pause_all(*store, 0x31) == 0);
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 4);  // committed since: held again
  }
  {
    // A daemon restarted after the resume adopts the committed manifest's sums.
    auto adopted = RankStore::adopt(roots, id, kChunk);
    REQUIRE(adopted);
    REQUIRE((*adopted)->reserve(set));
    CHECK(pause_all(**adopted, 0x31) == 4);
    REQUIRE((*adopted)->reserve(set));
    CHECK(write_through(**adopted, 1, 0, filled(kChunk, 0x31)));
  }  // the daemon stops mid-pause
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  REQUIRE((*adopted)->reserve(set));
  CHECK(pause_all(**adopted, 0x31) == 0);  // a restart mid-pause: nothing is provably held
  REQUIRE((*adopted)->remove());
}

TEST_CASE(
    "a WRITE hashed elsewhere is unchanged only against what open_write found, and only if no other WRITE of the chunk "
    "opened since") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("settle", 1));
  const std::vector<proto::BlobSize> set{{1, 2 * kChunk}};
  REQUIRE(store->reserve(set));
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x11)));
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x22)));
  REQUIRE(store->commit(proto::CommitState::Paused));
  REQUIRE(store->commit(proto::CommitState::Resumed));
  REQUIRE(store->reserve(set));
  // What a hash worker would do between open_write() and settle_write().
  auto hash = [](const RankStore::WriteTicket& t, uint8_t fill) {
    return RankStore::hash_chunk(t.xxh64, filled(kChunk, fill));
  };

  // The same bytes, hashed elsewhere: unchanged, sealed at once.
  auto a = store->open_write(1, 0, kChunk);
  REQUIRE(a);
  CHECK(a->held);
  auto settled = store->settle_write(1, 0, kChunk, *a, hash(*a, 0x11));
  REQUIRE(settled);
  CHECK(settled->unchanged);
  CHECK(store->expected_checksum(1, 0));

  // Two WRITEs of one chunk in flight at once: neither is taken for unchanged (the second was opened
  // while what the file holds was already in doubt; the first finds a WRITE opened after it).
  auto b1 = store->open_write(1, kChunk, kChunk);
  auto b2 = store->open_write(1, kChunk, kChunk);
  REQUIRE((b1 && b2));
  CHECK(b1->held);
  CHECK_FALSE(b2->held);
  CHECK_FALSE(store->expected_checksum(1, kChunk));  // unknown while they are in flight
  auto s1 = store->settle_write(1, kChunk, kChunk, *b1, hash(*b1, 0x22));
  auto s2 = store->settle_write(1, kChunk, kChunk, *b2, hash(*b2, 0x22));
  REQUIRE((s1 && s2));
  CHECK_FALSE(s1->unchanged);
  CHECK_FALSE(s2->unchanged);
  write_chunk(*store, 1, kChunk, kChunk, 0x22);
  REQUIRE(store->end_write(1, kChunk, kChunk, s2->sum));

  // A WRITE whose hash comes back after another WRITE of its chunk was opened and written (other
  // bytes), and one more opened, is not taken for unchanged: the seal of the write in between does
  // not reset the count of WRITEs opened (were it reset, the third would count as the first again).
  auto c1 = store->open_write(1, 0, kChunk);
  REQUIRE(c1);
  CHECK(c1->held);
  auto c2 = store->open_write(1, 0, kChunk);
  REQUIRE(c2);
  write_chunk(*store, 1, 0, kChunk, 0x33);
  REQUIRE(store->end_write(1, 0, kChunk, hash(*c2, 0x33)));
  auto c3 = store->open_write(1, 0, kChunk);
  REQUIRE(c3);
  auto late = store->settle_write(1, 0, kChunk, *c1, hash(*c1, 0x11));
  REQUIRE(late);
  CHECK_FALSE(late->unchanged);  // the file holds 0x33 there now
  write_chunk(*store, 1, 0, kChunk, 0x11);
  REQUIRE(store->end_write(1, 0, kChunk, late->sum));

  REQUIRE(store->commit(proto::CommitState::Paused));
  CHECK(chunk_is(*store, 1, 0, kChunk, 0x11));
  CHECK(store->verify(1, 0, filled(kChunk, 0x11)));
  CHECK(store->verify(1, kChunk, filled(kChunk, 0x22)));
  REQUIRE(store->remove());
}

TEST_CASE("a READ verified elsewhere: open_read refuses what cannot be verified, settle_read answers as verify") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("settle-read", 1));
  const std::vector<proto::BlobSize> set{{1, 2 * kChunk}};
  REQUIRE(store->reserve(set));
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x41)));
  // Never written in this generation: refused before any I/O, as verify() refuses it.
  auto unwritten = store->open_read(1, kChunk, kChunk);
  REQUIRE_FALSE(unwritten);
  CHECK(unwritten.error().errnum() == ENODATA);
  CHECK_FALSE(store->open_read(1, 0, kChunk / 2));  // not the chunk's length
  CHECK_FALSE(store->open_read(2, 0, kChunk));      // no such blob
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x42)));
  REQUIRE(store->commit(proto::CommitState::Paused));

  // What a hash worker would do between open_read() and settle_read().
  auto ticket = store->open_read(1, 0, kChunk);
  REQUIRE(ticket);
  CHECK_FALSE(ticket->xxh64);  // sealed with an XXH3-128
  auto good = store->settle_read(1, 0, kChunk, RankStore::hash_chunk(ticket->xxh64, filled(kChunk, 0x41)));
  REQUIRE(good);
  CHECK(*good == *store->expected_checksum(1, 0));
  // The right bytes hashed the other way (XXH3-64) are not taken for the XXH3-128 sealed; other bytes
  // neither. EBADMSG, and the file is no longer trusted there (the next pause rewrites the chunk).
  auto other_kind = store->settle_read(1, kChunk, kChunk, RankStore::hash_chunk(true, filled(kChunk, 0x42)));
  REQUIRE_FALSE(other_kind);
  CHECK(other_kind.error().errnum() == EBADMSG);
  auto bad = store->settle_read(1, kChunk, kChunk, RankStore::hash_chunk(false, filled(kChunk, 0x43)));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE(store->commit(proto::CommitState::Resumed));
  REQUIRE(store->reserve(set));
  CHECK(write_through(*store, 1, 0, filled(kChunk, 0x41)));             // held there: unchanged
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x42)));  // in doubt after the mismatch: written
  REQUIRE(store->remove());
}

// A data file changed outside tmsdiskd while the memory it held was resident again: whatever the
// change, the next pause writes every chunk of that file again instead of taking the bytes it held
// for unchanged, and what it wrote reads back verified, with or without a daemon restart in between.
namespace {

constexpr uint64_t kDamageChunks = 4;
const std::vector<proto::BlobSize> kDamageSet{{1, kDamageChunks* kChunk}};

enum class Damage { FlipByte, Truncate, TruncateAndExtend, Replace };

// Pauses the set with every chunk filled with `fill` through `store`; returns how many chunks were
// unchanged. Then checks that each reads back verified from the file, and resumes.
int pause_and_resume(RankStore& store, uint8_t fill) {
  REQUIRE(store.reserve(kDamageSet));
  int unchanged = 0;
  for (uint64_t c = 0; c < kDamageChunks; ++c) unchanged += write_through(store, 1, c * kChunk, filled(kChunk, fill));
  REQUIRE(store.commit(proto::CommitState::Paused));
  for (uint64_t c = 0; c < kDamageChunks; ++c) {
    CHECK(chunk_is(store, 1, c * kChunk, kChunk, fill));
    CHECK(store.verify(1, c * kChunk, filled(kChunk, fill)));
  }
  REQUIRE(store.commit(proto::CommitState::Resumed));
  return unchanged;
}

// Does to the data file at `path` what root might, between two pauses.
void damage(const std::string& path, Damage how) {
  switch (how) {
    case Damage::FlipByte: {
      const int fd = ::open(path.c_str(), O_RDWR);
      REQUIRE(fd >= 0);
      unsigned char byte = 0;
      REQUIRE(::pread(fd, &byte, 1, kChunk + 100) == 1);
      byte ^= 0x01;
      REQUIRE(::pwrite(fd, &byte, 1, kChunk + 100) == 1);
      ::close(fd);
      break;
    }
    case Damage::Truncate:  // below the extents: chunks 2 and 3 are gone
      REQUIRE(::truncate(path.c_str(), 2 * kChunk) == 0);
      break;
    case Damage::TruncateAndExtend: {  // the same size as before, chunks 2 and 3 now zeros
      struct stat st {};
      REQUIRE(::stat(path.c_str(), &st) == 0);
      REQUIRE(::truncate(path.c_str(), 2 * kChunk) == 0);
      REQUIRE(::truncate(path.c_str(), st.st_size) == 0);
      break;
    }
    case Damage::Replace: {  // another file in its place: a copy, one byte flipped
      std::string bytes = read_text(path);
      REQUIRE(bytes.size() > kChunk + 100);
      bytes[kChunk + 100] = static_cast<char>(bytes[kChunk + 100] ^ 0x01);
      write_text(path + ".new", bytes);
      REQUIRE(::chmod((path + ".new").c_str(), 0600) == 0);
      REQUIRE(::rename((path + ".new").c_str(), path.c_str()) == 0);
      break;
    }
  }
}

const char* damage_name(Damage how) {
  switch (how) {
    case Damage::FlipByte: return "a flipped byte";
    case Damage::Truncate: return "truncated below its extents";
    case Damage::TruncateAndExtend: return "truncated below its extents and extended back";
    case Damage::Replace: return "replaced by another file";
  }
  return "";
}

}  // namespace

TEST_CASE("a data file changed outside tmsdiskd between pauses has every chunk rewritten, never taken as unchanged") {
  for (Damage how : {Damage::FlipByte, Damage::Truncate, Damage::TruncateAndExtend, Damage::Replace}) {
    INFO(damage_name(how));
    TempDir root;
    Roots roots = open_roots({root.path()});
    auto store = make_store(roots, my_identity("damaged", 1));
    const std::string data = store->dir_path() + "/data";
    CHECK(pause_and_resume(*store, 0x61) == 0);
    CHECK(pause_and_resume(*store, 0x61) == static_cast<int>(kDamageChunks));  // untouched: all unchanged
    damage(data, how);
    CHECK(pause_and_resume(*store, 0x61) == 0);  // written again, and verified
    // In the file at the data file's name, which a restarted daemon adopts (another file put there is
    // the one written from then on).
    CHECK(read_text(data).substr(0, kDamageChunks * kChunk) == std::string(kDamageChunks * kChunk, '\x61'));
    CHECK(pause_and_resume(*store, 0x61) == static_cast<int>(kDamageChunks));  // trusted again once rewritten
    REQUIRE(store->remove());
  }
}

TEST_CASE("after a daemon restart, a data file changed outside tmsdiskd is not trusted on the manifest's word") {
  for (Damage how : {Damage::FlipByte, Damage::TruncateAndExtend, Damage::Replace}) {
    INFO(damage_name(how));
    TempDir root;
    Roots roots = open_roots({root.path()});
    const RankIdentity id = my_identity("restarted", 1);
    std::string data;
    {
      auto store = make_store(roots, id);
      data = store->dir_path() + "/data";
      CHECK(pause_and_resume(*store, 0x62) == 0);
    }  // the daemon stops; root changes the file; a daemon starts and the rank reconnects
    {
      auto adopted = RankStore::adopt(roots, id, kChunk);
      REQUIRE(adopted);
      CHECK(pause_and_resume(**adopted, 0x62) == static_cast<int>(kDamageChunks));  // untouched: all unchanged
    }
    damage(data, how);
    auto adopted = RankStore::adopt(roots, id, kChunk);
    INFO((adopted ? std::string() : adopted.error().describe()));
    REQUIRE(adopted);
    CHECK((*adopted)->record_problem().empty());
    CHECK(pause_and_resume(**adopted, 0x62) == 0);  // written again, and verified
    REQUIRE((*adopted)->remove());
  }
}

TEST_CASE("manifest version 3 records each data file's identity; versions 2 and 1 read as none recorded") {
  Manifest m;
  m.state = kManifestResumed;
  m.generation = 4;
  m.chunk_bytes = kChunk;
  m.data_end = {kChunk, 0};
  m.data_files = {detail::FileIdentity{.dev = 1,
                                       .ino = 2,
                                       .size = kChunk,
                                       .mtime_sec = 3,
                                       .mtime_nsec = 4,
                                       .ctime_sec = 5,
                                       .ctime_nsec = 999'999'999},
                  std::nullopt};
  m.blobs.push_back({.id = 1,
                     .size = kChunk,
                     .extents = {{0, kChunk}, {0, 0}},
                     .states = {ChunkState::Data},
                     .sums = {Checksum128{7, 8}}});
  std::string why;
  auto back = decode_manifest(encode_manifest(m), why);
  INFO(why);
  REQUIRE(back);
  CHECK(back->version == 3);
  REQUIRE(back->data_files.size() == 2);
  CHECK(back->data_files[0] == m.data_files[0]);
  CHECK_FALSE(back->data_files[1]);
  auto v1 = decode_manifest(encode_manifest_v1(m), why);
  REQUIRE(v1);
  CHECK(v1->data_files.empty());
}

TEST_CASE(
    "a version-1 manifest is adopted and verified with XXH3-64; the next generation is written in the current "
    "version") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("legacy", 1);
  const std::vector<proto::BlobSize> set{{1, 2 * kChunk + 100}};
  const auto chunk0 = filled(kChunk, 0x41);
  const auto tail = filled(100, 0x42);
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();
    REQUIRE(store->reserve(set));
    write_through(*store, 1, 0, chunk0);
    write_through(*store, 1, kChunk, chunk0);
    write_through(*store, 1, 2 * kChunk, tail);
    REQUIRE(store->commit(proto::CommitState::Paused));
  }
  // Rewrite the manifest in version 1, as an older daemon would have: XXH3-64 of each chunk.
  Manifest m = manifest_of(dir);
  m.blobs[0].sums = {{XXH3_64bits(chunk0.data(), kChunk), 0},
                     {XXH3_64bits(chunk0.data(), kChunk), 0},
                     {XXH3_64bits(tail.data(), tail.size()), 0}};
  write_text(dir + "/manifest", encode_manifest_v1(m));

  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(store.record_problem().empty());
  CHECK(store.paused());
  CHECK(store.verify(1, 0, chunk0));
  CHECK(store.verify(1, 2 * kChunk, tail));
  // A READ verified on a hash worker: the ticket says which hash the chunk was sealed with.
  auto ticket = store.open_read(1, kChunk, kChunk);
  REQUIRE(ticket);
  CHECK(ticket->xxh64);
  CHECK(store.settle_read(1, kChunk, kChunk, RankStore::hash_chunk(ticket->xxh64, chunk0)));
  auto bad = store.verify(1, kChunk, filled(kChunk, 0x40));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE(store.commit(proto::CommitState::Resumed));
  CHECK(manifest_of(dir).version == kManifestVersion);
  // A 64-bit sum proves nothing against a 128-bit hash: the next pause writes everything.
  REQUIRE(store.reserve(set));
  CHECK_FALSE(write_through(store, 1, 0, chunk0));
  REQUIRE(store.remove());
}

TEST_CASE("a pause in progress under a version-1 record continues with XXH3-64 until its commit") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("legacyj", 1);
  const std::vector<proto::BlobSize> set{{1, 2 * kChunk}};
  const auto bytes = filled(kChunk, 0x51);
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();
    REQUIRE(store->reserve(set));
    write_chunk(*store, 1, 0, kChunk, 0x51);
  }
  // The "writing" manifest and the journal of chunk 0 in version 1, as an older daemon wrote them.
  const std::string v1 = encode_manifest_v1(manifest_of(dir));
  write_text(dir + "/manifest", v1);
  {
    UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY));
    auto j = detail::ChecksumJournal::open(d.get(), false, dir + "/sums");
    REQUIRE(j);
    REQUIRE(j->reset());
    j->set_seed(XXH3_64bits(v1.data(), v1.size()));
    j->use_version1_layout();
    REQUIRE(j->record(0, 1, 0, Checksum128{XXH3_64bits(bytes.data(), bytes.size()), 0}));
  }
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(store.missing_chunks() == 1);
  CHECK(store.verify(1, 0, bytes));
  auto sealed = store.seal(1, kChunk, bytes);
  REQUIRE(sealed);
  CHECK(*sealed == Checksum128{XXH3_64bits(bytes.data(), bytes.size()), 0});
  REQUIRE(store.commit(proto::CommitState::Paused));
  Manifest m = manifest_of(dir);
  CHECK(m.version == kManifestVersion);
  CHECK(m.blobs[0].states == std::vector<ChunkState>{ChunkState::Data64, ChunkState::Data64});
  CHECK(store.verify(1, kChunk, bytes));
  REQUIRE(store.remove());
}

namespace {

// Writes `fill` over every chunk of `blob` and seals it, as a pause would.
void write_and_seal(RankStore& store, uint64_t blob, uint64_t size, unsigned char fill) {
  for (uint64_t off = 0; off < size; off += kChunk) {
    const auto len = static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off));
    write_chunk(store, blob, off, len, fill);
    std::vector<uint8_t> bytes(len, fill);
    REQUIRE(store.seal(blob, off, bytes));
  }
}

// Every chunk of `blob` reads back as `fill` and verifies against its seal.
void check_blob(RankStore& store, uint64_t blob, uint64_t size, unsigned char fill) {
  for (uint64_t off = 0; off < size; off += kChunk) {
    const auto len = static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off));
    CHECK(chunk_is(store, blob, off, len, fill));
    std::vector<uint8_t> bytes(len, fill);
    auto v = store.verify(blob, off, bytes);
    INFO((v ? std::string() : v.error().describe()));
    CHECK(v);
  }
}

}  // namespace

TEST_CASE("a carried blob stays paused across new sets: its extents, seals and bytes pass untouched") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("carry", 1);
  const uint64_t size1 = 3 * kChunk + 100, size2 = 2 * kChunk;
  auto store = make_store(roots, id);
  // Part A paused and committed.
  REQUIRE(store->reserve(std::vector<proto::BlobSize>{{1, size1}}));
  write_and_seal(*store, 1, size1, 0xa1);
  REQUIRE(store->commit(proto::CommitState::Paused));
  const uint64_t generation = store->generation();
  const uint64_t where = offset_of(*store, 1, kChunk, size1);
  // Part B pauses while A stays paused: only a set that carries A may replace the committed one.
  const std::vector<proto::BlobSize> both{{1, size1}, {2, size2}};
  auto refused = store->reserve(both);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EBUSY);
  const std::vector<uint64_t> carry_a{1};
  REQUIRE(store->reserve(both, {}, {}, carry_a));
  CHECK_FALSE(store->paused());
  CHECK(store->holds_unresumed_data());  // A's chunks are still the only copy
  CHECK(store->missing_chunks() == 2);   // B's, to be written
  CHECK(offset_of(*store, 1, kChunk, size1) == where);
  check_blob(*store, 1, size1, 0xa1);
  write_and_seal(*store, 2, size2, 0xb2);
  REQUIRE(store->commit(proto::CommitState::Paused));
  CHECK(store->generation() == generation + 1);
  store.reset();  // the daemon restarts with both parts paused

  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& again = **adopted;
  CHECK(again.paused());
  check_blob(again, 1, size1, 0xa1);
  check_blob(again, 2, size2, 0xb2);
  // A resumes while B stays paused: a set of B alone, carried; A's extents are recycled.
  const std::vector<uint64_t> carry_b{2};
  REQUIRE(again.reserve(std::vector<proto::BlobSize>{{2, size2}}, {}, {}, carry_b));
  CHECK(again.missing_chunks() == 0);
  CHECK_FALSE(again.locate(1, 0, kChunk));
  check_blob(again, 2, size2, 0xb2);
  REQUIRE(again.commit(proto::CommitState::Paused));
  check_blob(again, 2, size2, 0xb2);
  REQUIRE(again.remove());
}

TEST_CASE("a set that carries survives a daemon restart before its commit: the carried seals are in its record") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("carry-restart", 1);
  const uint64_t size1 = 2 * kChunk, size2 = kChunk;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(std::vector<proto::BlobSize>{{1, size1}}));
    write_and_seal(*store, 1, size1, 0x11);
    REQUIRE(store->commit(proto::CommitState::Paused));
    const std::vector<uint64_t> carry{1};
    REQUIRE(store->reserve(std::vector<proto::BlobSize>{{1, size1}, {2, size2}}, {}, {}, carry));
  }  // dies before B is written
  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& store = **adopted;
  CHECK(store.record_problem().empty());
  CHECK(store.missing_chunks() == 1);
  CHECK(store.holds_unresumed_data());
  check_blob(store, 1, size1, 0x11);
  REQUIRE(store.remove());
}

TEST_CASE("carrying is refused for a blob not held as it is, with chunks never written, or named by a run") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  auto store = make_store(roots, my_identity("carry-refused", 1));
  const std::vector<proto::BlobSize> set{{1, 2 * kChunk}, {2, kChunk}};
  REQUIRE(store->reserve(set));
  write_and_seal(*store, 1, 2 * kChunk, 0x33);  // blob 2 never written
  auto refused = [&](std::vector<proto::BlobSize> next, std::vector<uint64_t> carry,
                     std::vector<proto::ChunkRun> zero = {}) {
    auto st = store->reserve(next, zero, {}, carry);
    REQUIRE_FALSE(st);
    CHECK(st.error().errnum() == EINVAL);
    return st.error().describe();
  };
  CHECK_THAT(refused(set, {3}), Catch::Contains("blob 3 is carried but not held"));
  CHECK_THAT(refused({{1, kChunk}, {2, kChunk}}, {1}), Catch::Contains("blob 1 is carried but not held"));
  CHECK_THAT(refused(set, {2}), Catch::Contains("1 of its chunks were never written"));
  CHECK_THAT(refused(set, {1, 1}), Catch::Contains("carried twice"));
  CHECK_THAT(refused(set, {1}, {{.blob = 1, .first_chunk = 0, .count = 1}}), Catch::Contains("carried as it is"));
  // Refused without a change: blob 1 is where it was and verifies.
  check_blob(*store, 1, 2 * kChunk, 0x33);
}
