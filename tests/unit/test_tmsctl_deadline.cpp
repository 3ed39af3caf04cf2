// SPDX-License-Identifier: Apache-2.0
// tmsctl's deadlines (tools/tmsctl/deadline.h): the defaults each command waits under, --timeout, and
// a client that gives up on a daemon that accepts its connection but never answers.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <string>

#include "client.h"
#include "deadline.h"
#include "test_support.h"

using namespace tmsdisk;
using namespace tmsdisk::ctl;
using tmsdisk::testing::TempDir;
using tmsdisk::testing::test_tmp_root;
using namespace std::chrono_literals;

TEST_CASE("without --timeout the daemon's answers get 30 s, and a pause goes on while the ranks report progress") {
  const Deadline::Clock::time_point t0{};
  CommandDeadlines d = command_deadlines(0, t0);

  CHECK(d.answer.limit() == kAnswerLimit);
  CHECK(kAnswerLimit == 30s);
  CHECK_FALSE(d.answer.renewed());
  CHECK_FALSE(d.answer.passed(t0 + 29s));
  d.answer.heard(t0 + 20s);  // a fixed limit is not extended
  CHECK(d.answer.passed(t0 + 30s));

  CHECK(d.ranks.limit() == kSilenceLimit);
  CHECK(d.ranks.renewed());
  // The shim waits up to 60 s, without a word, for the CUDA calls in flight before a pause.
  CHECK(kSilenceLimit > 60s);
  // Progress every minute for an hour (a pause of a few TB): never given up.
  for (int minute = 1; minute <= 60; ++minute) {
    CHECK_FALSE(d.ranks.passed(t0 + std::chrono::minutes(minute)));
    d.ranks.heard(t0 + std::chrono::minutes(minute));
  }
  // Then silence: given up kSilenceLimit after the last word.
  CHECK_FALSE(d.ranks.passed(t0 + 60min + kSilenceLimit - 1ms));
  CHECK(d.ranks.passed(t0 + 60min + kSilenceLimit));
  CHECK(d.ranks.poll_ms(t0 + 60min) == 120000);
}

TEST_CASE("--timeout S gives every command S seconds from its start, progress or not") {
  const Deadline::Clock::time_point t0{};
  CommandDeadlines d = command_deadlines(2.5, t0);
  for (Deadline* x : {&d.answer, &d.ranks}) {
    CHECK(x->limit() == 2500ms);
    CHECK_FALSE(x->renewed());
    x->heard(t0 + 2s);
    CHECK_FALSE(x->passed(t0 + 2499ms));
    CHECK(x->passed(t0 + 2500ms));
    CHECK(x->poll_ms(t0) == 2500);
    CHECK(x->poll_ms(t0 + 3s) == 0);  // passed: poll takes only what has already come
    CHECK(x->seconds_text() == "2.5 s");
  }
  CHECK(command_deadlines(10, t0).answer.seconds_text() == "10 s");
  CHECK(command_deadlines(0.0001, t0).answer.limit() == 1ms);  // never "no time at all"
}

TEST_CASE("a client gives up on a daemon that accepts but never answers, and names its socket") {
  // A listener that never accepts: the kernel completes the connection and queues HELLO, as for a
  // daemon stopped with SIGSTOP.
  TempDir dir(test_tmp_root());
  const std::string path = dir / "silent.sock";
  int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(addr.sun_path));
  std::strcpy(addr.sun_path, path.c_str());
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(listener, 8) == 0);

  const auto start = std::chrono::steady_clock::now();
  auto c = Client::connect(path, Deadline::fixed(300ms));
  const auto took = std::chrono::steady_clock::now() - start;
  REQUIRE_FALSE(c);
  INFO(c.error().message);
  CHECK(c.error().errnum() == ETIMEDOUT);
  CHECK(c.error().message.find("tmsdiskd at " + path + " did not answer within 0.3 s") != std::string::npos);
  CHECK(c.error().message.find("stopped or overloaded") != std::string::npos);
  CHECK(took < 10s);  // it gave up rather than waiting on (how soon is for benchmarks, not tests)
  ::close(listener);
}
