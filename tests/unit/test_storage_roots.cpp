// SPDX-License-Identifier: Apache-2.0
// Storage, job names, rank directory names, and the roots: what Roots::open accepts, and the root a
// backup directory names.
#include <fcntl.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "storage.h"
#include "storage_fixtures.h"
#include "tmsdisk/protocol/messages.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;

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
