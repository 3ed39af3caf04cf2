// SPDX-License-Identifier: Apache-2.0
// Storage, zero chunks, which take no disk space, and the space a reservation gives back, punched off
// the caller's thread.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "background_punch.h"
#include "punch_gate.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using namespace storage_test;
using storage::testing::missing_chunks;
using storage::testing::wait_for_punches;

namespace {

// The space a reservation gives back is punched off the caller's thread (background_punch.h). A
// store of 8 chunks that all held data, about to be reserved with every chunk zero; `full` gets the
// bytes its file then has allocated.
std::unique_ptr<RankStore> store_of_data(Roots& roots, const std::string& job, uint64_t& full) {
  auto store = make_store(roots, my_identity(job, 1));
  const std::vector<storage::BlobSize> set{{1, 8 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 8; ++c) write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(c + 1)));
  REQUIRE(store->commit(storage::CommitState::Paused));
  REQUIRE(store->commit(storage::CommitState::Resumed));
  full = allocated_bytes(store->dir_path() + "/data");
  REQUIRE(full >= 8 * kChunk);
  return store;
}

}  // namespace

TEST_CASE("zero chunks take no disk space, are recorded at the reservation and are never written nor read") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  RankIdentity id = my_identity("zero", 1);
  const std::vector<storage::BlobSize> set{{1, 8 * kChunk}, {2, kChunk + 100}};
  const std::vector<storage::ChunkRun> runs{{1, 2, 4}, {2, 1, 1}};
  std::string dir;
  {
    auto store = make_store(roots, id);
    dir = store->dir_path();

    SECTION("runs naming another blob, past a blob's end or overlapping are refused and change nothing") {
      for (const auto& bad : {std::vector<storage::ChunkRun>{{9, 0, 1}}, std::vector<storage::ChunkRun>{{1, 6, 3}},
                              std::vector<storage::ChunkRun>{{1, 0, 3}, {1, 2, 1}}}) {
        auto st = store->reserve(set, bad);
        REQUIRE_FALSE(st);
        CHECK(st.error().errnum() == EINVAL);
        CHECK(store->blob_count() == 0);
        CHECK(usage_of(dir + "/data").size == 0);
      }
    }

    REQUIRE(store->reserve(set, runs));
    // Blob 1: chunks 0, 1, 6, 7 hold data; blob 2: chunk 0 (its chunk 1, 100 bytes, is zero).
    CHECK(store->disk_bytes() == 5 * kChunk);
    CHECK(store->zero_bytes() == 4 * kChunk + 100);
    CHECK(store->chunk_count() == 10);
    CHECK(allocated_bytes(dir + "/data") <= 5 * kChunk + 16384);
    CHECK(usage_of(dir + "/data").size >= 9 * kChunk);  // sparse: the layout's whole length
    CHECK(missing_chunks(*store) == 5);

    for (auto refused :
         {store->locate(1, 2 * kChunk, kChunk).error(), store->locate(2, kChunk, 100).error(),
          store->open_write(1, 5 * kChunk, kChunk).error(), store->open_read(1, 3 * kChunk, kChunk).error()}) {
      CHECK(refused.errnum() == EINVAL);
      CHECK_THAT(refused.message, Catch::Contains("reserved as zero"));
    }
    CHECK_FALSE(store->commit(storage::CommitState::Paused));  // data chunks still missing
    for (uint64_t off : {0u, 1u, 6u, 7u}) CHECK_FALSE(write_through(*store, 1, off * kChunk, filled(kChunk, 0x61)));
    CHECK_FALSE(write_through(*store, 2, 0, filled(kChunk, 0x62)));
    CHECK(missing_chunks(*store) == 0);
    REQUIRE(store->commit(storage::CommitState::Paused));
  }
  // The committed manifest keeps them zero: an adopting daemon refuses them too, and verifies the rest.
  auto adopted = RankStore::adopt(roots, id, kChunk);
  REQUIRE(adopted);
  RankStore& store = **adopted;
  CHECK(store.paused());
  CHECK(store.disk_bytes() == 5 * kChunk);
  CHECK(reads_back(store, 1, kChunk, filled(kChunk, 0x61)));
  auto zero = store.open_read(1, 4 * kChunk, kChunk);
  REQUIRE_FALSE(zero);
  CHECK(zero.error().errnum() == EINVAL);
  REQUIRE(store.remove());
}

TEST_CASE("a zero chunk becomes data and data becomes zero across generations, its blocks punched") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  auto store = make_store(roots, my_identity("zerogen", 1));
  const std::string data = store->dir_path() + "/data";
  const std::vector<storage::BlobSize> set{{1, 8 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 8; ++c) write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(c + 1)));
  REQUIRE(store->commit(storage::CommitState::Paused));
  REQUIRE(store->commit(storage::CommitState::Resumed));
  const uint64_t full = allocated_bytes(data);
  CHECK(full >= 8 * kChunk);

  REQUIRE(store->reserve(set, std::vector<storage::ChunkRun>{{1, 0, 6}}));
  CHECK(store->disk_bytes() == 2 * kChunk);
  wait_for_punches(*store);
  CHECK(allocated_bytes(data) <= full - 6 * kChunk);
  CHECK(missing_chunks(*store) == 2);
  // The kept data chunks still hold their bytes; the zero ones read back as zeros from the file.
  CHECK(chunk_is(*store, 1, 7 * kChunk, kChunk, 8));
  CHECK(write_through(*store, 1, 6 * kChunk, filled(kChunk, 7)));  // unchanged: never punched
  CHECK(write_through(*store, 1, 7 * kChunk, filled(kChunk, 8)));
  REQUIRE(store->commit(storage::CommitState::Paused));
  REQUIRE(store->commit(storage::CommitState::Resumed));

  // Zero again to data: allocated again, and written (what the file held there was punched).
  REQUIRE(store->reserve(set));
  CHECK(store->disk_bytes() == 8 * kChunk);
  CHECK(allocated_bytes(data) >= 8 * kChunk);
  CHECK_FALSE(write_through(*store, 1, 0, filled(kChunk, 1)));
  CHECK(chunk_is(*store, 1, 0, kChunk, 1));
  REQUIRE(store->remove());
}

TEST_CASE("a reservation returns before the space it gives back is punched, and its blocks come back after") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  uint64_t full = 0;
  auto store = store_of_data(roots, "punchlater", full);
  const std::string data = store->dir_path() + "/data";
  const std::vector<storage::BlobSize> set{{1, 8 * kChunk}};
  const std::vector<storage::ChunkRun> all_zero{{1, 0, 8}};
  {
    tmsdisk::testing::PunchGate gate;
    REQUIRE(store->reserve(set, all_zero));
    // Returned, while the punch is held at the gate: nothing was given back on this thread.
    REQUIRE(gate.wait_entered(1));
    CHECK(allocated_bytes(data) >= full);
    CHECK(store->disk_bytes() == 0);  // what the layout counts, at once
    // The pause goes on meanwhile: nothing to write, committed, resumed.
    CHECK(missing_chunks(*store) == 0);
    REQUIRE(store->commit(storage::CommitState::Paused));
    REQUIRE(store->commit(storage::CommitState::Resumed));
    CHECK(allocated_bytes(data) >= full);
    gate.release();
    wait_for_punches(*store);
    CHECK(allocated_bytes(data) + 8 * kChunk <= full);

    // The same zero set again: its ranges are holes already, nothing is punched (nor waited for).
    const int punched = gate.entered();
    const int waits = gate.waits();
    REQUIRE(store->reserve(set, all_zero));
    wait_for_punches(*store);
    CHECK(gate.entered() == punched);
    CHECK(gate.waits() == waits);
  }
  // A daemon restarted may have stopped before its punches: an adopting store punches them again.
  store.reset();
  auto adopted = RankStore::adopt(roots, my_identity("punchlater", 1), kChunk);
  REQUIRE(adopted);
  tmsdisk::testing::PunchGate gate;
  gate.release();
  REQUIRE((*adopted)->reserve(set, all_zero));
  wait_for_punches(**adopted);
  CHECK(gate.entered() >= 1);
  CHECK(allocated_bytes(data) + 8 * kChunk <= full);
  REQUIRE((*adopted)->remove());
}

TEST_CASE("the next reservation waits for the punches of the one before, and its data over their ranges reads back") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  uint64_t full = 0;
  auto store = store_of_data(roots, "punchwait", full);
  const std::string data = store->dir_path() + "/data";
  const std::vector<storage::BlobSize> set{{1, 8 * kChunk}};
  tmsdisk::testing::PunchGate gate;
  REQUIRE(store->reserve(set, std::vector<storage::ChunkRun>{{1, 0, 8}}));
  REQUIRE(gate.wait_entered(1));
  REQUIRE(store->commit(storage::CommitState::Paused));
  REQUIRE(store->commit(storage::CommitState::Resumed));

  // The next pause makes every chunk data again, over the very ranges still to be punched: its
  // reservation must not return before that punch has landed, or the punch would land on its writes.
  Status next;
  CHECK(gate.waits_for_punches([&] { next = store->reserve(set); }));
  REQUIRE(next);
  CHECK(allocated_bytes(data) >= 8 * kChunk);  // preallocated again after the punch
  for (uint64_t c = 0; c < 8; ++c)
    CHECK_FALSE(write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(0x40 + c))));
  REQUIRE(store->commit(storage::CommitState::Paused));
  wait_for_punches(*store);
  for (uint64_t c = 0; c < 8; ++c)
    CHECK(reads_back(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(0x40 + c))));
  REQUIRE(store->remove());
}

TEST_CASE("removing or destroying a store stops its punches at the next piece and waits for them") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  // Three pieces to punch (BackgroundPunch::kPunchPiece each at most); no need to write them, only to
  // have them allocated.
  const uint64_t size = 2 * storage::detail::BackgroundPunch::kPunchPiece + 4 * kChunk;
  const std::vector<storage::BlobSize> set{{1, size}};
  auto store = make_store(roots, my_identity("punchstop", 1));
  const std::string dir = store->dir_path();
  REQUIRE(store->reserve(set));
  tmsdisk::testing::PunchGate gate;
  REQUIRE(store->reserve(set, std::vector<storage::ChunkRun>{{1, 0, size / kChunk}}));
  REQUIRE(gate.wait_entered(1));

  const bool remove = GENERATE(true, false);
  Status removed;
  CHECK(gate.waits_for_punches([&] {
    if (remove)
      removed = store->remove();
    else
      store.reset();
  }));
  CHECK(removed);
  CHECK(gate.entered() == 1);  // stopped after the piece it was punching: the other two never began
  CHECK(exists(dir) != remove);
  if (!remove) {
    // A daemon that stopped mid-punch: its successor adopts the set, and punches the zero chunks again.
    auto adopted = RankStore::adopt(roots, my_identity("punchstop", 1), kChunk);
    REQUIRE(adopted);
    REQUIRE((*adopted)->remove());
  }
}

TEST_CASE("a set larger than the free space is reserved when its data chunks fit") {
  TempDir root;
  Roots roots = open_roots({root.path()});
  constexpr uint32_t kBig = 64 << 20;  // few chunks, however large the filesystem
  auto store = make_store(roots, my_identity("sparse", 1), kBig);
  auto free = roots.free_bytes(0);
  REQUIRE(free);
  const uint64_t chunks = *free / kBig + 8;
  const uint64_t size = chunks * kBig + 4096;  // the last chunk, 4 KiB, holds the only data
  const std::vector<storage::BlobSize> set{{1, size}};
  auto nospace = store->reserve(set);
  REQUIRE_FALSE(nospace);
  CHECK(nospace.error().errnum() == ENOSPC);
  REQUIRE(store->reserve(set, std::vector<storage::ChunkRun>{{1, 0, chunks}}));
  CHECK(store->disk_bytes() == 4096);
  CHECK(missing_chunks(*store) == 1);
  CHECK(usage_of(store->dir_path() + "/data").size == size);
  REQUIRE(store->remove());
}
