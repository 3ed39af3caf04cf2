// SPDX-License-Identifier: Apache-2.0
// Storage internals: openat helpers that never follow a symlink, shared by roots, rank stores and
// the sweep. Not part of storage.h's interface.
#pragma once

#include <sys/types.h>

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rank_identity.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::storage::detail {

// The uid and job directories only need to be traversable by the daemon, which does all I/O; 0711
// lets a user's own tools stat their rank directory path without listing other users' jobs.
inline constexpr mode_t kParentDirMode = 0711;
inline constexpr mode_t kRankDirMode = 0700;
inline constexpr mode_t kFileMode = 0600;
inline constexpr std::size_t kMaxOwnerBytes = 4096;
// Files we create in a rank directory never contain directories; recursion is only a fallback for
// something foreign that appeared there, bounded so a hostile tree cannot exhaust the stack.
inline constexpr int kRemoveDepth = 4;

inline constexpr const char* kOwnerName = "owner";
inline constexpr const char* kOwnerTmpName = "owner.tmp";
inline constexpr const char* kDataName = "data";
inline constexpr const char* kManifestName = "manifest";
inline constexpr const char* kManifestTmpName = "manifest.tmp";
inline constexpr const char* kSumsName = "sums";           // checksum journal (checksum_journal.h)
inline constexpr const char* kObjectDataName = "objects";  // the object store's (object_store_log.h)
inline constexpr const char* kObjectLogName = "objects.log";
inline constexpr const char* kObjectLogTmpName = "objects.log.tmp";

Error out_of_memory(std::string_view what);

std::string join_path(std::string_view dir, std::string_view name);

// Splits an absolute path into its components, dropping empty ones and ".". False for a relative
// path or one containing "..": those cannot be checked lexically against a root.
bool split_absolute(std::string_view path, std::vector<std::string_view>& parts);
std::string join_parts(const std::vector<std::string_view>& parts);

template <class T>
bool parse_number(std::string_view text, T& out) {
  if (text.empty()) return false;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && ptr == text.data() + text.size();
}

bool all_digits(std::string_view s);

Status write_all(int fd, const void* data, std::size_t len, const std::string& what);

// Opens an existing directory below `dirfd` without following a symlink in its place.
int open_dir_nofollow(int dirfd, const char* name);

Error not_a_directory_error(int err, const std::string& path);

// Reads a small regular file (at most `limit` bytes) without following a symlink.
Result<std::string> read_small_file(int dirfd, const char* name, std::size_t limit, const std::string& path);

// Writes `name` atomically: a temporary file in the same directory, renamed over it. With `durable`,
// the temporary is flushed before the rename and the directory after it, so after a crash `name` is
// either the old or the new content, never a torn mix.
Status write_file_atomic(int dirfd, const char* tmp_name, const char* name, std::string_view content, bool durable,
                         const std::string& dir_path);

// Names in directory `dirfd`, read through a fresh open file description so the caller's fd
// offset is untouched.
Result<std::vector<std::string>> list_dir(int dirfd, const std::string& path);

// Removes everything inside directory `dirfd` with unlinkat on names listed through that fd: a symlink
// is removed, never followed, and nothing outside the directory is touched. Adds the disk usage of
// removed files (st_blocks * 512) to *bytes when given.
Status empty_dir(int dirfd, const std::string& path, int depth, uint64_t* bytes);

// Removes the files `names` lists from directory `dirfd` (`path` names it in messages), those that are
// there: a rank's files in a directory it shares with others. Adds the disk usage of removed files
// (st_blocks * 512) to *bytes when given, as empty_dir() does.
Status remove_rank_files(int dirfd, const std::string& path, const RankFileNames& names, uint64_t* bytes = nullptr);

// Removes directory `name` below `dirfd` if it is empty; a non-empty one is fine (other jobs or
// ranks still use it).
void remove_if_empty(int dirfd, const char* name);

}  // namespace tmsdisk::storage::detail
