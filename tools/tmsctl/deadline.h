// SPDX-License-Identifier: Apache-2.0
// How long tmsctl waits for tmsdiskd. Every wait is bounded: a daemon that is stopped
// (SIGSTOP) or wedged, or a rank that never answers (any user's, under root's `pause --all`), must
// not hang a command; tmsctl then prints what it has, names what did not answer, and exits 1.
//
// Two kinds of limit:
//  - fixed: give up this long after the command started. --timeout S sets one for every command,
//    and the daemon's simple answers (HELLO, status, gc) get kAnswerLimit by default.
//  - silence: give up once nothing has come for this long; every message starts it again. A pause or
//    resume legitimately takes minutes (hundreds of GB at a few GB/s), so no fixed default would fit:
//    while the ranks report progress it goes on, and it stops once they have all gone quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tmsdisk::ctl {

// The daemon answers HELLO, LIST_SESSIONS and GC from its event loop, within milliseconds when it is
// well. 30 s leaves room for a loop held up by a slow disk (a sweep, an fsync) while a script that
// polls `tmsctl status` still hears about a stopped daemon in well under a minute.
inline constexpr std::chrono::seconds kAnswerLimit{30};
// A rank reports progress at most every 100 ms while data moves (interposer/core/transfer.cpp), but
// nothing while it waits for the CUDA calls in flight to finish before a pause, which it does for up
// to 60 s (kDrainTimeoutMs in interposer/core/engine.cpp) and then refuses: the silence limit must
// exceed that, with room for the synchronization, disk reservation and commit around the transfer.
inline constexpr std::chrono::seconds kSilenceLimit{120};

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // Gives up `limit` after `start`.
  static Deadline fixed(std::chrono::milliseconds limit, Clock::time_point start = Clock::now()) {
    return Deadline(limit, start, false);
  }
  // Gives up once nothing has been heard for `limit` since `start` or the last heard().
  static Deadline silence(std::chrono::milliseconds limit, Clock::time_point start = Clock::now()) {
    return Deadline(limit, start, true);
  }

  // Something came from the daemon: a silence limit starts again; a fixed one stays.
  void heard(Clock::time_point now = Clock::now()) {
    if (renewed_) at_ = now + limit_;
  }
  bool passed(Clock::time_point now = Clock::now()) const { return now >= at_; }
  // What is left, in ms for poll(): 0 once passed (poll then takes only what has already arrived).
  int poll_ms(Clock::time_point now = Clock::now()) const {
    if (now >= at_) return 0;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(at_ - now).count();
    return ms > INT32_MAX ? INT32_MAX : static_cast<int>(ms);
  }
  std::chrono::milliseconds limit() const noexcept { return limit_; }
  bool renewed() const noexcept { return renewed_; }
  // The limit in words for messages: "10 s", "0.5 s".
  std::string seconds_text() const;

 private:
  Deadline(std::chrono::milliseconds limit, Clock::time_point start, bool renewed)
      : limit_(limit), at_(start + limit), renewed_(renewed) {}
  std::chrono::milliseconds limit_;
  Clock::time_point at_;
  bool renewed_;
};

// The deadlines of one command, from --timeout (`timeout_s`, 0 when not given) and the time it started.
struct CommandDeadlines {
  Deadline answer;  // the daemon's answers: HELLO of every command, status, gc, env, run
  Deadline ranks;   // pause and resume: the ranks' answers, routed by the daemon
};
// --timeout S: both give up S seconds after the start, whatever comes meanwhile ("give up after S
// seconds" means the same for every command). Without it: kAnswerLimit for the daemon's answers, and
// kSilenceLimit of silence for the ranks', with no limit while they report progress.
CommandDeadlines command_deadlines(double timeout_s, Deadline::Clock::time_point start = Deadline::Clock::now());

}  // namespace tmsdisk::ctl
