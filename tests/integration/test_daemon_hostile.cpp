// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, what the daemon refuses: malformed messages, out-of-range requests, names and paths built
// to escape a root, a second daemon, another uid, a silent connection.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "client.h"
#include "daemon_fixture.h"
#include "other_user.h"
#include "test_support.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

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

}  // namespace

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

TEST_CASE("a root daemon refuses a root that other users can write to") {
  if (::geteuid() != 0) skip("only a daemon running as root checks who else can write to its roots");
  Daemon d;
  ::chmod(d.roots[0].c_str(), 01777);  // like /tmp or /var/tmp
  CHECK(d.proc.start(TMSDISK_DAEMON_PATH, d.args()) != 0);
  CHECK(d.proc.log().find("not writable by group or others") != std::string::npos);
  ::chmod(d.roots[0].c_str(), 0755);
  d.start();
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
