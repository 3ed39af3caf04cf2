// SPDX-License-Identifier: Apache-2.0
// RankStore::reserve (storage.h): a new set's layout on the roots, its chunk records, the space it
// needs preallocated and what it gives back, recorded before anything is written. Also what a
// reservation checks first: data files replaced or changed outside the store.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/falloc.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "rank_store_impl.h"
#include "storage_fs.h"
#include "storage_testing.h"
#include "tmsdisk/common/human.h"

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

}  // namespace

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
static Status check_zero_runs(std::span<const BlobSize> set, std::span<const ChunkRun> runs, uint32_t chunk,
                              std::vector<ChunkRun>& sorted) {
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
  std::sort(sorted.begin(), sorted.end(), [](const ChunkRun& a, const ChunkRun& b) {
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

namespace {

// One reservation from the checks of the new set to the files' changes. Each step fills in part of
// what the next reads; nothing on disk changes before preallocate(), and nothing in the store before
// install(), which cannot fail.
class Reservation {
 public:
  Reservation(RankStore::Impl& store, std::span<const BlobSize> set, std::span<const ChunkRun> zero_runs,
              std::span<const ChunkRun> host_runs, std::span<const uint64_t> carry)
      : m_(store), n_(store.roots.size()), set_(set), zero_runs_(zero_runs), host_runs_(host_runs), carry_(carry) {}

  Status check_store() const;
  Status check_set();
  Status settle_files();
  Status lay_out();
  Status check_fresh_space() const;
  void make_records();
  void plan_file_changes();
  Status check_space_per_root();
  void plan_give_back();
  Status preallocate();
  Status record();
  void install();

 private:
  bool kept_blob(uint64_t id) const {
    auto it = m_.index.find(id);
    return it != m_.index.end() && kept_[it->second];
  }
  // Frees what this call allocated in the first `done` ranges of allocate_ and cuts any growth off,
  // so the files are as before.
  void roll_back(std::size_t done);

  RankStore::Impl& m_;
  const std::size_t n_;  // roots
  std::span<const BlobSize> set_;
  std::span<const ChunkRun> zero_runs_, host_runs_;
  std::span<const uint64_t> carry_;

  std::vector<ChunkRun> runs_;  // zero and host runs, checked and sorted
  std::unordered_set<uint64_t> carried_;
  bool holes_known_ = true;            // the old layout's free and zero ranges are holes
  std::vector<ExtentAllocator> plan_;  // the new layout, per root
  std::vector<bool> kept_;             // per blob of the old set: in the new one with its extents
  std::vector<BlobState> next_;        // the new set
  std::unordered_map<uint64_t, std::size_t> next_index_;
  std::vector<ExtentAllocator> holes_;  // per root: what the files hold now
  std::vector<FileRange> allocate_;     // ranges preallocated
  std::vector<FileRange> zero_;         // zero and host-tier chunks: given back
  std::vector<uint64_t> needed_;        // per root: new blocks the preallocation takes
  std::vector<uint64_t> old_size_;      // per root: the data file's size before
  PunchPlan give_back_;
  bool give_back_here_ = false;   // a descriptor could not be duplicated: given back on this thread
  std::vector<uint8_t> touched_;  // per root: changed by preallocate()
};

Status Reservation::check_store() const {
  if (m_.removed) return make_error(ENOENT, "the rank's directory was removed");
  // Carrying blobs, the rank says that what it does not carry is resident again (as a resume's commit
  // does for all of it): a committed pause may then give way to the new set.
  if (m_.paused && carry_.empty()) {
    return make_error(EBUSY, fmt::format("rank has a committed pause (generation {}) that was not resumed; its files "
                                         "are the only copy of that memory. Resume before reserving a new set",
                                         m_.generation));
  }
  // A new set recycles extents the old one left free, and truncates and punches what it does not
  // use: over files whose record is lost, that could destroy the only copy of paused memory.
  if (!m_.record_problem.empty()) return make_error(EBUSY, m_.record_problem);
  if (!m_.corrupt_records.empty()) {
    return make_error(EBUSY, fmt::format("{} chunk(s) of the pause in progress when tmsdiskd stopped have a corrupt "
                                         "record in the checksum journal {}: they may hold memory the rank released, "
                                         "so no new set is reserved over them. Resume first (`tmsctl resume`, or "
                                         "`tmsctl resume --accept-loss` for what cannot be verified)",
                                         m_.corrupt_records.size(), m_.journal.path()));
  }
  return {};
}

// The set's blobs, its runs and what it carries, against each other and the set stored.
Status Reservation::check_set() {
  std::unordered_map<uint64_t, uint64_t> size_of;  // blob id -> size in the new set
  size_of.reserve(set_.size());
  for (const auto& b : set_) {
    if (!size_of.emplace(b.id, b.size).second) {
      return make_error(EINVAL, fmt::format("blob {} appears twice in the reserved set", b.id));
    }
    if (b.size > kMaxBlobSize) {
      return make_error(
          EFBIG, fmt::format("blob {} of {} bytes is larger than tmsdisk supports ({})", b.id, b.size, kMaxBlobSize));
    }
  }
  runs_.assign(zero_runs_.begin(), zero_runs_.end());
  runs_.insert(runs_.end(), host_runs_.begin(), host_runs_.end());
  if (auto st = check_zero_runs(set_, std::vector<ChunkRun>(runs_), m_.chunk, runs_); !st) return st;
  // Carried blobs pass into the new set as they are: same size, every chunk sealed, data or zero or
  // in the rank's host tier, none of it named again by this set's runs.
  carried_.reserve(carry_.size());
  for (const uint64_t id : carry_) {
    if (!carried_.insert(id).second) return make_error(EINVAL, fmt::format("blob {} is carried twice", id));
    // By lookup, not by a scan of the set per carried blob: both may hold a million blobs.
    auto in_set = size_of.find(id);
    auto it = m_.index.find(id);
    if (in_set == size_of.end() || it == m_.index.end() || m_.blobs[it->second].size != in_set->second)
      return make_error(EINVAL, fmt::format("blob {} is carried but not held with that size in the set reserved now "
                                            "and the one stored",
                                            id));
    const auto& records = m_.blobs[it->second].records;
    const auto unsealed = std::count_if(records.begin(), records.end(),
                                        [](const ChunkRecord& r) { return r.state == ChunkState::Missing; });
    if (unsealed > 0)
      return make_error(EINVAL,
                        fmt::format("blob {} cannot be carried: {} of its chunks were never written", id, unsealed));
  }
  for (const auto& r : runs_)
    if (carried_.count(r.blob))
      return make_error(EINVAL, fmt::format("a zero or host run names blob {}, which is carried as it is", r.blob));
  return {};
}

Status Reservation::settle_files() {
  // The space the previous reservation gives back must be back before this one counts free space
  // and lays out, preallocates, truncates and punches ranges it may reuse: a punch that landed
  // after this reservation could hit blocks its chunks are written to.
  holes_known_ = m_.wait_punches("the next reservation");
  // Chunks carried over as held must still be in the files: checked before the records are made.
  m_.check_files(true);
  auto followed = m_.follow_replaced_files(!carry_.empty());
  if (!followed) return std::move(followed).error();
  // A file opened anew may have blocks anywhere (a copy): every free and zero range is punched.
  if (*followed) holes_known_ = false;
  return {};
}

// Plans the new layout on copies of the allocators; nothing on disk changes until it is complete.
Status Reservation::lay_out() {
  const auto& blobs = m_.blobs;
  const uint32_t chunk = m_.chunk;
  plan_.reserve(n_);
  for (const auto& rf : m_.roots) plan_.push_back(rf.alloc);

  kept_.assign(blobs.size(), false);
  for (const auto& b : set_) {
    auto it = m_.index.find(b.id);
    if (it != m_.index.end() && blobs[it->second].size == b.size) kept_[it->second] = true;
  }
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    if (kept_[i]) continue;
    for (std::size_t r = 0; r < n_; ++r) {
      const auto& e = blobs[i].extents[r];
      if (e.length > 0 && !plan_[r].release(e.offset, e.length)) {
        return make_error(
            EIO, "internal error: extent allocator of " + m_.roots[r].rank_path + " is inconsistent; restart the rank");
      }
    }
  }

  next_.reserve(set_.size());
  next_index_.reserve(set_.size());
  uint64_t total_chunks = 0;
  for (const auto& b : set_) {
    BlobState s;
    s.id = b.id;
    s.size = b.size;
    s.chunks = b.size == 0 ? 0 : (b.size - 1) / chunk + 1;
    auto it = m_.index.find(b.id);
    if (it != m_.index.end() && kept_[it->second]) {
      s.extents = blobs[it->second].extents;
    } else {
      s.extents.resize(n_);
      for (std::size_t r = 0; r < n_; ++r) {
        uint64_t len = extent_length(b.size, chunk, n_, r);
        if (len == 0) continue;
        auto off = plan_[r].allocate(len);
        if (!off) return make_error(EFBIG, "the data file on " + m_.roots[r].path + " would grow past 2^62 bytes");
        s.extents[r] = {*off, len};
      }
    }
    s.first_chunk = total_chunks;
    total_chunks += s.chunks;
    next_index_.emplace(s.id, next_.size());
    next_.push_back(std::move(s));
  }
  for (auto& a : plan_) a.trim_tail();
  return {};
}

// A first refusal before any per-chunk memory is allocated, so that a bogus size is refused for
// lack of space rather than making this allocate without bound: the data chunks of new and resized
// blobs need at least their bytes, somewhere on the roots.
Status Reservation::check_fresh_space() const {
  const uint32_t chunk = m_.chunk;
  uint64_t fresh_data = 0;
  {
    std::unordered_map<uint64_t, uint64_t> zero_of;
    for (const auto& z : runs_) {
      const uint64_t size = next_[next_index_.at(z.blob)].size;
      const uint64_t end = std::min<uint64_t>(size, (z.first_chunk + z.count) * chunk);
      zero_of[z.blob] += end - z.first_chunk * chunk;
    }
    for (const auto& s : next_) {
      if (!kept_blob(s.id)) fresh_data += s.size - zero_of[s.id];
    }
  }
  uint64_t avail_all = 0;
  for (std::size_t r = 0; r < n_; ++r) {
    struct statvfs vfs {};
    if (::fstatvfs(m_.roots[r].data.get(), &vfs) != 0)
      return errno_error("cannot stat the filesystem of " + m_.roots[r].path);
    avail_all += static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
  }
  if (fresh_data > avail_all)
    return no_space_error(ENOSPC, fresh_data, n_ == 1 ? m_.roots[0].path : "the roots together", avail_all);
  return {};
}

// The chunk records. A kept blob keeps what its file provably holds (ChunkRecord::held); a zero
// chunk holds nothing; a carried blob keeps its records whole, seals and states. Zero runs are few
// and sorted; the records are bounded by the sessions' caps (max-chunks-per-uid), no longer by the
// disk space a set needs.
void Reservation::make_records() {
  for (auto& s : next_) {
    s.records.resize(s.chunks);
    auto it = m_.index.find(s.id);
    if (it == m_.index.end() || !kept_[it->second]) continue;
    const auto& old = m_.blobs[it->second].records;
    if (carried_.count(s.id)) {
      s.records = old;
      continue;
    }
    for (uint64_t ci = 0; ci < s.chunks; ++ci)
      s.records[ci] = {.sum = old[ci].sum, .state = ChunkState::Missing, .held = old[ci].held};
  }
  for (const auto& [list, state] : {std::pair{zero_runs_, ChunkState::Zero}, std::pair{host_runs_, ChunkState::Host}}) {
    for (const auto& z : list) {
      auto& records = next_[next_index_.at(z.blob)].records;
      for (uint64_t ci = z.first_chunk; ci < z.first_chunk + z.count; ++ci)
        records[ci] = {.sum = {}, .state = state, .held = false};
    }
  }
}

void Reservation::plan_file_changes() {
  const uint32_t chunk = m_.chunk;
  // What the files hold now: every used range is allocated but the zero chunks of the old set
  // (holes), and the free ranges were punched.
  holes_.reserve(n_);
  for (const auto& rf : m_.roots) holes_.push_back(rf.alloc);
  for (const auto& b : m_.blobs) {
    for (uint64_t ci = 0; ci < b.chunks; ++ci) {
      if (!kept_off_disk(b.records[ci].state)) continue;
      const FileRange range = chunk_range(b, ci, chunk, n_);
      (void)holes_[range.root].release(range.offset, range.length);
    }
  }

  // Data chunks are preallocated; zero chunks are punched (a zero chunk takes no disk space).
  // Only what is a hole or free today needs new blocks.
  needed_.assign(n_, 0);
  for (const auto& s : next_) {
    auto it = m_.index.find(s.id);
    const BlobState* old = it != m_.index.end() && kept_[it->second] ? &m_.blobs[it->second] : nullptr;
    for (uint64_t ci = 0; ci < s.chunks; ++ci) {
      const FileRange range = chunk_range(s, ci, chunk, n_);
      if (kept_off_disk(s.records[ci].state)) {
        add_range(zero_, range);
      } else if (!old || kept_off_disk(old->records[ci].state) || m_.roots[range.root].changed) {
        add_range(allocate_, range);
        for_each_free_part(holes_[range.root], range.offset, range.length,
                           [&](uint64_t, uint64_t len) { needed_[range.root] += len; });
      }
    }
  }
}

// A cheap refusal before touching the disk, with the numbers the user needs. It can only be
// optimistic (roots may share a filesystem, metadata takes blocks): fallocate has the last word.
Status Reservation::check_space_per_root() {
  old_size_.assign(n_, 0);
  for (std::size_t r = 0; r < n_; ++r) {
    const RootFiles& rf = m_.roots[r];
    struct stat st {};
    if (::fstat(rf.data.get(), &st) != 0) return errno_error("cannot stat data file in " + rf.rank_path);
    old_size_[r] = static_cast<uint64_t>(st.st_size);
    if (needed_[r] == 0) continue;
    struct statvfs vfs {};
    if (::fstatvfs(rf.data.get(), &vfs) != 0) return errno_error("cannot stat the filesystem of " + rf.path);
    uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    if (needed_[r] > avail) return no_space_error(ENOSPC, needed_[r], rf.path, avail);
  }
  return {};
}

// What only gives space back once this set is recorded: each file's tail past the new layout,
// its free extents and its zero chunks. Where the old layout's holes are known to be punched
// (holes_known_), only the ranges that held something are punched again. Given back after the
// reservation returns, off the caller's thread (background_punch.h): nothing in it waits for that
// space (the preallocation counts none of it, as before it moved), and none of these ranges is
// written in this generation: locate() refuses a zero chunk and knows no free extent. Planned (the
// allocations made, the descriptors duplicated) before the set is recorded, so that nothing after
// that can fail.
void Reservation::plan_give_back() {
  give_back_.what = m_.relative;
  give_back_.files.resize(n_);
  auto give = [&](std::size_t r, uint64_t off, uint64_t len) {
    auto& list = give_back_.files[r].punches;
    auto add = [&](uint64_t a, uint64_t l) {
      if (!list.empty() && list.back().first + list.back().second == a)
        list.back().second += l;
      else
        list.emplace_back(a, l);
    };
    if (holes_known_)
      for_each_used_part(holes_[r], off, len, add);
    else
      add(off, len);
  };
  for (std::size_t r = 0; r < n_; ++r) {
    auto& f = give_back_.files[r];
    f.owned.reset(::fcntl(m_.roots[r].data.get(), F_DUPFD_CLOEXEC, 0));
    f.fd = f.owned ? f.owned.get() : m_.roots[r].data.get();
    give_back_here_ = give_back_here_ || !f.owned;
    f.size = old_size_[r];
    if (plan_[r].end() < old_size_[r]) f.truncate_to = plan_[r].end();
    for (const auto& [off, len] : plan_[r].free_extents()) give(r, off, len);
  }
  for (const FileRange& z : zero_) give(z.root, z.offset, z.length);
  touched_.assign(n_, 0);  // allocated up front: roll_back() must not throw
}

// Only the parts that were free or holes in the old layout are punched: a range may cover a dropped
// blob whose data the old set still owns.
void Reservation::roll_back(std::size_t done) {
  for (std::size_t j = 0; j < done; ++j) {
    const FileRange& g = allocate_[j];
    for_each_free_part(holes_[g.root], g.offset, g.length, [&](uint64_t off, uint64_t len) {
      if (!punch(m_.roots[g.root].data.get(), off, len)) m_.holes_punched = false;
    });
    touched_[g.root] = 1;
  }
  for (std::size_t r = 0; r < n_; ++r) {
    // Truncating to the unchanged size still drops blocks preallocated past the end of the file.
    if (!touched_[r]) continue;
    while (::ftruncate(m_.roots[r].data.get(), static_cast<off_t>(old_size_[r])) != 0 && errno == EINTR) {
    }
  }
}

Status Reservation::preallocate() {
  auto& roots = m_.roots;
  auto hook = testing::g_fallocate_hook.load();
  for (std::size_t k = 0; k < allocate_.size(); ++k) {
    const FileRange& f = allocate_[k];
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
      return no_space_error(err, needed_[f.root], roots[f.root].path, avail);
    }
    return make_error(err, fmt::format("cannot preallocate {} in the data file of {}", human_bytes(f.length),
                                       roots[f.root].rank_path));
  }
  // A file whose last chunks are zero ends before its layout does: it is extended (sparsely) to the
  // end the manifest records, which adopt() checks.
  for (std::size_t r = 0; r < n_; ++r) {
    struct stat st {};
    if (::fstat(roots[r].data.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) >= plan_[r].end()) continue;
    touched_[r] = 1;
    int err = 0;
    while (::ftruncate(roots[r].data.get(), static_cast<off_t>(plan_[r].end())) != 0 && (err = errno) == EINTR) {
    }
    if (err != 0) {
      roll_back(allocate_.size());
      return make_error(err, "cannot extend the data file in " + roots[r].rank_path);
    }
  }
  return {};
}

// Records where this pause's chunks will go, and which are zero, before any is written, and empties
// the checksum journal of the previous set: if the daemon dies mid-pause, its successor still knows
// the extents and, from the journal, the checksum of every chunk written, and verifies what the rank
// (which may have released it) reads back. Recorded before anything is punched, so that a daemon
// stopped in between never adopts a record of bytes that are gone.
Status Reservation::record() {
  std::vector<uint64_t> data_end(n_);
  for (std::size_t r = 0; r < n_; ++r) data_end[r] = plan_[r].end();
  uint64_t seed = 0;
  Status st = m_.journal.reset();
  if (st) st = m_.write_manifest_of(next_, data_end, kManifestWriting, m_.generation, &seed);
  if (!st) {
    roll_back(allocate_.size());
    return make_error(st.error().errnum(), "cannot record the reservation: " + st.error().describe());
  }
  m_.journal.set_seed(seed);
  return {};
}

// Committed from here on; what follows only gives unused space back (best effort), and must not fail.
void Reservation::install() {
  for (std::size_t r = 0; r < n_; ++r) {
    m_.roots[r].alloc = std::move(plan_[r]);
    m_.roots[r].changed = false;
  }
  if (give_back_here_) {
    m_.holes_punched = run_punch_plan(give_back_, nullptr);
  } else {
    m_.holes_punched = true;  // once `punches` is done; the next reservation learns whether it was
    m_.punches.start(std::move(give_back_));
  }
  m_.blobs = std::move(next_);
  m_.index = std::move(next_index_);
  m_.writing = true;
  m_.paused = false;  // a pause that gave way to carrying (the new set's commit makes the next generation)
  m_.recount();
}

}  // namespace

Status RankStore::Impl::reserve_locked(std::span<const BlobSize> set, std::span<const ChunkRun> zero_runs,
                                       std::span<const ChunkRun> host_runs, std::span<const uint64_t> carry) {
  Reservation r(*this, set, zero_runs, host_runs, carry);
  if (auto st = r.check_store(); !st) return st;
  if (auto st = r.check_set(); !st) return st;
  if (auto st = r.settle_files(); !st) return st;
  if (auto st = r.lay_out(); !st) return st;
  if (auto st = r.check_fresh_space(); !st) return st;
  r.make_records();
  r.plan_file_changes();
  if (auto st = r.check_space_per_root(); !st) return st;
  r.plan_give_back();
  if (auto st = r.preallocate(); !st) return st;
  if (auto st = r.record(); !st) return st;
  r.install();
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
    const std::string path = join_path(rf.rank_path, names.data);
    struct stat open_st {};
    struct stat named {};
    if (::fstat(rf.data.get(), &open_st) != 0) return errno_error("cannot stat the data file " + path);
    const bool named_exists = ::fstatat(rf.rank_dir.get(), names.data.c_str(), &named, AT_SYMLINK_NOFOLLOW) == 0;
    if (!named_exists && errno != ENOENT) return errno_error("cannot stat " + path);
    if (named_exists && named.st_dev == open_st.st_dev && named.st_ino == open_st.st_ino) continue;
    bool direct_io = true;
    auto data = open_data_file(rf.rank_dir.get(), names.data, !named_exists, direct_io, path);
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
    const bool replaced = !now || ::fstatat(rf.rank_dir.get(), names.data.c_str(), &named, AT_SYMLINK_NOFOLLOW) != 0 ||
                          static_cast<uint64_t>(named.st_ino) != now->ino ||
                          static_cast<uint64_t>(named.st_dev) != now->dev;
    if (!now || replaced || !(*now == *rf.known)) {
      spdlog::warn(
          "{}: the data file {} changed since tmsdiskd last wrote it ({}): its chunks are written again "
          "at the next pause instead of being taken as unchanged",
          relative, join_path(rf.rank_path, names.data),
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

Status RankStore::reserve(std::span<const BlobSize> blobs, std::span<const ChunkRun> zero_runs,
                          std::span<const ChunkRun> host_runs, std::span<const uint64_t> carry) {
  try {
    return impl_->reserve_locked(blobs, zero_runs, host_runs, carry);
  } catch (const std::bad_alloc&) {
    return out_of_memory("reserving extents (set unchanged)");
  }
}

}  // namespace tmsdisk::storage
