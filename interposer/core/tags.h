// SPDX-License-Identifier: Apache-2.0
// Tags (DESIGN.md, "Where the data goes"): the part of a process an allocation belongs to ("weights", "kv_cache"), and
// what a pause does with it. A thread pushes a tag with its policy (tmsdisk_tag_push, a Python region) and every
// allocation it makes until the matching pop carries the innermost one; allocations made outside any region carry
// "untagged", which is a tag like the others. Only the allocating thread's stack counts: another thread's region never
// tags this one's memory.
//
// Policies: backup (the pause saves the bytes: host tier, disk), discard (the pause releases the
// memory without saving it; the resume maps new memory at the same addresses, zero-filled: for a KV
// cache or CUDA-graph scratch whose content is garbage between phases), resident (never paused: the
// native allocator's memory, counted as unmanaged).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::shim {

enum class Policy : uint8_t { Backup = 0, Discard = 1, Resident = 2 };

using TagId = uint16_t;
inline constexpr TagId kUntagged = 0;
inline constexpr std::size_t kMaxTagLength = proto::kMaxTagLength;
inline constexpr std::size_t kMaxTagDepth = 32;

struct CurrentTag {
  TagId tag = kUntagged;
  Policy policy = Policy::Backup;
};

// 1 to 63 characters of [A-Za-z0-9_.-].
inline bool valid_tag_name(std::string_view name) noexcept {
  return !name.empty() && proto::valid_tag(name);
}

// torch_memory_saver's region state of the calling thread, as its C entry points set it
// (tms_entry_points.h): inside an "interesting region" the thread's allocations carry its current tag
// ("default" until one is set), backed up when its CPU or disk backup is on, else discarded, as TMS
// does with them. A tmsdisk region of the same thread (push_tag) is innermost and wins. A plain
// aggregate, zero at each thread's start.
struct TmsRegion {
  bool interesting;
  bool cpu_backup;
  bool disk_backup;
  bool mmap_backend;  // cpu_backup_backend "mmap" (else "pinned"): kept for tms_get_*, no other effect
  bool tag_set;       // `tag` was set (else "default")
  TagId tag;
};
TmsRegion& tms_region() noexcept;
// The tags torch_memory_saver regions gave allocations so far: what tms_pause(NULL) pauses.
std::vector<TagId> tms_tags_used();

// The calling thread's innermost tag, or untagged with backup.
CurrentTag current_tag() noexcept;
// The id of tag `name`, interned if new: 0, -EINVAL (not a tag name), -ENOSPC (too many distinct tags).
int intern_tag(const char* name, TagId* id) noexcept;
// 0, -EINVAL (bad name or policy), -ENOSPC (deeper than kMaxTagDepth, or too many distinct tags).
int push_tag(const char* name, int policy) noexcept;
// 0, or -ENOENT when the thread has none pushed.
int pop_tag() noexcept;

// The id of a tag some thread pushed (or "untagged"); nullopt for a name never seen.
std::optional<TagId> find_tag(std::string_view name) noexcept;
// The name of `id` ("untagged" for kUntagged); empty when out of memory.
std::string tag_name(TagId id) noexcept;
const char* policy_name(Policy p) noexcept;

}  // namespace tmsdisk::shim
