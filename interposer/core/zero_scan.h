// SPDX-License-Identifier: Apache-2.0
// Zero chunks (DESIGN.md, "Where the data goes"): before a pause reserves disk space, a kernel on each allocation's
// device reads its memory once and flags the chunks that hold a non-zero byte. The others are all zero: they are not
// staged, written nor read back, take no disk space, and resume sets them to zero on the device. A preallocated pool
// that was never touched (XLA's 75% of HBM) then costs nothing.
//
// The kernel is PTX text, compiled by the driver's JIT when first loaded in a context: no CUDA
// compiler at build time, and it runs on any GPU the driver supports. It reads HBM at its bandwidth
// (terabytes per second), so the scan is a few tens of milliseconds against the seconds a disk
// needs for the same bytes; TMSDISK_ZERO_SCAN=0 turns it off.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_api.h"
#include "tmsdisk/common/result.h"
#include "transfer.h"

namespace tmsdisk::shim {

// The kernel's entry point (in kZeroScanPtx; simcuda implements it under the same name).
inline constexpr const char* kZeroScanKernel = "tmsdisk_nonzero_chunks";
extern const char* const kZeroScanPtx;

class ZeroScanner {
 public:
  ZeroScanner() = default;
  ZeroScanner(const ZeroScanner&) = delete;
  ZeroScanner& operator=(const ZeroScanner&) = delete;

  // Sets each job's `place` (one entry per chunk of `chunk_bytes`, Zero where every byte is zero) and
  // recounts its `chunks` as the chunks left to move. A job the scan cannot cover (the kernel does
  // not load, no device memory for the flags, an allocation its device may not read) keeps every
  // chunk as data, said once in the log: skipping a scan costs bytes, never correctness. An error
  // once a kernel ran (its context may be unusable) is returned: the pause must not go on.
  Status scan(std::vector<TransferJob>& jobs, uint32_t chunk_bytes, TransferPipeline& pipeline);
  // Loads the kernel in `ctx` ahead of the first scan (a PTX module load takes tens of ms).
  void warm(CUcontext ctx);

 private:
  struct Loaded {
    CUcontext ctx = nullptr;
    CUmodule module = nullptr;
    CUfunction kernel = nullptr;  // null: the module did not load in this context
  };
  // The kernel in `ctx` (current), loaded on first use; null if it cannot be.
  CUfunction kernel_for(CUcontext ctx);

  std::vector<Loaded> loaded_;
};

}  // namespace tmsdisk::shim
