// SPDX-License-Identifier: Apache-2.0
// Hooks that only pass the gate: kernel and graph launches, copies, sets, prefetches (one generic
// definition, TMSDISK_GATED_HOOKS), and stream capture, which is also recorded for the pause. Each
// tells the gate which memory it names (touch.h), so that only calls naming lost memory are held.
#include "driver.h"
#include "gate.h"
#include "touch.h"

namespace tmsdisk::shim::hook {

// The driver's function, or CUDA_ERROR_NOT_FOUND when this libcuda lacks it (a program linked
// against a newer driver reached our export instead of failing to load). Calls from the shim's own
// threads, and calls while the shim is disabled, go straight through.
#define TMSDISK_X(name, params, args, ...)                                                                     \
  CUresult name params noexcept {                                                                              \
    ReentryGuard tms_guard;                                                                                    \
    const Driver& tms_driver = driver();                                                                       \
    const auto tms_real = tms_driver.api.name;                                                                 \
    if (!tms_real) return CUDA_ERROR_NOT_FOUND;                                                                \
    if (tms_guard.nested() || !tms_driver.usable) return tms_real args;                                        \
    constexpr touch::Shape tms_shape = touch::shape_of(#name);                                                 \
    static_assert(tms_shape != touch::Shape::Unknown, "classify " #name " in touch.h: which memory it names"); \
    auto tms_touches = [&]() noexcept { return touch::check<tms_shape> args; };                                \
    GateScope tms_gate(#name, tms_touches);                                                                    \
    if (tms_gate.result() != CUDA_SUCCESS) return tms_gate.result();                                           \
    return tms_real args;                                                                                      \
  }
TMSDISK_GATED_HOOKS(TMSDISK_X)
#undef TMSDISK_X

namespace {

template <class Fn, class... Args>
CUresult begin_capture(Fn real, const char* what, bool per_thread, CUstream stream, Args... rest) noexcept {
  ReentryGuard guard;
  if (!real) return CUDA_ERROR_NOT_FOUND;
  if (guard.nested() || !driver().usable) return real(stream, rest...);
  // Gated: a capture cannot begin while paused, and a pause never starts while one is active. It
  // touches no memory itself (the launches it records pass the gate on their own).
  GateScope gate(what, []() noexcept { return gate::Touch::Clear; });
  if (gate.result() != CUDA_SUCCESS) return gate.result();
  const CUresult r = real(stream, rest...);
  if (r == CUDA_SUCCESS) gate::capture_begin(stream, per_thread);
  return r;
}

CUresult end_capture(decltype(DriverApi::cuStreamEndCapture) real, const char* what, bool per_thread, CUstream stream,
                     CUgraph* graph) noexcept {
  ReentryGuard guard;
  if (!real) return CUDA_ERROR_NOT_FOUND;
  if (guard.nested() || !driver().usable) return real(stream, graph);
  GateScope gate(what, []() noexcept { return gate::Touch::Clear; });
  if (gate.result() != CUDA_SUCCESS) return gate.result();
  const CUresult r = real(stream, graph);
  // A capture ends with the call whatever it returns (invalidated captures included), except when
  // a thread-local capture is ended from another thread.
  if (r != CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD) gate::capture_end(stream, per_thread);
  return r;
}

}  // namespace

CUresult cuStreamBeginCapture(CUstream hStream) noexcept {
  return begin_capture(driver().api.cuStreamBeginCapture, "cuStreamBeginCapture", false, hStream);
}
CUresult cuStreamBeginCapture_ptsz(CUstream hStream) noexcept {
  return begin_capture(driver().api.cuStreamBeginCapture_ptsz, "cuStreamBeginCapture_ptsz", true, hStream);
}
CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) noexcept {
  return begin_capture(driver().api.cuStreamBeginCapture_v2, "cuStreamBeginCapture_v2", false, hStream, mode);
}
CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) noexcept {
  return begin_capture(driver().api.cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture_v2_ptsz", true, hStream, mode);
}
CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph, const CUgraphNode* dependencies,
                                     const CUgraphEdgeData* dependencyData, size_t numDependencies,
                                     CUstreamCaptureMode mode) noexcept {
  return begin_capture(driver().api.cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", false, hStream, hGraph,
                       dependencies, dependencyData, numDependencies, mode);
}
CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph, const CUgraphNode* dependencies,
                                          const CUgraphEdgeData* dependencyData, size_t numDependencies,
                                          CUstreamCaptureMode mode) noexcept {
  return begin_capture(driver().api.cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph_ptsz", true, hStream,
                       hGraph, dependencies, dependencyData, numDependencies, mode);
}
CUresult cuStreamEndCapture(CUstream hStream, CUgraph* phGraph) noexcept {
  return end_capture(driver().api.cuStreamEndCapture, "cuStreamEndCapture", false, hStream, phGraph);
}
CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph* phGraph) noexcept {
  return end_capture(driver().api.cuStreamEndCapture_ptsz, "cuStreamEndCapture_ptsz", true, hStream, phGraph);
}

}  // namespace tmsdisk::shim::hook
