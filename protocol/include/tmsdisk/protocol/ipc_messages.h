// SPDX-License-Identifier: Apache-2.0
// The wire protocol's legacy CUDA IPC messages (messages.h has the whole protocol).
#pragma once

#include <cstdint>
#include <string>

#include "tmsdisk/protocol/wire.h"

namespace tmsdisk::proto {

// Legacy IPC. An exporter's cuIpcGetMemHandle hands the daemon a POSIX fd of the allocation's
// physical memory and gets back a random id, which the CUipcMemHandle carries. An importer's
// cuIpcOpenMemHandle sends the id and receives the fd when both processes belong to the same uid.
// The daemon counts importers per export: the exporter keeps an allocation resident while any
// process has it open, and revokes the fd before pausing it so that the old physical memory is
// not kept alive by the daemon.

inline constexpr uint64_t kMaxIpcBytes = uint64_t{1} << 48;  // far above any device's memory

struct IpcExport {
  static constexpr MsgType kType = MsgType::IpcExport;
  uint64_t export_id = 0;  // 0: a new export; else the fd of this revoked export again (after a resume)
  uint64_t bytes = 0;      // mapped size of the physical memory
  int32_t device = 0;      // the exporter's device ordinal
  template <class F>
  void fields(F&& f) {
    f(export_id), f(bytes), f(device);
  }
  bool check(std::string& why) const;
};

struct IpcExported {
  static constexpr MsgType kType = MsgType::IpcExported;
  uint64_t export_id = 0;
  template <class F>
  void fields(F&& f) {
    f(export_id);
  }
  bool check(std::string& why) const;
};

struct IpcRevoke {
  static constexpr MsgType kType = MsgType::IpcRevoke;
  uint64_t export_id = 0;
  uint8_t freed = 0;  // 1: the allocation was freed, forget the export (never refused)
  template <class F>
  void fields(F&& f) {
    f(export_id), f(freed);
  }
  bool check(std::string& why) const;
};

struct IpcOpen {
  static constexpr MsgType kType = MsgType::IpcOpen;
  uint64_t export_id = 0;
  template <class F>
  void fields(F&& f) {
    f(export_id);
  }
  bool check(std::string& why) const;
};

struct IpcOpened {
  static constexpr MsgType kType = MsgType::IpcOpened;
  uint64_t export_id = 0;
  uint64_t bytes = 0;
  int32_t device = 0;
  int32_t exporter_pid = 0;
  template <class F>
  void fields(F&& f) {
    f(export_id), f(bytes), f(device), f(exporter_pid);
  }
  bool check(std::string& why) const;
};

struct IpcClose {
  static constexpr MsgType kType = MsgType::IpcClose;
  uint64_t export_id = 0;
  template <class F>
  void fields(F&& f) {
    f(export_id);
  }
  bool check(std::string& why) const;
};

struct IpcUsers {
  static constexpr MsgType kType = MsgType::IpcUsers;
  uint64_t export_id = 0;
  uint32_t importers = 0;  // processes that have it open
  template <class F>
  void fields(F&& f) {
    f(export_id), f(importers);
  }
  bool check(std::string& why) const;
};

}  // namespace tmsdisk::proto
