// SPDX-License-Identifier: Apache-2.0
// Tags (tags.h).
#include "tags.h"

#include <array>
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

std::optional<TagId> find_locked(TagTable& t, std::string_view name) noexcept {
  for (std::size_t i = 0; i < t.count; ++i)
    if (name == std::string_view(t.names[i].data())) return static_cast<TagId>(i);
  return std::nullopt;
}

}  // namespace

CurrentTag current_tag() noexcept {
  const TagStack& s = tls_stack;
  if (s.depth == 0) return {};
  return {s.tags[s.depth - 1], s.policies[s.depth - 1]};
}

int push_tag(const char* name, int policy) noexcept {
  if (!name || !valid_tag_name(name) || policy < 0 || policy > static_cast<int>(Policy::Resident)) return -EINVAL;
  TagStack& s = tls_stack;
  if (s.depth >= kMaxTagDepth) return -ENOSPC;
  TagTable& t = table();
  TagId id;
  {
    std::lock_guard lock(t.mu);
    std::optional<TagId> found = find_locked(t, name);
    if (!found) {
      if (t.count >= kMaxTags) return -ENOSPC;
      std::string_view(name).copy(t.names[t.count].data(), kMaxTagLength);
      found = static_cast<TagId>(t.count++);
    }
    id = *found;
  }
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
