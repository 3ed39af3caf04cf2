// SPDX-License-Identifier: Apache-2.0
// Storage, the manifest and the checksum journal: what commit writes and adopt restores after a
// restart, and records lost, deleted or corrupt (the data file is kept, its use refused).
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;

namespace {

// A store adopted with a lost record: every use of the files refused with `problem`, the files as
// they were (`data` is the data file's bytes before the loss).
void check_lost_record(RankStore& store, const std::string& data_path, const std::string& data) {
  const std::string& problem = store.record_problem();
  INFO(problem);
  REQUIRE_FALSE(problem.empty());
  CHECK_THAT(problem, Catch::Contains(data_path + " (" + std::to_string(data.size()) + " bytes) is kept untouched") &&
                          Catch::Contains("--accept-loss") && Catch::Contains("restart tmsdiskd"));
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());  // a closed connection keeps the session and its files
  CHECK_FALSE(store.paused());
  CHECK(store.disk_bytes() == data.size());
  auto located = store.locate(1, 0, kChunk);
  REQUIRE_FALSE(located);
  CHECK(located.error().errnum() == EUCLEAN);
  CHECK(located.error().message == problem);
  // Nothing is read nor sealed: a READ and a WRITE are refused before any I/O, and so is a seal.
  CHECK(store.open_read(1, 0, kChunk).error().errnum() == EUCLEAN);
  CHECK(store.open_write(1, 0, kChunk).error().errnum() == EUCLEAN);
  CHECK(store.end_write(1, 0, kChunk, Checksum128{5}).error().errnum() == EUCLEAN);
  // A new set would recycle, truncate and punch the old extents: refused, as is a pause of nothing.
  auto reserved = store.reserve(std::vector<storage::BlobSize>{{1, 3 * kChunk}});
  REQUIRE_FALSE(reserved);
  CHECK(reserved.error().errnum() == EBUSY);
  CHECK(reserved.error().message == problem);
  auto committed = store.commit(storage::CommitState::Paused);
  REQUIRE_FALSE(committed);
  CHECK(committed.error().errnum() == EBUSY);
  CHECK(read_text(data_path) == data);
}

}  // namespace

TEST_CASE("commit writes a manifest that adopt restores after a daemon restart") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("job1", 2);
  std::vector<storage::BlobSize> set{{10, 5 * kChunk + 300}, {11, kChunk}, {12, 0}};
  uint64_t o10 = 0, o11 = 0;
  std::string manifest;
  {
    auto store = make_store(roots, id);
    manifest = store->dir_path() + "/manifest";
    REQUIRE(store->reserve(set));
    write_set(*store, std::vector<storage::BlobSize>{{10, 5 * kChunk + 300}});
    auto incomplete = store->commit(storage::CommitState::Paused);
    REQUIRE_FALSE(incomplete);
    CHECK(incomplete.error().errnum() == EINVAL);
    CHECK_THAT(incomplete.error().message, Catch::Contains("1 of 7 chunks"));
    CHECK(exists(manifest));  // the reservation is recorded ("writing"), not a pause
    CHECK_FALSE(store->paused());

    write_set(*store, set);
    REQUIRE(store->commit(storage::CommitState::Paused));
    CHECK(store->paused());
    CHECK(store->generation() == 1);  // the store numbers pauses
    CHECK(mode_of(manifest) == 0600);
    CHECK_FALSE(exists(manifest + ".tmp"));
    o10 = offset_of(*store, 10, 5 * kChunk, 5 * kChunk + 300);
    o11 = offset_of(*store, 11, 0, kChunk);

    auto busy = store->reserve(set);  // the paused data is the only copy
    REQUIRE_FALSE(busy);
    CHECK(busy.error().errnum() == EBUSY);
  }  // the daemon "exits" without removing anything

  {
    auto adopted = RankStore::adopt(roots, id, kChunk);
    INFO((adopted ? std::string() : adopted.error().describe()));
    REQUIRE(adopted);
    auto& store = **adopted;
    CHECK(store.paused());
    CHECK(store.generation() == 1);
    auto blobs = store.blobs();
    REQUIRE(blobs.size() == 3);
    CHECK(blobs[0].id == 10);
    CHECK(blobs[0].size == 5 * kChunk + 300);
    CHECK(blobs[2].size == 0);
    CHECK(storage::testing::missing_chunks(store) == 0);
    CHECK(offset_of(store, 10, 5 * kChunk, 5 * kChunk + 300) == o10);
    CHECK(offset_of(store, 11, 0, kChunk) == o11);
    // Each chunk verifies against the checksum sealed for it (its bytes differ from every other's).
    for (const auto& b : set)
      for (uint64_t off = 0; off < b.size; off += kChunk)
        CHECK(reads_back(store, b.id, off, chunk_bytes_of(store, b.id, off, b.size)));
    CHECK(store.disk_bytes() == (3 * kChunk) + (2 * kChunk + 4096) + kChunk);

    // Resume completes: the manifest says so, and the extents stay for the next pause.
    REQUIRE(store.commit(storage::CommitState::Resumed));
    CHECK_FALSE(store.paused());
  }
  {
    auto adopted = RankStore::adopt(roots, id, kChunk);
    REQUIRE(adopted);
    auto& store = **adopted;
    CHECK_FALSE(store.paused());
    CHECK(store.generation() == 1);  // a resume keeps the number of the pause it ended
    REQUIRE(store.reserve(set));
    CHECK(storage::testing::missing_chunks(store) == 7);
    CHECK(offset_of(store, 10, 5 * kChunk, 5 * kChunk + 300) == o10);
    CHECK(offset_of(store, 11, 0, kChunk) == o11);
    // New blobs after an adopt take free space, never space of the adopted extents.
    REQUIRE(store.reserve(std::vector<storage::BlobSize>{{10, 5 * kChunk + 300}, {11, kChunk}, {13, kChunk}}));
    uint64_t o13 = offset_of(store, 13, 0, kChunk);
    CHECK(o13 != o11);
    CHECK(o13 != offset_of(store, 10, 0, 5 * kChunk + 300));
    REQUIRE(store.remove());
  }
}

TEST_CASE("adopt refuses a wrong owner and starts empty without a manifest") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity();
  { auto store = make_store(roots, id); }

  RankIdentity wrong_token = id;
  wrong_token.token = 1;
  auto t = RankStore::adopt(roots, wrong_token, kChunk);
  REQUIRE_FALSE(t);
  CHECK(t.error().errnum() == EPERM);
  CHECK_THAT(t.error().message, Catch::Contains("another session"));

  RankIdentity wrong_start = id;
  wrong_start.start_time += 1;
  auto s = RankStore::adopt(roots, wrong_start, kChunk);
  REQUIRE_FALSE(s);
  CHECK(s.error().errnum() == EPERM);

  auto other_job = RankStore::adopt(roots, my_identity("job2"), kChunk);
  REQUIRE_FALSE(other_job);
  CHECK(other_job.error().errnum() == ENOENT);

  auto fresh = RankStore::adopt(roots, id, kChunk);
  REQUIRE(fresh);
  CHECK_FALSE((*fresh)->paused());
  CHECK((*fresh)->blobs().empty());
  REQUIRE((*fresh)->remove());
}

TEST_CASE(
    "a corrupt manifest keeps the data file untouched and refuses its use, saying the record is unreadable and why") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity();
  const std::string data_path = paused_rank(roots, id);
  const std::string manifest = std::filesystem::path(data_path).parent_path() / "manifest";
  const std::string data = read_text(data_path);
  REQUIRE(data.size() >= 3 * kChunk);
  const std::string good = read_text(manifest);
  REQUIRE(good.size() > 64);

  auto expect_lost = [&](const std::string& bytes, const char* why) {
    write_text(manifest, bytes);
    auto r = RankStore::adopt(roots, id, kChunk);
    INFO((r ? std::string() : r.error().describe()));
    REQUIRE(r);  // the rank gets its session: its memory stays paused, the process runs
    CHECK_THAT((*r)->record_problem(),
               Catch::StartsWith("the pause record " + manifest + " is unreadable (") && Catch::Contains(why));
    check_lost_record(**r, data_path, data);
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  expect_lost(flipped, "checksum mismatch");
  std::string magic = good;
  magic[0] = 'X';
  expect_lost(magic, "magic");
  expect_lost(good.substr(0, good.size() - 9), "checksum");
  expect_lost("", "too short");

  // Another chunk size is the session's mistake, not the record's: refused, and reconnecting as
  // before works.
  write_text(manifest, good);
  auto wrong_chunk = RankStore::adopt(roots, id, 2 * kChunk);
  REQUIRE_FALSE(wrong_chunk);
  CHECK_THAT(wrong_chunk.error().message, Catch::Contains("chunk size"));
  auto ok = RankStore::adopt(roots, id, kChunk);
  REQUIRE(ok);
  CHECK((*ok)->record_problem().empty());
  CHECK((*ok)->paused());
  CHECK(chunk_is(**ok, 1, 2 * kChunk, kChunk, 0x33));
  REQUIRE((*ok)->remove());
}

TEST_CASE("a deleted manifest never truncates the data file: its use is refused until the rank commits a resume") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("lost", 4);
  const std::string data0 = paused_rank(roots, id);
  const std::string dir0 = std::filesystem::path(data0).parent_path();
  const std::string data1 = b.path() + "/" + rank_relative_dir(id) + "/data";
  const std::string bytes0 = read_text(data0), bytes1 = read_text(data1);
  REQUIRE(bytes0.size() > 0);
  REQUIRE(bytes1.size() > 0);  // striped: chunk 1 lives on the second root
  REQUIRE(std::filesystem::remove(dir0 + "/manifest"));

  auto r = RankStore::adopt(roots, id, kChunk);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  RankStore& store = **r;
  const std::string& problem = store.record_problem();
  INFO(problem);
  CHECK_THAT(problem, Catch::StartsWith("the pause record " + dir0 +
                                        "/manifest is missing: without it tmsdiskd "
                                        "cannot tell where this rank's paused memory lies"));
  CHECK_THAT(problem,
             Catch::Contains("the data files " + data0 + " (" + std::to_string(bytes0.size()) + " bytes) and " + data1 +
                             " (" + std::to_string(bytes1.size()) + " bytes) are kept untouched"));
  CHECK(store.disk_bytes() == bytes0.size() + bytes1.size());
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());
  CHECK(store.locate(1, 0, kChunk).error().errnum() == EUCLEAN);
  CHECK(store.reserve(std::vector<storage::BlobSize>{{1, 3 * kChunk}}).error().errnum() == EBUSY);
  CHECK(read_text(data0) == bytes0);
  CHECK(read_text(data1) == bytes1);

  // The rank has every allocation resident again (it gave the paused ones up, --accept-loss): the
  // record stops mattering, and the files serve the next pause.
  REQUIRE(store.commit(storage::CommitState::Resumed));
  CHECK(store.record_problem().empty());
  CHECK_FALSE(store.awaits_resume());
  REQUIRE(store.reserve(std::vector<storage::BlobSize>{{1, 3 * kChunk}}));
  write_set(store, std::vector<storage::BlobSize>{{1, 3 * kChunk}});
  REQUIRE(store.commit(storage::CommitState::Paused));
  REQUIRE(store.remove());
}

TEST_CASE("a rank that never reserved has empty data files: adopt without a manifest starts empty, no problem") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("fresh", 1);
  { auto store = make_store(roots, id); }
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  CHECK((*r)->record_problem().empty());
  CHECK_FALSE((*r)->awaits_resume());
  REQUIRE((*r)->reserve(std::vector<storage::BlobSize>{{1, kChunk}}));
  REQUIRE((*r)->remove());
}

TEST_CASE("a checksum journal deleted mid-pause: the chunks it sealed are kept, and their use refused naming it") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("nosums", 1);
  const std::vector<storage::BlobSize> set{{1, 3 * kChunk}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    // Every chunk acknowledged: the rank may have released all of it.
    for (uint64_t c = 0; c < 3; ++c) write_through(*store, 1, c * kChunk, filled(kChunk, 0x44));
    dir = store->dir_path();
  }  // the daemon dies before the pause is committed
  const std::string data = read_text(dir + "/data");
  REQUIRE(std::filesystem::remove(dir + "/sums"));
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  CHECK_THAT((*r)->record_problem(), Catch::StartsWith("the checksum journal " + dir +
                                                       "/sums of the pause in progress when tmsdiskd stopped "
                                                       "is missing"));
  // Before, the chunks passed for never written: nothing held, and a closed connection removed the files.
  check_lost_record(**r, dir + "/data", data);
  REQUIRE((*r)->remove());
}

TEST_CASE(
    "a corrupt record in the checksum journal: that chunk is refused, the others verify, nothing is reserved over it") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("badsum", 1);
  const std::vector<storage::BlobSize> set{{1, 3 * kChunk}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    write_set(*store, set);
    dir = store->dir_path();
  }  // the daemon dies before the pause is committed
  std::string sums = read_text(dir + "/sums");
  REQUIRE(sums.size() == 3 * 40);
  sums[40 + 16] ^= 0x01;  // the checksum of chunk 1
  write_text(dir + "/sums", sums);
  const std::string data = read_text(dir + "/data");
  auto r = RankStore::adopt(roots, id, kChunk);
  REQUIRE(r);
  RankStore& store = **r;
  CHECK(store.record_problem().empty());
  CHECK(reads_back(store, 1, 0, chunk_bytes_of(store, 1, 0, 3 * kChunk)));
  CHECK(reads_back(store, 1, 2 * kChunk, chunk_bytes_of(store, 1, 2 * kChunk, 3 * kChunk)));
  auto bad = store.open_read(1, kChunk, kChunk);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EUCLEAN);
  CHECK_THAT(bad.error().message,
             Catch::Contains("the record of this chunk in the checksum journal " + dir + "/sums is corrupt") &&
                 Catch::Contains(dir + "/data (" + std::to_string(data.size()) + " bytes) is kept untouched"));
  CHECK(store.awaits_resume());
  CHECK(store.holds_unresumed_data());
  auto reserved = store.reserve(set);
  REQUIRE_FALSE(reserved);
  CHECK(reserved.error().errnum() == EBUSY);
  CHECK_THAT(reserved.error().message, Catch::Contains("1 chunk(s)") && Catch::Contains(dir + "/sums"));
  CHECK(read_text(dir + "/data") == data);
  REQUIRE(store.commit(storage::CommitState::Resumed));  // every allocation resident again
  CHECK_FALSE(store.awaits_resume());
  REQUIRE(store.reserve(set));
  REQUIRE(store.remove());
}

TEST_CASE("a reservation survives a daemon restart mid-pause: adopt knows the extents and the checksums sealed") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("midpause", 1);
  std::vector<storage::BlobSize> set{{1, 3 * kChunk}, {2, kChunk + 100}};
  uint64_t o2 = 0;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    write_set(*store, std::vector<storage::BlobSize>{{1, 3 * kChunk}});
    o2 = offset_of(*store, 2, kChunk, kChunk + 100);
  }  // the daemon dies before the pause is committed
  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& store = **adopted;
  CHECK_FALSE(store.paused());
  CHECK(store.blobs().size() == 2);
  CHECK(offset_of(store, 2, kChunk, kChunk + 100) == o2);
  // The checksum journal kept what was sealed: no checksum from the rank is needed.
  for (uint64_t off = 0; off < 3 * kChunk; off += kChunk)
    CHECK(reads_back(store, 1, off, chunk_bytes_of(store, 1, off, 3 * kChunk)));
  auto never = store.open_read(2, 0, kChunk);
  REQUIRE_FALSE(never);
  CHECK(never.error().errnum() == ENODATA);
  CHECK(storage::testing::missing_chunks(store) == 2);
  CHECK(store.holds_unresumed_data());  // chunks the rank may have released
}

TEST_CASE("a WRITE seals what was written and a READ refuses a chunk that changed, also after a restart") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("seal", 1);
  std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
  std::vector<uint8_t> chunk(kChunk, 0x5a);
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    write_as_daemon(*store, 1, 0, chunk);
    CHECK(reads_back(*store, 1, 0, chunk));
    // Not the chunk's length: refused when the WRITE opens, and by its seal.
    CHECK_FALSE(store->open_write(1, 0, 100));
    CHECK_FALSE(store->end_write(1, 0, 100, RankStore::hash_chunk(false, std::span(chunk).first(100))));
    auto unsealed = store->open_read(1, kChunk, kChunk);
    REQUIRE_FALSE(unsealed);
    CHECK(unsealed.error().errnum() == ENODATA);
  }  // the daemon dies before the pause is committed
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  CHECK(reads_back(**adopted, 1, 0, chunk));
  // One byte of the chunk changes in the file: what is read back no longer verifies.
  chunk[100] ^= 1;
  write_bytes(**adopted, 1, 0, chunk);
  auto bad = verify_slot(**adopted, 1, 0, read_chunk(**adopted, 1, 0, kChunk));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
  REQUIRE((*adopted)->remove());
}

TEST_CASE("checksums journaled for an earlier reservation are not taken for the next one") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("rejournal", 1);
  std::vector<storage::BlobSize> set{{1, 2 * kChunk}};
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(set));
    write_set(*store, set);
    REQUIRE(store->reserve(set));  // the same layout again: a new pause that wrote nothing yet
  }
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  CHECK(storage::testing::missing_chunks(**adopted) == 2);
  CHECK_FALSE((*adopted)->open_read(1, 0, kChunk));
}
