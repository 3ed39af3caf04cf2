// SPDX-License-Identifier: Apache-2.0
// The units the tests write their byte figures in: one MiB and one GiB, defined once for every test
// program.
#pragma once

#include <cstdint>

namespace tmsdisk::testing {

inline constexpr uint64_t MiB = 1ull << 20;
inline constexpr uint64_t GiB = 1ull << 30;

}  // namespace tmsdisk::testing
