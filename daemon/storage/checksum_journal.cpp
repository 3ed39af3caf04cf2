// SPDX-License-Identifier: Apache-2.0
// The checksum journal (checksum_journal.h).
#include "checksum_journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "storage_fs.h"

namespace tmsdisk::storage::detail {

static_assert(std::endian::native == std::endian::little, "the journal is read and written as little-endian");

namespace {

uint64_t record_hash(const uint64_t (&fields)[3], uint64_t seed) {
  return XXH3_64bits_withSeed(fields, sizeof(fields), seed);
}

}  // namespace

Result<ChecksumJournal> ChecksumJournal::open(int rank_dir, bool create, const std::string& path) {
  constexpr int kFlags = O_RDWR | O_NOFOLLOW | O_CLOEXEC;
  int fd = create ? -1 : ::openat(rank_dir, kSumsName, kFlags);
  const bool creating = fd < 0 && (create || errno == ENOENT);
  if (creating) fd = ::openat(rank_dir, kSumsName, kFlags | O_CREAT | O_EXCL, kFileMode);
  if (fd < 0) return errno_error("cannot open the checksum journal " + path);
  ChecksumJournal j;
  j.created_ = creating;
  j.fd_.reset(fd);
  j.path_ = path;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat " + path);
  // A hard link would make the next reset() truncate whatever file it names.
  if (!S_ISREG(st.st_mode) || st.st_nlink != 1)
    return make_error(EINVAL, path + " is not a regular file of its own: it was not created by tmsdiskd; remove it");
  return j;
}

Status ChecksumJournal::reset() {
  while (::ftruncate(fd_.get(), 0) != 0)
    if (errno != EINTR) return errno_error("cannot empty the checksum journal " + path_);
  seed_ = 0;
  return {};
}

Status ChecksumJournal::record(uint64_t ordinal, uint64_t blob, uint64_t chunk, uint64_t checksum) {
  const uint64_t fields[3] = {blob, chunk, checksum};
  uint64_t rec[4] = {blob, chunk, checksum, record_hash(fields, seed_)};
  const auto offset = static_cast<off_t>(ordinal * kJournalRecordBytes);
  for (;;) {
    ssize_t n = ::pwrite(fd_.get(), rec, sizeof(rec), offset);
    if (n == static_cast<ssize_t>(sizeof(rec))) return {};
    if (n < 0 && errno == EINTR) continue;
    // A short write of 32 bytes means a full disk; the torn record fails its check on load.
    return n < 0 ? errno_error("cannot record a checksum in " + path_)
                 : make_error(ENOSPC, "cannot record a checksum in " + path_ + ": the disk is full");
  }
}

Result<std::vector<ChecksumJournal::Record>> ChecksumJournal::load(uint64_t chunks) const {
  std::vector<Record> out(chunks);
  std::vector<uint64_t> buf(4 * 4096);
  for (uint64_t first = 0; first < chunks;) {
    const uint64_t want = std::min<uint64_t>(chunks - first, buf.size() / 4);
    ssize_t n =
        ::pread(fd_.get(), buf.data(), want * kJournalRecordBytes, static_cast<off_t>(first * kJournalRecordBytes));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("cannot read the checksum journal " + path_);
    }
    const uint64_t got = static_cast<uint64_t>(n) / kJournalRecordBytes;
    for (uint64_t i = 0; i < got; ++i) {
      const uint64_t* r = &buf[4 * i];
      const uint64_t fields[3] = {r[0], r[1], r[2]};
      if (record_hash(fields, seed_) == r[3])
        out[first + i] = {.valid = true, .blob = r[0], .chunk = r[1], .checksum = r[2]};
      else if (r[0] | r[1] | r[2] | r[3])
        out[first + i].corrupt = true;
    }
    if (got < want) break;  // the end of the file: later chunks were never written
    first += got;
  }
  return out;
}

}  // namespace tmsdisk::storage::detail
