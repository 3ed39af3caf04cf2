// SPDX-License-Identifier: Apache-2.0
// The wire protocol's messages of the rank's store of named objects (messages.h has the whole protocol).
#pragma once

#include <cstdint>
#include <string>

#include "tmsdisk/common/object_name.h"
#include "tmsdisk/protocol/wire.h"

namespace tmsdisk::proto {

// The rank's store of named objects (daemon/storage/object_store.h): byte arrays the rank writes and
// reads in ranges while it runs, beside its pauses and never moved by them. A write of a range is
// STORE_WRITEs of its chunks, then STORE_COMMIT: the object's current version changes all at once,
// and a daemon killed before the commit leaves the previous version readable.

// Object names follow tmsdisk/common/object_name.h.
using tmsdisk::kMaxObjectNameLength;

// StoreOpen.flags. Host-tier memory of an object is all of it or none: the whole object lives in the
// rank's memory (no disk space, no seal: DMA copies) or the whole object on disk. The rank's objects
// take their part of the rank's fair share first (a pause's grant gets what is left of it), are
// never reclaimed for another rank's pause (they are the only copy), and go back when the object is
// removed or the rank exits.
inline constexpr uint8_t kStoreOpenHost = 1;  // place it in host-tier memory if the rank's share has room
// The rank holds the object's host-tier memory since before this daemon started (it restarted): the
// memfd rides along, to be counted again. Only on a session continued from an earlier daemon's
// records, for an object those records hold, counted as the object's size; anything else is refused
// and the rank writes the object to disk instead.
inline constexpr uint8_t kStoreOpenHeld = 2;

struct StoreOpen {
  static constexpr MsgType kType = MsgType::StoreOpen;
  std::string name;
  uint64_t size = 0;  // bytes: an existing object of another size is refused (EEXIST)
  uint8_t flags = 0;  // kStoreOpen*: at most one
  template <class F>
  void fields(F&& f) {
    f(name, kMaxObjectNameLength), f(size), f(flags);
  }
  bool check(std::string& why) const;
};

struct StoreOpened {
  static constexpr MsgType kType = MsgType::StoreOpened;
  uint64_t handle = 0;  // STORE_WRITE/STORE_READ name the object by it (ChunkRef::blob)
  uint8_t created = 0;  // 1: the object did not exist
  // Host-tier memory the object lives in: 0, on disk; else a whole number of chunks covering it (its
  // memfd rides along with this answer to kStoreOpenHost; counted again for kStoreOpenHeld).
  uint64_t host_bytes = 0;
  template <class F>
  void fields(F&& f) {
    f(handle), f(created), f(host_bytes);
  }
  bool check(std::string& why) const;
};

// Chunks of an object, as WRITE and READ name a blob's: ChunkRef::blob is the object's handle.
struct StoreWrite : ChunkRef {
  static constexpr MsgType kType = MsgType::StoreWrite;
};
struct StoreRead : ChunkRef {
  static constexpr MsgType kType = MsgType::StoreRead;
};

// StoreCommit.flags
inline constexpr uint8_t kStoreDiscard = 1;  // drop what was written of the range instead

struct StoreCommit {
  static constexpr MsgType kType = MsgType::StoreCommit;
  uint64_t handle = 0;
  uint64_t offset = 0;  // a multiple of the chunk size
  uint64_t length = 0;
  uint8_t flags = 0;
  template <class F>
  void fields(F&& f) {
    f(handle), f(offset), f(length), f(flags);
  }
  bool check(std::string& why) const;
};

struct StoreRemove {
  static constexpr MsgType kType = MsgType::StoreRemove;
  std::string name;
  template <class F>
  void fields(F&& f) {
    f(name, kMaxObjectNameLength);
  }
  bool check(std::string& why) const;
};

}  // namespace tmsdisk::proto
