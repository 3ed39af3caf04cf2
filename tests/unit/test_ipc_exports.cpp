// SPDX-License-Identifier: Apache-2.0
// The daemon's legacy-IPC registry: who may open an export, when a revoke is refused, and what goes
// when a session ends or reconnects.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>

#include "ipc_exports.h"

using namespace tmsdisk;
using tmsdisk::server::IpcExports;

namespace {

UniqueFd memfd() {
  UniqueFd fd(::memfd_create("ipc-exports-test", MFD_CLOEXEC));
  REQUIRE(fd);
  return fd;
}

// Whether this process still holds a descriptor on the same file as `probe`.
bool holds_file_of(int probe, int except) {
  struct stat want {};
  REQUIRE(::fstat(probe, &want) == 0);
  for (int fd = 0; fd < 4096; ++fd) {
    if (fd == probe || fd == except) continue;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_ino == want.st_ino && st.st_dev == want.st_dev) return true;
  }
  return false;
}

IpcExports make(IpcExports::Limits limits = {}) {
  return IpcExports([n = uint64_t{0}]() mutable { return ++n * 1000; }, limits);
}

constexpr uint64_t kOwner = 1, kImporter = 2, kStranger = 3;
constexpr uid_t kUid = 1000;

}  // namespace

TEST_CASE("ipc exports - only another process of the same uid may open an export") {
  IpcExports ipc = make();
  auto id = ipc.add(kOwner, kUid, 4242, memfd(), 2 << 20, 0);
  REQUIRE(id);
  CHECK(ipc.open(*id, kOwner, kUid).error().errnum() == EINVAL);         // its own handle
  CHECK(ipc.open(*id, kStranger, kUid + 1).error().errnum() == ENOENT);  // another user: not even seen
  CHECK(ipc.open(*id + 1, kImporter, kUid).error().errnum() == ENOENT);
  auto o = ipc.open(*id, kImporter, kUid);
  REQUIRE(o);
  CHECK(o->fd >= 0);
  CHECK(o->bytes == (2u << 20));
  CHECK(o->exporter_pid == 4242);
  CHECK(o->users.owner == kOwner);
  CHECK(o->users.importers == 1);
}

TEST_CASE("ipc exports - a revoke is refused while the export is open and closes the fd once it is not") {
  IpcExports ipc = make();
  UniqueFd probe = memfd();
  UniqueFd given(::fcntl(probe.get(), F_DUPFD_CLOEXEC, 0));
  const int given_fd = given.get();
  auto id = ipc.add(kOwner, kUid, 1, std::move(given), 4096, 0);
  REQUIRE(id);
  REQUIRE(ipc.open(*id, kImporter, kUid));
  REQUIRE(ipc.open(*id, kImporter, kUid));                       // twice by one process: one importer, two opens
  CHECK(ipc.revoke(*id, kImporter).error().errnum() == ENOENT);  // not the owner
  CHECK(ipc.revoke(*id, kOwner).error().errnum() == EBUSY);
  auto u = ipc.close(*id, kImporter);
  REQUIRE(u);
  CHECK(u->importers == 1);
  CHECK(ipc.revoke(*id, kOwner).error().errnum() == EBUSY);
  u = ipc.close(*id, kImporter);
  REQUIRE(u);
  CHECK(u->importers == 0);
  CHECK(ipc.close(*id, kImporter).error().errnum() == ENOENT);
  CHECK(holds_file_of(probe.get(), -1));
  REQUIRE(ipc.revoke(*id, kOwner));
  CHECK_FALSE(holds_file_of(probe.get(), given_fd));  // the daemon keeps no old physical memory alive
  // Revoked (the exporter is paused): opens wait for the refresh after its resume.
  CHECK(ipc.open(*id, kImporter, kUid).error().errnum() == EAGAIN);
  CHECK(ipc.refresh(*id, kOwner, memfd(), 8192).error().errnum() == EINVAL);  // not the same memory
  REQUIRE(ipc.refresh(*id, kOwner, memfd(), 4096));
  CHECK(ipc.refresh(*id, kOwner, memfd(), 4096).error().errnum() == EBUSY);  // live: nobody's memory changes
  CHECK(ipc.open(*id, kImporter, kUid));
  CHECK(ipc.close(*id, kStranger).error().errnum() == ENOENT);  // not open by it: same answer as unknown
}

TEST_CASE("ipc exports - a session's exports and opens end with it, and follow it when it reconnects") {
  IpcExports ipc = make();
  auto a = ipc.add(kOwner, kUid, 1, memfd(), 4096, 0);
  auto b = ipc.add(kImporter, kUid, 2, memfd(), 4096, 0);
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(ipc.open(*a, kImporter, kUid));
  REQUIRE(ipc.open(*b, kOwner, kUid));

  CHECK(ipc.holds(kOwner));
  CHECK(ipc.holds(kImporter));
  CHECK_FALSE(ipc.holds(kStranger));
  ipc.rename_session(kImporter, 7);
  CHECK_FALSE(ipc.holds(kImporter));
  auto mine = ipc.exports_of(7);
  REQUIRE(mine.size() == 1);
  CHECK(mine[0].export_id == *b);
  CHECK(ipc.exports_of(kOwner).at(0).importers == 1);

  auto notices = ipc.drop([](uint64_t s) { return s == 7; });
  CHECK(ipc.size() == 1);  // b went with its owner
  REQUIRE(notices.size() == 1);
  CHECK(notices[0].owner == kOwner);
  CHECK(notices[0].export_id == *a);
  CHECK(notices[0].importers == 0);
  CHECK(ipc.revoke(*a, kOwner));
  CHECK(ipc.forget(*a, kOwner));
  CHECK(ipc.size() == 0);
}

TEST_CASE("ipc exports - the descriptors held are bounded per user and in all") {
  IpcExports ipc = make({.per_uid = 3, .total = 5});
  UniqueFd fd = memfd();
  auto dup = [&] { return UniqueFd(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0)); };
  for (int i = 0; i < 3; ++i) REQUIRE(ipc.add(kOwner + i, kUid, 1, dup(), 4096, 0));  // sessions share the cap
  auto refused = ipc.add(kOwner, kUid, 1, dup(), 4096, 0);
  CHECK(refused.error().errnum() == EDQUOT);
  REQUIRE(ipc.add(kStranger, kUid + 1, 2, dup(), 4096, 0));
  auto last = ipc.add(kStranger, 0, 3, dup(), 4096, 0);  // root has no per-user cap
  REQUIRE(last);
  CHECK(ipc.add(kStranger, 0, 3, dup(), 4096, 0).error().errnum() == ENFILE);  // but counts toward the total
  // What goes frees room for the user again.
  REQUIRE(ipc.forget(*last, kStranger));
  ipc.drop([](uint64_t s) { return s == kOwner; });
  CHECK(ipc.add(kOwner, kUid, 1, dup(), 4096, 0));
}

TEST_CASE("ipc exports - only NVIDIA device files and memfds pass as GPU memory") {
  UniqueFd m = memfd();
  CHECK(server::check_memory_fd(m.get()));
  UniqueFd dir(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  REQUIRE(dir);
  CHECK(server::check_memory_fd(dir.get()).error().errnum() == EINVAL);
  UniqueFd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  REQUIRE(null);
  CHECK(server::check_memory_fd(null.get()).error().errnum() == EINVAL);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  UniqueFd r(p[0]), w(p[1]);
  CHECK(server::check_memory_fd(r.get()).error().errnum() == EINVAL);
}
