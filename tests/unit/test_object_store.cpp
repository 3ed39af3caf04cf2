// SPDX-License-Identifier: Apache-2.0
// The object store (object_store.h): objects and their handles, ranges written copy on write and
// committed whole, reads verified against the seals, the log replayed after a restart (a torn tail
// dropped), removal, symbolic links refused, chunks striped over roots, the log compacted. Every chunk
// is moved with real I/O to the extents the store names, as the daemon's I/O engine moves it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "object_store.h"
#include "storage.h"
#include "temp_dir.h"
#include "tmsdisk/common/unique_fd.h"

using namespace tmsdisk;
using namespace tmsdisk::storage;
using tmsdisk::testing::TempDir;

namespace {

constexpr uint32_t kChunkSize = 64 * 1024;

#define REQUIRE_OK(expr)                                          \
  do {                                                            \
    auto&& result_ = (expr);                                      \
    INFO((result_ ? std::string() : result_.error().describe())); \
    REQUIRE(result_);                                             \
  } while (0)

// A rank directory on each of `roots` temp roots, as tmsdiskd makes them, and the store opened on them.
struct Rank {
  TempDir tmp;
  std::vector<std::string> root_paths;
  Roots roots;
  std::vector<UniqueFd> dir_fds;  // O_PATH, as the server holds them
  std::vector<int> dirs;
  std::vector<std::string> warnings;

  explicit Rank(std::size_t n = 1) {
    for (std::size_t i = 0; i < n; ++i) {
      root_paths.push_back(tmp / ("root" + std::to_string(i)));
      REQUIRE(::mkdir(root_paths.back().c_str(), 0755) == 0);
      REQUIRE(::mkdir(dir(i).c_str(), 0700) == 0);
      dir_fds.emplace_back(::open(dir(i).c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
      REQUIRE(dir_fds.back());
      dirs.push_back(dir_fds.back().get());
    }
    // The store does not care what a root is on; the tests run wherever the temp directory is.
    auto r = Roots::open(root_paths, true);
    REQUIRE_OK(r);
    roots = std::move(r).value();
  }
  std::string dir(std::size_t i = 0) const { return root_paths[i] + "/rank"; }
  std::string log_path() const { return dir(0) + "/objects.log"; }
  std::string data_path(std::size_t i = 0) const { return dir(i) + "/objects"; }

  Result<std::unique_ptr<ObjectStore>> try_open(uint32_t chunk = kChunkSize) {
    return ObjectStore::open(roots, dirs, RankFileNames{}, chunk,
                             [this](const std::string& w) { warnings.push_back(w); });
  }
  std::unique_ptr<ObjectStore> open(uint32_t chunk = kChunkSize) {
    auto s = try_open(chunk);
    REQUIRE_OK(s);
    return std::move(s).value();
  }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

uint64_t file_size(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return static_cast<uint64_t>(st.st_size);
}

uint64_t allocated_bytes(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

// `len` bytes that differ from chunk to chunk and version to version.
std::vector<uint8_t> pattern(uint32_t len, uint32_t seed) {
  std::vector<uint8_t> out(len);
  for (uint32_t i = 0; i < len; ++i) out[i] = static_cast<uint8_t>((i * 131 + seed * 7919 + (i >> 12)) & 0xff);
  return out;
}

uint32_t length_at(uint64_t size, uint64_t offset, uint32_t chunk = kChunkSize) {
  return static_cast<uint32_t>(std::min<uint64_t>(chunk, size - offset));
}

// A buffer O_DIRECT can move: aligned, io_length long, zero past the chunk's bytes.
struct IoBuffer {
  explicit IoBuffer(uint32_t io_length)
      : bytes(static_cast<uint8_t*>(std::aligned_alloc(kIoAlignment, io_length)), &std::free), length(io_length) {
    REQUIRE(bytes);
    std::memset(bytes.get(), 0, io_length);
  }
  std::unique_ptr<uint8_t, decltype(&std::free)> bytes;
  uint32_t length;
};

// A WRITE as the daemon makes it: open_write(), the bytes to where locate_write() says, the hash a
// hash worker takes (settle_write()), end_write() once they are on disk. The file offset written.
uint64_t write_chunk(ObjectStore& s, uint64_t handle, uint64_t offset, std::span<const uint8_t> bytes) {
  const auto len = static_cast<uint32_t>(bytes.size());
  auto ticket = s.open_write(handle, offset, len);
  REQUIRE_OK(ticket);
  auto loc = s.locate_write(handle, offset, len);
  REQUIRE_OK(loc);
  REQUIRE(loc->io_length == (len + kIoAlignment - 1) / kIoAlignment * kIoAlignment);
  // The file is what the Location says: O_DIRECT (where the filesystem takes it), so that this I/O
  // meets its alignment as the engine's does.
  CHECK(((::fcntl(loc->fd, F_GETFL) & O_DIRECT) != 0) == loc->direct_io);
  IoBuffer buf(loc->io_length);
  std::copy(bytes.begin(), bytes.end(), buf.bytes.get());
  REQUIRE(::pwrite(loc->fd, buf.bytes.get(), buf.length, static_cast<off_t>(loc->file_offset)) ==
          static_cast<ssize_t>(buf.length));
  auto plan = s.settle_write(handle, offset, len, *ticket, RankStore::hash_chunk(ticket->xxh64, bytes));
  REQUIRE_OK(plan);
  REQUIRE_FALSE(plan->unchanged);
  REQUIRE_OK(s.end_write(handle, offset, len, plan->sum));
  return loc->file_offset;
}

// Every chunk of [0, size) of `handle` written with pattern(seed + chunk index).
void write_range(ObjectStore& s, uint64_t handle, uint64_t size, uint32_t seed, uint32_t chunk = kChunkSize) {
  for (uint64_t off = 0; off < size; off += chunk)
    write_chunk(s, handle, off, pattern(length_at(size, off, chunk), seed + static_cast<uint32_t>(off / chunk)));
}

// A READ as the daemon makes it: open_read(), the bytes from where locate_read() says, then
// settle_read() with their hash. The bytes, or why the READ is refused.
Result<std::vector<uint8_t>> read_chunk(ObjectStore& s, uint64_t handle, uint64_t offset, uint32_t len) {
  auto ticket = s.open_read(handle, offset, len);
  if (!ticket) return std::move(ticket).error();
  auto loc = s.locate_read(handle, offset, len);
  REQUIRE_OK(loc);
  IoBuffer buf(loc->io_length);
  REQUIRE(::pread(loc->fd, buf.bytes.get(), buf.length, static_cast<off_t>(loc->file_offset)) ==
          static_cast<ssize_t>(buf.length));
  std::vector<uint8_t> bytes(buf.bytes.get(), buf.bytes.get() + len);
  auto verified = s.settle_read(handle, offset, len, RankStore::hash_chunk(ticket->xxh64, bytes));
  if (!verified) return std::move(verified).error();
  return bytes;
}

// True when every chunk of [0, size) of `handle` reads back verified as write_range(seed) wrote it.
bool reads_back(ObjectStore& s, uint64_t handle, uint64_t size, uint32_t seed, uint32_t chunk = kChunkSize) {
  for (uint64_t off = 0; off < size; off += chunk) {
    const uint32_t len = length_at(size, off, chunk);
    auto got = read_chunk(s, handle, off, len);
    INFO("offset " << off << ": " << (got ? std::string("read") : got.error().describe()));
    if (!got || *got != pattern(len, seed + static_cast<uint32_t>(off / chunk))) return false;
  }
  return true;
}

// Object `name` of `size` bytes, every chunk written (write_range(seed)) and committed: its handle.
uint64_t committed_object(ObjectStore& s, const std::string& name, uint64_t size, uint32_t seed,
                          uint32_t chunk = kChunkSize) {
  auto h = s.open_object(name, size);
  REQUIRE_OK(h);
  write_range(s, *h, size, seed, chunk);
  REQUIRE_OK(s.commit_range(*h, 0, size));
  return *h;
}

int errnum_of(const Status& st) {
  return st ? 0 : st.error().errnum();
}
template <class T>
int errnum_of(const Result<T>& r) {
  return r ? 0 : r.error().errnum();
}

}  // namespace

TEST_CASE("open_object: the same name and size give the same handle, another size EEXIST, bad names EINVAL") {
  Rank rank;
  auto s = rank.open();
  auto h = s->open_object("g0.b3.exp_avg", 3 * kChunkSize);
  REQUIRE_OK(h);
  CHECK(*h != 0);
  auto again = s->open_object("g0.b3.exp_avg", 3 * kChunkSize);
  REQUIRE_OK(again);
  CHECK(*again == *h);
  CHECK(errnum_of(s->open_object("g0.b3.exp_avg", 2 * kChunkSize)) == EEXIST);

  for (std::string_view bad : {std::string_view(""), std::string_view("."), std::string_view(".."),
                               std::string_view("a/b"), std::string_view("../x"), std::string_view("a b"),
                               std::string_view("caf\xc3\xa9"), std::string_view("a\0b", 3)}) {
    INFO("name \"" << bad << "\"");
    CHECK(errnum_of(s->open_object(bad, kChunkSize)) == EINVAL);
  }
  CHECK(errnum_of(s->open_object(std::string(kMaxObjectName + 1, 'x'), kChunkSize)) == EINVAL);
  CHECK(errnum_of(s->open_object("empty", 0)) == EINVAL);

  auto longest = s->open_object(std::string(kMaxObjectName, 'x'), 1);
  REQUIRE_OK(longest);
  CHECK(*longest != *h);
  CHECK(s->object_count() == 2);
  CHECK(s->chunk_count() == 4 + 2 * kObjectOverheadChunks);  // the records' cost of each object too
  CHECK(s->disk_bytes() == 0);
  const auto objects = s->list();
  REQUIRE(objects.size() == 2);
  CHECK(objects[0].name == "g0.b3.exp_avg");
  CHECK(objects[0].size == 3 * kChunkSize);
  CHECK(objects[0].committed_bytes == 0);
}

TEST_CASE("a range written and committed reads back verified; before its commit it reads ENODATA") {
  Rank rank;
  auto s = rank.open();
  const uint64_t size = 2 * kChunkSize + 5000;  // the last chunk short: its I/O is rounded up
  auto h = s->open_object("state", size);
  REQUIRE_OK(h);
  write_range(*s, *h, size, 10);
  CHECK(errnum_of(read_chunk(*s, *h, 0, kChunkSize)) == ENODATA);
  CHECK(s->disk_bytes() == 2 * kChunkSize + kIoAlignment * 2);

  // A range must end at a chunk's end or the object's.
  CHECK(errnum_of(s->commit_range(*h, 0, kChunkSize + 1)) == EINVAL);
  CHECK(errnum_of(s->commit_range(*h, 0, 0)) == EINVAL);
  CHECK(errnum_of(s->commit_range(*h, 0, size + 1)) == EINVAL);
  CHECK(errnum_of(s->commit_range(*h + 100, 0, size)) == ENOENT);
  REQUIRE_OK(s->commit_range(*h, 0, size));
  CHECK(reads_back(*s, *h, size, 10));
  auto loc = s->locate_read(*h, 0, kChunkSize);
  REQUIRE_OK(loc);
  CHECK(loc->direct_io == rank.roots[0].direct_io);
  CHECK(loc->in_memory == rank.roots[0].in_memory);
  CHECK(s->list().at(0).committed_bytes == size);
  // A chunk of the wrong length, or at an offset inside a chunk, names nothing.
  CHECK(errnum_of(s->open_read(*h, 0, kChunkSize - 1)) == EINVAL);
  CHECK(errnum_of(s->open_read(*h, 4096, kChunkSize)) == EINVAL);
  CHECK(errnum_of(s->open_write(*h, size, 1)) == EINVAL);
}

TEST_CASE("a range written and not committed leaves the committed version readable, in other extents") {
  Rank rank;
  auto s = rank.open();
  const uint64_t size = 2 * kChunkSize;
  const uint64_t h = committed_object(*s, "state", size, 1);
  std::vector<uint64_t> v1_offsets;
  for (uint64_t off = 0; off < size; off += kChunkSize) {
    auto loc = s->locate_read(h, off, kChunkSize);
    REQUIRE_OK(loc);
    v1_offsets.push_back(loc->file_offset);
  }

  std::vector<uint64_t> v2_offsets;
  for (uint64_t off = 0; off < size; off += kChunkSize)
    v2_offsets.push_back(write_chunk(*s, h, off, pattern(kChunkSize, 2 + static_cast<uint32_t>(off / kChunkSize))));
  for (uint64_t v2 : v2_offsets) CHECK(std::find(v1_offsets.begin(), v1_offsets.end(), v2) == v1_offsets.end());
  CHECK(reads_back(*s, h, size, 1));
  CHECK(s->disk_bytes() == 4 * kChunkSize);
  // Written again before the commit: the same pending extent, not a third one.
  CHECK(write_chunk(*s, h, 0, pattern(kChunkSize, 2)) == v2_offsets[0]);
  CHECK(s->disk_bytes() == 4 * kChunkSize);

  REQUIRE_OK(s->commit_range(h, 0, size));
  CHECK(reads_back(*s, h, size, 2));
  CHECK(s->disk_bytes() == 2 * kChunkSize);                       // the old versions' extents are free
  CHECK(errnum_of(s->locate_write(h, 0, kChunkSize)) == EINVAL);  // no WRITE open after the commit
}

TEST_CASE("discard frees the written chunks and keeps the committed version") {
  Rank rank;
  auto s = rank.open();
  const uint64_t size = 3 * kChunkSize;
  const uint64_t h = committed_object(*s, "state", size, 1);
  write_range(*s, h, size, 50);
  CHECK(s->disk_bytes() == 6 * kChunkSize);

  REQUIRE_OK(s->discard_range(h, kChunkSize, kChunkSize));
  CHECK(s->disk_bytes() == 5 * kChunkSize);
  CHECK(errnum_of(s->locate_write(h, kChunkSize, kChunkSize)) == EINVAL);
  CHECK(errnum_of(s->end_write(h, kChunkSize, kChunkSize, {})) == EINVAL);
  CHECK(errnum_of(s->commit_range(h, 0, size)) == EINVAL);
  CHECK(errnum_of(s->discard_range(h, 0, kChunkSize + 1)) == EINVAL);

  s->discard_all();
  CHECK(s->disk_bytes() == 3 * kChunkSize);
  CHECK(reads_back(*s, h, size, 1));
  // The space freed is what the next WRITE takes: the file does not grow.
  const uint64_t before = file_size(rank.data_path());
  write_range(*s, h, size, 60);
  CHECK(file_size(rank.data_path()) == before);
}

TEST_CASE("a commit with a chunk not written is EINVAL, names the chunk and changes nothing") {
  Rank rank;
  auto s = rank.open();
  const uint64_t size = 3 * kChunkSize;
  const uint64_t h = committed_object(*s, "state", size, 1);
  const uint64_t log_before = file_size(rank.log_path());

  write_chunk(*s, h, 0, pattern(kChunkSize, 100));
  write_chunk(*s, h, 2 * kChunkSize, pattern(kChunkSize, 102));
  auto missing = s->commit_range(h, 0, size);
  REQUIRE_FALSE(missing);
  CHECK(missing.error().errnum() == EINVAL);
  CHECK_THAT(missing.error().describe(), Catch::Contains("offset 65536"));
  // Opened and not ended is not written either, and no second WRITE of the chunk opens meanwhile: the
  // two would share one extent, and whichever ended last would seal the other's bytes.
  REQUIRE_OK(s->open_write(h, kChunkSize, kChunkSize));
  CHECK(errnum_of(s->commit_range(h, 0, size)) == EINVAL);
  CHECK(errnum_of(s->open_write(h, kChunkSize, kChunkSize)) == EBUSY);
  CHECK(file_size(rank.log_path()) == log_before);
  CHECK(reads_back(*s, h, size, 1));
  REQUIRE_OK(s->discard_range(h, kChunkSize, kChunkSize));  // the unfinished WRITE's version goes

  // A range that was written whole commits, and another part of the object stays as it was.
  REQUIRE_OK(s->commit_range(h, 2 * kChunkSize, kChunkSize));
  auto third = read_chunk(*s, h, 2 * kChunkSize, kChunkSize);
  REQUIRE_OK(third);
  CHECK(*third == pattern(kChunkSize, 102));
  write_chunk(*s, h, kChunkSize, pattern(kChunkSize, 101));
  REQUIRE_OK(s->commit_range(h, 0, 2 * kChunkSize));
  CHECK(reads_back(*s, h, size, 100));
}

TEST_CASE("a restart finds the objects, their handles and committed data; what was not committed is gone") {
  Rank rank;
  uint64_t a = 0, b = 0, removed = 0;
  const uint64_t size_a = 3 * kChunkSize, size_b = kChunkSize + 4096;
  {
    auto s = rank.open();
    a = committed_object(*s, "a", size_a, 1);
    b = committed_object(*s, "b", size_b, 7);
    removed = s->open_object("gone", kChunkSize).value();
    write_range(*s, a, size_a, 20);                 // never committed
    REQUIRE_OK(s->commit_range(a, 0, kChunkSize));  // but its first chunk is
    REQUIRE_OK(s->remove_object("gone"));
  }  // the daemon stops, leaving every file
  auto s = rank.open();
  CHECK(rank.warnings.empty());
  const auto objects = s->list();
  REQUIRE(objects.size() == 2);
  CHECK((objects[0].handle == a && objects[0].name == "a" && objects[0].size == size_a));
  CHECK(objects[0].committed_bytes == size_a);
  CHECK((objects[1].handle == b && objects[1].name == "b" && objects[1].size == size_b));
  auto first = read_chunk(*s, a, 0, kChunkSize);
  REQUIRE_OK(first);
  CHECK(*first == pattern(kChunkSize, 20));
  for (uint64_t off = kChunkSize; off < size_a; off += kChunkSize) {
    auto got = read_chunk(*s, a, off, kChunkSize);
    REQUIRE_OK(got);
    CHECK(*got == pattern(kChunkSize, 1 + static_cast<uint32_t>(off / kChunkSize)));
  }
  CHECK(reads_back(*s, b, size_b, 7));
  CHECK(s->disk_bytes() == size_a + size_b);  // committed versions only
  // The same name and size is the same object; a new one never takes a handle given before.
  CHECK(s->open_object("a", size_a).value() == a);
  auto fresh = s->open_object("new", kChunkSize);
  REQUIRE_OK(fresh);
  CHECK(*fresh > removed);
  // Written again after the restart, it takes free space, never a committed extent.
  write_range(*s, a, size_a, 30);
  REQUIRE_OK(s->commit_range(a, 0, size_a));
  CHECK(reads_back(*s, a, size_a, 30));
  CHECK(reads_back(*s, b, size_b, 7));
}

TEST_CASE("a torn or corrupt last record of the log is dropped and the records before it kept") {
  Rank rank;
  const uint64_t size = 2 * kChunkSize;
  uint64_t h = 0;
  {
    auto s = rank.open();
    h = committed_object(*s, "state", size, 1);
    write_range(*s, h, size, 2);
    REQUIRE_OK(s->commit_range(h, 0, size));
  }
  const uint64_t whole = file_size(rank.log_path());
  uint32_t expected = 2;
  SECTION("the last record cut short") {
    REQUIRE(::truncate(rank.log_path().c_str(), static_cast<off_t>(whole - 5)) == 0);
    expected = 1;
  }
  SECTION("a byte of the last record flipped") {
    UniqueFd fd(::open(rank.log_path().c_str(), O_RDWR | O_CLOEXEC));
    REQUIRE(fd);
    uint8_t byte = 0;
    REQUIRE(::pread(fd.get(), &byte, 1, static_cast<off_t>(whole - 20)) == 1);
    byte ^= 0x40;
    REQUIRE(::pwrite(fd.get(), &byte, 1, static_cast<off_t>(whole - 20)) == 1);
    expected = 1;
  }
  SECTION("garbage after the last record") {
    UniqueFd fd(::open(rank.log_path().c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
    REQUIRE(fd);
    const std::string garbage("\x30\x00\x00\x00garbage that is no record", 29);
    REQUIRE(::write(fd.get(), garbage.data(), garbage.size()) == static_cast<ssize_t>(garbage.size()));
  }
  {
    auto s = rank.open();
    CHECK(rank.warnings.size() == 1);
    CHECK(s->list().size() == 1);
    CHECK(reads_back(*s, h, size, expected));
    // The log was mended: what is committed now follows a whole record and outlives a restart.
    write_range(*s, h, size, 3);
    REQUIRE_OK(s->commit_range(h, 0, size));
  }
  rank.warnings.clear();
  auto s = rank.open();
  CHECK(rank.warnings.empty());
  CHECK(reads_back(*s, h, size, 3));
}

TEST_CASE("a byte flipped in a committed extent fails settle_read with EBADMSG") {
  Rank rank;
  auto s = rank.open();
  const uint64_t h = committed_object(*s, "state", 2 * kChunkSize, 1);
  auto loc = s->locate_read(h, kChunkSize, kChunkSize);
  REQUIRE_OK(loc);
  {
    UniqueFd fd(::open(rank.data_path().c_str(), O_RDWR | O_CLOEXEC));
    REQUIRE(fd);
    const auto at = static_cast<off_t>(loc->file_offset + 100);
    uint8_t byte = 0;
    REQUIRE(::pread(fd.get(), &byte, 1, at) == 1);
    byte ^= 0x01;
    REQUIRE(::pwrite(fd.get(), &byte, 1, at) == 1);
    REQUIRE(::fsync(fd.get()) == 0);
  }
  CHECK(errnum_of(read_chunk(*s, h, kChunkSize, kChunkSize)) == EBADMSG);
  auto intact = read_chunk(*s, h, 0, kChunkSize);
  REQUIRE_OK(intact);
  CHECK(*intact == pattern(kChunkSize, 1));
}

TEST_CASE("remove_object frees its extents; its name and handle are gone, across a restart too") {
  Rank rank;
  auto s = rank.open();
  const uint64_t big = 8 * kChunkSize, small = 2 * kChunkSize;
  const uint64_t b = committed_object(*s, "small", small, 5);
  const uint64_t a = committed_object(*s, "big", big, 1);
  write_range(*s, a, 2 * kChunkSize, 9);  // pending chunks go too
  CHECK(s->disk_bytes() == big + small + 2 * kChunkSize);
  const uint64_t allocated = allocated_bytes(rank.data_path());

  REQUIRE_OK(s->remove_object("big"));
  CHECK(s->disk_bytes() == small);
  CHECK(allocated_bytes(rank.data_path()) < allocated);  // given back to the filesystem
  CHECK(errnum_of(s->remove_object("big")) == ENOENT);
  CHECK(errnum_of(s->open_read(a, 0, kChunkSize)) == ENOENT);
  CHECK(errnum_of(s->open_write(a, 0, kChunkSize)) == ENOENT);
  CHECK(errnum_of(s->commit_range(a, 0, kChunkSize)) == ENOENT);
  CHECK(s->object_count() == 1);
  CHECK(reads_back(*s, b, small, 5));
  s.reset();

  s = rank.open();
  CHECK(s->object_count() == 1);
  CHECK(errnum_of(s->open_read(a, 0, kChunkSize)) == ENOENT);
  CHECK(reads_back(*s, b, small, 5));
  CHECK(s->disk_bytes() == small);
}

TEST_CASE("a symbolic link in place of objects.log or objects is refused, never followed") {
  Rank rank;
  const std::string target = rank.tmp / "precious";
  std::ofstream(target, std::ios::binary) << "precious bytes";
  std::string planted;
  SECTION("objects.log, on a new store") {
    planted = rank.log_path();
  }
  SECTION("objects, on a new store") {
    planted = rank.data_path();
  }
  SECTION("objects.log, after a restart") {
    {
      auto s = rank.open();
      REQUIRE_OK(s->open_object("state", kChunkSize));
    }
    REQUIRE(::unlink(rank.log_path().c_str()) == 0);
    planted = rank.log_path();
  }
  REQUIRE(::symlink(target.c_str(), planted.c_str()) == 0);
  auto s = rank.try_open();
  REQUIRE_FALSE(s);
  CHECK(s.error().errnum() == ELOOP);
  CHECK(read_text(target) == "precious bytes");
  struct stat st {};
  REQUIRE(::lstat(planted.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
}

TEST_CASE("two roots stripe the chunks: chunk i on root i % 2") {
  Rank rank(2);
  const uint64_t size = 5 * kChunkSize;
  uint64_t h = 0;
  {
    auto s = rank.open();
    h = committed_object(*s, "state", size, 3);
    struct stat files[2]{};
    REQUIRE(::stat(rank.data_path(0).c_str(), &files[0]) == 0);
    REQUIRE(::stat(rank.data_path(1).c_str(), &files[1]) == 0);
    for (uint64_t ci = 0; ci < 5; ++ci) {
      auto loc = s->locate_read(h, ci * kChunkSize, kChunkSize);
      REQUIRE_OK(loc);
      struct stat st {};
      REQUIRE(::fstat(loc->fd, &st) == 0);
      INFO("chunk " << ci);
      CHECK(st.st_ino == files[ci % 2].st_ino);
    }
    CHECK(file_size(rank.data_path(0)) == 3 * kChunkSize);
    CHECK(file_size(rank.data_path(1)) == 2 * kChunkSize);
  }
  auto s = rank.open();
  CHECK(reads_back(*s, h, size, 3));

  // The log records the roots it was written over: the same directories as one root are refused.
  s.reset();
  auto one = Roots::open({rank.root_paths[0]}, true);
  REQUIRE_OK(one);
  const std::vector<int> first{rank.dirs[0]};
  const uint64_t log_size = file_size(rank.log_path());
  auto refused = ObjectStore::open(*one, first, RankFileNames{}, kChunkSize);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EINVAL);
  CHECK(file_size(rank.log_path()) == log_size);
  // Nor may two roots be given one rank directory: they would share one objects file.
  const std::vector<int> twice{rank.dirs[0], rank.dirs[0]};
  CHECK(errnum_of(ObjectStore::open(rank.roots, twice, RankFileNames{}, kChunkSize)) == EINVAL);
}

TEST_CASE("a log of another chunk size is refused, its files left as they are") {
  Rank rank;
  {
    auto s = rank.open();
    committed_object(*s, "state", kChunkSize, 1);
  }
  const std::string log = read_text(rank.log_path());
  const uint64_t data = file_size(rank.data_path());
  auto refused = rank.try_open(2 * kChunkSize);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EINVAL);
  CHECK(read_text(rank.log_path()) == log);
  CHECK(file_size(rank.data_path()) == data);
}

TEST_CASE("the log is compacted: many commits do not grow it without bound") {
  Rank rank;
  constexpr uint32_t kSmall = kIoAlignment;  // small chunks: many commits stay quick
  constexpr int kCommits = 400;
  const uint64_t size = 2 * kSmall;
  uint64_t h = 0, removed = 0, largest = 0;
  bool shrank = false;
  {
    auto s = rank.open(kSmall);
    removed = s->open_object("scratch", kSmall).value();
    REQUIRE_OK(s->remove_object("scratch"));
    h = s->open_object("state", size).value();
    for (int i = 0; i < kCommits; ++i) {
      write_range(*s, h, size, static_cast<uint32_t>(i), kSmall);
      const uint64_t before = file_size(rank.log_path());
      REQUIRE_OK(s->commit_range(h, 0, size));
      const uint64_t after = file_size(rank.log_path());
      shrank = shrank || after < before;
      largest = std::max(largest, after);
    }
    CHECK(s->disk_bytes() == size);
  }
  // Each commit's record takes about 100 bytes: without compaction the log would be ~40 KB.
  CHECK(shrank);
  CHECK(largest <= 20 * 1024);
  auto s = rank.open(kSmall);
  CHECK(rank.warnings.empty());
  CHECK(reads_back(*s, h, size, kCommits - 1, kSmall));
  CHECK(s->disk_bytes() == size);
  auto fresh = s->open_object("scratch", kSmall);  // the removed object's handle is not given again
  REQUIRE_OK(fresh);
  CHECK(*fresh > h);
  CHECK(*fresh != removed);
}
