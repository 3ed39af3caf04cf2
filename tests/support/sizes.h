// SPDX-License-Identifier: Apache-2.0
// The unit tests write their byte figures in: one MiB, defined once for every test program.
#pragma once

#include <cstdint>

namespace tmsdisk::testing {

inline constexpr uint64_t MiB = 1ull << 20;

}  // namespace tmsdisk::testing
