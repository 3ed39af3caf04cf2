// SPDX-License-Identifier: Apache-2.0
// Zero chunks found on the device (zero_scan.h).
#include "zero_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <limits>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {

// One block per chunk: its threads read the chunk in 16-byte words, coalesced, OR them together, and
// any thread that saw a non-zero word stores 1 in the chunk's flag (racing stores of the same value
// are harmless, and no block waits for another). `bytes` is the allocation's size rounded up to 16:
// the mapping always extends that far (it is a multiple of the allocation granularity), and a byte
// past the size that is not zero only makes its chunk count as data.
//   params: u64 base, u64 bytes, u64 chunk_bytes, u64 flags (one byte per chunk, cleared before)
const char* const kZeroScanPtx = R"ptx(
.version 7.0
.target sm_70
.address_size 64

.visible .entry tmsdisk_nonzero_chunks(
	.param .u64 p_base,
	.param .u64 p_bytes,
	.param .u64 p_chunk,
	.param .u64 p_flags
)
{
	.reg .pred %p<3>;
	.reg .b16 %rs<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<16>;

	ld.param.u64 %rd1, [p_base];
	ld.param.u64 %rd2, [p_bytes];
	ld.param.u64 %rd3, [p_chunk];
	ld.param.u64 %rd4, [p_flags];
	cvta.to.global.u64 %rd1, %rd1;
	cvta.to.global.u64 %rd4, %rd4;
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %tid.x;
	mov.u32 %r3, %ntid.x;
	cvt.u64.u32 %rd5, %r1;
	mul.lo.u64 %rd6, %rd5, %rd3;
	add.u64 %rd7, %rd6, %rd3;
	min.u64 %rd7, %rd7, %rd2;
	cvt.u64.u32 %rd8, %r2;
	shl.b64 %rd8, %rd8, 4;
	add.u64 %rd8, %rd6, %rd8;
	cvt.u64.u32 %rd9, %r3;
	shl.b64 %rd9, %rd9, 4;
	mov.u64 %rd10, 0;
SCAN:
	setp.ge.u64 %p1, %rd8, %rd7;
	@%p1 bra SCANNED;
	add.u64 %rd11, %rd1, %rd8;
	ld.global.v2.u64 {%rd12, %rd13}, [%rd11];
	or.b64 %rd10, %rd10, %rd12;
	or.b64 %rd10, %rd10, %rd13;
	add.u64 %rd8, %rd8, %rd9;
	bra SCAN;
SCANNED:
	setp.eq.u64 %p2, %rd10, 0;
	@%p2 bra DONE;
	add.u64 %rd14, %rd4, %rd5;
	mov.u16 %rs1, 1;
	st.global.u8 [%rd14], %rs1;
DONE:
	ret;
}
)ptx";

namespace {

constexpr unsigned kThreadsPerBlock = 256;

// Whether the allocation's own device may read it: an application mapping paused before its first
// cuMemSetAccess may not, and a kernel reading it would fault and poison the context.
bool readable_by_own_device(const Allocation& a) {
  for (const CUmemAccessDesc& d : a.access)
    if (d.location.type == CU_MEM_LOCATION_TYPE_DEVICE && d.location.id == a.device &&
        (d.flags == CU_MEM_ACCESS_FLAGS_PROT_READ || d.flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
      return true;
  return false;
}

}  // namespace

CUfunction ZeroScanner::kernel_for(CUcontext ctx) {
  for (const Loaded& l : loaded_)
    if (l.ctx == ctx) return l.kernel;
  const DriverApi& api = driver().api;
  Loaded l;
  l.ctx = ctx;
  CUresult r = CUDA_ERROR_NOT_SUPPORTED;
  if (api.cuModuleLoadData && api.cuModuleGetFunction && api.cuLaunchKernel) {
    r = api.cuModuleLoadData(&l.module, kZeroScanPtx);
    if (r == CUDA_SUCCESS) r = api.cuModuleGetFunction(&l.kernel, l.module, kZeroScanKernel);
  }
  if (r != CUDA_SUCCESS) {
    l.kernel = nullptr;
    TMS_LOG_ONCE(LogLevel::Warn,
                 "cannot load the zero-chunk scan kernel (%s (%d)): every chunk is written, zero or not",
                 cu_error_name(r), static_cast<int>(r));
  }
  loaded_.push_back(l);
  return l.kernel;
}

void ZeroScanner::warm(CUcontext ctx) {
  const DriverApi& api = driver().api;
  CtxScope scope(api, ctx);
  if (scope.ok()) (void)kernel_for(ctx);
}

Status ZeroScanner::scan(std::vector<TransferJob>& jobs, uint32_t chunk_bytes, TransferPipeline& pipeline) {
  const DriverApi& api = driver().api;
  if (chunk_bytes == 0 || !api.cuMemsetD8Async || !api.cuMemcpyDtoHAsync_v2) return {};
  auto cuda_error = [](const char* what, CUresult r) {
    return make_error(EIO,
                      fmt::format("zero-chunk scan: {} failed: {} ({})", what, cu_error_name(r), static_cast<int>(r)));
  };
  // By context: one flag buffer, one copy back and one wait for all of its allocations.
  std::vector<int> contexts;
  for (const TransferJob& j : jobs)
    if (std::find(contexts.begin(), contexts.end(), j.ctx) == contexts.end()) contexts.push_back(j.ctx);
  for (int ctx : contexts) {
    std::vector<TransferJob*> mine;
    uint64_t flags_bytes = 0;
    for (TransferJob& j : jobs) {
      if (j.ctx != ctx || j.a->size == 0 || !readable_by_own_device(*j.a)) continue;
      const uint64_t chunks = (j.a->size + chunk_bytes - 1) / chunk_bytes;
      if (chunks > std::numeric_limits<int32_t>::max()) continue;  // beyond one grid: left as data
      mine.push_back(&j);
      flags_bytes += chunks;
    }
    if (mine.empty()) continue;
    const CUcontext cu_ctx = mine.front()->a->ctx;
    CtxScope scope(api, cu_ctx);
    if (!scope.ok()) continue;
    const CUfunction kernel = kernel_for(cu_ctx);
    if (!kernel) continue;
    const CUstream stream = pipeline.stream(ctx);
    CUdeviceptr flags = 0;
    if (CUresult r = api.cuMemAlloc_v2(&flags, flags_bytes); r != CUDA_SUCCESS) {
      TMS_LOG_ONCE(LogLevel::Warn,
                   "no device memory for the zero-chunk scan's %llu flag bytes (%s): every chunk is written",
                   static_cast<unsigned long long>(flags_bytes), cu_error_name(r));
      continue;
    }
    struct FreeFlags {
      const DriverApi& api;
      CUdeviceptr p;
      ~FreeFlags() { api.cuMemFree_v2(p); }
    } free_flags{api, flags};
    CUresult r = api.cuMemsetD8Async(flags, 0, flags_bytes, stream);
    uint64_t at = 0;
    for (TransferJob* j : mine) {
      if (r != CUDA_SUCCESS) break;
      CUdeviceptr base = j->a->base;
      uint64_t bytes = (j->a->size + 15) / 16 * 16;
      uint64_t chunk = chunk_bytes;
      CUdeviceptr out = flags + at;
      void* params[] = {&base, &bytes, &chunk, &out};
      const uint64_t chunks = (j->a->size + chunk_bytes - 1) / chunk_bytes;
      r = api.cuLaunchKernel(kernel, static_cast<unsigned>(chunks), 1, 1, kThreadsPerBlock, 1, 1, 0, stream, params,
                             nullptr);
      at += chunks;
    }
    std::vector<uint8_t> nonzero(flags_bytes, 1);
    if (r == CUDA_SUCCESS) r = api.cuMemcpyDtoHAsync_v2(nonzero.data(), flags, flags_bytes, stream);
    // Whatever was queued finishes before the flags are read or freed. A failure to queue (launch
    // resources, say) leaves the context usable: the scan is skipped. A failure while running means
    // a kernel or copy faulted, and the context may be lost: the pause stops there.
    CUevent done = nullptr;
    CUresult ran = api.cuEventCreate(&done, CU_EVENT_DISABLE_TIMING);
    if (ran == CUDA_SUCCESS) ran = api.cuEventRecord(done, stream);
    if (ran == CUDA_SUCCESS) ran = api.cuEventSynchronize(done);
    if (done) api.cuEventDestroy_v2(done);
    if (ran != CUDA_SUCCESS) return cuda_error("scanning device memory", ran);
    if (r != CUDA_SUCCESS) {
      TMS_LOG_ONCE(LogLevel::Warn, "cannot start the zero-chunk scan (%s (%d)): every chunk is written",
                   cu_error_name(r), static_cast<int>(r));
      continue;
    }
    at = 0;
    for (TransferJob* j : mine) {
      const uint64_t chunks = (j->a->size + chunk_bytes - 1) / chunk_bytes;
      j->place.assign(chunks, ChunkPlace::Disk);
      for (uint64_t i = 0; i < chunks; ++i)
        if (nonzero[at + i] == 0) j->place[i] = ChunkPlace::Zero;
      at += chunks;
    }
  }
  return {};
}

}  // namespace tmsdisk::shim
