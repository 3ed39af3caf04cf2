// SPDX-License-Identifier: Apache-2.0
// I/O engine on io_uring: every shared case plus registered buffers (main: test_io_engine_uring_main.cpp).
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>

#include <filesystem>
#include <fstream>
#include <thread>

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
namespace {

// The io_uring workers of the calling thread: threads of this process named iou-wrk-<its tid>. The
// kernel keeps them a while after their last request.
std::size_t my_io_uring_workers() {
  const std::string name = "iou-wrk-" + std::to_string(::gettid());
  std::size_t n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

// Reads `count` pieces of `piece` bytes into `dst` through a new engine on a thread of its own (whose
// workers no other case shares), all requests flagged `async` or none; returns the workers that
// thread had then, or sets `error` (no Catch assertions off the main thread: they are not thread-safe).
std::size_t read_on_own_thread(int fd, unsigned char* dst, std::size_t count, uint32_t piece, bool async,
                               std::string& error) {
  std::size_t workers = 0;
  std::thread([&] {
    auto engine = Engine::create(uring_options(8));
    if (!engine) {
      error = engine.error().describe();
      return;
    }
    for (std::size_t i = 0; i < count; ++i)
      (*engine)->queue(Request{Op::Read, fd, dst + i * piece, -1, piece, i * piece, i, async});
    (*engine)->submit();
    std::vector<Completion> done;
    while ((*engine)->in_flight() > 0)
      if ((*engine)->wait(done) == 0) {
        error = "the engine stopped making progress";
        return;
      }
    for (const Completion& c : done)
      if (c.result != 0) error = "request " + std::to_string(c.tag) + ": " + std::strerror(-c.result);
    if (done.size() != count) error = std::to_string(done.size()) + " completions for " + std::to_string(count);
    workers = my_io_uring_workers();
  }).join();
  return workers;
}

}  // namespace

// Requests flagged async (the daemon's, for a root in memory) run in io_uring's workers, as many at
// once as there are requests waiting and no idle worker (the kernel marks forced-async work
// concurrent: each one queued while every worker is busy starts another). On tmpfs the kernel otherwise does the reads
// on the submitting thread or hands them to one worker, one after another (measured: one worker for
// 16 reads of 4 MiB, against three to six flagged, also on one CPU): the reason for the flag, a
// resume's reads at memory speed. Elsewhere (a disk's filesystem hands requests to workers as it
// likes) only that the flagged reads had workers is checked.
TEST_CASE("uring: async requests run in the kernel's workers, with the same results") {
  constexpr std::size_t kCount = 16;
  constexpr uint32_t kPiece = 4 << 20;
  struct statfs shm {};
  // A container's /dev/shm may be small (64 MiB by default under Docker): used with room to spare only.
  const bool shm_is_tmpfs = ::statfs("/dev/shm", &shm) == 0 && shm.f_type == TMPFS_MAGIC &&
                            ::access("/dev/shm", W_OK) == 0 &&
                            static_cast<uint64_t>(shm.f_bavail) * shm.f_bsize >= 4 * kCount * kPiece;
  ScratchDir dir = shm_is_tmpfs ? ScratchDir("/dev/shm") : ScratchDir();
  INFO("files in " << dir.path());
  AlignedBuffer src(kCount * kPiece), dst(kCount * kPiece);
  fill(src.data(), src.size, 0, 11);
  TestFile file(dir);
  REQUIRE(::pwrite(file.fd, src.data(), src.size, 0) == static_cast<ssize_t>(src.size));
  std::size_t workers_of[2] = {0, 0};  // [async]
  for (bool async : {false, true}) {
    std::memset(dst.data(), 0, dst.size);
    std::string error;
    const std::size_t workers = read_on_own_thread(file.fd, dst.data(), kCount, kPiece, async, error);
    INFO("async " << async << ": " << error);
    REQUIRE(error.empty());
    require_same(src.data(), dst.data(), src.size);
    workers_of[async] = workers;
  }
  INFO("workers: " << workers_of[0] << " reading plain, " << workers_of[1] << " reading flagged async");
  CHECK(workers_of[1] > 0);
  if (shm_is_tmpfs) CHECK(workers_of[1] > workers_of[0]);
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
TEST_CASE("uring: Op::Sync flushes a file, errors surfaced once") {
  syncs(uring_options());
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
