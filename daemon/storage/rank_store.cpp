// SPDX-License-Identifier: Apache-2.0
// One rank's files on all roots: directories, data files, extents, checksums and the manifest
// (storage.h, RankStore).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "background_punch.h"
#include "checksum_journal.h"
#include "extent_allocator.h"
#include "file_identity.h"
#include "manifest.h"
#include "owner_file.h"
#include "storage.h"
#include "storage_fs.h"
#include "storage_testing.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/proc.h"

namespace tmsdisk::storage {

using namespace detail;

namespace testing {
namespace {
std::atomic<FallocateHook> g_fallocate_hook{nullptr};
}  // namespace
FallocateHook set_fallocate_hook(FallocateHook hook) noexcept {
  return g_fallocate_hook.exchange(hook);
}
}  // namespace testing

namespace {

// Keeps every extent length and file offset far from 64-bit overflow (1 EiB per blob).
constexpr uint64_t kMaxBlobSize = uint64_t{1} << 60;

Result<UniqueFd> make_parent_dir(int parent, const std::string& name, const std::string& path, uid_t rank_uid) {
  if (::mkdirat(parent, name.c_str(), kParentDirMode) != 0 && errno != EEXIST) {
    return errno_error("cannot create directory " + path);
  }
  UniqueFd fd(open_dir_nofollow(parent, name.c_str()));
  if (!fd) return not_a_directory_error(errno, path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_error("cannot stat " + path);
  if (st.st_uid != ::geteuid() && st.st_uid != rank_uid) {
    return make_error(EPERM, fmt::format("{} is owned by uid {}, neither tmsdiskd (uid {}) nor the rank's user (uid "
                                         "{}); remove it so tmsdiskd can recreate it",
                                         path, st.st_uid, ::geteuid(), rank_uid));
  }
  return fd;
}

// Opens `data` in a rank directory, with O_DIRECT where the filesystem allows it.
Result<UniqueFd> open_data_file(int rank_dir, bool create, bool& direct_io, const std::string& path) {
  int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  int fd = ::openat(rank_dir, kDataName, flags | O_DIRECT, kFileMode);
  direct_io = true;
  if (fd < 0 && errno == EINVAL) {
    // This filesystem has no O_DIRECT (tmpfs before 6.6, some FUSE and network filesystems):
    // buffered I/O still works, only slower and through the page cache. The caller logs it.
    fd = ::openat(rank_dir, kDataName, flags, kFileMode);
    direct_io = false;
  }
  if (fd < 0) return errno_error("cannot open data file " + path);
  UniqueFd out(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat " + path);
  if (!S_ISREG(st.st_mode)) return make_error(EINVAL, path + " is not a regular file");
  return out;
}

int fallocate_retry(int fd, int mode, uint64_t offset, uint64_t length) {
  while (::fallocate(fd, mode, static_cast<off_t>(offset), static_cast<off_t>(length)) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

// Gives the blocks of a free range back to the filesystem. Best effort: where punching is not
// supported the range just stays allocated, which costs space but never correctness. False when it
// was refused.
bool punch(int fd, uint64_t offset, uint64_t length) {
  return length == 0 || fallocate_retry(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0;
}

// Calls fn(offset, length) for each part of [offset, offset+length) that `layout` has free or past
// its end.
template <class Fn>
void for_each_free_part(const ExtentAllocator& layout, uint64_t offset, uint64_t length, Fn&& fn) {
  const uint64_t stop = offset + length;
  const auto& free = layout.free_extents();
  auto it = free.upper_bound(offset);
  if (it != free.begin()) --it;
  for (; it != free.end() && it->first < stop; ++it) {
    uint64_t a = std::max(offset, it->first);
    uint64_t b = std::min(stop, it->first + it->second);
    if (a < b) fn(a, b - a);
  }
  uint64_t tail = std::max(offset, layout.end());
  if (tail < stop) fn(tail, stop - tail);
}

// Calls fn(offset, length) for each part of [offset, offset+length) that `layout` has in use: the
// complement of for_each_free_part.
template <class Fn>
void for_each_used_part(const ExtentAllocator& layout, uint64_t offset, uint64_t length, Fn&& fn) {
  uint64_t at = offset;
  for_each_free_part(layout, offset, length, [&](uint64_t a, uint64_t len) {
    if (a > at) fn(at, a - at);
    at = a + len;
  });
  if (at < offset + length) fn(at, offset + length - at);
}

// The refusal a user reads when a pause does not fit (issue 8: said once, in human units).
Error no_space_error(int err, uint64_t needed, const std::string& root, uint64_t avail) {
  return make_error(
      err, fmt::format("not enough disk space: needs {} on {}, {} free{}: free space, add a root, or "
                       "pause less",
                       human_bytes(needed), root, human_bytes(avail), err == EDQUOT ? " within the disk quota" : ""));
}

struct RootFiles {
  std::string path;  // root path, for messages
  std::string rank_path;
  UniqueFd root;  // dup of the root's O_PATH fd: the RankStore does not depend on Roots' lifetime
  UniqueFd uid_dir;
  UniqueFd job_dir;
  UniqueFd rank_dir;
  UniqueFd data;
  bool direct_io = true;
  bool in_memory = false;  // the root's Root::in_memory
  bool gone = false;       // rank directory removed
  ExtentAllocator alloc{kIoAlignment};
  // Of alloc.used_bytes(), the ranges of zero and host-tier chunks: holes in the file, no disk space.
  uint64_t off_disk_bytes = 0;
  // The data file as it was when its bytes were last known to be what the records say: taken at a
  // commit of a pause, after its fdatasync (file_identity.h); nullopt from the moment the store
  // itself may change the file again (a reservation, a WRITE), and whenever it was not taken. The
  // held chunks of a file that no longer matches it are forgotten (RankStore::Impl::check_files).
  std::optional<FileIdentity> known;
  // The file was found changed outside the store: the next reservation preallocates its data chunks
  // again (a truncation or a punch may have taken their blocks).
  bool changed = false;
};

// What the store knows of one chunk.
struct ChunkRecord {
  // The sealed checksum where is_data(state); otherwise, while `held`, the XXH3-128 of what the
  // data file holds at the chunk's place from an earlier generation.
  Checksum128 sum;
  ChunkState state = ChunkState::Missing;
  // The data file provably holds bytes whose XXH3-128 is `sum` at this chunk's place: this store
  // wrote them (or found them unchanged) in this generation or the last committed one, and since
  // then no write there has started, no read of them failed its check, the chunk was not zero, its
  // blob kept its extents and the file was not changed outside the store (RootFiles::known, checked
  // before anything is skipped). A WRITE of the same bytes then skips the disk (issue 9). Never set
  // from a journal record, a version-1 checksum or a "writing" manifest: they prove less.
  bool held = false;
  // WRITEs of this chunk opened (RankStore::open_write): a hash that comes back after another WRITE
  // of the chunk was opened is not taken for what the file holds.
  uint32_t opened = 0;
};
// Each chunk costs the daemon about 24 bytes (max-chunks-per-uid's help and the README say so).
static_assert(sizeof(ChunkRecord) <= 24);

struct BlobState {
  uint64_t id = 0;
  uint64_t size = 0;
  uint64_t chunks = 0;
  uint64_t first_chunk = 0;             // ordinal of its chunk 0 in the set (checksum journal slot)
  std::vector<ManifestExtent> extents;  // one per root; length 0: no chunk of this blob there
  std::vector<ChunkRecord> records;     // one per chunk
};

// A byte range of one root's data file.
struct FileRange {
  std::size_t root;
  uint64_t offset;
  uint64_t length;
};

uint64_t round_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

}  // namespace

struct RankStore::Impl {
  RankIdentity id;
  uint32_t chunk = 0;
  std::string uid_name;
  std::string rank_name;
  std::string relative;
  std::string dir_path;
  std::vector<RootFiles> roots;
  ChecksumJournal journal;  // beside the manifest, on the first root
  std::vector<BlobState> blobs;
  std::unordered_map<uint64_t, std::size_t> index;
  uint64_t missing = 0;
  bool paused = false;
  bool writing = false;  // a reservation was made and no commit has closed it yet
  uint64_t generation = 0;
  bool removed = false;
  // Set by adopt() when the record of where the rank's memory lies and what it must read back as is
  // gone or unusable (record_problem()): the whole refusal, naming the file and what to do.
  std::string record_problem;
  // Ordinals of chunks of the pause in progress whose journal record is corrupt: each may have been
  // written and acknowledged, so its memory released; none can be verified.
  std::unordered_set<uint64_t> corrupt_records;
  // Every range the layout has free or zero, and each file past its layout's end, is a hole (or will
  // be once `punches` is done, which the next reservation waits for): a reservation then punches
  // only what it frees or zeroes anew. False after adopt() (a daemon may have stopped before its
  // punches) and after a punch that did not happen: the next reservation punches all of them again.
  bool holes_punched = true;

  Status open_dirs(std::size_t i, int root_fd, bool create);
  Status remove_locked();
  Status reserve_locked(std::span<const proto::BlobSize> set, std::span<const proto::ChunkRun> zero_runs,
                        std::span<const proto::ChunkRun> host_runs, std::span<const uint64_t> carry);
  Status load_manifest();
  Status load_journal(uint64_t seed, uint64_t chunks);
  // Bytes in the data file of each root, as they are.
  std::vector<uint64_t> data_file_sizes() const;
  // "the data file P (N bytes) is kept untouched", for every root.
  std::string kept_files_text() const;
  // Keeps every file as it is and refuses, with `what` and the way out, whatever would read, move
  // or overwrite the rank's data (invariant 6): the record that locates and verifies it is `what`.
  void lose_record(const std::string& what);
  // Writes the manifest of the current set; *hash (when given) receives the XXH3-64 of its bytes.
  Status write_manifest(uint32_t state, uint64_t gen, uint64_t* hash = nullptr);
  Result<const BlobState*> find_chunk(uint64_t blob, uint64_t offset, uint64_t* chunk_index) const;
  // find_chunk, and `length` must be that chunk's length.
  Result<const BlobState*> find_chunk_of_length(uint64_t blob, uint64_t offset, uint64_t length,
                                                uint64_t* chunk_index) const;
  // Seals chunk (blob, offset) with `sum`, journaled first; `held` as ChunkRecord::held.
  Status record(uint64_t blob, uint64_t offset, Checksum128 sum, bool held);
  // The checksum of a chunk's bytes: an XXH3-128, or an XXH3-64 while the pause in progress keeps
  // the journal layout of version 1 (its records have room for no more).
  Checksum128 hash(std::span<const uint8_t> bytes) const;
  ChunkState sealed_state() const { return journal.version1_layout() ? ChunkState::Data64 : ChunkState::Data; }
  // Writes a manifest of `set` with the data files ending at `data_end`.
  Status write_manifest_of(const std::vector<BlobState>& set, const std::vector<uint64_t>& data_end, uint32_t state,
                           uint64_t gen, uint64_t* hash);
  // Recounts missing chunks and each root's zero bytes from `blobs`.
  void recount();
  // Before anything is skipped for being held: forgets every held chunk of a data file whose identity
  // differs from the one recorded (or was never recorded), so that a file changed outside the store is
  // rewritten rather than trusted. With `before_change` (a reservation or a WRITE is about to change
  // the files) the identities are dropped too, as the change makes them stale.
  void check_files(bool before_change);
  // Forgets what the data file of root `r` is known to hold.
  void forget_held(std::size_t r);
  // Where another file has taken a data file's name, or none is left there, the store would go on
  // writing a file that a daemon restarted later never finds: a reservation opens the file the name
  // gives (a new one if there is none), as adopt() would, and its data chunks are preallocated and
  // written anew. Not while the open file holds the only copy of something (a pause in progress or
  // committed, blobs carried): those stay where they are. True when a file was opened anew.
  Result<bool> follow_replaced_files(bool carrying);
  // Waits for `punches` (reserve(), wait_for_punches()); false when they left something undone.
  bool wait_punches(const char* who) noexcept {
    holes_punched = punches.wait(who) && holes_punched;
    return holes_punched;
  }

  // The space the last reservation gives back, being given back off the caller's thread. Declared
  // last, so destroyed first: stopped and joined while everything else is still there (it touches
  // nothing of the store's, only its own plan and descriptors, but that is one thing less to check).
  BackgroundPunch punches;
};

namespace {

Status check_identity(const Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  if (roots.size() == 0) return make_error(EINVAL, "no storage root configured");
  if (!proto::valid_job_name(id.job)) {
    return make_error(EINVAL, "job name \"" + id.job +
                                  "\" is not usable as a directory name: use 1-64 characters of A-Z a-z 0-9 . _ -, "
                                  "not starting with '.'");
  }
  if (id.pid <= 0) return make_error(EINVAL, fmt::format("invalid pid {}", id.pid));
  if (chunk_bytes == 0 || chunk_bytes % kIoAlignment != 0) {
    return make_error(EINVAL, fmt::format("chunk size {} is not a non-zero multiple of {}", chunk_bytes, kIoAlignment));
  }
  return {};
}

std::unique_ptr<RankStore::Impl> new_impl(const Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  auto impl = std::make_unique<RankStore::Impl>();
  impl->id = id;
  impl->chunk = chunk_bytes;
  impl->uid_name = fmt::format("{}", id.uid);
  impl->rank_name = rank_dir_name(id);
  impl->relative = rank_relative_dir(id);
  impl->roots.resize(roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    impl->roots[i].path = roots[i].path;
    impl->roots[i].rank_path = join_path(roots[i].path, impl->relative);
    impl->roots[i].in_memory = roots[i].in_memory;
  }
  impl->dir_path = impl->roots[0].rank_path;
  return impl;
}

}  // namespace

Status RankStore::Impl::open_dirs(std::size_t i, int root_fd, bool create) {
  RootFiles& rf = roots[i];
  std::string uid_path = join_path(rf.path, uid_name);
  std::string job_path = join_path(uid_path, id.job);
  int dupfd = ::fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
  if (dupfd < 0) return errno_error("cannot duplicate the handle of storage root " + rf.path);
  rf.root.reset(dupfd);

  if (create) {
    auto uid_dir = make_parent_dir(rf.root.get(), uid_name, uid_path, id.uid);
    if (!uid_dir) return std::move(uid_dir).error();
    rf.uid_dir = std::move(uid_dir).value();
    auto job_dir = make_parent_dir(rf.uid_dir.get(), id.job, job_path, id.uid);
    if (!job_dir) return std::move(job_dir).error();
    rf.job_dir = std::move(job_dir).value();

    if (::mkdirat(rf.job_dir.get(), rank_name.c_str(), kRankDirMode) != 0) {
      if (errno != EEXIST) return errno_error("cannot create directory " + rf.rank_path);
      // A directory of this name exists: pids are reused, so it may be a dead process's leftovers.
      // Replace it only if its owner is provably gone.
      UniqueFd old(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
      if (!old) return not_a_directory_error(errno, rf.rank_path);
      auto text = read_small_file(old.get(), kOwnerName, kMaxOwnerBytes, join_path(rf.rank_path, kOwnerName));
      std::optional<Owner> owner = text ? parse_owner(*text) : std::nullopt;
      if (owner && process_alive(owner->pid, owner->start_time)) {
        return make_error(EEXIST, fmt::format("{} belongs to the live process {}: a reconnecting rank must present "
                                              "its session token to adopt it",
                                              rf.rank_path, owner->pid));
      }
      // Without a readable owner nothing proves its process gone, and the pid in its name is alive (it
      // is the caller's): a data file with bytes may hold that very process's paused memory (its owner
      // file deleted, its token refused for that), so it is kept. Without one there is nothing to keep.
      struct stat data_st {};
      if (!owner && ::fstatat(old.get(), kDataName, &data_st, AT_SYMLINK_NOFOLLOW) == 0 && data_st.st_size > 0) {
        return make_error(EEXIST, fmt::format("{} has no valid owner file ({}) but a data file of {} bytes, which "
                                              "may hold the paused memory of pid {}, still running: tmsdiskd leaves "
                                              "it untouched. Remove the directory yourself if it is stale",
                                              rf.rank_path, text ? "not one tmsdiskd wrote" : text.error().describe(),
                                              data_st.st_size, id.pid));
      }
      if (auto s = empty_dir(old.get(), rf.rank_path, kRemoveDepth, nullptr); !s) return s;
      old.reset();
      if (::unlinkat(rf.job_dir.get(), rank_name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        return errno_error("cannot remove stale directory " + rf.rank_path);
      }
      if (::mkdirat(rf.job_dir.get(), rank_name.c_str(), kRankDirMode) != 0) {
        return errno_error("cannot create directory " + rf.rank_path);
      }
    }
    rf.rank_dir.reset(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
    if (!rf.rank_dir) return not_a_directory_error(errno, rf.rank_path);
    // The umask may have narrowed the mode; it must not be wider than 0700 either way.
    if (::fchmod(rf.rank_dir.get(), kRankDirMode) != 0) return errno_error("cannot set the mode of " + rf.rank_path);

    // The owner file needs no fsync: it only matters while its process lives, and a machine crash
    // ends that process too.
    std::string owner = format_owner(id);
    if (auto s = write_file_atomic(rf.rank_dir.get(), kOwnerTmpName, kOwnerName, owner, false, rf.rank_path); !s) {
      return s;
    }
  } else {
    rf.uid_dir.reset(open_dir_nofollow(rf.root.get(), uid_name.c_str()));
    if (!rf.uid_dir) return not_a_directory_error(errno, uid_path);
    rf.job_dir.reset(open_dir_nofollow(rf.uid_dir.get(), id.job.c_str()));
    if (!rf.job_dir) return not_a_directory_error(errno, job_path);
    rf.rank_dir.reset(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
    if (!rf.rank_dir) return not_a_directory_error(errno, rf.rank_path);

    std::string owner_path = join_path(rf.rank_path, kOwnerName);
    auto text = read_small_file(rf.rank_dir.get(), kOwnerName, kMaxOwnerBytes, owner_path);
    if (!text) return std::move(text).error();
    auto owner = parse_owner(*text);
    if (!owner) return make_error(EINVAL, owner_path + " is not a tmsdisk owner file");
    if (owner->pid != id.pid || owner->start_time != id.start_time || owner->token != id.token ||
        owner->uid != id.uid || owner->job != id.job) {
      return make_error(EPERM, rf.rank_path +
                                   " belongs to another session (pid, start time or token differ): "
                                   "reconnect with the token this daemon issued, or start afresh");
    }
  }

  auto data = open_data_file(rf.rank_dir.get(), create, rf.direct_io, join_path(rf.rank_path, kDataName));
  if (!data) return std::move(data).error();
  rf.data = std::move(data).value();
  if (i == 0) {
    auto journal = ChecksumJournal::open(rf.rank_dir.get(), create, join_path(rf.rank_path, kSumsName));
    if (!journal) return std::move(journal).error();
    this->journal = std::move(journal).value();
  }
  return {};
}

Status RankStore::Impl::remove_locked() {
  // The files go: what is still being punched in them is of no use, and the punches must stop
  // before a file is closed and unlinked (they hold dups of its descriptor, which would keep its
  // blocks until they end).
  punches.stop();
  holes_punched = false;
  Status first;
  for (auto& rf : roots) {
    if (rf.gone) continue;
    rf.data.reset();
    if (rf.rank_dir) {
      Status s = empty_dir(rf.rank_dir.get(), rf.rank_path, kRemoveDepth, nullptr);
      if (s && ::unlinkat(rf.job_dir.get(), rank_name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        s = errno_error("cannot remove directory " + rf.rank_path);
      }
      if (!s) {
        if (first) first = std::move(s);
        continue;
      }
    }
    // Also reached when create() failed before making the rank directory: the job and uid
    // directories it may have made go too, if nothing else uses them.
    rf.gone = true;
    rf.rank_dir.reset();
    if (rf.uid_dir) remove_if_empty(rf.uid_dir.get(), id.job.c_str());
    if (rf.root) remove_if_empty(rf.root.get(), uid_name.c_str());
    rf.job_dir.reset();
    rf.uid_dir.reset();
  }
  if (first) removed = true;
  return first;
}

Result<std::unique_ptr<RankStore>> RankStore::create(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  try {
    if (auto s = check_identity(roots, id, chunk_bytes); !s) return std::move(s).error();
    auto impl = new_impl(roots, id, chunk_bytes);
    for (std::size_t i = 0; i < roots.size(); ++i) {
      Status s = impl->open_dirs(i, roots[i].dir.get(), true);
      // A sweep may remove the job or uid directory in the moment it is empty; one retry covers it.
      if (!s && s.error().errnum() == ENOENT) s = impl->open_dirs(i, roots[i].dir.get(), true);
      if (!s) {
        // Leave nothing half-made behind: remove what this call created on earlier roots.
        (void)impl->remove_locked();
        return std::move(s).error();
      }
      if (!impl->roots[i].direct_io) roots[i].direct_io = false;
    }
    return std::unique_ptr<RankStore>(new RankStore(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return out_of_memory("creating a rank directory");
  }
}

Result<std::unique_ptr<RankStore>> RankStore::adopt(Roots& roots, const RankIdentity& id, uint32_t chunk_bytes) {
  try {
    if (auto s = check_identity(roots, id, chunk_bytes); !s) return std::move(s).error();
    auto impl = new_impl(roots, id, chunk_bytes);
    for (std::size_t i = 0; i < roots.size(); ++i) {
      if (auto s = impl->open_dirs(i, roots[i].dir.get(), false); !s) return std::move(s).error();
      if (!impl->roots[i].direct_io) roots[i].direct_io = false;
    }
    if (auto s = impl->load_manifest(); !s) return std::move(s).error();
    // The daemon before this one may have stopped before (or while) it gave space back.
    impl->holes_punched = false;
    return std::unique_ptr<RankStore>(new RankStore(std::move(impl)));
  } catch (const std::bad_alloc&) {
    return out_of_memory("adopting a rank directory");
  }
}

RankStore::RankStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankStore::~RankStore() = default;

const std::string& RankStore::dir_path() const noexcept {
  return impl_->dir_path;
}
const std::string& RankStore::relative_dir() const noexcept {
  return impl_->relative;
}
uint32_t RankStore::chunk_bytes() const noexcept {
  return impl_->chunk;
}
std::size_t RankStore::root_count() const noexcept {
  return impl_->roots.size();
}

Status RankStore::remove() {
  try {
    if (impl_->removed) return {};
    return impl_->remove_locked();
  } catch (const std::bad_alloc&) {
    return out_of_memory("removing a rank directory");
  }
}

// Extent of `size` bytes' chunks that land on root r of n: every n-th chunk starting at r, packed
// back to back; the blob's last chunk is rounded up to kIoAlignment so O_DIRECT can move it whole.
static uint64_t extent_length(uint64_t size, uint32_t chunk, std::size_t n, std::size_t r) {
  uint64_t chunks = size == 0 ? 0 : (size - 1) / chunk + 1;
  if (chunks <= r) return 0;
  uint64_t count = (chunks - 1 - r) / n + 1;
  uint64_t len = count * chunk;
  if ((chunks - 1) % n == r) {
    uint64_t tail = size - (chunks - 1) * chunk;
    len = (count - 1) * chunk + round_up(tail, kIoAlignment);
  }
  return len;
}

// Where chunk `ci` of `b` lies: its root and byte range (the last chunk rounded up to kIoAlignment).
static FileRange chunk_range(const BlobState& b, uint64_t ci, uint32_t chunk, std::size_t n) {
  const std::size_t r = static_cast<std::size_t>(ci % n);
  const uint64_t length = ci + 1 == b.chunks ? round_up(b.size - ci * chunk, kIoAlignment) : chunk;
  return {r, b.extents[r].offset + (ci / n) * chunk, length};
}

// Appends `range` to `out`, merged with the last range when they touch (consecutive chunks of a blob
// on one root are adjacent in its file): one fallocate or punch per run, not per chunk.
static void add_range(std::vector<FileRange>& out, const FileRange& range) {
  if (!out.empty() && out.back().root == range.root && out.back().offset + out.back().length == range.offset) {
    out.back().length += range.length;
    return;
  }
  out.push_back(range);
}

// Checks the runs of zero and host-tier chunks against the set (EINVAL naming the first wrong one),
// sorted by blob and chunk into `sorted`.
static Status check_zero_runs(std::span<const proto::BlobSize> set, std::span<const proto::ChunkRun> runs,
                              uint32_t chunk, std::vector<proto::ChunkRun>& sorted) {
  std::unordered_map<uint64_t, uint64_t> chunks_of;
  chunks_of.reserve(set.size());
  for (const auto& b : set) chunks_of.emplace(b.id, b.size == 0 ? 0 : (b.size - 1) / chunk + 1);
  for (const auto& z : runs) {
    auto it = chunks_of.find(z.blob);
    if (it == chunks_of.end())
      return make_error(EINVAL, fmt::format("a run of chunks names blob {}, which is not in the reserved set", z.blob));
    if (z.count == 0 || z.count > it->second || z.first_chunk > it->second - z.count) {
      return make_error(EINVAL, fmt::format("run of chunks [{}, {}+{}) of blob {} is empty or past its {} chunks",
                                            z.first_chunk, z.first_chunk, z.count, z.blob, it->second));
    }
  }
  sorted.assign(runs.begin(), runs.end());
  std::sort(sorted.begin(), sorted.end(), [](const proto::ChunkRun& a, const proto::ChunkRun& b) {
    return a.blob != b.blob ? a.blob < b.blob : a.first_chunk < b.first_chunk;
  });
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    const auto& prev = sorted[i - 1];
    if (prev.blob == sorted[i].blob && prev.first_chunk + prev.count > sorted[i].first_chunk) {
      return make_error(
          EINVAL, fmt::format("runs of chunks of blob {} overlap at chunk {}", sorted[i].blob, sorted[i].first_chunk));
    }
  }
  return {};
}

Status RankStore::Impl::reserve_locked(std::span<const proto::BlobSize> set, std::span<const proto::ChunkRun> zero_runs,
                                       std::span<const proto::ChunkRun> host_runs, std::span<const uint64_t> carry) {
  if (removed) return make_error(ENOENT, "the rank's directory was removed");
  // Carrying blobs, the rank says that what it does not carry is resident again (as a resume's commit
  // does for all of it): a committed pause may then give way to the new set.
  if (paused && carry.empty()) {
    return make_error(EBUSY, fmt::format("rank has a committed pause (generation {}) that was not resumed; its files "
                                         "are the only copy of that memory. Resume before reserving a new set",
                                         generation));
  }
  // A new set recycles extents the old one left free, and truncates and punches what it does not
  // use: over files whose record is lost, that could destroy the only copy of paused memory.
  if (!record_problem.empty()) return make_error(EBUSY, record_problem);
  if (!corrupt_records.empty()) {
    return make_error(EBUSY, fmt::format("{} chunk(s) of the pause in progress when tmsdiskd stopped have a corrupt "
                                         "record in the checksum journal {}: they may hold memory the rank released, "
                                         "so no new set is reserved over them. Resume first (`tmsctl resume`, or "
                                         "`tmsctl resume --accept-loss` for what cannot be verified)",
                                         corrupt_records.size(), journal.path()));
  }
  const std::size_t n = roots.size();

  std::unordered_map<uint64_t, uint64_t> size_of;  // blob id -> size in the new set
  size_of.reserve(set.size());
  for (const auto& b : set) {
    if (!size_of.emplace(b.id, b.size).second) {
      return make_error(EINVAL, fmt::format("blob {} appears twice in the reserved set", b.id));
    }
    if (b.size > kMaxBlobSize) {
      return make_error(
          EFBIG, fmt::format("blob {} of {} bytes is larger than tmsdisk supports ({})", b.id, b.size, kMaxBlobSize));
    }
  }
  std::vector<proto::ChunkRun> runs(zero_runs.begin(), zero_runs.end());
  runs.insert(runs.end(), host_runs.begin(), host_runs.end());
  if (auto st = check_zero_runs(set, std::vector<proto::ChunkRun>(runs), chunk, runs); !st) return st;
  // Carried blobs pass into the new set as they are: same size, every chunk sealed, data or zero or
  // in the rank's host tier, none of it named again by this set's runs.
  std::unordered_set<uint64_t> carried;
  carried.reserve(carry.size());
  for (const uint64_t id : carry) {
    if (!carried.insert(id).second) return make_error(EINVAL, fmt::format("blob {} is carried twice", id));
    // By lookup, not by a scan of the set per carried blob: both may hold a million blobs.
    auto in_set = size_of.find(id);
    auto it = index.find(id);
    if (in_set == size_of.end() || it == index.end() || blobs[it->second].size != in_set->second)
      return make_error(EINVAL, fmt::format("blob {} is carried but not held with that size in the set reserved now "
                                            "and the one stored",
                                            id));
    const auto& records = blobs[it->second].records;
    const auto unsealed = std::count_if(records.begin(), records.end(),
                                        [](const ChunkRecord& r) { return r.state == ChunkState::Missing; });
    if (unsealed > 0)
      return make_error(EINVAL,
                        fmt::format("blob {} cannot be carried: {} of its chunks were never written", id, unsealed));
  }
  for (const auto& r : runs)
    if (carried.count(r.blob))
      return make_error(EINVAL, fmt::format("a zero or host run names blob {}, which is carried as it is", r.blob));

  // The space the previous reservation gives back must be back before this one counts free space
  // and lays out, preallocates, truncates and punches ranges it may reuse: a punch that landed
  // after this reservation could hit blocks its chunks are written to.
  bool holes_known = wait_punches("the next reservation");
  // Chunks carried over as held must still be in the files: checked before the records are made.
  check_files(true);
  auto followed = follow_replaced_files(!carry.empty());
  if (!followed) return std::move(followed).error();
  // A file opened anew may have blocks anywhere (a copy): every free and zero range is punched.
  if (*followed) holes_known = false;

  // Plan the new layout on copies of the allocators; nothing on disk changes until it is complete.
  std::vector<ExtentAllocator> plan;
  plan.reserve(n);
  for (const auto& rf : roots) plan.push_back(rf.alloc);

  std::vector<bool> kept(blobs.size(), false);
  for (const auto& b : set) {
    auto it = index.find(b.id);
    if (it != index.end() && blobs[it->second].size == b.size) kept[it->second] = true;
  }
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    if (kept[i]) continue;
    for (std::size_t r = 0; r < n; ++r) {
      const auto& e = blobs[i].extents[r];
      if (e.length > 0 && !plan[r].release(e.offset, e.length)) {
        return make_error(
            EIO, "internal error: extent allocator of " + roots[r].rank_path + " is inconsistent; restart the rank");
      }
    }
  }

  std::vector<BlobState> next;
  next.reserve(set.size());
  std::unordered_map<uint64_t, std::size_t> next_index;
  next_index.reserve(set.size());
  uint64_t total_chunks = 0;
  for (const auto& b : set) {
    BlobState s;
    s.id = b.id;
    s.size = b.size;
    s.chunks = b.size == 0 ? 0 : (b.size - 1) / chunk + 1;
    auto it = index.find(b.id);
    if (it != index.end() && kept[it->second]) {
      s.extents = blobs[it->second].extents;
    } else {
      s.extents.resize(n);
      for (std::size_t r = 0; r < n; ++r) {
        uint64_t len = extent_length(b.size, chunk, n, r);
        if (len == 0) continue;
        auto off = plan[r].allocate(len);
        if (!off) return make_error(EFBIG, "the data file on " + roots[r].path + " would grow past 2^62 bytes");
        s.extents[r] = {*off, len};
      }
    }
    s.first_chunk = total_chunks;
    total_chunks += s.chunks;
    next_index.emplace(s.id, next.size());
    next.push_back(std::move(s));
  }
  for (auto& a : plan) a.trim_tail();

  // A first refusal before any per-chunk memory is allocated, so that a bogus size is refused for
  // lack of space rather than making this allocate without bound: the data chunks of new and resized
  // blobs need at least their bytes, somewhere on the roots.
  uint64_t fresh_data = 0;
  {
    std::unordered_map<uint64_t, uint64_t> zero_of;
    for (const auto& z : runs) {
      const uint64_t size = next[next_index.at(z.blob)].size;
      const uint64_t end = std::min<uint64_t>(size, (z.first_chunk + z.count) * chunk);
      zero_of[z.blob] += end - z.first_chunk * chunk;
    }
    for (const auto& s : next) {
      auto it = index.find(s.id);
      if (it == index.end() || !kept[it->second]) fresh_data += s.size - zero_of[s.id];
    }
  }
  uint64_t avail_all = 0;
  for (std::size_t r = 0; r < n; ++r) {
    struct statvfs vfs {};
    if (::fstatvfs(roots[r].data.get(), &vfs) != 0)
      return errno_error("cannot stat the filesystem of " + roots[r].path);
    avail_all += static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
  }
  if (fresh_data > avail_all)
    return no_space_error(ENOSPC, fresh_data, n == 1 ? roots[0].path : "the roots together", avail_all);

  // The chunk records. A kept blob keeps what its file provably holds (ChunkRecord::held); a zero
  // chunk holds nothing; a carried blob keeps its records whole, seals and states. Zero runs are few
  // and sorted; the records are bounded by the sessions' caps (max-chunks-per-uid), no longer by the
  // disk space a set needs.
  for (auto& s : next) {
    s.records.resize(s.chunks);
    auto it = index.find(s.id);
    if (it == index.end() || !kept[it->second]) continue;
    const auto& old = blobs[it->second].records;
    if (carried.count(s.id)) {
      s.records = old;
      continue;
    }
    for (uint64_t ci = 0; ci < s.chunks; ++ci)
      s.records[ci] = {.sum = old[ci].sum, .state = ChunkState::Missing, .held = old[ci].held};
  }
  for (const auto& [list, state] : {std::pair{zero_runs, ChunkState::Zero}, std::pair{host_runs, ChunkState::Host}}) {
    for (const auto& z : list) {
      auto& records = next[next_index.at(z.blob)].records;
      for (uint64_t ci = z.first_chunk; ci < z.first_chunk + z.count; ++ci)
        records[ci] = {.sum = {}, .state = state, .held = false};
    }
  }

  // What the files hold now: every used range is allocated but the zero chunks of the old set
  // (holes), and the free ranges were punched.
  std::vector<ExtentAllocator> holes;
  holes.reserve(n);
  for (const auto& rf : roots) holes.push_back(rf.alloc);
  for (const auto& b : blobs) {
    for (uint64_t ci = 0; ci < b.chunks; ++ci) {
      if (!kept_off_disk(b.records[ci].state)) continue;
      const FileRange range = chunk_range(b, ci, chunk, n);
      (void)holes[range.root].release(range.offset, range.length);
    }
  }

  // Data chunks are preallocated; zero chunks are punched (issue 9: a zero chunk takes no disk space).
  // Only what is a hole or free today needs new blocks.
  std::vector<FileRange> allocate;
  std::vector<FileRange> zero;
  std::vector<uint64_t> needed(n, 0);
  for (const auto& s : next) {
    auto it = index.find(s.id);
    const BlobState* old = it != index.end() && kept[it->second] ? &blobs[it->second] : nullptr;
    for (uint64_t ci = 0; ci < s.chunks; ++ci) {
      const FileRange range = chunk_range(s, ci, chunk, n);
      if (kept_off_disk(s.records[ci].state)) {
        add_range(zero, range);
      } else if (!old || kept_off_disk(old->records[ci].state) || roots[range.root].changed) {
        add_range(allocate, range);
        for_each_free_part(holes[range.root], range.offset, range.length,
                           [&](uint64_t, uint64_t len) { needed[range.root] += len; });
      }
    }
  }

  // A cheap refusal before touching the disk, with the numbers the user needs. It can only be
  // optimistic (roots may share a filesystem, metadata takes blocks): fallocate has the last word.
  std::vector<uint64_t> old_size(n, 0);
  for (std::size_t r = 0; r < n; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) != 0) return errno_error("cannot stat data file in " + roots[r].rank_path);
    old_size[r] = static_cast<uint64_t>(st.st_size);
    if (needed[r] == 0) continue;
    struct statvfs vfs {};
    if (::fstatvfs(roots[r].data.get(), &vfs) != 0)
      return errno_error("cannot stat the filesystem of " + roots[r].path);
    uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    if (needed[r] > avail) return no_space_error(ENOSPC, needed[r], roots[r].path, avail);
  }

  // What only gives space back once this set is recorded: each file's tail past the new layout,
  // its free extents and its zero chunks. Where the old layout's holes are known to be punched
  // (holes_known), only the ranges that held something are punched again. Given back after this
  // call returns, off the caller's thread (background_punch.h): nothing here waits for that space
  // (the preallocation above counts none of it, as before it moved), and none of these ranges is
  // written in this generation: locate() refuses a zero chunk and knows no free extent. Planned (the
  // allocations made, the descriptors duplicated) before the set is recorded, so that nothing after
  // that can fail.
  PunchPlan give_back;
  give_back.what = relative;
  give_back.files.resize(n);
  bool give_back_here = false;  // a descriptor could not be duplicated: given back on this thread
  {
    auto give = [&](std::size_t r, uint64_t off, uint64_t len) {
      auto& list = give_back.files[r].punches;
      auto add = [&](uint64_t a, uint64_t l) {
        if (!list.empty() && list.back().first + list.back().second == a)
          list.back().second += l;
        else
          list.emplace_back(a, l);
      };
      if (holes_known)
        for_each_used_part(holes[r], off, len, add);
      else
        add(off, len);
    };
    for (std::size_t r = 0; r < n; ++r) {
      auto& f = give_back.files[r];
      f.owned.reset(::fcntl(roots[r].data.get(), F_DUPFD_CLOEXEC, 0));
      f.fd = f.owned ? f.owned.get() : roots[r].data.get();
      give_back_here = give_back_here || !f.owned;
      f.size = old_size[r];
      if (plan[r].end() < old_size[r]) f.truncate_to = plan[r].end();
      for (const auto& [off, len] : plan[r].free_extents()) give(r, off, len);
    }
    for (const FileRange& z : zero) give(z.root, z.offset, z.length);
  }

  std::vector<uint8_t> touched(n, 0);  // allocated up front: the rollback below must not throw
  // Frees what this call allocated in the first `done` ranges of `allocate` and cuts any growth off,
  // so the files are as before. Only the parts that were free or holes in the old layout are
  // punched: a range may cover a dropped blob whose data the old set still owns.
  auto roll_back = [&](std::size_t done) {
    for (std::size_t j = 0; j < done; ++j) {
      const FileRange& g = allocate[j];
      for_each_free_part(holes[g.root], g.offset, g.length, [&](uint64_t off, uint64_t len) {
        if (!punch(roots[g.root].data.get(), off, len)) holes_punched = false;
      });
      touched[g.root] = 1;
    }
    for (std::size_t r = 0; r < n; ++r) {
      // Truncating to the unchanged size still drops blocks preallocated past the end of the file.
      if (!touched[r]) continue;
      while (::ftruncate(roots[r].data.get(), static_cast<off_t>(old_size[r])) != 0 && errno == EINTR) {
      }
    }
  };

  auto hook = testing::g_fallocate_hook.load();
  for (std::size_t k = 0; k < allocate.size(); ++k) {
    const FileRange& f = allocate[k];
    int err = hook ? hook(f.root, f.offset, f.length) : 0;
    if (err == 0) err = fallocate_retry(roots[f.root].data.get(), 0, f.offset, f.length);
    if (err == 0) continue;
    // The failed range too: a filesystem may have allocated part of it, even past the end of the file.
    roll_back(k + 1);
    if (err == ENOSPC || err == EDQUOT) {
      uint64_t avail = 0;
      struct statvfs vfs {};
      if (::fstatvfs(roots[f.root].data.get(), &vfs) == 0) {
        avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
      }
      return no_space_error(err, needed[f.root], roots[f.root].path, avail);
    }
    return make_error(err, fmt::format("cannot preallocate {} in the data file of {}", human_bytes(f.length),
                                       roots[f.root].rank_path));
  }
  // A file whose last chunks are zero ends before its layout does: it is extended (sparsely) to the
  // end the manifest records, which adopt() checks.
  for (std::size_t r = 0; r < n; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) >= plan[r].end()) continue;
    touched[r] = 1;
    int err = 0;
    while (::ftruncate(roots[r].data.get(), static_cast<off_t>(plan[r].end())) != 0 && (err = errno) == EINTR) {
    }
    if (err != 0) {
      roll_back(allocate.size());
      return make_error(err, "cannot extend the data file in " + roots[r].rank_path);
    }
  }

  // Record where this pause's chunks will go, and which are zero, before any is written, and empty
  // the checksum journal of the previous set: if the daemon dies mid-pause, its successor still
  // knows the extents and, from the journal, the checksum of every chunk written, and verifies what
  // the rank (which may have released it) reads back. Recorded before anything is punched, so that a
  // daemon stopped in between never adopts a record of bytes that are gone.
  std::vector<uint64_t> data_end(n);
  for (std::size_t r = 0; r < n; ++r) data_end[r] = plan[r].end();
  uint64_t seed = 0;
  Status st = journal.reset();
  if (st) st = write_manifest_of(next, data_end, kManifestWriting, generation, &seed);
  if (!st) {
    roll_back(allocate.size());
    return make_error(st.error().errnum(), "cannot record the reservation: " + st.error().describe());
  }
  journal.set_seed(seed);

  // Committed from here on; what follows only gives unused space back (best effort), and must not
  // fail.
  for (std::size_t r = 0; r < n; ++r) {
    roots[r].alloc = std::move(plan[r]);
    roots[r].changed = false;
  }
  if (give_back_here) {
    holes_punched = run_punch_plan(give_back, nullptr);
  } else {
    holes_punched = true;  // once `punches` is done; the next reservation learns whether it was
    punches.start(std::move(give_back));
  }
  blobs = std::move(next);
  index = std::move(next_index);
  writing = true;
  paused = false;  // a pause that gave way to carrying (the new set's commit makes the next generation)
  recount();
  return {};
}

void RankStore::Impl::recount() {
  missing = 0;
  for (auto& rf : roots) rf.off_disk_bytes = 0;
  for (const auto& b : blobs) {
    for (uint64_t ci = 0; ci < b.chunks; ++ci) {
      const ChunkState st = b.records[ci].state;
      if (st == ChunkState::Missing) ++missing;
      if (!kept_off_disk(st)) continue;
      const FileRange range = chunk_range(b, ci, chunk, roots.size());
      roots[range.root].off_disk_bytes += range.length;
    }
  }
}

void RankStore::Impl::forget_held(std::size_t r) {
  const std::size_t n = roots.size();
  for (auto& b : blobs) {
    for (uint64_t ci = r; ci < b.chunks; ci += n) b.records[ci].held = false;
  }
}

Result<bool> RankStore::Impl::follow_replaced_files(bool carrying) {
  if (writing || paused || carrying) return false;
  bool opened = false;
  for (std::size_t r = 0; r < roots.size(); ++r) {
    RootFiles& rf = roots[r];
    const std::string path = join_path(rf.rank_path, kDataName);
    struct stat open_st {};
    struct stat named {};
    if (::fstat(rf.data.get(), &open_st) != 0) return errno_error("cannot stat the data file " + path);
    const bool named_exists = ::fstatat(rf.rank_dir.get(), kDataName, &named, AT_SYMLINK_NOFOLLOW) == 0;
    if (!named_exists && errno != ENOENT) return errno_error("cannot stat " + path);
    if (named_exists && named.st_dev == open_st.st_dev && named.st_ino == open_st.st_ino) continue;
    bool direct_io = true;
    auto data = open_data_file(rf.rank_dir.get(), !named_exists, direct_io, path);
    if (!data) return std::move(data).error();
    spdlog::warn(
        "{}: {} is no longer the file tmsdiskd had open ({} outside it): the file now at that name is "
        "used, and every chunk is written to it anew",
        relative, path, named_exists ? "another file was put in its place" : "it was removed");
    rf.data = std::move(data).value();
    rf.direct_io = direct_io;
    rf.known.reset();
    rf.changed = true;
    forget_held(r);
    opened = true;
  }
  return opened;
}

void RankStore::Impl::check_files(bool before_change) {
  for (std::size_t r = 0; r < roots.size(); ++r) {
    RootFiles& rf = roots[r];
    if (!rf.known) {
      // Nothing vouches for the file since the store last changed it: nothing in it is trusted.
      forget_held(r);
      continue;
    }
    const std::optional<FileIdentity> now = file_identity(rf.data.get());
    // The name too: the store goes on writing the file it has open, which a daemon restarted later
    // would not find.
    struct stat named {};
    const bool replaced = !now || ::fstatat(rf.rank_dir.get(), kDataName, &named, AT_SYMLINK_NOFOLLOW) != 0 ||
                          static_cast<uint64_t>(named.st_ino) != now->ino ||
                          static_cast<uint64_t>(named.st_dev) != now->dev;
    if (!now || replaced || !(*now == *rf.known)) {
      spdlog::warn(
          "{}: the data file {} changed since tmsdiskd last wrote it ({}): its chunks are written again "
          "at the next pause instead of being taken as unchanged",
          relative, join_path(rf.rank_path, kDataName),
          !now                                                                 ? "it cannot be stat'ed"
          : replaced || now->ino != rf.known->ino || now->dev != rf.known->dev ? "another file is in its place"
          : now->size != rf.known->size                                        ? "its size differs"
                                                                               : "it was modified");
      forget_held(r);
      rf.known.reset();
      rf.changed = true;
      continue;
    }
    if (before_change) rf.known.reset();
  }
}

Status RankStore::reserve(std::span<const proto::BlobSize> blobs, std::span<const proto::ChunkRun> zero_runs,
                          std::span<const proto::ChunkRun> host_runs, std::span<const uint64_t> carry) {
  try {
    return impl_->reserve_locked(blobs, zero_runs, host_runs, carry);
  } catch (const std::bad_alloc&) {
    return out_of_memory("reserving extents (set unchanged)");
  }
}

void RankStore::wait_for_punches() noexcept {
  (void)impl_->wait_punches("wait_for_punches()");
}

Result<const BlobState*> RankStore::Impl::find_chunk(uint64_t blob, uint64_t offset, uint64_t* chunk_index) const {
  if (removed) return make_error(ENOENT, "the rank's directory was removed");
  if (!record_problem.empty()) return make_error(EUCLEAN, record_problem);
  auto it = index.find(blob);
  if (it == index.end()) return make_error(ENOENT, fmt::format("blob {} is not in the reserved set", blob));
  const BlobState& b = blobs[it->second];
  if (offset % chunk != 0) {
    return make_error(EINVAL,
                      fmt::format("offset {} of blob {} is not a multiple of the chunk size {}", offset, blob, chunk));
  }
  if (offset >= b.size) {
    return make_error(EINVAL, fmt::format("offset {} is past the end of blob {} ({} bytes)", offset, blob, b.size));
  }
  *chunk_index = offset / chunk;
  // Also what keeps every write of this generation off the ranges being punched after its
  // reservation (background_punch.h): a zero chunk has no Location, nor has a free extent.
  if (b.records[*chunk_index].state == ChunkState::Zero) {
    return make_error(EINVAL,
                      fmt::format("chunk at offset {} of blob {} was reserved as zero: nothing is stored for "
                                  "it, so it is neither written nor read (resume sets it to zero on the device)",
                                  offset, blob));
  }
  if (b.records[*chunk_index].state == ChunkState::Host) {
    return make_error(EINVAL, fmt::format("chunk at offset {} of blob {} was reserved in the rank's host tier: "
                                          "nothing is stored for it, so it is neither written nor read",
                                          offset, blob));
  }
  return &b;
}

Result<const BlobState*> RankStore::Impl::find_chunk_of_length(uint64_t blob, uint64_t offset, uint64_t length,
                                                               uint64_t* chunk_index) const {
  auto found = find_chunk(blob, offset, chunk_index);
  if (!found) return found;
  const uint64_t want = std::min<uint64_t>(chunk, (*found)->size - offset);
  if (length != want) {
    return make_error(EINVAL,
                      fmt::format("chunk at offset {} of blob {} is {} bytes, not {}", offset, blob, want, length));
  }
  return found;
}

Status RankStore::Impl::record(uint64_t blob, uint64_t offset, Checksum128 sum, bool held) {
  uint64_t ci = 0;
  auto found = find_chunk(blob, offset, &ci);
  if (!found) return std::move(found).error();
  auto& b = const_cast<BlobState&>(**found);
  // Journaled first: a chunk counts as sealed only once a restarted daemon could still verify it.
  if (auto st = journal.record(b.first_chunk + ci, blob, ci, sum); !st) return st;
  ChunkRecord& rec = b.records[ci];
  if (rec.state == ChunkState::Missing) --missing;
  rec = {.sum = sum,
         .state = sealed_state(),
         .held = held && sealed_state() == ChunkState::Data,
         .opened = rec.opened};  // a WRITE of the chunk may be open still (settle_write() checks it)
  corrupt_records.erase(b.first_chunk + ci);
  return {};
}

Checksum128 RankStore::Impl::hash(std::span<const uint8_t> bytes) const {
  return RankStore::hash_chunk(journal.version1_layout(), bytes);
}

Checksum128 RankStore::hash_chunk(bool xxh64, std::span<const uint8_t> bytes) noexcept {
  if (xxh64) return {XXH3_64bits(bytes.data(), bytes.size()), 0};
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return {h.low64, h.high64};
}

Result<RankStore::Location> RankStore::locate(uint64_t blob, uint64_t offset, uint32_t length) const {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    const FileRange range = chunk_range(**found, ci, impl_->chunk, impl_->roots.size());
    const RootFiles& rf = impl_->roots[range.root];
    Location loc;
    loc.fd = rf.data.get();
    loc.direct_io = rf.direct_io;
    loc.in_memory = rf.in_memory;
    loc.file_offset = range.offset;
    loc.io_length = static_cast<uint32_t>(round_up(length, kIoAlignment));
    return loc;
  } catch (const std::bad_alloc&) {
    return out_of_memory("locating a chunk");
  }
}

Result<RankStore::WritePlan> RankStore::begin_write(uint64_t blob, uint64_t offset, std::span<const uint8_t> bytes) {
  const auto length = static_cast<uint32_t>(std::min<std::size_t>(bytes.size(), UINT32_MAX));
  auto ticket = open_write(blob, offset, length);
  if (!ticket) return std::move(ticket).error();
  return settle_write(blob, offset, length, *ticket, hash_chunk(ticket->xxh64, bytes));
}

Result<RankStore::WriteTicket> RankStore::open_write(uint64_t blob, uint64_t offset, uint32_t length) {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    // A WRITE after a commit, with no reservation since: the identities that commit recorded are
    // checked now, before the first chunk is taken as held (and dropped: this WRITE changes the file).
    if (std::any_of(impl_->roots.begin(), impl_->roots.end(), [](const RootFiles& rf) { return rf.known.has_value(); }))
      impl_->check_files(true);
    ChunkRecord& rec = const_cast<BlobState&>(**found).records[ci];
    const WriteTicket ticket{.held_sum = rec.sum,
                             .held = rec.held && impl_->sealed_state() == ChunkState::Data,
                             .xxh64 = impl_->journal.version1_layout(),
                             .opened = ++rec.opened};
    // Until the write completes (or settle_write() finds it unneeded), what the file holds there is
    // unknown, and a seal of this generation no longer describes it.
    rec.held = false;
    if (is_data(rec.state)) {
      rec.state = ChunkState::Missing;
      ++impl_->missing;
    }
    return ticket;
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening a chunk's write");
  }
}

Result<RankStore::WritePlan> RankStore::settle_write(uint64_t blob, uint64_t offset, uint32_t length,
                                                     const WriteTicket& ticket, Checksum128 sum) {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    const ChunkRecord& rec = (*found)->records[ci];
    // Nothing wrote there since open_write(), which found the file holding bytes of held_sum: no write
    // of this WRITE has started, and any other WRITE of the chunk was opened after it (`opened`).
    if (ticket.held && rec.opened == ticket.opened && sum == ticket.held_sum &&
        impl_->sealed_state() == ChunkState::Data) {
      if (auto st = impl_->record(blob, offset, sum, true); !st) return std::move(st).error();
      return WritePlan{.sum = sum, .unchanged = true};
    }
    return WritePlan{.sum = sum, .unchanged = false};
  } catch (const std::bad_alloc&) {
    return out_of_memory("settling a chunk's write");
  }
}

Result<Checksum128> RankStore::end_write(uint64_t blob, uint64_t offset, uint32_t length, Checksum128 sum) {
  try {
    uint64_t ci = 0;
    if (auto found = impl_->find_chunk_of_length(blob, offset, length, &ci); !found) return std::move(found).error();
    if (auto st = impl_->record(blob, offset, sum, true); !st) return std::move(st).error();
    return sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("sealing a chunk");
  }
}

Result<Checksum128> RankStore::seal(uint64_t blob, uint64_t offset, std::span<const uint8_t> bytes) {
  return end_write(blob, offset, static_cast<uint32_t>(std::min<std::size_t>(bytes.size(), UINT32_MAX)),
                   impl_->hash(bytes));
}

bool RankStore::record_checksum(uint64_t blob, uint64_t offset, Checksum128 checksum) {
  try {
    return static_cast<bool>(impl_->record(blob, offset, checksum, false));
  } catch (const std::bad_alloc&) {
    return false;
  }
}

Result<Checksum128> RankStore::expected_checksum(uint64_t blob, uint64_t offset) const {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk(blob, offset, &ci);
    if (!found) return std::move(found).error();
    const ChunkRecord& rec = (*found)->records[ci];
    if (!is_data(rec.state)) {
      if (impl_->corrupt_records.count((*found)->first_chunk + ci)) {
        return make_error(
            EUCLEAN,
            fmt::format("the record of this chunk in the checksum journal {} is corrupt, so the chunk cannot be "
                        "verified; {}. If you have an intact copy of the journal, put it back and restart tmsdiskd; "
                        "otherwise `tmsctl resume --accept-loss` gives the allocation zero-filled memory",
                        impl_->journal.path(), impl_->kept_files_text()));
      }
      return make_error(
          ENODATA, fmt::format("chunk at offset {} of blob {} was never written in this generation", offset, blob));
    }
    return rec.sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("looking up a checksum");
  }
}

Result<Checksum128> RankStore::verify(uint64_t blob, uint64_t offset, std::span<const uint8_t> bytes) {
  const auto length = static_cast<uint32_t>(std::min<std::size_t>(bytes.size(), UINT32_MAX));
  auto ticket = open_read(blob, offset, length);
  if (!ticket) return std::move(ticket).error();
  return settle_read(blob, offset, length, hash_chunk(ticket->xxh64, bytes));
}

Result<RankStore::ReadTicket> RankStore::open_read(uint64_t blob, uint64_t offset, uint32_t length) const {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    if (auto expected = expected_checksum(blob, offset); !expected) return std::move(expected).error();
    // A version-1 record vouches with an XXH3-64; everything else with an XXH3-128. One pass either way.
    return ReadTicket{.xxh64 = (*found)->records[ci].state == ChunkState::Data64};
  } catch (const std::bad_alloc&) {
    return out_of_memory("opening a chunk's read");
  }
}

Result<Checksum128> RankStore::settle_read(uint64_t blob, uint64_t offset, uint32_t length, Checksum128 sum) {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    auto expected = expected_checksum(blob, offset);
    if (!expected) return expected;
    if (sum != *expected) {
      // Whatever the file holds there, it is not what was sealed: never skip a write over it. (A sum of
      // the other kind than the record's, the record rewritten meanwhile, lands here too: refused.)
      const_cast<BlobState&>(**found).records[ci].held = false;
      return make_error(EBADMSG, fmt::format("checksum mismatch in blob {} at offset {}: the bytes read are not what "
                                             "was sealed (the backup file is damaged, or the staging slot was written "
                                             "before the answer); the allocation stays paused and the file is kept",
                                             blob, offset));
    }
    return sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("verifying a chunk");
  }
}

uint64_t RankStore::missing_chunks() const noexcept {
  return impl_->missing;
}

bool RankStore::holds_unresumed_data() const noexcept {
  if (awaits_resume()) return true;
  if (!impl_->writing) return false;
  return impl_->missing < chunk_count();
}

bool RankStore::paused() const noexcept {
  return impl_->paused;
}

bool RankStore::awaits_resume() const noexcept {
  return impl_->paused || !impl_->record_problem.empty() || !impl_->corrupt_records.empty();
}

const std::string& RankStore::record_problem() const noexcept {
  return impl_->record_problem;
}

uint64_t RankStore::generation() const noexcept {
  return impl_->generation;
}

std::size_t RankStore::blob_count() const noexcept {
  return impl_->blobs.size();
}

std::vector<proto::BlobSize> RankStore::blobs() const {
  std::vector<proto::BlobSize> out;
  try {
    out.reserve(impl_->blobs.size());
    for (const auto& b : impl_->blobs) out.push_back({b.id, b.size});
  } catch (const std::bad_alloc&) {
    out.clear();
  }
  return out;
}

uint64_t RankStore::disk_bytes() const noexcept {
  uint64_t total = 0;
  if (!impl_->record_problem.empty()) {
    // Nothing is known to be used or free: all of it is kept.
    try {
      for (uint64_t n : impl_->data_file_sizes()) total += n;
    } catch (const std::bad_alloc&) {
    }
    return total;
  }
  for (const auto& rf : impl_->roots) total += rf.alloc.used_bytes() - rf.off_disk_bytes;
  return total;
}

uint64_t RankStore::disk_bytes_on(std::size_t root) const noexcept {
  if (root >= impl_->roots.size()) return 0;
  if (!impl_->record_problem.empty()) {
    // As disk_bytes(): with the record lost, the whole data file is kept.
    try {
      const std::vector<uint64_t> sizes = impl_->data_file_sizes();
      return root < sizes.size() ? sizes[root] : 0;
    } catch (const std::bad_alloc&) {
      return 0;
    }
  }
  return impl_->roots[root].alloc.used_bytes() - impl_->roots[root].off_disk_bytes;
}

uint64_t RankStore::chunk_count() const noexcept {
  uint64_t total = 0;
  for (const auto& b : impl_->blobs) total += b.chunks;
  return total;
}

uint64_t RankStore::host_tier_bytes() const noexcept {
  uint64_t chunks = 0;
  for (const auto& b : impl_->blobs)
    for (uint64_t ci = 0; ci < b.chunks; ++ci) chunks += b.records[ci].state == ChunkState::Host;
  return chunks * impl_->chunk;
}

uint64_t RankStore::zero_bytes(std::span<const uint64_t> except) const noexcept {
  // A figure for the log and the metrics: without memory for the lookup, every blob is counted.
  std::unordered_set<uint64_t> skip;
  try {
    skip.insert(except.begin(), except.end());
  } catch (const std::bad_alloc&) {
    skip.clear();
  }
  uint64_t total = 0;
  for (const auto& b : impl_->blobs) {
    if (skip.count(b.id)) continue;
    for (uint64_t ci = 0; ci < b.chunks; ++ci) {
      if (b.records[ci].state == ChunkState::Zero)
        total += std::min<uint64_t>(impl_->chunk, b.size - ci * impl_->chunk);
    }
  }
  return total;
}

Status RankStore::commit(proto::CommitState state) {
  try {
    Impl& m = *impl_;
    if (m.removed) return make_error(ENOENT, "the rank's directory was removed");
    if (state != proto::CommitState::Paused && state != proto::CommitState::Resumed) {
      return make_error(EINVAL, fmt::format("unknown commit state {}", static_cast<int>(state)));
    }
    // The rank says every allocation is resident again (or was given up with --accept-loss): what
    // the files hold is no longer needed, and a lost record stops mattering. A pause, though, has
    // nothing to commit: no set could be reserved.
    if (state == proto::CommitState::Paused && !m.record_problem.empty()) return make_error(EBUSY, m.record_problem);
    if (state == proto::CommitState::Paused) {
      if (m.missing > 0) {
        uint64_t total = 0;
        for (const auto& b : m.blobs) total += b.chunks;
        return make_error(EINVAL, fmt::format("{} of {} chunks of the reserved set were never written; the pause is "
                                              "incomplete and was not committed",
                                              m.missing, total));
      }
      // The data must be on disk before a manifest that vouches for it; for O_DIRECT files this also
      // persists the conversion of fallocated (unwritten) extents.
      for (auto& rf : m.roots) {
        if (::fdatasync(rf.data.get()) != 0) return errno_error("cannot flush the data file in " + rf.rank_path);
      }
      // What the files hold is known now, chunk by chunk: their identities vouch for it until the
      // store changes them again (recorded in the manifest too, for a daemon restarted before the
      // next pause). Space the reservation gives back may still be being punched: the file changes
      // after this, so nothing is recorded and the next pause rewrites rather than trusts.
      const bool punching = m.punches.busy();
      for (auto& rf : m.roots) rf.known = punching ? std::nullopt : settled_file_identity(rf.data.get());
    }

    // The store numbers the pauses: the manifest is the one record of which pause the files hold.
    const uint64_t generation = state == proto::CommitState::Paused ? m.generation + 1 : m.generation;
    if (auto s = m.write_manifest(state == proto::CommitState::Paused ? kManifestPaused : kManifestResumed, generation);
        !s) {
      return s;
    }
    m.paused = state == proto::CommitState::Paused;
    m.writing = false;
    m.generation = generation;
    m.record_problem.clear();
    m.corrupt_records.clear();
    // The manifest now holds every checksum; the journal's records are of no further use. Failing
    // to empty it costs only its few bytes: a committed manifest never reads it.
    (void)m.journal.reset();
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("committing the manifest");
  }
}

Status RankStore::Impl::write_manifest(uint32_t state, uint64_t gen, uint64_t* hash) {
  std::vector<uint64_t> data_end;
  data_end.reserve(roots.size());
  for (const auto& rf : roots) data_end.push_back(rf.alloc.end());
  return write_manifest_of(blobs, data_end, state, gen, hash);
}

Status RankStore::Impl::write_manifest_of(const std::vector<BlobState>& set, const std::vector<uint64_t>& data_end,
                                          uint32_t state, uint64_t gen, uint64_t* hash) {
  Manifest mf;
  mf.state = state;
  mf.generation = gen;
  mf.chunk_bytes = chunk;
  mf.data_end = data_end;
  mf.data_files.reserve(roots.size());
  for (const auto& rf : roots) mf.data_files.push_back(rf.known);
  mf.blobs.reserve(set.size());
  for (const auto& b : set) {
    ManifestBlob mb{.id = b.id, .size = b.size, .extents = b.extents, .states = {}, .sums = {}};
    mb.states.reserve(b.chunks);
    mb.sums.reserve(b.chunks);
    for (const auto& rec : b.records) {
      mb.states.push_back(rec.state);
      mb.sums.push_back(is_data(rec.state) ? rec.sum : Checksum128{});
    }
    mf.blobs.push_back(std::move(mb));
  }
  std::string bytes = encode_manifest(mf);
  if (hash) *hash = XXH3_64bits(bytes.data(), bytes.size());
  RootFiles& first = roots[0];
  return write_file_atomic(first.rank_dir.get(), kManifestTmpName, kManifestName, bytes, true, first.rank_path);
}

namespace {

// What a lost record means, said after what is lost.
constexpr const char* kNoRecordMeans =
    ": without it tmsdiskd cannot tell where this rank's paused memory lies in its data file, nor verify it";
constexpr const char* kNoJournalMeans =
    ": without it tmsdiskd cannot verify the chunks that pause wrote, some of which may hold the only copy of "
    "memory the rank released";

}  // namespace

std::vector<uint64_t> RankStore::Impl::data_file_sizes() const {
  std::vector<uint64_t> sizes;
  sizes.reserve(roots.size());
  for (const auto& rf : roots) {
    struct stat st {};
    sizes.push_back(rf.data && ::fstat(rf.data.get(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0);
  }
  return sizes;
}

std::string RankStore::Impl::kept_files_text() const {
  const std::vector<uint64_t> sizes = data_file_sizes();
  std::string files;
  for (std::size_t r = 0; r < roots.size(); ++r) {
    if (r) files += r + 1 == roots.size() ? " and " : ", ";
    files += fmt::format("{} ({} bytes)", join_path(roots[r].rank_path, kDataName), sizes[r]);
  }
  return fmt::format("the data file{} {} {} kept untouched", roots.size() > 1 ? "s" : "", files,
                     roots.size() > 1 ? "are" : "is");
}

void RankStore::Impl::lose_record(const std::string& what) {
  record_problem = fmt::format(
      "{}; {}, and tmsdiskd neither restores memory from {} nor reserves a new pause over {}. If you have an "
      "intact copy, put it back and restart tmsdiskd: the rank reconnects and `tmsctl resume` restores its memory. "
      "Otherwise `tmsctl resume --accept-loss` gives the paused allocations zero-filled memory at the same "
      "addresses (the files are reused from then on). The rank keeps running meanwhile",
      what, kept_files_text(), roots.size() > 1 ? "them" : "it", roots.size() > 1 ? "them" : "it");
}

// Never truncates, punches or removes: whatever the record is missing, the data files may hold the
// only copy of memory the rank released (invariant 6). A record that cannot be used becomes
// record_problem, which refuses every use of the files until the rank commits a resume (issue 11).
Status RankStore::Impl::load_manifest() {
  RootFiles& first = roots[0];
  std::string path = join_path(first.rank_path, kManifestName);
  auto bytes = read_small_file(first.rank_dir.get(), kManifestName, kMaxManifestBytes, path);
  if (!bytes) {
    if (bytes.error().errnum() != ENOENT) {
      lose_record(
          fmt::format("the pause record {} is unreadable ({}){}", path, bytes.error().describe(), kNoRecordMeans));
      return {};
    }
    // No reservation was ever recorded: the data files are still as create() made them, empty. A
    // byte in them means the record was deleted (or the daemon stopped between preallocating a first
    // reservation and recording it, when the rank released nothing: it closes the record itself, see
    // awaits_resume()).
    const std::vector<uint64_t> sizes = data_file_sizes();
    if (std::all_of(sizes.begin(), sizes.end(), [](uint64_t n) { return n == 0; })) return {};
    lose_record(fmt::format("the pause record {} is missing{}", path, kNoRecordMeans));
    return {};
  }
  auto unreadable = [&](const std::string& why) {
    lose_record(fmt::format("the pause record {} is unreadable ({}){}", path, why, kNoRecordMeans));
    return Status{};
  };
  std::string why;
  auto mf = decode_manifest(*bytes, why);
  if (!mf) return unreadable(why);
  if (mf->chunk_bytes != chunk) {
    return make_error(EINVAL, fmt::format("{} was written with chunk size {}, this session uses {}: reconnect with "
                                          "the chunk size of the original session",
                                          path, mf->chunk_bytes, chunk));
  }
  const std::size_t n = roots.size();
  if (mf->data_end.size() != n) {
    return make_error(EINVAL, fmt::format("{} was written with {} storage roots, the daemon now has {}: restore the "
                                          "original --root list to resume this rank",
                                          path, mf->data_end.size(), n));
  }
  std::vector<ExtentAllocator> allocs;
  allocs.reserve(n);
  for (std::size_t r = 0; r < n; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) != 0)
      return errno_error("cannot stat the data file in " + roots[r].rank_path);
    if (static_cast<uint64_t>(st.st_size) < mf->data_end[r]) {
      lose_record(
          fmt::format("the data file {} is shorter ({} bytes) than its pause record {} says ({} bytes): it "
                      "was truncated outside tmsdiskd, and the paused memory it held is lost",
                      join_path(roots[r].rank_path, kDataName), st.st_size, path, mf->data_end[r]));
      return {};
    }
    allocs.push_back(ExtentAllocator::with_free_file(kIoAlignment, mf->data_end[r]));
  }
  std::vector<BlobState> loaded;
  std::unordered_map<uint64_t, std::size_t> idx;
  loaded.reserve(mf->blobs.size());
  uint64_t missing_count = 0;
  uint64_t ordinal = 0;
  for (auto& mb : mf->blobs) {
    if (mb.size > kMaxBlobSize || !idx.emplace(mb.id, loaded.size()).second)
      return unreadable(fmt::format("it lists blob {} twice or with an invalid size", mb.id));
    for (std::size_t r = 0; r < n; ++r) {
      const auto& e = mb.extents[r];
      uint64_t want = extent_length(mb.size, chunk, n, r);
      if (e.length != want || (want > 0 && !allocs[r].claim(e.offset, e.length)))
        return unreadable(
            fmt::format("the extent of blob {} on root {} is inconsistent: wrong length, overlap or "
                        "past the end",
                        mb.id, r));
    }
    BlobState s;
    s.id = mb.id;
    s.size = mb.size;
    s.chunks = mb.size == 0 ? 0 : (mb.size - 1) / chunk + 1;
    s.first_chunk = ordinal;
    ordinal += s.chunks;
    if (mb.sums.size() != s.chunks || mb.states.size() != s.chunks)
      return unreadable(fmt::format("wrong number of checksums for blob {}", mb.id));
    s.extents = std::move(mb.extents);
    s.records.resize(s.chunks);
    for (uint64_t ci = 0; ci < s.chunks; ++ci) {
      const ChunkState st = mb.states[ci];
      // A committed generation's 128-bit sums describe what the file holds (nothing was written after
      // its commit: a write needs a reservation, which rewrites the manifest first) if the file is
      // still the one the manifest recorded (check_files() below); a pause in progress when the
      // previous daemon stopped may have had writes in flight.
      s.records[ci] = {
          .sum = mb.sums[ci], .state = st, .held = st == ChunkState::Data && mf->state != kManifestWriting};
      missing_count += st == ChunkState::Missing ? 1 : 0;
    }
    loaded.push_back(std::move(s));
  }
  if (mf->state == kManifestPaused && missing_count > 0)
    return unreadable(fmt::format("it says paused but {} chunks have no checksum", missing_count));
  if (mf->state == kManifestWriting && journal.created()) {
    // The pause in progress when the previous daemon stopped sealed its chunks in the journal only.
    lose_record(fmt::format("the checksum journal {} of the pause in progress when tmsdiskd stopped is missing{}",
                            journal.path(), kNoJournalMeans));
    return {};
  }
  for (std::size_t r = 0; r < n; ++r) {
    roots[r].alloc = std::move(allocs[r]);
    roots[r].known = r < mf->data_files.size() ? mf->data_files[r] : std::nullopt;
  }
  blobs = std::move(loaded);
  index = std::move(idx);
  // On the manifest's word alone nothing is held: only where the file is still the one it recorded.
  check_files(false);
  missing = missing_count;
  paused = mf->state == kManifestPaused;
  writing = mf->state == kManifestWriting;
  generation = mf->generation;
  recount();
  // A pause in progress when the previous daemon stopped: the checksums of the chunks it wrote are
  // in the journal of this reservation (seeded with this manifest's hash), in the layout of the
  // manifest's version (a daemon upgraded mid-pause).
  if (!writing) return {};
  if (mf->version == kManifestVersion1) journal.use_version1_layout();
  return load_journal(XXH3_64bits(bytes->data(), bytes->size()), ordinal);
}

Status RankStore::Impl::load_journal(uint64_t seed, uint64_t chunks) {
  journal.set_seed(seed);
  auto records = journal.load(chunks);
  if (!records) {
    // Nothing loaded is usable without it: forget the reservation rather than half-know it.
    blobs.clear();
    index.clear();
    for (auto& rf : roots) rf.alloc = ExtentAllocator(kIoAlignment);
    recount();
    writing = false;
    lose_record(
        fmt::format("the checksum journal {} of the pause in progress when tmsdiskd stopped is unreadable "
                    "({}){}",
                    journal.path(), records.error().describe(), kNoJournalMeans));
    return {};
  }
  for (auto& b : blobs) {
    for (uint64_t ci = 0; ci < b.chunks; ++ci) {
      ChunkRecord& rec = b.records[ci];
      if (kept_off_disk(rec.state)) continue;  // recorded by the manifest, never journaled
      const auto& r = (*records)[b.first_chunk + ci];
      if (r.valid && r.blob == b.id && r.chunk == ci) {
        if (rec.state == ChunkState::Missing) --missing;
        rec = {.sum = r.checksum,
               .state = journal.version1_layout() ? ChunkState::Data64 : ChunkState::Data,
               .held = false};
      } else if (r.corrupt || r.valid) {  // a valid record in another chunk's place is no less wrong
        corrupt_records.insert(b.first_chunk + ci);
      }
    }
  }
  return {};
}

}  // namespace tmsdisk::storage
