// SPDX-License-Identifier: Apache-2.0
// The names of a rank's stored objects (daemon/storage/object_store.h): one rule for the wire, the
// store and the shim. A name never reaches a path, but tmsctl shows it and the daemon logs it.
#pragma once

#include <cstddef>
#include <string_view>

namespace tmsdisk {

inline constexpr std::size_t kMaxObjectNameLength = 127;
inline constexpr const char* kObjectNameRule = "1 to 127 of A-Z a-z 0-9 _ . - (never \".\" or \"..\")";

constexpr bool valid_object_name(std::string_view name) noexcept {
  if (name.empty() || name.size() > kMaxObjectNameLength || name == "." || name == "..") return false;
  for (char c : name) {
    const bool ok =
        (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace tmsdisk
