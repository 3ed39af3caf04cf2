// SPDX-License-Identifier: Apache-2.0
// Callbacks the program registers (tmsdisk_on_pause) to hand back memory it does not need before a
// pause moves it, e.g. PyTorch's caching allocator emptying its cache (the start-up module that
// `tmsctl run` puts on the Python path registers one).
//
// They run on a thread of their own, started for each pause, never on the control thread:
// - the control thread's driver calls bypass the hooks (mark_shim_thread), while a callback's frees
//   must go through them (a managed allocation is VMM-backed: the driver's cuMemFree cannot free it);
// - a callback may block on what a thread of the program holds: Python's GIL, taken by a thread that
//   called tmsdisk_pause() with the GIL held (ctypes.PyDLL) or by one waiting on the control thread
//   (a brokered CUDA IPC call). The control thread waits for the callbacks only so long, then pauses
//   without them; a callback that returns later works like any thread of the program during a pause.
#pragma once

#include <cstddef>

namespace tmsdisk::shim {

using PauseCallback = void (*)(void* arg);

// How many callbacks a process may register: a handful of frameworks, not one per object.
inline constexpr std::size_t kMaxPauseCallbacks = 16;

// Registers `callback(arg)` to run before each pause. 0; the same pair again is registered once
// (0); -EINVAL for a null callback; -ENOSPC when kMaxPauseCallbacks are registered.
int add_pause_callback(PauseCallback callback, void* arg) noexcept;

// Runs every registered callback, in the order registered, on a new thread, and waits for them up to
// `timeout_ms`. Returns at once when none is registered. When the callbacks of an earlier pause still
// run (they timed out and have not returned), they are not started again: said once, in the log.
// Returns true when the callbacks ran to completion (or there were none).
bool run_pause_callbacks(int timeout_ms) noexcept;

// Tests only: forgets every registered callback.
void clear_pause_callbacks() noexcept;

// pthread_atfork child: the callbacks' thread does not exist in the child, and the registration lock
// may have been held by a thread that does not either.
void pause_callbacks_fork_child() noexcept;

}  // namespace tmsdisk::shim
