// SPDX-License-Identifier: Apache-2.0
// The sweep: removes rank directories, and ranks' files in directories of their choosing, whose owner
// process is gone (storage.h, sweep_dead_ranks and sweep_rank_files).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <new>

#include "owner_file.h"
#include "storage.h"
#include "storage_fs.h"
#include "tmsdisk/common/proc.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

struct Sweeper {
  const std::function<bool(const std::string&)>& in_use;
  const std::function<void(const std::string&)>& warn;
  SweepStats stats;

  void say(const std::string& msg) const {
    if (warn) warn(msg);
  }

  // One rank directory: removed only when its owner file is ours, matches the path, and names a
  // process that is gone, and the daemon does not hold it.
  void rank(int job_fd, const std::string& root_path, const std::string& uid, const std::string& job,
            const std::string& name) {
    std::string rel = uid + "/" + job + "/" + name;
    std::string path = join_path(root_path, rel);
    auto pid = parse_rank_dir_name(name);
    if (!pid) {
      say("sweep: leaving " + path + " alone: not a rank directory name (rank<R>-<pid>)");
      return;
    }
    UniqueFd fd(open_dir_nofollow(job_fd, name.c_str()));
    if (!fd) {
      say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
      return;
    }
    auto text = read_small_file(fd.get(), kOwnerName, kMaxOwnerBytes, join_path(path, kOwnerName));
    if (!text) {
      say("sweep: leaving " + path + " alone: " + text.error().describe());
      return;
    }
    auto owner = parse_owner(*text);
    if (!owner || owner->pid != *pid || std::to_string(owner->uid) != uid || owner->job != job) {
      say("sweep: leaving " + path + " alone: its owner file is not tmsdiskd's or does not match the path");
      return;
    }
    if (process_alive(owner->pid, owner->start_time)) return;
    if (in_use && in_use(rel)) return;
    uint64_t bytes = 0;
    if (auto s = empty_dir(fd.get(), path, kRemoveDepth, &bytes); !s) {
      stats.removed_bytes += bytes;
      say("sweep: cannot remove " + path + ": " + s.error().describe());
      return;
    }
    fd.reset();
    stats.removed_bytes += bytes;
    if (::unlinkat(job_fd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      Error e = errno_error("sweep: cannot remove " + path);
      say(e.describe());
      return;
    }
    ++stats.removed_dirs;
  }

  void job(int uid_fd, const std::string& root_path, const std::string& uid, const std::string& name) {
    std::string path = join_path(root_path, uid + "/" + name);
    if (!proto::valid_job_name(name)) {
      say("sweep: leaving " + path + " alone: not a job name tmsdiskd creates");
      return;
    }
    UniqueFd fd(open_dir_nofollow(uid_fd, name.c_str()));
    if (!fd) {
      say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
      return;
    }
    auto names = list_dir(fd.get(), path);
    if (!names) {
      say("sweep: " + names.error().describe());
      return;
    }
    for (const auto& n : *names) rank(fd.get(), root_path, uid, name, n);
    fd.reset();
    remove_if_empty(uid_fd, name.c_str());
  }

  // The files of dead ranks in a directory ranks chose (Roots::rank_chosen()): each rank's are named
  // by the prefix its owner file carries, which must be the one its contents give.
  void shared_directory(int dir, const std::string& path) {
    UniqueFd fd(::openat(dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    auto names = fd ? list_dir(fd.get(), path) : Result<std::vector<std::string>>(errno_error("cannot open " + path));
    if (!names) {
      say("sweep: " + names.error().describe());
      return;
    }
    constexpr std::string_view kPrefix = "tmsdisk-";
    const std::string owner_suffix = kOwnerName;
    for (const auto& n : *names) {
      if (n.size() <= kPrefix.size() + owner_suffix.size() || !n.starts_with(kPrefix) || !n.ends_with(owner_suffix))
        continue;
      const std::string prefix = n.substr(0, n.size() - owner_suffix.size());
      auto text = read_small_file(dir, n.c_str(), kMaxOwnerBytes, join_path(path, n));
      std::optional<Owner> owner = text ? parse_owner(*text) : std::nullopt;
      if (!owner) continue;  // not an owner file tmsdiskd wrote: not ours to judge
      RankIdentity id;
      id.uid = owner->uid;
      id.job = owner->job;
      id.rank = owner->rank;
      id.pid = owner->pid;
      if (rank_file_prefix(id) != prefix || process_alive(owner->pid, owner->start_time)) continue;
      uint64_t bytes = 0;
      Status st = remove_rank_files(dir, path, RankFileNames(prefix), &bytes);
      stats.removed_bytes += bytes;
      if (!st) {
        say("sweep: " + st.error().describe());
        continue;
      }
      ++stats.removed_dirs;
    }
  }

  void root(const Root& r) {
    UniqueFd fd(::openat(r.dir.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd) {
      say("sweep: " + errno_error("cannot open storage root " + r.path).describe());
      return;
    }
    auto names = list_dir(fd.get(), r.path);
    if (!names) {
      say("sweep: " + names.error().describe());
      return;
    }
    for (const auto& uid : *names) {
      uid_t value = 0;
      // Not a uid: something else that lives in this (possibly shared) directory.
      if (!all_digits(uid) || !parse_number(uid, value)) continue;
      std::string path = join_path(r.path, uid);
      UniqueFd ufd(open_dir_nofollow(fd.get(), uid.c_str()));
      if (!ufd) {
        say("sweep: leaving " + path + " alone: " + not_a_directory_error(errno, path).describe());
        continue;
      }
      auto jobs = list_dir(ufd.get(), path);
      if (!jobs) {
        say("sweep: " + jobs.error().describe());
        continue;
      }
      for (const auto& j : *jobs) job(ufd.get(), r.path, uid, j);
      ufd.reset();
      remove_if_empty(fd.get(), uid.c_str());
    }
  }
};

}  // namespace

SweepStats sweep_rank_files(int dir, const std::string& path, const std::function<void(const std::string&)>& warn) {
  try {
    const std::function<bool(const std::string&)> none;
    Sweeper s{none, warn, {}};
    s.shared_directory(dir, path);
    return s.stats;
  } catch (const std::bad_alloc&) {
    return {};
  }
}

Result<SweepStats> sweep_dead_ranks(Roots& roots, const std::function<bool(const std::string& relative_dir)>& in_use,
                                    const std::function<void(const std::string&)>& warn) {
  try {
    Sweeper s{in_use, warn, {}};
    for (std::size_t i = 0; i < roots.size(); ++i) s.root(roots[i]);
    return s.stats;
  } catch (const std::bad_alloc&) {
    return out_of_memory("sweeping dead ranks' directories");
  }
}

}  // namespace tmsdisk::storage
