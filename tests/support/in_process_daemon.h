// SPDX-License-Identifier: Apache-2.0
// A tmsdiskd server running on a thread of the test process, for tests that inject I/O faults into
// its engine. Header-only: include it from targets that link tmsdisk_server.
#pragma once

#include <catch2/catch.hpp>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "server.h"

namespace tmsdisk::testing {

struct InProcessDaemon {
  std::unique_ptr<server::Server> srv;
  std::thread loop;

  InProcessDaemon(server::Config cfg, std::function<int(const io::Request&, int)> fault) {
    cfg.io_fault = std::move(fault);
    auto s = server::Server::create(cfg);
    INFO((s ? "" : s.error().describe()));
    REQUIRE(s);
    srv = std::move(s.value());
    loop = std::thread([this] { (void)srv->run(); });
  }
  ~InProcessDaemon() {
    srv->stop();
    loop.join();
  }
  InProcessDaemon(const InProcessDaemon&) = delete;
  InProcessDaemon& operator=(const InProcessDaemon&) = delete;
};

}  // namespace tmsdisk::testing
