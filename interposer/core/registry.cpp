// SPDX-License-Identifier: Apache-2.0
// Registry of managed and native device allocations (registry.h).
#include "registry.h"

#include <algorithm>
#include <iterator>
#include <new>
#include <tuple>

namespace tmsdisk::shim {

std::shared_ptr<Allocation> Registry::add(std::unique_ptr<Allocation> a) {
  std::shared_ptr<Allocation> shared(std::move(a));
  std::lock_guard lock(mu_);
  shared->id = next_id_++;
  managed_[shared->base] = shared;
  version_.fetch_add(1, std::memory_order_relaxed);
  return shared;
}

std::shared_ptr<Allocation> Registry::find(CUdeviceptr ptr) const {
  std::lock_guard lock(mu_);
  auto it = managed_.upper_bound(ptr);
  if (it == managed_.begin()) return nullptr;
  --it;
  const Allocation& a = *it->second;
  if (ptr - a.base < a.mapped) return it->second;
  return nullptr;
}

std::shared_ptr<Allocation> Registry::remove(CUdeviceptr base) {
  std::lock_guard lock(mu_);
  auto it = managed_.find(base);
  if (it == managed_.end()) return nullptr;
  auto a = std::move(it->second);
  managed_.erase(it);
  version_.fetch_add(1, std::memory_order_relaxed);
  return a;
}

std::vector<std::shared_ptr<Allocation>> Registry::overlapping(CUdeviceptr ptr, std::size_t bytes) const {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Allocation>> out;
  if (bytes == 0) return out;
  // The allocation that contains `ptr`, if any, then every one that starts inside the range.
  auto it = managed_.upper_bound(ptr);
  if (it != managed_.begin() && ptr - std::prev(it)->second->base < std::prev(it)->second->mapped)
    out.push_back(std::prev(it)->second);
  for (; it != managed_.end() && it->first - ptr < bytes; ++it) out.push_back(it->second);
  return out;
}

std::vector<std::shared_ptr<Allocation>> Registry::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Allocation>> out;
  out.reserve(managed_.size());
  for (const auto& [base, a] : managed_) out.push_back(a);
  return out;
}

void Registry::pin(Allocation& a, proto::Unmanaged reason) noexcept {
  std::lock_guard lock(mu_);
  int none = -1;
  if (a.pinned.compare_exchange_strong(none, static_cast<int>(reason)))
    version_.fetch_add(1, std::memory_order_relaxed);
}

void Registry::add_unmanaged(CUdeviceptr ptr, std::size_t bytes, proto::Unmanaged reason) noexcept {
  std::lock_guard lock(mu_);
  decltype(native_)::iterator it;
  bool inserted;
  try {
    std::tie(it, inserted) = native_.try_emplace(ptr, Native{bytes, reason});
  } catch (...) {
    return;
  }
  if (!inserted) {
    // The driver reused an address we missed the free of: replace the stale record.
    unmanaged_bytes_[static_cast<std::size_t>(it->second.reason)] -= it->second.bytes;
    it->second = Native{bytes, reason};
  }
  unmanaged_bytes_[static_cast<std::size_t>(reason)] += bytes;
  version_.fetch_add(1, std::memory_order_relaxed);
}

bool Registry::remove_unmanaged(CUdeviceptr ptr) noexcept {
  std::lock_guard lock(mu_);
  auto it = native_.find(ptr);
  if (it == native_.end()) return false;
  unmanaged_bytes_[static_cast<std::size_t>(it->second.reason)] -= it->second.bytes;
  native_.erase(it);
  version_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Registry::set_importers(Allocation& a, uint32_t importers) noexcept {
  if (a.importers.exchange(importers) != importers) version_.fetch_add(1, std::memory_order_relaxed);
}

RegistryTotals Registry::totals() const {
  std::lock_guard lock(mu_);
  RegistryTotals t;
  t.unmanaged_bytes = unmanaged_bytes_;
  for (const auto& [base, a] : managed_) {
    if (const int reason = a->pinned.load(std::memory_order_relaxed); reason >= 0) {
      t.unmanaged_bytes[static_cast<std::size_t>(reason)] += a->size;
      continue;
    }
    if (a->importers.load(std::memory_order_relaxed) > 0 &&
        a->state.load(std::memory_order_relaxed) == AllocState::Resident) {
      t.unmanaged_bytes[static_cast<std::size_t>(proto::Unmanaged::Exported)] += a->size;
      continue;
    }
    ++t.managed_allocations;
    if (a->state.load(std::memory_order_relaxed) == AllocState::Paused) {
      t.paused_bytes += a->size;
      ++t.paused_allocations;
      if (a->damage.load(std::memory_order_relaxed) != 0) {
        t.damaged_bytes += a->size;
        ++t.damaged_allocations;
      }
    } else {
      t.resident_bytes += a->size;
    }
  }
  return t;
}

std::vector<TagTotals> Registry::tag_totals() const {
  std::lock_guard lock(mu_);
  std::vector<TagTotals> out;
  for (const auto& [base, a] : managed_) {
    if (a->pinned.load(std::memory_order_relaxed) >= 0) continue;  // counted as unmanaged
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const TagTotals& t) { return t.tag == a->tag && t.policy == a->policy; });
    if (it == out.end()) it = out.insert(out.end(), TagTotals{.tag = a->tag, .policy = a->policy});
    ++it->allocations;
    if (a->state.load(std::memory_order_relaxed) == AllocState::Paused) {
      ++it->paused_allocations;
      it->paused_bytes += a->size;
    } else {
      it->resident_bytes += a->size;
    }
  }
  return out;
}

Registry& registry() noexcept {
  // Never destroyed: hooks can run during static destruction and from threads still alive at exit.
  alignas(Registry) static unsigned char storage[sizeof(Registry)];
  static Registry* r = new (storage) Registry;
  return *r;
}

}  // namespace tmsdisk::shim
