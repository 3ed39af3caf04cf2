// SPDX-License-Identifier: Apache-2.0
// The gate: every hooked call that submits GPU work or reads device memory passes it. Open, passing
// costs one atomic increment of a counter only this thread writes and one load of a shared word;
// a pause closes it, waits for the calls already inside, and only then synchronizes and moves data.
// While closed, a call follows TMSDISK_ON_TOUCH (wait, resume or fail).
//
// After a resume that could not restore some allocations because their backup is damaged, the gate
// is open but knows their address ranges as *lost*: a call that names a lost range (copies, sets,
// prefetches, stream memory operations, VMM calls on it) follows TMSDISK_ON_TOUCH as if paused;
// every other call proceeds, kernel and graph launches included (they do not say which memory they
// read: a kernel that reads a lost range faults on the unmapped memory, never reads zeros). Checking
// ranges costs nothing while nothing is lost: it happens only on the slow path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "on_touch.h"
#include "tmsdisk/common/result.h"

namespace tmsdisk::shim {

// The error a gated call returns under TMSDISK_ON_TOUCH=fail (documented in README.md).
inline constexpr CUresult kGateClosedError = CUDA_ERROR_NOT_PERMITTED;

namespace gate {

// Whether a call touches lost memory, as far as its arguments say.
enum class Touch : uint8_t {
  Clear,   // it names address ranges, none of them lost
  Lost,    // it names a lost range
  Unseen,  // it names none (a kernel or graph launch): it proceeds
};
// Asked only while some memory is lost; `ctx` is what the caller passed to enter(). Calls lost()
// for each range the call names.
using TouchCheck = Touch (*)(const void* ctx) noexcept;

// Application side. enter() returns CUDA_SUCCESS once the calling thread is inside (leave() must
// follow), or kGateClosedError (fail policy, or an automatic resume that failed): not inside.
// `check` (may be null: Unseen) tells whether the call touches lost memory.
CUresult enter(const char* what, TouchCheck check = nullptr, const void* ctx = nullptr) noexcept;
void leave() noexcept;

// Lost memory: the ranges of allocations a resume could not restore (damaged backup). Replaces the
// list; an empty one means nothing is lost. Threads held because they touched lost memory look again.
struct Range {
  CUdeviceptr base = 0;
  std::size_t size = 0;
};
void set_lost(std::vector<Range> ranges) noexcept;
// The allocation at `base` was freed: its range is no longer lost (the address may be reused at once).
void forget_lost(CUdeviceptr base) noexcept;
// True if [base, base+size) overlaps a lost range (for TouchCheck functions).
bool lost(CUdeviceptr base, std::size_t size) noexcept;
// A TouchCheck's answer for one range.
inline Touch range_touch(CUdeviceptr base, std::size_t size) noexcept {
  return lost(base, size) ? Touch::Lost : Touch::Clear;
}
// Threads now held at the gate, closed or because they touched lost memory (tests, diagnostics).
std::size_t held_count() noexcept;

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

// Enters the gate for one hooked call; result() says whether the call may proceed. `touches`, a
// callable returning gate::Touch, says what the call touches; it is called only while some memory is
// lost, so building its ranges costs nothing otherwise.
class GateScope {
 public:
  explicit GateScope(const char* what) noexcept : result_(gate::enter(what)) {}
  template <class Touches>
  GateScope(const char* what, const Touches& touches) noexcept
      : result_(gate::enter(
            what, [](const void* t) noexcept -> gate::Touch { return (*static_cast<const Touches*>(t))(); },
            &touches)) {}
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
