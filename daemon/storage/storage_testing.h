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

// Called before every truncation and every punched piece that gives a reservation's unused space
// back (background_punch.h), on the thread that does it, with the root index and the range (a
// truncation: the new size and the bytes cut off). A test that blocks in it holds that work back.
using PunchHook = void (*)(std::size_t root, uint64_t offset, uint64_t length);
PunchHook set_punch_hook(PunchHook hook) noexcept;

// Called on a store's thread when it is about to wait for space still being given back (its next
// reservation, wait_for_punches(), removal, destruction), before it waits.
using PunchWaitHook = void (*)();
PunchWaitHook set_punch_wait_hook(PunchWaitHook hook) noexcept;

}  // namespace tmsdisk::storage::testing
