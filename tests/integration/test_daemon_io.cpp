// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, the I/O path: staging buffers built, WRITEs hashed and READs verified off the event loop,
// holes punched, and the engine's faults (ENOSPC, EIO, short transfers).
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <poll.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>

#include "client.h"
#include "daemon_fixture.h"
#include "in_process_daemon.h"
#include "punch_gate.h"
#include "server.h"
#include "small_filesystem.h"
#include "test_support.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

constexpr uint32_t kSmallChunk = 64 << 10;

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
}

// A new session pauses and resumes two chunks through the daemon at `socket`: it serves on.
void check_serves_a_new_session(const std::string& socket) {
  auto next = ShimClient::connect(socket, small_session("next"));
  REQUIRE(next);
  REQUIRE(next->reserve({{1, 2 * kSmallChunk}}));
  CHECK(next->write_all({{1, 2 * kSmallChunk}}, fill_pattern));
  REQUIRE(next->commit(proto::CommitState::Paused));
  CHECK(next->read_all({{1, 2 * kSmallChunk}}, check_pattern));
}

// Sends a WRITE of every chunk of blob 1 (chunk i from slot i) without waiting for any answer.
// Returns the chunk of each request id.
std::map<uint64_t, uint32_t> send_writes(ShimClient& c, uint32_t chunks) {
  std::map<uint64_t, uint32_t> chunk_of;
  for (uint32_t i = 0; i < chunks; ++i) {
    auto id = c.send(proto::Write{{.slot = i, .length = kSmallChunk, .blob = 1, .offset = uint64_t{i} * kSmallChunk}});
    REQUIRE(id);
    chunk_of[*id] = i;
  }
  return chunk_of;
}

// Takes an answer to each of those WRITEs: whether each chunk was unchanged. Each must be answered
// exactly once, by WRITTEN.
std::vector<int> take_answers(ShimClient& c, const std::map<uint64_t, uint32_t>& chunk_of) {
  std::vector<int> unchanged(chunk_of.size(), -1);
  for (std::size_t n = 0; n < chunk_of.size(); ++n) {
    auto env = c.receive();
    REQUIRE(env);
    const auto* e = std::get_if<proto::ErrorReply>(&env->body);
    INFO((e ? e->message : std::string()));
    const auto* w = std::get_if<proto::Written>(&env->body);
    REQUIRE(w);
    auto it = chunk_of.find(env->request_id);
    REQUIRE(it != chunk_of.end());
    REQUIRE(unchanged[it->second] == -1);
    unchanged[it->second] = w->unchanged;
  }
  return unchanged;
}

std::vector<int> write_all_at_once(ShimClient& c, uint32_t chunks) {
  return take_answers(c, send_writes(c, chunks));
}

// Four hash workers are held at once by `gate`, the event loop serves meanwhile (a control client
// lists the one session), and the client at `client_fd` has no answer yet.
void check_four_held_while_the_loop_serves(HoldGate& gate, const std::string& socket, int client_fd) {
  REQUIRE(gate.wait_entered(4));
  CHECK(gate.most_at_once() == 4);
  auto ctl = ctl::Client::connect(socket);
  REQUIRE(ctl);
  auto listed = ctl->list_sessions();
  REQUIRE(listed);
  CHECK(listed->size() == 1);
  CHECK_FALSE(readable(client_fd));
}

}  // namespace

TEST_CASE("ENOSPC at reservation is refused cleanly on a real small filesystem") {
  std::string why_not;
  auto small = SmallFilesystem::mount(96, &why_not);
  if (!small) skip(why_not);
  Daemon d;
  d.roots = {small->path()};
  d.start();
  auto c = d.shim({.job = "full"});
  const std::vector<BlobSize> fits = {{1, 40 * MiB}};
  REQUIRE(c.reserve(fits));
  REQUIRE(c.write_all(fits, fill_pattern));
  auto too_big = c.reserve({{1, 40 * MiB}, {2, 200 * MiB}});
  REQUIRE_FALSE(too_big);
  CHECK(too_big.error().errnum() == ENOSPC);
  INFO(too_big.error().describe());
  // Said once, in human units: "needs 200.0 MiB on <root>, 51.2 MiB free: free space, add a root, ...".
  const std::string why = too_big.error().describe();
  CHECK(why.find("needs ") != std::string::npos);
  CHECK(why.find("MiB free: free space, add a root, or pause less") != std::string::npos);
  CHECK(why.find("bytes (") == std::string::npos);
  // Nothing changed: the earlier set is still there, written data intact.
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(fits, check_pattern));
}

TEST_CASE("a HELLO whose staging buffer is being built holds up no other client and is charged meanwhile") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.hooks.before_staging = gate.staging_hook("held");
    c.max_total_staging_bytes = 48 * server::kMiB;  // the held HELLO's 32 MiB and another's 8, with no room for 32 more
  });
  std::future<Result<ShimClient>> held;
  ReleaseAtEnd release_at_end{gate};  // before `held` waits for its answer, whatever happens
  held = std::async(std::launch::async, [&] {
    return ShimClient::connect(d.socket, {.job = "held", .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
  });
  REQUIRE(gate.wait_entered(1));  // its buffer is in the slow path, and stays there

  // Meanwhile another client's HELLO is answered, and a control request too.
  auto other = ShimClient::connect(d.socket, {.job = "other", .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
  INFO((other ? "" : other.error().describe()));
  REQUIRE(other);
  auto ctl = ctl::Client::connect(d.socket);
  REQUIRE(ctl);
  auto listed = ctl->list_sessions();
  REQUIRE(listed);
  CHECK(listed->size() == 1);  // "other": the held one is no session yet
  // The held HELLO is charged from its acceptance: 32 + 8 + 32 MiB would pass max-total-staging-mb.
  auto third =
      ShimClient::connect(d.socket, {.job = "third", .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(!third);
  CHECK(third.error().errnum() == ENOMEM);
  // All of that while the held one was still held, unanswered.
  CHECK(gate.holding());
  CHECK(held.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);

  gate.release();
  auto h = held.get();
  INFO((h ? "" : h.error().describe()));
  REQUIRE(h);
  CHECK(h->welcome().slot_count == 8);
  const std::vector<BlobSize> blobs = {{1, 12 * MiB + 4096}};
  REQUIRE(h->reserve(blobs));
  CHECK(h->write_all(blobs, fill_pattern));
  CHECK(h->read_all(blobs, check_pattern));
  CHECK(ctl->list_sessions()->size() == 2);
}

TEST_CASE("a client that leaves while its staging buffer is built gives its charge back at once") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.hooks.before_staging = gate.staging_hook("gone");
    c.max_total_staging_bytes = 48 * server::kMiB;  // room for one 32 MiB session
  });
  ReleaseAtEnd release_at_end{gate};
  UniqueFd gone(proto::connect_seqpacket(d.socket));
  REQUIRE(gone);
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Shim);
  hello.job = "gone";
  hello.staging_budget_bytes = 32 * MiB;
  hello.chunk_bytes = 4 * MiB;
  REQUIRE(proto::send_message(gone.get(), proto::encode(1, hello)) == 0);
  REQUIRE(gate.wait_entered(1));
  const ShimClient::Options next_options{.job = "next", .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB};
  auto refused = ShimClient::connect(d.socket, next_options);
  REQUIRE(!refused);
  CHECK(refused.error().errnum() == ENOMEM);  // the unanswered HELLO holds its 32 MiB

  gone.reset();  // its client goes away unanswered
  Result<ShimClient> next = make_error(EAGAIN, "not connected yet");
  CHECK(eventually([&] {
    next = ShimClient::connect(d.socket, next_options);
    return next.ok();
  }));
  CHECK(gate.holding());  // given back while the buffer it asked for was still being built
}

TEST_CASE("a reservation that zeroes a pause's data answers before the holes are punched, and no other rank waits") {
  LocalDaemon d;
  const std::vector<BlobSize> blobs = {{1, 16 * MiB}};
  const std::vector<proto::ChunkRun> all_zero = {{1, 0, 4}};
  auto a = ShimClient::connect(d.socket, {.job = "punch", .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(a);
  auto allocated = [&] { return dir_bytes(a->welcome().rank_dir); };
  REQUIRE(a->reserve(blobs));
  REQUIRE(a->write_all(blobs, fill_pattern));
  REQUIRE(a->commit(proto::CommitState::Paused));
  REQUIRE(a->read_all(blobs, check_pattern));
  REQUIRE(a->commit(proto::CommitState::Resumed));
  REQUIRE(allocated() >= 16 * MiB);

  PunchGate gate;  // after the daemon: released before the daemon stops, however the test ends
  // The memory is all zero now: the reservation is answered while its 16 MiB of punching is held.
  REQUIRE(a->reserve(blobs, all_zero));
  REQUIRE(gate.wait_entered(1));
  CHECK(allocated() >= 16 * MiB);
  // Meanwhile another rank is served: its HELLO and a whole pause and resume.
  auto b = ShimClient::connect(d.socket, {.job = "other", .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(b);
  REQUIRE(b->reserve({{7, 8 * MiB}}));
  REQUIRE(b->write_all({{7, 8 * MiB}}, fill_pattern));
  REQUIRE(b->commit(proto::CommitState::Paused));
  REQUIRE(b->read_all({{7, 8 * MiB}}, check_pattern));
  REQUIRE(b->commit(proto::CommitState::Resumed));
  // And the zeroing pause itself completes.
  REQUIRE(a->commit(proto::CommitState::Paused));
  REQUIRE(a->commit(proto::CommitState::Resumed));
  CHECK(gate.entered() == 1);  // all that while the punch stayed held

  // The next pause writes data over the ranges still to be punched: its reservation is answered only
  // once that punch has landed, so that it cannot land on the new data.
  Status next;
  CHECK(gate.waits_for_punches([&] { next = a->reserve(blobs); }));
  REQUIRE(next);
  REQUIRE(a->write_all(blobs, fill_pattern));
  REQUIRE(a->commit(proto::CommitState::Paused));
  REQUIRE(a->read_all(blobs, check_pattern));
  CHECK(allocated() >= 16 * MiB);
}

TEST_CASE("WRITEs in flight are hashed side by side off the event loop, and answered unchanged exactly when they are") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.hash_threads = 4;
    c.hooks.before_hash = gate.hook();
  });
  ReleaseAtEnd release_at_end{gate};  // before the daemon stops, which waits for its workers
  constexpr uint32_t kChunks = 64;
  auto c = ShimClient::connect(
      d.socket, {.job = "hashes", .staging_budget_bytes = kChunks * kSmallChunk, .chunk_bytes = kSmallChunk});
  REQUIRE(c);
  REQUIRE(c->welcome().slot_count == kChunks);
  const std::vector<BlobSize> blobs = {{1, uint64_t{kChunks} * kSmallChunk}};
  // Chunk i holds the pattern of version[i] at its offset.
  std::vector<uint64_t> version(kChunks, 0);
  auto fill = [&] {
    for (uint32_t i = 0; i < kChunks; ++i) fill_pattern(version[i], uint64_t{i} * kSmallChunk, c->slot(i), kSmallChunk);
  };
  auto resume = [&] {
    REQUIRE(c->commit(proto::CommitState::Paused));
    CHECK(c->read_all(blobs, [&](uint64_t, uint64_t off, const uint8_t* src, uint32_t len) {
      return check_pattern(version[off / kSmallChunk], off, src, len);
    }));
    REQUIRE(c->commit(proto::CommitState::Resumed));
  };

  // The first pause: all 64 WRITEs go out at once and four are hashed at the same time, one per
  // worker, while the event loop serves others.
  REQUIRE(c->reserve(blobs));
  fill();
  const auto first = send_writes(*c, kChunks);
  check_four_held_while_the_loop_serves(gate, d.socket, c->fd());  // no WRITE answered while all are held
  gate.release();
  CHECK(take_answers(*c, first) == std::vector<int>(kChunks, 0));  // nothing known: all written
  CHECK(gate.most_at_once() == 4);
  resume();

  // Some chunks change: exactly the others are unchanged.
  std::vector<int> expected(kChunks, 1);
  for (uint32_t i = 0; i < kChunks; ++i) {
    if (i % 3 == 0 || i == 31 || i == 63) {
      version[i] = 1;
      expected[i] = 0;
    }
  }
  REQUIRE(c->reserve(blobs));
  fill();
  CHECK(write_all_at_once(*c, kChunks) == expected);
  resume();

  // Nothing changes: all unchanged. Then everything changes: none.
  REQUIRE(c->reserve(blobs));
  fill();
  CHECK(write_all_at_once(*c, kChunks) == std::vector<int>(kChunks, 1));
  resume();
  for (auto& v : version) v += 2;
  REQUIRE(c->reserve(blobs));
  fill();
  CHECK(write_all_at_once(*c, kChunks) == std::vector<int>(kChunks, 0));
  resume();
}

TEST_CASE("a shim that goes away while its WRITEs are being hashed leaves nothing behind, and the daemon serves on") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.hash_threads = 2;
    c.hooks.before_hash = gate.hook();
  });
  ReleaseAtEnd release_at_end{gate};
  constexpr uint32_t kChunks = 8;
  std::string dir;
  {
    auto c = ShimClient::connect(
        d.socket, {.job = "gone", .staging_budget_bytes = kChunks * kSmallChunk, .chunk_bytes = kSmallChunk});
    REQUIRE(c);
    dir = c->welcome().rank_dir;
    REQUIRE(c->reserve({{1, uint64_t{kChunks} * kSmallChunk}}));
    for (uint32_t i = 0; i < kChunks; ++i)
      REQUIRE(
          c->send(proto::Write{{.slot = i, .length = kSmallChunk, .blob = 1, .offset = uint64_t{i} * kSmallChunk}}));
    REQUIRE(gate.wait_entered(2));
  }  // gone, with its WRITEs being hashed (two) and waiting for a worker (six)
  // Once the daemon saw it go (the session is no longer listed), its files stay while its staging
  // pages are still being read: the session waits for them.
  REQUIRE(eventually([&] { return listed_sessions(d.socket) == 0; }));
  CHECK(fs::exists(dir));
  gate.release();
  CHECK(eventually([&] { return !fs::exists(dir); }));
  check_serves_a_new_session(d.socket);
}

// (A chunk that no longer matches its seal is refused through the same workers: "a corrupted byte in a
// backup file is detected on read".)
TEST_CASE("READs in flight are verified side by side off the event loop, each answered once it is") {
  HoldGate gate;
  auto hold_reads = std::make_shared<std::atomic<bool>>(false);  // the WRITEs before them pass
  LocalDaemon d([&](server::Config& c) {
    c.hash_threads = 4;
    c.hooks.before_hash = gate.hook_while(hold_reads);
  });
  ReleaseAtEnd release_at_end{gate};
  constexpr uint32_t kChunks = 16;
  auto c = ShimClient::connect(
      d.socket, {.job = "reads", .staging_budget_bytes = kChunks * kSmallChunk, .chunk_bytes = kSmallChunk});
  REQUIRE(c);
  const std::vector<BlobSize> blobs = {{1, uint64_t{kChunks} * kSmallChunk}};
  REQUIRE(c->reserve(blobs));
  for (uint32_t i = 0; i < kChunks; ++i) fill_pattern(1, uint64_t{i} * kSmallChunk, c->slot(i), kSmallChunk);
  CHECK(write_all_at_once(*c, kChunks) == std::vector<int>(kChunks, 0));
  REQUIRE(c->commit(proto::CommitState::Paused));

  hold_reads->store(true);
  for (uint32_t i = 0; i < kChunks; ++i) std::memset(c->slot(i), 0, kSmallChunk);
  std::map<uint64_t, uint32_t> chunk_of;
  for (uint32_t i = 0; i < kChunks; ++i) {
    auto id = c->send(proto::Read{{.slot = i, .length = kSmallChunk, .blob = 1, .offset = uint64_t{i} * kSmallChunk}});
    REQUIRE(id);
    chunk_of[*id] = i;
  }
  // Read, then four verified at once, one per worker, while the event loop serves others.
  check_four_held_while_the_loop_serves(gate, d.socket, c->fd());  // no READ answered before it is verified
  gate.release();
  std::vector<int> answered(kChunks, 0);
  for (uint32_t n = 0; n < kChunks; ++n) {
    auto env = c->receive();
    REQUIRE(env);
    const auto* e = std::get_if<proto::ErrorReply>(&env->body);
    INFO((e ? e->message : std::string()));
    REQUIRE(std::holds_alternative<proto::ReadDone>(env->body));
    auto it = chunk_of.find(env->request_id);
    REQUIRE(it != chunk_of.end());
    ++answered[it->second];
  }
  CHECK(answered == std::vector<int>(kChunks, 1));
  for (uint32_t i = 0; i < kChunks; ++i) CHECK(check_pattern(1, uint64_t{i} * kSmallChunk, c->slot(i), kSmallChunk));
}

TEST_CASE("a rank that dies while its READs are being verified leaves nothing behind, and the daemon serves on") {
  HoldGate gate;
  auto hold_reads = std::make_shared<std::atomic<bool>>(false);  // the rank's WRITEs pass
  LocalDaemon d([&](server::Config& c) {
    c.hash_threads = 2;
    c.hooks.before_hash = gate.hook_while(hold_reads);
  });
  ReleaseAtEnd release_at_end{gate};
  constexpr uint32_t kChunks = 8;
  // The rank is another process, so that its files go once it is gone (a paused rank that lives on
  // keeps them); pipes step it: it paused, then READs go out, then it dies.
  int to_rank[2], from_rank[2];
  REQUIRE(::pipe(to_rank) == 0);
  REQUIRE(::pipe(from_rank) == 0);
  pid_t child = ::fork();
  if (child == 0) {
    char go = 0;
    auto c = ShimClient::connect(
        d.socket, {.job = "gone", .staging_budget_bytes = kChunks * kSmallChunk, .chunk_bytes = kSmallChunk});
    const std::vector<BlobSize> blobs = {{1, uint64_t{kChunks} * kSmallChunk}};
    if (!c || !c->reserve(blobs) || !c->write_all(blobs, fill_pattern) || !c->commit(proto::CommitState::Paused))
      ::_exit(1);
    const std::string dir = c->welcome().rank_dir;
    if (::write(from_rank[1], dir.c_str(), dir.size() + 1) != static_cast<ssize_t>(dir.size() + 1)) ::_exit(2);
    if (::read(to_rank[0], &go, 1) != 1) ::_exit(3);
    for (uint32_t i = 0; i < kChunks; ++i)
      if (!c->send(proto::Read{{.slot = i, .length = kSmallChunk, .blob = 1, .offset = uint64_t{i} * kSmallChunk}}))
        ::_exit(4);
    if (::read(to_rank[0], &go, 1) != 1) ::_exit(5);
    ::_exit(0);  // gone with chunks being verified (two) and the others read or waiting
  }
  char buf[4096] = {};
  REQUIRE(::read(from_rank[0], buf, sizeof(buf) - 1) > 0);
  const std::string dir = buf;
  hold_reads->store(true);
  REQUIRE(::write(to_rank[1], "r", 1) == 1);
  REQUIRE(gate.wait_entered(2));
  REQUIRE(::write(to_rank[1], "x", 1) == 1);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  for (int fd : {to_rank[0], to_rank[1], from_rank[0], from_rank[1]}) ::close(fd);
  // Once the daemon saw it go (the session is no longer listed), its files stay while its staging
  // pages are still being read: the session waits for them.
  REQUIRE(eventually([&] { return listed_sessions(d.socket) == 0; }));
  CHECK(fs::exists(dir));
  gate.release();
  CHECK(eventually([&] { return !fs::exists(dir); }));
  check_serves_a_new_session(d.socket);
}

TEST_CASE("EIO during a write reaches the client - other sessions are unaffected - no files remain once it exits") {
  std::atomic<bool> fail_next_write{false};
  FaultyDaemon d([&](const io::Request& r, int raw) {
    if (r.op == io::Op::Write && fail_next_write.exchange(false)) return -EIO;
    return raw;
  });
  auto bystander =
      ShimClient::connect(d.socket, {.job = "ok", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(bystander);
  fail_next_write = true;
  // The victim is another process, so that "dead session" means what it says.
  pid_t child = ::fork();
  if (child == 0) {
    auto victim =
        ShimClient::connect(d.socket, {.job = "eio", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
    if (!victim || !victim->reserve({{1, 16 * MiB}})) ::_exit(1);
    auto w = victim->write_all({{1, 16 * MiB}}, fill_pattern);
    if (w || w.error().errnum() != EIO) ::_exit(2);
    if (victim->commit(proto::CommitState::Paused)) ::_exit(3);  // a chunk is missing: refused
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  REQUIRE(bystander->reserve({{1, 16 * MiB}}));
  REQUIRE(bystander->write_all({{1, 16 * MiB}}, fill_pattern));
  REQUIRE(bystander->read_all({{1, 16 * MiB}}, check_pattern));
  const std::string job_dir = d.dir / ("root/" + std::to_string(::getuid()) + "/eio");
  CHECK(eventually([&] { return !fs::exists(job_dir); }));
}

TEST_CASE("short writes and reads are resubmitted and the data survives intact") {
  std::atomic<int> shortened{0};
  FaultyDaemon d([&](const io::Request& r, int raw) {
    // Every other completion moves only half the bytes (kept 4 KiB aligned for O_DIRECT).
    if (raw > 8192 && (shortened.fetch_add(1) % 2 == 0)) return static_cast<int>((r.length / 2) & ~4095u);
    return raw;
  });
  auto c = ShimClient::connect(d.socket, {.job = "short", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE(c);
  const std::vector<BlobSize> blobs = {{1, 24 * MiB + 777}};
  REQUIRE(c->reserve(blobs));
  REQUIRE(c->write_all(blobs, fill_pattern));
  REQUIRE(c->commit(proto::CommitState::Paused));
  REQUIRE(c->read_all(blobs, check_pattern));
  CHECK(shortened.load() > 4);
}
