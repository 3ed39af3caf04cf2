// SPDX-License-Identifier: Apache-2.0
// `tmsctl doctor` (doctor.h): gathers facts about the node, judges each, prints one line per check.
//
// tmsctl depends on nothing but the C and C++ runtimes, so the CUDA driver is reached with dlopen (as
// the shim reaches it); cuda.h provides the types only. A root's filesystem and O_DIRECT, and
// io_uring, are probed by tmsdiskd's own functions (root_probe.h, uring_probe.h), linked statically.
#include "doctor.h"

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "client.h"
#include "root_probe.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/memory_filesystem.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/sizes.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/socket.h"
#include "uring_probe.h"

#ifndef TMSDISK_VERSION
#define TMSDISK_VERSION "unknown"
#endif

namespace tmsdisk::ctl {
namespace doctor {
namespace {

// The file tmsdiskd reads by default when installed beside this tmsctl (paths.h).
const std::string kConfigFile = default_config_file(layout::kBinDir);
// tmsdiskd's default staging-budget-mb, for when no daemon answers to tell its own.
constexpr uint64_t kDefaultStagingBudget = 256 * kMiB;
constexpr std::size_t kProbeBlock = 4096;  // a multiple of every logical block size O_DIRECT asks for
// The ring doctor sets up as the engine would: whether the kernel allows one does not depend on its size.
constexpr unsigned kProbeRingEntries = 4;
constexpr int kCapIpcLock = 14;  // linux/capability.h

// Filesystems other than the local block-device ones, by statfs magic (linux/magic.h lacks some).
constexpr unsigned long kOverlayMagic = 0x794c7630;
constexpr unsigned long kFuseMagic = 0x65735546;
constexpr unsigned long kCifsMagic = 0xff534d42;
constexpr unsigned long kSmb2Magic = 0xfe534d42;
constexpr unsigned long kCephMagic = 0x00c36400;
constexpr unsigned long kLustreMagic = 0x0bd00bd0;
constexpr unsigned long kGpfsMagic = 0x47504653;
constexpr unsigned long kZfsMagic = 0x2fc12fc1;
constexpr unsigned long kXfsMagic = 0x58465342;

bool is_network_or_fuse(unsigned long t) {
  return t == NFS_SUPER_MAGIC || t == kFuseMagic || t == kCifsMagic || t == kSmb2Magic || t == kCephMagic ||
         t == kLustreMagic || t == kGpfsMagic;
}

Check make(std::string name, std::string subject, Status status, std::string detail, std::string fix = {}) {
  return Check{std::move(name), std::move(subject), status, std::move(detail), std::move(fix)};
}

std::string plural(uint64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

const char* status_name(Status s) {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::Warn: return "warn";
    case Status::Fail: return "FAIL";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Decisions

namespace {

// The system daemon started by hand, where no systemd would start it (containers, WSL, some HPC
// images): as root, with the unit's memlock limit, under whatever keeps services running there.
std::string daemon_by_hand() {
  return "no systemd here to start it: as root, run `ulimit -l unlimited; exec tmsdiskd --config " +
         std::string(kConfigFile) + "` under this host's supervisor, or by hand (README: Install, without systemd)";
}

// Restarting the daemon the way it was started.
std::string daemon_restart(bool systemd_running) {
  return systemd_running ? "(`sudo systemctl restart tmsdiskd`)" : "(stop it and start it again as it was started)";
}

}  // namespace

std::string daemon_start_command(const DaemonFacts& f) {
  if (f.system_socket)
    return f.systemd_running
               ? "enable the system daemon: `sudo systemctl enable --now tmsdiskd.socket` (see the systemd check)"
               : daemon_by_hand();
  if (f.private_socket)
    return "this user's private daemon starts with the first rank launched by `tmsctl run -- CMD`; for one daemon for "
           "the node, " +
           (f.systemd_running ? std::string("`sudo systemctl enable --now tmsdiskd.socket`") : daemon_by_hand());
  return "start a daemon there: `tmsdiskd --socket " + f.socket +
         " --root DIR` (DIR on local NVMe), or point --socket (or TMSDISK_SOCKET) at the socket of the daemon that "
         "runs";
}

Check judge_daemon(const DaemonFacts& f) {
  const std::string subject = "daemon";
  if (f.reached) {
    const std::string version = f.version.empty() ? "(version not told)" : f.version;
    const std::string where = "tmsdiskd " + version + " at " + f.socket;
    if (!f.version.empty() && f.version != f.own_version)
      return make("daemon", subject, Status::Warn, where + ", but this tmsctl is " + f.own_version,
                  "install tmsctl, libtmsdisk.so and tmsdiskd from one build, then restart the daemon " +
                      daemon_restart(f.systemd_running));
    return make("daemon", subject, Status::Ok, where);
  }
  if (f.error == EPROTONOSUPPORT)
    return make("daemon", subject, Status::Fail, f.message,
                "tmsctl and tmsdiskd come from different builds: install both from one build and restart the daemon " +
                    daemon_restart(f.systemd_running));
  if (f.error == EACCES || f.error == EPERM)
    return make("daemon", subject, Status::Fail, f.message,
                "have your uid or group allowed (allow-uid / allow-gid in " + std::string(kConfigFile) +
                    "), or check the socket's permissions");
  const std::string why = (f.error == ENOENT || f.error == ECONNREFUSED) ? std::strerror(f.error) : f.message;
  return make("daemon", subject, Status::Fail, "no tmsdiskd answers at " + f.socket + " (" + why + ")",
              daemon_start_command(f));
}

Check judge_systemd_socket(const SystemdFacts& f) {
  const std::string name = "systemd.socket", subject = "systemd tmsdiskd.socket";
  const std::string enable = "`sudo systemctl enable --now tmsdiskd.socket`";
  if (!f.systemd_running) {
    if (f.socket_exists)
      return make(name, subject, Status::Ok,
                  "systemd is not the init system here, but something listens at " + std::string(kSystemSocket));
    return make(name, subject, Status::Warn,
                "systemd is not running here (no /run/systemd/system), so nothing starts tmsdiskd for the node",
                "start it under this system's supervisor: `tmsdiskd --config " + std::string(kConfigFile) +
                    "`; or let each user's ranks start a private daemon (`tmsctl run`)");
  }
  if (!f.installed)
    return make(name, subject, Status::Warn,
                "tmsdiskd.socket is not installed: without it each user's ranks start a private daemon",
                "install tmsdisk (`sudo cmake --install build --prefix /usr`, or the .deb), then " + enable);
  if (f.enabled == "masked")
    return make(name, subject, Status::Fail, "tmsdiskd.socket is masked: it cannot be started",
                "`sudo systemctl unmask tmsdiskd.socket`, then " + enable);
  if (f.active == "failed")
    return make(name, subject, Status::Fail, "tmsdiskd.socket failed",
                "see `journalctl -u tmsdiskd.socket -u tmsdiskd.service`, fix the cause, then "
                "`sudo systemctl restart tmsdiskd.socket`");
  const bool enabled = f.enabled == "enabled" || f.enabled == "enabled-runtime" || f.enabled == "alias";
  const bool active = f.active == "active";
  if (enabled && active)
    return make(name, subject, Status::Ok, "tmsdiskd.socket is enabled and listening on " + std::string(kSystemSocket));
  if (!enabled)
    return make(name, subject, Status::Warn,
                "tmsdiskd.socket is installed but not enabled (" + (f.enabled.empty() ? "unknown" : f.enabled) +
                    (active ? "; listening now, but not after a reboot)" : "; not listening)"),
                enable);
  return make(name, subject, Status::Warn,
              "tmsdiskd.socket is enabled but not listening (" + (f.active.empty() ? "unknown" : f.active) + ")",
              "`sudo systemctl start tmsdiskd.socket`");
}

uint64_t DriverFacts::device_memory() const {
  uint64_t sum = 0;
  for (const auto& d : devices) sum += d.total_bytes;
  return sum;
}

std::vector<Check> judge_driver(const DriverFacts& f) {
  const std::string subject = "CUDA driver";
  if (!f.load_error.empty())
    return {make("driver", subject, Status::Fail, "cannot load libcuda.so.1: " + f.load_error,
                 "install the NVIDIA driver; its libcuda.so.1 must be on the loader's path (`ldconfig -p | grep "
                 "libcuda`), or in LD_LIBRARY_PATH")};
  if (!f.missing.empty())
    return {make("driver", subject, Status::Fail, "libcuda.so.1 has no " + f.missing + ": the driver is too old",
                 "update the NVIDIA driver")};
  if (f.init_result != 0) {
    const std::string what = "cuInit failed: " + (f.init_error.empty() ? std::string("error") : f.init_error) + " (" +
                             std::to_string(f.init_result) + ")";
    std::string fix = "check `nvidia-smi` and the kernel log (`dmesg | grep -i nvidia`)";
    if (f.init_result == CUDA_ERROR_NO_DEVICE)
      fix = "no GPU is visible to this process: check `nvidia-smi`, and CUDA_VISIBLE_DEVICES if it is set";
    if (f.init_result == CUDA_ERROR_SYSTEM_DRIVER_MISMATCH ||
        f.init_result == CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)
      fix =
          "libcuda.so.1 does not match the loaded NVIDIA kernel module: reinstall the driver, or reboot after an "
          "upgrade";
    return {make("driver", subject, Status::Fail, what, fix)};
  }
  char version[32];
  std::snprintf(version, sizeof(version), "%d.%d", f.version / 1000, (f.version % 1000) / 10);
  if (f.devices.empty())
    return {make("driver", subject, Status::Fail, std::string("version ") + version + ", no device",
                 "check `nvidia-smi`, and CUDA_VISIBLE_DEVICES if it is set")};
  std::vector<Check> out{make("driver", subject, Status::Ok,
                              std::string("version ") + version + ", " + plural(f.devices.size(), "device", "devices") +
                                  ", " + human_bytes(f.device_memory()) + " of device memory")};
  for (const auto& d : f.devices) {
    const std::string dev = "device " + std::to_string(d.ordinal) + " (" + d.name + ")";
    const std::string size = human_bytes(d.total_bytes);
    if (!d.vmm) {
      out.push_back(make("device", dev, Status::Fail,
                         size + ", no virtual memory management (VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED): the shim leaves "
                                "its allocations native, so nothing on it can be paused",
                         "use a driver and GPU that offer cuMemCreate/cuMemMap on this device (update the NVIDIA "
                         "driver; some virtualized GPUs lack them)"));
    } else if (!d.posix_fd) {
      out.push_back(make("device", dev, Status::Warn,
                         size + ", virtual memory management supported, POSIX file descriptor handles not: legacy "
                                "CUDA IPC (cuIpcGetMemHandle) of memory tmsdisk manages on it fails",
                         "update the NVIDIA driver if the jobs share memory between processes with CUDA IPC"));
    } else {
      out.push_back(make("device", dev, Status::Ok,
                         size + ", virtual memory management and POSIX file descriptor handles supported"));
    }
  }
  return out;
}

const char* filesystem_name(unsigned long t) {
  switch (t) {
    case EXT4_SUPER_MAGIC: return "ext4";  // also ext2 and ext3, which share the magic
    case kXfsMagic: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case F2FS_SUPER_MAGIC: return "f2fs";
    case kZfsMagic: return "zfs";
    case TMPFS_MAGIC: return "tmpfs";
    case RAMFS_MAGIC: return "ramfs";
    case kOverlayMagic: return "overlay";
    case NFS_SUPER_MAGIC: return "nfs";
    case kFuseMagic: return "fuse";
    case kCifsMagic:
    case kSmb2Magic: return "cifs";
    case kCephMagic: return "ceph";
    case kLustreMagic: return "lustre";
    case kGpfsMagic: return "gpfs";
    default: return nullptr;
  }
}

Check judge_root_filesystem(const RootFacts& f) {
  const std::string name = "root.filesystem", subject = "root " + f.path + ": filesystem";
  const std::string elsewhere = "use a directory on a local NVMe filesystem (ext4 or xfs), e.g. /nvme0/tmsdisk";
  if (f.symlink)
    return make(name, subject, Status::Fail,
                "a symbolic link: tmsdiskd refuses it, so that the root cannot be swapped under it",
                "configure the directory it points to (`realpath " + f.path + "`)");
  if (f.open_error == ENOENT)
    return make(
        name, subject, Status::Fail, "does not exist",
        "create it on local NVMe (`sudo mkdir -p " + f.path + "`), or fix --root / root = [...] in " + kConfigFile);
  if (f.open_error == ENOTDIR) return make(name, subject, Status::Fail, "not a directory", elsewhere);
  if (f.open_error == EACCES)
    return make(name, subject, Status::Warn, "cannot open it as this user (" + std::string(std::strerror(EACCES)) + ")",
                "run `sudo tmsctl doctor` to check it as tmsdiskd (root) sees it");
  if (f.open_error != 0)
    return make(name, subject, Status::Fail, std::string("cannot open it: ") + std::strerror(f.open_error), elsewhere);
  const char* fs = filesystem_name(f.fs_type);
  if (in_memory_filesystem(f.fs_type))
    return make(name, subject, Status::Fail,
                std::string("on ") + fs +
                    ": paused GPU memory would stay in RAM, which pausing to disk is meant to free (tmsdiskd refuses "
                    "it unless --allow-tmpfs)",
                elsewhere);
  if (f.fs_type == kOverlayMagic)
    return make(name, subject, Status::Fail,
                "on overlay (a container's writable layer): it gives no O_DIRECT guarantee, and its upper layer may "
                "itself be in RAM",
                "bind-mount a directory of a local NVMe filesystem into the container and use that");
  if (is_network_or_fuse(f.fs_type))
    return make(name, subject, Status::Warn,
                std::string("on ") + fs + ": pauses would go over the network or through FUSE, not to local NVMe",
                elsewhere);
  char unknown[32];
  std::snprintf(unknown, sizeof(unknown), "filesystem type 0x%lx", f.fs_type);
  return make(name, subject, Status::Ok, fs ? fs : unknown);
}

Check judge_root_direct_io(const RootFacts& f) {
  const std::string name = "root.direct_io", subject = "root " + f.path + ": O_DIRECT";
  if (f.direct_error == 0 && f.direct_step.empty())
    return make(name, subject, Status::Ok, "a 4 KiB block written and read back with O_DIRECT");
  if (f.direct_unsupported)
    return make(name, subject, Status::Warn,
                "this filesystem refuses O_DIRECT: tmsdiskd falls back to buffered I/O, which is slower and fills the "
                "page cache with paused memory",
                "use a directory on a local ext4 or xfs filesystem");
  if (f.direct_step == "compare")
    return make(name, subject, Status::Fail, "the block read back with O_DIRECT differs from the one written",
                "check the device and filesystem (`dmesg`, `nvme smart-log`); use another root meanwhile");
  const std::string what = "cannot " + f.direct_step + " a test file: " + std::strerror(f.direct_error);
  if (f.direct_error == EACCES || f.direct_error == EPERM)
    return make(name, subject, Status::Warn, what + " as this user",
                "run `sudo tmsctl doctor` to test it as tmsdiskd (root) writes");
  if (f.direct_error == EROFS)
    return make(name, subject, Status::Fail, what, "remount the filesystem read-write, or use another root");
  if (f.direct_error == ENOSPC || f.direct_error == EDQUOT)
    return make(name, subject, Status::Fail, what, "free space on the filesystem, or use another root");
  return make(name, subject, Status::Fail, what, "check the device and filesystem (`dmesg`), or use another root");
}

Check judge_root_space(const RootFacts& f, std::optional<uint64_t> device_memory, std::size_t roots) {
  const std::string name = "root.space", subject = "root " + f.path + ": free space";
  const std::string free = human_bytes(f.free_bytes) + " free";
  if (!device_memory)
    return make(name, subject, Status::Ok, free + " (no CUDA driver answered: the device memory to hold is unknown)");
  roots = roots ? roots : 1;
  // Chunks stripe over the roots, so each holds its share of a whole node's pause.
  const uint64_t share = (*device_memory + roots - 1) / roots;
  const std::string need = roots == 1 ? "the node's " + human_bytes(share) + " of device memory"
                                      : human_bytes(share) + ", its share (1/" + std::to_string(roots) +
                                            ") of the node's " + human_bytes(*device_memory) + " of device memory";
  if (f.free_bytes >= share) return make(name, subject, Status::Ok, free + ", enough for " + need);
  return make(name, subject, Status::Warn,
              free + ", less than " + need +
                  ": a pause that does not fit is refused (ENOSPC) and its ranks keep running on the GPU",
              "free space on this filesystem, or add roots on other NVMe drives (root = [...] in " +
                  std::string(kConfigFile) + ")");
}

Check judge_io_uring(const IoUringFacts& f) {
  const std::string name = "io_uring", subject = "io_uring";
  const std::string fallback = "; tmsdiskd then uses pread/pwrite: pauses work, more slowly";
  const std::string sysctl_fix =
      "`sudo sysctl -w kernel.io_uring_disabled=0`, and keep it in /etc/sysctl.d/ (or, with the value 1, put "
      "tmsdiskd in the group kernel.io_uring_group names)";
  const std::string seccomp_fix =
      "allow io_uring_setup, io_uring_enter and io_uring_register in the seccomp profile (a container's: docker or "
      "podman --security-opt seccomp=PROFILE), or run tmsdiskd outside it";
  const std::string kernel = f.kernel.empty() ? "this kernel" : "Linux " + f.kernel;
  if (f.setup_error == 0) {
    // A ring made here says little for the daemon under io_uring_disabled=1: this process may hold
    // CAP_SYS_ADMIN, which the service does not (it keeps only CAP_IPC_LOCK).
    if (f.disabled == 1)
      return make(name, subject, Status::Warn,
                  "a ring was created here, but kernel.io_uring_disabled=1 refuses io_uring to processes without "
                  "CAP_SYS_ADMIN outside kernel.io_uring_group, such as the tmsdiskd service and private daemons" +
                      fallback,
                  sysctl_fix);
    return make(name, subject, Status::Ok, "a ring was created (" + kernel + ")");
  }
  const std::string failed = std::string("io_uring_setup: ") + std::strerror(f.setup_error);
  if (f.setup_error == EPERM || f.setup_error == EACCES) {
    if (f.disabled == 2)
      return make(name, subject, Status::Warn,
                  failed + ": kernel.io_uring_disabled=2 turns io_uring off for every process" + fallback, sysctl_fix);
    if (f.disabled == 1)
      return make(name, subject, Status::Warn,
                  failed +
                      ": kernel.io_uring_disabled=1 allows it only with CAP_SYS_ADMIN or in kernel.io_uring_group" +
                      fallback,
                  sysctl_fix);
    if (f.seccomp == 2)
      return make(name, subject, Status::Warn,
                  failed + ": a seccomp filter on this process refuses it (Seccomp: 2 in /proc/self/status)" + fallback,
                  seccomp_fix);
    return make(name, subject, Status::Warn, failed + ": refused by a security policy (SELinux, AppArmor)" + fallback,
                "allow io_uring for tmsdiskd in the policy that refuses it (see the audit log)");
  }
  if (f.setup_error == ENOSYS) {
    if (f.seccomp == 2)
      return make(name, subject, Status::Warn,
                  failed + ": a seccomp filter on this process hides it (Seccomp: 2 in /proc/self/status)" + fallback,
                  seccomp_fix);
    return make(
        name, subject, Status::Warn,
        failed + ": " + kernel + " has no io_uring (it needs Linux 5.1 or later built with CONFIG_IO_URING)" + fallback,
        "upgrade the kernel (5.10 or later) or enable CONFIG_IO_URING");
  }
  if (f.setup_error == ENOMEM)
    return make(name, subject, Status::Warn,
                failed + ": kernels before 5.12 charge rings to RLIMIT_MEMLOCK, which is too low" + fallback,
                "raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity for the service, `ulimit -l unlimited` in a shell)");
  return make(name, subject, Status::Warn, failed + fallback, "see the kernel log (`dmesg`)");
}

Check judge_memlock(const MemlockFacts& f) {
  const std::string name = "memlock", subject = "memlock of " + f.process;
  if (f.cap_ipc_lock)
    return make(name, subject, Status::Ok,
                "holds CAP_IPC_LOCK: the staging tmsdiskd pins is not limited by RLIMIT_MEMLOCK");
  if (!f.limit) return make(name, subject, Status::Ok, "RLIMIT_MEMLOCK is unlimited");
  const unsigned ranks = f.ranks ? f.ranks : 1;
  const uint64_t need = f.staging_per_rank * ranks;
  const std::string budget = plural(ranks, "rank", "ranks") + " x " + human_bytes(f.staging_per_rank) + " of staging" +
                             (ranks > 1 ? " = " + human_bytes(need) : "");
  const std::string limit = "RLIMIT_MEMLOCK is " + human_bytes(*f.limit);
  if (*f.limit >= need) return make(name, subject, Status::Ok, limit + ", enough for " + budget);
  const std::string detail = limit + ", less than the " + budget +
                             " tmsdiskd pins for io_uring: past the limit a rank's staging is not registered and "
                             "its pauses use slower unregistered I/O";
  if (f.is_daemon && !f.systemd_running)
    return make(name, subject, Status::Warn, detail,
                "start tmsdiskd again from a root shell after `ulimit -l unlimited` (or raise its supervisor's "
                "memlock limit)");
  if (f.is_daemon)
    return make(name, subject, Status::Warn, detail,
                "give tmsdiskd LimitMEMLOCK=infinity (`sudo systemctl edit tmsdiskd.service`; the installed unit has "
                "it), or start it from a shell after `ulimit -l unlimited`");
  return make(
      name, subject, Status::Warn, detail,
      "a private tmsdiskd started from here inherits this limit: `ulimit -l unlimited` first (memlock in "
      "/etc/security/limits.conf)" +
          std::string(f.systemd_running ? ", or use the system service, whose unit sets LimitMEMLOCK=infinity" : ""));
}

// ---------------------------------------------------------------------------------------------
// Facts

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The value of "Key:" in a /proc/<pid>/status file.
std::optional<std::string> status_field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) != 0) continue;
    std::size_t at = key.size();
    while (at < line.size() && (line[at] == ' ' || line[at] == '\t')) ++at;
    return line.substr(at);
  }
  return std::nullopt;
}

std::string proc_dir(pid_t pid) {
  return pid ? "/proc/" + std::to_string(pid) : std::string("/proc/self");
}

bool has_cap_ipc_lock(pid_t pid) {
  const auto caps = status_field(proc_dir(pid) + "/status", "CapEff:");
  return caps && ((std::strtoull(caps->c_str(), nullptr, 16) >> kCapIpcLock) & 1);
}

// The soft RLIMIT_MEMLOCK and CAP_IPC_LOCK of process `pid` (0: this one). Another process's come
// from /proc, which any user may read, so that the daemon's own limit is told, not this shell's.
// False when they cannot be read.
bool read_memlock(pid_t pid, MemlockFacts& f) {
  if (pid == 0) {
    rlimit lim{};
    if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return false;
    f.limit = lim.rlim_cur == RLIM_INFINITY ? std::nullopt : std::optional<uint64_t>(lim.rlim_cur);
    f.cap_ipc_lock = has_cap_ipc_lock(0);
    return true;
  }
  std::ifstream in(proc_dir(pid) + "/limits");
  bool found = false;
  for (std::string line; std::getline(in, line);) {
    const std::string key = "Max locked memory";
    if (line.rfind(key, 0) != 0) continue;
    std::istringstream fields(line.substr(key.size()));
    std::string soft;
    fields >> soft;
    if (soft == "unlimited") {
      f.limit.reset();
    } else {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(soft.c_str(), &end, 10);
      if (end == soft.c_str()) return false;
      f.limit = v;
    }
    found = true;
  }
  if (!found) return false;
  f.cap_ipc_lock = has_cap_ipc_lock(pid);
  return true;
}

// Runs a command with stdin and stderr on /dev/null; its stdout's first line, or nullopt when it
// cannot run (not installed) or does not finish in time (a hung D-Bus must not hang the doctor).
std::optional<std::string> first_line_of(const std::vector<std::string>& argv) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return std::nullopt;
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    return std::nullopt;
  }
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0);
    ::dup2(out[1], 1);
    ::dup2(null, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(out[1]);
  UniqueFd from(out[0]);
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool in_time = true;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{from.get(), POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) == 0) {
      ::kill(pid, SIGKILL);
      in_time = false;
      break;
    }
    char buf[512];
    const ssize_t n = ::read(from.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!in_time || (WIFEXITED(status) && WEXITSTATUS(status) == 127)) return std::nullopt;
  return text.substr(0, text.find('\n'));
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// tmsdiskd's process. SO_PEERCRED names whoever called listen(): the daemon itself, except under
// socket activation, where it is systemd and the daemon is the service's main process.
std::optional<pid_t> daemon_pid(const std::string& socket, bool systemd_running) {
  auto is_tmsdiskd = [](pid_t pid) { return pid > 0 && read_first_line(proc_dir(pid) + "/comm") == "tmsdiskd"; };
  const int fd = proto::connect_seqpacket(socket);
  if (fd >= 0) {
    UniqueFd conn(fd);
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 && is_tmsdiskd(peer.pid)) return peer.pid;
  }
  if (!systemd_running) return std::nullopt;
  const auto main_pid = first_line_of({"systemctl", "show", "--property=MainPID", "--value", "tmsdiskd.service"});
  if (!main_pid) return std::nullopt;
  const pid_t pid = static_cast<pid_t>(std::strtol(main_pid->c_str(), nullptr, 10));
  return is_tmsdiskd(pid) ? std::optional<pid_t>(pid) : std::nullopt;
}

SystemdFacts probe_systemd() {
  SystemdFacts f;
  struct stat st {};
  f.systemd_running = ::stat("/run/systemd/system", &st) == 0 && S_ISDIR(st.st_mode);
  f.socket_exists = ::stat(kSystemSocket, &st) == 0 && S_ISSOCK(st.st_mode);
  for (const char* dir : {"/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
                          "/usr/lib/systemd/system", "/lib/systemd/system"})
    f.installed |= exists(std::string(dir) + "/tmsdiskd.socket");
  if (f.systemd_running) {
    // systemctl knows units in every directory of its search path, and masks.
    if (auto enabled = first_line_of({"systemctl", "is-enabled", "tmsdiskd.socket"})) {
      f.enabled = *enabled;
      if (!f.enabled.empty()) f.installed = f.enabled != "not-found";
    }
    if (auto active = first_line_of({"systemctl", "is-active", "tmsdiskd.socket"})) f.active = *active;
  } else if (f.installed) {
    // Without systemd running, `enable` is the symlink it would have made.
    f.enabled = exists("/etc/systemd/system/sockets.target.wants/tmsdiskd.socket") ? "enabled" : "disabled";
  }
  return f;
}

DriverFacts probe_driver() {
  DriverFacts f;
  // Never closed: a driver's threads may outlive an unload.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    f.load_error = why ? why : "not found";
    // dlerror() starts with the file name, which the verdict names already.
    const std::string prefix = "libcuda.so.1: ";
    if (f.load_error.rfind(prefix, 0) == 0) f.load_error.erase(0, prefix.size());
    return f;
  }
  auto entry = [&](const char* symbol) {
    void* p = ::dlsym(lib, symbol);
    if (!p && f.missing.empty()) f.missing = symbol;
    return p;
  };
  const auto init = reinterpret_cast<decltype(&cuInit)>(entry("cuInit"));
  const auto driver_version = reinterpret_cast<decltype(&cuDriverGetVersion)>(entry("cuDriverGetVersion"));
  const auto device_count = reinterpret_cast<decltype(&cuDeviceGetCount)>(entry("cuDeviceGetCount"));
  const auto device_get = reinterpret_cast<decltype(&cuDeviceGet)>(entry("cuDeviceGet"));
  const auto device_name = reinterpret_cast<decltype(&cuDeviceGetName)>(entry("cuDeviceGetName"));
  const auto total_mem = reinterpret_cast<decltype(&cuDeviceTotalMem_v2)>(entry("cuDeviceTotalMem_v2"));
  const auto attribute = reinterpret_cast<decltype(&cuDeviceGetAttribute)>(entry("cuDeviceGetAttribute"));
  const auto granularity =
      reinterpret_cast<decltype(&cuMemGetAllocationGranularity)>(entry("cuMemGetAllocationGranularity"));
  const auto error_name = reinterpret_cast<decltype(&cuGetErrorName)>(::dlsym(lib, "cuGetErrorName"));
  if (!f.missing.empty()) return f;

  const CUresult r = init(0);
  f.init_result = static_cast<int>(r);
  if (r != CUDA_SUCCESS) {
    const char* text = nullptr;
    if (error_name && error_name(r, &text) == CUDA_SUCCESS && text) f.init_error = text;
    return f;
  }
  driver_version(&f.version);
  int count = 0;
  if (device_count(&count) != CUDA_SUCCESS) count = 0;
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    if (device_get(&dev, i) != CUDA_SUCCESS) continue;
    DeviceFacts d;
    d.ordinal = i;
    char text[256] = {};
    d.name = device_name(text, sizeof(text) - 1, dev) == CUDA_SUCCESS ? text : "unnamed";
    std::size_t bytes = 0;
    if (total_mem(&bytes, dev) == CUDA_SUCCESS) d.total_bytes = bytes;
    auto attr = [&](CUdevice_attribute a) {
      int v = 0;
      return attribute(&v, a, dev) == CUDA_SUCCESS && v != 0;
    };
    d.posix_fd = attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
    d.vmm = attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
    if (d.vmm) {
      // As the shim decides (interposer/core/alloc.cpp): VMM counts only with a granularity for the
      // allocations it would make.
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = dev;
      prop.requestedHandleTypes = d.posix_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
      std::size_t g = 0;
      d.vmm = granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS && g != 0;
    }
    f.devices.push_back(std::move(d));
  }
  return f;
}

// The root's filesystem, free space and O_DIRECT. O_DIRECT is probed as tmsdiskd probes it when it
// opens the root (an unnamed file, else one named and removed at once, as a rank's data file is
// opened), then one aligned block is written to that file and read back.
RootFacts probe_root(const std::string& path) {
  RootFacts f;
  f.path = path;
  struct stat lst {};
  f.symlink = ::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode);
  UniqueFd dir(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) {
    f.open_error = errno;
    return f;
  }
  if (const auto type = storage::filesystem_type(dir.get(), path)) f.fs_type = *type;
  struct statvfs vfs {};
  if (::fstatvfs(dir.get(), &vfs) == 0) f.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;

  const std::string name = ".tmsdisk-doctor-" + std::to_string(::getpid());
  storage::DirectIoProbe probe = storage::probe_direct_io(dir.get(), name.c_str());
  if (probe.outcome != storage::DirectIoProbe::Outcome::Direct) {
    f.direct_error = probe.error;
    f.direct_step = "open";
    f.direct_unsupported = probe.outcome == storage::DirectIoProbe::Outcome::Buffered;
    return f;
  }
  const UniqueFd file = std::move(probe.file);
  std::unique_ptr<unsigned char, decltype(&std::free)> written(
      static_cast<unsigned char*>(std::aligned_alloc(kProbeBlock, kProbeBlock)), &std::free);
  std::unique_ptr<unsigned char, decltype(&std::free)> read(
      static_cast<unsigned char*>(std::aligned_alloc(kProbeBlock, kProbeBlock)), &std::free);
  if (!written || !read) {
    f.direct_error = ENOMEM;
    f.direct_step = "allocate a buffer for";
    return f;
  }
  for (std::size_t i = 0; i < kProbeBlock; ++i) written.get()[i] = static_cast<unsigned char>(i * 131 + 7);
  std::memset(read.get(), 0, kProbeBlock);
  const ssize_t w = ::pwrite(file.get(), written.get(), kProbeBlock, 0);
  if (w != static_cast<ssize_t>(kProbeBlock)) {
    f.direct_error = w < 0 ? errno : EIO;
    f.direct_step = "write";
    return f;
  }
  const ssize_t r = ::pread(file.get(), read.get(), kProbeBlock, 0);
  if (r != static_cast<ssize_t>(kProbeBlock)) {
    f.direct_error = r < 0 ? errno : EIO;
    f.direct_step = "read";
    return f;
  }
  if (std::memcmp(written.get(), read.get(), kProbeBlock) != 0) f.direct_step = "compare";
  return f;
}

IoUringFacts probe_io_uring() {
  IoUringFacts f;
  f.setup_error = io::ring_setup_error(kProbeRingEntries);
  f.disabled = io::io_uring_disabled();
  if (auto s = status_field("/proc/self/status", "Seccomp:")) f.seccomp = std::atoi(s->c_str());
  utsname u{};
  if (::uname(&u) == 0) f.kernel = u.release;
  return f;
}

std::string socket_of(const Common& c) {
  return c.socket.empty() ? default_socket_path() : c.socket;
}

}  // namespace
}  // namespace doctor

int cmd_doctor(const Common& common, const DoctorOptions& options) {
  using namespace doctor;
  std::vector<Check> checks;

  DaemonFacts daemon;
  daemon.socket = socket_of(common);
  daemon.own_version = TMSDISK_VERSION;
  daemon.system_socket = daemon.socket == kSystemSocket;
  daemon.private_socket = daemon.socket == private_socket_path();
  std::string first_root;
  uint64_t staging_per_rank = kDefaultStagingBudget;
  if (auto client = Client::connect(daemon.socket)) {
    daemon.reached = true;
    daemon.version = client->welcome().version;
    first_root = client->first_root();
    if (client->welcome().staging_budget_bytes) staging_per_rank = client->welcome().staging_budget_bytes;
  } else {
    daemon.error = client.error().errnum();
    daemon.message = client.error().message;
  }
  const SystemdFacts systemd = probe_systemd();
  daemon.systemd_running = systemd.systemd_running;
  checks.push_back(judge_daemon(daemon));
  checks.push_back(judge_systemd_socket(systemd));

  const DriverFacts driver = probe_driver();
  for (auto& c : judge_driver(driver)) checks.push_back(std::move(c));
  const std::optional<uint64_t> device_memory =
      driver.usable() && !driver.devices.empty() ? std::optional<uint64_t>(driver.device_memory()) : std::nullopt;

  // Which roots: those asked for, else the one the daemon tells (its first; the others are only in
  // its configuration, which is the daemon's to parse).
  std::vector<std::string> roots = options.roots;
  std::string roots_source = "--root";
  if (roots.empty() && !first_root.empty()) {
    roots.push_back(first_root);
    roots_source = "daemon";
  }
  if (roots.empty()) {
    roots_source = "none";
    checks.push_back(
        make("roots", "storage roots", Status::Warn,
             "none checked: no daemon answered to name its root, and no --root was given",
             "pass --root DIR for each storage root (the root = [...] list in " + std::string(kConfigFile) + ")"));
  }
  for (const auto& path : roots) {
    const RootFacts root = probe_root(path);
    checks.push_back(judge_root_filesystem(root));
    if (root.open_error != 0) continue;
    checks.push_back(judge_root_direct_io(root));
    checks.push_back(judge_root_space(root, device_memory, roots.size()));
  }

  checks.push_back(judge_io_uring(probe_io_uring()));

  MemlockFacts memlock;
  memlock.staging_per_rank = staging_per_rank;
  memlock.systemd_running = systemd.systemd_running;
  memlock.ranks = driver.usable() && !driver.devices.empty() ? static_cast<unsigned>(driver.devices.size()) : 1;
  const std::optional<pid_t> pid =
      daemon.reached ? daemon_pid(daemon.socket, systemd.systemd_running) : std::optional<pid_t>();
  if (pid && read_memlock(*pid, memlock)) {
    memlock.process = "tmsdiskd (pid " + std::to_string(*pid) + ")";
    memlock.is_daemon = true;
  } else {
    memlock.process = daemon.reached ? "this shell (tmsdiskd's process could not be read)" : "this shell";
    read_memlock(0, memlock);
  }
  checks.push_back(judge_memlock(memlock));

  std::size_t counts[3] = {0, 0, 0};
  for (const auto& c : checks) ++counts[static_cast<int>(c.status)];
  const bool failed = counts[static_cast<int>(Status::Fail)] > 0;

  std::string roots_text;
  for (const auto& r : roots) roots_text += (roots_text.empty() ? "" : ", ") + r;
  const std::string others =
      "check the others with --root DIR, once per root in the root = [...] list of " + std::string(kConfigFile);
  if (common.json) {
    // In the order a person reads them: name, subject, status, then detail and fix.
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& c : checks)
      list.push_back({{"name", c.name},
                      {"subject", c.subject},
                      {"status", status_name(c.status)},
                      {"detail", c.detail},
                      {"fix", c.fix}});
    const nlohmann::ordered_json out = {{"ok", !failed},
                                        {"checks", list},
                                        {"roots", {{"checked", roots}, {"source", roots_source}}},
                                        {"summary",
                                         {{"ok", counts[static_cast<int>(Status::Ok)]},
                                          {"warn", counts[static_cast<int>(Status::Warn)]},
                                          {"fail", counts[static_cast<int>(Status::Fail)]}}}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    for (const auto& c : checks)
      std::printf("%-4s  %s: %s%s\n", status_name(c.status), c.subject.c_str(), c.detail.c_str(),
                  c.fix.empty() ? "" : (". Fix: " + c.fix).c_str());
    if (roots_source == "daemon")
      std::printf("roots checked: %s (the daemon's first root); %s\n", roots_text.c_str(), others.c_str());
    else if (roots_source == "--root")
      std::printf("roots checked: %s (given with --root)\n", roots_text.c_str());
    std::printf("doctor: %zu ok, %zu warn, %zu FAIL\n", counts[static_cast<int>(Status::Ok)],
                counts[static_cast<int>(Status::Warn)], counts[static_cast<int>(Status::Fail)]);
  }
  return failed ? kExitFailed : 0;
}

}  // namespace tmsdisk::ctl
