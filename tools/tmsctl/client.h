// SPDX-License-Identifier: Apache-2.0
// A blocking client of tmsdiskd's control protocol, as used by tmsctl (and by tests). Every error's
// message is whole (the daemon's own words, or what failed here with its cause): print it as it is.
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
  const std::string& first_root() const noexcept { return welcome_.rank_dir; }
  // The daemon's chunk size and staging budgets (default and largest), for checking a launch.
  const proto::Welcome& welcome() const noexcept { return welcome_; }
  const std::string& socket_path() const noexcept { return path_; }

 private:
  Client(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Status send(const proto::Message& m);
  // Receives the next message answering the current request; ERROR replies become errors.
  Result<proto::Message> receive();

  UniqueFd fd_;
  std::string path_;
  proto::Welcome welcome_;
  uint64_t next_request_ = 1;
};

}  // namespace tmsdisk::ctl
