// SPDX-License-Identifier: Apache-2.0
// The pause/resume engine: coordinates one control thread, the only reader of the session with
// tmsdiskd (daemon_session.h); commands from the daemon and the in-process C API share it. Bytes
// move through the transfer pipeline (transfer.h) and the staging slots (staging_slots.h).
//
// A pause first closes the gate (gate.h) and waits for gated calls in flight, then synchronizes
// every context it allocated on, then moves data; the gate opens again when nothing is paused, or
// when all that stays paused is memory a resume could not restore because its backup is damaged
// (then only calls naming that memory are held: see settle_gate).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "control_thread.h"
#include "cuda_api.h"
#include "daemon_session.h"
#include "host_tier.h"
#include "host_view.h"
#include "ipc_broker.h"
#include "object_client.h"
#include "op_result.h"
#include "pause_record.h"
#include "paused_reader.h"
#include "prefetch.h"
#include "rank_report.h"
#include "registry.h"
#include "staging_slots.h"
#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"
#include "transfer.h"
#include "zero_scan.h"

namespace tmsdisk::shim {

class Engine {
 public:
  // The process's engine. Created on first use, never destroyed (the control thread may outlive
  // static destruction); replaced by a fresh one in a fork child. Null only if memory ran out.
  static Engine* instance() noexcept;
  // The engine if one was created, without creating it.
  static Engine* existing() noexcept;

  // Starts the control thread (which connects to the daemon) unless it runs. Cheap once started.
  void ensure_started() noexcept { control_.start(); }

  // Runs a pause or resume on the control thread and waits for it; EBUSY when another operation
  // is running. `flags`: proto::kAcceptLoss (resume only). `tag`: only the allocations carrying it
  // (tags.h); empty: every allocation.
  Status run(proto::CommandOp op, uint8_t flags = 0, std::string tag = {}) noexcept;

  // cuMemFree released a paused allocation (its range no longer lost: see gate::forget_lost). The
  // control thread then settles the gate, the state and the daemon's record of the pause (closed
  // once nothing is paused). Does not wait.
  void paused_freed() noexcept;

  EngineStatus status() const;

  // Legacy CUDA IPC brokered by tmsdiskd, for the hooks (ipc.cpp) and frees.
  IpcBroker& ipc() noexcept { return ipc_; }
  // The rank's store of named objects, for the C API (tmsdisk_store_*).
  ObjectClient& objects() noexcept { return objects_; }
  // Starts reading the paused memory of `tag` (empty: all of it) into the host tier ahead of its
  // resume (prefetch.h); with `wait`, returns once that is done. A tag nothing carries: nothing to do.
  Status prefetch(const std::string& tag, bool wait) noexcept;
  // The directory the rank's files go in from now on (tmsdisk_set_backup_dir), on the control thread
  // (DaemonSession::set_backup_dir).
  Status set_backup_dir(const std::string& path) noexcept;
  // Whether a resume leaves the host chunks it copied back in the host-tier memory, readable as the
  // allocation's retained copy until that memory is used again (tmsdisk_retain_host_copy; TMS's
  // retain_cpu_backup). Off by default.
  void set_retain_host_copy(bool on) noexcept { retain_host_copy_.store(on); }
  bool retain_host_copy() const noexcept { return retain_host_copy_.load(); }
  // Paused memory read in place, for the C API (tmsdisk_read_paused, tmsdisk_paused_view).
  PausedReader& paused_reader() noexcept { return paused_reader_; }
  // The views of host copies that zero-copy reads made (cuMemFree drops a freed allocation's).
  HostViews& views() noexcept { return views_; }

  // Frees of managed memory hold this shared; a pause or resume holds it exclusively.
  std::shared_mutex& op_lock() noexcept { return op_lock_; }

  // pthread_atfork handlers.
  static void fork_prepare() noexcept;
  static void fork_parent() noexcept;
  static void fork_child() noexcept;

  Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  OpResult execute(proto::CommandOp op, uint8_t flags, uint64_t command_request, const std::string& tag);
  // The allocations an operation is about: every one, or those of one tag.
  struct Selection {
    bool all = true;
    TagId tag = kUntagged;
    std::string name;  // for messages
    bool covers(const Allocation& a) const noexcept { return all || a.tag == tag; }
  };
  // What is paused or resident decides the work: a pause that finds allocations an earlier failed
  // pause left paused resumes those, then pauses all. Allocations under a discard policy are released
  // without the daemon (discard()); the others go into the rank's backed-up pause, whose reservation
  // carries other tags' paused allocations as stored (a whole-process pause over them too).
  OpResult pause(ProgressReporter& progress, const Selection& which);
  // accept_loss: allocations whose backup is damaged get zero-filled memory instead of staying paused.
  OpResult resume(ProgressReporter& progress, bool accept_loss, const Selection& which);
  // `carried`: other tags' paused allocations, kept in the daemon's set as stored (Reserve.carry).
  // A failure after the reservation records the carried ones again (record_paused_after_failure).
  OpResult pause_all(std::vector<std::shared_ptr<Allocation>> resident, ProgressReporter& progress,
                     std::vector<std::shared_ptr<Allocation>> carried = {});
  // After a failed pause that carried `paused`: a committed pause of them and of what it released.
  void record_paused_after_failure(std::vector<std::shared_ptr<Allocation>> paused,
                                   const std::vector<TransferJob>& jobs);
  // `last`: no backed-up allocation outside `paused` is paused, so the daemon records the resume once
  // all of them are back; else the rank's pause stays recorded for the rest.
  OpResult resume_all(std::vector<std::shared_ptr<Allocation>> paused, ProgressReporter& progress,
                      bool accept_loss = false, bool last = true);
  // Discard policy: work using them finishes, then their physical memory goes, unsaved.
  OpResult discard(std::vector<std::shared_ptr<Allocation>> list);
  // ... and comes back: new memory at the same addresses, zero-filled.
  OpResult refill(std::vector<std::shared_ptr<Allocation>> list);
  // After an operation, or a free of paused memory, with the op lock held exclusively: the gate
  // closed while anything is paused for another reason than a damaged backup; else open, with the
  // damaged allocations' ranges lost (gate.h). Closed if memory ran out.
  void settle_gate() noexcept;
  // Jobs for the pipeline, one per allocation, each with its context's stream.
  Result<std::vector<TransferJob>> make_jobs(std::vector<std::shared_ptr<Allocation>> list, uint64_t* total);
  Status connect_session();
  void session_lost(const char* why);
  void handle_other(const proto::Envelope& env);
  void send_report();
  void set_state(proto::RankState s);

  std::shared_mutex op_lock_;
  std::atomic<bool> retain_host_copy_{false};

  // Control thread only.
  DaemonSession session_;
  StagingSlots staging_;
  TransferPipeline pipeline_{session_, staging_};
  ZeroScanner zero_scan_;
  HostTierClient host_tier_;
  ControlThread control_;
  IpcBroker ipc_{session_, control_, op_lock_};
  ObjectClient objects_{session_, control_, pipeline_, staging_};
  HostViews views_;
  PausedReader paused_reader_{session_, control_, pipeline_, staging_, host_tier_, views_, op_lock_};
  Prefetcher prefetch_{session_, pipeline_, staging_, host_tier_, op_lock_};
  PauseRecord record_{session_};
  RankReport report_{session_};
  // The last pause covered every allocation (and paused some, a failed one too): until nothing is
  // paused, or a tag is resumed alone, the gate holds every CUDA call (settle_gate). After a pause of
  // one tag only calls naming paused memory are held: the program asked for part of its memory to go,
  // as with torch_memory_saver, and runs on with the rest.
  bool whole_process_paused_ = false;
  // A whole pause took untagged memory (outside every region): any kernel may reach it (a caching
  // allocator hands it out again), so every call stays held while it is paused, a tag resumed alone
  // or not, until a resume covers it (the whole process, or the tag `untagged`).
  bool untagged_held_ = false;
};

}  // namespace tmsdisk::shim
