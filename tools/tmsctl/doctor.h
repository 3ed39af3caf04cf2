// SPDX-License-Identifier: Apache-2.0
// `tmsctl doctor`: checks a node as an operator would before enabling the service, and says what to
// do about each problem. Each decision is a pure function of facts gathered beforehand (the judge_*
// functions below), so that situations a test machine cannot be put in (io_uring disabled by
// sysctl, a seccomp filter, a masked unit) are still tested (tests/unit/test_doctor.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"

namespace tmsdisk::ctl {

struct DoctorOptions {
  std::vector<std::string> roots;  // --root: the storage roots to check (empty: the daemon's first root)
};

int cmd_doctor(const Common& common, const DoctorOptions& options);

namespace doctor {

enum class Status { Ok, Warn, Fail };
const char* status_name(Status s);  // "ok", "warn", "FAIL": FAIL stands out in a column of ok

// One verdict. `name` is stable for scripts ("root.filesystem"); `subject` says what was looked at
// ("root /nvme0/tmsdisk: filesystem"); `fix` is what to do, empty when there is nothing to do.
struct Check {
  std::string name;
  std::string subject;
  Status status = Status::Ok;
  std::string detail;
  std::string fix;
};

// The daemon at the socket tmsctl uses.
struct DaemonFacts {
  std::string socket;
  bool reached = false;
  int error = 0;                 // errno when not reached
  std::string message;           // the client's whole error message when not reached
  std::string version;           // the daemon's package version (its WELCOME), when reached
  std::string own_version;       // this tmsctl's
  bool system_socket = false;    // `socket` is the system service's
  bool private_socket = false;   // `socket` is this user's private daemon's
  bool systemd_running = false;  // systemd is the init system (SystemdFacts): its commands are fixes
};
Check judge_daemon(const DaemonFacts& f);
// The command that makes a daemon answer at `f.socket`.
std::string daemon_start_command(const DaemonFacts& f);

// tmsdiskd.socket, as systemd sees it.
struct SystemdFacts {
  bool systemd_running = false;  // /run/systemd/system exists: systemd is the init system here
  bool installed = false;        // a tmsdiskd.socket unit file exists
  std::string enabled;           // `systemctl is-enabled`: enabled, disabled, masked, ... (empty: unknown)
  std::string active;            // `systemctl is-active`: active, inactive, failed, ... (empty: unknown)
  bool socket_exists = false;    // /run/tmsdisk/tmsdiskd.sock is a socket
};
Check judge_systemd_socket(const SystemdFacts& f);

// The CUDA driver, loaded as the shim loads it (dlopen("libcuda.so.1")).
struct DeviceFacts {
  int ordinal = 0;
  std::string name;
  uint64_t total_bytes = 0;  // cuDeviceTotalMem
  bool vmm = false;          // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, and a granularity for it
  bool posix_fd = false;     // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (legacy IPC of managed memory)
};
struct DriverFacts {
  std::string load_error;  // why libcuda.so.1 could not be loaded (dlerror); empty: it was
  std::string missing;     // an entry point libcuda.so.1 lacks; empty: none
  int init_result = 0;     // cuInit's CUresult
  std::string init_error;  // its name (CUDA_ERROR_NO_DEVICE)
  int version = 0;         // cuDriverGetVersion: 13000 for CUDA 13.0
  std::vector<DeviceFacts> devices;
  bool usable() const { return load_error.empty() && missing.empty() && init_result == 0; }
  uint64_t device_memory() const;  // the sum over devices: what the roots may have to hold
};
// The driver's verdict, then one per device.
std::vector<Check> judge_driver(const DriverFacts& f);

// One storage root.
struct RootFacts {
  std::string path;
  int open_error = 0;               // errno opening it as a directory; 0: opened
  bool symlink = false;             // the path itself is a symbolic link (tmsdiskd refuses those)
  unsigned long fs_type = 0;        // statfs f_type
  int direct_error = 0;             // errno of the O_DIRECT probe; 0: a block was written and read back
  std::string direct_step;          // the probe's step that failed: "open", "write", "read" or "compare"
  bool direct_unsupported = false;  // O_DIRECT refused (EINVAL) where a plain open works
  uint64_t free_bytes = 0;          // available to unprivileged writers (f_bavail)
};
Check judge_root_filesystem(const RootFacts& f);
Check judge_root_direct_io(const RootFacts& f);
// `device_memory`: what the node's GPUs hold (unknown without a driver); chunks stripe over `roots`.
Check judge_root_space(const RootFacts& f, std::optional<uint64_t> device_memory, std::size_t roots);
const char* filesystem_name(unsigned long fs_type);  // "ext4", "tmpfs", ...; nullptr if unknown

// io_uring, as this process finds it.
struct IoUringFacts {
  int setup_error = 0;          // errno of a 4-entry ring set up as tmsdiskd's engine sets one up; 0: it was
  std::optional<int> disabled;  // kernel.io_uring_disabled (the sysctl exists from Linux 6.6)
  std::optional<int> seccomp;   // "Seccomp:" of /proc/self/status: 0 none, 1 strict, 2 filter
  std::string kernel;           // uname -r
};
Check judge_io_uring(const IoUringFacts& f);

// RLIMIT_MEMLOCK of the process that pins the staging buffers. That is tmsdiskd: it registers each
// rank's staging buffer with io_uring as fixed buffers, which the kernel charges to the daemon
// user's locked memory unless the daemon has CAP_IPC_LOCK. (The rank pins the same pages for DMA with
// cuMemHostRegister, through the driver, which RLIMIT_MEMLOCK does not govern.)
struct MemlockFacts {
  std::string process;            // "tmsdiskd (pid 1234)", or "this shell" when no daemon was found
  bool is_daemon = false;         // the limit is the running daemon's own
  std::optional<uint64_t> limit;  // the soft limit in bytes; nullopt: unlimited
  bool cap_ipc_lock = false;
  uint64_t staging_per_rank = 0;  // the daemon's default staging budget
  unsigned ranks = 1;             // one per GPU
  bool systemd_running = false;   // systemd is the init system (SystemdFacts): its unit is a fix
};
Check judge_memlock(const MemlockFacts& f);

}  // namespace doctor
}  // namespace tmsdisk::ctl
