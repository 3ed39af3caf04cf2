// SPDX-License-Identifier: Apache-2.0
// Hashes chunks (XXH3-128) on a few threads of their own: those of WRITEs, to find the unchanged
// ones, and those of READs just read, to verify them. On the event loop, one core's hashing speed was
// the speed of a pause whose chunks are all unchanged (7 GB/s covered on an H200 node), and a resume
// from a disk faster than about 3 GB/s read at 0.64-0.76 of it (a block device in host memory,
// 2026-12-01), whatever the number of ranks and of requests in flight. Here the chunks in flight are
// hashed side by side; the loop hears back through an eventfd in its epoll set and decides, as
// before, whether each chunk must be written, or whether it was read intact (chunk_io.h).
//
// A job reads its request's staging slot in place. The slot stays the daemon's until the request is
// answered (the shim reuses it only then), and the session, with its staging buffer, stays while it
// has a request in flight (Session::io_in_flight), so the bytes neither change nor go away meanwhile.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "storage.h"
#include "worker_pool.h"

namespace tmsdisk::server {

// What hash-threads = 0 means: one thread per two CPUs this process may run on, at least 2 and at
// most 8 (about 30 GB/s of XXH3-128 on an H200 node's cores, several times its disks; the rest stays
// with the ranks' own threads). Never 1: a single worker hashes no faster than the event loop did and
// adds a handoff per chunk (on a 2-CPU machine, 8 GB/s against 12 inline; two workers, 18-22).
unsigned automatic_hash_threads() noexcept;

class HashWorkers : public WorkerPool {
 public:
  struct Job {
    uint64_t tag = 0;  // the caller's, handed back with the sum
    const uint8_t* bytes = nullptr;
    uint32_t length = 0;
    bool xxh64 = false;  // how to hash (RankStore::hash_chunk): a version-1 record's XXH3-64
  };
  struct Done {
    uint64_t tag = 0;
    storage::Checksum128 sum;
  };

  // Starts `threads` threads (at least one). `before_hash` (tests only) runs on a worker before each
  // job; it must return before stop().
  explicit HashWorkers(unsigned threads, std::function<void()> before_hash = {});
  ~HashWorkers();  // stop()
  HashWorkers(const HashWorkers&) = delete;
  HashWorkers& operator=(const HashWorkers&) = delete;

  unsigned threads() const noexcept { return worker_count(); }
  // event_fd() (WorkerPool) is readable while finished() has something for the loop.

  // Queues `job`; false (nothing queued) once stop() was called. Throws std::bad_alloc (nothing
  // queued).
  bool submit(const Job& job);
  // Moves what is done since the last call into `out` (event loop; clears the eventfd).
  void finished(std::vector<Done>& out);
  // Drops the jobs not started (their tags never come back), waits for those being hashed and joins
  // the threads: after it, no thread reads a staging slot. Idempotent.
  void stop() noexcept;

 private:
  void work();

  std::function<void()> before_hash_;
  std::deque<Job> queue_;  // under mu_, as done_ is
  std::vector<Done> done_;
};

}  // namespace tmsdisk::server
