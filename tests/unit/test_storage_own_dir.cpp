// SPDX-License-Identifier: Apache-2.0
// Storage, a directory of the rank's choosing (Roots::open_rank_directory): what it must be, the
// rank's files in it under their prefix beside anything else, what remove deletes, the sweep of dead
// ranks' files there, and the rank's objects beside them.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "object_store.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "tmsdisk/common/memory_filesystem.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;

namespace {

UniqueFd open_path(const std::string& path, int flags = O_DIRECTORY) {
  UniqueFd fd(::open(path.c_str(), O_PATH | O_CLOEXEC | flags));
  REQUIRE(fd);
  return fd;
}

Roots rank_directory(const std::string& path) {
  auto r = Roots::open_rank_directory(open_path(path), ::getuid(), path, false);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  return std::move(r).value();
}

std::string prefix_of(const RankIdentity& id) {
  return rank_file_prefix(id);
}

}  // namespace

TEST_CASE("a rank's files in a directory of its choosing carry its prefix, beside the user's, and go alone") {
  TempDir dir;
  write_text(dir / "notes.txt", "the user's");
  Roots roots = rank_directory(dir.path());
  CHECK(roots.rank_chosen());
  CHECK(roots.size() == 1);
  const RankIdentity id = my_identity("job1", 3);
  auto store = make_store(roots, id);
  const std::string p = "tmsdisk-job1-rank3-" + std::to_string(::getpid()) + ".";
  CHECK(prefix_of(id) == p);
  CHECK(store->in_own_directory());
  CHECK(store->dir_path() == std::filesystem::canonical(dir.path()).string());
  CHECK(entries(dir.path()) == std::set<std::string>{"notes.txt", p + "owner", p + "data", p + "sums"});
  CHECK(mode_of(dir / (p + "data")) == 0600);
  CHECK_THAT(read_text(dir / (p + "owner")), Catch::Contains("job job1\n"));

  const std::vector<storage::BlobSize> set{{1, 3 * kChunk}};
  auto reserved = store->reserve(set);
  INFO((reserved ? std::string() : reserved.error().describe()));
  REQUIRE(reserved);
  write_set(*store, set);
  REQUIRE(store->commit(CommitState::Paused));
  CHECK(exists(dir / (p + "manifest")));
  CHECK(reads_back(*store, 1, kChunk, chunk_bytes_of(*store, 1, kChunk, 3 * kChunk)));

  // An object store beside it names its files the same way.
  auto objects = ObjectStore::open(roots, store->dir_fds(), store->file_names(), kChunk);
  REQUIRE(objects);
  CHECK(exists(dir / (p + "objects")));
  CHECK(exists(dir / (p + "objects.log")));
  objects->reset();  // the store's files stay; remove() below takes them with the rank's

  REQUIRE(store->remove());
  CHECK(entries(dir.path()) == std::set<std::string>{"notes.txt"});
  CHECK(read_text(dir / "notes.txt") == "the user's");
}

TEST_CASE("a directory of the rank's choosing must be a directory, the rank's user's, closed to others") {
  TempDir dir;
  SECTION("writable by the group") {
    REQUIRE(::chmod(dir.path().c_str(), 0775) == 0);
    auto r = Roots::open_rank_directory(open_path(dir.path()), ::getuid(), dir.path(), false);
    REQUIRE_FALSE(r);
    CHECK(r.error().errnum() == EACCES);
    CHECK_THAT(r.error().message, Catch::Contains("writable by others"));
  }
  SECTION("a file") {
    write_text(dir / "f", "x");
    auto r = Roots::open_rank_directory(open_path(dir / "f", 0), ::getuid(), dir / "f", false);
    REQUIRE_FALSE(r);
    CHECK(r.error().errnum() == ENOTDIR);
  }
  SECTION("another user's") {
    // The directory is this process's user's; the rank says it is uid 4242's.
    auto r = Roots::open_rank_directory(open_path(dir.path()), ::getuid() == 4242 ? 4243 : 4242, dir.path(), false);
    if (::getuid() == 0) {
      // uid 4242 asks for root's directory: refused. (Root itself may name any directory.)
      REQUIRE_FALSE(r);
      CHECK(r.error().errnum() == EACCES);
      CHECK_THAT(r.error().message, Catch::Contains("belongs to uid 0"));
    } else {
      REQUIRE_FALSE(r);
      CHECK(r.error().errnum() == EACCES);
    }
  }
  SECTION("the message names the directory as the kernel does, not as the client said") {
    auto r = Roots::open_rank_directory(open_path(dir.path()), ::getuid(), "/claimed/elsewhere", false);
    REQUIRE(r);
    CHECK((*r)[0].path == std::filesystem::canonical(dir.path()).string());
  }
  CHECK(entries(dir.path()).size() <= 1);  // nothing made in it but the section's own file
}

TEST_CASE("a file put at the rank's data file's name in its directory is never written") {
  TempDir dir;
  Roots roots = rank_directory(dir.path());
  const RankIdentity id = my_identity("job1", 0);
  auto store = make_store(roots, id);
  const std::string data = dir / (rank_file_prefix(id) + "data");
  // The user may write the directory: the data file replaced by one of theirs, linked elsewhere too.
  REQUIRE(::unlink(data.c_str()) == 0);
  write_text(data, "planted");
  REQUIRE(::link(data.c_str(), (dir / "elsewhere").c_str()) == 0);
  auto reserved = store->reserve(std::vector<storage::BlobSize>{{1, kChunk}});
  REQUIRE_FALSE(reserved);
  CHECK(reserved.error().errnum() == EPERM);
  CHECK_THAT(reserved.error().message, Catch::Contains("not a file of tmsdiskd's own"));
  CHECK(read_text(dir / "elsewhere") == "planted");
}

TEST_CASE("filesystems that can hold up the daemon are named, and disks are not") {
  CHECK(std::string(blocking_filesystem(FUSE_SUPER_MAGIC)) == "FUSE");
  CHECK(std::string(blocking_filesystem(NFS_SUPER_MAGIC)) == "NFS");
  CHECK(std::string(blocking_filesystem(V9FS_MAGIC)) == "9p");
  CHECK(blocking_filesystem(EXT4_SUPER_MAGIC) == nullptr);
  CHECK(blocking_filesystem(XFS_SUPER_MAGIC) == nullptr);
  CHECK(blocking_filesystem(TMPFS_MAGIC) == nullptr);  // in memory: refused otherwise, unless allowed
}

TEST_CASE("the next rank in a directory removes a dead rank's files there, and nothing else") {
  TempDir dir;
  Roots roots = rank_directory(dir.path());
  RankIdentity dead = dead_identity("jobA", 1);
  {
    auto s = make_store(roots, dead);
    const std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
    REQUIRE(s->reserve(set));
    write_set(*s, set);
  }  // destroyed without remove(): as after a daemon crash
  const std::string dead_prefix = prefix_of(dead);
  REQUIRE(exists(dir / (dead_prefix + "data")));
  auto live = make_store(roots, my_identity("jobB", 0));
  // A file that looks like an owner file but is not tmsdiskd's, and the user's own: left alone.
  write_text(dir / "tmsdisk-mine.owner", "not an owner file");
  write_text(dir / "notes.txt", "x");

  auto next = make_store(roots, my_identity("jobC", 0));
  for (const auto& name : entries(dir.path())) CHECK(name.rfind(dead_prefix, 0) != 0);
  CHECK(exists(dir / (prefix_of(my_identity("jobB", 0)) + "data")));  // alive: kept
  CHECK(exists(dir / "tmsdisk-mine.owner"));
  CHECK(exists(dir / "notes.txt"));

  // Files of its own name whose owner is this live process: refused, kept.
  auto dup = RankStore::create(roots, my_identity("jobB", 0), kChunk);
  REQUIRE_FALSE(dup);
  CHECK(dup.error().errnum() == EEXIST);
  CHECK(exists(dir / (prefix_of(my_identity("jobB", 0)) + "data")));
  REQUIRE(next->remove());
  REQUIRE(live->remove());
}

TEST_CASE("a rank store in a directory of its choosing is adopted after a restart") {
  TempDir dir;
  Roots roots = rank_directory(dir.path());
  const RankIdentity id = my_identity("job1", 0);
  const std::vector<storage::BlobSize> set{{7, 2 * kChunk}};
  {
    auto s = make_store(roots, id);
    REQUIRE(s->reserve(set));
    write_set(*s, set);
    REQUIRE(s->commit(CommitState::Paused));
  }
  Roots again = rank_directory(dir.path());
  auto adopted = RankStore::adopt(again, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  CHECK((*adopted)->paused());
  CHECK(reads_back(**adopted, 7, 0, chunk_bytes_of(**adopted, 7, 0, 2 * kChunk)));
  REQUIRE((*adopted)->remove());
  CHECK(entries(dir.path()).empty());
}
