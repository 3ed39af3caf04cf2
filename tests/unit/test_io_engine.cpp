// SPDX-License-Identifier: Apache-2.0
// I/O engine: option checks, the io_uring probe, and every case on the synchronous pread/pwrite engine.
#include "test_io_engine_cases.h"

using namespace io_test;

namespace {

Engine::Options sync_options(unsigned depth = 4) {
  Engine::Options o;
  o.queue_depth = depth;
  o.force_sync = true;
  return o;
}

}  // namespace

TEST_CASE("create rejects queue depths io_uring cannot have") {
  Engine::Options o;
  o.queue_depth = 0;
  auto e = Engine::create(o);
  REQUIRE_FALSE(e);
  REQUIRE(e.error().errnum() == EINVAL);
  o.queue_depth = 65536;
  REQUIRE_FALSE(Engine::create(o));
}

TEST_CASE("the default engine uses io_uring exactly when the probe says it can") {
  std::string why;
  bool available = tmsdisk::io::io_uring_available(&why);
  auto engine = make_engine(Engine::Options{});
  REQUIRE(engine->uses_io_uring() == available);
  if (!available) {
    WARN("io_uring unavailable: " << why);
    REQUIRE(!why.empty());
    REQUIRE(engine->fallback_reason().find("io_uring_setup") != std::string::npos);
  } else {
    REQUIRE(engine->fallback_reason().empty());
  }
}

TEST_CASE("sync: reports its mode and refuses fixed buffers with a reason") {
  auto engine = make_engine(sync_options());
  REQUIRE_FALSE(engine->uses_io_uring());
  REQUIRE_FALSE(engine->fallback_reason().empty());
  AlignedBuffer buf(kAlign);
  std::string why;
  REQUIRE(engine->register_buffer(buf.data(), buf.size, &why) == -1);
  REQUIRE(why.find("io_uring unavailable") != std::string::npos);
  // Unregistering an index that was never handed out changes nothing: the engine still moves bytes.
  engine->unregister_buffer(0);
  ScratchDir dir;
  TestFile file(dir);
  fill(buf.data(), buf.size, 0, 5);
  require_all_ok(transfer(*engine, Op::Write, file.fd, buf.data(), -1, 1, kAlign), 1);
  REQUIRE(engine->in_flight() == 0);
}

TEST_CASE("sync: write then read back") {
  round_trip(sync_options(), false, 32, 64 << 10);
}
TEST_CASE("sync: backlog far beyond the queue depth") {
  round_trip(sync_options(2), false, 1000, 4096);
}
TEST_CASE("sync: short transfers are resubmitted") {
  short_transfers(sync_options(), false);
}
TEST_CASE("sync: -EAGAIN is retried, within bounds") {
  eagain(sync_options());
}
TEST_CASE("sync: -EIO is surfaced once with its tag") {
  eio(sync_options());
}
TEST_CASE("sync: Op::Sync flushes a file, errors surfaced once") {
  syncs(sync_options());
}
TEST_CASE("sync: EOF and kernel errors") {
  kernel_errors(sync_options());
}
TEST_CASE("sync: immediate completions") {
  immediate_completions(sync_options());
}
TEST_CASE("sync: eventfd signals completions") {
  eventfd_signals(sync_options());
}
TEST_CASE("sync: destroyed while busy") {
  destroy_busy(sync_options());
}
