// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, the rank's store of named objects (STORE_* messages, object_store.h): written in ranges
// that become current all at once, read back verified, kept across a daemon restart, gone with the
// rank, counted against the user's chunks, and apart from the rank's pauses. A real daemon on a temp
// socket and temp roots, driven by a client that plays the shim's role.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "daemon_fixture.h"
#include "in_process_daemon.h"
#include "other_user.h"
#include "pattern.h"
#include "test_support.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;

namespace {

Result<uint64_t> open_object(ShimClient& c, const std::string& name, uint64_t size) {
  auto r = c.call(proto::StoreOpen{.name = name, .size = size});
  if (!r) return std::move(r).error();
  const auto* opened = std::get_if<proto::StoreOpened>(&*r);
  if (!opened) return make_error(EPROTO, "not STORE_OPENED");
  return opened->handle;
}

// Writes the chunks of [offset, offset + bytes) of object `handle` with pattern `id` through slot 0,
// one after another, without committing.
Status write_chunks(ShimClient& c, uint64_t handle, uint64_t offset, uint64_t bytes, uint64_t id) {
  const uint64_t chunk = c.welcome().chunk_bytes;
  for (uint64_t at = 0; at < bytes; at += chunk) {
    const uint32_t len = static_cast<uint32_t>(std::min(chunk, bytes - at));
    fill_pattern(id, at, c.slot(0), len);
    proto::StoreWrite w;
    w.slot = 0;
    w.length = len;
    w.blob = handle;
    w.offset = offset + at;
    auto r = c.call(w);
    if (!r) return std::move(r).error();
    if (!std::holds_alternative<proto::Written>(*r)) return make_error(EPROTO, "not WRITTEN");
  }
  return {};
}

Status commit(ShimClient& c, uint64_t handle, uint64_t offset, uint64_t bytes, uint8_t flags = 0) {
  auto r = c.call(proto::StoreCommit{.handle = handle, .offset = offset, .length = bytes, .flags = flags});
  if (!r) return std::move(r).error();
  return {};
}

// Reads [offset, offset + bytes) back through slot 1 and compares it with pattern `id`: the offset
// of the first byte that differs (-1: none), or the daemon's refusal.
Result<int64_t> read_and_compare(ShimClient& c, uint64_t handle, uint64_t offset, uint64_t bytes, uint64_t id) {
  const uint64_t chunk = c.welcome().chunk_bytes;
  for (uint64_t at = 0; at < bytes; at += chunk) {
    const uint32_t len = static_cast<uint32_t>(std::min(chunk, bytes - at));
    std::memset(c.slot(1), 0xEE, len);  // a READ answered without its bytes shows
    proto::StoreRead rd;
    rd.slot = 1;
    rd.length = len;
    rd.blob = handle;
    rd.offset = offset + at;
    auto r = c.call(rd);
    if (!r) return std::move(r).error();
    if (!std::holds_alternative<proto::ReadDone>(*r)) return make_error(EPROTO, "not READ_DONE");
    if (int64_t bad = find_mismatch(id, at, c.slot(1), len); bad >= 0) return static_cast<int64_t>(at) + bad;
  }
  return int64_t{-1};
}

}  // namespace

TEST_CASE("objects: a range written and committed reads back verified, and an object is named once at one size") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "objects", .rank = 0});
  const uint64_t chunk = c.welcome().chunk_bytes;
  const uint64_t size = 3 * chunk + 4096;  // a short last chunk
  auto h = open_object(c, "adam.b0", size);
  REQUIRE(h);
  auto again = open_object(c, "adam.b0", size);
  REQUIRE(again);
  CHECK(*again == *h);
  auto other_size = open_object(c, "adam.b0", size + 1);
  REQUIRE_FALSE(other_size);
  CHECK(other_size.error().errnum() == EEXIST);

  // Nothing written yet: nothing to verify against.
  auto unwritten = read_and_compare(c, *h, 0, chunk, 1);
  REQUIRE_FALSE(unwritten);
  CHECK(unwritten.error().errnum() == ENODATA);

  REQUIRE(write_chunks(c, *h, 0, size, 1));
  REQUIRE(commit(c, *h, 0, size));
  auto back = read_and_compare(c, *h, 0, size, 1);
  REQUIRE(back);
  CHECK(*back == -1);
  // `tmsctl status` counts the object and the disk it takes, apart from the pause store's bytes.
  const auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].objects == 1);
  CHECK(listed[0].object_bytes >= size);
  CHECK(listed[0].disk_bytes == 0);

  // A range of the object alone: its second chunk, rewritten.
  REQUIRE(write_chunks(c, *h, chunk, chunk, 2));
  REQUIRE(commit(c, *h, chunk, chunk));
  auto first = read_and_compare(c, *h, 0, chunk, 1);
  auto second = read_and_compare(c, *h, chunk, chunk, 2);
  REQUIRE(first);
  REQUIRE(second);
  CHECK(*first == -1);
  CHECK(*second == -1);

  // A commit of a range with a chunk never written since its last commit changes nothing.
  REQUIRE(write_chunks(c, *h, 0, chunk, 3));
  auto partial = commit(c, *h, 0, 2 * chunk);
  REQUIRE_FALSE(partial);
  CHECK(partial.error().errnum() == EINVAL);
  auto unchanged = read_and_compare(c, *h, 0, chunk, 1);
  REQUIRE(unchanged);
  CHECK(*unchanged == -1);

  CHECK(c.call(proto::StoreRemove{.name = "adam.b0"}));
  auto gone = c.call(proto::StoreRemove{.name = "adam.b0"});
  REQUIRE_FALSE(gone);
  CHECK(gone.error().errnum() == ENOENT);
}

TEST_CASE("objects: a write cut short by a daemon killed before its commit leaves the previous version readable") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "objects", .rank = 1});
  const uint64_t token = c.welcome().token;
  const uint64_t chunk = c.welcome().chunk_bytes;
  const uint64_t size = 4 * chunk;
  auto h = open_object(c, "moments", size);
  REQUIRE(h);
  REQUIRE(write_chunks(c, *h, 0, size, 7));
  REQUIRE(commit(c, *h, 0, size));
  // The next version: half of it written (sealed, on disk), never committed.
  REQUIRE(write_chunks(c, *h, 0, 2 * chunk, 8));
  d.proc.kill9();
  c.close();

  d.start();
  auto back = d.shim({.job = "objects", .rank = 1, .token = token});
  auto h2 = open_object(back, "moments", size);
  REQUIRE(h2);
  auto read = read_and_compare(back, *h2, 0, size, 7);
  INFO((read ? "" : read.error().describe()));
  REQUIRE(read);
  CHECK(*read == -1);
}

TEST_CASE("objects: a flipped byte in the objects file is caught when read") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "objects", .rank = 2});
  const uint64_t chunk = c.welcome().chunk_bytes;
  auto h = open_object(c, "masters", chunk);
  REQUIRE(h);
  REQUIRE(write_chunks(c, *h, 0, chunk, 5));
  REQUIRE(commit(c, *h, 0, chunk));
  const std::string file = d.rank_dir(0, "objects", 2, ::getpid()) + "/objects";
  REQUIRE(fs::exists(file));
  {
    // The chunk is the file's only data: flip a byte of every block that holds any.
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(f);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    bool flipped = false;
    for (std::size_t at = 0; at + 1 < bytes.size(); at += 4096) {
      if (std::all_of(bytes.begin() + at, bytes.begin() + std::min(bytes.size(), at + 4096),
                      [](char b) { return b == 0; }))
        continue;
      f.seekp(static_cast<std::streamoff>(at + 17));
      const char b = static_cast<char>(bytes[at + 17] ^ 0x40);
      f.write(&b, 1);
      flipped = true;
    }
    REQUIRE(flipped);
  }
  auto read = read_and_compare(c, *h, 0, chunk, 5);
  REQUIRE_FALSE(read);
  CHECK(read.error().errnum() == EBADMSG);
}

TEST_CASE("objects: a pause neither moves nor drops the rank's objects, and they go when the rank exits") {
  Daemon d;
  d.start();
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    auto c = ShimClient::connect(d.socket, {.job = "objects", .rank = 3});
    if (!c) ::_exit(10);
    const uint64_t chunk = c->welcome().chunk_bytes;
    auto h = open_object(*c, "state", 2 * chunk);
    if (!h || !write_chunks(*c, *h, 0, 2 * chunk, 9) || !commit(*c, *h, 0, 2 * chunk)) ::_exit(11);
    // A pause and a resume of its memory: the objects are neither part of it nor touched by it.
    const std::vector<proto::BlobSize> blobs = {{1, chunk}};
    if (!c->reserve(blobs) || !c->write_all(blobs, fill_pattern)) ::_exit(12);
    if (!c->commit(proto::CommitState::Paused)) ::_exit(13);
    if (!c->read_all(blobs, [](uint64_t id, uint64_t off, const uint8_t* p, uint32_t n) {
          return find_mismatch(id, off, p, n) < 0;
        }))
      ::_exit(14);
    if (!c->commit(proto::CommitState::Resumed)) ::_exit(15);
    auto read = read_and_compare(*c, *h, 0, 2 * chunk, 9);
    if (!read || *read != -1) ::_exit(16);
    // A new set without the object's handle as a blob: the pause store's set is its own.
    if (!c->reserve({{2, chunk}})) ::_exit(17);
    read = read_and_compare(*c, *h, 0, 2 * chunk, 9);
    if (!read || *read != -1) ::_exit(18);
    const char one = 1;
    if (::write(ready[1], &one, 1) != 1) ::_exit(19);
    ::_exit(0);
  }
  ::close(ready[1]);
  char one = 0;
  CHECK(::read(ready[0], &one, 1) == 1);
  ::close(ready[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The rank exited: its directory, objects included, goes with its session.
  const std::string dir = d.rank_dir(0, "objects", 3, child);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("objects: a user's objects count against max-chunks-per-uid, refused before any byte moves") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  // Each object counts its chunks and storage::kObjectOverheadChunks (16) for its records.
  d.start({"--max-chunks-per-uid", "40"});
  CHECK(as_other_user([&] {
          auto c = ShimClient::connect(d.socket, {.job = "objects", .rank = 4});
          if (!c) return c.error().errnum() == EACCES ? kUnreachable : 11;
          const uint64_t chunk = c->welcome().chunk_bytes;
          if (!open_object(*c, "a", 6 * chunk)) return 12;  // 22 of 40
          auto refused = open_object(*c, "b", 3 * chunk);   // 19 more
          if (refused || refused.error().errnum() != EDQUOT) return 13;
          if (refused.error().message.find("max-chunks-per-uid") == std::string::npos) return 14;
          // ... and the objects count against a pause's reservation too.
          auto reserve = c->reserve({{1, 19 * chunk}});
          if (reserve || reserve.error().errnum() != EDQUOT) return 15;
          if (!open_object(*c, "b", 2 * chunk)) return 16;  // 18 more: 40 of 40
          return 0;
        }) == 0);
}

TEST_CASE("objects: a commit's flushes run off the event loop; a failed one leaves the previous version current") {
  // The engine's fault hook fails the Sync (fdatasync) numbered `fail_sync`: a commit flushes the data
  // file (one root), then the objects log.
  std::atomic<int> syncs{0}, fail_sync{0};
  FaultyDaemon d([&](const io::Request& r, int raw) {
    if (r.op != io::Op::Sync) return raw;
    return ++syncs == fail_sync.load() ? -EIO : raw;
  });
  auto c = ShimClient::connect(d.socket, {.job = "flush", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(c);
  const uint64_t size = 2 * 4 * MiB;
  auto h = open_object(*c, "adam.b0", size);
  REQUIRE(h);
  auto current_is = [&](uint64_t id) {
    auto back = read_and_compare(*c, *h, 0, size, id);
    INFO((back ? "" : back.error().describe()));
    REQUIRE(back);
    CHECK(*back == -1);
  };
  REQUIRE(write_chunks(*c, *h, 0, size, 1));
  REQUIRE(commit(*c, *h, 0, size));
  CHECK(syncs == 2);  // the data file's, then the log's
  current_is(1);

  // The data file's flush fails: nothing recorded, version 2 stays pending and a second commit takes it.
  REQUIRE(write_chunks(*c, *h, 0, size, 2));
  fail_sync = syncs + 1;
  auto refused = commit(*c, *h, 0, size);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EIO);
  CHECK_THAT(refused.error().message, Catch::Contains("cannot flush"));
  current_is(1);
  REQUIRE(commit(*c, *h, 0, size));
  current_is(2);

  // The log's flush fails: the record is cut off, version 2 stays current, and the log is written no
  // more (whether the record reached the disk is unknown); reads go on.
  REQUIRE(write_chunks(*c, *h, 0, size, 3));
  fail_sync = syncs + 2;
  auto lost = commit(*c, *h, 0, size);
  REQUIRE_FALSE(lost);
  CHECK(lost.error().errnum() == EIO);
  current_is(2);
  REQUIRE(write_chunks(*c, *h, 0, size, 4));
  auto after = commit(*c, *h, 0, size);
  REQUIRE_FALSE(after);
  CHECK(after.error().errnum() == EIO);
  current_is(2);
}
