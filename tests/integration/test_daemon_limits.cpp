// SPDX-License-Identifier: Apache-2.0
// tmsdiskd, per-user limits (sessions, staging, connections, queued replies, reservations) with the
// refusal that names them, and the settings a TOML config file gives.
// A real daemon on a temp socket and temp roots, driven by a client that plays the shim's role; each
// TEST_CASE runs as its own CTest test, and one that cannot run here exits 77.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <utility>

#include "client.h"
#include "daemon_fixture.h"
#include "in_process_daemon.h"
#include "other_user.h"
#include "server.h"
#include "test_support.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace fs = std::filesystem;
using namespace tmsdisk;
using namespace tmsdisk::testing;
using proto::BlobSize;

namespace {

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
  LocalDaemon d([](server::Config& c) { c.max_unread_replies_bytes_per_uid = 1 * server::kMiB; });
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

TEST_CASE("a staging budget too small for two of the daemon's chunks gets chunks of half of it") {
  Daemon d;
  d.start();
  // 1 MiB of staging (TMS_DISK_BACKUP_CHUNK_MB=1), the chunk size left to the daemon (its default: 8 MiB).
  auto c = ShimClient::connect(d.socket, {.job = "small", .staging_budget_bytes = 1 * MiB, .chunk_bytes = 0});
  INFO((c ? "" : c.error().describe()));
  REQUIRE(c);
  CHECK(c->welcome().chunk_bytes == 512u << 10);
  CHECK(c->welcome().slot_count == 2);
  const std::vector<proto::BlobSize> blobs = {{1, 3 * MiB + 4096}};
  REQUIRE(c->reserve(blobs));
  REQUIRE(c->write_all(blobs, fill_pattern));
  REQUIRE(c->read_all(blobs, check_pattern));
  // A chunk size the rank asks for itself is still held to the rule.
  auto fixed = ShimClient::connect(d.socket, {.job = "fixed", .staging_budget_bytes = 1 * MiB, .chunk_bytes = 4 * MiB});
  REQUIRE_FALSE(fixed);
  CHECK(fixed.error().errnum() == EINVAL);
}
