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

}  // namespace tmsdisk::storage
