// SPDX-License-Identifier: Apache-2.0
// Storage internals: a rank directory's name and its `owner` file (pid, start time, token, uid, job,
// rank), which tell a live rank's files from a dead one's across daemon restarts.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "rank_identity.h"

namespace tmsdisk::storage::detail {

// What an `owner` file says.
struct Owner {
  pid_t pid = 0;
  uint64_t start_time = 0;
  uint64_t token = 0;
  uid_t uid = 0;
  std::string job;
  int64_t rank = 0;
};

std::string format_owner(const RankIdentity& id);
// nullopt unless `text` is a complete owner file of this format (unknown keys are skipped).
std::optional<Owner> parse_owner(std::string_view text);

// "rank<R>-<pid>" -> pid, or nullopt if the name is not of that form.
std::optional<pid_t> parse_rank_dir_name(std::string_view name);

}  // namespace tmsdisk::storage::detail
