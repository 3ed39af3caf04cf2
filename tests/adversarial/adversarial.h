// SPDX-License-Identifier: Apache-2.0
// What the adversarial suites share beside the daemon fixture (daemon_fixture.h: a tmsdiskd child and
// what every attack is checked against afterwards, the descriptors it holds and a well-formed client
// it still serves): their session sizes, snapshots of files an attack must not change, and the
// suite's seed. Header-only; Catch2 test programs that link tmsdisk_ctl and the test-support library.
#pragma once

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
#include "daemon_fixture.h"
#include "disk_faults.h"
#include "test_support.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::adversarial {

namespace fs = std::filesystem;
using namespace tmsdisk::testing;

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

// The adversarial cases' daemon: its shim-role sessions ask for 4 MiB of staging in 1 MiB chunks.
inline constexpr Daemon::Options kSmallSessions{.staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB};

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
