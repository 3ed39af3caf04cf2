// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, legacy IPC brokered by the daemon, and descriptors a client passes with its messages.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "daemon_fixture.h"
#include "fd_passing.h"
#include "other_user.h"
#include "test_support.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

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
