// SPDX-License-Identifier: Apache-2.0
// A blocking client of tmsdiskd's control protocol, as used by tmsctl (and by tests).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::ctl {

class Client {
 public:
  // Connects and says HELLO as a control client. The error names the socket and what to do.
  static Result<Client> connect(const std::string& socket_path);

  // Every session the caller may see (all pages).
  Result<std::vector<proto::SessionInfo>> list_sessions();

  // Pauses or resumes the matching ranks and waits for every answer. `progress` is called with each
  // PROGRESS message the ranks send along the way.
  Result<std::vector<proto::RankResult>> control(const proto::Control& request,
                                                 const std::function<void(const proto::Progress&)>& progress = {});

  Result<proto::GcResult> gc();

  // The daemon's first storage root (from its WELCOME).
  const std::string& first_root() const noexcept { return first_root_; }
  const std::string& socket_path() const noexcept { return path_; }

 private:
  Client(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Status send(const proto::Message& m);
  // Receives the next message answering the current request; ERROR replies become errors.
  Result<proto::Message> receive();

  UniqueFd fd_;
  std::string path_;
  std::string first_root_;
  uint64_t next_request_ = 1;
};

}  // namespace tmsdisk::ctl
