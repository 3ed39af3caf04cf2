// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's server: accepts shim and tmsctl connections, owns sessions, staging buffers and their
// rank stores, and moves chunks between staging slots and files through the I/O engine.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "connection.h"  // kReadPauseBytes, kMaxOutboxBytes: the bounds on replies queued
#include "tmsdisk/common/result.h"

namespace tmsdisk::server {

// What is wrong with `config` as a whole: settings each valid alone but not together, named by the
// options that set them (tmsdiskd reports these before starting; Server::create() refuses them too).
std::vector<std::string> inconsistencies(const Config& config);

class Server {
 public:
  // Opens the roots (refusing tmpfs unless allowed), takes the single-instance lock, sweeps dead
  // ranks, and binds the socket (or adopts Config::listen_fd).
  static Result<std::unique_ptr<Server>> create(Config config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Serves until stop() is called (or, with exit_when_idle, the last session ends).
  Status run();

  // Asks run() to return. Async-signal-safe: a SIGTERM handler may call it.
  void stop() noexcept;

  const Config& config() const noexcept;

  // The most the daemon has held at once in replies queued for peers that do not read them, for one
  // connection and for one user, since it started (any thread; tests check the bounds with it).
  struct ReplyBacklog {
    uint64_t connection_bytes = 0;
    uint64_t uid_bytes = 0;
  };
  ReplyBacklog reply_backlog_peaks() const noexcept;

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tmsdisk::server
