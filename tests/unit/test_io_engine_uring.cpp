// SPDX-License-Identifier: Apache-2.0
// I/O engine on io_uring: every shared case plus registered buffers (main: test_io_engine_uring_main.cpp).
#include <sys/mman.h>

#include "test_io_engine_cases.h"

using namespace io_test;

namespace {

Engine::Options uring_options(unsigned depth = 4, unsigned slots = 8) {
  Engine::Options o;
  o.queue_depth = depth;
  o.buffer_slots = slots;
  return o;
}

}  // namespace

TEST_CASE("uring: the engine really uses io_uring") {
  auto engine = make_engine(uring_options());
  INFO(engine->fallback_reason());
  REQUIRE(engine->uses_io_uring());
}

TEST_CASE("uring: write then read back, plain buffers") {
  round_trip(uring_options(), false, 32, 64 << 10);
}
TEST_CASE("uring: write then read back, registered buffers") {
  round_trip(uring_options(), true, 32, 64 << 10);
}
TEST_CASE("uring: backlog far beyond the queue depth, plain") {
  round_trip(uring_options(2), false, 1000, 4096);
}
TEST_CASE("uring: backlog far beyond the queue depth, registered") {
  round_trip(uring_options(2), true, 1000, 4096);
}
TEST_CASE("uring: short transfers are resubmitted, plain") {
  short_transfers(uring_options(), false);
}
TEST_CASE("uring: short transfers are resubmitted, registered") {
  short_transfers(uring_options(), true);
}
TEST_CASE("uring: -EAGAIN is retried, within bounds") {
  eagain(uring_options());
}
TEST_CASE("uring: -EIO is surfaced once with its tag") {
  eio(uring_options());
}
TEST_CASE("uring: EOF and kernel errors") {
  kernel_errors(uring_options());
}
TEST_CASE("uring: immediate completions") {
  immediate_completions(uring_options());
}
TEST_CASE("uring: eventfd signals completions") {
  eventfd_signals(uring_options());
}
TEST_CASE("uring: destroyed while busy") {
  destroy_busy(uring_options(8));
}

TEST_CASE("uring: the registered-buffer table fills, frees and refuses bad ranges") {
  auto engine = make_engine(uring_options(4, 2));
  AlignedBuffer a(2 * kAlign), b(kAlign), c(kAlign);
  std::string why;
  int ia = engine->register_buffer(a.data(), a.size, &why);
  INFO(why);
  REQUIRE(ia >= 0);
  int ib = engine->register_buffer(b.data(), b.size, &why);
  REQUIRE(ib >= 0);
  REQUIRE(ib != ia);
  REQUIRE(engine->register_buffer(c.data(), c.size, &why) == -1);
  REQUIRE(why.find("in use") != std::string::npos);
  engine->unregister_buffer(ib);
  REQUIRE(engine->register_buffer(c.data(), c.size, &why) == ib);
  REQUIRE(engine->register_buffer(nullptr, kAlign, &why) == -1);

  // Past the end of buffer `ia`, or in another buffer's memory: refused before reaching the kernel.
  engine->queue(Request{Op::Read, -1, a.data() + kAlign, ia, 2 * kAlign, 0, 1});
  engine->queue(Request{Op::Read, -1, c.data(), ia, kAlign, 0, 2});
  engine->submit();
  REQUIRE(drain(*engine) == std::map<uint64_t, int>{{1, -EINVAL}, {2, -EINVAL}});
}

TEST_CASE("uring: a shared memfd mapping works as a registered buffer") {
  // The daemon registers the staging memfd it shares with the shim; older kernels refused to pin
  // file-backed memory, which register_buffer() must then report rather than fail the I/O.
  constexpr std::size_t kSize = 1 << 20;
  int mfd = ::memfd_create("tmsdisk-io-test", MFD_CLOEXEC);
  REQUIRE(mfd >= 0);
  REQUIRE(::ftruncate(mfd, 2 * kSize) == 0);
  void* map = ::mmap(nullptr, 2 * kSize, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
  REQUIRE(map != MAP_FAILED);
  auto* src = static_cast<unsigned char*>(map);
  unsigned char* dst = src + kSize;
  fill(src, kSize, 0, 13);
  {
    ScratchDir dir;
    TestFile file(dir);
    auto engine = make_engine(uring_options());
    std::string why;
    int index = engine->register_buffer(map, 2 * kSize, &why);
    INFO(why);
    REQUIRE(index >= 0);
    require_all_ok(transfer(*engine, Op::Write, file.fd, src, index, 16, kSize / 16), 16);
    require_all_ok(transfer(*engine, Op::Read, file.fd, dst, index, 16, kSize / 16), 16);
    require_same(src, dst, kSize);
  }
  ::munmap(map, 2 * kSize);
  ::close(mfd);
}
