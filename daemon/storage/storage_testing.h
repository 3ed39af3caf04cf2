// SPDX-License-Identifier: Apache-2.0
// Test hooks of the storage component: fault injection that production code never sets.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tmsdisk::storage::testing {

// Called before every fallocate(2) that reserve() issues, with the root index and the range. Returning
// a positive errno makes that fallocate fail with it (without calling the kernel); 0 lets it run.
// Lets tests drive the all-or-nothing rollback at any point, on any filesystem.
using FallocateHook = int (*)(std::size_t root, uint64_t offset, uint64_t length);

// Installs `hook` (nullptr removes it) and returns the previous one.
FallocateHook set_fallocate_hook(FallocateHook hook) noexcept;

}  // namespace tmsdisk::storage::testing
