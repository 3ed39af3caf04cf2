// SPDX-License-Identifier: Apache-2.0
// Closes descriptors that clients passed to the daemon (SCM_RIGHTS) and that it does not keep, on a
// thread of their own. close(2) of a FUSE or NFS file waits for that file's server, which a client
// may run itself: the event loop, which serves every user, must never wait on it.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>

#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

class FdReaper {
 public:
  FdReaper() = default;
  // Never waits for the thread: one stuck in a close keeps its descriptors (the process is ending).
  ~FdReaper();
  FdReaper(const FdReaper&) = delete;
  FdReaper& operator=(const FdReaper&) = delete;

  // Queues `fd` to be closed. The queue is bounded only by the descriptor limit: while descriptors
  // wait here, the kernel refuses new ones to the daemon (and closes them itself, without a flush).
  void discard(UniqueFd fd) noexcept;

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<int> fds;
    bool stop = false;
  };
  std::shared_ptr<State> state_;  // shared with the (detached) thread, started on first use
};

}  // namespace tmsdisk::server
