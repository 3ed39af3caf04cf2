// SPDX-License-Identifier: Apache-2.0
// Storage, reservations: the extent allocator, blobs laid out and striped over the roots, all or
// nothing, locate, and blobs carried paused across new sets.
#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "extent_allocator.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;
using storage::testing::missing_chunks;
using storage::testing::wait_for_punches;

namespace {
int g_fail_calls = 0;
int g_fail_at = 0;
int g_fail_errno = ENOSPC;
int fail_nth(std::size_t, uint64_t, uint64_t) {
  return ++g_fail_calls == g_fail_at ? g_fail_errno : 0;
}
}  // namespace

namespace {

// Writes `fill` over every chunk of `blob` as a pause would: each WRITE as the daemon makes it.
void write_and_seal(RankStore& store, uint64_t blob, uint64_t size, unsigned char fill) {
  for (uint64_t off = 0; off < size; off += kChunk)
    write_through(store, blob, off, filled(static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)), fill));
}

// Every chunk of `blob` reads back as `fill` and verifies against its seal.
void check_blob(RankStore& store, uint64_t blob, uint64_t size, unsigned char fill) {
  for (uint64_t off = 0; off < size; off += kChunk)
    CHECK(reads_back(store, blob, off, filled(static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)), fill)));
}

}  // namespace

TEST_CASE("extent allocator: growth, first fit, coalescing, reuse") {
  constexpr uint64_t P = 4096;
  ExtentAllocator a(P);
  CHECK(a.allocate(2 * P) == 0u);
  CHECK(a.allocate(P) == 2 * P);
  CHECK(a.allocate(3 * P) == 3 * P);
  CHECK(a.end() == 6 * P);
  CHECK(a.used_bytes() == 6 * P);
  CHECK_FALSE(a.allocate(0));
  CHECK_FALSE(a.allocate(P + 1));

  SECTION("first fit takes the lowest hole that is large enough") {
    REQUIRE(a.release(0, 2 * P));
    REQUIRE(a.release(3 * P, 3 * P));   // touches the end: stays free until trimmed
    CHECK(a.allocate(3 * P) == 3 * P);  // the hole at 0 is too small
    CHECK(a.allocate(P) == 0u);         // first fit: the lowest hole
    CHECK(a.allocate(P) == P);
    CHECK(a.free_bytes() == 0);
    CHECK(a.end() == 6 * P);
  }
  SECTION("neighbouring free extents coalesce") {
    REQUIRE(a.release(0, 2 * P));
    REQUIRE(a.release(3 * P, 3 * P));
    CHECK(a.free_extents().size() == 2);
    REQUIRE(a.release(2 * P, P));  // bridges both
    REQUIRE(a.free_extents().size() == 1);
    CHECK(a.free_extents().begin()->first == 0u);
    CHECK(a.free_extents().begin()->second == 6 * P);
    CHECK(a.allocate(6 * P) == 0u);  // reused whole, no growth
    CHECK(a.end() == 6 * P);
  }
  SECTION("a free tail grows instead of leaving a hole") {
    REQUIRE(a.release(3 * P, 3 * P));
    CHECK(a.allocate(5 * P) == 3 * P);
    CHECK(a.end() == 8 * P);
    CHECK(a.free_bytes() == 0);
  }
  SECTION("trim_tail drops the free end") {
    REQUIRE(a.release(2 * P, 4 * P));
    a.trim_tail();
    CHECK(a.end() == 2 * P);
    CHECK(a.free_extents().empty());
    CHECK(a.allocate(P) == 2 * P);
  }
  SECTION("bad releases are refused and change nothing") {
    REQUIRE(a.release(0, 2 * P));
    CHECK_FALSE(a.release(0, 2 * P));      // double free
    CHECK_FALSE(a.release(P, 2 * P));      // overlaps a free extent
    CHECK_FALSE(a.release(2 * P + 1, P));  // misaligned
    CHECK_FALSE(a.release(5 * P, 2 * P));  // past the end
    CHECK_FALSE(a.release(2 * P, 0));
    CHECK(a.free_bytes() == 2 * P);
    CHECK(a.free_extents().size() == 1);
  }
  SECTION("claim rebuilds used extents inside a free file") {
    ExtentAllocator b = ExtentAllocator::with_free_file(P, 8 * P);
    CHECK(b.claim(2 * P, 2 * P));
    CHECK(b.claim(6 * P, 2 * P));
    CHECK_FALSE(b.claim(3 * P, 2 * P));  // overlaps a used extent
    CHECK_FALSE(b.claim(8 * P, P));      // past the end
    CHECK(b.used_bytes() == 4 * P);
    CHECK(b.allocate(2 * P) == 0u);
    CHECK(b.allocate(2 * P) == 4 * P);
    CHECK(b.free_bytes() == 0);
  }
}

TEST_CASE("reserve lays out blobs, keeps unchanged ones and recycles dropped extents") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  const std::string data = store->dir_path() + "/data";

  // Blob 1: three full chunks and a 3392-byte tail rounded up to 4096.
  const uint64_t b1 = 3 * kChunk + 3392;
  std::vector<storage::BlobSize> set{{1, b1}, {2, kChunk}};
  REQUIRE(store->reserve(set));
  CHECK(store->disk_bytes() == 3 * kChunk + 4096 + kChunk);
  CHECK(missing_chunks(*store) == 5);
  CHECK(store->blobs().size() == 2);
  const uint64_t off1 = offset_of(*store, 1, 0, b1);
  const uint64_t off2 = offset_of(*store, 2, 0, kChunk);
  CHECK(off1 % kIoAlignment == 0);
  CHECK(offset_of(*store, 1, 3 * kChunk, b1) == off1 + 3 * kChunk);
  auto tail = store->locate(1, 3 * kChunk, 3392);
  REQUIRE(tail);
  CHECK(tail->io_length == 4096);
  CHECK(usage_of(data).size == store->disk_bytes());
  CHECK(usage_of(data).blocks * 512 >= store->disk_bytes());  // preallocated, not sparse

  SECTION("repeating the same set keeps extents and disk usage constant") {
    const auto usage = usage_of(data);
    for (int i = 0; i < 5; ++i) {
      write_set(*store, set, static_cast<uint64_t>(i));
      REQUIRE(store->commit(storage::CommitState::Paused));
      CHECK(store->generation() == static_cast<uint64_t>(i) + 1);  // each pause numbered by the store
      REQUIRE(store->commit(storage::CommitState::Resumed));
      REQUIRE(store->reserve(set));
      CHECK(store->disk_bytes() == 3 * kChunk + 4096 + kChunk);
      CHECK(usage_of(data) == usage);
      CHECK(offset_of(*store, 1, 0, b1) == off1);
      CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    }
  }
  SECTION("a dropped blob's extent is reused by a new one of the same size") {
    std::vector<storage::BlobSize> next{{2, kChunk}, {3, b1}};
    REQUIRE(store->reserve(next));
    CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    CHECK(offset_of(*store, 3, 0, b1) == off1);
    CHECK_FALSE(store->locate(1, 0, kChunk));
    CHECK(usage_of(data).size == 3 * kChunk + 4096 + kChunk);
  }
  SECTION("a resized blob moves, the file grows at the end, and shrinks when the tail frees") {
    std::vector<storage::BlobSize> bigger{{1, b1}, {2, 4 * kChunk}};
    REQUIRE(store->reserve(bigger));
    CHECK(offset_of(*store, 1, 0, b1) == off1);
    CHECK(offset_of(*store, 2, 0, 4 * kChunk) == off1 + 3 * kChunk + 4096);  // off2 + its old extent freed, merged
    CHECK(store->disk_bytes() == 3 * kChunk + 4096 + 4 * kChunk);
    CHECK(usage_of(data).size == store->disk_bytes());
    // The file is cut once the space a reservation gives back is given back, off the caller's thread.
    REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, b1}}));
    wait_for_punches(*store);
    CHECK(usage_of(data).size == 3 * kChunk + 4096);
    REQUIRE(store->reserve(std::vector<storage::BlobSize>{}));
    CHECK(store->disk_bytes() == 0);
    wait_for_punches(*store);
    CHECK(usage_of(data).size == 0);
  }
  SECTION("invalid sets are refused and change nothing") {
    auto dup = store->reserve(std::vector<storage::BlobSize>{{7, kChunk}, {7, kChunk}});
    REQUIRE_FALSE(dup);
    CHECK(dup.error().errnum() == EINVAL);
    CHECK_THAT(dup.error().message, Catch::Contains("twice"));
    auto huge = store->reserve(std::vector<storage::BlobSize>{{8, uint64_t{1} << 61}});
    REQUIRE_FALSE(huge);
    CHECK(huge.error().errnum() == EFBIG);
    // More than the disk holds: refused before touching it, with both numbers in the message.
    auto nospace = store->reserve(std::vector<storage::BlobSize>{{1, b1}, {9, uint64_t{1} << 59}});
    REQUIRE_FALSE(nospace);
    CHECK(nospace.error().errnum() == ENOSPC);
    CHECK_THAT(nospace.error().message, Catch::Contains("needs") && Catch::Contains("free"));
    CHECK(store->blobs().size() == 2);
    CHECK(offset_of(*store, 1, 0, b1) == off1);
    CHECK(offset_of(*store, 2, 0, kChunk) == off2);
    CHECK(usage_of(data).size == 3 * kChunk + 4096 + kChunk);
  }
  REQUIRE(store->remove());
}

TEST_CASE("blobs stripe chunk by chunk over the roots") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  const RankIdentity id = my_identity();
  auto store = make_store(roots, id);
  const uint64_t size = 4 * kChunk + 100;  // chunks 0,2,4 on root 0 (4 is the tail); 1,3 on root 1
  REQUIRE(store->reserve(std::vector<storage::BlobSize>{{5, size}}));
  CHECK(store->disk_bytes() == 2 * kChunk + 4096 + 2 * kChunk);
  auto c0 = store->locate(5, 0, kChunk);
  auto c1 = store->locate(5, kChunk, kChunk);
  auto c2 = store->locate(5, 2 * kChunk, kChunk);
  auto c3 = store->locate(5, 3 * kChunk, kChunk);
  auto c4 = store->locate(5, 4 * kChunk, 100);
  REQUIRE((c0 && c1 && c2 && c3 && c4));
  CHECK(c0->fd == c2->fd);
  CHECK(c0->fd == c4->fd);
  CHECK(c1->fd == c3->fd);
  CHECK(c0->fd != c1->fd);
  CHECK(c2->file_offset == c0->file_offset + kChunk);
  CHECK(c4->file_offset == c0->file_offset + 2 * kChunk);
  CHECK(c3->file_offset == c1->file_offset + kChunk);
  CHECK(c4->io_length == 4096);
  CHECK(usage_of(a / rank_relative_dir(id) + "/data").size == 2 * kChunk + 4096);
  CHECK(usage_of(b / rank_relative_dir(id) + "/data").size == 2 * kChunk);
  CHECK_FALSE(exists(b / rank_relative_dir(id) + "/manifest"));
  REQUIRE(store->remove());
  CHECK(entries(a.path()).empty());
  CHECK(entries(b.path()).empty());
}

TEST_CASE("reserve is all or nothing when a preallocation fails") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  const RankIdentity id = my_identity();
  auto store = make_store(roots, id);
  const std::string data_a = a / rank_relative_dir(id) + "/data";
  const std::string data_b = b / rank_relative_dir(id) + "/data";
  std::vector<storage::BlobSize> first{{1, 3 * kChunk}, {2, 2 * kChunk}};
  REQUIRE(store->reserve(first));
  write_set(*store, std::vector<storage::BlobSize>{{1, 3 * kChunk}});
  write_through(*store, 2, 0, filled(kChunk, 0xa5));
  write_through(*store, 2, kChunk, filled(kChunk, 0x5a));
  const auto ua = usage_of(data_a);
  const auto ub = usage_of(data_b);
  const uint64_t disk = store->disk_bytes();
  const uint64_t o1 = offset_of(*store, 1, kChunk, 3 * kChunk);

  // The new set drops blob 2 and adds two blobs: four fresh extents; fail each one in turn so the
  // rollback runs after 0..3 successful preallocations spread over both roots.
  std::vector<storage::BlobSize> next{{1, 3 * kChunk}, {3, 8 * kChunk}, {4, 2 * kChunk}};
  int err = GENERATE(ENOSPC, EIO);
  int at = GENERATE(1, 2, 3, 4);
  g_fail_calls = 0;
  g_fail_at = at;
  g_fail_errno = err;
  auto prev = storage::testing::set_fallocate_hook(&fail_nth);
  auto st = store->reserve(next);
  storage::testing::set_fallocate_hook(prev);
  REQUIRE_FALSE(st);
  CHECK(st.error().errnum() == err);
  if (err == ENOSPC) {
    CHECK_THAT(st.error().message, Catch::Contains("needs") && Catch::Contains("free"));
  } else {
    CHECK_THAT(st.error().message, Catch::Contains("cannot preallocate"));
  }
  CHECK(usage_of(data_a) == ua);
  CHECK(usage_of(data_b) == ub);
  CHECK(store->disk_bytes() == disk);
  auto blobs = store->blobs();
  REQUIRE(blobs.size() == 2);
  CHECK(blobs[1].id == 2);
  CHECK(offset_of(*store, 1, kChunk, 3 * kChunk) == o1);
  CHECK(missing_chunks(*store) == 0);  // checksums of the old set survive a refused reserve
  // Blob 2 is dropped by the refused set and its space would have gone to blob 3: still intact, and
  // verified against its seals.
  CHECK(reads_back(*store, 2, 0, filled(kChunk, 0xa5)));
  CHECK(reads_back(*store, 2, kChunk, filled(kChunk, 0x5a)));

  REQUIRE(store->reserve(next));
  CHECK(store->blobs().size() == 3);
  REQUIRE(store->remove());
}

TEST_CASE("locate validates blob, offset and length") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  const uint64_t size = 2 * kChunk + 10;
  REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, size}, {2, 0}}));

  auto unknown = store->locate(99, 0, kChunk);
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().errnum() == ENOENT);
  auto misaligned = store->locate(1, 4096, kChunk);
  REQUIRE_FALSE(misaligned);
  CHECK(misaligned.error().errnum() == EINVAL);
  auto short_len = store->locate(1, 0, kChunk - 4096);
  REQUIRE_FALSE(short_len);
  CHECK(short_len.error().errnum() == EINVAL);
  auto long_tail = store->locate(1, 2 * kChunk, kChunk);
  REQUIRE_FALSE(long_tail);
  CHECK_THAT(long_tail.error().message, Catch::Contains("is 10 bytes"));
  auto past = store->locate(1, 3 * kChunk, kChunk);
  REQUIRE_FALSE(past);
  CHECK_THAT(past.error().message, Catch::Contains("past the end"));
  CHECK_FALSE(store->locate(2, 0, 0));  // an empty blob has no chunk
  auto ok = store->locate(1, 2 * kChunk, 10);
  REQUIRE(ok);
  CHECK(ok->io_length == 4096);
  CHECK(missing_chunks(*store) == 3);
  REQUIRE(store->remove());
}

TEST_CASE("checksums are kept per chunk and cleared by reserve") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity());
  std::vector<storage::BlobSize> set{{1, 2 * kChunk}, {2, 100}};
  REQUIRE(store->reserve(set));
  CHECK(missing_chunks(*store) == 3);

  auto none = store->open_read(1, 0, kChunk);
  REQUIRE_FALSE(none);
  CHECK(none.error().errnum() == ENODATA);
  write_through(*store, 1, 0, filled(kChunk, 42));
  CHECK(missing_chunks(*store) == 2);
  write_through(*store, 1, 0, filled(kChunk, 43));  // rewriting a chunk replaces its checksum
  CHECK(missing_chunks(*store) == 2);
  CHECK(reads_back(*store, 1, 0, filled(kChunk, 43)));
  CHECK(verify_slot(*store, 1, 0, filled(kChunk, 42)).error().errnum() == EBADMSG);

  // No chunk of the reserved set: refused when the WRITE opens, and by a seal.
  CHECK_FALSE(store->open_write(3, 0, kChunk));
  CHECK_FALSE(store->open_write(1, 5, kChunk));
  CHECK_FALSE(store->open_write(1, 2 * kChunk, kChunk));
  CHECK_FALSE(store->end_write(3, 0, kChunk, Checksum128{1}));
  CHECK_FALSE(store->end_write(1, 5, kChunk, Checksum128{1}));
  CHECK_FALSE(store->end_write(1, 2 * kChunk, kChunk, Checksum128{1}));
  CHECK(missing_chunks(*store) == 2);
  CHECK_FALSE(store->open_read(9, 0, kChunk));

  write_through(*store, 1, kChunk, filled(kChunk, 7));
  write_through(*store, 2, 0, filled(100, 8));
  CHECK(missing_chunks(*store) == 0);
  REQUIRE(store->reserve(set));
  CHECK(missing_chunks(*store) == 3);
  CHECK_FALSE(store->open_read(2, 0, 100));
  REQUIRE(store->remove());
}

TEST_CASE("a carried blob stays paused across new sets: its extents, seals and bytes pass untouched") {
  TempDir a, b;
  Roots roots = open_roots({a.path(), b.path()});
  RankIdentity id = my_identity("carry", 1);
  const uint64_t size1 = 3 * kChunk + 100, size2 = 2 * kChunk;
  auto store = make_store(roots, id);
  // Part A paused and committed.
  REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, size1}}));
  write_and_seal(*store, 1, size1, 0xa1);
  REQUIRE(store->commit(storage::CommitState::Paused));
  const uint64_t generation = store->generation();
  const uint64_t where = offset_of(*store, 1, kChunk, size1);
  // Part B pauses while A stays paused: only a set that carries A may replace the committed one.
  const std::vector<storage::BlobSize> both{{1, size1}, {2, size2}};
  auto refused = store->reserve(both);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EBUSY);
  const std::vector<uint64_t> carry_a{1};
  REQUIRE(store->reserve(both, {}, {}, carry_a));
  CHECK_FALSE(store->paused());
  CHECK(store->holds_unresumed_data());  // A's chunks are still the only copy
  CHECK(missing_chunks(*store) == 2);    // B's, to be written
  CHECK(offset_of(*store, 1, kChunk, size1) == where);
  check_blob(*store, 1, size1, 0xa1);
  write_and_seal(*store, 2, size2, 0xb2);
  REQUIRE(store->commit(storage::CommitState::Paused));
  CHECK(store->generation() == generation + 1);
  store.reset();  // the daemon restarts with both parts paused

  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& again = **adopted;
  CHECK(again.paused());
  check_blob(again, 1, size1, 0xa1);
  check_blob(again, 2, size2, 0xb2);
  // A resumes while B stays paused: a set of B alone, carried; A's extents are recycled.
  const std::vector<uint64_t> carry_b{2};
  REQUIRE(again.reserve(std::vector<storage::BlobSize>{{2, size2}}, {}, {}, carry_b));
  CHECK(missing_chunks(again) == 0);
  CHECK_FALSE(again.locate(1, 0, kChunk));
  check_blob(again, 2, size2, 0xb2);
  REQUIRE(again.commit(storage::CommitState::Paused));
  check_blob(again, 2, size2, 0xb2);
  REQUIRE(again.remove());
}

TEST_CASE("a set that carries survives a daemon restart before its commit: the carried seals are in its record") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  RankIdentity id = my_identity("carry-restart", 1);
  const uint64_t size1 = 2 * kChunk, size2 = kChunk;
  {
    auto store = make_store(roots, id);
    REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, size1}}));
    write_and_seal(*store, 1, size1, 0x11);
    REQUIRE(store->commit(storage::CommitState::Paused));
    const std::vector<uint64_t> carry{1};
    REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, size1}, {2, size2}}, {}, {}, carry));
  }  // dies before B is written
  auto adopted = RankStore::adopt(roots, id, kChunk);
  INFO((adopted ? std::string() : adopted.error().describe()));
  REQUIRE(adopted);
  auto& store = **adopted;
  CHECK(store.record_problem().empty());
  CHECK(missing_chunks(store) == 1);
  CHECK(store.holds_unresumed_data());
  check_blob(store, 1, size1, 0x11);
  REQUIRE(store.remove());
}

TEST_CASE("carrying is refused for a blob not held as it is, with chunks never written, or named by a run") {
  TempDir a;
  Roots roots = open_roots({a.path()});
  auto store = make_store(roots, my_identity("carry-refused", 1));
  const std::vector<storage::BlobSize> set{{1, 2 * kChunk}, {2, kChunk}};
  REQUIRE(store->reserve(set));
  write_and_seal(*store, 1, 2 * kChunk, 0x33);  // blob 2 never written
  auto refused = [&](std::vector<storage::BlobSize> next, std::vector<uint64_t> carry,
                     std::vector<storage::ChunkRun> zero = {}) {
    auto st = store->reserve(next, zero, {}, carry);
    REQUIRE_FALSE(st);
    CHECK(st.error().errnum() == EINVAL);
    return st.error().describe();
  };
  CHECK_THAT(refused(set, {3}), Catch::Contains("blob 3 is carried but not held"));
  CHECK_THAT(refused({{1, kChunk}, {2, kChunk}}, {1}), Catch::Contains("blob 1 is carried but not held"));
  CHECK_THAT(refused(set, {2}), Catch::Contains("1 of its chunks were never written"));
  CHECK_THAT(refused(set, {1, 1}), Catch::Contains("carried twice"));
  CHECK_THAT(refused(set, {1}, {{.blob = 1, .first_chunk = 0, .count = 1}}), Catch::Contains("carried as it is"));
  // Refused without a change: blob 1 is where it was and verifies.
  check_blob(*store, 1, 2 * kChunk, 0x33);
}
