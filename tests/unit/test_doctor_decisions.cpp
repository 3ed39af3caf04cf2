// SPDX-License-Identifier: Apache-2.0
// `tmsctl doctor`'s decisions (tools/tmsctl/doctor.h) from facts a test machine cannot be put in:
// io_uring turned off by sysctl or hidden by seccomp, an old kernel, a masked or failed unit, a
// daemon from another build. The end-to-end suite (tests/e2e/test_doctor.cpp) runs the real checks.
#include <linux/magic.h>

#include <catch2/catch.hpp>
#include <cerrno>

#include "doctor.h"
#include "tmsdisk/common/sizes.h"

using namespace tmsdisk::ctl::doctor;

namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A problem names its cause and says what to do.
void check_problem(const Check& c, Status status, const std::string& cause, const std::string& fix) {
  INFO(c.subject << ": " << c.detail << " / fix: " << c.fix);
  CHECK(c.status == status);
  CHECK(has(c.detail, cause));
  CHECK(has(c.fix, fix));
}

}  // namespace

TEST_CASE("io_uring: a ring that was created is ok, unless io_uring_disabled=1 keeps it from the daemon") {
  IoUringFacts f{.kernel = "6.8.0"};
  Check ok = judge_io_uring(f);
  CHECK(ok.status == Status::Ok);
  CHECK(has(ok.detail, "6.8.0"));
  CHECK(ok.fix.empty());
  f.disabled = 0;
  CHECK(judge_io_uring(f).status == Status::Ok);
  // Root with CAP_SYS_ADMIN may make a ring that the service, holding only CAP_IPC_LOCK, may not.
  f.disabled = 1;
  check_problem(judge_io_uring(f), Status::Warn, "kernel.io_uring_disabled=1", "sysctl -w kernel.io_uring_disabled=0");
}

TEST_CASE("io_uring: each reason for a refusal is named with its fix, and the fallback is said") {
  SECTION("disabled for everyone") {
    check_problem(judge_io_uring({.setup_error = EPERM, .disabled = 2, .seccomp = 0}), Status::Warn,
                  "kernel.io_uring_disabled=2", "sysctl -w kernel.io_uring_disabled=0");
  }
  SECTION("disabled for the unprivileged") {
    check_problem(judge_io_uring({.setup_error = EPERM, .disabled = 1, .seccomp = 0}), Status::Warn, "io_uring_group",
                  "kernel.io_uring_group");
  }
  SECTION("a seccomp filter refusing it") {
    check_problem(judge_io_uring({.setup_error = EPERM, .disabled = 0, .seccomp = 2}), Status::Warn, "seccomp",
                  "seccomp profile");
  }
  SECTION("a seccomp filter hiding it") {
    check_problem(judge_io_uring({.setup_error = ENOSYS, .seccomp = 2}), Status::Warn, "seccomp", "seccomp profile");
  }
  SECTION("a kernel without io_uring") {
    check_problem(judge_io_uring({.setup_error = ENOSYS, .seccomp = 0, .kernel = "4.19.0"}), Status::Warn,
                  "Linux 4.19.0 has no io_uring", "upgrade the kernel");
  }
  SECTION("an old kernel charging the ring to RLIMIT_MEMLOCK") {
    check_problem(judge_io_uring({.setup_error = ENOMEM}), Status::Warn, "RLIMIT_MEMLOCK", "ulimit -l unlimited");
  }
  SECTION("a security module") {
    check_problem(judge_io_uring({.setup_error = EACCES, .disabled = 0, .seccomp = 0}), Status::Warn, "security policy",
                  "policy");
  }
  // Pauses still work without io_uring: a warning, never a failure, and it says so.
  for (int error : {EPERM, ENOSYS, ENOMEM, EINVAL}) {
    const Check c = judge_io_uring({.setup_error = error, .disabled = 2});
    CHECK(c.status == Status::Warn);
    CHECK(has(c.detail, "pread/pwrite"));
  }
}

TEST_CASE("memlock: the daemon's limit against budget x ranks, and the fix for whichever process it is") {
  MemlockFacts f{.process = "tmsdiskd (pid 42)",
                 .is_daemon = true,
                 .limit = 64 * 1024,
                 .staging_per_rank = 256 * tmsdisk::kMiB,
                 .ranks = 8,
                 .systemd_running = true};
  const Check low = judge_memlock(f);
  check_problem(low, Status::Warn, "RLIMIT_MEMLOCK is 64.0 KiB", "LimitMEMLOCK=infinity");
  f.systemd_running = false;  // no unit to edit: the shell's limit it was started with
  check_problem(judge_memlock(f), Status::Warn, "RLIMIT_MEMLOCK is 64.0 KiB", "ulimit -l unlimited");
  CHECK_FALSE(has(judge_memlock(f).fix, "systemctl"));
  f.systemd_running = true;
  CHECK(has(low.subject, "tmsdiskd (pid 42)"));
  CHECK(has(low.detail, "8 ranks x 256.0 MiB of staging = 2.0 GiB"));

  f.limit = 2048 * tmsdisk::kMiB;  // exactly enough
  CHECK(judge_memlock(f).status == Status::Ok);
  f.limit = 2047 * tmsdisk::kMiB;
  CHECK(judge_memlock(f).status == Status::Warn);
  f.limit.reset();
  CHECK(judge_memlock(f).status == Status::Ok);
  f.limit = 0;
  f.cap_ipc_lock = true;  // io_uring charges nothing to a process with CAP_IPC_LOCK
  const Check capable = judge_memlock(f);
  CHECK(capable.status == Status::Ok);
  CHECK(has(capable.detail, "CAP_IPC_LOCK"));

  // No daemon found: this shell's limit, which a private daemon started from it inherits.
  const Check shell =
      judge_memlock({.process = "this shell", .limit = 64 * 1024, .staging_per_rank = 256 * tmsdisk::kMiB});
  check_problem(shell, Status::Warn, "1 rank x 256.0 MiB", "ulimit -l unlimited");
  CHECK_FALSE(has(shell.fix, "system service"));  // none is started without systemd
}

TEST_CASE("systemd: tmsdiskd.socket enabled and listening is ok; otherwise the exact command") {
  const std::string enable = "sudo systemctl enable --now tmsdiskd.socket";
  SystemdFacts f{.systemd_running = true, .installed = true, .enabled = "enabled", .active = "active"};
  CHECK(judge_systemd_socket(f).status == Status::Ok);
  check_problem(
      judge_systemd_socket({.systemd_running = true, .installed = true, .enabled = "disabled", .active = "inactive"}),
      Status::Warn, "not enabled", enable);
  check_problem(
      judge_systemd_socket({.systemd_running = true, .installed = true, .enabled = "disabled", .active = "active"}),
      Status::Warn, "not after a reboot", enable);
  check_problem(
      judge_systemd_socket({.systemd_running = true, .installed = true, .enabled = "enabled", .active = "inactive"}),
      Status::Warn, "not listening", "sudo systemctl start tmsdiskd.socket");
  check_problem(judge_systemd_socket({.systemd_running = true, .installed = true, .enabled = "masked"}), Status::Fail,
                "masked", "systemctl unmask tmsdiskd.socket");
  check_problem(
      judge_systemd_socket({.systemd_running = true, .installed = true, .enabled = "enabled", .active = "failed"}),
      Status::Fail, "failed", "journalctl -u tmsdiskd.socket");
  check_problem(judge_systemd_socket({.systemd_running = true, .installed = false}), Status::Warn, "not installed",
                enable);
  check_problem(judge_systemd_socket({.systemd_running = false}), Status::Warn, "systemd is not running",
                "tmsdiskd --config");
  CHECK(judge_systemd_socket({.systemd_running = false, .socket_exists = true}).status == Status::Ok);
}

TEST_CASE("daemon: its version when reached; when not, the command that makes one answer at that socket") {
  DaemonFacts f{.socket = "/run/tmsdisk/tmsdiskd.sock", .reached = true, .version = "0.1.0", .own_version = "0.1.0"};
  const Check ok = judge_daemon(f);
  CHECK(ok.status == Status::Ok);
  CHECK(ok.detail == "tmsdiskd 0.1.0 at /run/tmsdisk/tmsdiskd.sock");
  f.version = "0.2.0";
  check_problem(judge_daemon(f), Status::Warn, "this tmsctl is 0.1.0", "one build");

  DaemonFacts absent{
      .socket = "/run/tmsdisk/tmsdiskd.sock", .error = ENOENT, .system_socket = true, .systemd_running = true};
  check_problem(judge_daemon(absent), Status::Fail, "no tmsdiskd answers at /run/tmsdisk/tmsdiskd.sock",
                "sudo systemctl enable --now tmsdiskd.socket");
  // Where systemd is not the init system, no systemctl: the daemon by hand, with the unit's memlock.
  absent.systemd_running = false;
  const Check by_hand = judge_daemon(absent);
  check_problem(by_hand, Status::Fail, "no tmsdiskd answers", "ulimit -l unlimited; exec tmsdiskd --config ");
  CHECK_FALSE(has(by_hand.fix, "systemctl"));
  f.systemd_running = false;
  CHECK_FALSE(has(judge_daemon(f).fix, "systemctl"));  // the version mismatch's restart
  absent = {.socket = "/run/user/1000/tmsdisk/tmsdiskd.sock", .error = ECONNREFUSED, .private_socket = true};
  check_problem(judge_daemon(absent), Status::Fail, "Connection refused", "tmsctl run");
  CHECK_FALSE(has(judge_daemon(absent).fix, "systemctl"));
  absent = {.socket = "/x/d.sock", .error = ENOENT};
  check_problem(judge_daemon(absent), Status::Fail, "/x/d.sock", "tmsdiskd --socket /x/d.sock --root DIR");
  absent = {.socket = "/x/d.sock", .error = EPROTONOSUPPORT, .message = "protocol version 3, daemon speaks 4"};
  check_problem(judge_daemon(absent), Status::Fail, "protocol version", "different builds");
}

TEST_CASE("driver: FAIL without one or without VMM on a device; a device without POSIX fd handles warns") {
  check_problem(judge_driver({.load_error = "libcuda.so.1: cannot open shared object file"})[0], Status::Fail,
                "cannot load libcuda.so.1", "NVIDIA driver");
  check_problem(judge_driver({.init_result = 100, .init_error = "CUDA_ERROR_NO_DEVICE"})[0], Status::Fail,
                "CUDA_ERROR_NO_DEVICE (100)", "CUDA_VISIBLE_DEVICES");
  const DriverFacts f{
      .version = 12040,
      .devices = {{.ordinal = 0, .name = "A", .total_bytes = 80ull << 30, .vmm = true, .posix_fd = true},
                  {.ordinal = 1, .name = "B", .total_bytes = 80ull << 30, .vmm = false},
                  {.ordinal = 2, .name = "C", .total_bytes = 80ull << 30, .vmm = true}}};
  CHECK(f.device_memory() == 240ull << 30);
  const auto checks = judge_driver(f);
  REQUIRE(checks.size() == 4);
  CHECK(checks[0].status == Status::Ok);
  CHECK(has(checks[0].detail, "version 12.4, 3 devices, 240.0 GiB"));
  CHECK(checks[1].status == Status::Ok);
  check_problem(checks[2], Status::Fail, "no virtual memory management", "cuMemCreate");
  CHECK(checks[2].subject == "device 1 (B)");
  check_problem(checks[3], Status::Warn, "cuIpcGetMemHandle", "update the NVIDIA driver");
}

TEST_CASE("roots: tmpfs, ramfs and overlay FAIL with the reason; network filesystems warn; ext4 is ok") {
  const std::string nvme = "local NVMe";
  check_problem(judge_root_filesystem({.path = "/dev/shm/t", .fs_type = TMPFS_MAGIC}), Status::Fail,
                "paused GPU memory would stay in RAM", nvme);
  check_problem(judge_root_filesystem({.path = "/r", .fs_type = RAMFS_MAGIC}), Status::Fail, "on ramfs", nvme);
  check_problem(judge_root_filesystem({.path = "/r", .fs_type = 0x794c7630}), Status::Fail, "no O_DIRECT guarantee",
                "bind-mount");
  check_problem(judge_root_filesystem({.path = "/r", .fs_type = NFS_SUPER_MAGIC}), Status::Warn, "on nfs", nvme);
  const Check ext4 = judge_root_filesystem({.path = "/nvme0/t", .fs_type = EXT4_SUPER_MAGIC});
  CHECK(ext4.status == Status::Ok);
  CHECK(ext4.detail == "ext4");
  CHECK(ext4.subject == "root /nvme0/t: filesystem");
  check_problem(judge_root_filesystem({.path = "/nope", .open_error = ENOENT}), Status::Fail, "does not exist",
                "sudo mkdir -p /nope");
  check_problem(judge_root_filesystem({.path = "/link", .symlink = true}), Status::Fail, "symbolic link",
                "realpath /link");
}

TEST_CASE("roots: O_DIRECT refused warns (buffered fallback); a block read back wrong FAILs") {
  CHECK(judge_root_direct_io({.path = "/r"}).status == Status::Ok);
  check_problem(
      judge_root_direct_io({.path = "/r", .direct_error = EINVAL, .direct_step = "open", .direct_unsupported = true}),
      Status::Warn, "refuses O_DIRECT", "ext4 or xfs");
  check_problem(judge_root_direct_io({.path = "/r", .direct_step = "compare"}), Status::Fail, "differs", "dmesg");
  check_problem(judge_root_direct_io({.path = "/r", .direct_error = EACCES, .direct_step = "open"}), Status::Warn,
                "Permission denied", "sudo tmsctl doctor");
  check_problem(judge_root_direct_io({.path = "/r", .direct_error = EROFS, .direct_step = "open"}), Status::Fail,
                "Read-only", "read-write");
}

TEST_CASE("roots: free space against the node's device memory, shared over the roots chunks stripe across") {
  const RootFacts root{.path = "/r", .free_bytes = 100ull << 30};
  const Check unknown = judge_root_space(root, std::nullopt, 1);
  CHECK(unknown.status == Status::Ok);
  CHECK(has(unknown.detail, "100.0 GiB free"));
  CHECK(has(unknown.detail, "unknown"));
  CHECK(judge_root_space(root, 100ull << 30, 1).status == Status::Ok);
  check_problem(judge_root_space(root, 640ull << 30, 1), Status::Warn, "less than the node's 640.0 GiB", "add roots");
  CHECK(judge_root_space(root, 200ull << 30, 2).status == Status::Ok);  // half of it each
  check_problem(judge_root_space(root, 640ull << 30, 2), Status::Warn, "320.0 GiB, its share (1/2)", "root = [...]");
}
