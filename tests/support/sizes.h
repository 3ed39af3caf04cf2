// SPDX-License-Identifier: Apache-2.0
// The units the tests write their byte figures in: one MiB and one GiB, defined once for every test
// program.
#pragma once

#include <cstdint>

#include "tmsdisk/common/sizes.h"

namespace tmsdisk::testing {

inline constexpr uint64_t MiB = tmsdisk::kMiB;
inline constexpr uint64_t GiB = tmsdisk::kGiB;

}  // namespace tmsdisk::testing
