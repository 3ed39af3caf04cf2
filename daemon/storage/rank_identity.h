// SPDX-License-Identifier: Apache-2.0
// Who a rank's files belong to (RankIdentity) and the names its directories get: a leaf, which the
// store's API (storage.h) and its owner files (owner_file.h) both use.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

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

}  // namespace tmsdisk::storage
