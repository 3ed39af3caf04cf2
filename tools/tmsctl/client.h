// SPDX-License-Identifier: Apache-2.0
// A blocking client of tmsdiskd's control protocol, as used by tmsctl (and by tests). Every error's
// message is whole (the daemon's own words, or what failed here with its cause): print it as it is.
// Every wait for the daemon is bounded by a Deadline (deadline.h): a daemon that does not answer in
// time is an ETIMEDOUT error naming its socket and what to check.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "deadline.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::ctl {

// What a pause or resume came to by the time it ended or its deadline passed.
struct ControlAnswer {
  // The ranks that answered (or whose exit the daemon reported), sorted by job, rank and pid.
  std::vector<proto::RankResult> results;
  // The ranks asked that did not answer before the deadline (tmsctl's or the daemon's), sorted the
  // same way. They may still finish: `tmsctl status` shows their state.
  std::vector<proto::RankTarget> unanswered;
};

class Client {
 public:
  // Connects and says HELLO as a control client, both within `deadline`. The error names the socket
  // and what to do.
  static Result<Client> connect(const std::string& socket_path,
                                const Deadline& deadline = Deadline::fixed(kAnswerLimit));

  // Every session the caller may see (all pages), within `deadline`. `host_tier` (if set) receives the
  // node's host-tier budget and use, as the last page said them.
  struct HostTier {
    uint64_t budget_bytes = 0;
    uint64_t used_bytes = 0;
  };
  Result<std::vector<proto::SessionInfo>> list_sessions(const Deadline& deadline = Deadline::fixed(kAnswerLimit),
                                                        HostTier* host_tier = nullptr);

  // Pauses or resumes the matching ranks and waits for every answer, or until `deadline` passes once
  // the daemon has said which ranks it asked: the ranks without an answer are then in `unanswered`
  // (not an error). Every message of the daemon about this request counts as heard (a silence limit
  // starts again). `progress` is called with each PROGRESS message the ranks send along the way.
  // After a deadline the daemon may still route that request: connect again for another one.
  // `waiting` (if set) is called about once a second while nothing comes, once the daemon has said
  // whom it asked: with the ranks that have not answered yet and how long nothing has come.
  using Waiting = std::function<void(const std::vector<proto::RankTarget>& silent, std::chrono::milliseconds quiet)>;
  Result<ControlAnswer> control(const proto::Control& request, Deadline deadline = Deadline::silence(kSilenceLimit),
                                const std::function<void(const proto::Progress&)>& progress = {},
                                const Waiting& waiting = {});
  Result<ControlAnswer> control(const proto::Control& request,
                                const std::function<void(const proto::Progress&)>& progress) {
    return control(request, Deadline::silence(kSilenceLimit), progress);
  }

  Result<proto::GcResult> gc(const Deadline& deadline = Deadline::fixed(kAnswerLimit));

  // The daemon's first storage root (from its WELCOME).
  const std::string& first_root() const noexcept { return welcome_.rank_dir; }
  // The daemon's chunk size and staging budgets (default and largest), for checking a launch.
  const proto::Welcome& welcome() const noexcept { return welcome_; }
  const std::string& socket_path() const noexcept { return path_; }

 private:
  Client(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Status send(const proto::Message& m, const Deadline& deadline);
  // Receives the next message answering the current request; ERROR replies become errors, and so
  // does a deadline that passes first (ETIMEDOUT).
  Result<proto::Message> receive(const Deadline& deadline);
  // "tmsdiskd at S did not answer within N s; ...": the daemon is stopped, wedged or swamped.
  Error silent_daemon(const Deadline& deadline) const;

  UniqueFd fd_;
  std::string path_;
  proto::Welcome welcome_;
  uint64_t next_request_ = 1;
};

}  // namespace tmsdisk::ctl
