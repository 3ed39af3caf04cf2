// SPDX-License-Identifier: Apache-2.0
// Storage, rank directories: what create makes and refuses (planted links, a live owner, a failure
// on a later root), what remove deletes, and the sweep of dead ranks' directories.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "storage.h"
#include "storage_fixtures.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;

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
  CHECK(store->dir_path() == root / rank_relative_dir(id));  // the directory the sweep is told of
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
  std::vector<storage::BlobSize> set{{1, kChunk}};
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
    REQUIRE(s->reserve(std::vector<storage::BlobSize>{{1, kChunk}}));
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
    REQUIRE(s->reserve(std::vector<storage::BlobSize>{{1, 4 * kChunk}}));
    write_set(*s, std::vector<storage::BlobSize>{{1, 4 * kChunk}});
    REQUIRE(s->commit(storage::CommitState::Paused));
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
  REQUIRE((*again)->commit(storage::CommitState::Resumed));
  REQUIRE((*again)->remove());
}
