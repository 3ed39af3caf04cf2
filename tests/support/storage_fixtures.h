// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the storage tests: identities, file checks, and the shared TempDir. Header-only;
// the test links tmsdisk_storage.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "storage.h"
#include "temp_dir.h"
#include "tmsdisk/common/proc.h"

namespace storage_test {

// One TempDir for every test (temp_dir.h): under $TMSDISK_TEST_TMP or the build tree, a disk
// filesystem, as roots must be or Roots::open refuses them.
using tmsdisk::testing::on_tmpfs;
using tmsdisk::testing::TempDir;

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
