// SPDX-License-Identifier: Apache-2.0
// The transfer pipeline: moves allocations chunk by chunk between device memory and tmsdiskd through
// the staging slots, with copies on the shim's own streams overlapping the daemon's I/O. It owns
// slot scheduling (to storage, in lanes: a run of changed chunks waiting on the disk does not keep
// the rest from being hashed), copy events, reply timeouts and connection loss; a direction says
// which way the bytes go, and TransferSteps what the caller does per chunk and once an allocation
// is done.
//
//   to storage:   device --copy--> slot --WRITE--> daemon, chunk done when WRITTEN
//   from storage: daemon --READ--> slot --copy--> device, chunk done when the copy completes
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "daemon_session.h"
#include "registry.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

enum class Direction : uint8_t { ToStorage, FromStorage };

// One range of memory moving through the pipeline: `size` bytes at `base` (device memory, or host
// memory the driver can copy from) to or from `blob` at `blob_offset` (a multiple of the chunk size)
// in the daemon's store. The pipeline reads only these; `a` is for the caller's steps.
struct TransferJob {
  CUdeviceptr base = 0;
  uint64_t size = 0;
  uint64_t blob = 0;
  uint64_t blob_offset = 0;
  std::shared_ptr<Allocation> a;  // the allocation moving, for a pause or resume; else empty
  bool object = false;            // `blob` is one of the rank's objects (STORE_WRITE/STORE_READ)
  bool host_memory = false;       // `base` is host memory: its chunks are copied with memcpy
  int ctx = -1;                   // TransferPipeline::context()
  uint64_t chunks = 0;
  uint64_t done = 0;  // chunks acknowledged (to storage) or copied back (from storage)
  uint32_t in_flight = 0;
  std::optional<Error> error;  // this allocation failed; the others may go on (from storage)
  // From storage: the daemon refused to give back a chunk (error->errnum() says why: a checksum
  // mismatch, a read error...); the offset of the first such chunk. Unset when the failure was ours.
  std::optional<uint64_t> refused_offset;
  std::string refusal;    // the daemon's own words for that refusal
  bool complete = false;  // every chunk done and TransferSteps::finished succeeded
  // From storage: the new physical memory, mapped before its first chunk is copied back.
  CUmemGenericAllocationHandle handle = 0;
  bool mapped = false;
  // Where each chunk goes (a chunk past the end of `place` goes to disk; empty: every chunk). Zero
  // and host chunks are neither staged nor sent: they move on the job's stream (host-tier copies,
  // zero memsets), queued before its disk chunks' copies. `chunks` counts the disk chunks.
  std::vector<ChunkPlace> place;
  // The job's host chunks, in order, one chunk apart from here in the host-tier memory.
  uint8_t* host = nullptr;
  bool local_queued = false;  // its host-tier copies and zero memsets are queued on its stream
};

// A job moving the whole of allocation `a`.
inline TransferJob allocation_job(std::shared_ptr<Allocation> a) {
  TransferJob j;
  j.base = a->base;
  j.size = a->size;
  j.blob = a->id;
  j.a = std::move(a);
  return j;
}

// Calls f(first, count) for each run of consecutive chunks of `j` placed at `where`, in order; stops
// at the first error f returns. Disk runs are not listed (chunks past `place` are on disk too).
template <class F>
Status for_each_run(const TransferJob& j, ChunkPlace where, F&& f) {
  for (uint64_t i = 0; i < j.place.size();) {
    if (j.place[i] != where) {
      ++i;
      continue;
    }
    uint64_t end = i;
    while (end < j.place.size() && j.place[end] == where) ++end;
    if (Status st = f(i, end - i); !st) return st;
    i = end;
  }
  return {};
}

// The bytes of j's chunks placed at `where` (Zero or Host).
uint64_t place_bytes(const TransferJob& j, ChunkPlace where, uint32_t chunk_bytes) noexcept;
// Recounts `j.chunks` as its disk chunks (what goes through the staging slots).
void count_disk_chunks(TransferJob& j, uint32_t chunk_bytes) noexcept;

struct TransferSteps {
  // From storage: before a chunk is copied to the device (the first one maps memory). An error
  // fails this allocation only.
  std::function<Status(TransferJob&)> before_copy;
  // Every chunk of the job is done (to storage: only while nothing failed). An error stops the
  // whole transfer.
  std::function<Status(TransferJob&)> finished;
  // A failed job has nothing in flight any more.
  std::function<void(TransferJob&)> abandoned;
};

// Tells whoever asked for the operation how far it got (a daemon command has a watcher; the C API
// has none).
class ProgressReporter {
 public:
  ProgressReporter(DaemonSession* session, uint64_t command_request) : session_(session), request_(command_request) {}
  void start(uint64_t total) {
    total_ = total;
    update(0, true);
  }
  // At most once per tick unless `force`.
  void update(uint64_t done, bool force);

 private:
  DaemonSession* session_;
  uint64_t request_;
  uint64_t total_ = 0;
  int64_t last_ms_ = 0;
};

class TransferPipeline {
 public:
  TransferPipeline(DaemonSession& session, StagingSlots& slots) : session_(session), slots_(slots) {}

  // The index of `ctx`'s stream and events, created on first use.
  Result<int> context(CUcontext ctx);
  // Creates them ahead of the first operation (its time is then the copies'); errors are left for
  // that operation to meet.
  void warm(CUcontext ctx);
  // The stream of a context index: work queued on it runs before the pipeline's copies queued after.
  CUstream stream(int ctx) const { return ctxs_[static_cast<std::size_t>(ctx)].stream; }
  // Waits for everything queued on `ctx`'s stream.
  Status drain(int ctx);
  // run() for jobs that are no allocation's (an object's range, host memory paused chunks are read
  // into) and need no step: their disk chunks counted, no progress reported. The error that stopped
  // the whole transfer, else the first job's own, if any.
  std::optional<Error> run_plain(Direction dir, std::vector<TransferJob>& jobs);

  // Moves `jobs` (each with its ctx set); returns the first error that stopped the whole transfer,
  // if any. Jobs that failed alone carry their own error. `done_bytes` counts finished chunks (zero
  // chunks are not; host chunks once their job is done), `unchanged_bytes` (to storage) those the
  // daemon found it already held.
  std::optional<Error> run(Direction dir, std::vector<TransferJob>& jobs, const TransferSteps& steps,
                           ProgressReporter& progress, uint64_t* done_bytes, uint64_t* unchanged_bytes = nullptr);

 private:
  class Run;  // one call of run(): its state and steps
  friend class Run;

  struct CtxResources {
    CUcontext ctx = nullptr;
    CUstream stream = nullptr;
    std::vector<CUevent> events;  // one per slot, created on first use
  };

  Result<CUevent> slot_event(int ctx, std::size_t slot);
  // Starts the copy of slot `s`'s chunk (device to slot or back, by direction).
  Status start_copy(Direction dir, TransferJob& j, std::size_t s);
  // Sends the WRITE or READ of slot `s`'s chunk; its request id.
  Result<uint64_t> start_request(Direction dir, const TransferJob& j, std::size_t s);
  // Queues on j's stream what moves without the daemon: the host-tier copies of its host chunks
  // (out of the device or back), and from storage the memsets of its zero chunks.
  Status queue_local(Direction dir, TransferJob& j);
  // The daemon's next message, or, while copies run and nothing has arrived, the completion of the
  // copy in the lowest-numbered slot still copying (then 0, so the caller harvests it instead of
  // spinning).
  int next_message(proto::Envelope& env, bool copying);

  DaemonSession& session_;
  StagingSlots& slots_;
  std::vector<CtxResources> ctxs_;
};

}  // namespace tmsdisk::shim
