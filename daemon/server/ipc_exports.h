// SPDX-License-Identifier: Apache-2.0
// The daemon's side of brokered legacy CUDA IPC: the physical-memory fds exporters handed over, by
// random id, with the sessions that have each one open.
//
// Rules (see also README.md, "Known limitations"):
//   - only a process of the exporter's uid may open an export, and never the exporter itself
//     (the driver refuses same-process opens too);
//   - an export is revoked (its fd closed) before the exporter pauses the allocation, which is
//     refused while any session has it open: a pause must not leave an importer looking at
//     physical memory the exporter no longer uses;
//   - everything a session exported goes with the session; what it had open is closed with it
//     (the server keeps the session of a live process that holds either, as an orphan);
//   - every export holds a descriptor of the root daemon's: their number is bounded per user and in
//     all.
//
// Plain data structure, single-threaded like the server that owns it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::server {

// Whether `fd` can be the POSIX handle of GPU physical memory: the real driver's handles are
// character-device files (/dev/nvidia*), simulated ones memfds. Anything else is refused so that
// the root daemon never holds a descriptor whose close() could block it (a FUSE or NFS file) or a
// directory a client could use as an anchor.
Status check_memory_fd(int fd);

class IpcExports {
 public:
  struct Limits {
    std::size_t per_uid = 4096;  // exports one (non-root) user may hold
    std::size_t total = 16384;   // exports of all users together (LimitNOFILE is 65536)
  };

  // The processes that have an export open changed: tell its owner (IPC_USERS).
  struct Users {
    uint64_t owner = 0;  // exporter session
    uint64_t export_id = 0;
    uint32_t importers = 0;
  };
  struct Opened {
    int fd = -1;  // borrowed: stays owned by the registry
    uint64_t bytes = 0;
    int32_t device = 0;
    pid_t exporter_pid = 0;
    Users users;
  };

  // `random` supplies non-zero ids (tests make them predictable).
  IpcExports(std::function<uint64_t()> random, Limits limits) : random_(std::move(random)), limits_(limits) {}

  // A new export of `owner` (session of `uid`, process `pid`). Returns its id.
  Result<uint64_t> add(uint64_t owner, uid_t uid, pid_t pid, UniqueFd fd, uint64_t bytes, int32_t device);
  // The fd of a revoked export again, after the exporter resumed the allocation (refused while the
  // export is live: nobody's memory changes under them).
  Status refresh(uint64_t id, uint64_t owner, UniqueFd fd, uint64_t bytes);
  // Closes the fd before a pause: EBUSY while a session has it open.
  Status revoke(uint64_t id, uint64_t owner);
  // The exporter freed the allocation: forget the export (importers keep what they mapped).
  Status forget(uint64_t id, uint64_t owner);

  // `importer` (a session of `uid`) opens export `id`.
  Result<Opened> open(uint64_t id, uint64_t importer, uid_t uid);
  // `importer` closes one open of `id`. The owner learns the new count.
  Result<Users> close(uint64_t id, uint64_t importer);

  // Sessions that ended: their exports go, their opens close. Returns what owners must be told.
  std::vector<Users> drop(const std::function<bool(uint64_t session)>& gone);
  // A session reconnected under a new id (an orphan adopted by its rank).
  void rename_session(uint64_t from, uint64_t to);
  // Current counts of `owner`'s exports (sent again when it reconnects).
  std::vector<Users> exports_of(uint64_t owner) const;
  // Whether the session exported anything or has anything open.
  bool holds(uint64_t sid) const;

  std::size_t size() const noexcept { return exports_.size(); }

 private:
  struct Export {
    uint64_t owner = 0;
    uid_t uid = 0;
    pid_t pid = 0;
    UniqueFd fd;  // -1 while revoked (the exporter paused it)
    uint64_t bytes = 0;
    int32_t device = 0;
    std::map<uint64_t, uint32_t> opens;  // importer session -> opens not yet closed
  };
  static uint32_t importers(const Export& e) noexcept { return static_cast<uint32_t>(e.opens.size()); }
  Result<Export*> owned(uint64_t id, uint64_t owner);
  void erase(std::map<uint64_t, Export>::iterator it);

  std::function<uint64_t()> random_;
  Limits limits_;
  std::map<uint64_t, Export> exports_;
  std::map<uid_t, std::size_t> per_uid_;  // exports held, by user
};

}  // namespace tmsdisk::server
