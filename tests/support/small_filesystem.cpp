// SPDX-License-Identifier: Apache-2.0
// A loop-mounted small ext4 for real ENOSPC (small_filesystem.h).
#include "small_filesystem.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

extern char** environ;

namespace tmsdisk::testing {

namespace {

// Runs argv quietly; returns the exit status, or -1 if it could not run.
int run_quietly(std::vector<std::string> argv) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  int rc = -1;
  // mkfs.ext4 lives in sbin, which a non-login PATH may lack.
  for (std::string dir : {"", "/usr/sbin/", "/sbin/"}) {
    std::string prog = dir + argv[0];
    args[0] = prog.data();
    pid_t pid = -1;
    if (posix_spawnp(&pid, prog.c_str(), &fa, nullptr, args.data(), environ) == 0) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
      break;
    }
  }
  posix_spawn_file_actions_destroy(&fa);
  return rc;
}

}  // namespace

std::unique_ptr<SmallFilesystem> SmallFilesystem::mount(uint64_t mib, std::string* why_not, const std::string& parent) {
  if (::geteuid() != 0) {
    *why_not = "needs root to loop-mount a small filesystem";
    return nullptr;
  }
  std::unique_ptr<SmallFilesystem> fs;
  try {
    fs.reset(new SmallFilesystem(parent));
  } catch (const std::exception& e) {
    *why_not = e.what();
    return nullptr;
  }
  const std::string image = fs->dir_ / "fs.img";
  fs->mnt_ = fs->dir_ / "mnt";
  std::filesystem::create_directory(fs->mnt_);
  int fd = ::open(image.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  const bool sized = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(mib << 20)) == 0;
  if (fd >= 0) ::close(fd);
  // Inode tables and journal initialized now, so that the free space does not move under a test.
  if (!sized || run_quietly({"mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", image}) != 0) {
    *why_not = "cannot make an ext4 image with mkfs.ext4 (is e2fsprogs installed?)";
    return nullptr;
  }
  if (run_quietly({"mount", "-o", "loop", image, fs->mnt_}) != 0) {
    *why_not = "cannot loop-mount " + image + " (no loop devices in this container?)";
    return nullptr;
  }
  fs->mounted_ = true;
  return fs;
}

SmallFilesystem::~SmallFilesystem() {
  // A lazy unmount as the fallback: the loop device is released once the last user goes.
  if (mounted_ && ::umount2(mnt_.c_str(), 0) != 0) ::umount2(mnt_.c_str(), MNT_DETACH);
}

}  // namespace tmsdisk::testing
