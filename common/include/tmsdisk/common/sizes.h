// SPDX-License-Identifier: Apache-2.0
// Binary size units, defined once for every program: settings given in MiB become bytes with these.
#pragma once

#include <cstdint>

namespace tmsdisk {

inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;

}  // namespace tmsdisk
