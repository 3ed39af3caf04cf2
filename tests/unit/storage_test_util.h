// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the storage tests: temp roots on a real disk filesystem, identities, file checks.
#pragma once

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "storage.h"
#include "tmsdisk/common/proc.h"

namespace storage_test {

inline bool on_tmpfs(const std::string& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return false;
  auto magic = static_cast<unsigned long>(s.f_type);
  return magic == TMPFS_MAGIC || magic == RAMFS_MAGIC;
}

// /var/tmp unless it is a tmpfs (then the build tree, the current directory of a ctest run): roots
// must be on a disk filesystem, or Roots::open refuses them.
inline std::string scratch_parent() {
  if (const char* env = std::getenv("TMSDISK_TEST_TMP"); env && *env) return env;
  if (!on_tmpfs("/var/tmp")) return "/var/tmp";
  return std::filesystem::current_path().string();
}

// A fresh directory removed with its contents (symlinks removed, never followed) on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& parent = scratch_parent()) {
    std::string tmpl = parent + "/tmsdisk-storage-test-XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp under " + parent + " failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

inline tmsdisk::storage::RankIdentity identity_of(pid_t pid, const std::string& job = "job1", int64_t rank = 0,
                                                  uint64_t token = 1234) {
  tmsdisk::storage::RankIdentity id;
  id.uid = 1000;
  id.gid = 1000;
  id.job = job;
  id.rank = rank;
  id.pid = pid;
  id.start_time = tmsdisk::process_start_time(pid).value_or(0);
  id.token = token;
  return id;
}

inline tmsdisk::storage::RankIdentity my_identity(const std::string& job = "job1", int64_t rank = 0) {
  return identity_of(::getpid(), job, rank);
}

inline bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

inline mode_t mode_of(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

struct FileUsage {
  uint64_t size = 0;
  uint64_t blocks = 0;
  bool operator==(const FileUsage&) const = default;
};

inline FileUsage usage_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_blocks)};
}

}  // namespace storage_test
