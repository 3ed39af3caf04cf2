// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the storage tests: identities, file checks, the shared TempDir, and a rank's store
// written and read as the daemon does. Header-only, for Catch2 programs that link tmsdisk_storage.
#pragma once

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "manifest.h"
#include "storage.h"
#include "temp_dir.h"
#include "tmsdisk/common/proc.h"

namespace storage_test {

// One TempDir for every test (temp_dir.h): under $TMSDISK_TEST_TMP or the build tree, a disk
// filesystem, as roots must be or Roots::open refuses them.
using tmsdisk::testing::on_tmpfs;
using tmsdisk::testing::TempDir;

inline tmsdisk::storage::RankIdentity identity_of(pid_t pid, const std::string& job = "job1", int64_t rank = 0,
                                                  uint64_t token = 1234) {
  tmsdisk::storage::RankIdentity id;
  id.uid = 1000;
  id.gid = 1000;
  id.job = job;
  id.rank = rank;
  id.pid = pid;
  id.start_time = tmsdisk::process_start_time(pid).value_or(0);
  id.token = token;
  return id;
}

inline tmsdisk::storage::RankIdentity my_identity(const std::string& job = "job1", int64_t rank = 0) {
  return identity_of(::getpid(), job, rank);
}

inline bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

inline mode_t mode_of(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

struct FileUsage {
  uint64_t size = 0;
  uint64_t blocks = 0;
  bool operator==(const FileUsage&) const = default;
};

inline FileUsage usage_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_blocks)};
}

// What the storage tests do to a rank's store and its files: open roots, make a store of 64 KiB
// chunks, write chunks through their locations as the I/O engine would, and read files back. They
// speak the store's own names, as the tests do.
using namespace tmsdisk;
using namespace tmsdisk::storage;

inline constexpr uint32_t kChunk = 64 * 1024;

inline Roots open_roots(const std::vector<std::string>& paths) {
  auto r = Roots::open(paths, false);
  INFO((r ? std::string() : r.error().describe()));
  REQUIRE(r);
  return std::move(r).value();
}

inline std::unique_ptr<RankStore> make_store(Roots& roots, const RankIdentity& id, uint32_t chunk = kChunk) {
  auto s = RankStore::create(roots, id, chunk);
  INFO((s ? std::string() : s.error().describe()));
  REQUIRE(s);
  return std::move(s).value();
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

inline std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// A pid that existed and is gone (reaped), with the start time it had: an owner that provably died.
inline pid_t dead_process(uint64_t& start_time) {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  // Until reaped, the exited child is a zombie whose /proc/<pid>/stat is still readable.
  auto st = process_start_time(pid);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(st);
  start_time = *st;
  REQUIRE_FALSE(process_alive(pid, start_time));
  return pid;
}

inline RankIdentity dead_identity(const std::string& job, int64_t rank = 0) {
  uint64_t start = 0;
  pid_t pid = dead_process(start);
  RankIdentity id = storage_test::identity_of(pid, job, rank);
  id.start_time = start;
  return id;
}

// Writes `bytes` over the chunk at (blob, off) through its Location, as the I/O engine writes a
// staging slot: aligned for O_DIRECT, the rest of the slot (up to io_length) `pad`.
inline void write_bytes(const RankStore& store, uint64_t blob, uint64_t off, std::span<const uint8_t> bytes,
                        unsigned char pad = 0) {
  auto loc = store.locate(blob, off, static_cast<uint32_t>(bytes.size()));
  INFO((loc ? std::string() : loc.error().describe()));
  REQUIRE(loc);
  auto* buf = static_cast<unsigned char*>(std::aligned_alloc(kIoAlignment, loc->io_length));
  REQUIRE(buf);
  std::memset(buf, pad, loc->io_length);
  std::copy(bytes.begin(), bytes.end(), buf);
  ssize_t n = ::pwrite(loc->fd, buf, loc->io_length, static_cast<off_t>(loc->file_offset));
  std::free(buf);
  REQUIRE(n == static_cast<ssize_t>(loc->io_length));
}

inline std::vector<uint8_t> filled(uint32_t len, uint8_t byte) {
  return std::vector<uint8_t>(len, byte);
}

// Writes `fill` over the chunk through its Location and nothing else: bytes the store was never told
// of (a WRITE whose seal never came, a file changed behind its back).
inline void write_chunk(const RankStore& store, uint64_t blob, uint64_t off, uint32_t len, unsigned char fill) {
  write_bytes(store, blob, off, filled(len, fill), fill);
}

// The `len` bytes of the chunk at (blob, off), read from the data file through its Location as the
// I/O engine reads a staging slot.
inline std::vector<uint8_t> read_chunk(const RankStore& store, uint64_t blob, uint64_t off, uint32_t len) {
  auto loc = store.locate(blob, off, len);
  INFO((loc ? std::string() : loc.error().describe()));
  REQUIRE(loc);
  auto* buf = static_cast<unsigned char*>(std::aligned_alloc(kIoAlignment, loc->io_length));
  REQUIRE(buf);
  const ssize_t n = ::pread(loc->fd, buf, loc->io_length, static_cast<off_t>(loc->file_offset));
  std::vector<uint8_t> bytes(buf, buf + (n == static_cast<ssize_t>(loc->io_length) ? len : 0));
  std::free(buf);
  REQUIRE(n == static_cast<ssize_t>(loc->io_length));
  return bytes;
}

inline bool chunk_is(const RankStore& store, uint64_t blob, uint64_t off, uint32_t len, unsigned char fill) {
  const std::vector<uint8_t> bytes = read_chunk(store, blob, off, len);
  return std::all_of(bytes.begin(), bytes.end(), [fill](uint8_t c) { return c == fill; });
}

inline uint64_t offset_of(const RankStore& store, uint64_t blob, uint64_t off, uint64_t size) {
  auto loc = store.locate(blob, off, static_cast<uint32_t>(std::min<uint64_t>(kChunk, size - off)));
  INFO((loc ? std::string() : loc.error().describe()));
  REQUIRE(loc);
  return loc->file_offset;
}

// The store's calls for a WRITE of `bytes` at (blob, off) up to its I/O, as the daemon makes them
// (chunk_io.cpp): open_write(), the hash a hash worker takes (hash_chunk()), settle_write(). Its plan
// says whether the bytes need writing; a WRITE whose I/O never completes ends here.
inline RankStore::WritePlan start_write(RankStore& store, uint64_t blob, uint64_t off, std::span<const uint8_t> bytes) {
  const auto len = static_cast<uint32_t>(bytes.size());
  auto ticket = store.open_write(blob, off, len);
  INFO((ticket ? std::string() : ticket.error().describe()));
  REQUIRE(ticket);
  auto plan = store.settle_write(blob, off, len, *ticket, RankStore::hash_chunk(ticket->xxh64, bytes));
  INFO((plan ? std::string() : plan.error().describe()));
  REQUIRE(plan);
  return *plan;
}

// A WRITE of `bytes` at (blob, off) as the daemon does it: start_write(), then, unless the store
// found the bytes unchanged, the bytes to the data file and end_write(). Its plan: whether it was
// unchanged, and the checksum sealed.
inline RankStore::WritePlan write_as_daemon(RankStore& store, uint64_t blob, uint64_t off,
                                            std::span<const uint8_t> bytes) {
  const RankStore::WritePlan plan = start_write(store, blob, off, bytes);
  if (plan.unchanged) return plan;
  write_bytes(store, blob, off, bytes);
  auto sealed = store.end_write(blob, off, static_cast<uint32_t>(bytes.size()), plan.sum);
  INFO((sealed ? std::string() : sealed.error().describe()));
  REQUIRE(sealed);
  return {.sum = *sealed, .unchanged = false};
}

// write_as_daemon(), saying only whether the bytes were unchanged.
inline bool write_through(RankStore& store, uint64_t blob, uint64_t off, std::span<const uint8_t> bytes) {
  return write_as_daemon(store, blob, off, bytes).unchanged;
}

// The bytes write_set() gives chunk (blob, off): one byte value per chunk, so that each chunk's
// record vouches for its own bytes only.
inline std::vector<uint8_t> chunk_bytes_of(const RankStore& store, uint64_t blob, uint64_t off, uint64_t size,
                                           uint64_t salt = 0) {
  const uint32_t chunk = store.chunk_bytes();
  return filled(static_cast<uint32_t>(std::min<uint64_t>(chunk, size - off)),
                static_cast<uint8_t>(1 + blob * 37 + off / chunk * 11 + salt * 5));
}

// Writes every chunk of `set` as the daemon does (write_through), each with chunk_bytes_of().
inline void write_set(RankStore& store, const std::vector<storage::BlobSize>& set, uint64_t salt = 0) {
  for (const auto& b : set) {
    for (uint64_t off = 0; off < b.size; off += store.chunk_bytes())
      write_through(store, b.id, off, chunk_bytes_of(store, b.id, off, b.size, salt));
  }
}

// The store's calls for a READ at (blob, off) whose staging slot holds `slot` once read, as the daemon
// makes them: open_read(), the hash a hash worker takes of the slot, settle_read(). Its answer is the
// daemon's: the checksum verified, or why the READ is refused.
inline Result<Checksum128> verify_slot(RankStore& store, uint64_t blob, uint64_t off, std::span<const uint8_t> slot) {
  const auto len = static_cast<uint32_t>(slot.size());
  auto ticket = store.open_read(blob, off, len);
  if (!ticket) return std::move(ticket).error();
  return store.settle_read(blob, off, len, RankStore::hash_chunk(ticket->xxh64, slot));
}

// A READ of (blob, off) as the daemon does it: refused before any I/O when open_read() refuses it,
// else the chunk read from the data file through its Location and verified (verify_slot()). True
// when it is verified and its bytes are `expected`.
inline bool reads_back(RankStore& store, uint64_t blob, uint64_t off, std::span<const uint8_t> expected) {
  const auto len = static_cast<uint32_t>(expected.size());
  auto ticket = store.open_read(blob, off, len);
  INFO((ticket ? std::string() : ticket.error().describe()));
  if (!ticket) return false;
  const std::vector<uint8_t> slot = read_chunk(store, blob, off, len);
  auto verified = verify_slot(store, blob, off, slot);
  INFO((verified ? std::string() : verified.error().describe()));
  return verified && std::equal(slot.begin(), slot.end(), expected.begin(), expected.end());
}

inline uint64_t allocated_bytes(const std::string& path) {
  return usage_of(path).blocks * 512;
}

inline Manifest manifest_of(const std::string& dir) {
  std::string why;
  auto m = decode_manifest(read_text(dir + "/manifest"), why);
  INFO(why);
  REQUIRE(m);
  return *m;
}

// A rank paused with 3 chunks of blob 1 written (bytes 0x11, 0x22, 0x33); returns its data file path.
inline std::string paused_rank(Roots& roots, const RankIdentity& id) {
  auto store = make_store(roots, id);
  const std::vector<storage::BlobSize> set{{1, 3 * kChunk}};
  REQUIRE(store->reserve(set));
  for (uint64_t c = 0; c < 3; ++c)
    write_through(*store, 1, c * kChunk, filled(kChunk, static_cast<uint8_t>(0x11 * (c + 1))));
  REQUIRE(store->commit(storage::CommitState::Paused));
  return store->dir_path() + "/data";
}  // the daemon "exits" without removing anything

}  // namespace storage_test
