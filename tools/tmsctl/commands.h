// SPDX-License-Identifier: Apache-2.0
// tmsctl's subcommands, each returning the process exit status. main.cpp only parses options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::ctl {

// Exit statuses, as the man page promises them. kExitFailed: the daemon could not be reached or did
// not answer in time, or a rank failed or did not answer in time.
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;  // the command line is wrong; nothing was done

struct Common {
  std::string socket;  // empty: default_socket_path()
  bool json = false;
  double timeout_s = 0;  // --timeout: give up after this many seconds (0: the defaults, deadline.h)
};

struct Selector {
  std::string job;
  int64_t rank = -1;
  int32_t pid = 0;
  bool all = false;
  std::string tag;         // pause/resume: only allocations carrying it
  bool tag_given = false;  // --tag was given (perhaps empty, which is refused); false: all allocations
};

struct LaunchOptions {
  std::string job;                 // TMSDISK_JOB for the launch (default: launcher ids, else "default")
  uint64_t staging_budget_mb = 0;  // TMS_DISK_BACKUP_CHUNK_MB (0: the daemon's default)
  uint64_t min_mb = 0;             // TMSDISK_MIN_BYTES in MiB (0: the shim's default)
  std::string on_touch;            // TMSDISK_ON_TOUCH: wait | resume | fail (empty: the shim's default, wait)
  bool start_daemon = true;        // run: start a private daemon when none answers
  // The Python start-up module on PYTHONPATH, TMSDISK_TORCH_EMPTY_CACHE=1: PyTorch empties its cache
  // before each pause. false (--keep-torch-cache): TMSDISK_TORCH_EMPTY_CACHE=0, PYTHONPATH untouched.
  bool empty_torch_cache = true;
  // --tms-compat: the directory of tmsdisk's torch_memory_saver compatibility module first on PYTHONPATH,
  // so that `import torch_memory_saver` in the launch pauses and resumes through tmsdisk.
  bool tms_compat = false;
  // --stream-optimizer[=fp32|bf16|fp8]: TMSDISK_STREAM_OPTIMIZER for the start-up module, which makes
  // torch.optim.AdamW and Adam tmsdisk.optim's streamed classes with moments of that dtype (empty: off).
  std::string stream_optimizer;
};

// Tells a failure: "WHERE: MESSAGE" on stderr, or with --json a JSON object on stdout
// ({"ok": false, "error": MESSAGE, "errno": N, "usage": true|false}), so that a script parsing the
// output gets an answer for every outcome.
void print_failure(bool json, const std::string& where, const std::string& message, int errnum, bool usage);

int cmd_status(const Common& common);
// accept_loss (resume only): proto::kAcceptLoss, damaged allocations get zero-filled memory.
int cmd_control(const Common& common, const Selector& sel, proto::CommandOp op, bool accept_loss = false);
int cmd_gc(const Common& common);
int cmd_env(const Common& common, const LaunchOptions& launch);
int cmd_run(const Common& common, const LaunchOptions& launch, const std::vector<std::string>& command);

// Path of libtmsdisk.so for LD_PRELOAD: $TMSDISK_LIBRARY, else next to this tmsctl's install or
// build tree. Empty if not found.
std::string find_shim_library();
// The directory of the Python start-up module (sitecustomize.py) next to this tmsctl's install or
// build tree. Empty if not found.
std::string find_python_startup();
// The directory holding the torch_memory_saver compatibility package: tms-compat/ in the start-up
// module's directory. Empty if not found.
std::string find_tms_compat();

}  // namespace tmsdisk::ctl
