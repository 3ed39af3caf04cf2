// SPDX-License-Identifier: Apache-2.0
// Paused memory read without resuming it (tmsdisk_read_paused, tmsdisk_paused_view): what the weight
// sync of a paused trainer does (torch_memory_saver's get_cpu_backup). Each chunk of the range comes
// from where its pause put it: the host tier (copied out of the memory mapped in the process, in
// parallel slices: host_copy.h), the disk (READs through the transfer pipeline straight into the
// caller's memory, each verified by the daemon against the chunk's seal), or nowhere (a zero chunk:
// zeros). The allocation stays paused and the daemon's record of the pause is untouched.
//
// Reads run on the control thread, one operation after another with pauses and resumes: a read of a
// range that is being paused or resumed waits for that to finish, then finds it paused (read) or
// resident (ENODATA: the device has the bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <vector>

#include "control_thread.h"
#include "cuda_api.h"
#include "daemon_session.h"
#include "host_tier.h"
#include "host_view.h"
#include "registry.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"
#include "transfer.h"

namespace tmsdisk::shim {

class PausedReader {
 public:
  PausedReader(DaemonSession& session, ControlThread& control, TransferPipeline& pipeline, StagingSlots& slots,
               const HostTierClient& tier, HostViews& views, std::shared_mutex& op_lock)
      : session_(session),
        control_(control),
        pipeline_(pipeline),
        slots_(slots),
        tier_(tier),
        views_(views),
        op_lock_(op_lock) {}

  // Copies the paused bytes of [ptr, ptr + length) into host memory dst. ENODATA: the range is not
  // paused (resident: the device holds its bytes, and no host copy was retained) or was paused
  // without a backup (a discard tag: nothing to read); EINVAL: it is not inside one allocation
  // tmsdisk manages; EBADMSG: a chunk on disk failed its seal; EIO: the host-tier memory or the
  // daemon is gone.
  Status read(CUdeviceptr ptr, uint64_t length, void* dst) noexcept;
  // The host copy of [ptr, ptr + length) where none of it lies on disk, without a copy: the
  // allocation's view (host_view.h), read-only, at an address that stays the same while it has a host
  // copy (paused, or resumed retaining it) and goes once it is freed or resumed without retaining.
  // ENODATA where any chunk of it lies on disk (read() copies those), and as read() says.
  Result<const void*> view(CUdeviceptr ptr, uint64_t length) noexcept;

 private:
  struct Located {
    std::shared_ptr<Allocation> a;
    uint64_t offset = 0;  // of the range in the allocation
    uint32_t chunk = 0;   // the session's chunk size
    // Where its chunks are: the pause's placement, or a resumed allocation's retained one (whose
    // disk chunks are not there to read any more).
    const std::vector<ChunkPlace>* placement = nullptr;
    uint64_t host_offset = 0;
    bool retained = false;
    bool viewed = false;       // resident, its host copy kept in its view (host_view.h): read from there
    uint64_t host_before = 0;  // host chunks of the allocation before the range's first chunk
    ChunkPlace place_of(uint64_t chunk_index) const noexcept { return place_at(*placement, chunk_index); }
  };
  // The paused allocation [ptr, ptr + length) lies in (op lock held).
  Result<Located> locate(CUdeviceptr ptr, uint64_t length) const;
  // On the control thread.
  Status copy(const Located& at, uint64_t length, uint8_t* dst);

  DaemonSession& session_;
  ControlThread& control_;
  TransferPipeline& pipeline_;
  StagingSlots& slots_;
  const HostTierClient& tier_;
  HostViews& views_;
  std::shared_mutex& op_lock_;
};

}  // namespace tmsdisk::shim
