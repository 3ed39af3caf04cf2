// SPDX-License-Identifier: Apache-2.0
// Temporary directories for tests (temp_dir.h).
#include "temp_dir.h"

#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

namespace tmsdisk::testing {

namespace fs = std::filesystem;

bool on_tmpfs(const std::string& path) {
  struct statfs s {};
  if (::statfs(path.c_str(), &s) != 0) return false;
  auto magic = static_cast<unsigned long>(s.f_type);
  return magic == TMPFS_MAGIC || magic == RAMFS_MAGIC;
}

std::string test_tmp_root() {
  if (const char* e = std::getenv("TMSDISK_TEST_TMP"); e && *e) return e;
  static const std::string root = [] {
    const std::string build = TMSDISK_TEST_TMP_DEFAULT;
    std::error_code ec;
    fs::create_directories(build, ec);
    return !ec && !on_tmpfs(build) ? build : std::string("/var/tmp");
  }();
  return root;
}

TempDir::TempDir(const std::string& parent, const std::string& prefix) {
  fs::create_directories(parent);
  std::string tmpl = parent + "/" + prefix + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp " + tmpl + ": " + std::strerror(errno));
  path_ = buf.data();
  ::chmod(path_.c_str(), 0755);
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

}  // namespace tmsdisk::testing
