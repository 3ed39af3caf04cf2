// SPDX-License-Identifier: Apache-2.0
// What tmsdiskd finds out about a storage root when it opens one (root.cpp): the filesystem it is on
// and whether that filesystem takes O_DIRECT. A library of its own (tmsdisk_root_probe), which
// `tmsctl doctor` links too: the doctor judges a root by the very probes the daemon runs, so the two
// cannot disagree about it.
#pragma once

#include <string>

#include "tmsdisk/common/result.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::storage {

// statfs(2)'s f_type of the filesystem directory `dir` lies on (in_memory_filesystem() judges it);
// the error names `path`.
Result<unsigned long> filesystem_type(int dir, const std::string& path);

// What an O_DIRECT probe of a directory found.
struct DirectIoProbe {
  enum class Outcome {
    Direct,    // a file was opened with O_DIRECT: `file`
    Buffered,  // O_DIRECT was refused (EINVAL) where the same open without it works: the filesystem has none
    Unknown,   // the open failed otherwise (`error`); the filesystem may lack O_TMPFILE itself
  };
  Outcome outcome = Outcome::Unknown;
  int error = 0;  // errno of the open with O_DIRECT; 0 when Direct
  UniqueFd file;  // Direct: opened O_RDWR | O_DIRECT, and nameless (it is gone once closed)
};

// Probes O_DIRECT in directory `dir` (any descriptor of it, O_PATH too) with an unnamed temporary
// file (O_TMPFILE), which leaves nothing behind. Where the filesystem has no O_TMPFILE, tmsdiskd
// cannot tell and leaves the decision to a rank's first data file, which it opens by name with
// O_DIRECT, and without it on EINVAL (open_data_file): given `fallback_name`, the probe then does
// the same with a new file of that name, removed at once, instead of answering Unknown.
DirectIoProbe probe_direct_io(int dir, const char* fallback_name = nullptr);

}  // namespace tmsdisk::storage
