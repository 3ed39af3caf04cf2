// SPDX-License-Identifier: Apache-2.0
// Tags (tags.h).
#include "tags.h"

#include <array>
#include <atomic>
#include <cerrno>
#include <mutex>

namespace tmsdisk::shim {

namespace {

// Names by id, interned once: an allocation stores two bytes, not a string. Entries are written once
// under the mutex and never change, so readers of an id they got from an allocation need the lock only
// to see the write (taken anyway: it is rare, for status and for a pause).
constexpr std::size_t kMaxTags = 1024;
struct TagTable {
  std::mutex mu;
  std::array<std::array<char, kMaxTagLength + 1>, kMaxTags> names{};
  std::size_t count = 1;  // 0: "untagged"
};

TagTable& table() noexcept {
  static TagTable* t = [] {
    auto* t = new TagTable;  // never destroyed: allocations made during exit still read it
    std::string_view u = "untagged";
    u.copy(t->names[0].data(), u.size());
    return t;
  }();
  return *t;
}

// A plain aggregate: a preloaded library's thread_local with a constructor would run it on every
// thread's first use; zero-initialized storage needs none.
struct TagStack {
  TagId tags[kMaxTagDepth];
  Policy policies[kMaxTagDepth];
  uint8_t depth;
};
thread_local TagStack tls_stack;
thread_local TmsRegion tls_tms;

// Tags a torch_memory_saver region gave an allocation, by id: set on the allocation path, which
// takes no lock.
std::array<std::atomic<bool>, kMaxTags> tms_used{};

std::optional<TagId> find_locked(TagTable& t, std::string_view name) noexcept {
  for (std::size_t i = 0; i < t.count; ++i)
    if (name == std::string_view(t.names[i].data())) return static_cast<TagId>(i);
  return std::nullopt;
}

}  // namespace

TmsRegion& tms_region() noexcept {
  return tls_tms;
}

std::vector<TagId> tms_tags_used() {
  std::vector<TagId> used;
  for (std::size_t i = 0; i < kMaxTags; ++i)
    if (tms_used[i].load(std::memory_order_relaxed)) used.push_back(static_cast<TagId>(i));
  return used;
}

CurrentTag current_tag() noexcept {
  const TagStack& s = tls_stack;
  if (s.depth > 0) return {s.tags[s.depth - 1], s.policies[s.depth - 1]};
  const TmsRegion& r = tls_tms;
  if (!r.interesting) return {};
  TagId id = r.tag;
  if (!r.tag_set) {
    // TMS's tag until one is set; interned once (a full table leaves such memory untagged).
    static const TagId kDefault = [] {
      TagId d = kUntagged;
      return intern_tag("default", &d) == 0 ? d : kUntagged;
    }();
    id = kDefault;
  }
  tms_used[id].store(true, std::memory_order_relaxed);
  return {id, r.cpu_backup || r.disk_backup ? Policy::Backup : Policy::Discard};
}

int intern_tag(const char* name, TagId* id) noexcept {
  if (!name || !valid_tag_name(name)) return -EINVAL;
  TagTable& t = table();
  std::lock_guard lock(t.mu);
  std::optional<TagId> found = find_locked(t, name);
  if (!found) {
    if (t.count >= kMaxTags) return -ENOSPC;
    std::string_view(name).copy(t.names[t.count].data(), kMaxTagLength);
    found = static_cast<TagId>(t.count++);
  }
  *id = *found;
  return 0;
}

int push_tag(const char* name, int policy) noexcept {
  if (!name || !valid_tag_name(name) || policy < 0 || policy > static_cast<int>(Policy::Resident)) return -EINVAL;
  TagStack& s = tls_stack;
  if (s.depth >= kMaxTagDepth) return -ENOSPC;
  TagId id = kUntagged;
  if (const int rc = intern_tag(name, &id); rc != 0) return rc;
  s.tags[s.depth] = id;
  s.policies[s.depth] = static_cast<Policy>(policy);
  ++s.depth;
  return 0;
}

int pop_tag() noexcept {
  TagStack& s = tls_stack;
  if (s.depth == 0) return -ENOENT;
  --s.depth;
  return 0;
}

std::optional<TagId> find_tag(std::string_view name) noexcept {
  TagTable& t = table();
  std::lock_guard lock(t.mu);
  return find_locked(t, name);
}

std::string tag_name(TagId id) noexcept {
  TagTable& t = table();
  try {
    std::lock_guard lock(t.mu);
    return id < t.count ? std::string(t.names[id].data()) : std::string();
  } catch (...) {
    return {};
  }
}

const char* policy_name(Policy p) noexcept {
  switch (p) {
    case Policy::Backup: return "backup";
    case Policy::Discard: return "discard";
    case Policy::Resident: return "resident";
  }
  return "?";
}

}  // namespace tmsdisk::shim
