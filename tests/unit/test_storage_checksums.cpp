// SPDX-License-Identifier: Apache-2.0
// Storage, XXH3-128 checksums and unchanged chunks: the journal's records, a WRITE of bytes the file
// provably holds, data files changed outside tmsdiskd, and the manifest versions 1 to 3.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "checksum_journal.h"
#include "manifest.h"
#include "manifest_v1.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;

// A data file changed outside tmsdiskd while the memory it held was resident again: whatever the
// change, the next pause writes every chunk of that file again instead of taking the bytes it held
// for unchanged, and what it wrote reads back verified, with or without a daemon restart in between.
namespace {

constexpr uint64_t kDamageChunks = 4;
const std::vector<storage::BlobSize> kDamageSet{{1, kDamageChunks* kChunk}};

enum class Damage { FlipByte, Truncate, TruncateAndExtend, Replace };

// Pauses the set with every chunk filled with `fill` through `store`; returns how many chunks were
// unchanged. Then checks that each reads back verified from the file, and resumes.
int pause_and_resume(RankStore& store, uint8_t fill) {
  REQUIRE(store.reserve(kDamageSet));
  int unchanged = 0;
  for (uint64_t c = 0; c < kDamageChunks; ++c) unchanged += write_through(store, 1, c * kChunk, filled(kChunk, fill));
  REQUIRE(store.commit(storage::CommitState::Paused));
  for (uint64_t c = 0; c < kDamageChunks; ++c) CHECK(reads_back(store, 1, c * kChunk, filled(kChunk, fill)));
  REQUIRE(store.commit(storage::CommitState::Resumed));
  return unchanged;
}

// Does to the data file at `path` what root might, between two pauses.
void damage(const std::string& path, Damage how) {
  switch (how) {
    case Damage::FlipByte: {
      const int fd = ::open(path.c_str(), O_RDWR);
      REQUIRE(fd >= 0);
      unsigned char byte = 0;
      REQUIRE(::pread(fd, &byte, 1, kChunk + 100) == 1);
      byte ^= 0x01;
      REQUIRE(::pwrite(fd, &byte, 1, kChunk + 100) == 1);
      ::close(fd);
      break;
    }
    case Damage::Truncate:  // below the extents: chunks 2 and 3 are gone
      REQUIRE(::truncate(path.c_str(), 2 * kChunk) == 0);
      break;
    case Damage::TruncateAndExtend: {  // the same size as before, chunks 2 and 3 now zeros
      struct stat st {};
      REQUIRE(::stat(path.c_str(), &st) == 0);
      REQUIRE(::truncate(path.c_str(), 2 * kChunk) == 0);
      REQUIRE(::truncate(path.c_str(), st.st_size) == 0);
      break;
    }
    case Damage::Replace: {  // another file in its place: a copy, one byte flipped
      std::string bytes = read_text(path);
      REQUIRE(bytes.size() > kChunk + 100);
      bytes[kChunk + 100] = static_cast<char>(bytes[kChunk + 100] ^ 0x01);
      write_text(path + ".new", bytes);
      REQUIRE(::chmod((path + ".new").c_str(), 0600) == 0);
      REQUIRE(::rename((path + ".new").c_str(), path.c_str()) == 0);
      break;
    }
  }
}

const char* damage_name(Damage how) {
  switch (how) {
    case Damage::FlipByte: return "a flipped byte";
    case Damage::Truncate: return "truncated below its extents";
    case Damage::TruncateAndExtend: return "truncated below its extents and extended back";
    case Damage::Replace: return "replaced by another file";
  }
  return "";
}

}  // namespace

TEST_CASE("manifest version 2 round trip: chunk states and 128-bit sums; version 1 decodes as XXH3-64 sums") {
  Manifest m;
  m.state = kManifestPaused;
  m.generation = 7;
  m.chunk_bytes = kChunk;
  m.data_end = {5 * kChunk};
  m.blobs.push_back(
      {.id = 3,
       .size = 4 * kChunk + 100,
       .extents = {{0, 5 * kChunk}},
       .states = {ChunkState::Data, ChunkState::Zero, ChunkState::Data64, ChunkState::Missing, ChunkState::Data},
       .sums = {{1, 2}, {}, {3, 0}, {}, {~uint64_t{0}, 5}}});
  const std::string bytes = encode_manifest(m);
  std::string why;
  auto back = decode_manifest(bytes, why);
  INFO(why);
  REQUIRE(back);
  CHECK(back->version == kManifestVersion);
  CHECK(back->generation == 7);
  REQUIRE(back->blobs.size() == 1);
  CHECK(back->blobs[0].states == m.blobs[0].states);
  CHECK(back->blobs[0].sums == m.blobs[0].sums);
  // Every byte is covered by the trailing hash; an unknown chunk state is refused even with a valid hash.
  std::string edited = bytes;
  edited[edited.size() - 9] ^= 1;
  CHECK_FALSE(decode_manifest(edited, why));

  auto v1 = decode_manifest(encode_manifest_v1(m), why);
  INFO(why);
  REQUIRE(v1);
  CHECK(v1->version == kManifestVersion1);
  const auto& b = v1->blobs[0];
  CHECK(b.states == std::vector<ChunkState>{ChunkState::Data64, ChunkState::Missing, ChunkState::Data64,
                                            ChunkState::Missing, ChunkState::Data64});
  CHECK(b.sums[0] == Checksum128{1, 0});  // the low half only: version 1 kept 64 bits
  CHECK(b.sums[4] == Checksum128{~uint64_t{0}, 0});
}

TEST_CASE("the checksum journal records 128-bit sums in 40-byte records, and reads a version-1 journal") {
  TempDir dir;
  UniqueFd d(::open(dir.path().c_str(), O_PATH | O_DIRECTORY));
  REQUIRE(d);
  auto j = detail::ChecksumJournal::open(d.get(), "sums", true, dir.path() + "/sums");
  REQUIRE(j);
  j->set_seed(99);
  REQUIRE(j->record(1, 5, 1, Checksum128{0x1111, 0x2222}));
  CHECK(read_text(dir.path() + "/sums").size() == 2 * detail::kJournalRecordBytes);
  auto recs = j->load(3);
  REQUIRE(recs);
  CHECK_FALSE((*recs)[0].valid);
  CHECK_FALSE((*recs)[0].corrupt);  // a hole: never written
  REQUIRE((*recs)[1].valid);
  CHECK((*recs)[1].checksum == Checksum128{0x1111, 0x2222});
  // The high half is covered by the record's own hash.
  std::string sums = read_text(dir.path() + "/sums");
  sums[40 + 24] ^= 1;
  write_text(dir.path() + "/sums", sums);
  recs = j->load(2);
  REQUIRE(recs);
  CHECK((*recs)[1].corrupt);

  REQUIRE(j->reset());
  j->set_seed(7);
  j->use_version1_layout();
  REQUIRE(j->record(1, 5, 1, Checksum128{0x3333, 0x4444}));
  CHECK(read_text(dir.path() + "/sums").size() == 2 * detail::kJournalRecordBytesV1);
  recs = j->load(2);
  REQUIRE(recs);
  REQUIRE((*recs)[1].valid);
  CHECK((*recs)[1].checksum == Checksum128{0x3333, 0});
}

TEST_CASE("a WRITE of the bytes the file provably holds is unchanged; anything doubtful is rewritten") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("unchanged", 1);
  const std::vector<storage::BlobSize> set{{1, 3 * kChunk}, {2, kChunk}};
  auto pause_all = [&](RankStore& store, uint8_t fill) {
    int unchanged = 0;
    for (const auto& b : set)
      for (uint64_t off = 0; off < b.size; off += kChunk)
        unchanged += write_through(store, b.id, off, filled(kChunk, fill));
    REQUIRE(store.commit(storage::CommitState::Paused));
    for (const auto& b : set)
      for (uint64_t off = 0; off < b.size; off += kChunk) CHECK(reads_back(store, b.id, off, filled(kChunk, fill)));
    REQUIRE(store.commit(storage::CommitState::Resumed));
    return unchanged;
  };
  {
    auto store = make_store(roots, id);
    const std::string data = store->dir_path() + "/data";
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 0);  // first pause: nothing known
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 4);  // pause, resume, pause of the same bytes
    // Changed bytes are rewritten; the others stay unchanged.
    REQUIRE(store->reserve(set));
    CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x32)));
    CHECK(write_through(*store, 1, 0, filled(kChunk, 0x31)));
    CHECK(chunk_is(*store, 1, kChunk, kChunk, 0x32));
    // A write that started and did not complete makes the chunk unknown, even for the same bytes.
    CHECK_FALSE(start_write(*store, 1, 2 * kChunk, filled(kChunk, 0x33)).unchanged);
    CHECK_FALSE(write_through(*store, 1, 2 * kChunk, filled(kChunk, 0x31)));
    CHECK(write_through(*store, 2, 0, filled(kChunk, 0x31)));
    REQUIRE(store->commit(storage::CommitState::Paused));
    // A read that fails its check: the chunk is rewritten next time.
    CHECK_FALSE(verify_slot(*store, 2, 0, filled(kChunk, 0x30)));
    REQUIRE(store->commit(storage::CommitState::Resumed));
    REQUIRE(store->reserve(set));
    CHECK_FALSE(write_through(*store, 2, 0, filled(kChunk, 0x31)));
    // A resized blob has new extents: rewritten.
    const std::vector<storage::BlobSize> resized{{1, 4 * kChunk}, {2, kChunk}};
    REQUIRE(store->reserve(resized));
    CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x31)));
    REQUIRE(store->reserve(set));
    // Blob 2 kept its extents and was rewritten above, but in a generation never committed: nothing
    // recorded what the file looked like after that write, so it is not trusted across a reservation.
    // The extents of the resized blob 1 are given back meanwhile: a commit while they are still being
    // punched records nothing either (the punches change the file after it), so they are waited for.
    storage::testing::wait_for_punches(*store);
    CHECK(pause_all(*store, 0x31) == 0);
    REQUIRE(store->reserve(set));
    CHECK(pause_all(*store, 0x31) == 4);  // committed since: held again
  }
  {
    // A daemon restarted after the resume adopts the committed manifest's sums.
    auto adopted = RankStore::adopt(roots, id, kChunk);
    REQUIRE(adopted);
    REQUIRE((*adopted)->reserve(set));
    CHECK(pause_all(**adopted, 0x31) == 4);
    REQUIRE((*adopted)->reserve(set));
    CHECK(write_through(**adopted, 1, 0, filled(kChunk, 0x31)));
  }  // the daemon stops mid-pause
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  REQUIRE((*adopted)->reserve(set));
  CHECK(pause_all(**adopted, 0x31) == 0);  // a restart mid-pause: nothing is provably held
  REQUIRE((*adopted)->remove());
}

TEST_CASE(
    "a WRITE hashed elsewhere is unchanged only against what open_write found, and only if no other WRITE of the chunk "
    "opened since") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("settle", 1));
  const std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
  REQUIRE(store->reserve(set));
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x11)));
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x22)));
  REQUIRE(store->commit(storage::CommitState::Paused));
  REQUIRE(store->commit(storage::CommitState::Resumed));
  REQUIRE(store->reserve(set));
  // What a hash worker would do between open_write() and settle_write().
  auto hash = [](const RankStore::WriteTicket& t, uint8_t fill) {
    return RankStore::hash_chunk(t.xxh64, filled(kChunk, fill));
  };

  // The same bytes, hashed elsewhere: unchanged, sealed at once.
  auto a = store->open_write(1, 0, kChunk);
  REQUIRE(a);
  CHECK(a->held);
  auto settled = store->settle_write(1, 0, kChunk, *a, hash(*a, 0x11));
  REQUIRE(settled);
  CHECK(settled->unchanged);
  CHECK(store->open_read(1, 0, kChunk));  // sealed: a READ has its checksum to verify against

  // Two WRITEs of one chunk in flight at once: neither is taken for unchanged (the second was opened
  // while what the file holds was already in doubt; the first finds a WRITE opened after it).
  auto b1 = store->open_write(1, kChunk, kChunk);
  auto b2 = store->open_write(1, kChunk, kChunk);
  REQUIRE((b1 && b2));
  CHECK(b1->held);
  CHECK_FALSE(b2->held);
  CHECK(store->open_read(1, kChunk, kChunk).error().errnum() == ENODATA);  // unknown while they are in flight
  auto s1 = store->settle_write(1, kChunk, kChunk, *b1, hash(*b1, 0x22));
  auto s2 = store->settle_write(1, kChunk, kChunk, *b2, hash(*b2, 0x22));
  REQUIRE((s1 && s2));
  CHECK_FALSE(s1->unchanged);
  CHECK_FALSE(s2->unchanged);
  write_chunk(*store, 1, kChunk, kChunk, 0x22);
  REQUIRE(store->end_write(1, kChunk, kChunk, s2->sum));

  // A WRITE whose hash comes back after another WRITE of its chunk was opened and written (other
  // bytes), and one more opened, is not taken for unchanged: the seal of the write in between does
  // not reset the count of WRITEs opened (were it reset, the third would count as the first again).
  auto c1 = store->open_write(1, 0, kChunk);
  REQUIRE(c1);
  CHECK(c1->held);
  auto c2 = store->open_write(1, 0, kChunk);
  REQUIRE(c2);
  write_chunk(*store, 1, 0, kChunk, 0x33);
  REQUIRE(store->end_write(1, 0, kChunk, hash(*c2, 0x33)));
  auto c3 = store->open_write(1, 0, kChunk);
  REQUIRE(c3);
  auto late = store->settle_write(1, 0, kChunk, *c1, hash(*c1, 0x11));
  REQUIRE(late);
  CHECK_FALSE(late->unchanged);  // the file holds 0x33 there now
  write_chunk(*store, 1, 0, kChunk, 0x11);
  REQUIRE(store->end_write(1, 0, kChunk, late->sum));

  REQUIRE(store->commit(storage::CommitState::Paused));
  CHECK(reads_back(*store, 1, 0, filled(kChunk, 0x11)));
  CHECK(reads_back(*store, 1, kChunk, filled(kChunk, 0x22)));
  REQUIRE(store->remove());
}

TEST_CASE("a READ verified elsewhere: open_read refuses what cannot be verified, settle_read checks the seal") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("settle-read", 1));
  const std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
  REQUIRE(store->reserve(set));
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 0x41)));
  // Never written in this generation: refused before any I/O, with nothing to verify against.
  auto unwritten = store->open_read(1, kChunk, kChunk);
  REQUIRE_FALSE(unwritten);
  CHECK(unwritten.error().errnum() == ENODATA);
  CHECK_FALSE(store->open_read(1, 0, kChunk / 2));  // not the chunk's length
  CHECK_FALSE(store->open_read(2, 0, kChunk));      // no such blob
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x42)));
  REQUIRE(store->commit(storage::CommitState::Paused));

  // What a hash worker would do between open_read() and settle_read().
  auto ticket = store->open_read(1, 0, kChunk);
  REQUIRE(ticket);
  CHECK_FALSE(ticket->xxh64);  // sealed with an XXH3-128
  auto good = store->settle_read(1, 0, kChunk, RankStore::hash_chunk(ticket->xxh64, filled(kChunk, 0x41)));
  REQUIRE(good);
  CHECK(*good == RankStore::hash_chunk(false, filled(kChunk, 0x41)));
  CHECK(reads_back(*store, 1, 0, filled(kChunk, 0x41)));  // the file's bytes verify against the same seal
  // The right bytes hashed the other way (XXH3-64) are not taken for the XXH3-128 sealed; other bytes
  // neither. EBADMSG, and the file is no longer trusted there (the next pause rewrites the chunk).
  auto other_kind = store->settle_read(1, kChunk, kChunk, RankStore::hash_chunk(true, filled(kChunk, 0x42)));
  REQUIRE_FALSE(other_kind);
  CHECK(other_kind.error().errnum() == EBADMSG);
  auto bad = store->settle_read(1, kChunk, kChunk, RankStore::hash_chunk(false, filled(kChunk, 0x43)));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE(store->commit(storage::CommitState::Resumed));
  REQUIRE(store->reserve(set));
  CHECK(write_through(*store, 1, 0, filled(kChunk, 0x41)));             // held there: unchanged
  CHECK_FALSE(write_through(*store, 1, kChunk, filled(kChunk, 0x42)));  // in doubt after the mismatch: written
  REQUIRE(store->remove());
}

TEST_CASE("a data file changed outside tmsdiskd between pauses has every chunk rewritten, never taken as unchanged") {
  for (Damage how : {Damage::FlipByte, Damage::Truncate, Damage::TruncateAndExtend, Damage::Replace}) {
    INFO(damage_name(how));
    TempDir root;
    Roots roots = open_roots({root.path()});
    auto store = make_store(roots, my_identity("damaged", 1));
    const std::string data = store->dir_path() + "/data";
    CHECK(pause_and_resume(*store, 0x61) == 0);
    CHECK(pause_and_resume(*store, 0x61) == static_cast<int>(kDamageChunks));  // untouched: all unchanged
    damage(data, how);
    CHECK(pause_and_resume(*store, 0x61) == 0);  // written again, and verified
    // In the file at the data file's name, which a restarted daemon adopts (another file put there is
    // the one written from then on).
    CHECK(read_text(data).substr(0, kDamageChunks * kChunk) == std::string(kDamageChunks * kChunk, '\x61'));
    CHECK(pause_and_resume(*store, 0x61) == static_cast<int>(kDamageChunks));  // trusted again once rewritten
    REQUIRE(store->remove());
  }
}

TEST_CASE("after a daemon restart, a data file changed outside tmsdiskd is not trusted on the manifest's word") {
  for (Damage how : {Damage::FlipByte, Damage::TruncateAndExtend, Damage::Replace}) {
    INFO(damage_name(how));
    TempDir root;
    Roots roots = open_roots({root.path()});
    const RankIdentity id = my_identity("restarted", 1);
    std::string data;
    {
      auto store = make_store(roots, id);
      data = store->dir_path() + "/data";
      CHECK(pause_and_resume(*store, 0x62) == 0);
    }  // the daemon stops; root changes the file; a daemon starts and the rank reconnects
    {
      auto adopted = RankStore::adopt(roots, id, kChunk);
      REQUIRE(adopted);
      CHECK(pause_and_resume(**adopted, 0x62) == static_cast<int>(kDamageChunks));  // untouched: all unchanged
    }
    damage(data, how);
    auto adopted = RankStore::adopt(roots, id, kChunk);
    INFO((adopted ? std::string() : adopted.error().describe()));
    REQUIRE(adopted);
    CHECK((*adopted)->record_problem().empty());
    CHECK(pause_and_resume(**adopted, 0x62) == 0);  // written again, and verified
    REQUIRE((*adopted)->remove());
  }
}

TEST_CASE("manifest version 3 records each data file's identity; versions 2 and 1 read as none recorded") {
  Manifest m;
  m.state = kManifestResumed;
  m.generation = 4;
  m.chunk_bytes = kChunk;
  m.data_end = {kChunk, 0};
  m.data_files = {detail::FileIdentity{.dev = 1,
                                       .ino = 2,
                                       .size = kChunk,
                                       .mtime_sec = 3,
                                       .mtime_nsec = 4,
                                       .ctime_sec = 5,
                                       .ctime_nsec = 999'999'999},
                  std::nullopt};
  m.blobs.push_back({.id = 1,
                     .size = kChunk,
                     .extents = {{0, kChunk}, {0, 0}},
                     .states = {ChunkState::Data},
                     .sums = {Checksum128{7, 8}}});
  std::string why;
  auto back = decode_manifest(encode_manifest(m), why);
  INFO(why);
  REQUIRE(back);
  CHECK(back->version == 3);
  REQUIRE(back->data_files.size() == 2);
  CHECK(back->data_files[0] == m.data_files[0]);
  CHECK_FALSE(back->data_files[1]);
  auto v1 = decode_manifest(encode_manifest_v1(m), why);
  REQUIRE(v1);
  CHECK(v1->data_files.empty());
}

TEST_CASE(
    "a version-1 manifest is adopted and verified with XXH3-64; the next generation is written in the current "
    "version") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("legacy", 1);
  const std::vector<storage::BlobSize> set{{1, 2 * kChunk + 100}};
  const auto chunk0 = filled(kChunk, 0x41);
  const auto tail = filled(100, 0x42);
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();
    REQUIRE(store->reserve(set));
    write_through(*store, 1, 0, chunk0);
    write_through(*store, 1, kChunk, chunk0);
    write_through(*store, 1, 2 * kChunk, tail);
    REQUIRE(store->commit(storage::CommitState::Paused));
  }
  // Rewrite the manifest in version 1, as an older daemon would have: XXH3-64 of each chunk.
  Manifest m = manifest_of(dir);
  m.blobs[0].sums = {{XXH3_64bits(chunk0.data(), kChunk), 0},
                     {XXH3_64bits(chunk0.data(), kChunk), 0},
                     {XXH3_64bits(tail.data(), tail.size()), 0}};
  write_text(dir + "/manifest", encode_manifest_v1(m));

  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(store.record_problem().empty());
  CHECK(store.paused());
  CHECK(reads_back(store, 1, 0, chunk0));
  CHECK(reads_back(store, 1, 2 * kChunk, tail));
  // A READ verified on a hash worker: the ticket says which hash the chunk was sealed with.
  auto ticket = store.open_read(1, kChunk, kChunk);
  REQUIRE(ticket);
  CHECK(ticket->xxh64);
  CHECK(store.settle_read(1, kChunk, kChunk, RankStore::hash_chunk(ticket->xxh64, chunk0)));
  auto bad = verify_slot(store, 1, kChunk, filled(kChunk, 0x40));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE(store.commit(storage::CommitState::Resumed));
  CHECK(manifest_of(dir).version == kManifestVersion);
  // A 64-bit sum proves nothing against a 128-bit hash: the next pause writes everything.
  REQUIRE(store.reserve(set));
  CHECK_FALSE(write_through(store, 1, 0, chunk0));
  REQUIRE(store.remove());
}

TEST_CASE("a pause in progress under a version-1 record continues with XXH3-64 until its commit") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("legacyj", 1);
  const std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
  const auto bytes = filled(kChunk, 0x51);
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();
    REQUIRE(store->reserve(set));
    write_chunk(*store, 1, 0, kChunk, 0x51);
  }
  // The "writing" manifest and the journal of chunk 0 in version 1, as an older daemon wrote them.
  const std::string v1 = encode_manifest_v1(manifest_of(dir));
  write_text(dir + "/manifest", v1);
  {
    UniqueFd d(::open(dir.c_str(), O_PATH | O_DIRECTORY));
    auto j = detail::ChecksumJournal::open(d.get(), "sums", false, dir + "/sums");
    REQUIRE(j);
    REQUIRE(j->reset());
    j->set_seed(XXH3_64bits(v1.data(), v1.size()));
    j->use_version1_layout();
    REQUIRE(j->record(0, 1, 0, Checksum128{XXH3_64bits(bytes.data(), bytes.size()), 0}));
  }
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(storage::testing::missing_chunks(store) == 1);
  CHECK(reads_back(store, 1, 0, bytes));
  const RankStore::WritePlan sealed = write_as_daemon(store, 1, kChunk, bytes);
  CHECK_FALSE(sealed.unchanged);
  CHECK(sealed.sum == Checksum128{XXH3_64bits(bytes.data(), bytes.size()), 0});
  REQUIRE(store.commit(storage::CommitState::Paused));
  Manifest m = manifest_of(dir);
  CHECK(m.version == kManifestVersion);
  CHECK(m.blobs[0].states == std::vector<ChunkState>{ChunkState::Data64, ChunkState::Data64});
  CHECK(reads_back(store, 1, kChunk, bytes));
  REQUIRE(store.remove());
}
