// SPDX-License-Identifier: Apache-2.0
// Storage on tmpfs: refused by default with the reason and the override, usable with allow_tmpfs.
// Exits 77 (skipped, with the reason) when this machine has no writable tmpfs to test against.
// main() is in test_storage_catch_impl.cpp; it calls storage_test_setup() first.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "skip.h"
#include "storage.h"
#include "storage_fixtures.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;

namespace {

std::string g_tmpfs;  // a fresh directory on a tmpfs

// A writable tmpfs mount point: /dev/shm where it is one, else the first other tmpfs mounted rw.
std::string find_tmpfs() {
  if (storage_test::on_tmpfs("/dev/shm") && ::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  std::ifstream mounts("/proc/self/mounts");
  std::string line;
  while (std::getline(mounts, line)) {
    std::istringstream in(line);
    std::string dev, dir, type, opts;
    in >> dev >> dir >> type >> opts;
    if (type != "tmpfs" || (opts.rfind("rw", 0) != 0)) continue;
    if (::access(dir.c_str(), W_OK) == 0 && storage_test::on_tmpfs(dir)) return dir;
  }
  return {};
}

}  // namespace

TEST_CASE("a tmpfs root is refused with the reason and the override") {
  auto r = Roots::open({g_tmpfs}, false);
  REQUIRE_FALSE(r);
  CHECK(r.error().errnum() == EINVAL);
  CHECK_THAT(r.error().message, Catch::Contains("tmpfs") && Catch::Contains("RAM") && Catch::Contains("--allow-tmpfs"));
}

TEST_CASE("a tmpfs root works when explicitly allowed") {
  auto r = Roots::open({g_tmpfs}, true);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  auto store = RankStore::create(*r, storage_test::my_identity(), 64 * 1024);
  INFO((store ? std::string() : store.error().describe()));
  REQUIRE(store);
  REQUIRE((*store)->reserve(std::vector<storage::BlobSize>{{1, 100000}}));
  auto loc = (*store)->locate(1, 65536, 100000 - 65536);
  REQUIRE(loc);
  // In memory: the daemon sends its requests to io_uring's workers (io::Request::async).
  CHECK((*r)[0].in_memory);
  CHECK(loc->in_memory);
  // Older kernels' tmpfs refuses O_DIRECT: then the fallback is buffered and says so.
  CHECK(((::fcntl(loc->fd, F_GETFL) & O_DIRECT) != 0) == loc->direct_io);
  if (!loc->direct_io) CHECK_FALSE((*r)[0].direct_io);
  REQUIRE((*store)->remove());
}

namespace {
std::unique_ptr<storage_test::TempDir> g_dir;
}  // namespace

int storage_test_setup() {
  std::string mount = find_tmpfs();
  if (mount.empty())
    tmsdisk::testing::skip("no writable tmpfs on this machine (looked at /dev/shm and /proc/self/mounts)");
  try {
    g_dir = std::make_unique<storage_test::TempDir>(mount);
  } catch (const std::exception& e) {
    tmsdisk::testing::skip(e.what());
  }
  g_tmpfs = g_dir->path();
  return 0;
}

void storage_test_teardown() {
  g_dir.reset();
}
