// SPDX-License-Identifier: Apache-2.0
// The rank's side of its store of named objects in tmsdiskd (daemon/storage/object_store.h): what the
// C API's tmsdisk_store_* calls do. A write or read of a range is queued on the control thread, after
// the work its caller had queued on its CUDA stream, and moves through the transfer pipeline as a
// pause does (staging slots, the daemon's O_DIRECT I/O, a seal per chunk verified on read). A write
// ends with STORE_COMMIT: the daemon makes the range the object's current version at once, so a
// reader never sees half of an old and half of a new range; a failed write is dropped there.
//
// Objects in the host tier: a new object asks to live in host-tier memory (kStoreOpenHost). When the
// daemon has room in the rank's share of the node's budget for all of it, it sends a memfd of its own
// making; the rank maps and pins it, and the object's ranges are copied in and out of it by DMA on the
// shim's copy stream (memcpy for host memory), without the daemon: no disk space, no seal, and a read
// of the state costs a PCIe copy. An object that does not fit lives on disk, all of it. After a daemon
// restart the memory is handed back to be counted again (kStoreOpenHeld); a daemon that refuses it
// gets the object written to disk, and the memory is given up. TMSDISK_STORE_HOST_TIER=0 (or
// TMSDISK_HOST_TIER=0) keeps every object on disk.
//
// Operations run one after another in the order they were queued, on the one thread that also
// pauses and resumes: a pause queued after writes waits for them, and a read queued after a write
// of the same range reads what it wrote. The caller waits for a ticket (or for every write: flush).
// A range waits on that thread for the caller's stream to reach it (its event) before it moves. The
// wait stays there, not on a thread of its own ahead of the queue: a range held back elsewhere would
// let a pause queued after it run first and find its memory paused, where a pause must wait for the
// writes before it; and a pause must wait for the caller's queued work all the same (it synchronizes
// the device before it copies).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "control_thread.h"
#include "cuda_api.h"
#include "daemon_session.h"
#include "registered_mapping.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
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
  // Runs on the control thread before an object asks for host-tier memory (the engine makes room for
  // it in the rank's share: HostTierClient::yield_to_objects).
  void on_host_open(std::function<void()> fn) { before_host_open_ = std::move(fn); }
  // A new session (on the control thread, once connected): the daemon is handed the host-tier memory
  // of every object that lives there, at once rather than at its next range, so that it counts it
  // before it grants more. What it refuses goes to disk at the object's next range.
  void session_started() noexcept;

 private:
  // An object's host-tier memory, mapped (and pinned where the driver allows) here.
  struct HostCopy {
    UniqueFd fd;  // kept: handed back to a daemon that restarts
    RegisteredMapping mapping;
    // Per chunk: a write landed there. A read of another is ENODATA, as the daemon answers for a
    // chunk of an object on disk that holds no version. Used on the control thread only.
    std::vector<uint8_t> written;
  };
  struct Object {
    std::string name;
    uint64_t size = 0;
    uint64_t daemon_handle = 0;  // the daemon's, for the connection `connection`; 0: removed
    uint64_t connection = 0;
    std::shared_ptr<HostCopy> host{};  // null: the object lives on disk
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
  // STORE_OPEN of `o` on the current session, in host-tier memory when `host` asks for it and the
  // daemon has room; falls back to disk when the memory cannot be mapped. Fills in `o`.
  Status open_on_daemon(Object& o, bool host, CUcontext ctx);
  // Maps and pins the host-tier memory `memory` (`bytes`, as STORE_OPENED said) of `o`.
  Result<std::shared_ptr<HostCopy>> map_host(const Object& o, uint64_t bytes, UniqueFd memory, CUcontext ctx);
  // After a reconnection: the daemon counts the host-tier memory of object `handle` again, or (with
  // `or_to_disk`) the object is written to disk and the memory given up.
  Status keep_counted(uint64_t handle, bool or_to_disk);
  // A range of a host-tier object, copied in or out of its memory.
  Status copy_host(const Range& r, const std::string& name, HostCopy& host);
  // A range of an object on disk, through the pipeline, then (a write) its commit or its discard.
  Status through_daemon(const Range& r, uint64_t daemon_handle);
  Result<uint64_t> daemon_handle(uint64_t handle);
  Status checked(const Range& r) const;
  void finish(uint64_t ticket, Direction dir, Status st);

  DaemonSession& session_;
  ControlThread& control_;
  TransferPipeline& pipeline_;
  StagingSlots& slots_;
  std::function<void()> before_host_open_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Object> objects_;  // handle h is objects_[h - 1]
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, Ticket> tickets_;  // queued or done, until waited for (or flushed)
  uint64_t writes_in_flight_ = 0;
  std::optional<Error> write_error_;  // the first since the last flush()
};

}  // namespace tmsdisk::shim
