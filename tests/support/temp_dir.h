// SPDX-License-Identifier: Apache-2.0
// Where tests put their files, and the one temporary directory every test uses.
#pragma once

#include <string>

namespace tmsdisk::testing {

// True when `path` lies on a tmpfs or ramfs (no O_DIRECT; roots there are refused).
bool on_tmpfs(const std::string& path);

// Where tests put their files: $TMSDISK_TEST_TMP, else the build tree's test-tmp/ (a real disk
// filesystem where O_DIRECT works, unlike a tmpfs /tmp), else /var/tmp if the build tree is a tmpfs.
std::string test_tmp_root();

// A fresh directory (mode 0755) made under `parent` (created if missing), removed with its contents
// on destruction; symlinks inside are removed, never followed. Throws std::runtime_error when it
// cannot be made.
class TempDir {
 public:
  explicit TempDir(const std::string& parent = test_tmp_root(), const std::string& prefix = "tmsdisk-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

}  // namespace tmsdisk::testing
