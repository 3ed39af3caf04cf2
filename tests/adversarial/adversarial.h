// SPDX-License-Identifier: Apache-2.0
// What the adversarial suites share: a tmsdiskd child on temp roots with what every attack is checked
// against afterwards (the descriptors it holds, a well-formed client it still serves), snapshots of
// files an attack must not change, and the suite's seed. Header-only; Catch2 test programs that link
// tmsdisk_ctl and the test-support library.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "client.h"
#include "disk_faults.h"
#include "test_support.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::adversarial {

namespace fs = std::filesystem;
using namespace tmsdisk::testing;

inline constexpr uint64_t MiB = 1ull << 20;

// The seed of every generated input: fixed, so that a failure repeats; TMSDISK_ADVERSARIAL_SEED picks
// another. Printed once per program (and INFO'd by the cases that use it).
inline uint64_t suite_seed() {
  static const uint64_t seed = [] {
    uint64_t s = 0x7d15c0de2026ull;
    if (const char* e = std::getenv("TMSDISK_ADVERSARIAL_SEED"); e && *e) s = std::strtoull(e, nullptr, 0);
    std::printf("adversarial seed: %#" PRIx64 " (TMSDISK_ADVERSARIAL_SEED=%#" PRIx64 " repeats this run)\n", s, s);
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

// Descriptors open in process `pid` right now (/proc/<pid>/fd), or -1 when they cannot be counted.
inline int open_fds(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return -1;
  int n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// What process `pid`'s descriptors name, one per line (for a failure's message).
inline std::string describe_fds(pid_t pid) {
  std::string out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code link_ec;
    out += e.path().filename().string() + " -> " + fs::read_symlink(e.path(), link_ec).string() + "\n";
  }
  return out;
}

// A tmsdiskd child on its own socket and roots (see DaemonProcess), with what an attack is measured by.
struct Daemon {
  TempDir dir{test_tmp_root(), "adv"};
  std::string socket = dir / "d.sock";
  std::vector<std::string> roots;
  DaemonProcess proc;

  explicit Daemon(int nroots = 1) {
    for (int i = 0; i < nroots; ++i) {
      roots.push_back(dir / ("root" + std::to_string(i)));
      fs::create_directories(roots.back());
    }
  }
  std::vector<std::string> args(const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> a{"--socket", socket, "--log-level", "debug"};
    for (auto& r : roots) a.insert(a.end(), {"--root", r});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  void start(const std::vector<std::string>& extra = {}) {
    int rc = proc.start(TMSDISK_DAEMON_PATH, args(extra));
    INFO(proc.log());
    REQUIRE(rc == 0);
  }
  // A shim-role session with a small staging budget unless the options say otherwise.
  Result<ShimClient> try_shim(ShimClient::Options o = {}) const {
    if (!o.staging_budget_bytes) o.staging_budget_bytes = 4 * MiB;
    if (!o.chunk_bytes) o.chunk_bytes = 1 * MiB;
    return ShimClient::connect(socket, o);
  }
  ShimClient shim(ShimClient::Options o = {}) const {
    auto c = try_shim(std::move(o));
    INFO((c ? "" : c.error().describe()));
    REQUIRE(c);
    return std::move(c.value());
  }
  ctl::Client control() const {
    auto c = ctl::Client::connect(socket);
    INFO((c ? "" : c.error().describe()));
    REQUIRE(c);
    return std::move(c.value());
  }
  std::string rank_dir(std::size_t root, const std::string& job, int64_t rank, pid_t pid,
                       uid_t uid = ::getuid()) const {
    return roots[root] + "/" + std::to_string(uid) + "/" + job + "/rank" + std::to_string(rank) + "-" +
           std::to_string(pid);
  }
  int fds() const { return open_fds(proc.pid()); }

  // The daemon still serves a well-formed client: a control client lists the sessions, and a
  // shim-role client pauses and resumes two chunks (reserve, write, commit, read back verified,
  // commit). Resumed, the canary's session and files go when this returns (a session closed mid-pause
  // would rightly be kept as an orphan while this process lives).
  void check_serving(const std::string& job = "canary") const {
    auto ctl = control();
    auto list = ctl.list_sessions();
    INFO((list ? "" : list.error().describe()));
    CHECK(list);
    static int64_t next_rank = 0;
    auto c = shim({.job = job, .rank = next_rank++});
    const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
    auto reserved = c.reserve(blobs);
    INFO((reserved ? "" : reserved.error().describe()));
    REQUIRE(reserved);
    auto written = c.write_all(blobs, fill_pattern);
    INFO((written ? "" : written.error().describe()));
    REQUIRE(written);
    REQUIRE(c.commit(proto::CommitState::Paused));
    auto read = c.read_all(blobs, check_pattern);
    INFO((read ? "" : read.error().describe()));
    CHECK(read);
    CHECK(c.commit(proto::CommitState::Resumed));
  }

  // The daemon holds no more descriptors than `baseline` once what it was handed is closed (its
  // reaper thread closes passed descriptors, sessions end after their I/O: waited for, not slept on).
  void check_fds(int baseline) const {
    REQUIRE(baseline > 0);
    int now = -1;
    const bool back = eventually([&] { return (now = fds()) <= baseline; }, std::chrono::seconds(20));
    INFO("daemon descriptors: " << baseline << " before, " << now << " after:\n" << describe_fds(proc.pid()));
    CHECK(back);
  }
};

// One line per entry under `dir` (links not followed): relative path -> type, mode, owner, size,
// mtime and, for a regular file, the hash of its bytes. Two equal snapshots: nothing was created,
// removed, written or touched.
using Tree = std::map<std::string, std::string>;

inline std::string file_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  return std::to_string(std::hash<std::string>{}(bytes));
}

inline Tree snapshot(const std::string& dir) {
  Tree t;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st {};
    const std::string path = it->path().string();
    if (::lstat(path.c_str(), &st) != 0) continue;
    std::ostringstream line;
    line << std::oct << st.st_mode << std::dec << " " << st.st_uid << ":" << st.st_gid << " " << st.st_size << " "
         << st.st_mtim.tv_sec << "." << st.st_mtim.tv_nsec;
    if (S_ISREG(st.st_mode)) line << " " << file_hash(path);
    if (S_ISLNK(st.st_mode)) line << " -> " << fs::read_symlink(it->path(), ec).string();
    t[fs::relative(it->path(), dir).string()] = line.str();
  }
  return t;
}

// What changed from `before` to `after`, one line each; empty when nothing did.
inline std::string diff(const Tree& before, const Tree& after) {
  std::string out;
  for (auto& [k, v] : before) {
    auto it = after.find(k);
    if (it == after.end())
      out += "removed " + k + "\n";
    else if (it->second != v)
      out += "changed " + k + ": " + v + " -> " + it->second + "\n";
  }
  for (auto& [k, v] : after)
    if (!before.count(k)) out += "created " + k + ": " + v + "\n";
  return out;
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

// A directory outside every root that looks like a rank's (owner, data, manifest, sums) next to a
// file that matters, so that a daemon following a planted link would find something to write, truncate
// or delete. Its snapshot must never change.
struct Sentinel {
  TempDir dir{test_tmp_root(), "adv-sentinel"};
  Tree before;
  explicit Sentinel(pid_t owner = ::getpid()) {
    write_file(dir / "precious", "keep me\n");
    write_file(dir / "owner", "tmsdisk-owner 1\npid " + std::to_string(owner) + "\nstart_time 1\ntoken 1\n");
    write_file(dir / "data", std::string(64 * 1024, 'D'));
    write_file(dir / "manifest", std::string(512, 'M'));
    write_file(dir / "sums", std::string(256, 'S'));
    fs::create_directories(dir / "0/job/rank0-1");
    write_file(dir / "0/job/rank0-1/data", "deep");
    // Fixed, old times, so that "touched" shows as a change even within one clock tick.
    for (auto& e : fs::recursive_directory_iterator(dir.path())) {
      timespec times[2] = {{1'000'000'000, 0}, {1'000'000'000, 0}};
      ::utimensat(AT_FDCWD, e.path().c_str(), times, AT_SYMLINK_NOFOLLOW);
    }
    before = snapshot(dir.path());
  }
  const std::string& path() const { return dir.path(); }
  // Nothing in it was created, removed, written or touched.
  void check_untouched() const {
    const std::string changes = diff(before, snapshot(dir.path()));
    INFO("outside the root:\n" << changes);
    CHECK(changes.empty());
  }
};

// The state word of a rank's manifest (daemon/storage/manifest.h: 1 paused, 2 resumed, 3 writing),
// 0 when there is none. Lets a case tell whether a fault really came mid-pause or mid-resume.
inline uint32_t manifest_state(const std::string& rank_dir) {
  std::ifstream in(rank_dir + "/manifest", std::ios::binary);
  unsigned char b[16] = {};
  if (!in.read(reinterpret_cast<char*>(b), sizeof(b))) return 0;
  return b[12] | (b[13] << 8) | (b[14] << 16) | (static_cast<uint32_t>(b[15]) << 24);
}
inline constexpr uint32_t kManifestPaused = 1, kManifestResumed = 2, kManifestWriting = 3;

}  // namespace tmsdisk::adversarial
