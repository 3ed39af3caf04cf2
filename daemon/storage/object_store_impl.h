// SPDX-License-Identifier: Apache-2.0
// Inside ObjectStore (object_store.h): its state, ObjectStore::Impl, shared by object_store.cpp
// (objects, WRITEs, READs, commits) and object_store_open.cpp (the files, and the log replayed).
// Not for other users.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "extent_allocator.h"
#include "object_store.h"
#include "object_store_log.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage {

// Keeps every extent length and file offset far from 64-bit overflow, as RankStore's blobs.
inline constexpr uint64_t kMaxObjectSize = uint64_t{1} << 60;
inline constexpr uint64_t kNoExtent = UINT64_MAX;

inline uint64_t round_up_to(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

// The committed version of a chunk: its extent (kNoExtent: none) and seal. 24 bytes a chunk.
struct ObjectVersion {
  uint64_t offset = kNoExtent;
  Checksum128 seal;
};

// chunk_count() is what max-chunks-per-uid bounds, at this cost each.
static_assert(sizeof(ObjectVersion) <= 24);

// A version being written: its extent, and its seal once end_write() gave it.
struct PendingVersion {
  uint64_t offset = 0;
  Checksum128 sum;
  uint32_t opened = 0;  // WRITEs of the chunk opened onto this extent
  bool sealed = false;  // end_write() came after the last open_write()
};

struct Object {
  uint64_t handle = 0;
  std::string name;
  uint64_t size = 0;
  uint64_t chunks = 0;
  std::vector<ObjectVersion> committed;  // one per chunk
  uint64_t committed_chunks = 0;         // of `committed`, those with an extent
  std::map<uint64_t, PendingVersion> pending;
};

// An extent of a chunk's version: root, offset and length in that root's objects file.
struct Extent {
  std::size_t root = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
};

struct ObjectRoot {
  UniqueFd dir;  // the rank directory, opened so that it can be flushed
  std::string dir_path;
  std::string data_path;  // of the objects file, for messages
  UniqueFd data;
  bool direct_io = true;
  bool in_memory = false;
  ExtentAllocator alloc{kIoAlignment};
};

struct ObjectStore::Impl {
  uint32_t chunk = 0;
  std::vector<ObjectRoot> roots;
  detail::ObjectLog log;
  std::map<uint64_t, Object> objects;  // by handle
  std::map<std::string, uint64_t, std::less<>> names;
  RankFileNames files;       // the names of the store's files in the rank directory
  uint64_t chunk_total = 0;  // of every object's chunks (chunk_count() without a walk over them)
  uint64_t next_handle = 1;
  std::function<void(const std::string&)> warn;

  void say(const std::string& what) const;

  std::size_t root_of(uint64_t ci) const { return static_cast<std::size_t>(ci % roots.size()); }
  uint32_t length_of(const Object& o, uint64_t ci) const {
    return static_cast<uint32_t>(std::min<uint64_t>(chunk, o.size - ci * chunk));
  }
  uint32_t io_length_of(const Object& o, uint64_t ci) const {
    return static_cast<uint32_t>(round_up_to(length_of(o, ci), kIoAlignment));
  }
  Extent extent_of(const Object& o, uint64_t ci, uint64_t offset) const {
    return {.root = root_of(ci), .offset = offset, .length = io_length_of(o, ci)};
  }
  // Where the chunk's version is: the one being written (`written`), else the committed one.
  Result<RankStore::Location> locate(uint64_t handle, uint64_t offset, uint32_t length, bool written);
  static std::string describe(const Object& o);
  // An object of `size` bytes under `handle` and `name`, nothing of it committed.
  Object make_object(uint64_t handle, std::string_view name, uint64_t size) const;

  Result<Object*> find(uint64_t handle);
  Result<Object*> find_chunk(uint64_t handle, uint64_t offset, uint32_t length, uint64_t* ci);
  // The object, and the chunks [first, end) of a range of it (which must end at a chunk's end).
  Result<Object*> find_range(uint64_t handle, uint64_t offset, uint64_t length, uint64_t* first, uint64_t* end);
  Result<PendingVersion*> pending_of(uint64_t handle, uint64_t offset, uint32_t length);
  Result<const ObjectVersion*> committed_of(uint64_t handle, uint64_t offset, uint32_t length);
  Result<uint64_t> new_extent(std::size_t root, uint32_t io_length);
  void free_extents(std::span<const Extent> extents);
  void drop_pending(Object& o, std::map<uint64_t, PendingVersion>::iterator it);
  void give_back_space();

  Status append(const detail::LogRecord& r);
  // ObjectStore::begin_commit() and write_commit(): the range's record; `touched`: its roots.
  Result<detail::LogRecord> commit_record(uint64_t handle, uint64_t offset, uint64_t length,
                                          std::vector<bool>* touched);
  uint64_t live_log_bytes() const;
  std::string snapshot() const;
  void maybe_compact();

  // object_store_open.cpp
  Status open_roots(Roots& roots_in, std::span<const int> rank_dirs);
  Status open_data(Roots& roots_in);
  Status replay(std::string_view bytes, bool& repair);
  bool apply(const detail::LogRecord& r, std::string& why);
  Status rebuild_allocators(bool& repair);
};

}  // namespace tmsdisk::storage
