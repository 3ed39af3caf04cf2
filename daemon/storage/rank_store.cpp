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

#include "owner_file.h"
#include "rank_store_impl.h"
#include "storage_fs.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/proc.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::storage {

using namespace detail;

namespace {

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

}  // namespace

Result<UniqueFd> open_data_file(int rank_dir, const std::string& name, bool create, bool& direct_io,
                                const std::string& path) {
  int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
  int fd = ::openat(rank_dir, name.c_str(), flags | O_DIRECT, kFileMode);
  direct_io = true;
  if (fd < 0 && errno == EINVAL) {
    // This filesystem has no O_DIRECT (tmpfs before 6.6, some FUSE and network filesystems):
    // buffered I/O still works, only slower and through the page cache. The caller logs it. The
    // refused open may have created the file already (the kernel checks O_DIRECT after creating
    // it): that empty file goes, so that the new one is still created exclusively, by us.
    if (create) (void)::unlinkat(rank_dir, name.c_str(), 0);
    fd = ::openat(rank_dir, name.c_str(), flags, kFileMode);
    direct_io = false;
  }
  if (fd < 0) return errno_error("cannot open data file " + path);
  UniqueFd out(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat " + path);
  if (!S_ISREG(st.st_mode)) return make_error(EINVAL, path + " is not a regular file");
  // One tmsdiskd made: in a directory its user may write (one a rank chose), another file, or a hard
  // link to one, could have been put at that name for the daemon to write into.
  if (st.st_nlink != 1 || st.st_uid != ::geteuid())
    return make_error(EPERM, fmt::format("{} is not a file of tmsdiskd's own ({} link(s), owned by uid {}): it was "
                                         "put there by someone else; remove it",
                                         path, st.st_nlink, st.st_uid));
  return out;
}

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
  impl->own_dir = roots.rank_chosen();
  if (impl->own_dir) impl->names = RankFileNames(rank_file_prefix(id));
  impl->roots.resize(roots.size());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    impl->roots[i].path = roots[i].path;
    impl->roots[i].rank_path = impl->own_dir ? roots[i].path : join_path(roots[i].path, impl->relative);
    impl->roots[i].in_memory = roots[i].in_memory;
  }
  impl->dir_path = impl->roots[0].rank_path;
  return impl;
}

}  // namespace

Status RankStore::Impl::open_dirs(std::size_t i, int root_fd, bool create) {
  RootFiles& rf = roots[i];
  int dupfd = ::fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
  if (dupfd < 0) return errno_error("cannot duplicate the handle of storage root " + rf.path);
  rf.root.reset(dupfd);
  if (auto s = own_dir ? enter_own_dir(rf, create) : enter_rank_dir(rf, create); !s) return s;

  const std::string owner_path = join_path(rf.rank_path, names.owner);
  if (create) {
    // The owner file needs no fsync: it only matters while its process lives, and a machine crash
    // ends that process too.
    std::string owner = format_owner(id);
    if (auto s = write_file_atomic(rf.rank_dir.get(), names.owner_tmp.c_str(), names.owner.c_str(), owner, false,
                                   rf.rank_path);
        !s) {
      return s;
    }
  } else {
    auto text = read_small_file(rf.rank_dir.get(), names.owner.c_str(), kMaxOwnerBytes, owner_path);
    if (!text) return std::move(text).error();
    auto owner = parse_owner(*text);
    if (!owner) return make_error(EINVAL, owner_path + " is not a tmsdisk owner file");
    if (owner->pid != id.pid || owner->start_time != id.start_time || owner->token != id.token ||
        owner->uid != id.uid || owner->job != id.job) {
      return make_error(EPERM, owner_path +
                                   " belongs to another session (pid, start time or token differ): "
                                   "reconnect with the token this daemon issued, or start afresh");
    }
  }

  auto data = open_data_file(rf.rank_dir.get(), names.data, create, rf.direct_io, join_path(rf.rank_path, names.data));
  if (!data) return std::move(data).error();
  rf.data = std::move(data).value();
  if (i == 0) {
    auto journal = ChecksumJournal::open(rf.rank_dir.get(), names.sums, create, join_path(rf.rank_path, names.sums));
    if (!journal) return std::move(journal).error();
    this->journal = std::move(journal).value();
  }
  return {};
}

Status RankStore::Impl::enter_rank_dir(RootFiles& rf, bool create) {
  std::string uid_path = join_path(rf.path, uid_name);
  std::string job_path = join_path(uid_path, id.job);
  if (!create) {
    rf.uid_dir.reset(open_dir_nofollow(rf.root.get(), uid_name.c_str()));
    if (!rf.uid_dir) return not_a_directory_error(errno, uid_path);
    rf.job_dir.reset(open_dir_nofollow(rf.uid_dir.get(), id.job.c_str()));
    if (!rf.job_dir) return not_a_directory_error(errno, job_path);
    rf.rank_dir.reset(open_dir_nofollow(rf.job_dir.get(), rank_name.c_str()));
    if (!rf.rank_dir) return not_a_directory_error(errno, rf.rank_path);
    return {};
  }
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
    if (auto s = check_leftovers(old.get(), rf.rank_path, rf.rank_path); !s) return s;
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
  return {};
}

Status RankStore::Impl::enter_own_dir(RootFiles& rf, bool create) {
  // A descriptor that reads and flushes the directory (the one handed over may be O_PATH). It becomes
  // rf.rank_dir only once the files of this rank's name are known to be this store's to make: a
  // failed create() removes what rf.rank_dir holds of them.
  UniqueFd dir(::openat(rf.root.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return errno_error("cannot open " + rf.path);
  if (create) {
    // Files of this rank's name already there: pids are reused, so they may be a dead process's.
    struct stat st {};
    if (::fstatat(dir.get(), names.owner.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 ||
        ::fstatat(dir.get(), names.data.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      if (auto s = check_leftovers(dir.get(), rf.path, join_path(rf.path, rank_file_prefix(id) + "*")); !s) return s;
      if (auto s = remove_rank_files(dir.get(), rf.path, names); !s) return s;
    }
    // Other ranks' files whose process is gone (a rank that died while no daemon held its directory:
    // nothing else would ever find them).
    (void)sweep_rank_files(dir.get(), rf.path, [](const std::string& what) { spdlog::warn("{}", what); });
  }
  rf.rank_dir = std::move(dir);
  return {};
}

// Before files of this rank's name are replaced: they may be the paused memory of this very process
// (its token refused, its owner file deleted). Refused unless their owner provably is gone.
Status RankStore::Impl::check_leftovers(int dir, const std::string& dir_path, const std::string& what) const {
  auto text = read_small_file(dir, names.owner.c_str(), kMaxOwnerBytes, join_path(dir_path, names.owner));
  std::optional<Owner> owner = text ? parse_owner(*text) : std::nullopt;
  if (owner && process_alive(owner->pid, owner->start_time)) {
    return make_error(EEXIST, fmt::format("{} belongs to the live process {}: a reconnecting rank must present "
                                          "its session token to adopt it",
                                          what, owner->pid));
  }
  // Without a readable owner nothing proves its process gone, and the pid in its name is alive (it
  // is the caller's): a data file with bytes may hold that very process's paused memory (its owner
  // file deleted, its token refused for that), so it is kept. Without one there is nothing to keep.
  struct stat data_st {};
  if (!owner && ::fstatat(dir, names.data.c_str(), &data_st, AT_SYMLINK_NOFOLLOW) == 0 && data_st.st_size > 0) {
    return make_error(
        EEXIST, fmt::format("{} has no valid owner file ({}) but a data file of {} bytes, which "
                            "may hold the paused memory of pid {}, still running: tmsdiskd leaves "
                            "it untouched. Remove it yourself if it is stale",
                            what, text ? "not one tmsdiskd wrote" : text.error().describe(), data_st.st_size, id.pid));
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
    if (rf.rank_dir && own_dir) {
      // A directory of the rank's choosing: only its own files go, the directory stays.
      if (Status s = remove_rank_files(rf.rank_dir.get(), rf.rank_path, names); !s) {
        if (first) first = std::move(s);
        continue;
      }
    } else if (rf.rank_dir) {
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
uint32_t RankStore::chunk_bytes() const noexcept {
  return impl_->chunk;
}
std::size_t RankStore::root_count() const noexcept {
  return impl_->roots.size();
}
const RankFileNames& RankStore::file_names() const noexcept {
  return impl_->names;
}
bool RankStore::in_own_directory() const noexcept {
  return impl_->own_dir;
}
std::vector<int> RankStore::dir_fds() const {
  std::vector<int> fds;
  for (const RootFiles& rf : impl_->roots) fds.push_back(rf.rank_dir.get());
  return fds;
}

Status RankStore::remove() {
  try {
    if (impl_->removed) return {};
    return impl_->remove_locked();
  } catch (const std::bad_alloc&) {
    return out_of_memory("removing a rank directory");
  }
}

void testing::wait_for_punches(RankStore& store) noexcept {
  (void)store.impl_->wait_punches("wait_for_punches()");
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

Status RankStore::Impl::record(uint64_t blob, uint64_t offset, Checksum128 sum) {
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
         .held = sealed_state() == ChunkState::Data,
         .opened = rec.opened};  // a WRITE of the chunk may be open still (settle_write() checks it)
  corrupt_records.erase(b.first_chunk + ci);
  return {};
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
      if (auto st = impl_->record(blob, offset, sum); !st) return std::move(st).error();
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
    if (auto st = impl_->record(blob, offset, sum); !st) return std::move(st).error();
    return sum;
  } catch (const std::bad_alloc&) {
    return out_of_memory("sealing a chunk");
  }
}

Result<Checksum128> RankStore::Impl::sealed_sum(const BlobState& b, uint64_t ci) const {
  const ChunkRecord& rec = b.records[ci];
  if (is_data(rec.state)) return rec.sum;
  if (corrupt_records.count(b.first_chunk + ci)) {
    return make_error(EUCLEAN,
                      fmt::format("the record of this chunk in the checksum journal {} is corrupt, so the chunk cannot "
                                  "be verified; {}. If you have an intact copy of the journal, put it back and restart "
                                  "tmsdiskd; otherwise `tmsctl resume --accept-loss` gives the allocation zero-filled "
                                  "memory",
                                  journal.path(), kept_files_text()));
  }
  return make_error(
      ENODATA, fmt::format("chunk at offset {} of blob {} was never written in this generation", ci * chunk, b.id));
}

Result<RankStore::ReadTicket> RankStore::open_read(uint64_t blob, uint64_t offset, uint32_t length) const {
  try {
    uint64_t ci = 0;
    auto found = impl_->find_chunk_of_length(blob, offset, length, &ci);
    if (!found) return std::move(found).error();
    if (auto sealed = impl_->sealed_sum(**found, ci); !sealed) return std::move(sealed).error();
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
    auto sealed = impl_->sealed_sum(**found, ci);
    if (!sealed) return sealed;
    if (sum != *sealed) {
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

std::vector<BlobSize> RankStore::blobs() const {
  std::vector<BlobSize> out;
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

}  // namespace tmsdisk::storage
