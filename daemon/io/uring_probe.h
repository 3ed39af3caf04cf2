// SPDX-License-Identifier: Apache-2.0
// How tmsdiskd finds whether it may use io_uring: the ring its engine sets up (io_engine.cpp), and
// the sysctl that may refuse it. A library of its own (tmsdisk_uring_probe), which `tmsctl doctor`
// links too: the doctor's io_uring check makes the engine's very ring, so the two cannot disagree.
#pragma once

#include <optional>

struct io_uring;  // liburing.h, which only uring_probe.cpp and io_engine.cpp include

namespace tmsdisk::io {

// Sets up `ring` with `entries` entries as the engine does: with IORING_SETUP_SUBMIT_ALL, so that one
// bad SQE does not stall those behind it, where the kernel has it (5.18+), else without. 0, or a
// negative errno (liburing's convention).
int setup_ring(io_uring& ring, unsigned entries) noexcept;

// Whether this process may set up the engine's ring (setup_ring), torn down again at once: 0, or the
// errno that refused it.
int ring_setup_error(unsigned entries) noexcept;

// kernel.io_uring_disabled (Linux 6.6+): 0 io_uring for all, 1 only with CAP_SYS_ADMIN or in
// kernel.io_uring_group, 2 for none. nullopt where the sysctl is absent or unreadable.
std::optional<int> io_uring_disabled() noexcept;

}  // namespace tmsdisk::io
