// SPDX-License-Identifier: Apache-2.0
// The private daemon's socket directory is trusted only when it is this user's own and closed.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>

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
  std::string why;
  CHECK(tmsdisk::spawn_private_daemon("/bin/false", socket, 100, &why) == -EPERM);
  // The words the shim logs and tmsctl prints: whose it is, and what to do.
  CHECK(why.find(dir.string() + " belongs to another user (uid 65534)") != std::string::npos);
  CHECK(why.find("ask its owner or root to remove it, or set XDG_RUNTIME_DIR") != std::string::npos);
  fs::remove_all(base);
}

namespace {

// A stand-in for tmsdiskd: a shell script with `body`, executable.
std::string fake_daemon(const fs::path& base, const std::string& body) {
  const fs::path path = base / "tmsdiskd";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  fs::permissions(path, fs::perms::owner_all);
  return path.string();
}

}  // namespace

TEST_CASE("a private daemon that fails to start is reported at once, in its own words") {
  const fs::path base = fresh_base("private-fails");
  const std::string socket = (base / "tmsdisk" / "tmsdiskd.sock").string();
  const std::string daemon =
      fake_daemon(base, "echo \"tmsdiskd --private: TMS_DISK_BACKUP_DIR=/x does not exist\" >&2\nexit 1");
  std::string why;
  const auto start = std::chrono::steady_clock::now();
  CHECK(tmsdisk::spawn_private_daemon(daemon, socket, 20000, &why) == -EIO);
  // Its exit said it all: no waiting for a socket that will not come.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  CHECK(why == "tmsdiskd --private: TMS_DISK_BACKUP_DIR=/x does not exist");

  // Silent, it is still named by how it ended.
  const std::string mute = fake_daemon(base, "exit 7");
  CHECK(tmsdisk::spawn_private_daemon(mute, socket, 20000, &why) == -EIO);
  CHECK(why == "tmsdiskd exited with status 7");
  fs::remove_all(base);
}

TEST_CASE("a private daemon that lost the race to another one waits for the winner's socket") {
  const fs::path base = fresh_base("private-race");
  const std::string socket = (base / "tmsdisk" / "tmsdiskd.sock").string();
  // Exit status 3: another daemon holds the lock. None ever serves here, so the caller waits for the
  // socket until its time is up, and then says what the loser said.
  const std::string daemon =
      fake_daemon(base, "echo \"tmsdiskd --private: cannot start: another tmsdiskd already serves it\" >&2\nexit " +
                            std::to_string(tmsdisk::kExitAlreadyServed));
  std::string why;
  CHECK(tmsdisk::spawn_private_daemon(daemon, socket, 300, &why) == -ETIMEDOUT);
  CHECK(why == "tmsdiskd --private: cannot start: another tmsdiskd already serves it");
  fs::remove_all(base);
}

TEST_CASE("the default configuration file is where the install rules put it for the program's prefix") {
  using tmsdisk::config_file_for_prefix;
  // systemd/install.cmake: GNUInstallDirs' sysconfdir rule (the .deb installs under /usr).
  CHECK(config_file_for_prefix("/usr") == "/etc/tmsdisk/tmsdiskd.conf");
  CHECK(config_file_for_prefix("/usr/") == "/etc/tmsdisk/tmsdiskd.conf");
  CHECK(config_file_for_prefix("/") == "/etc/tmsdisk/tmsdiskd.conf");
  CHECK(config_file_for_prefix("/usr/local") == "/usr/local/etc/tmsdisk/tmsdiskd.conf");
  CHECK(config_file_for_prefix("/opt/tmsdisk") == "/etc/opt/tmsdisk/tmsdisk/tmsdiskd.conf");
  CHECK(config_file_for_prefix("/home/u/.local") == "/home/u/.local/etc/tmsdisk/tmsdiskd.conf");
  // This test is no installed program: it gets the configured prefix's file.
  CHECK(tmsdisk::default_config_file(tmsdisk::layout::kSbinDir) == tmsdisk::layout::kBuiltConfigFile);
}
