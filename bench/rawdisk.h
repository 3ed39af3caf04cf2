// SPDX-License-Identifier: Apache-2.0
// Raw disk ceiling: sequential O_DIRECT write and read bandwidth of a directory, through the I/O engine.
//
// Every tmsdisk pause/resume figure is reported as a ratio against this ceiling, measured by the same
// engine on the same directory (DESIGN.md, "Performance").
#pragma once

#include <cstdint>
#include <string>

#include "tmsdisk/common/result.h"

namespace tmsdisk::bench {

struct RawDiskResult {
  double write_bytes_per_s = 0;  // sequential writes, including the one fdatasync a pause also pays
  double read_bytes_per_s = 0;   // sequential reads of what was just written, from the device (better of 2 passes)
  bool direct_io = false;        // false: the filesystem refused O_DIRECT; buffered I/O, cache dropped
  bool io_uring = false;         // false: the engine fell back to pread/pwrite
  uint64_t bytes = 0;            // moved each way (total rounded up to 4 KiB)
  std::string notes;             // why direct_io or io_uring is false, and other caveats
};

// Creates an unlinked temporary file in `dir` (so nothing is left behind even on a crash),
// preallocates `total_bytes`, writes it sequentially with `queue_depth` requests of `request_bytes`
// in flight, then reads it back the same way. `request_bytes` must be a positive multiple of 4096.
// Fails on invalid arguments, a missing directory, too little space, or any I/O error.
Result<RawDiskResult> measure_raw_disk(const std::string& dir, uint64_t total_bytes, uint32_t request_bytes = 8u << 20,
                                       unsigned queue_depth = 8);

}  // namespace tmsdisk::bench
