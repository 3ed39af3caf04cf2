// SPDX-License-Identifier: Apache-2.0
// The gate: every hooked call that submits GPU work or reads device memory passes it. Open, passing
// costs one atomic increment of a counter only this thread writes and one load of a shared word;
// a pause closes it, waits for the calls already inside, and only then synchronizes and moves data.
// While closed, a call follows TMSDISK_ON_TOUCH (wait, resume or fail).
#pragma once

#include <cstdint>
#include <string>

#include "cuda_api.h"
#include "on_touch.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

// The error a gated call returns under TMSDISK_ON_TOUCH=fail (documented in README.md).
inline constexpr CUresult kGateClosedError = CUDA_ERROR_NOT_PERMITTED;

namespace gate {

// Application side. enter() returns CUDA_SUCCESS once the calling thread is inside (leave() must
// follow), or kGateClosedError (fail policy, or an automatic resume that failed): not inside.
CUresult enter(const char* what) noexcept;
void leave() noexcept;

// The automatic resume of TMSDISK_ON_TOUCH=resume, registered by whoever runs resumes (the engine)
// so that the gate depends on nothing above it. EBUSY: another pause or resume is running.
using AutoResume = Status (*)() noexcept;
void set_auto_resume(AutoResume fn) noexcept;

// Engine side (control thread). An operation brackets close/drain/open with begin_op/end_op so that
// threads waiting under the resume policy know when to try again.
void begin_op() noexcept;
void end_op() noexcept;
void close() noexcept;
// Returns true once no thread is inside a gated call, false if some still is after `timeout_ms`.
bool drain(int timeout_ms) noexcept;
void open() noexcept;
bool is_closed() noexcept;

// Stream captures seen through the hooks (cuStreamBeginCapture*/cuStreamEndCapture*).
void capture_begin(CUstream stream, bool per_thread) noexcept;
void capture_end(CUstream stream, bool per_thread) noexcept;
// EBUSY, saying why a pause must wait, while a capture is still active. Asks the driver about each
// stream it can (cuStreamIsCapturing) and forgets those whose capture ended or that were destroyed.
Status no_capture_active();

// pthread_atfork: the child has only the forking thread, so no other thread can be inside.
void fork_prepare() noexcept;
void fork_parent() noexcept;
void fork_child() noexcept;

}  // namespace gate

// Enters the gate for one hooked call; result() says whether the call may proceed.
class GateScope {
 public:
  explicit GateScope(const char* what) noexcept : result_(gate::enter(what)) {}
  ~GateScope() {
    if (result_ == CUDA_SUCCESS) gate::leave();
  }
  GateScope(const GateScope&) = delete;
  GateScope& operator=(const GateScope&) = delete;
  CUresult result() const noexcept { return result_; }

 private:
  CUresult result_;
};

}  // namespace tmsdisk::shim
