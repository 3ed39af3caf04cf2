// SPDX-License-Identifier: Apache-2.0
// Names of rank directories, of a rank's files and of their owner files (owner_file.h, rank_identity.h).
#include "owner_file.h"

#include <fmt/format.h>

#include <algorithm>

#include "storage_fs.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::storage {

std::string rank_dir_name(const RankIdentity& id) {
  int64_t r = id.rank >= 0 ? id.rank : static_cast<int64_t>(id.pid);
  return fmt::format("rank{}-{}", r, id.pid);
}

std::string rank_relative_dir(const RankIdentity& id) {
  return fmt::format("{}/{}/{}", id.uid, id.job, rank_dir_name(id));
}

std::string rank_file_prefix(const RankIdentity& id) {
  return fmt::format("tmsdisk-{}-{}.", id.job, rank_dir_name(id));
}

RankFileNames::RankFileNames(const std::string& prefix)
    : owner(prefix + detail::kOwnerName),
      owner_tmp(prefix + detail::kOwnerTmpName),
      data(prefix + detail::kDataName),
      manifest(prefix + detail::kManifestName),
      manifest_tmp(prefix + detail::kManifestTmpName),
      sums(prefix + detail::kSumsName),
      objects(prefix + detail::kObjectDataName),
      objects_log(prefix + detail::kObjectLogName),
      objects_log_tmp(prefix + detail::kObjectLogTmpName) {}

std::vector<const std::string*> RankFileNames::all() const {
  return {&owner, &owner_tmp, &data, &manifest, &manifest_tmp, &sums, &objects, &objects_log, &objects_log_tmp};
}

namespace detail {

namespace {
constexpr std::string_view kOwnerMagic = "tmsdisk-owner 1";
}  // namespace

std::string format_owner(const RankIdentity& id) {
  return fmt::format("{}\npid {}\nstart_time {}\ntoken {}\nuid {}\njob {}\nrank {}\n", kOwnerMagic, id.pid,
                     id.start_time, id.token, id.uid, id.job, id.rank);
}

std::optional<Owner> parse_owner(std::string_view text) {
  Owner o;
  unsigned seen = 0;
  bool first = true;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (first) {
      if (line != kOwnerMagic) return std::nullopt;
      first = false;
      continue;
    }
    if (line.empty()) continue;
    std::size_t sp = line.find(' ');
    if (sp == std::string_view::npos) return std::nullopt;
    std::string_view key = line.substr(0, sp);
    std::string_view value = line.substr(sp + 1);
    bool ok = true;  // unknown keys are skipped: a later version may add fields
    if (key == "pid") {
      ok = parse_number(value, o.pid) && o.pid > 0;
      seen |= 1;
    } else if (key == "start_time") {
      ok = parse_number(value, o.start_time);
      seen |= 2;
    } else if (key == "token") {
      ok = parse_number(value, o.token);
      seen |= 4;
    } else if (key == "uid") {
      ok = parse_number(value, o.uid);
      seen |= 8;
    } else if (key == "job") {
      ok = proto::valid_job_name(value);
      o.job = std::string(value);
      seen |= 16;
    } else if (key == "rank") {
      ok = parse_number(value, o.rank);
      seen |= 32;
    }
    if (!ok) return std::nullopt;
  }
  if (first || seen != 63) return std::nullopt;
  return o;
}

std::optional<pid_t> parse_rank_dir_name(std::string_view name) {
  if (!name.starts_with("rank")) return std::nullopt;
  name.remove_prefix(4);
  std::size_t dash = name.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  std::string_view rank = name.substr(0, dash);
  std::string_view pid = name.substr(dash + 1);
  pid_t value = 0;
  if (!all_digits(rank) || !all_digits(pid) || !parse_number(pid, value) || value <= 0) return std::nullopt;
  return value;
}

// Creates (if needed) and opens directory `name` below `parent`. An existing entry must be a real
// directory (O_NOFOLLOW: a planted symlink fails with ELOOP) owned by the daemon or by the rank's

}  // namespace detail
}  // namespace tmsdisk::storage
