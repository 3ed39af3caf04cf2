// SPDX-License-Identifier: Apache-2.0
// The host-memory tier (host_tier.h).
#include "host_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "staging_buffer.h"
#include "tmsdisk/common/human.h"

namespace tmsdisk::server {
namespace {

constexpr const char* kMemfdName = "tmsdisk-host-tier";
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kCgroupMargin = 64ull << 20;  // left below a cgroup's memory.max: its own kernel allocations
// One thread faults in this much at least; a large grant is split over at most kFaultThreads. The
// pages of one file are allocated under one lock: on an H200 node (16 cores) 8 GiB faulted in at
// 2.6 GB/s on one thread, 6.7 on four, 5.7 on eight. fallocate(2) looks faster (11.5 GB/s) but
// leaves the zeroing to the first fault, which then fell to the rank's cuMemHostRegister, on one
// thread: the pause took 3.8 s instead of 2.7.
constexpr uint64_t kFaultPiece = 1ull << 30;
constexpr unsigned kFaultThreads = 4;

// "MemAvailable:   123456 kB" -> bytes; nullopt when absent.
std::optional<uint64_t> meminfo_field(const std::string& text, std::string_view key) {
  std::istringstream in(text);
  std::string name;
  uint64_t kib = 0;
  std::string unit;
  while (in >> name >> kib) {
    std::getline(in, unit);
    if (name.size() == key.size() + 1 && name.compare(0, key.size(), key) == 0 && name.back() == ':') return kib * 1024;
  }
  return std::nullopt;
}

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// memory.max or memory.current: a number, or "max" (no limit: nullopt).
std::optional<uint64_t> cgroup_value(const std::string& path) {
  auto text = read_text(path);
  if (!text) return std::nullopt;
  uint64_t v = 0;
  std::istringstream in(*text);
  if (!(in >> v)) return std::nullopt;
  return v;
}

}  // namespace

SpareMemory spare_memory(const std::string& meminfo, const std::string& self_cgroup, const std::string& cgroup_root) {
  SpareMemory spare;
  if (auto text = read_text(meminfo)) {
    const auto available = meminfo_field(*text, "MemAvailable");
    const auto total = meminfo_field(*text, "MemTotal");
    if (available && total) {
      spare.bytes = sub_floor(*available, std::max(kGiB, *total / 20));
      spare.limited_by = "MemAvailable";
    }
  }
  // cgroup v2: "0::/system.slice/tmsdiskd.service". Each ancestor's limit applies too.
  auto text = read_text(self_cgroup);
  if (!text) return spare;
  std::istringstream lines(*text);
  std::string line;
  std::string path;
  while (std::getline(lines, line))
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  if (path.empty() || path.front() != '/' || path.find("/..") != std::string::npos) return spare;
  for (;;) {
    const std::string dir = cgroup_root + (path == "/" ? "" : path);
    const auto max = cgroup_value(dir + "/memory.max");
    const auto current = cgroup_value(dir + "/memory.current");
    if (max && current) {
      const uint64_t headroom = sub_floor(*max, *current + kCgroupMargin);
      if (headroom < spare.bytes) {
        spare.bytes = headroom;
        spare.limited_by = "cgroup " + path + " (memory.max)";
      }
    }
    if (path == "/") break;
    const auto slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return spare;
}

FairShare fair_share(uint64_t budget, std::size_t users, std::size_t ranks_of_user) {
  FairShare f;
  f.users = std::max<std::size_t>(users, 1);
  f.ranks_of_user = std::max<std::size_t>(ranks_of_user, 1);
  f.bytes = budget / f.users / f.ranks_of_user;
  return f;
}

TierPlan plan_grant(uint64_t ask, uint32_t chunk, uint64_t budget, uint64_t used, const FairShare& share,
                    const SpareMemory& spare) {
  TierPlan p;
  if (budget == 0 || chunk == 0) {
    p.note = "the node has no host-memory tier (tmsdiskd's host-tier-mb is 0)";
    return p;
  }
  const uint64_t want = ask / chunk * chunk + (ask % chunk ? chunk : 0);
  const uint64_t fair = share.bytes;
  const uint64_t left = sub_floor(budget, used);
  p.bytes = std::min({want, fair, left, spare.bytes}) / chunk * chunk;
  if (p.bytes >= want) return p;
  if (p.bytes / chunk * chunk == spare.bytes / chunk * chunk && spare.bytes < std::min({want, fair, left}))
    p.note = fmt::format("the node can spare only {} now ({})", human_bytes(spare.bytes), spare.limited_by);
  else if (left < std::min(want, fair))
    p.note = fmt::format("other ranks hold the rest of the node's host tier ({} of {} left)", human_bytes(left),
                         human_bytes(budget));
  else if (share.users > 1)
    p.note = fmt::format(
        "a fair share of the node's host tier: {} of {}, split between {} users, and this user's "
        "part between its {} rank(s)",
        human_bytes(fair), human_bytes(budget), share.users, share.ranks_of_user);
  else
    p.note = fmt::format("a fair share of the node's host tier: {} of {} for each of {} ranks", human_bytes(fair),
                         human_bytes(budget), share.ranks_of_user);
  return p;
}

Result<TierMemory> hold_tier_memory(UniqueFd fd, uint64_t bytes) {
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0) return errno_error("cannot stat host-tier memory");
  TierMemory m;
  m.fd = std::move(fd);
  m.bytes = bytes;
  m.dev = st.st_dev;
  m.ino = st.st_ino;
  return m;
}

Status revoke_tier_memory(TierMemory& memory) {
  Status st;
  struct stat s {};
  if (memory.fd && ::fstat(memory.fd.get(), &s) == 0 && s.st_size > 0 &&
      ::fallocate(memory.fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, s.st_size) != 0)
    st = errno_error("cannot take host-tier memory back (punching its memfd)");
  memory = TierMemory{};
  return st;
}

Result<UniqueFd> make_tier_memory(uint64_t bytes) {
  UniqueFd fd(::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return errno_error("memfd_create for host-tier memory");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
    return errno_error(fmt::format("cannot size host-tier memory to {} bytes", bytes));
  // Sealed against resizing: its size is what the budget counts, now and when a rank hands it back.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    return errno_error("cannot seal host-tier memory");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return errno_error("cannot map host-tier memory");
  auto* base = static_cast<uint8_t*>(p);
  // Huge pages where the node lets shared memory have them (shmem_enabled "advise"; the H200 node
  // says "never"): fewer faults to take here, fewer pages for the rank to pin. Ignored elsewhere.
  (void)::madvise(base, bytes, MADV_HUGEPAGE);
  const unsigned threads = static_cast<unsigned>(std::clamp<uint64_t>(
      bytes / kFaultPiece, 1, std::max(1u, std::min(kFaultThreads, std::thread::hardware_concurrency()))));
  const uint64_t share = (bytes / threads + 4095) / 4096 * 4096;
  std::vector<Status> results(threads);
  auto piece = [&](unsigned t) {
    const uint64_t from = std::min(bytes, t * share);
    results[t] = fault_in(base + from, std::min(share, bytes - from), "host-tier memory");
  };
  std::vector<std::thread> workers;
  unsigned started = 1;
  try {
    for (; started < threads; ++started) workers.emplace_back(piece, started);
  } catch (const std::system_error&) {
    // Fewer threads: this one does the pieces that got none.
  }
  piece(0);
  for (unsigned t = started; t < threads; ++t) piece(t);
  for (auto& w : workers) w.join();
  ::munmap(base, bytes);
  for (const auto& r : results)
    if (!r) return r.error();
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SEAL) != 0) return errno_error("cannot seal host-tier memory");
  return fd;
}

Result<uint64_t> tier_memory_bytes(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot stat the descriptor");
  char link[64];
  const std::string proc = fmt::format("/proc/self/fd/{}", fd);
  const ssize_t n = ::readlink(proc.c_str(), link, sizeof(link) - 1);
  const std::string name = n > 0 ? std::string(link, static_cast<std::size_t>(n)) : std::string();
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || name.rfind(std::string("/memfd:") + kMemfdName, 0) != 0 || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return make_error(EINVAL, "the descriptor is not host-tier memory tmsdiskd handed out");
  return std::min(static_cast<uint64_t>(st.st_size), static_cast<uint64_t>(st.st_blocks) * 512);
}

}  // namespace tmsdisk::server
