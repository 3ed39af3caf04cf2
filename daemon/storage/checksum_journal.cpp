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
static_assert(kJournalRecordBytes == 5 * sizeof(uint64_t) && kJournalRecordBytesV1 == 4 * sizeof(uint64_t));

namespace {

// A record is its fields (blob, chunk, then the checksum: two words, or one in version 1) and the
// seeded hash of them: 5 words, or 4.
uint64_t record_hash(const uint64_t* fields, std::size_t words, uint64_t seed) {
  return XXH3_64bits_withSeed(fields, words * sizeof(uint64_t), seed);
}

}  // namespace

Result<ChecksumJournal> ChecksumJournal::open(int rank_dir, const std::string& name, bool create,
                                              const std::string& path) {
  constexpr int kFlags = O_RDWR | O_NOFOLLOW | O_CLOEXEC;
  int fd = create ? -1 : ::openat(rank_dir, name.c_str(), kFlags);
  const bool creating = fd < 0 && (create || errno == ENOENT);
  if (creating) fd = ::openat(rank_dir, name.c_str(), kFlags | O_CREAT | O_EXCL, kFileMode);
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
  v1_ = false;
  return {};
}

Status ChecksumJournal::record(uint64_t ordinal, uint64_t blob, uint64_t chunk, Checksum128 checksum) {
  const std::size_t bytes = v1_ ? kJournalRecordBytesV1 : kJournalRecordBytes;
  const std::size_t fields = bytes / sizeof(uint64_t) - 1;
  uint64_t rec[5] = {blob, chunk, checksum.low, checksum.high, 0};
  rec[fields] = record_hash(rec, fields, seed_);
  const auto offset = static_cast<off_t>(ordinal * bytes);
  for (;;) {
    ssize_t n = ::pwrite(fd_.get(), rec, bytes, offset);
    if (n == static_cast<ssize_t>(bytes)) return {};
    if (n < 0 && errno == EINTR) continue;
    // A short write of a few bytes means a full disk; the torn record fails its check on load.
    return n < 0 ? errno_error("cannot record a checksum in " + path_)
                 : make_error(ENOSPC, "cannot record a checksum in " + path_ + ": the disk is full");
  }
}

Result<std::vector<ChecksumJournal::Record>> ChecksumJournal::load(uint64_t chunks) const {
  const uint64_t record_bytes = v1_ ? kJournalRecordBytesV1 : kJournalRecordBytes;
  const std::size_t words = record_bytes / sizeof(uint64_t);
  const std::size_t fields = words - 1;
  std::vector<Record> out(chunks);
  std::vector<uint64_t> buf(words * 4096);
  for (uint64_t first = 0; first < chunks;) {
    const uint64_t want = std::min<uint64_t>(chunks - first, buf.size() / words);
    ssize_t n = ::pread(fd_.get(), buf.data(), want * record_bytes, static_cast<off_t>(first * record_bytes));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_error("cannot read the checksum journal " + path_);
    }
    const uint64_t got = static_cast<uint64_t>(n) / record_bytes;
    for (uint64_t i = 0; i < got; ++i) {
      const uint64_t* r = &buf[words * i];
      if (record_hash(r, fields, seed_) == r[fields]) {
        out[first + i] = {.valid = true, .blob = r[0], .chunk = r[1], .checksum = {r[2], v1_ ? 0 : r[3]}};
      } else {
        uint64_t any = 0;
        for (std::size_t w = 0; w < words; ++w) any |= r[w];
        out[first + i].corrupt = any != 0;
      }
    }
    if (got < want) break;  // the end of the file: later chunks were never written
    first += got;
  }
  return out;
}

}  // namespace tmsdisk::storage::detail
