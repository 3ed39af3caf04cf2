// SPDX-License-Identifier: Apache-2.0
// The private daemon's socket directory is trusted only when it is this user's own and closed.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "skip.h"
#include "temp_dir.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/private_daemon.h"

namespace fs = std::filesystem;

namespace {

// A fresh, empty parent for the socket directory, removed again by the case.
fs::path fresh_base(const std::string& name) {
  const fs::path base = fs::path(tmsdisk::testing::test_tmp_root()) / (name + "-" + std::to_string(::getpid()));
  fs::remove_all(base);
  fs::create_directories(base);
  return base;
}

}  // namespace

TEST_CASE("a private socket directory must be ours, mode 0700, and not a symlink") {
  const fs::path base = fresh_base("private");
  const fs::path dir = base / "tmsdisk";
  const std::string socket = (dir / "tmsdiskd.sock").string();

  CHECK_FALSE(tmsdisk::private_dir_trusted(socket));  // missing
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  CHECK_FALSE(tmsdisk::private_dir_trusted(socket));  // open to others
  // Spawning is refused outright: no daemon is started, nothing listens.
  CHECK(tmsdisk::spawn_private_daemon("/bin/false", socket, 100) == -EPERM);
  REQUIRE(::chmod(dir.c_str(), 0700) == 0);
  CHECK(tmsdisk::private_dir_trusted(socket));
  fs::remove(dir);
  fs::create_directories(base / "elsewhere");
  ::chmod((base / "elsewhere").c_str(), 0700);
  fs::create_directory_symlink(base / "elsewhere", dir);
  CHECK_FALSE(tmsdisk::private_dir_trusted(socket));  // lstat: a symlink is not the directory
  fs::remove_all(base);
}

TEST_CASE("a private socket directory another user made first is not trusted", "[root]") {
  if (::geteuid() != 0) tmsdisk::testing::skip("needs root to give the directory to another user");
  const fs::path base = fresh_base("private-owner");
  const fs::path dir = base / "tmsdisk";
  const std::string socket = (dir / "tmsdiskd.sock").string();
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  REQUIRE(tmsdisk::private_dir_trusted(socket));
  REQUIRE(::chown(dir.c_str(), 65534, 65534) == 0);  // as if another user had made it first
  CHECK_FALSE(tmsdisk::private_dir_trusted(socket));
  CHECK(tmsdisk::spawn_private_daemon("/bin/false", socket, 100) == -EPERM);
  fs::remove_all(base);
}
