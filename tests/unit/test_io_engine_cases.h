// SPDX-License-Identifier: Apache-2.0
// I/O engine test cases shared by the synchronous-fallback and the io_uring test executables.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "io_engine.h"
#include "temp_dir.h"

namespace io_test {

using tmsdisk::io::Completion;
using tmsdisk::io::Engine;
using tmsdisk::io::Op;
using tmsdisk::io::Request;

constexpr std::size_t kAlign = 4096;

// A scratch directory on a real filesystem (O_DIRECT needs one; tmpfs would also hide short reads):
// the shared TempDir, under $TMSDISK_TEST_TMP or the build tree.
using ScratchDir = tmsdisk::testing::TempDir;

// An unlinked file in the scratch directory, opened with O_DIRECT where the filesystem allows it.
struct TestFile {
  int fd = -1;
  bool direct = false;
  explicit TestFile(const ScratchDir& dir, int extra_flags = 0) {
    std::string name = dir.path() + "/data";
    fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT | extra_flags, 0600);
    direct = fd >= 0;
    if (fd < 0 && errno == EINVAL) fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0600);
    REQUIRE(fd >= 0);
    ::unlink(name.c_str());
    if (!direct) WARN("O_DIRECT refused in " << dir.path() << "; testing buffered I/O");
  }
  ~TestFile() { ::close(fd); }
  TestFile(const TestFile&) = delete;
  TestFile& operator=(const TestFile&) = delete;
};

struct AlignedBuffer {
  std::unique_ptr<unsigned char, decltype(&std::free)> mem{nullptr, &std::free};
  std::size_t size = 0;
  explicit AlignedBuffer(std::size_t n) : size(n) {
    void* p = nullptr;
    REQUIRE(::posix_memalign(&p, kAlign, n) == 0);
    mem.reset(static_cast<unsigned char*>(p));
    std::memset(p, 0, n);
  }
  unsigned char* data() const { return mem.get(); }
};

inline unsigned char pattern(uint64_t pos, unsigned seed) {
  return static_cast<unsigned char>((pos * 131 + seed) ^ (pos >> 12));
}

inline void fill(unsigned char* p, std::size_t n, uint64_t file_offset, unsigned seed) {
  for (std::size_t i = 0; i < n; ++i) p[i] = pattern(file_offset + i, seed);
}

inline std::unique_ptr<Engine> make_engine(const Engine::Options& o) {
  auto e = Engine::create(o);
  INFO((e ? std::string() : e.error().describe()));
  REQUIRE(e);
  return std::move(e).value();
}

// Waits until nothing is in flight; returns the result per tag and fails on a duplicate completion.
inline std::map<uint64_t, int> drain(Engine& engine) {
  std::map<uint64_t, int> results;
  std::vector<Completion> out;
  while (engine.in_flight() > 0) {
    out.clear();
    std::size_t n = engine.wait(out);
    REQUIRE(n == out.size());
    REQUIRE(n > 0);  // wait() returns nothing with work in flight only if the ring broke
    for (const Completion& c : out) {
      INFO("tag " << c.tag);
      REQUIRE(results.emplace(c.tag, c.result).second);
    }
  }
  return results;
}

// Moves `count` pieces of `piece` bytes each between `buf` and the file at the same offsets; tags 0..count-1.
inline std::map<uint64_t, int> transfer(Engine& engine, Op op, int fd, unsigned char* buf, int buf_index,
                                        std::size_t count, uint32_t piece) {
  for (std::size_t i = 0; i < count; ++i)
    engine.queue(Request{op, fd, buf + i * piece, buf_index, piece, i * piece, i});
  engine.submit();
  return drain(engine);
}

inline void require_all_ok(const std::map<uint64_t, int>& results, std::size_t count) {
  REQUIRE(results.size() == count);
  for (auto [tag, result] : results) {
    INFO("tag " << tag);
    REQUIRE(result == 0);
  }
}

// Byte-for-byte comparison that reports the first difference instead of dumping megabytes.
inline void require_same(const unsigned char* a, const unsigned char* b, std::size_t n) {
  auto diff = std::mismatch(a, a + n, b);
  INFO("first difference at byte " << (diff.first - a));
  REQUIRE(diff.first == a + n);
}

// Writes a pattern and reads it back, `count` requests of `piece` bytes; fixed buffers if asked.
inline void round_trip(const Engine::Options& opts, bool fixed, std::size_t count, uint32_t piece) {
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  std::size_t total = count * piece;
  AlignedBuffer src(total), dst(total);
  fill(src.data(), total, 0, 7);
  int src_index = -1, dst_index = -1;
  if (fixed) {
    std::string why;
    src_index = engine->register_buffer(src.data(), total, &why);
    INFO(why);
    REQUIRE(src_index >= 0);
    dst_index = engine->register_buffer(dst.data(), total, &why);
    REQUIRE(dst_index >= 0);
  }
  require_all_ok(transfer(*engine, Op::Write, file.fd, src.data(), src_index, count, piece), count);
  require_all_ok(transfer(*engine, Op::Read, file.fd, dst.data(), dst_index, count, piece), count);
  require_same(src.data(), dst.data(), total);
  REQUIRE(engine->in_flight() == 0);
}

// The first result of every request is cut to half, and the half the engine is told did not move is
// clobbered (in the buffer for a read, in the file for a write), as after a genuine short transfer:
// only a correct resubmission of the remainder gives back the right bytes.
inline void short_transfers(Engine::Options opts, bool fixed) {
  constexpr std::size_t kCount = 8;
  constexpr uint32_t kPiece = 256 << 10;
  constexpr uint32_t kHalf = kPiece / 2;
  ScratchDir dir;
  TestFile file(dir);
  AlignedBuffer src(kCount * kPiece), dst(kCount * kPiece), garbage(kHalf);
  std::memset(garbage.data(), 0xEE, kHalf);
  fill(src.data(), src.size, 0, 3);
  std::map<uint64_t, int> calls;
  int src_index = -1, dst_index = -1;
  opts.fault = [&](const Request& r, int raw) {
    int n = ++calls[r.tag];
    unsigned char* base = r.op == Op::Read ? dst.data() : src.data();
    if (n == 1) {
      if (raw != static_cast<int>(kPiece)) return raw;
      if (r.op == Op::Read)
        std::memset(static_cast<unsigned char*>(r.buf) + kHalf, 0xEE, kHalf);
      else if (::pwrite(r.fd, garbage.data(), kHalf, static_cast<off_t>(r.offset + kHalf)) != kHalf)
        return -ENOSPC;  // fails the test through the completion
      return static_cast<int>(kHalf);
    }
    // The remainder: same buffer, advanced; still inside the registered one.
    bool advanced = r.offset == r.tag * kPiece + kHalf && r.length == kHalf && r.buf == base + r.tag * kPiece + kHalf &&
                    r.buf_index == (r.op == Op::Read ? dst_index : src_index);
    return advanced ? raw : -ERANGE;
  };
  auto engine = make_engine(opts);
  if (fixed) {
    std::string why;
    src_index = engine->register_buffer(src.data(), src.size, &why);
    INFO(why);
    REQUIRE(src_index >= 0);
    dst_index = engine->register_buffer(dst.data(), dst.size, &why);
    REQUIRE(dst_index >= 0);
  }
  require_all_ok(transfer(*engine, Op::Write, file.fd, src.data(), src_index, kCount, kPiece), kCount);
  for (std::size_t t = 0; t < kCount; ++t) REQUIRE(calls[t] == 2);
  calls.clear();
  require_all_ok(transfer(*engine, Op::Read, file.fd, dst.data(), dst_index, kCount, kPiece), kCount);
  for (std::size_t t = 0; t < kCount; ++t) REQUIRE(calls[t] == 2);
  require_same(src.data(), dst.data(), src.size);
}

// -EAGAIN once per request is retried invisibly; -EAGAIN forever gives up after kMaxRetries.
inline void eagain(Engine::Options opts) {
  std::map<uint64_t, int> calls;
  opts.fault = [&](const Request& r, int raw) {
    int n = ++calls[r.tag];
    if (r.tag == 99 || n == 1) return -EAGAIN;
    return raw;
  };
  constexpr std::size_t kCount = 8;
  constexpr uint32_t kPiece = 64 << 10;
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  AlignedBuffer src(kCount * kPiece), dst(kCount * kPiece);
  fill(src.data(), src.size, 0, 11);
  require_all_ok(transfer(*engine, Op::Write, file.fd, src.data(), -1, kCount, kPiece), kCount);
  for (std::size_t t = 0; t < kCount; ++t) REQUIRE(calls[t] == 2);
  calls.clear();
  require_all_ok(transfer(*engine, Op::Read, file.fd, dst.data(), -1, kCount, kPiece), kCount);
  for (std::size_t t = 0; t < kCount; ++t) REQUIRE(calls[t] == 2);
  require_same(src.data(), dst.data(), src.size);

  engine->queue(Request{Op::Read, file.fd, dst.data(), -1, kPiece, 0, 99});
  engine->submit();
  auto results = drain(*engine);
  REQUIRE(results.size() == 1);
  REQUIRE(results.at(99) == -EAGAIN);
  REQUIRE(calls[99] == static_cast<int>(Engine::kMaxRetries) + 1);
}

// An injected -EIO completes exactly its request, once, with its tag; also on a resubmitted remainder.
inline void eio(Engine::Options opts) {
  std::map<uint64_t, int> calls;
  opts.fault = [&](const Request& r, int raw) {
    int n = ++calls[r.tag];
    if (r.tag == 5) return -EIO;
    if (r.tag == 6) return n == 1 ? raw / 2 : -EIO;
    return raw;
  };
  constexpr std::size_t kCount = 16;
  constexpr uint32_t kPiece = 64 << 10;
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  AlignedBuffer src(kCount * kPiece);
  fill(src.data(), src.size, 0, 5);
  auto results = transfer(*engine, Op::Write, file.fd, src.data(), -1, kCount, kPiece);
  REQUIRE(results.size() == kCount);
  for (auto [tag, result] : results) {
    INFO("tag " << tag);
    REQUIRE(result == (tag == 5 || tag == 6 ? -EIO : 0));
  }
  REQUIRE(calls[5] == 1);
  REQUIRE(calls[6] == 2);
}

// Op::Sync flushes a file without a buffer: 0 for a file written, -EBADF for a descriptor that is none,
// and a fault (-EIO) surfaced once with its tag, -EAGAIN retried as for a transfer.
inline void syncs(Engine::Options opts) {
  std::map<uint64_t, int> calls;
  opts.fault = [&](const Request& r, int raw) {
    const int n = ++calls[r.tag];
    if (r.op != Op::Sync) return raw;
    if (r.tag == 3) return -EIO;
    if (r.tag == 4 && n == 1) return -EAGAIN;
    return raw;
  };
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  AlignedBuffer buf(kAlign);
  fill(buf.data(), kAlign, 0, 9);
  require_all_ok(transfer(*engine, Op::Write, file.fd, buf.data(), -1, 1, kAlign), 1);
  engine->queue(Request{.op = Op::Sync, .fd = file.fd, .tag = 1});
  engine->queue(Request{.op = Op::Sync, .fd = -1, .tag = 2});
  engine->queue(Request{.op = Op::Sync, .fd = file.fd, .tag = 3});
  engine->queue(Request{.op = Op::Sync, .fd = file.fd, .tag = 4});
  engine->submit();
  REQUIRE(drain(*engine) == std::map<uint64_t, int>{{1, 0}, {2, -EBADF}, {3, -EIO}, {4, 0}});
  REQUIRE(calls[4] == 2);
}

// The kernel's own answers: EOF inside and past the end of a file, and a write on a read-only fd.
inline void kernel_errors(const Engine::Options& opts) {
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  AlignedBuffer buf(16 * kAlign);
  fill(buf.data(), kAlign, 0, 1);
  REQUIRE(::pwrite(file.fd, buf.data(), kAlign, 0) == static_cast<ssize_t>(kAlign));
  // Straddling EOF: the kernel returns one page (a real short read), then 0 for the remainder.
  engine->queue(Request{Op::Read, file.fd, buf.data(), -1, 4 * kAlign, 0, 1});
  engine->queue(Request{Op::Read, file.fd, buf.data() + 4 * kAlign, -1, kAlign, 1 << 20, 2});
  std::string path = dir.path() + "/readonly";
  int ro = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(ro >= 0);
  engine->queue(Request{Op::Write, ro, buf.data(), -1, kAlign, 0, 3});
  engine->submit();
  auto results = drain(*engine);
  ::close(ro);
  REQUIRE(results == std::map<uint64_t, int>{{1, -EIO}, {2, -EIO}, {3, -EBADF}});
}

// Requests the engine settles itself complete once, like any other, and wake the eventfd too.
inline void immediate_completions(const Engine::Options& opts) {
  auto engine = make_engine(opts);
  std::vector<Completion> out;
  REQUIRE(engine->wait(out) == 0);  // nothing in flight: returns at once
  AlignedBuffer buf(kAlign);
  engine->queue(Request{Op::Read, -1, buf.data(), -1, 0, 0, 1});      // nothing to move
  engine->queue(Request{Op::Read, -1, buf.data(), 7, kAlign, 0, 2});  // index never registered
  pollfd p{engine->event_fd(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, 30000) == 1);
  auto results = drain(*engine);
  REQUIRE(results == std::map<uint64_t, int>{{1, 0}, {2, -EINVAL}});
}

// The eventfd turns readable while completions wait, and reap() clears it.
inline void eventfd_signals(Engine::Options opts) {
  std::set<uint64_t> halved;
  opts.fault = [&](const Request& r, int raw) { return raw > 0 && halved.insert(r.tag).second ? raw / 2 : raw; };
  ScratchDir dir;
  TestFile file(dir);
  auto engine = make_engine(opts);
  AlignedBuffer buf(4 * kAlign);
  fill(buf.data(), buf.size, 0, 9);
  for (uint64_t t = 0; t < 4; ++t)
    engine->queue(Request{Op::Write, file.fd, buf.data() + t * kAlign, -1, kAlign, t * kAlign, t});
  engine->submit();
  std::map<uint64_t, int> results;
  std::vector<Completion> out;
  while (engine->in_flight() > 0) {
    pollfd p{engine->event_fd(), POLLIN, 0};
    int rc = ::poll(&p, 1, 30000);  // bounded only so that a lost wakeup fails instead of hanging
    REQUIRE(rc == 1);
    REQUIRE((p.revents & POLLIN));
    out.clear();
    engine->reap(out);  // may be empty: a halved request comes back to be resubmitted
    for (const Completion& c : out) REQUIRE(results.emplace(c.tag, c.result).second);
  }
  require_all_ok(results, 4);
  REQUIRE(engine->in_flight() == 0);
  // The kernel makes a CQE visible before it signals the eventfd for it, so the last signal can land
  // after its completion was already reaped (seen under ASan on 2 loaded cores). Such a signal must
  // be spurious: whatever woke the loop, nothing is left to reap.
  uint64_t count;
  if (::read(engine->event_fd(), &count, sizeof(count)) == -1) CHECK(errno == EAGAIN);
  out.clear();
  CHECK(engine->reap(out) == 0);
}

// Destroying the engine with requests queued and in the kernel neither crashes nor leaks.
inline void destroy_busy(const Engine::Options& opts) {
  ScratchDir dir;
  TestFile file(dir);
  AlignedBuffer buf(64 * kAlign);
  {
    auto engine = make_engine(opts);
    for (uint64_t t = 0; t < 64; ++t)
      engine->queue(Request{Op::Write, file.fd, buf.data() + t * kAlign, -1, kAlign, t * kAlign, t});
    engine->submit();
  }
  SUCCEED();
}

}  // namespace io_test
