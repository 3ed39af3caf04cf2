// SPDX-License-Identifier: Apache-2.0
// A data file's identity and metadata, recorded when the store last knew its bytes (file_identity.h).
#include "file_identity.h"

#include <sys/stat.h>
#include <time.h>

namespace tmsdisk::storage::detail {

namespace {

// Longest a settled identity waits for the coarse clock: one tick is 1 to 10 ms (HZ 1000 to 100).
constexpr int kMaxSettleMs = 50;

bool before(const timespec& a, const timespec& b) {
  return a.tv_sec != b.tv_sec ? a.tv_sec < b.tv_sec : a.tv_nsec < b.tv_nsec;
}

}  // namespace

std::optional<FileIdentity> file_identity(int fd) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return FileIdentity{.dev = static_cast<uint64_t>(st.st_dev),
                      .ino = static_cast<uint64_t>(st.st_ino),
                      .size = static_cast<uint64_t>(st.st_size),
                      .mtime_sec = st.st_mtim.tv_sec,
                      .mtime_nsec = st.st_mtim.tv_nsec,
                      .ctime_sec = st.st_ctim.tv_sec,
                      .ctime_nsec = st.st_ctim.tv_nsec};
}

std::optional<FileIdentity> settled_file_identity(int fd) noexcept {
  const auto id = file_identity(fd);
  if (!id) return std::nullopt;
  const timespec mtime{.tv_sec = id->mtime_sec, .tv_nsec = id->mtime_nsec};
  const timespec ctime{.tv_sec = id->ctime_sec, .tv_nsec = id->ctime_nsec};
  const timespec latest = before(mtime, ctime) ? ctime : mtime;
  for (int waited = 0;; ++waited) {
    timespec now{};
    if (::clock_gettime(CLOCK_REALTIME_COARSE, &now) != 0) return std::nullopt;
    if (before(latest, now)) break;
    if (waited == kMaxSettleMs) return std::nullopt;
    const timespec ms{.tv_sec = 0, .tv_nsec = 1'000'000};
    ::nanosleep(&ms, nullptr);
  }
  // A change made meanwhile, in the tick of the store's own last change, may carry its timestamps;
  // a second look still catches one that moved the size or (multigrain timestamps) a timestamp.
  const auto again = file_identity(fd);
  if (!again || !(*again == *id)) return std::nullopt;
  return id;
}

}  // namespace tmsdisk::storage::detail
