// SPDX-License-Identifier: Apache-2.0
// A small ext4 filesystem, loop-mounted in a fresh temporary directory, where a test can run a root
// out of space for real (ENOSPC from the kernel, not from a fault hook).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "temp_dir.h"

namespace tmsdisk::testing {

class SmallFilesystem {
 public:
  // Makes a `mib` MiB ext4 image under `parent` and loop-mounts it. Null where this machine cannot
  // (not root, no mkfs.ext4, no loop devices), with the reason in *why_not for the test's skip().
  static std::unique_ptr<SmallFilesystem> mount(uint64_t mib, std::string* why_not,
                                                const std::string& parent = test_tmp_root());
  ~SmallFilesystem();  // unmounts (lazily if busy) and removes the image
  SmallFilesystem(const SmallFilesystem&) = delete;
  SmallFilesystem& operator=(const SmallFilesystem&) = delete;

  const std::string& path() const { return mnt_; }  // the mount point
  std::string operator/(const std::string& rel) const { return mnt_ + "/" + rel; }

 private:
  explicit SmallFilesystem(const std::string& parent) : dir_(parent, "small-fs") {}
  TempDir dir_;
  std::string mnt_;
  bool mounted_ = false;
};

}  // namespace tmsdisk::testing
