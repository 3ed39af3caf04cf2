// SPDX-License-Identifier: Apache-2.0
// tmsctl's deadlines (deadline.h).
#include "deadline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace tmsdisk::ctl {

std::string Deadline::seconds_text() const {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", static_cast<double>(limit_.count()) / 1000.0);
  return buf;
}

CommandDeadlines command_deadlines(double timeout_s, Deadline::Clock::time_point start) {
  if (timeout_s > 0) {
    // At least 1 ms: a limit that rounds to nothing would still take what has already arrived.
    const auto limit = std::chrono::milliseconds(std::max<long long>(1, std::llround(timeout_s * 1000)));
    return {Deadline::fixed(limit, start), Deadline::fixed(limit, start)};
  }
  return {Deadline::fixed(kAnswerLimit, start), Deadline::silence(kSilenceLimit, start)};
}

}  // namespace tmsdisk::ctl
