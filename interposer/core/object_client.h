// SPDX-License-Identifier: Apache-2.0
// The rank's side of its store of named objects in tmsdiskd (daemon/storage/object_store.h): what the
// C API's tmsdisk_store_* calls do. A write or read of a range is queued on the control thread, after
// the work its caller had queued on its CUDA stream, and moves through the transfer pipeline as a
// pause does (staging slots, the daemon's O_DIRECT I/O, a seal per chunk verified on read). A write
// ends with STORE_COMMIT: the daemon makes the range the object's current version at once, so a
// reader never sees half of an old and half of a new range; a failed write is dropped there.
//
// Operations run one after another in the order they were queued, on the one thread that also
// pauses and resumes: a pause queued after writes waits for them, and a read queued after a write
// of the same range reads what it wrote. The caller waits for a ticket (or for every write: flush).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "control_thread.h"
#include "cuda_api.h"
#include "daemon_session.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"
#include "transfer.h"

namespace tmsdisk::shim {

class ObjectClient {
 public:
  ObjectClient(DaemonSession& session, ControlThread& control, TransferPipeline& pipeline, StagingSlots& slots)
      : session_(session), control_(control), pipeline_(pipeline), slots_(slots) {}

  // The chunk size ranges are cut in (offsets are multiples of it): the session's, opened if need be.
  Result<uint64_t> chunk_bytes() noexcept;

  // The handle of object `name`, created with `size` bytes when missing. Handles are the rank's own:
  // they stay valid across a reconnection to the daemon (the object is named again there).
  Result<uint64_t> open(std::string_view name, uint64_t size) noexcept;
  Status remove(std::string_view name) noexcept;

  // Queues a write of [src, src + length) (device memory, or host memory) to the object at `offset`,
  // or a read of the object's current bytes there into dst, after the work queued on `stream` so far
  // (a CUstream; null: the legacy default stream). The ticket to wait for.
  Result<uint64_t> write(uint64_t handle, uint64_t offset, const void* src, uint64_t length, CUstream stream) noexcept;
  Result<uint64_t> read(uint64_t handle, uint64_t offset, void* dst, uint64_t length, CUstream stream) noexcept;
  // The outcome of the operation `ticket` names, once it is done (EINVAL: no such ticket, or waited
  // for already).
  Status wait(uint64_t ticket) noexcept;
  // Waits for every write queued so far: the first error among the writes since the last flush,
  // whether waited for or not. Tickets of writes done by then need no wait().
  Status flush() noexcept;

 private:
  struct Object {
    std::string name;
    uint64_t size = 0;
    uint64_t daemon_handle = 0;  // the daemon's, for the connection `connection`
    uint64_t connection = 0;
  };
  struct Range {
    Direction dir = Direction::ToStorage;
    uint64_t handle = 0;  // ours
    uint64_t offset = 0;
    uint64_t length = 0;
    CUdeviceptr memory = 0;
    CUstream stream = nullptr;  // the caller's
    bool host = false;          // `memory` is host memory: copied with memcpy
    CUcontext ctx = nullptr;    // of device memory
    CUevent after = nullptr;    // recorded on `stream`: the range moves after it
  };
  struct Ticket {
    std::optional<Status> outcome;  // set once done
    bool write = false;
  };

  Result<uint64_t> queue(Range r) noexcept;
  // On the control thread.
  Status transfer(const Range& r);
  Result<uint64_t> daemon_handle(uint64_t handle);
  Status checked(const Range& r) const;
  void finish(uint64_t ticket, Direction dir, Status st);

  DaemonSession& session_;
  ControlThread& control_;
  TransferPipeline& pipeline_;
  StagingSlots& slots_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Object> objects_;  // handle h is objects_[h - 1]
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, Ticket> tickets_;  // queued or done, until waited for (or flushed)
  uint64_t writes_in_flight_ = 0;
  std::optional<Error> write_error_;  // the first since the last flush()
};

}  // namespace tmsdisk::shim
