// SPDX-License-Identifier: Apache-2.0
// tmsdisk-session-bench: the daemon's write/read path through a session, beside the raw O_DIRECT
// ceiling of the same directory measured in the same run, and the host memory it took.
//
//   tmsdisk-session-bench DIR [--gib 8] [--staging-budget-mb 256] [--chunk-mb 8] [--unchanged 2] [--json]
//
// Raw and session passes alternate (--repeat); each direction compares best with best.
// The client plays the shim: it fills its staging slots once (the benchmark measures the disk path,
// not pattern generation), reserves one blob, and streams it through every slot to the daemon, then
// reads it back (the daemon verifies every chunk's checksum). Write time includes the commit's
// fdatasync, as the raw ceiling's includes one. Each pass changes every chunk (it stamps its number
// into every slot), so that its chunks are written: the daemon writes no chunk whose bytes its file
// already holds. Then --unchanged pauses of the same bytes measure that path: every chunk
// hashed by the daemon, none written.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rawdisk.h"
#include "test_support.h"

using namespace tmsdisk;
using Clock = std::chrono::steady_clock;

namespace {

// VmHWM (peak resident set) of a process, in bytes.
uint64_t peak_rss(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  double gib = 8;
  uint64_t staging_budget_mb = 256;
  uint32_t chunk_mb = 8;
  bool as_json = false;
  bool allow_tmpfs = false;
  unsigned repeat = 3;
  unsigned unchanged_passes = 2;
  CLI::App app{"tmsdisk-session-bench: daemon session write/read bandwidth vs the raw O_DIRECT ceiling of DIR"};
  app.add_option("dir", dir, "directory on the disk to measure (becomes the daemon's root)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--gib", gib, "bytes moved in each direction, GiB")->capture_default_str();
  app.add_option("--staging-budget-mb", staging_budget_mb, "staging budget per rank (pinned host memory), MiB")
      ->capture_default_str();
  app.add_option("--chunk-mb", chunk_mb, "chunk size (bytes per request and per checksum), MiB")->capture_default_str();
  app.add_option("--repeat", repeat, "session passes, each preceded by a raw pass (plus one raw pass at the end)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--unchanged", unchanged_passes,
                 "pauses of the same bytes after the last pass, each chunk unchanged (hashed, not written)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  app.add_flag("--allow-tmpfs", allow_tmpfs,
               "let DIR be on tmpfs (the daemon's --allow-tmpfs): where O_DIRECT there is a memory copy (Linux "
               ">= 6.6), what the daemon adds shows without a disk's limit");
  app.add_flag("--json", as_json, "print JSON");
  CLI11_PARSE(app, argc, argv);
  const uint64_t bytes = static_cast<uint64_t>(gib * (1ull << 30)) & ~((uint64_t{chunk_mb} << 20) - 1);

  // The ceiling gets the same bytes in flight as the session: one request per staging slot.
  const unsigned depth = static_cast<unsigned>(std::max<uint64_t>(1, staging_budget_mb / chunk_mb));
  std::vector<bench::RawDiskResult> raws;
  auto raw_pass = [&]() -> bool {
    auto r = bench::measure_raw_disk(dir, bytes, uint64_t{chunk_mb} << 20, depth);
    if (!r) {
      std::fprintf(stderr, "raw measurement failed: %s\n", r.error().describe().c_str());
      return false;
    }
    raws.push_back(*r);
    return true;
  };

  testing::TempDir work(dir, "tmsdisk-bench");
  const std::string root = work / "root";
  std::filesystem::create_directories(root);
  testing::DaemonProcess daemon;
  const std::string socket = work / "d.sock";
  const char* daemon_env = std::getenv("TMSDISK_DAEMON");  // a carried build has no build tree
  const std::string daemon_path = daemon_env && *daemon_env ? daemon_env : TMSDISK_DAEMON_PATH;
  std::vector<std::string> daemon_args{"--socket",
                                       socket,
                                       "--root",
                                       root,
                                       "--staging-budget-mb",
                                       std::to_string(staging_budget_mb),
                                       "--chunk-mb",
                                       std::to_string(chunk_mb),
                                       "--log-level",
                                       "warn"};
  if (allow_tmpfs) daemon_args.push_back("--allow-tmpfs");
  if (daemon.start(daemon_path, daemon_args) != 0) {
    std::fprintf(stderr, "tmsdiskd did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  testing::ShimClient::Options options;
  options.job = "bench";
  auto client = testing::ShimClient::connect(socket, options);
  if (!client) {
    std::fprintf(stderr, "session: %s\n", client.error().describe().c_str());
    return 1;
  }
  // Every slot holds the same bytes, so that a chunk's bytes do not depend on the slot it went
  // through: whether the daemon finds it unchanged does not depend on the order of its answers.
  for (uint32_t s = 0; s < client->welcome().slot_count; ++s)
    testing::fill_pattern(0, 0, client->slot(s), client->welcome().chunk_bytes);
  const std::vector<proto::BlobSize> blobs = {{1, bytes}};
  // One pause of the blob: reserve, every chunk through the slots, commit. Its bytes per second, or 0
  // (said on stderr).
  auto pause = [&]() -> double {
    if (auto st = client->reserve(blobs); !st) {
      std::fprintf(stderr, "reserve: %s\n", st.error().describe().c_str());
      return 0;
    }
    const auto t0 = Clock::now();
    auto w = client->write_all(blobs, [](uint64_t, uint64_t, uint8_t*, uint32_t) {});
    auto c = w ? client->commit(proto::CommitState::Paused) : Status(w.error());
    const double rate = static_cast<double>(bytes) / seconds_since(t0);
    if (c) return rate;
    std::fprintf(stderr, "session write: %s\n", c.error().describe().c_str());
    return 0;
  };

  // Raw and session passes alternate (raw, session, raw, ..., raw) so that a drifting disk affects
  // both alike; each direction compares the best session pass with the best raw pass.
  std::vector<double> session_w, session_r;
  for (unsigned i = 0; i < repeat; ++i) {
    if (!raw_pass()) return 1;
    const uint64_t stamp = i + 1;
    for (uint32_t s = 0; s < client->welcome().slot_count; ++s) std::memcpy(client->slot(s), &stamp, sizeof stamp);
    session_w.push_back(pause());
    if (session_w.back() == 0) return 1;
    auto t0 = Clock::now();
    // The daemon verifies every chunk; the client neither checks nor poisons its slots (as the shim).
    auto r = client->read_all(
        blobs, [](uint64_t, uint64_t, const uint8_t*, uint32_t) { return true; }, /*poison_slots=*/false);
    session_r.push_back(static_cast<double>(bytes) / seconds_since(t0));
    if (!r) {
      std::fprintf(stderr, "session read: %s\n", r.error().describe().c_str());
      return 1;
    }
    if (auto st = client->commit(proto::CommitState::Resumed); !st) {
      std::fprintf(stderr, "commit: %s\n", st.error().describe().c_str());
      return 1;
    }
  }
  // The same bytes again: what a pause of memory that did not change costs (the daemon hashes every
  // chunk and writes none). No raw pass between them: they do not touch the disk's data.
  std::vector<double> session_u;
  for (unsigned i = 0; i < unchanged_passes; ++i) {
    session_u.push_back(pause());
    if (session_u.back() == 0) return 1;
    if (auto st = client->commit(proto::CommitState::Resumed); !st) {
      std::fprintf(stderr, "commit: %s\n", st.error().describe().c_str());
      return 1;
    }
  }
  const uint64_t daemon_rss = peak_rss(daemon.pid());
  const uint64_t client_rss = peak_rss(::getpid());
  const uint64_t budget = client->welcome().staging_budget_bytes;
  client->close();
  daemon.stop();
  if (!raw_pass()) return 1;

  double raw_w = 0, raw_r = 0;
  nlohmann::json raw_passes = nlohmann::json::array();
  for (const auto& r : raws) {
    raw_w = std::max(raw_w, r.write_bytes_per_s);
    raw_r = std::max(raw_r, r.read_bytes_per_s);
    raw_passes.push_back({{"write_gb_s", r.write_bytes_per_s / 1e9}, {"read_gb_s", r.read_bytes_per_s / 1e9}});
  }
  const double sw = *std::max_element(session_w.begin(), session_w.end());
  const double sr = *std::max_element(session_r.begin(), session_r.end());
  nlohmann::json session_passes = nlohmann::json::array();
  for (unsigned i = 0; i < repeat; ++i)
    session_passes.push_back({{"write_gb_s", session_w[i] / 1e9}, {"read_gb_s", session_r[i] / 1e9}});
  // The unchanged pauses beside the best written one: what not writing saves, in wall time.
  const double su = session_u.empty() ? 0 : *std::max_element(session_u.begin(), session_u.end());
  nlohmann::json unchanged_passes_json = nlohmann::json::array();
  for (double u : session_u) unchanged_passes_json.push_back(u / 1e9);
  const auto& raw = raws.front();
  nlohmann::json out = {{"dir", dir},
                        {"bytes", bytes},
                        {"chunk_bytes", uint64_t{chunk_mb} << 20},
                        {"staging_budget_bytes", budget},
                        {"raw",
                         {{"write_gb_s", raw_w / 1e9},
                          {"read_gb_s", raw_r / 1e9},
                          {"passes", raw_passes},
                          {"direct_io", raw.direct_io},
                          {"io_uring", raw.io_uring},
                          {"notes", raw.notes}}},
                        {"session", {{"write_gb_s", sw / 1e9}, {"read_gb_s", sr / 1e9}, {"passes", session_passes}}},
                        {"unchanged", {{"pause_gb_s", su / 1e9}, {"passes", unchanged_passes_json}}},
                        {"ratio", {{"write", sw / raw_w}, {"read", sr / raw_r}, {"unchanged_over_write", su / sw}}},
                        {"memory",
                         {{"daemon_peak_rss", daemon_rss},
                          {"client_peak_rss", client_rss},
                          {"daemon_rss_per_budget", static_cast<double>(daemon_rss) / static_cast<double>(budget)}}}};
  if (as_json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("directory            %s (%s, %s)\n", dir.c_str(), raw.direct_io ? "O_DIRECT" : "buffered",
              raw.io_uring ? "io_uring" : "pread/pwrite");
  std::printf("bytes each way       %.2f GiB, %u MiB requests, %.0f MiB staging, %u session passes\n",
              static_cast<double>(bytes) / (1ull << 30), chunk_mb, static_cast<double>(budget) / (1 << 20), repeat);
  std::printf("raw passes (GB/s)   ");
  for (const auto& r : raws) std::printf(" w %.3f r %.3f |", r.write_bytes_per_s / 1e9, r.read_bytes_per_s / 1e9);
  std::printf("\nsession passes      ");
  for (unsigned i = 0; i < repeat; ++i) std::printf(" w %.3f r %.3f |", session_w[i] / 1e9, session_r[i] / 1e9);
  std::printf("\n                     %10s %10s %8s   (best pass of each)\n", "raw GB/s", "session", "ratio");
  std::printf("write                %10.3f %10.3f %8.3f\n", raw_w / 1e9, sw / 1e9, sw / raw_w);
  std::printf("read                 %10.3f %10.3f %8.3f\n", raw_r / 1e9, sr / 1e9, sr / raw_r);
  if (!session_u.empty()) {
    std::printf("unchanged pauses    ");
    for (double u : session_u) std::printf(" %.3f |", u / 1e9);
    std::printf("\nunchanged pause      %10s %10.3f %8.3f   (best; ratio: over the best written pause)\n", "", su / 1e9,
                su / sw);
  }
  std::printf("daemon peak RSS      %.1f MiB = %.2f x the staging budget\n",
              static_cast<double>(daemon_rss) / (1 << 20),
              static_cast<double>(daemon_rss) / static_cast<double>(budget));
  std::printf("client peak RSS      %.1f MiB (includes the mapped staging)\n",
              static_cast<double>(client_rss) / (1 << 20));
  if (!raw.notes.empty()) std::printf("notes                %s\n", raw.notes.c_str());
  return 0;
}
