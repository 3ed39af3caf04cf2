// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, a directory of the rank's choosing (TMS_DISK_BACKUP_DIR outside the roots,
// torch_memory_saver's set_disk_backup_dir): handed over by descriptor at HELLO or with SET_RANK_DIR,
// the rank's files kept in it under their prefix and removed with the session; refused for another
// user's directory, one others may write, one in memory, and while the rank is paused.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "daemon_fixture.h"
#include "other_user.h"
#include "test_support.h"
#include "tmsdisk/protocol/client.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;

namespace {

UniqueFd open_dir(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  REQUIRE(fd);
  return fd;
}

std::set<std::string> names_in(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string prefix_of(const std::string& job, int64_t rank) {
  return "tmsdisk-" + job + "-rank" + std::to_string(rank) + "-" + std::to_string(::getpid()) + ".";
}

// Pauses `blobs` (reserved, written, committed), reads them back verified and commits the resume.
void pause_and_resume(ShimClient& c, const std::vector<proto::BlobSize>& blobs) {
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(blobs, check_pattern));
  REQUIRE(c.commit(proto::CommitState::Resumed));
}

Status set_rank_dir(ShimClient& c, int dir, const std::string& named) {
  proto::SetRankDir m;
  m.path = named;
  auto r = c.call(m, dir);
  if (!r) return std::move(r).error();
  return {};
}

}  // namespace

TEST_CASE("a rank's files go in the directory it hands over: prefixed, beside the user's, removed with it") {
  Daemon d;
  d.start();
  TempDir own{test_tmp_root()};
  std::ofstream(own / "notes.txt") << "the user's own file";
  UniqueFd dir = open_dir(own.path());
  {
    auto c = d.shim({.job = "own", .rank = 2, .dir_fd = dir.get()});
    CHECK(c.welcome().rank_dir == fs::canonical(own.path()).string());
    const std::vector<proto::BlobSize> blobs = {{1, 12 * MiB}};
    REQUIRE(c.reserve(blobs));
    REQUIRE(c.write_all(blobs, fill_pattern));
    REQUIRE(c.commit(proto::CommitState::Paused));
    const std::string p = prefix_of("own", 2);
    const std::set<std::string> names = names_in(own.path());
    for (const char* f : {"owner", "data", "manifest", "sums"}) CHECK(names.count(p + f) == 1);
    CHECK(names.count("notes.txt") == 1);
    CHECK(fs::file_size(own / (p + "data")) >= 12 * MiB);  // what a listing of the directory shows
    // Nothing of it under the daemon's root.
    CHECK_FALSE(fs::exists(d.roots[0] + "/" + std::to_string(::getuid()) + "/own"));
    REQUIRE(c.read_all(blobs, check_pattern));
    REQUIRE(c.commit(proto::CommitState::Resumed));
  }
  // The session ended: its files go, the directory and the user's file stay.
  CHECK(eventually([&] { return names_in(own.path()) == std::set<std::string>{"notes.txt"}; }));
  CHECK(fs::is_directory(own.path()));
}

TEST_CASE("a rank's directory is refused when it is another user's, writable by others, or in memory") {
  Daemon d;
  d.start();
  SECTION("writable by its group") {
    TempDir own{test_tmp_root()};
    REQUIRE(::chmod(own.path().c_str(), 0770) == 0);
    UniqueFd dir = open_dir(own.path());
    auto c = d.try_shim({.job = "open", .dir_fd = dir.get()});
    REQUIRE_FALSE(c);
    CHECK(c.error().errnum() == EACCES);
    CHECK_THAT(c.error().message, Catch::Contains("writable by others"));
    CHECK(fs::is_empty(own.path()));
  }
  SECTION("not a directory") {
    TempDir own{test_tmp_root()};
    std::ofstream(own / "file") << "x";
    UniqueFd file(::open((own / "file").c_str(), O_PATH | O_CLOEXEC));
    REQUIRE(file);
    auto c = d.try_shim({.job = "file", .dir_fd = file.get()});
    REQUIRE_FALSE(c);
    CHECK(c.error().errnum() == ENOTDIR);
  }
  SECTION("HELLO says a directory rides along and none does") {
    proto::Hello h;
    h.role = static_cast<uint8_t>(proto::Role::Shim);
    h.job = "flagonly";
    h.flags = proto::kHelloRankDir;
    auto r = proto::connect_and_hello(d.socket, h, 60'000);
    REQUIRE_FALSE(r);
    CHECK(r.error == EINVAL);
  }
  SECTION("in memory (tmpfs)") {
    struct statfs st {};
    if (::statfs("/dev/shm", &st) != 0 || st.f_type != 0x01021994) skip("/dev/shm is not a tmpfs here");
    TempDir own{"/dev/shm"};
    UniqueFd dir = open_dir(own.path());
    auto c = d.try_shim({.job = "ram", .dir_fd = dir.get()});
    REQUIRE_FALSE(c);
    CHECK(c.error().errnum() == EINVAL);
    CHECK_THAT(c.error().message, Catch::Contains("tmpfs"));
    CHECK(fs::is_empty(own.path()));
  }
}

TEST_CASE("a rank may not hand over another user's directory") {
  Daemon d;
  d.start();
  if (::geteuid() != 0) skip("needs root to switch to another uid");
  TempDir own{test_tmp_root()};  // root's
  const int rc = as_other_user([&]() -> int {
    UniqueFd dir(::open(own.path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!dir) return 2;
    proto::Hello h;
    h.role = static_cast<uint8_t>(proto::Role::Shim);
    h.job = "theirs";
    h.flags = proto::kHelloRankDir;
    auto r = proto::connect_and_hello(d.socket, h, 60'000, dir.get());
    if (!r && !r.refused && (r.error == EACCES || r.error == ENOENT || r.error == ECONNREFUSED)) return kUnreachable;
    if (r) return 3;
    if (r.error != EACCES || r.message.find("belongs to uid 0") == std::string::npos) return 4;
    return 0;
  });
  CHECK(rc == 0);
  CHECK(fs::is_empty(own.path()));
}

TEST_CASE("SET_RANK_DIR moves a running rank's files, is refused while it is paused, and a root brings them back") {
  Daemon d;
  d.start();
  TempDir own{test_tmp_root()};
  UniqueFd dir = open_dir(own.path());
  auto c = d.shim({.job = "move"});
  const std::string under_root = d.rank_dir(0, "move", 0, ::getpid());
  const std::vector<proto::BlobSize> blobs = {{1, 8 * MiB}};

  // Paused: refused, its files where they were.
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  auto refused = set_rank_dir(c, dir.get(), own.path());
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EBUSY);
  CHECK_THAT(refused.error().message, Catch::Contains("Resume it first"));
  CHECK(fs::exists(under_root + "/data"));
  CHECK(fs::is_empty(own.path()));
  REQUIRE(c.read_all(blobs, check_pattern));
  REQUIRE(c.commit(proto::CommitState::Resumed));

  // Resumed: moved; its next pause is in the new directory.
  REQUIRE(set_rank_dir(c, dir.get(), own.path()));
  CHECK_FALSE(fs::exists(under_root));
  pause_and_resume(c, blobs);
  CHECK(names_in(own.path()).count(prefix_of("move", 0) + "data") == 1);

  // The root hands the daemon's own layout back; the directory is left empty.
  UniqueFd root = open_dir(d.roots[0]);
  REQUIRE(set_rank_dir(c, root.get(), d.roots[0]));
  CHECK(fs::is_empty(own.path()));
  pause_and_resume(c, blobs);
  CHECK(fs::exists(under_root + "/data"));

  // Without the directory's descriptor: refused, nothing changes.
  auto bare = set_rank_dir(c, -1, own.path());
  REQUIRE_FALSE(bare);
  CHECK(bare.error().errnum() == EINVAL);
  CHECK(fs::exists(under_root + "/data"));
}

TEST_CASE("a rank that died while no daemon held its directory has its files removed by the next rank there") {
  TempDir own{test_tmp_root()};
  UniqueFd dir = open_dir(own.path());
  pid_t child = 0;
  {
    Daemon first;
    first.start();
    child = fork_client([&] {
      auto c = ShimClient::connect(
          first.socket, {.job = "gone", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB, .dir_fd = dir.get()});
      return c && c->reserve({{1, 8 * MiB}}) && c->write_all({{1, 8 * MiB}}, fill_pattern) &&
             c->commit(proto::CommitState::Paused);
    });
    first.proc.kill9();  // the daemon dies first: nothing removes the rank's files
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  const std::string gone = "tmsdisk-gone-rank0-" + std::to_string(child) + ".";
  REQUIRE(names_in(own.path()).count(gone + "data") == 1);
  std::ofstream(own / "tmsdisk-notes.owner") << "not an owner file";  // not tmsdiskd's: left alone
  Daemon d;
  d.start();
  auto c = d.shim({.job = "next", .dir_fd = dir.get()});
  const std::set<std::string> names = names_in(own.path());
  for (const auto& n : names) CHECK(n.rfind(gone, 0) != 0);
  CHECK(names.count("tmsdisk-notes.owner") == 1);
  CHECK(names.count(prefix_of("next", 0) + "owner") == 1);
}
