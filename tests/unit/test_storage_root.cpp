// SPDX-License-Identifier: Apache-2.0
// Storage tests that need root: real ENOSPC on a small loop-mounted ext4, and planted foreign owners.
// Exits 77 (skipped, with the reason) when not root or when the loop mount is not possible here.
// main() is in test_storage_catch_impl.cpp; it calls storage_test_setup() first.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "skip.h"
#include "small_filesystem.h"
#include "storage.h"
#include "storage_fixtures.h"
#include "storage_testing.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using storage_test::my_identity;
using storage_test::open_roots;
using storage_test::TempDir;
using storage_test::usage_of;

namespace {

constexpr uint32_t kChunk = 1 << 20;
std::string g_mnt;  // the mounted 64 MiB ext4

// A store of this file's 1 MiB chunks (storage_fixtures.h's default is 64 KiB).
std::unique_ptr<RankStore> make_store(Roots& roots, const RankIdentity& id) {
  return storage_test::make_store(roots, id, kChunk);
}

uint64_t free_of(const Roots& roots, std::size_t i) {
  auto f = roots.free_bytes(i);
  REQUIRE(f);
  return *f;
}

// Writes `byte` over every chunk of `blob`, each WRITE as the daemon makes it.
void fill(RankStore& store, uint64_t blob, uint64_t size, unsigned char byte) {
  for (uint64_t off = 0; off < size; off += kChunk)
    storage_test::write_through(
        store, blob, off, storage_test::filled(static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)), byte));
}

bool holds(const RankStore& store, uint64_t blob, uint64_t size, unsigned char byte) {
  auto* buf = static_cast<unsigned char*>(std::aligned_alloc(kIoAlignment, kChunk));
  REQUIRE(buf);
  bool same = true;
  for (uint64_t off = 0; off < size && same; off += kChunk) {
    auto loc = store.locate(blob, off, static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)));
    REQUIRE(loc);
    same = ::pread(loc->fd, buf, loc->io_length, static_cast<off_t>(loc->file_offset)) ==
               static_cast<ssize_t>(loc->io_length) &&
           std::all_of(buf, buf + loc->io_length, [byte](unsigned char c) { return c == byte; });
  }
  std::free(buf);
  return same;
}

}  // namespace

TEST_CASE("a set larger than the free space is refused up front and changes nothing") {
  TempDir dir(g_mnt);
  Roots roots = open_roots({dir.path()});
  auto store = make_store(roots, my_identity());
  const std::string data = store->dir_path() + "/data";
  std::vector<storage::BlobSize> small{{1, 4 * kChunk}};
  REQUIRE(store->reserve(small));
  fill(*store, 1, 4 * kChunk, 0x11);
  const auto usage = usage_of(data);

  const uint64_t free = free_of(roots, 0);
  auto st = store->reserve(std::vector<storage::BlobSize>{{1, 4 * kChunk}, {2, free + 16 * kChunk}});
  REQUIRE_FALSE(st);
  CHECK(st.error().errnum() == ENOSPC);
  CHECK_THAT(st.error().message, Catch::Contains("needs") && Catch::Contains("free") && Catch::Contains(dir.path()));
  CHECK(usage_of(data) == usage);
  CHECK(store->blobs().size() == 1);
  CHECK(storage::testing::missing_chunks(*store) == 0);
  CHECK(holds(*store, 1, 4 * kChunk, 0x11));
  REQUIRE(store->remove());
}

TEST_CASE("a real ENOSPC from fallocate on a later root rolls every root back") {
  // Two roots on one filesystem: each one alone has room for its share, so the early check
  // passes, but the second preallocation hits the real ENOSPC of the filesystem.
  TempDir dir(g_mnt);
  std::filesystem::create_directory(dir / "r0");
  std::filesystem::create_directory(dir / "r1");
  Roots roots = open_roots({dir / "r0", dir / "r1"});
  const RankIdentity id = my_identity();
  auto store = make_store(roots, id);
  const std::string data0 = (dir / "r0/") + rank_relative_dir(id) + "/data";
  const std::string data1 = (dir / "r1/") + rank_relative_dir(id) + "/data";

  std::vector<storage::BlobSize> small{{1, 2 * kChunk}, {2, 2 * kChunk}};
  REQUIRE(store->reserve(small));
  fill(*store, 1, 2 * kChunk, 0x21);
  fill(*store, 2, 2 * kChunk, 0x22);
  const auto u0 = usage_of(data0);
  const auto u1 = usage_of(data1);
  const uint64_t free_before = free_of(roots, 0);

  // Blob 3's share on each root is 60% of the free space: 120% in all.
  const uint64_t share = free_before * 6 / 10 / kChunk * kChunk;
  REQUIRE(share >= 4 * kChunk);
  // Blob 2 is dropped, so its extents are recycled into blob 3's: they must survive the rollback.
  auto st = store->reserve(std::vector<storage::BlobSize>{{1, 2 * kChunk}, {3, 2 * share}});
  REQUIRE_FALSE(st);
  CHECK(st.error().errnum() == ENOSPC);
  CHECK_THAT(st.error().message, Catch::Contains("needs") && Catch::Contains("free"));
  INFO("data0 " << u0.size << "/" << u0.blocks << " -> " << usage_of(data0).size << "/" << usage_of(data0).blocks);
  INFO("data1 " << u1.size << "/" << u1.blocks << " -> " << usage_of(data1).size << "/" << usage_of(data1).blocks);
  // Sizes are exact. Blocks may differ by the extent-tree index block ext4 allocated for the large
  // fragmented preallocation: it stays after the punch and truncate (metadata, not data).
  constexpr uint64_t kMetaSlack = 8192;
  CHECK(usage_of(data0).size == u0.size);
  CHECK(usage_of(data1).size == u1.size);
  CHECK(usage_of(data0).blocks * 512 <= u0.blocks * 512 + kMetaSlack);
  CHECK(usage_of(data1).blocks * 512 <= u1.blocks * 512 + kMetaSlack);
  CHECK(free_of(roots, 0) + 2 * kMetaSlack >= free_before);
  REQUIRE(store->blobs().size() == 2);
  CHECK(storage::testing::missing_chunks(*store) == 0);
  CHECK(holds(*store, 1, 2 * kChunk, 0x21));
  CHECK(holds(*store, 2, 2 * kChunk, 0x22));

  // The space really came back: a set that fits (30% per root) now succeeds.
  const uint64_t fits = free_before * 3 / 10 / kChunk * kChunk;
  REQUIRE(store->reserve(std::vector<storage::BlobSize>{{1, 2 * kChunk}, {3, 2 * fits}}));
  CHECK(holds(*store, 1, 2 * kChunk, 0x21));
  REQUIRE(store->remove());
}

TEST_CASE("a job or uid directory planted by another user is refused") {
  TempDir dir(g_mnt);
  Roots roots = open_roots({dir.path()});
  std::filesystem::create_directory(dir / "1000");
  REQUIRE(::chown((dir / "1000").c_str(), 2000, 2000) == 0);
  auto s = RankStore::create(roots, my_identity(), kChunk);
  REQUIRE_FALSE(s);
  CHECK(s.error().errnum() == EPERM);
  CHECK_THAT(s.error().message, Catch::Contains("owned by uid 2000"));

  // The failed create removed the planted directory, being empty; one of the rank's own user is fine.
  std::filesystem::create_directories(dir / "1000/job1");
  REQUIRE(::chown((dir / "1000").c_str(), 1000, 1000) == 0);
  REQUIRE(::chown((dir / "1000/job1").c_str(), 3000, 3000) == 0);
  auto j = RankStore::create(roots, my_identity(), kChunk);
  REQUIRE_FALSE(j);
  CHECK_THAT(j.error().message, Catch::Contains("owned by uid 3000"));
}

namespace {
std::unique_ptr<tmsdisk::testing::SmallFilesystem> g_fs;
}  // namespace

int storage_test_setup() {
  if (::geteuid() != 0)
    tmsdisk::testing::skip("needs root to loop-mount a small ext4 (real ENOSPC) and to chown directories");
  std::string why_not;
  g_fs = tmsdisk::testing::SmallFilesystem::mount(64, &why_not);
  if (!g_fs) tmsdisk::testing::skip(why_not);
  g_mnt = g_fs->path();
  return 0;
}

void storage_test_teardown() {
  g_fs.reset();
}
