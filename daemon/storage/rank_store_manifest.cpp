// SPDX-License-Identifier: Apache-2.0
// RankStore's record (storage.h): the commit of a pause or resume, the manifest it writes, and what
// adopt() reads back from the manifest and the checksum journal.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <new>
#include <optional>
#include <unordered_map>
#include <utility>

#include "rank_store_impl.h"
#include "storage_fs.h"

namespace tmsdisk::storage {

using namespace detail;

Status RankStore::commit(CommitState state) {
  try {
    Impl& m = *impl_;
    if (m.removed) return make_error(ENOENT, "the rank's directory was removed");
    if (state != CommitState::Paused && state != CommitState::Resumed) {
      return make_error(EINVAL, fmt::format("unknown commit state {}", static_cast<int>(state)));
    }
    // The rank says every allocation is resident again (or was given up with --accept-loss): what
    // the files hold is no longer needed, and a lost record stops mattering. A pause, though, has
    // nothing to commit: no set could be reserved.
    if (state == CommitState::Paused && !m.record_problem.empty()) return make_error(EBUSY, m.record_problem);
    if (state == CommitState::Paused) {
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
    const uint64_t generation = state == CommitState::Paused ? m.generation + 1 : m.generation;
    if (auto s = m.write_manifest(state == CommitState::Paused ? kManifestPaused : kManifestResumed, generation); !s) {
      return s;
    }
    m.paused = state == CommitState::Paused;
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
  return write_file_atomic(first.rank_dir.get(), names.manifest_tmp.c_str(), names.manifest.c_str(), bytes, true,
                           first.rank_path);
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
    files += fmt::format("{} ({} bytes)", join_path(roots[r].rank_path, names.data), sizes[r]);
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
  std::string path = join_path(first.rank_path, names.manifest);
  auto bytes = read_small_file(first.rank_dir.get(), names.manifest.c_str(), kMaxManifestBytes, path);
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
                      join_path(roots[r].rank_path, names.data), st.st_size, path, mf->data_end[r]));
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
