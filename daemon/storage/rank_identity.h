// SPDX-License-Identifier: Apache-2.0
// Who a rank's files belong to (RankIdentity) and the names its directories get: a leaf, which the
// store's API (storage.h) and its owner files (owner_file.h) both use.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tmsdisk::storage {

struct RankIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::string job;  // must satisfy proto::valid_job_name
  int64_t rank = 0;
  pid_t pid = 0;
  uint64_t start_time = 0;  // process_start_time(pid)
  uint64_t token = 0;       // secret a reconnecting shim must present
};

// "rank<R>-<pid>", R being the rank or, for an undeclared rank (< 0), the pid.
std::string rank_dir_name(const RankIdentity& id);
// "<uid>/<job>/rank<R>-<pid>": the form sweep_dead_ranks() hands to its in_use callback.
std::string rank_relative_dir(const RankIdentity& id);
// "tmsdisk-<job>-rank<R>-<pid>.": what the names of its files begin with in a directory of its own choosing.
std::string rank_file_prefix(const RankIdentity& id);

// The names of one rank's files. In a rank directory under a root, which holds nothing else: the
// plain names above. In a directory of the rank's own choosing (TMS_DISK_BACKUP_DIR outside the
// roots, RankLayout::OwnDirectory in storage.h), which it may share with its user's files and other
// ranks: each prefixed with "tmsdisk-<job>-rank<R>-<pid>.", so that a listing shows whose they are
// and removing them touches nothing else.
struct RankFileNames {
  std::string owner, owner_tmp, data, manifest, manifest_tmp, sums, objects, objects_log, objects_log_tmp;
  explicit RankFileNames(const std::string& prefix = {});
  // Every name above, for removing them one by one from a shared directory.
  std::vector<const std::string*> all() const;
};

}  // namespace tmsdisk::storage
