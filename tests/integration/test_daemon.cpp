// SPDX-License-Identifier: Apache-2.0
// tmsdiskd end to end: a real daemon on a temp socket and temp roots, driven by a client that plays
// the shim's role. Each TEST_CASE runs as its own CTest test; one that cannot run here exits 77.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "client.h"
#include "disk_faults.h"
#include "fd_passing.h"
#include "in_process_daemon.h"
#include "manifest_v1.h"
#include "other_user.h"
#include "punch_gate.h"
#include "server.h"
#include "small_filesystem.h"
#include "test_support.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

// The sessions the daemon on `socket` lists (`tmsctl status`); 999 if it does not answer. A session
// whose shim went and whose I/O is still in flight is not listed.
std::size_t listed_sessions(const std::string& socket) {
  auto c = ctl::Client::connect(socket);
  if (!c) return 999;
  auto s = c->list_sessions();
  return s ? s->size() : 999;
}

// A whole file's bytes (empty if it cannot be read).
std::string read_all_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

constexpr uint64_t MiB = 1ull << 20;

uint64_t now_unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

struct Daemon {
  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::vector<std::string> roots;
  DaemonProcess proc;

  explicit Daemon(int nroots = 1) {
    for (int i = 0; i < nroots; ++i) {
      roots.push_back(dir / ("root" + std::to_string(i)));
      fs::create_directories(roots.back());
    }
  }
  std::vector<std::string> args(std::vector<std::string> extra = {}) const {
    std::vector<std::string> a{"--socket", socket, "--log-level", "debug"};
    for (auto& r : roots) a.insert(a.end(), {"--root", r});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  void start(std::vector<std::string> extra = {}) {
    int rc = proc.start(TMSDISK_DAEMON_PATH, args(extra));
    INFO(proc.log());
    REQUIRE(rc == 0);
  }
  ShimClient shim(ShimClient::Options o = {}) {
    if (!o.staging_budget_bytes) o.staging_budget_bytes = 32 * MiB;
    if (!o.chunk_bytes) o.chunk_bytes = 4 * MiB;
    auto c = ShimClient::connect(socket, o);
    INFO((c ? "" : c.error().describe()));
    REQUIRE(c);
    return std::move(c.value());
  }
  ctl::Client control() {
    auto c = ctl::Client::connect(socket);
    REQUIRE(c);
    return std::move(c.value());
  }
  std::size_t session_count() { return listed_sessions(socket); }
  // What LIST_SESSIONS answers (`tmsctl status`), empty if it fails.
  std::vector<proto::SessionInfo> sessions() {
    auto c = ctl::Client::connect(socket);
    if (!c) return {};
    auto s = c->list_sessions();
    return s ? std::move(s).value() : std::vector<proto::SessionInfo>{};
  }
  // Whether the one session listed is an orphan (its shim's connection gone, its files kept).
  bool one_orphan() {
    auto s = sessions();
    return s.size() == 1 && s[0].orphaned == 1;
  }
  std::string rank_dir(std::size_t root, const std::string& job, int64_t rank, pid_t pid) const {
    return roots[root] + "/" + std::to_string(::getuid()) + "/" + job + "/rank" + std::to_string(rank) + "-" +
           std::to_string(pid);
  }
};

int expect_error(ShimClient& c, const proto::Message& m) {
  auto r = c.call(m);
  if (r) return 0;
  return r.error().errnum();
}

// Sends raw bytes on a fresh connection and returns the daemon's error code (0 if none).
int raw_exchange(const std::string& socket, const std::vector<uint8_t>& bytes) {
  UniqueFd fd(proto::connect_seqpacket(socket));
  REQUIRE(fd);
  REQUIRE(proto::send_message(fd.get(), bytes) == 0);
  std::vector<uint8_t> buf;
  long n = proto::recv_message(fd.get(), buf);
  if (n <= 0) return 0;
  auto d = proto::decode(buf);
  REQUIRE(d.envelope);
  auto* e = std::get_if<proto::ErrorReply>(&d.envelope->body);
  if (!e) return 0;
  // The daemon closes a connection after a protocol violation.
  CHECK(proto::recv_message(fd.get(), buf) == 0);
  return e->code;
}

// `n` pipes, whose write ends a test passes to the daemon: once every copy of one is closed, its
// read end reports a hangup.
struct Pipes {
  std::vector<UniqueFd> readers, writers;
  explicit Pipes(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      int p[2];
      REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
      readers.emplace_back(p[0]);
      writers.emplace_back(p[1]);
    }
  }
  std::vector<int> write_ends() const {
    std::vector<int> out;
    for (auto& w : writers) out.push_back(w.get());
    return out;
  }
  // Whether every write end is closed everywhere (ours and every copy passed).
  bool all_closed() const {
    for (auto& r : readers) {
      pollfd p{r.get(), POLLIN, 0};
      if (::poll(&p, 1, 0) != 1 || !(p.revents & POLLHUP)) return false;
    }
    return true;
  }
};

uint64_t dir_bytes(const std::string& dir) {
  uint64_t total = 0;
  for (auto& e : fs::recursive_directory_iterator(dir)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

const std::vector<BlobSize> kBlobs = {{1, 160 * MiB}, {2, 100 * MiB + 12345}, {3, 3 * 4096 + 1}, {4, 40 * MiB}};

}  // namespace

TEST_CASE("round trip of a few hundred MiB striped over two roots, repeated pauses keep disk usage constant") {
  Daemon d(2);
  d.start();
  auto c = d.shim({.job = "rt", .rank = 3});
  REQUIRE(c.welcome().slot_count == 8);
  const std::string dir0 = d.rank_dir(0, "rt", 3, ::getpid());
  const std::string dir1 = d.rank_dir(1, "rt", 3, ::getpid());
  CHECK(c.welcome().rank_dir == dir0);

  uint64_t usage = 0;
  for (int cycle = 1; cycle <= 3; ++cycle) {
    REQUIRE(c.reserve(kBlobs));
    auto w = c.write_all(kBlobs, fill_pattern);
    INFO((w ? "" : w.error().describe()));
    REQUIRE(w);
    REQUIRE(c.commit(proto::CommitState::Paused));
    CHECK(fs::exists(dir0 + "/data"));
    CHECK(fs::exists(dir1 + "/data"));
    CHECK(fs::exists(dir0 + "/manifest"));
    struct stat st {};
    REQUIRE(::stat(dir0.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    const uint64_t now = dir_bytes(dir0) + dir_bytes(dir1);
    if (cycle == 1) usage = now;
    CHECK(now == usage);  // files are overwritten in place, never grown by a repeat
    auto r = c.read_all(kBlobs, check_pattern);
    INFO((r ? "" : r.error().describe()));
    REQUIRE(r);
    REQUIRE(c.commit(proto::CommitState::Resumed));
  }
  uint64_t total = 0;
  for (auto& b : kBlobs) total += b.size;
  CHECK(usage >= total);

  c.close();
  CHECK(eventually([&] { return d.session_count() == 0; }));
  CHECK(!fs::exists(dir0));
  CHECK(!fs::exists(dir1));
}

TEST_CASE("the manifest is the one pause state: the daemon numbers pauses, answers PAUSE_STATE, refuses a new set") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "owner", .rank = 2});
  const uint64_t token = c.welcome().token;
  auto state = [](ShimClient& s) {
    auto r = s.call(proto::PauseState{});
    REQUIRE(r);
    REQUIRE(std::holds_alternative<proto::PauseStateReply>(*r));
    return std::get<proto::PauseStateReply>(*r);
  };
  CHECK(state(c).paused == 0);
  CHECK(state(c).generation == 0);
  const std::vector<BlobSize> blobs = {{1, 8 * MiB + 17}};
  for (uint64_t generation = 1; generation <= 2; ++generation) {
    REQUIRE(c.reserve(blobs));
    REQUIRE(c.write_all(blobs, fill_pattern));
    CHECK(state(c).paused == 0);  // written, not committed
    REQUIRE(c.commit(proto::CommitState::Paused));
    CHECK(state(c).paused == 1);
    CHECK(state(c).generation == generation);
    if (generation == 2) break;
    REQUIRE(c.read_all(blobs, check_pattern));
    REQUIRE(c.commit(proto::CommitState::Resumed));
    CHECK(state(c).paused == 0);
    CHECK(state(c).generation == generation);  // a resume keeps the number of the pause it ended
  }
  // While the committed pause holds the only copy, a new set is refused, and says why.
  auto busy = c.call(proto::Reserve{.flags = proto::kReserveFirst | proto::kReserveLast, .blobs = blobs});
  REQUIRE_FALSE(busy);
  CHECK(busy.error().errnum() == EBUSY);
  CHECK_THAT(busy.error().message, Catch::Contains("committed pause"));

  // A daemon restart keeps it: the manifest, not the rank, says what is paused.
  d.proc.kill9();
  c.close();
  d.start();
  auto again = d.shim({.job = "owner", .rank = 2, .token = token});
  CHECK(again.welcome().restored == 1);
  CHECK(state(again).paused == 1);
  CHECK(state(again).generation == 2);
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
  CHECK(state(again).paused == 0);
  REQUIRE(again.reserve(blobs));
}

namespace {

// A READ of the first 4 MiB of `blob` is refused (the blob is not in the stored set).
bool read_of_first_chunk_refused(ShimClient& c, uint64_t blob) {
  proto::Read gone;
  gone.slot = 0;
  gone.length = 4 * MiB;
  gone.blob = blob;
  return expect_error(c, gone) != 0;
}

}  // namespace

TEST_CASE("a committed pause gives way to a set that carries it: two parts paused one after another, resumed apart") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "carry", .rank = 0});
  const uint64_t token = c.welcome().token;
  auto reserve = [&](std::vector<BlobSize> blobs, std::vector<uint64_t> carry) {
    return c.call(proto::Reserve{
        .flags = proto::kReserveFirst | proto::kReserveLast, .blobs = std::move(blobs), .carry = std::move(carry)});
  };
  const std::vector<BlobSize> a = {{1, 8 * MiB + 17}}, b = {{2, 6 * MiB}};
  const std::vector<BlobSize> both = {{1, 8 * MiB + 17}, {2, 6 * MiB}};
  // Part A pauses and commits; part B pauses after it, carrying A (which is not written again).
  REQUIRE(c.reserve(a));
  REQUIRE(c.write_all(a, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  auto refused = reserve(both, {});
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == EBUSY);
  auto carried = reserve(both, {1});
  INFO((carried ? std::string() : carried.error().describe()));
  REQUIRE(carried);
  REQUIRE(c.write_all(b, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  // Through a daemon restart, both parts are there.
  d.proc.kill9();
  c.close();
  d.start();
  c = d.shim({.job = "carry", .rank = 0, .token = token});
  REQUIRE(c.welcome().restored == 1);
  // A resumes alone: read back, then B carried on its own and committed paused again.
  REQUIRE(c.read_all(a, check_pattern));
  REQUIRE(reserve(b, {2}));
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(b, check_pattern));
  CHECK(read_of_first_chunk_refused(c, 1));  // A's extents went back with its resume
  REQUIRE(c.commit(proto::CommitState::Resumed));
  // A carried blob must be one the store holds, whole: refused otherwise.
  auto unknown = reserve(both, {3});
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().errnum() == EINVAL);
}

TEST_CASE("a smaller set after a larger one recycles extents and drops vanished blobs") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "shrink"});
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  std::vector<BlobSize> fewer = {{2, 100 * MiB + 12345}, {5, 8 * MiB}};
  REQUIRE(c.reserve(fewer));
  REQUIRE(c.write_all(fewer, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  REQUIRE(c.read_all(fewer, check_pattern));
  CHECK(read_of_first_chunk_refused(c, 1));
}

TEST_CASE("malformed, truncated, wrong-version and oversized messages are refused and the daemon keeps serving") {
  Daemon d;
  d.start();
  proto::Hello h;
  h.role = static_cast<uint8_t>(proto::Role::Control);
  auto good = proto::encode(1, h);

  std::vector<uint8_t> garbage(100, 0x5A);
  CHECK(raw_exchange(d.socket, garbage) == EPROTO);

  auto truncated = good;
  truncated.resize(proto::kHeaderSize + 3);
  CHECK(raw_exchange(d.socket, truncated) == EPROTO);  // header length no longer matches

  auto short_header = good;
  short_header.resize(10);
  CHECK(raw_exchange(d.socket, short_header) == EPROTO);

  auto wrong_version = good;
  wrong_version[4] = 99;
  CHECK(raw_exchange(d.socket, wrong_version) == EPROTONOSUPPORT);

  std::vector<uint8_t> oversized(70 * 1024, 0);
  std::memcpy(oversized.data(), good.data(), proto::kHeaderSize);
  CHECK(raw_exchange(d.socket, oversized) == EMSGSIZE);

  proto::ListSessions before_hello;
  CHECK(raw_exchange(d.socket, proto::encode(1, before_hello)) == EPROTO);

  // Still serving: a well-behaved client gets a session.
  auto c = d.shim();
  CHECK(c.welcome().slot_count > 0);
}

TEST_CASE("out-of-range slots and extents are answered with errors - the session stays usable") {
  Daemon d;
  d.start();
  auto c = d.shim();
  REQUIRE(c.reserve({{1, 10 * MiB}}));
  proto::Write w;
  w.length = 4 * MiB;
  w.blob = 1;
  w.slot = c.welcome().slot_count;  // one past the end
  CHECK(expect_error(c, w) == ERANGE);
  w.slot = 0;
  w.blob = 2;  // never reserved
  CHECK(expect_error(c, w) != 0);
  w.blob = 1;
  w.offset = 4096;  // not a chunk boundary
  CHECK(expect_error(c, w) != 0);
  w.offset = 8 * MiB;
  w.length = 4 * MiB;  // the tail is only 2 MiB
  CHECK(expect_error(c, w) != 0);
  w.offset = 12 * MiB;  // past the end
  w.length = 4096;
  CHECK(expect_error(c, w) != 0);
  proto::Read r;
  r.slot = 0;
  r.length = 4 * MiB;
  r.blob = 1;
  CHECK(expect_error(c, r) == ENODATA);                         // reserved but never written
  CHECK(expect_error(c, proto::Commit{.state = 1}) == EINVAL);  // chunks missing
  REQUIRE(c.write_all({{1, 10 * MiB}}, fill_pattern));
  REQUIRE(c.read_all({{1, 10 * MiB}}, check_pattern));
}

TEST_CASE("job names with path traversal, backup dirs outside the roots and oversized staging are refused") {
  Daemon d;
  d.start();
  for (std::string bad : {std::string("../../etc"), std::string("a/b"), std::string(".."), std::string(".hidden"),
                          std::string(65, 'x')}) {
    auto c = ShimClient::connect(d.socket, {.job = bad});
    REQUIRE_FALSE(c);
    CHECK(c.error().errnum() == EINVAL);
  }
  auto outside = ShimClient::connect(d.socket, {.backup_dir = "/etc"});
  REQUIRE_FALSE(outside);
  auto traversal = ShimClient::connect(d.socket, {.backup_dir = d.roots[0] + "/../../etc"});
  REQUIRE_FALSE(traversal);
  auto inside = ShimClient::connect(
      d.socket, {.staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB, .backup_dir = d.roots[0]});
  CHECK(inside);
  auto huge = ShimClient::connect(d.socket, {.staging_budget_bytes = 1ull << 40});
  REQUIRE_FALSE(huge);
  CHECK(huge.error().errnum() == EINVAL);
}

TEST_CASE("a symlink planted inside a root is never followed") {
  Daemon d;
  d.start();
  TempDir target(test_tmp_root(), "victim");
  fs::create_symlink(target.path(), d.roots[0] + "/" + std::to_string(::getuid()));
  auto c = ShimClient::connect(d.socket, {.job = "sym"});
  REQUIRE_FALSE(c);
  CHECK(fs::is_empty(target.path()));
}

TEST_CASE("a tmpfs root is refused with the reason, unless allowed") {
  struct statfs_probe {
    static bool is_tmpfs(const char* p) {
      struct stat st {};
      return ::stat(p, &st) == 0 && std::system((std::string("stat -f -c %T ") + p + " | grep -q tmpfs").c_str()) == 0;
    }
  };
  if (!statfs_probe::is_tmpfs("/dev/shm")) skip("/dev/shm is not a tmpfs on this machine");
  TempDir shm("/dev/shm", "tmsdisk-tmpfs");
  Daemon d;
  d.roots = {shm.path()};
  int rc = d.proc.start(TMSDISK_DAEMON_PATH, d.args());
  CHECK(rc != 0);
  CHECK(d.proc.log().find("tmpfs") != std::string::npos);
  DaemonProcess allowed;
  CHECK(allowed.start(TMSDISK_DAEMON_PATH, d.args({"--allow-tmpfs"})) == 0);
}

TEST_CASE("a second daemon on the same socket refuses to start and the first keeps serving") {
  Daemon d;
  d.start();
  DaemonProcess second;
  CHECK(second.start(TMSDISK_DAEMON_PATH, d.args()) != 0);
  CHECK(second.log().find("another tmsdiskd") != std::string::npos);
  auto c = d.shim();
  CHECK(c.welcome().slot_count > 0);
}

TEST_CASE("a client of another uid cannot see or pause someone else's ranks") {
  if (::geteuid() != 0) skip("needs root to switch to another uid");
  Daemon d;
  d.start();
  auto c = d.shim({.job = "owned"});
  CHECK(as_other_user([&] {
          auto ctl = ctl::Client::connect(d.socket);
          if (!ctl) return ctl.error().errnum() == EACCES ? kUnreachable : 11;
          auto list = ctl->list_sessions();
          if (!list || !list->empty()) return 12;
          proto::Control req;
          req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
          req.match = proto::kMatchJob;
          req.job = "owned";
          auto r = ctl->control(req);
          return !r && r.error().errnum() == EPERM ? 0 : 13;
        }) == 0);
}

TEST_CASE("a client that vanishes mid-transfer leaves no files and does not disturb others") {
  Daemon d;
  d.start();
  auto other = d.shim({.job = "bystander", .rank = 1});
  REQUIRE(other.reserve({{1, 16 * MiB}}));
  pid_t child = ::fork();
  if (child == 0) {
    auto c = ShimClient::connect(d.socket, {.job = "vanish", .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
    if (!c || !c->reserve({{1, 64 * MiB}})) ::_exit(1);
    for (uint32_t s = 0; s < c->welcome().slot_count; ++s) {
      proto::Write w;
      w.slot = s;
      w.length = 4 * MiB;
      w.blob = 1;
      w.offset = uint64_t{s} * 4 * MiB;
      (void)c->send(w);
    }
    ::_exit(0);  // gone with writes in flight
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK(eventually([&] { return d.session_count() == 1; }));
  CHECK(eventually([&] { return !fs::exists(d.roots[0] + "/" + std::to_string(::getuid()) + "/vanish"); }));
  REQUIRE(other.write_all({{1, 16 * MiB}}, fill_pattern));
  REQUIRE(other.read_all({{1, 16 * MiB}}, check_pattern));
}

TEST_CASE("a corrupted byte in a backup file is detected on read") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "corrupt"});
  const std::vector<BlobSize> blobs = {{1, 20 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string data = d.rank_dir(0, "corrupt", 0, ::getpid()) + "/data";
  flip_byte(data, 4 * MiB + 100, 0x01);
  // The page cache may hold the old byte for a buffered fallback; O_DIRECT reads see the disk.
  auto r = c.read_all(blobs, check_pattern);
  REQUIRE_FALSE(r);
  CHECK(r.error().errnum() == EBADMSG);
  CHECK(fs::exists(data));  // the file is kept for inspection
}

TEST_CASE("killing a client with SIGKILL removes its directory") {
  Daemon d;
  d.start();
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t child = ::fork();
  if (child == 0) {
    auto c = ShimClient::connect(d.socket, {.job = "killed", .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
    if (!c || !c->reserve({{1, 8 * MiB}}) || !c->write_all({{1, 8 * MiB}}, fill_pattern)) ::_exit(1);
    char x = 1;
    (void)!::write(ready[1], &x, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char x = 0;
  REQUIRE(::read(ready[0], &x, 1) == 1);
  ::close(ready[0]);
  const std::string dir = d.rank_dir(0, "killed", 0, child);
  REQUIRE(fs::exists(dir + "/data"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("files of a live rank survive a daemon restart and the rank resumes from the manifest") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "restart", .rank = 2});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{7, 30 * MiB + 5}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "restart", 2, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  CHECK(fs::exists(dir + "/data"));
  d.start();  // the startup sweep must keep a live owner's files
  CHECK(fs::exists(dir + "/manifest"));
  auto wrong = ShimClient::connect(
      d.socket,
      {.job = "restart", .rank = 2, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB, .token = token + 1});
  REQUIRE_FALSE(wrong);
  auto again = d.shim({.job = "restart", .rank = 2, .token = token});
  CHECK(again.welcome().restored == 1);
  auto r = again.read_all(blobs, check_pattern);
  INFO((r ? "" : r.error().describe()));
  CHECK(r);
}

TEST_CASE(
    "a rank paused under a version-1 manifest resumes through the restarted daemon, READs verified with XXH3-64") {
  // A version-1 manifest holds 64-bit sums (XXH3-64): the hash workers verify each READ with the kind
  // its chunk was sealed with (a 128-bit check would refuse every one of them).
  Daemon d;
  d.start();
  auto c = d.shim({.job = "v1"});
  const uint64_t token = c.welcome().token;
  const uint32_t chunk = c.welcome().chunk_bytes;
  constexpr uint32_t kChunks = 4;
  const uint64_t size = uint64_t{kChunks - 1} * chunk + 4096;
  const std::vector<BlobSize> blobs = {{5, size}};
  auto length = [&](uint32_t i) {
    return static_cast<uint32_t>(std::min<uint64_t>(chunk, size - uint64_t{i} * chunk));
  };
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "v1", 0, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  // The manifest as that daemon wrote it: XXH3-64 of each chunk's bytes; the last one's sum is wrong.
  std::string why;
  auto m = storage::decode_manifest(read_all_of(dir + "/manifest"), why);
  INFO(why);
  REQUIRE(m);
  auto& sums = m->blobs[0].sums;
  REQUIRE(sums.size() == kChunks);
  for (uint32_t i = 0; i < kChunks; ++i) {
    std::vector<uint8_t> bytes(length(i));
    fill_pattern(5, uint64_t{i} * chunk, bytes.data(), bytes.size());
    sums[i] = {XXH3_64bits(bytes.data(), bytes.size()), 0};
  }
  sums[kChunks - 1].low ^= 1;
  std::ofstream(dir + "/manifest", std::ios::binary | std::ios::trunc) << storage_test::encode_manifest_v1(*m);
  d.start();
  auto again = d.shim({.job = "v1", .token = token});
  CHECK(again.welcome().restored == 1);
  for (uint32_t i = 0; i < kChunks; ++i) {
    std::memset(again.slot(0), 0, chunk);
    auto r = again.call(proto::Read{{.slot = 0, .length = length(i), .blob = 5, .offset = uint64_t{i} * chunk}});
    INFO("chunk " << i << (r ? "" : ": " + r.error().describe()));
    if (i + 1 < kChunks) {
      REQUIRE(r);
      CHECK(std::holds_alternative<proto::ReadDone>(*r));
      CHECK(check_pattern(5, uint64_t{i} * chunk, again.slot(0), length(i)));
    } else {
      REQUIRE_FALSE(r);
      CHECK(r.error().errnum() == EBADMSG);
    }
  }
}

TEST_CASE("a rank that reconnects to the same daemon keeps its host-tier memory counted against the budget") {
  // The rank holds the memory (its descriptor); the daemon's count of it must survive the rank's
  // session turning orphan and being taken over, or other ranks are granted past the budget.
  Daemon d;
  d.start({"--host-tier-mb", "16", "--host-tier-ahead=false"});
  auto c = d.shim({.job = "tierback"});
  const uint64_t token = c.welcome().token;
  UniqueFd memory;
  auto granted = c.call(proto::TierAsk{.bytes = 8 * MiB, .flags = 0}, -1, &memory);
  INFO((granted ? "" : granted.error().describe()));
  REQUIRE(granted);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*granted));
  const uint64_t bytes = std::get<proto::TierGrant>(*granted).bytes;
  REQUIRE(bytes == 8 * MiB);
  REQUIRE(memory);
  const std::vector<BlobSize> blobs = {{1, 4 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  c.close();  // the process lives: an orphan, with the memory still the rank's
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(d.sessions().at(0).host_tier_bytes == bytes);
  auto again = d.shim({.job = "tierback", .token = token});
  CHECK(again.welcome().adopted == 1);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].host_tier_bytes == bytes);
  ctl::Client::HostTier node;
  REQUIRE(d.control().list_sessions(ctl::Deadline::fixed(ctl::kAnswerLimit), &node));
  CHECK(node.used_bytes == bytes);
}

namespace {

// True once `fd` has something to read, within `ms`: a wait for a message the test is sure comes (a
// receive() would block for good if it did not).
bool arrives_within(int fd, int ms) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  return ::poll(&p, 1, ms) == 1;
}

}  // namespace

TEST_CASE("an ask ahead that crosses a TIER_RECLAIM is told to release, and the pausing rank gets the memory") {
  // The rank forgets a reclaim once it answered an ask of its own; told to reuse, it would keep the
  // memory and the pausing rank would wait the whole kReclaimWait for nothing.
  Daemon d;
  d.start({"--host-tier-mb", "16"});  // keep and ahead on (the defaults)
  auto kept = d.shim({.job = "kept"});
  UniqueFd memory;
  auto ahead = kept.call(proto::TierAsk{.bytes = 16 * MiB, .flags = proto::kTierAskAhead}, -1, &memory);
  INFO((ahead ? "" : ahead.error().describe()));
  REQUIRE(ahead);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*ahead));
  REQUIRE(std::get<proto::TierGrant>(*ahead).bytes == 16 * MiB);
  REQUIRE(memory);

  // A second rank pauses: the budget is all kept by the first, so the daemon asks for it back.
  auto pausing = d.shim({.job = "pausing"});
  auto pause_ask = pausing.send(proto::TierAsk{.bytes = 16 * MiB, .flags = 0});
  REQUIRE(pause_ask);
  REQUIRE(arrives_within(kept.fd(), 10000));
  auto reclaim = kept.receive();
  REQUIRE(reclaim);
  CHECK(std::holds_alternative<proto::TierReclaim>(reclaim->body));
  CHECK((reclaim->request_id & proto::kDaemonRequestBit) != 0);

  // The first rank asks ahead again before it acted on the reclaim (it crossed on the wire).
  auto again = kept.call(proto::TierAsk{.bytes = 16 * MiB, .flags = proto::kTierAskAhead});
  REQUIRE(again);
  REQUIRE(std::holds_alternative<proto::TierGrant>(*again));
  CHECK(std::get<proto::TierGrant>(*again).flags == proto::kTierReleaseFirst);
  CHECK(std::get<proto::TierGrant>(*again).bytes == 0);
  REQUIRE(kept.call(proto::TierRelease{}));
  memory.reset();

  // The pausing rank's ask is answered with memory, not after the wait with none.
  REQUIRE(arrives_within(pausing.fd(), 10000));
  auto granted = pausing.receive();
  REQUIRE(granted);
  CHECK(granted->request_id == *pause_ask);
  REQUIRE(std::holds_alternative<proto::TierGrant>(granted->body));
  CHECK(std::get<proto::TierGrant>(granted->body).bytes > 0);
}

TEST_CASE("the daemon's gc removes directories of dead ranks and keeps live ones") {
  Daemon d;
  d.start();
  auto live = d.shim({.job = "gc"});
  // A dead rank's directory as a crashed daemon would leave it: owner names a finished process.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string dead = d.rank_dir(0, "gc", 9, child);
  fs::create_directories(dead);
  {
    std::ofstream(dead + "/owner") << "tmsdisk-owner 1\npid " << child << "\nstart_time 1\ntoken 1\nuid " << ::getuid()
                                   << "\njob gc\nrank 9\n";
    std::ofstream(dead + "/data") << std::string(8192, 'x');
  }
  auto ctl = d.control();
  auto r = ctl.gc();
  REQUIRE(r);
  CHECK(r->removed_dirs == 1);
  CHECK(!fs::exists(dead));
  CHECK(fs::exists(d.rank_dir(0, "gc", 0, ::getpid())));
}

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

// ------------------------------------------------------------------------------------------------
// Faults injected into the I/O engine of an in-process server.

namespace {
// A server on a thread of this process, on its own temp root and socket, with injected I/O faults.
struct FaultyDaemon {
  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::unique_ptr<InProcessDaemon> daemon;
  explicit FaultyDaemon(std::function<int(const io::Request&, int)> fault) {
    fs::create_directories(dir / "root");
    server::Config cfg;
    cfg.roots = {dir / "root"};
    cfg.socket_path = socket;
    daemon = std::make_unique<InProcessDaemon>(cfg, std::move(fault));
  }
};

// A daemon on a thread of this process, for tests that set its test hooks or read its accounting.
struct LocalDaemon {
  TempDir dir{test_tmp_root()};
  std::string socket = dir / "d.sock";
  std::unique_ptr<InProcessDaemon> daemon;
  explicit LocalDaemon(const std::function<void(server::Config&)>& adjust = {}) {
    fs::create_directories(dir / "root");
    server::Config cfg;
    cfg.roots = {dir / "root"};
    cfg.socket_path = socket;
    if (adjust) adjust(cfg);
    daemon = std::make_unique<InProcessDaemon>(cfg, nullptr);
  }
  server::Server& server() { return *daemon->srv; }
};

// Holds the daemon's workers that reach a test hook (Config::before_staging, Config::before_hash)
// until released, and counts them: how many came, and how many it held at once. Shared with the
// hooks, which the workers may call until the daemon is gone.
class HoldGate {
 public:
  // A before_hash hook: holds every caller.
  std::function<void()> hook() const {
    return [st = state_] { hold(*st); };
  }
  // ... that holds its callers only while `armed` is set.
  std::function<void()> hook_while(std::shared_ptr<std::atomic<bool>> armed) const {
    return [st = state_, armed = std::move(armed)] {
      if (armed->load()) hold(*st);
    };
  }
  // A before_staging hook: holds the staging buffers of the HELLOs of `job` only, in the slow path.
  std::function<void(const std::string&)> staging_hook(std::string job) const {
    return [st = state_, job = std::move(job)](const std::string& of) {
      if (of == job) hold(*st);
    };
  }
  // Whether `n` callers reached the hook (within a bound that only shows that nothing hung).
  bool wait_entered(int n) {
    std::unique_lock lock(state_->mu);
    return state_->cv.wait_for(lock, std::chrono::seconds(60), [&] { return state_->entered >= n; });
  }
  bool holding() {
    std::lock_guard lock(state_->mu);
    return state_->entered > 0 && !state_->released;
  }
  int most_at_once() {
    std::lock_guard lock(state_->mu);
    return state_->most;
  }
  void release() {
    std::lock_guard lock(state_->mu);
    state_->released = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    int entered = 0, inside = 0, most = 0;
    bool released = false;
  };
  static void hold(State& st) {
    std::unique_lock lock(st.mu);
    ++st.entered;
    st.most = std::max(st.most, ++st.inside);
    st.cv.notify_all();
    st.cv.wait(lock, [&] { return st.released; });
    --st.inside;
  }
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Releases the gate when a test ends, however it ends: the daemon waits for its workers when it stops.
struct ReleaseAtEnd {
  HoldGate& gate;
  ~ReleaseAtEnd() { gate.release(); }
};

ShimClient::Options small_session(const std::string& job, int64_t rank = 0) {
  return {.job = job, .rank = rank, .staging_budget_bytes = 128 << 10, .chunk_bytes = 64 << 10};
}

// Sends `request` on `sock` (made non-blocking) until its buffer is full or the daemon closed it.
// Returns how many were sent.
int flood(int sock, const proto::Message& request) {
  ::fcntl(sock, F_SETFL, ::fcntl(sock, F_GETFL) | O_NONBLOCK);
  const auto bytes = proto::encode(1, request);
  int sent = 0;
  while (sent < 100000 && proto::send_message(sock, bytes) == 0) ++sent;
  return sent;
}

bool hung_up(int sock) {
  pollfd p{sock, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLHUP);
}

}  // namespace

TEST_CASE("a HELLO whose staging buffer is being built holds up no other client and is charged meanwhile") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.before_staging = gate.staging_hook("held");
    c.max_total_staging_mb = 48;  // the held HELLO's 32 MiB and another's 8, with no room for 32 more
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
    c.before_staging = gate.staging_hook("gone");
    c.max_total_staging_mb = 48;  // room for one 32 MiB session
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

namespace {

constexpr uint32_t kSmallChunk = 64 << 10;

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

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
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

TEST_CASE("WRITEs in flight are hashed side by side off the event loop, and answered unchanged exactly when they are") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) {
    c.hash_threads = 4;
    c.before_hash = gate.hook();
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
    c.before_hash = gate.hook();
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
    c.before_hash = gate.hook_while(hold_reads);
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
    c.before_hash = gate.hook_while(hold_reads);
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

TEST_CASE("chunks acknowledged before the daemon died mid-pause can be read back; one never written is refused") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "crash", .rank = 1});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 8 * MiB}, {2, 8 * MiB}};
  REQUIRE(c.reserve(blobs));
  // Blob 1 is fully written and acknowledged (the shim would now release it); blob 2 never is.
  std::vector<uint64_t> acked;
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {
    fill_pattern(1, off, c.slot(0), 4 * MiB);
    auto r = c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}});
    REQUIRE(r);
    REQUIRE(std::holds_alternative<proto::Written>(*r));
    acked.push_back(off);
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  d.start();
  auto again = d.shim({.job = "crash", .rank = 1, .token = token});
  CHECK(again.welcome().restored == 0);  // not a committed pause...
  for (uint64_t off : acked) {           // ...but every acknowledged chunk is recoverable, verified
    proto::Read rd;                      // by the store's journaled checksums (the rank sends none)
    rd.slot = 1;
    rd.length = 4 * MiB;
    rd.blob = 1;
    rd.offset = off;
    auto r = again.call(rd);
    INFO((r ? "" : r.error().describe()));
    REQUIRE(r);
    CHECK(std::holds_alternative<proto::ReadDone>(*r));
    CHECK(check_pattern(1, off, again.slot(1), 4 * MiB));
  }
  proto::Read never;
  never.slot = 1;
  never.length = 4 * MiB;
  never.blob = 2;
  CHECK(expect_error(again, never) == ENODATA);
}

TEST_CASE("after a daemon restart mid-pause the store verifies chunks written before it without the rank's checksums") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "sealed", .rank = 1});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 8 * MiB}};
  REQUIRE(c.reserve(blobs));
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {
    fill_pattern(1, off, c.slot(0), 4 * MiB);
    REQUIRE(c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}}));
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  // The second chunk is corrupted on disk while no daemon runs.
  const std::string data = d.rank_dir(0, "sealed", 1, ::getpid()) + "/data";
  flip_byte(data, 4 * MiB + 100, 0x01);
  d.start();
  auto again = d.shim({.job = "sealed", .rank = 1, .token = token});
  CHECK(again.welcome().restored == 0);
  proto::Read rd;
  rd.slot = 1;
  rd.length = 4 * MiB;
  rd.blob = 1;
  rd.offset = 0;
  auto good = again.call(rd);
  INFO((good ? "" : good.error().describe()));
  REQUIRE(good);
  CHECK(check_pattern(1, 0, again.slot(1), 4 * MiB));
  rd.offset = 4 * MiB;
  auto bad = again.call(rd);
  REQUIRE_FALSE(bad);
  CHECK(bad.error().errnum() == EBADMSG);
}

TEST_CASE("a long per-rank answer reaches tmsctl whole, over as many result pages as it needs") {
  Daemon d;
  d.start();
  // Enough ranks that their full-length answers take more than one 64 KiB message.
  constexpr int kRanks = 70;
  std::vector<ShimClient> ranks;
  for (int r = 0; r < kRanks; ++r)
    ranks.push_back(d.shim({.job = "long", .rank = r, .staging_budget_bytes = 256 * 1024, .chunk_bytes = 128 * 1024}));
  auto text_of = [](int rank) {
    std::string t =
        "not enough disk space: needs 104.9 GiB on /var/tmp/x, 64.0 GiB free: free space, add a root, "
        "or pause less; rank " +
        std::to_string(rank) + " ";
    while (t.size() < proto::kMaxTextLength) t += static_cast<char>('a' + t.size() % 26);
    return t;
  };
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
    req.match = proto::kMatchJob;
    req.job = "long";
    req.timeout_ms = 60000;
    results = ctl.control(req);
  });
  for (int r = 0; r < kRanks; ++r) {
    auto cmd = ranks[r].receive();
    REQUIRE(cmd);
    REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
    proto::CommandDone done;
    done.code = ENOSPC;
    done.message = text_of(r);
    REQUIRE(proto::send_message(ranks[r].fd(), proto::encode(cmd->request_id, done)) == 0);
  }
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == kRanks);
  CHECK(results->unanswered.empty());
  for (const auto& r : results->results) {
    CHECK(r.code == ENOSPC);
    CHECK(r.message == text_of(static_cast<int>(r.rank)));
  }
}

TEST_CASE(
    "each rank's outcome reaches tmsctl: a no-op as the rank said, a rank that exited as done, a silent one "
    "as unanswered at the daemon's deadline") {
  Daemon d;
  d.start();
  auto noop = d.shim({.job = "outcome", .rank = 0});
  auto moved = d.shim({.job = "outcome", .rank = 1});
  auto gone = d.shim({.job = "outcome", .rank = 2});
  auto silent = d.shim({.job = "outcome", .rank = 3});
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
    req.match = proto::kMatchJob;
    req.job = "outcome";
    req.timeout_ms = 3000;  // the daemon's deadline, for the silent rank; the client's own is far longer
    results = ctl.control(req, ctl::Deadline::fixed(std::chrono::seconds(120)));
  });
  auto answer = [](ShimClient& rank, proto::CommandDone done) {
    auto cmd = rank.receive();
    REQUIRE(cmd);
    REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
    REQUIRE(proto::send_message(rank.fd(), proto::encode(cmd->request_id, done)) == 0);
  };
  answer(noop, {.nanos = 1000, .message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)});
  answer(moved, {.bytes = 4 * MiB, .nanos = 2000, .outcome = static_cast<uint8_t>(proto::Outcome::Done)});
  auto cmd = gone.receive();
  REQUIRE(cmd);
  gone.close();  // asked, then gone without an answer
  REQUIRE(silent.receive());
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 3);
  const auto& r = results->results;  // sorted by rank
  CHECK(r[0].code == 0);
  CHECK(r[0].outcome == static_cast<uint8_t>(proto::Outcome::NoOp));
  CHECK(r[0].bytes == 0);
  CHECK(r[0].message == "already paused");
  CHECK(r[1].code == 0);
  CHECK(r[1].outcome == static_cast<uint8_t>(proto::Outcome::Done));
  CHECK(r[1].bytes == 4 * MiB);
  CHECK(r[2].code == ECONNRESET);
  CHECK(r[2].outcome == static_cast<uint8_t>(proto::Outcome::Done));
  // No result made up for the silent rank: it is named as one that did not answer.
  REQUIRE(results->unanswered.size() == 1);
  CHECK(results->unanswered[0].rank == 3);
  CHECK(results->unanswered[0].session_id == silent.welcome().session_id);
  CHECK(results->unanswered[0].pid == ::getpid());
}

namespace {

// The next message on a raw control connection, within `timeout_ms`; fails the test otherwise.
proto::Message next_message(int sock, int timeout_ms) {
  pollfd p{sock, POLLIN, 0};
  REQUIRE(::poll(&p, 1, timeout_ms) == 1);
  std::vector<uint8_t> buf;
  REQUIRE(proto::recv_message(sock, buf) > 0);
  auto d = proto::decode(buf);
  INFO(d.error);
  REQUIRE(d.envelope);
  return std::move(d.envelope->body);
}

}  // namespace

TEST_CASE("each rank's result reaches tmsctl as soon as it answers: a silent rank holds back no other's") {
  Daemon d;
  d.start();
  auto quick = d.shim({.job = "stream", .rank = 0});
  auto silent = d.shim({.job = "stream", .rank = 1});
  // A raw control connection, to see each message when it comes.
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  auto ctl = proto::connect_and_hello(d.socket, hello, 10000);
  INFO(ctl.message);
  REQUIRE(ctl);
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  req.match = proto::kMatchJob;
  req.job = "stream";
  req.timeout_ms = 120000;  // the silent rank's deadline: far beyond every wait below
  REQUIRE(proto::send_message(ctl.sock, proto::encode(2, req)) == 0);

  // First, whom the daemon asked, so that a tmsctl that gives up can name who did not answer.
  proto::Message first = next_message(ctl.sock, 10000);
  auto* targets = std::get_if<proto::ControlTargets>(&first);
  REQUIRE(targets);
  CHECK(targets->last == 1);
  REQUIRE(targets->ranks.size() == 2);
  CHECK(targets->ranks[0].rank == 0);
  CHECK(targets->ranks[0].session_id == quick.welcome().session_id);
  CHECK(targets->ranks[1].rank == 1);
  CHECK(targets->ranks[1].session_id == silent.welcome().session_id);
  CHECK(targets->ranks[1].pid == ::getpid());
  CHECK(targets->ranks[1].job == "stream");

  // One rank answers, the other keeps its COMMAND unanswered.
  auto cmd = quick.receive();
  REQUIRE(cmd);
  REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
  proto::CommandDone done{.bytes = 4 * MiB, .nanos = 1000, .outcome = static_cast<uint8_t>(proto::Outcome::Done)};
  REQUIRE(proto::send_message(quick.fd(), proto::encode(cmd->request_id, done)) == 0);
  auto silent_cmd = silent.receive();
  REQUIRE(silent_cmd);
  REQUIRE(std::holds_alternative<proto::Command>(silent_cmd->body));

  // The answer comes now, not at the silent rank's deadline two minutes away (it used to wait for
  // every rank), on a page that says more are to come.
  proto::Message second = next_message(ctl.sock, 30000);
  auto* page = std::get_if<proto::ControlResult>(&second);
  REQUIRE(page);
  CHECK(page->last == 0);
  REQUIRE(page->results.size() == 1);
  CHECK(page->results[0].session_id == quick.welcome().session_id);
  CHECK(page->results[0].bytes == 4 * MiB);

  // tmsctl gives up and leaves; the silent rank's late answer goes nowhere, and the daemon forgets
  // the request: the same ranks answer the next one, on a new connection, in full.
  ::close(std::exchange(ctl.sock, -1));
  proto::CommandDone late{.code = ETIMEDOUT, .message = "late", .outcome = static_cast<uint8_t>(proto::Outcome::Done)};
  REQUIRE(proto::send_message(silent.fd(), proto::encode(silent_cmd->request_id, late)) == 0);
  auto again = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    req.timeout_ms = 0;
    results = again.control(req, ctl::Deadline::fixed(std::chrono::seconds(60)));
  });
  for (ShimClient* rank : {&quick, &silent}) {
    auto c = rank->receive();
    REQUIRE(c);
    REQUIRE(std::holds_alternative<proto::Command>(c->body));
    proto::CommandDone noop{.message = "already paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)};
    REQUIRE(proto::send_message(rank->fd(), proto::encode(c->request_id, noop)) == 0);
  }
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 2);
  CHECK(results->unanswered.empty());
  for (const auto& r : results->results) CHECK(r.message == "already paused");
}

TEST_CASE("a pause asked while a matching rank's HELLO is served waits for it and asks that rank too") {
  HoldGate gate;
  LocalDaemon d([&](server::Config& c) { c.before_staging = gate.staging_hook("late"); });
  std::future<Result<ShimClient>> late;
  ReleaseAtEnd release_at_end{gate};
  late = std::async(std::launch::async, [&] {
    return ShimClient::connect(d.socket, {.job = "late", .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
  });
  REQUIRE(gate.wait_entered(1));  // its HELLO is in, its session is not there yet
  proto::Hello hello;
  hello.role = static_cast<uint8_t>(proto::Role::Control);
  auto ctl = proto::connect_and_hello(d.socket, hello, 60'000);
  INFO(ctl.message);
  REQUIRE(ctl);
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Pause);
  req.match = proto::kMatchJob;
  req.job = "late";
  REQUIRE(proto::send_message(ctl.sock, proto::encode(2, req)) == 0);

  gate.release();
  auto h = late.get();
  REQUIRE(h);
  // The rank was asked (it was no session when the pause came, so it used to be "no running rank").
  proto::Message first = next_message(ctl.sock, 60'000);
  auto* targets = std::get_if<proto::ControlTargets>(&first);
  INFO((std::holds_alternative<proto::ErrorReply>(first) ? std::get<proto::ErrorReply>(first).message : ""));
  REQUIRE(targets);
  REQUIRE(targets->ranks.size() == 1);
  CHECK(targets->ranks[0].session_id == h->welcome().session_id);
  auto cmd = h->receive();
  REQUIRE(cmd);
  CHECK(std::holds_alternative<proto::Command>(cmd->body));
}

TEST_CASE("a client's own deadline names the ranks that did not answer and keeps the answers it has") {
  Daemon d;
  d.start();
  auto quick = d.shim({.job = "late", .rank = 0});
  auto silent = d.shim({.job = "late", .rank = 1});
  auto ctl = d.control();
  Result<ctl::ControlAnswer> results = make_error(EINVAL, "not run");
  std::thread asker([&] {
    proto::Control req;
    req.op = static_cast<uint8_t>(proto::CommandOp::Resume);
    req.match = proto::kMatchJob;
    req.job = "late";  // no daemon deadline: only the client's
    results = ctl.control(req, ctl::Deadline::fixed(std::chrono::seconds(5)));
  });
  auto cmd = quick.receive();
  REQUIRE(cmd);
  proto::CommandDone done{.message = "nothing is paused", .outcome = static_cast<uint8_t>(proto::Outcome::NoOp)};
  REQUIRE(proto::send_message(quick.fd(), proto::encode(cmd->request_id, done)) == 0);
  REQUIRE(silent.receive());
  asker.join();
  INFO((results ? "" : results.error().describe()));
  REQUIRE(results);
  REQUIRE(results->results.size() == 1);
  CHECK(results->results[0].rank == 0);
  CHECK(results->results[0].message == "nothing is paused");
  REQUIRE(results->unanswered.size() == 1);
  CHECK(results->unanswered[0].rank == 1);
}

TEST_CASE("a live rank that loses its connection while paused keeps its files until it reconnects or exits") {
  Daemon d;
  d.start();
  const std::vector<BlobSize> blobs = {{1, 12 * MiB}};
  {
    auto c = d.shim({.job = "orphan", .rank = 4});
    const uint64_t token = c.welcome().token;
    REQUIRE(c.reserve(blobs));
    REQUIRE(c.write_all(blobs, fill_pattern));
    REQUIRE(c.commit(proto::CommitState::Paused));
    c.close();  // the process lives on: its paused memory exists only in these files
    const std::string dir = d.rank_dir(0, "orphan", 4, ::getpid());
    REQUIRE(eventually([&] { return d.one_orphan(); }));
    CHECK(fs::exists(dir + "/data"));
    auto wrong = ShimClient::connect(
        d.socket, {.job = "orphan", .rank = 4, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
    REQUIRE_FALSE(wrong);  // without the token nobody takes them over
    CHECK(wrong.error().errnum() == EPERM);
    auto again = d.shim({.job = "orphan", .rank = 4, .token = token});
    CHECK(again.welcome().restored == 1);
    REQUIRE(again.read_all(blobs, check_pattern));
    REQUIRE(again.commit(proto::CommitState::Resumed));
    again.close();  // resumed: nothing to keep
    CHECK(eventually([&] { return !fs::exists(dir); }));
  }
  // A child that pauses, drops its connection and then exits: the files go when it does.
  int go[2];
  REQUIRE(::pipe(go) == 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(go[1]);
    auto c = ShimClient::connect(
        d.socket, {.job = "orphan", .rank = 5, .staging_budget_bytes = 16 * MiB, .chunk_bytes = 4 * MiB});
    if (!c || !c->reserve(blobs) || !c->write_all(blobs, fill_pattern) || !c->commit(proto::CommitState::Paused))
      ::_exit(1);
    c->close();
    char x;
    (void)!::read(go[0], &x, 1);  // wait until the parent has seen the files kept
    ::_exit(0);
  }
  ::close(go[0]);
  const std::string dir = d.rank_dir(0, "orphan", 5, child);
  REQUIRE(eventually([&] { return fs::exists(dir + "/manifest") && d.one_orphan(); }));
  CHECK(fs::exists(dir + "/data"));
  ::close(go[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

TEST_CASE("an orphan is listed by LIST_SESSIONS as orphaned, since when and with what it keeps on disk") {
  Daemon d;
  d.start();
  const std::vector<BlobSize> blobs = {{1, 12 * MiB}};
  auto c = d.shim({.job = "listed", .rank = 2});
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const uint64_t before = now_unix_ms();
  c.close();  // the process lives on: its paused memory exists only in the rank's files
  // Before, the session vanished from the list while it still counted against the per-user limit.
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  const proto::SessionInfo orphan = d.sessions().at(0);
  CHECK(orphan.job == "listed");
  CHECK(orphan.rank == 2);
  CHECK(orphan.pid == ::getpid());
  CHECK(orphan.orphaned_unix_ms >= before);
  CHECK(orphan.orphaned_unix_ms <= now_unix_ms());
  CHECK(orphan.disk_bytes >= 12 * MiB);

  // It cannot be paused or resumed until it reconnects, and the refusal says why.
  auto ctl = d.control();
  proto::Control req;
  req.op = static_cast<uint8_t>(proto::CommandOp::Resume);
  req.match = proto::kMatchJob;
  req.job = "listed";
  auto refused = ctl.control(req);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().errnum() == ENOTCONN);
  CHECK_THAT(refused.error().message, Catch::Contains("lost their connection") && Catch::Contains("orphaned"));

  auto again = d.shim({.job = "listed", .rank = 2, .token = token});
  CHECK(again.welcome().adopted == 1);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].orphaned == 0);
  CHECK(listed[0].orphaned_unix_ms == 0);
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
}

TEST_CASE("the per-user session limit's refusal counts the orphans among the sessions") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-sessions-per-uid", "2"});
  CHECK(as_other_user([&] {
          const ShimClient::Options options{
              .job = "lim", .rank = 0, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB};
          auto orphan = ShimClient::connect(d.socket, options);
          if (!orphan) return orphan.error().errnum() == EACCES ? kUnreachable : 11;
          const std::vector<BlobSize> blobs = {{1, 8 * MiB}};
          if (!orphan->reserve(blobs) || !orphan->write_all(blobs, fill_pattern) ||
              !orphan->commit(proto::CommitState::Paused))
            return 12;
          orphan->close();  // this process lives on: the session stays, an orphan
          if (!eventually([&] { return d.one_orphan(); })) return 13;
          ShimClient::Options second = options;
          second.rank = 1;
          auto live = ShimClient::connect(d.socket, second);
          if (!live) return 14;
          ShimClient::Options third = options;
          third.rank = 2;
          auto refused = ShimClient::connect(d.socket, third);
          if (refused || refused.error().errnum() != EDQUOT) return 15;
          const std::string& why = refused.error().message;
          if (why.find("already has 2 sessions (1 orphaned") == std::string::npos) return 16;
          if (why.find("kept for reconnection until each reconnects with its session token or its process exits") ==
              std::string::npos)
            return 17;
          if (why.find("tmsctl status") == std::string::npos) return 18;
          return 0;
        }) == 0);
}

namespace {

// The bytes of a file, to show that nothing in it changed.
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

proto::Read read_of(uint64_t blob, uint64_t offset, uint32_t length) {
  proto::Read rd;
  rd.slot = 1;
  rd.length = length;
  rd.blob = blob;
  rd.offset = offset;
  return rd;
}

// A rank (job "lost", rank 3) pauses blob 4 and the daemon stops; `damage` does what it does to the
// rank's directory while no daemon runs; the daemon starts on the same roots and the rank reconnects
// with its token, as the shim does. `data` receives the data file's bytes before the damage.
ShimClient paused_rank_after_restart(Daemon& d, const std::function<void(const std::string& dir)>& damage,
                                     std::string& data) {
  d.start();
  auto c = d.shim({.job = "lost", .rank = 3});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{4, 12 * MiB}};
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  CHECK(d.proc.stop() == 0);
  c.close();
  data = file_bytes(dir + "/data");
  REQUIRE(data.size() >= 12 * MiB);
  damage(dir);
  d.start();
  return d.shim({.job = "lost", .rank = 3, .token = token});
}

// What every use of a rank's files with a lost record gets: its resume, a new pause and a pause
// commit are refused with `what` (the file and why) and the way out; the data file is untouched.
void check_refused_and_kept(Daemon& d, ShimClient& rank, const std::string& what, const std::string& data) {
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  const std::string kept = dir + "/data (" + std::to_string(data.size()) + " bytes) is kept untouched";
  // The resume: its first READ. It used to find the data file truncated to 0 bytes and said only
  // "blob 4 is not in the reserved set".
  auto read = rank.call(read_of(4, 0, 4 * MiB));
  REQUIRE_FALSE(read);
  INFO(read.error().message);
  CHECK(read.error().errnum() == EUCLEAN);  // the shim counts the allocation as damaged (missing)
  CHECK_THAT(read.error().message,
             Catch::StartsWith(what) && Catch::Contains(kept) && Catch::Contains("--accept-loss"));
  // Asked whether to resume first, the daemon says so: a rank with every allocation resident closes
  // the record by committing a resume; one with paused memory resumes, and is refused as above.
  auto state = rank.call(proto::PauseState{});
  REQUIRE(state);
  CHECK(std::get<proto::PauseStateReply>(*state).paused == 1);
  // A new set would truncate and punch the data file.
  auto reserve = rank.reserve({{4, 12 * MiB}});
  REQUIRE_FALSE(reserve);
  CHECK(reserve.error().errnum() == EBUSY);
  CHECK_THAT(reserve.error().message, Catch::Contains(what));
  auto commit = rank.commit(proto::CommitState::Paused);
  REQUIRE_FALSE(commit);
  CHECK(commit.error().errnum() == EBUSY);
  auto listed = d.sessions();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].disk_bytes == data.size());
  CHECK(file_bytes(dir + "/data") == data);
}

}  // namespace

TEST_CASE("a manifest deleted while the daemon was down: the data file is kept, the resume refused naming it") {
  Daemon d;
  std::string data;
  auto rank = paused_rank_after_restart(
      d, [](const std::string& dir) { REQUIRE(fs::remove(dir + "/manifest")); }, data);
  CHECK(rank.welcome().restored == 0);
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  check_refused_and_kept(d, rank,
                         "the pause record " + dir +
                             "/manifest is missing: without it tmsdiskd cannot "
                             "tell where this rank's paused memory lies in its data file",
                         data);

  // The rank's connection drops: its files are kept for it, an orphan (they may hold its memory).
  const uint64_t token = rank.welcome().token;
  rank.close();
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(file_bytes(dir + "/data") == data);
  auto again = d.shim({.job = "lost", .rank = 3, .token = token});
  CHECK(again.call(read_of(4, 0, 4 * MiB)).error().errnum() == EUCLEAN);

  // The user accepts the loss: the shim maps zeros and commits the resume. The files serve again.
  REQUIRE(again.commit(proto::CommitState::Resumed));
  auto state = again.call(proto::PauseState{});
  REQUIRE(state);
  CHECK(std::get<proto::PauseStateReply>(*state).paused == 0);
  const std::vector<BlobSize> blobs = {{4, 12 * MiB}};
  REQUIRE(again.reserve(blobs));
  REQUIRE(again.write_all(blobs, fill_pattern));
  REQUIRE(again.commit(proto::CommitState::Paused));
  REQUIRE(again.read_all(blobs, check_pattern));
  REQUIRE(again.commit(proto::CommitState::Resumed));
}

TEST_CASE("a corrupted manifest: the data file is kept, the resume refused saying it is unreadable and why") {
  Daemon d;
  std::string data;
  auto rank = paused_rank_after_restart(
      d, [](const std::string& dir) { flip_byte(dir + "/manifest", 40, 0x01); }, data);
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  check_refused_and_kept(
      d, rank,
      "the pause record " + dir + "/manifest is unreadable (checksum mismatch: the file is torn or was modified)",
      data);
}

TEST_CASE("a checksum journal deleted after the daemon died mid-pause: the chunks it sealed are kept, not removed") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "lost", .rank = 3});
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve({{4, 8 * MiB}}));
  for (uint64_t off = 0; off < 8 * MiB; off += 4 * MiB) {  // acknowledged: the shim may release the memory
    fill_pattern(4, off, c.slot(0), 4 * MiB);
    REQUIRE(c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 4, .offset = off}}));
  }
  d.proc.kill9();  // no commit, no graceful stop
  c.close();
  const std::string dir = d.rank_dir(0, "lost", 3, ::getpid());
  const std::string data = file_bytes(dir + "/data");
  REQUIRE(fs::remove(dir + "/sums"));
  d.start();
  auto rank = d.shim({.job = "lost", .rank = 3, .token = token});
  auto read = rank.call(read_of(4, 0, 4 * MiB));
  REQUIRE_FALSE(read);
  CHECK(read.error().errnum() == EUCLEAN);
  CHECK_THAT(read.error().message, Catch::StartsWith("the checksum journal " + dir +
                                                     "/sums of the pause in progress when tmsdiskd stopped "
                                                     "is missing"));
  // Every chunk passed for never written before, so the daemon deemed the files of no use to the rank:
  // a dropped connection removed them.
  rank.close();
  REQUIRE(eventually([&] { return d.one_orphan(); }));
  CHECK(file_bytes(dir + "/data") == data);
}

TEST_CASE("a root daemon refuses a root that other users can write to") {
  if (::geteuid() != 0) skip("only a daemon running as root checks who else can write to its roots");
  Daemon d;
  ::chmod(d.roots[0].c_str(), 01777);  // like /tmp or /var/tmp
  CHECK(d.proc.start(TMSDISK_DAEMON_PATH, d.args()) != 0);
  CHECK(d.proc.log().find("not writable by group or others") != std::string::npos);
  ::chmod(d.roots[0].c_str(), 0755);
  d.start();
}

TEST_CASE("per-user limits on sessions and pinned staging are enforced with a clear refusal") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-sessions-per-uid", "2", "--max-staging-per-uid-mb", "48"});
  CHECK(as_other_user([&] {
          auto a = ShimClient::connect(
              d.socket, {.job = "lim", .rank = 0, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
          if (!a) return a.error().errnum() == EACCES ? kUnreachable : 11;
          auto b = ShimClient::connect(
              d.socket, {.job = "lim", .rank = 1, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB});
          if (b || b.error().errnum() != EDQUOT) return 12;  // 64 MiB > 48 MiB of staging
          auto c = ShimClient::connect(
              d.socket, {.job = "lim", .rank = 2, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
          if (!c) return 13;
          auto e = ShimClient::connect(
              d.socket, {.job = "lim", .rank = 3, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
          if (e || e.error().errnum() != EDQUOT) return 14;  // a third session
          return 0;
        }) == 0);
}

TEST_CASE("a connection that never says HELLO is closed after the deadline") {
  Daemon d;
  d.start();
  UniqueFd silent(proto::connect_seqpacket(d.socket));
  REQUIRE(silent);
  std::vector<uint8_t> buf;
  // Blocks until the daemon closes it (10 s deadline); the CTest timeout bounds a daemon that never does.
  CHECK(proto::recv_message(silent.get(), buf) == 0);
  auto c = d.shim();  // others were never affected
  CHECK(c.welcome().slot_count > 0);
}

TEST_CASE("a client that floods requests without reading replies cannot stall the daemon") {
  LocalDaemon d;
  // Sessions to list, so that each LIST_SESSIONS answer is a few KiB: replies worth queuing.
  std::vector<ShimClient> ranks;
  for (int r = 0; r < 40; ++r) {
    auto c = ShimClient::connect(d.socket, small_session("flood", r));
    REQUIRE(c);
    ranks.push_back(std::move(c.value()));
  }
  auto flooder = ShimClient::connect(d.socket, small_session("flooder"));
  REQUIRE(flooder);
  const int sent = flood(flooder->fd(), proto::ListSessions{});  // until our buffer is full
  CHECK(sent > 0);
  // The daemon queues answers it cannot deliver until they reach kReadPauseBytes, then stops
  // reading the flooder (whose requests wait in its own socket): at most one more answer queues.
  CHECK(eventually([&] { return d.server().reply_backlog_peaks().connection_bytes >= server::kReadPauseBytes; }));
  const auto peak = d.server().reply_backlog_peaks().connection_bytes;
  INFO("most queued for the flooder: " << peak << " bytes");
  CHECK(peak <= server::kReadPauseBytes + proto::kMaxMessageSize + 1024);
  // Another client is still served.
  auto ctl = ctl::Client::connect(d.socket);
  REQUIRE(ctl);
  CHECK(ctl->list_sessions()->size() == 41);
  // The flooder was held back, not dropped: it gets an answer to every request once it reads.
  ::fcntl(flooder->fd(), F_SETFL, ::fcntl(flooder->fd(), F_GETFL) & ~O_NONBLOCK);
  int answered = 0;
  for (; answered < sent; ++answered) {
    auto reply = flooder->receive();
    if (!reply || !std::holds_alternative<proto::Sessions>(reply->body)) break;
  }
  CHECK(answered == sent);
}

TEST_CASE("replies queued for one user's connections that do not read them are bounded in all") {
  LocalDaemon d([](server::Config& c) { c.max_unread_replies_mb_per_uid = 1; });
  CHECK(as_other_user([&] {
          std::vector<ShimClient> conns;
          for (int r = 0; r < 24; ++r) {
            auto c = ShimClient::connect(d.socket, small_session("unread", r));
            if (!c) return c.error().errnum() == EACCES ? kUnreachable : 11;
            conns.push_back(std::move(c.value()));
          }
          // Each stops being read at kReadPauseBytes of answers; 24 of them would pass 1 MiB.
          for (auto& c : conns)
            if (flood(c.fd(), proto::ListSessions{}) == 0) return 12;
          auto closed = [&] {
            return std::count_if(conns.begin(), conns.end(), [](ShimClient& c) { return hung_up(c.fd()); });
          };
          if (!eventually([&] { return closed() > 0; })) return 13;    // a reply that did not fit closed its connection
          if (closed() == static_cast<long>(conns.size())) return 14;  // the others were only held back
          return 0;
        }) == 0);
  const auto peaks = d.server().reply_backlog_peaks();
  INFO("most queued for the user: " << peaks.uid_bytes << " bytes");
  CHECK(peaks.uid_bytes <= 1 * MiB);
  CHECK(peaks.uid_bytes > 1 * MiB / 2);  // it was pushed towards the bound
}

TEST_CASE("a user's connections beyond max-connections-per-uid are refused with the reason") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-connections-per-uid", "2"});
  CHECK(as_other_user([&] {
          proto::Hello control;
          control.role = static_cast<uint8_t>(proto::Role::Control);
          auto a = proto::connect_and_hello(d.socket, control, 60'000);
          if (!a) return a.error == EACCES ? kUnreachable : 11;
          auto b = proto::connect_and_hello(d.socket, control, 60'000);
          if (!b) return 12;
          auto c = proto::connect_and_hello(d.socket, control, 60'000);
          if (c || c.error != EDQUOT) return 13;
          if (c.message.find("max-connections-per-uid") == std::string::npos) return 14;
          ::close(std::exchange(a.sock, -1));  // one fewer: room for another
          bool again = eventually([&] { return bool(proto::connect_and_hello(d.socket, control, 60'000)); });
          return again ? 0 : 15;
        }) == 0);
}

TEST_CASE("allocations reserved and being reserved are bounded per user, with the limit named") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-blobs-per-uid", "1000"});
  CHECK(as_other_user([&] {
          auto a = ShimClient::connect(d.socket, small_session("blobs", 0));
          if (!a) return a.error().errnum() == EACCES ? kUnreachable : 11;
          auto b = ShimClient::connect(d.socket, small_session("blobs", 1));
          if (!b) return 12;
          auto blobs = [](uint64_t first, std::size_t n) {
            std::vector<BlobSize> out;
            for (std::size_t i = 0; i < n; ++i) out.push_back({first + i, 4096});
            return out;
          };
          // A sends 600 blobs of a set and not yet its end; B's 600 would make 1200 being sent.
          if (!a->call(proto::Reserve{.flags = proto::kReserveFirst, .blobs = blobs(1, 600)})) return 13;
          auto refused = b->call(proto::Reserve{.flags = proto::kReserveFirst, .blobs = blobs(1, 600)});
          if (refused || refused.error().errnum() != EDQUOT) return 14;
          if (refused.error().message.find("max-blobs-per-uid") == std::string::npos) return 15;
          // A completes its set: 601 reserved. B's whole set of 500 would make 1101 reserved; 300 fit.
          if (!a->call(proto::Reserve{.flags = proto::kReserveLast, .blobs = blobs(601, 1)})) return 16;
          auto too_many = b->reserve(blobs(1, 500));
          if (too_many || too_many.error().errnum() != EDQUOT) return 17;
          if (!b->reserve(blobs(1, 300))) return 18;
          return 0;
        }) == 0);
}

TEST_CASE("the daemon takes its settings from a TOML config file") {
  Daemon d(2);
  const std::string conf = d.dir / "tmsdiskd.conf";
  {
    std::ofstream f(conf);
    f << "root = [\"" << d.roots[0] << "\", \"" << d.roots[1] << "\"]\n"
      << "socket = \"" << d.socket << "\"\n"
      << "staging-budget-mb = 24\n"
      << "chunk-mb = 4\n";
  }
  REQUIRE(d.proc.start(TMSDISK_DAEMON_PATH, {"--config", conf}) == 0);
  auto c = ShimClient::connect(d.socket, {.job = "conf"});
  REQUIRE(c);
  CHECK(c->welcome().staging_budget_bytes == 24 * MiB);  // the file's defaults, not the built-in ones
  CHECK(c->welcome().chunk_bytes == 4 * MiB);
  REQUIRE(c->reserve({{1, 8 * MiB}}));  // striped over both roots from the file
  CHECK(c->write_all({{1, 8 * MiB}}, fill_pattern));
  CHECK(fs::exists(d.rank_dir(1, "conf", 0, ::getpid()) + "/data"));

  DaemonProcess bad;
  const std::string missing = d.dir / "missing.conf";
  CHECK(bad.start(TMSDISK_DAEMON_PATH, {"--config", missing}) != 0);  // named but absent: an error, said so
  CHECK(bad.log().find("missing.conf") != std::string::npos);

  // Keys renamed so that each quantity has one name are refused with their new name, not ignored
  // (an old file would otherwise run with the built-in staging budget and chunk size).
  for (const auto& [old_key, new_key] :
       {std::pair{"staging-mb", "staging-budget-mb"}, std::pair{"slot-mb", "chunk-mb"}}) {
    const std::string old_conf = d.dir / (std::string(old_key) + ".conf");
    std::ofstream(old_conf) << "root = [\"" << d.roots[0] << "\"]\n" << old_key << " = 4\n";
    DaemonProcess renamed;
    CHECK(renamed.start(TMSDISK_DAEMON_PATH, {"--config", old_conf, "--socket", d.dir / "renamed.sock"}) != 0);
    CHECK(renamed.log().find(std::string("use ") + new_key + " = ") != std::string::npos);
  }
}

namespace {

// A memfd holding `text`, standing in for the POSIX handle of GPU memory.
UniqueFd memory_fd(const std::string& text) {
  UniqueFd fd(::memfd_create("ipc-test-memory", MFD_CLOEXEC));
  REQUIRE(fd);
  REQUIRE(::pwrite(fd.get(), text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()));
  return fd;
}

std::string read_text(int fd, std::size_t n) {
  std::string out(n, '\0');
  REQUIRE(::pread(fd, out.data(), n, 0) == static_cast<ssize_t>(n));
  return out;
}

// The last IPC_USERS the exporter was told for `id` (or -1).
int64_t users_told(ShimClient& c, uint64_t id) {
  int64_t last = -1;
  for (auto& n : c.notices())
    if (auto* u = std::get_if<proto::IpcUsers>(&n.body); u && u->export_id == id) last = u->importers;
  return last;
}

}  // namespace

TEST_CASE(
    "legacy IPC through the daemon - the fd reaches the importer, revokes wait for closes and for importers to exit") {
  Daemon d;
  d.start();
  auto exporter = d.shim({.job = "ipc", .rank = 0});
  auto importer = d.shim({.job = "ipc", .rank = 1});

  // Only GPU memory handles are taken: none at all, or a pipe, is refused.
  CHECK(expect_error(exporter, proto::IpcExport{.export_id = 0, .bytes = 4096, .device = 0}) == EINVAL);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  UniqueFd pr(p[0]), pw(p[1]);
  auto refused = exporter.call(proto::IpcExport{.export_id = 0, .bytes = 4096, .device = 0}, pr.get());
  CHECK((!refused && refused.error().errnum() == EINVAL));

  UniqueFd mem = memory_fd("device bytes");
  auto exported = exporter.call(proto::IpcExport{.export_id = 0, .bytes = 4096, .device = 0}, mem.get());
  REQUIRE(exported);
  const uint64_t id = std::get<proto::IpcExported>(*exported).export_id;
  CHECK(id != 0);

  CHECK(expect_error(exporter, proto::IpcOpen{.export_id = id}) == EINVAL);  // its own export
  CHECK(expect_error(importer, proto::IpcOpen{.export_id = id + 1}) == ENOENT);
  UniqueFd got;
  auto opened = importer.call(proto::IpcOpen{.export_id = id}, -1, &got);
  REQUIRE(opened);
  const auto& info = std::get<proto::IpcOpened>(*opened);
  CHECK(info.bytes == 4096);
  CHECK(info.exporter_pid == ::getpid());
  REQUIRE(got);
  CHECK(read_text(got.get(), 12) == "device bytes");  // the very memory the exporter handed over

  // Open elsewhere: a pause's revoke is refused, and the exporter was told who holds it.
  CHECK(expect_error(exporter, proto::IpcRevoke{.export_id = id, .freed = 0}) == EBUSY);
  CHECK(users_told(exporter, id) == 1);
  REQUIRE(importer.call(proto::IpcClose{.export_id = id}));
  REQUIRE(exporter.call(proto::IpcRevoke{.export_id = id, .freed = 0}));
  CHECK(users_told(exporter, id) == 0);
  CHECK(expect_error(importer, proto::IpcOpen{.export_id = id}) == EAGAIN);  // the exporter paused it

  // Resumed: the new memory goes out under the same id.
  UniqueFd mem2 = memory_fd("new bytes");
  REQUIRE(exporter.call(proto::IpcExport{.export_id = id, .bytes = 4096, .device = 0}, mem2.get()));
  REQUIRE(importer.call(proto::IpcOpen{.export_id = id}, -1, &got));
  CHECK(read_text(got.get(), 9) == "new bytes");

  // The importer loses its connection without closing, but lives (it may still map the memory): its
  // open stays, and the exporter cannot pause the memory under it.
  importer.close();
  CHECK(expect_error(exporter, proto::IpcRevoke{.export_id = id, .freed = 0}) == EBUSY);
  // An importer that exits releases what it had open.
  pid_t child = ::fork();
  if (child == 0) {
    auto c = ShimClient::connect(d.socket,
                                 {.job = "ipc", .rank = 4, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
    if (!c) ::_exit(11);
    UniqueFd mine;
    ::_exit(c->call(proto::IpcOpen{.export_id = id}, -1, &mine) ? 0 : 12);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  // Two processes had it open; once the child is gone, one (the revoke, refused, fetches the notices).
  CHECK(eventually([&] {
    (void)exporter.call(proto::IpcRevoke{.export_id = id, .freed = 0});
    return users_told(exporter, id) == 1;
  }));
  bool told_two = false;
  for (auto& n : exporter.notices())
    if (auto* u = std::get_if<proto::IpcUsers>(&n.body); u && u->export_id == id && u->importers == 2) told_two = true;
  CHECK(told_two);
  // The exporter freed the allocation: the id names nothing any more.
  REQUIRE(exporter.call(proto::IpcRevoke{.export_id = id, .freed = 1}));
  auto late = d.shim({.job = "ipc", .rank = 3});
  CHECK(expect_error(late, proto::IpcOpen{.export_id = id}) == ENOENT);
}

TEST_CASE("legacy IPC through the daemon - a user of another uid cannot open an export, even knowing its id") {
  if (::geteuid() != 0) skip("needs root to switch to another uid");
  Daemon d;
  d.start();
  auto exporter = d.shim({.job = "ipc", .rank = 0});
  UniqueFd mem = memory_fd("device bytes");
  auto exported = exporter.call(proto::IpcExport{.export_id = 0, .bytes = 4096, .device = 0}, mem.get());
  REQUIRE(exported);
  const uint64_t id = std::get<proto::IpcExported>(*exported).export_id;
  CHECK(as_other_user([&] {
          auto c = ShimClient::connect(
              d.socket, {.job = "ipc", .rank = 2, .staging_budget_bytes = 8 * MiB, .chunk_bytes = 4 * MiB});
          if (!c) return c.error().errnum() == EACCES ? kUnreachable : 11;
          auto r = c->call(proto::IpcOpen{.export_id = id});
          return !r && r.error().errnum() == ENOENT ? 0 : 12;
        }) == 0);
}

TEST_CASE("descriptors a client passes with messages that take none are closed, none kept") {
  Daemon d;
  d.start();
  auto c = d.shim();
  // Three descriptors on one message (the first taken, the others extra), on a message that takes
  // none: a REPORT, which has no answer.
  Pipes pipes(3);
  auto bytes = proto::encode(1, proto::Report{});
  REQUIRE(!bytes.empty());
  REQUIRE(send_with_fds(c.fd(), bytes, pipes.write_ends()) == static_cast<ssize_t>(bytes.size()));
  pipes.writers.clear();
  CHECK(eventually([&] { return pipes.all_closed(); }));
  // The session is unharmed.
  CHECK(c.call(proto::IpcClose{.export_id = 1}).error().errnum() == ENOENT);
}

TEST_CASE("more descriptors than a message may carry are refused as such, and all of them are closed") {
  Daemon d;
  d.start();
  auto c = d.shim();
  Pipes pipes(proto::kMaxPassedFds + 4);
  auto bytes = proto::encode(77, proto::Report{});  // 28 bytes: nothing about the message is too large
  REQUIRE(send_with_fds(c.fd(), bytes, pipes.write_ends()) == static_cast<ssize_t>(bytes.size()));
  pipes.writers.clear();
  auto reply = c.receive();
  REQUIRE(reply);
  CHECK(reply->request_id == 77);  // answered as the request it is
  auto* e = std::get_if<proto::ErrorReply>(&reply->body);
  REQUIRE(e);
  INFO(e->message);
  CHECK(e->message.find("too many descriptors passed with one message") != std::string::npos);
  CHECK(e->message.find("64 KiB") == std::string::npos);
  CHECK(eventually([&] { return pipes.all_closed(); }));    // those the daemon took, and those it never got
  CHECK(!c.receive());                                      // a protocol violation: the connection is closed
  CHECK(d.shim({.job = "next"}).welcome().slot_count > 0);  // and the daemon serves others
}

TEST_CASE("a rank whose session ended with nothing to keep reconnects with its token and starts afresh") {
  Daemon d;
  d.start();
  auto first = d.shim({.job = "again", .rank = 0});
  const uint64_t token = first.welcome().token;
  const std::string dir = first.welcome().rank_dir;
  first.close();  // nothing paused: the session and its directory go
  CHECK(eventually([&] { return !fs::exists(dir); }));
  auto again = ShimClient::connect(
      d.socket, {.job = "again", .rank = 0, .staging_budget_bytes = 32 * MiB, .chunk_bytes = 4 * MiB, .token = token});
  INFO((again ? "" : again.error().describe()));
  REQUIRE(again);
  CHECK(again->welcome().adopted == 0);
  CHECK(again->welcome().rank_dir == dir);
  CHECK(fs::exists(dir));
  REQUIRE(again->reserve({{1, 4 * MiB}}));  // a working session
}

// ------------------------------------------------------------------------------------------------
// Chunks that need not move (README.md, "What moves").

namespace {

// WRITEs chunk `off` of `blob` (4 MiB chunks) from slot 0 filled with the pattern: the WRITTEN, or the error.
Result<proto::Written> write_one(ShimClient& c, uint64_t blob, uint64_t off) {
  fill_pattern(blob, off, c.slot(0), 4 * MiB);
  auto r = c.call(proto::Write{{.slot = 0, .length = 4 * MiB, .blob = blob, .offset = off}});
  if (!r) return std::move(r).error();
  if (!std::holds_alternative<proto::Written>(*r)) return make_error(EPROTO, "WRITE answered with something else");
  return std::get<proto::Written>(*r);
}

struct timespec mtime_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mtim;
}

}  // namespace

TEST_CASE("zero chunks are neither written nor read, and a pause of unchanged bytes writes nothing, across a restart") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "skip", .rank = 0});
  const uint64_t token = c.welcome().token;
  // Blob 1: chunks 1 and 2 (of 4) are zero; blob 2: all data.
  const std::vector<BlobSize> blobs = {{1, 16 * MiB}, {2, 8 * MiB}};
  const std::vector<proto::ChunkRun> zero = {{1, 1, 2}};
  const std::string dir = d.rank_dir(0, "skip", 0, ::getpid());
  // Pauses and returns how many chunks were unchanged; *reserved gets the data file's mtime once the
  // reservation (which punches the zero chunks' ranges) is made.
  auto pause = [&](ShimClient& s, struct timespec* reserved = nullptr) {
    REQUIRE(s.reserve(blobs, zero));
    if (reserved) *reserved = mtime_of(dir + "/data");
    int unchanged = 0;
    for (const auto& [blob, off] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {1, 12 * MiB}, {2, 0}, {2, 4 * MiB}}) {
      auto w = write_one(s, blob, off);
      INFO((w ? "" : w.error().describe()));
      REQUIRE(w);
      unchanged += w->unchanged;
    }
    REQUIRE(s.commit(proto::CommitState::Paused));
    return unchanged;
  };
  auto resume = [&](ShimClient& s) {
    for (const auto& [blob, off] :
         std::vector<std::pair<uint64_t, uint64_t>>{{1, 0}, {1, 12 * MiB}, {2, 0}, {2, 4 * MiB}}) {
      auto r = s.call(proto::Read{{.slot = 0, .length = 4 * MiB, .blob = blob, .offset = off}});
      INFO((r ? "" : r.error().describe()));
      REQUIRE(r);
      CHECK(check_pattern(blob, off, s.slot(0), 4 * MiB));
    }
    REQUIRE(s.commit(proto::CommitState::Resumed));
  };

  CHECK(pause(c) == 0);
  // A zero chunk has nothing stored: a WRITE or READ of it is refused, saying so.
  for (const proto::Message& m :
       {proto::Message{proto::Write{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = 4 * MiB}}},
        proto::Message{proto::Read{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = 8 * MiB}}}}) {
    auto refused = c.call(m);
    REQUIRE_FALSE(refused);
    CHECK(refused.error().errnum() == EINVAL);
    CHECK_THAT(refused.error().describe(), Catch::Contains("reserved as zero"));
  }
  struct stat st {};
  REQUIRE(::stat((dir + "/data").c_str(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 < 20 * MiB);  // 16 MiB of data, not 24
  resume(c);

  // The same bytes again: every chunk is answered unchanged and the data file is not written.
  struct timespec before {};
  CHECK(pause(c, &before) == 4);
  const auto after = mtime_of(dir + "/data");
  CHECK((after.tv_sec == before.tv_sec && after.tv_nsec == before.tv_nsec));
  resume(c);

  // A daemon restarted after the resume adopts the committed manifest: still unchanged.
  CHECK(d.proc.stop() == 0);
  c.close();
  d.start();
  auto again = d.shim({.job = "skip", .rank = 0, .token = token});
  CHECK(pause(again) == 4);
  resume(again);

  // Restarted mid-pause: nothing is provably held, every chunk is rewritten.
  REQUIRE(again.reserve(blobs, zero));
  CHECK(d.proc.stop() == 0);
  again.close();
  d.start();
  auto third = d.shim({.job = "skip", .rank = 0, .token = token});
  CHECK(pause(third) == 0);
  resume(third);
}

TEST_CASE("a data file changed outside tmsdiskd while the memory is resident is written again, across a restart too") {
  Daemon d;
  d.start();
  auto c = d.shim({.job = "damaged", .rank = 0});
  const uint64_t token = c.welcome().token;
  const std::vector<BlobSize> blobs = {{1, 16 * MiB}};
  const std::string data = d.rank_dir(0, "damaged", 0, ::getpid()) + "/data";
  // Pauses all four chunks and returns how many were unchanged; resumes them, each verified.
  auto pause = [&](ShimClient& s) {
    REQUIRE(s.reserve(blobs));
    int unchanged = 0;
    for (uint64_t off = 0; off < 16 * MiB; off += 4 * MiB) {
      auto w = write_one(s, 1, off);
      INFO((w ? "" : w.error().describe()));
      REQUIRE(w);
      unchanged += w->unchanged;
    }
    REQUIRE(s.commit(proto::CommitState::Paused));
    return unchanged;
  };
  auto resume = [&](ShimClient& s) {
    for (uint64_t off = 0; off < 16 * MiB; off += 4 * MiB) {
      auto r = s.call(proto::Read{{.slot = 0, .length = 4 * MiB, .blob = 1, .offset = off}});
      INFO((r ? "" : r.error().describe()));
      REQUIRE(r);
      CHECK(check_pattern(1, off, s.slot(0), 4 * MiB));
    }
    REQUIRE(s.commit(proto::CommitState::Resumed));
  };
  CHECK(pause(c) == 0);
  resume(c);
  CHECK(pause(c) == 4);
  resume(c);

  // A byte flipped while the memory is resident: the next pause writes the file's chunks again.
  flip_byte(data, 4 * MiB + 100, 0x01);
  CHECK(pause(c) == 0);
  resume(c);

  // The same across a restart: the manifest's word is not enough.
  flip_byte(data, 8 * MiB + 100, 0x01);
  CHECK(d.proc.stop() == 0);
  c.close();
  d.start();
  auto again = d.shim({.job = "damaged", .rank = 0, .token = token});
  CHECK(pause(again) == 0);
  resume(again);
  CHECK(pause(again) == 4);  // rewritten and committed: trusted again
  resume(again);

  // Another file put in its place (a copy, one byte flipped) while the daemon is down.
  CHECK(d.proc.stop() == 0);
  again.close();
  {
    std::ifstream in(data, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() >= 16 * MiB);
    bytes[12 * MiB + 100] = static_cast<char>(bytes[12 * MiB + 100] ^ 0x01);
    std::ofstream(data + ".new", std::ios::binary) << bytes;
    REQUIRE(::rename((data + ".new").c_str(), data.c_str()) == 0);
  }
  d.start();
  auto third = d.shim({.job = "damaged", .rank = 0, .token = token});
  CHECK(pause(third) == 0);
  resume(third);

  // Another file put in its place while the daemon runs: the next pause writes to the file at that
  // name, not to the one the daemon had open, so a daemon restarted while the rank is paused finds
  // what it paused.
  {
    std::ifstream in(data, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() >= 16 * MiB);
    bytes[100] = static_cast<char>(bytes[100] ^ 0x01);
    std::ofstream(data + ".new", std::ios::binary) << bytes;
    REQUIRE(::rename((data + ".new").c_str(), data.c_str()) == 0);
  }
  CHECK(pause(third) == 0);
  CHECK(d.proc.stop() == 0);
  third.close();
  d.start();
  auto fourth = d.shim({.job = "damaged", .rank = 0, .token = token});
  resume(fourth);
}

TEST_CASE("chunks reserved are bounded per user, zero chunks included, with the limit named") {
  if (::geteuid() != 0) skip("needs root to act as another user (root itself is exempt from per-user limits)");
  Daemon d;
  d.start({"--max-chunks-per-uid", "40"});
  CHECK(as_other_user([&] {
          auto a = ShimClient::connect(d.socket, small_session("chunks", 0));
          if (!a) return a.error().errnum() == EACCES ? kUnreachable : 11;
          const uint64_t chunk = a->welcome().chunk_bytes;
          // 40 chunks, all zero: no disk space, yet each is a record the daemon keeps.
          if (!a->reserve({{1, 40 * chunk}}, {{1, 0, 40}})) return 12;
          auto refused = a->reserve({{1, 41 * chunk}}, {{1, 0, 41}});
          if (refused || refused.error().errnum() != EDQUOT) return 13;
          if (refused.error().message.find("max-chunks-per-uid") == std::string::npos) return 14;
          auto b = ShimClient::connect(d.socket, small_session("chunks", 1));
          if (!b) return 15;
          auto other = b->reserve({{1, chunk}});  // A's 40 are still reserved
          if (other || other.error().errnum() != EDQUOT) return 16;
          return 0;
        }) == 0);
}
