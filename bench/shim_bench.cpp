// SPDX-License-Identifier: Apache-2.0
// tmsdisk-shim-bench: what the shim costs and how fast it moves memory, on the real driver or simcuda.
//
//   tmsdisk-shim-bench --dir DIR [--gib 4] [--shim libtmsdisk.so] [--repeat N]
//
// One run measures, in this order:
//   1. the raw O_DIRECT write/read ceiling of DIR (the daemon's root; TMSDISK_SOCKET names the daemon),
//      again after 3., keeping the better figure;
//   2. children without the shim: pinned host<->device copy bandwidth, cuMemAlloc+cuMemFree latency
//      (64 MiB), and the kernel launch rate; in the last one, the naive engine on the same bytes and
//      directory (synchronous copies through a pageable buffer, buffered writes, one fsync; then
//      reads from the disk and copies back), which is what other tools do today;
//   3. children with the shim preloaded: the same, and in the last one tmsdisk_pause()/
//      tmsdisk_resume() of GIB GiB of filled device memory, verified byte for byte afterwards,
//      --repeat times, each cycle right after a raw pass of its own (the disk drifts by more than
//      what is measured, so each side is taken close in time to the other)
//      (2 and 3 alternate --overhead-rounds times; each keeps its best figures);
// and prints each figure beside its ceiling: pause GB/s / raw write, resume GB/s / raw read (best
// pass of each), alloc latency and launch rate with the shim / without, and pause and resume beside
// the naive engine's save and restore.
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rawdisk.h"

using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// An empty kernel in PTX, JIT-compiled by the driver for whatever GPU is present.
const char kNopPtx[] = R"(
.version 7.0
.target sm_52
.address_size 64
.visible .entry tmsdisk_nop() { ret; }
)";

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

#define CHECK_CU(call)                                                           \
  do {                                                                           \
    CUresult rc_ = (call);                                                       \
    if (rc_ != CUDA_SUCCESS) {                                                   \
      const char* name_ = nullptr;                                               \
      cuGetErrorName(rc_, &name_);                                               \
      std::fprintf(stderr, "%s failed: %s\n", #call, name_ ? name_ : "unknown"); \
      return json{{"error", std::string(#call) + ": " + (name_ ? name_ : "?")}}; \
    }                                                                            \
  } while (0)

// GIB GiB in 1 GiB allocations (made on the first call), each filled with its own 32-bit value,
// another one for each pass: a pause after a fill finds every chunk changed, as in training, where
// weights and optimizer state change every step. verify_pattern checks them.
constexpr size_t kPiece = size_t{1} << 30;

uint32_t word(size_t piece, int pass) {
  return 0xC0DE0000u + static_cast<uint32_t>(piece) + (static_cast<uint32_t>(pass) << 8);
}

CUresult fill_pattern(std::vector<CUdeviceptr>& mem, int pass = 0) {
  for (size_t i = 0; i < mem.size(); ++i) {
    if (!mem[i])
      if (CUresult r = cuMemAlloc(&mem[i], kPiece); r != CUDA_SUCCESS) return r;
    if (CUresult r = cuMemsetD32(mem[i], word(i, pass), kPiece / 4); r != CUDA_SUCCESS) return r;
  }
  return cuCtxSynchronize();
}

// `passes[i]`: the pass whose value piece i holds.
CUresult verify_pieces(const std::vector<CUdeviceptr>& mem, bool* intact, const std::vector<int>& passes) {
  std::vector<uint32_t> check(kPiece / 4 / 16);
  for (size_t i = 0; i < mem.size() && *intact; ++i) {
    for (size_t off = 0; off < kPiece && *intact; off += check.size() * 4) {
      if (CUresult r = cuMemcpyDtoH(check.data(), mem[i] + off, check.size() * 4); r != CUDA_SUCCESS) return r;
      for (uint32_t w : check) *intact &= w == word(i, passes[i]);
    }
  }
  return CUDA_SUCCESS;
}

CUresult verify_pattern(const std::vector<CUdeviceptr>& mem, bool* intact, int pass = 0) {
  return verify_pieces(mem, intact, std::vector<int>(mem.size(), pass));
}

// The naive engine: what moving device memory to disk and back looks like without tmsdisk.
json measure_naive(size_t count, const std::string& dir) {
  std::vector<CUdeviceptr> mem(count);
  CHECK_CU(fill_pattern(mem));
  const size_t chunk = 64u << 20;
  std::vector<uint8_t> buf(chunk);  // pageable, as a Python or C++ loop would use
  const std::string path = dir + "/naive-bench." + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return json{{"error", "cannot create " + path + ": " + std::strerror(errno)}};
  ::unlink(path.c_str());
  auto io_failed = [&](const char* what) {
    const std::string why = std::string(what) + ": " + std::strerror(errno);
    ::close(fd);
    return json{{"error", why}};
  };
  auto t = Clock::now();
  off_t pos = 0;
  for (CUdeviceptr p : mem) {
    for (size_t off = 0; off < kPiece; off += chunk, pos += static_cast<off_t>(chunk)) {
      CHECK_CU(cuMemcpyDtoH(buf.data(), p + off, chunk));
      if (::pwrite(fd, buf.data(), chunk, pos) != static_cast<ssize_t>(chunk)) return io_failed("pwrite");
    }
  }
  if (::fsync(fd) != 0) return io_failed("fsync");
  const double save_s = seconds_since(t);
  // Restored from the disk, not from the page cache the writes left behind.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  for (CUdeviceptr p : mem) CHECK_CU(cuMemsetD32(p, 0, kPiece / 4));
  t = Clock::now();
  pos = 0;
  for (CUdeviceptr p : mem) {
    for (size_t off = 0; off < kPiece; off += chunk, pos += static_cast<off_t>(chunk)) {
      if (::pread(fd, buf.data(), chunk, pos) != static_cast<ssize_t>(chunk)) return io_failed("pread");
      CHECK_CU(cuMemcpyHtoD(p + off, buf.data(), chunk));
    }
  }
  const double restore_s = seconds_since(t);
  ::close(fd);
  bool intact = true;
  CHECK_CU(verify_pattern(mem, &intact));
  for (CUdeviceptr p : mem) cuMemFree(p);
  const double bytes = static_cast<double>(count * kPiece);
  return json{{"naive_save_gb_s", bytes / save_s / 1e9},
              {"naive_restore_gb_s", bytes / restore_s / 1e9},
              {"naive_intact", intact}};
}

// Runs inside a child process: the measurements that do not involve the disk, plus the pause and
// resume when the shim is present (the naive engine when it is not).
json measure(double gib, bool with_pause, const std::string& dir, int repeat) {
  json out;
  CUdevice dev;
  CUcontext ctx;
  CHECK_CU(cuInit(0));
  CHECK_CU(cuDeviceGet(&dev, 0));
  CHECK_CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK_CU(cuCtxSetCurrent(ctx));
  char name[128] = {};
  cuDeviceGetName(name, sizeof(name), dev);
  out["device"] = name;
  CUstream stream;
  CHECK_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));

  // Pinned copy bandwidth, both directions.
  const size_t copy_bytes = 512u << 20;
  void* host = nullptr;
  CUdeviceptr dbuf = 0;
  CHECK_CU(cuMemAllocHost(&host, copy_bytes));
  CHECK_CU(cuMemAlloc(&dbuf, copy_bytes));
  std::memset(host, 0x5A, copy_bytes);
  for (int dir = 0; dir < 2; ++dir) {
    CHECK_CU(dir ? cuMemcpyHtoDAsync(dbuf, host, copy_bytes, stream)
                 : cuMemcpyDtoHAsync(host, dbuf, copy_bytes, stream));
    CHECK_CU(cuStreamSynchronize(stream));
    const int reps = 8;
    auto t = Clock::now();
    for (int i = 0; i < reps; ++i)
      CHECK_CU(dir ? cuMemcpyHtoDAsync(dbuf, host, copy_bytes, stream)
                   : cuMemcpyDtoHAsync(host, dbuf, copy_bytes, stream));
    CHECK_CU(cuStreamSynchronize(stream));
    out[dir ? "h2d_gb_s" : "d2h_gb_s"] = static_cast<double>(copy_bytes) * reps / seconds_since(t) / 1e9;
  }
  CHECK_CU(cuMemFree(dbuf));
  CHECK_CU(cuMemFreeHost(host));

  // Allocation latency: a 64 MiB alloc+free pair (managed by the shim when present).
  {
    const int reps = 200;
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc(&p, 64u << 20));
    CHECK_CU(cuMemFree(p));
    auto t = Clock::now();
    for (int i = 0; i < reps; ++i) {
      CHECK_CU(cuMemAlloc(&p, 64u << 20));
      CHECK_CU(cuMemFree(p));
    }
    out["alloc_free_us"] = seconds_since(t) / reps * 1e6;
  }

  // Kernel launch rate (simcuda has no PTX JIT: reported as absent there).
  CUmodule mod;
  CUfunction fn;
  if (cuModuleLoadData(&mod, kNopPtx) == CUDA_SUCCESS && cuModuleGetFunction(&fn, mod, "tmsdisk_nop") == CUDA_SUCCESS) {
    const int reps = 100000;
    for (int i = 0; i < 1000; ++i) CHECK_CU(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr));
    CHECK_CU(cuStreamSynchronize(stream));
    auto t = Clock::now();
    for (int i = 0; i < reps; ++i) CHECK_CU(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, nullptr, nullptr));
    CHECK_CU(cuStreamSynchronize(stream));
    out["launches_per_s"] = reps / seconds_since(t);
  }

  if (gib <= 0) return out;
  if (!with_pause) {
    const json naive = measure_naive(static_cast<size_t>(gib), dir);  // named: items() does not keep it alive
    for (auto& [k, v] : naive.items()) out[k] = v;
    return out;
  }
  using Api = int (*)();
  auto pause = reinterpret_cast<Api>(dlsym(RTLD_DEFAULT, "tmsdisk_pause"));
  auto resume = reinterpret_cast<Api>(dlsym(RTLD_DEFAULT, "tmsdisk_resume"));
  if (!pause || !resume) return json{{"error", "tmsdisk_pause not found: is the shim preloaded?"}};

  const size_t count = static_cast<size_t>(gib);
  std::vector<CUdeviceptr> mem(count);
  CHECK_CU(fill_pattern(mem));
  const double bytes = static_cast<double>(count * kPiece);
  size_t free_before = 0, free_paused = 0, total = 0;
  bool intact = true;
  json passes = json::array();
  for (int r = 0; r < repeat && intact; ++r) {
    json pass;
    if (r > 0) CHECK_CU(fill_pattern(mem, r));
    auto raw = tmsdisk::bench::measure_raw_disk(dir, count * kPiece, 8u << 20, 32);
    if (!raw) return json{{"error", "raw disk: " + raw.error().describe()}};
    pass["raw_write_gb_s"] = raw->write_bytes_per_s / 1e9;
    pass["raw_read_gb_s"] = raw->read_bytes_per_s / 1e9;
    cuMemGetInfo(&free_before, &total);
    auto t = Clock::now();
    int rc = pause();
    pass["pause_gb_s"] = bytes / seconds_since(t) / 1e9;
    if (rc != 0) return json{{"error", "tmsdisk_pause returned " + std::to_string(rc)}};
    cuMemGetInfo(&free_paused, &total);
    t = Clock::now();
    rc = resume();
    pass["resume_gb_s"] = bytes / seconds_since(t) / 1e9;
    if (rc != 0) return json{{"error", "tmsdisk_resume returned " + std::to_string(rc)}};
    // Every word of every allocation must be back.
    CHECK_CU(verify_pattern(mem, &intact, r));
    // Each pass on stderr as it ends: a run cut short by a time limit still leaves what it measured.
    std::fprintf(stderr, "shim bench: pass %d of %d: %s\n", r + 1, repeat, pass.dump().c_str());
    std::fflush(stderr);
    passes.push_back(pass);
  }
  // What the user waits for when bytes need not move, on the same memory: a pause right
  // after the last one, nothing changed (frozen weights); then one of memory that is all zero but
  // its first 4 KiB per GiB (a preallocated pool barely used). Logical GB/s: bytes covered per
  // second of the wait.
  if (intact && repeat > 0) {
    auto t = Clock::now();
    if (pause() != 0) return json{{"error", "tmsdisk_pause (unchanged) failed"}};
    out["unchanged_pause_gb_s"] = bytes / seconds_since(t) / 1e9;
    if (resume() != 0) return json{{"error", "tmsdisk_resume (unchanged) failed"}};
    CHECK_CU(verify_pattern(mem, &intact, repeat - 1));
    // Part of it changed since the last pause (a LoRA run's adapters and optimizer state over a frozen
    // base): half of the pieces, then one piece (with 16 of them, 15/16 unchanged).
    std::vector<int> holds(count, repeat - 1);
    int pass = repeat;
    for (const auto& [key, changed] :
         {std::pair{"half_changed", count / 2}, std::pair{"one_piece_changed", size_t{1}}}) {
      if (changed == 0 || !intact) continue;
      for (size_t i = 0; i < changed; ++i) {
        CHECK_CU(cuMemsetD32(mem[i], word(i, pass), kPiece / 4));
        holds[i] = pass;
      }
      CHECK_CU(cuCtxSynchronize());
      t = Clock::now();
      if (pause() != 0) return json{{"error", std::string("tmsdisk_pause (") + key + ") failed"}};
      out[std::string(key) + "_pause_gb_s"] = bytes / seconds_since(t) / 1e9;
      out[std::string(key) + "_fraction"] = static_cast<double>(changed) / static_cast<double>(count);
      if (resume() != 0) return json{{"error", std::string("tmsdisk_resume (") + key + ") failed"}};
      CHECK_CU(verify_pieces(mem, &intact, holds));
      ++pass;
    }
    for (CUdeviceptr p : mem) {
      CHECK_CU(cuMemsetD32(p, 0, kPiece / 4));
      CHECK_CU(cuMemsetD32(p, 0xC0DEu, 4096 / 4));
    }
    CHECK_CU(cuCtxSynchronize());
    t = Clock::now();
    if (pause() != 0) return json{{"error", "tmsdisk_pause (mostly zero) failed"}};
    out["mostly_zero_pause_gb_s"] = bytes / seconds_since(t) / 1e9;
    t = Clock::now();
    if (resume() != 0) return json{{"error", "tmsdisk_resume (mostly zero) failed"}};
    out["mostly_zero_resume_gb_s"] = bytes / seconds_since(t) / 1e9;
    std::vector<uint32_t> head(4096 / 4), tail(4096 / 4);
    for (CUdeviceptr p : mem) {
      CHECK_CU(cuMemcpyDtoH(head.data(), p, 4096));
      CHECK_CU(cuMemcpyDtoH(tail.data(), p + kPiece - 4096, 4096));
      for (uint32_t w : head) intact &= w == 0xC0DEu;
      for (uint32_t w : tail) intact &= w == 0;
    }
  }
  for (CUdeviceptr p : mem) cuMemFree(p);
  auto best = [&](const char* key) {
    double b = 0;
    for (const auto& p : passes) b = std::max(b, p[key].get<double>());
    return b;
  };
  out["passes"] = passes;
  out["pause_gb_s"] = best("pause_gb_s");
  out["resume_gb_s"] = best("resume_gb_s");
  out["raw_write_gb_s"] = best("raw_write_gb_s");
  out["raw_read_gb_s"] = best("raw_read_gb_s");
  out["paused_bytes"] = count * kPiece;
  out["freed_by_pause_bytes"] = free_paused > free_before ? free_paused - free_before : 0;
  out["intact"] = intact;
  return out;
}

// Runs this program again as `--child` with or without the shim and returns its JSON.
json run_child(const std::string& self, double gib, const std::string& shim, const std::string& dir, int repeat) {
  int fds[2];
  if (::pipe(fds) != 0) return json{{"error", "pipe"}};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    if (shim.empty())
      ::unsetenv("LD_PRELOAD");
    else
      ::setenv("LD_PRELOAD", shim.c_str(), 1);
    std::string g = std::to_string(gib), n = std::to_string(repeat);
    const char* argv[] = {
        self.c_str(), "--child", shim.empty() ? "plain" : "shim", "--gib", g.c_str(), "--dir", dir.c_str(), "--repeat",
        n.c_str(),    nullptr};
    ::execv(self.c_str(), const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  json j = json::parse(out, nullptr, false);
  if (j.is_discarded()) return json{{"error", "child exited " + std::to_string(status) + " without a result"}};
  return j;
}

double ratio(const json& a, const json& b, const char* key) {
  return a.contains(key) && b.contains(key) && b[key].get<double>() > 0 ? a[key].get<double>() / b[key].get<double>()
                                                                        : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, shim, child;
  double gib = 4;
  bool as_json = false;
  int overhead_rounds = 3;
  int repeat = 1;
  CLI::App app{"tmsdisk-shim-bench: pause/resume GB/s beside the disk ceiling, and the shim's overhead"};
  app.add_option("--dir", dir, "the daemon's root directory (for the raw O_DIRECT ceiling)");
  app.add_option("--gib", gib, "GiB of device memory to pause and resume")->capture_default_str();
  app.add_option("--shim", shim, "libtmsdisk.so to preload (default: $TMSDISK_LIBRARY)");
  app.add_option("--child", child, "internal: run the measurements in this process")->group("");
  app.add_option("--overhead-rounds", overhead_rounds,
                 "alternating plain/shim children for the overhead figures (best kept)")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  app.add_option("--repeat", repeat, "pause/resume cycles, each right after a raw disk pass (best of each compared)")
      ->capture_default_str()
      ->check(CLI::Range(1, 20));
  app.add_flag("--json", as_json, "print JSON");
  CLI11_PARSE(app, argc, argv);

  if (!child.empty()) {
    std::printf("%s\n", measure(gib, child == "shim", dir, repeat).dump().c_str());
    return 0;
  }
  if (dir.empty()) {
    std::fprintf(stderr, "tmsdisk-shim-bench: --dir is required (the daemon's root)\n");
    return 2;
  }
  if (shim.empty() && std::getenv("TMSDISK_LIBRARY")) shim = std::getenv("TMSDISK_LIBRARY");
  if (shim.empty()) {
    std::fprintf(stderr, "tmsdisk-shim-bench: pass --shim PATH/libtmsdisk.so (or set TMSDISK_LIBRARY)\n");
    return 2;
  }
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 1;
  self[n] = '\0';

  auto raw = tmsdisk::bench::measure_raw_disk(dir, static_cast<uint64_t>(gib * (1ull << 30)), 8u << 20, 32);
  if (!raw) {
    std::fprintf(stderr, "raw disk: %s\n", raw.error().describe().c_str());
    return 1;
  }
  // Launch rate and allocation latency drift between processes by more than the shim's cost, so
  // the overhead children alternate (plain, shim, plain, ...) and each side keeps its best figures;
  // the pause/resume runs once, in the last shim child.
  json plain, shimmed;
  auto keep_best = [](json& best, const json& now) {
    if (best.contains("error")) return;  // the first failure is the one reported
    if (best.is_null() || now.contains("error")) {
      best = now;
      return;
    }
    for (const char* key : {"d2h_gb_s", "h2d_gb_s", "launches_per_s"})
      if (now.contains(key) && (!best.contains(key) || now[key].get<double>() > best[key].get<double>()))
        best[key] = now[key];
    if (now.contains("alloc_free_us") && now["alloc_free_us"].get<double>() < best["alloc_free_us"].get<double>())
      best["alloc_free_us"] = now["alloc_free_us"];
    for (auto it = now.begin(); it != now.end(); ++it)
      if (!best.contains(it.key())) best[it.key()] = it.value();
  };
  for (int round = 0; round < overhead_rounds; ++round) {
    keep_best(plain, run_child(self, round + 1 == overhead_rounds ? gib : 0, "", dir, repeat));
    keep_best(shimmed, run_child(self, round + 1 == overhead_rounds ? gib : 0, shim, dir, repeat));
  }
  // As in the session benchmark: the ceiling is the better of a raw pass before and one after.
  if (auto again = tmsdisk::bench::measure_raw_disk(dir, static_cast<uint64_t>(gib * (1ull << 30)), 8u << 20, 32)) {
    raw->write_bytes_per_s = std::max(raw->write_bytes_per_s, again->write_bytes_per_s);
    raw->read_bytes_per_s = std::max(raw->read_bytes_per_s, again->read_bytes_per_s);
  }
  // And the passes taken beside each pause/resume cycle.
  if (shimmed.contains("raw_write_gb_s")) {
    raw->write_bytes_per_s = std::max(raw->write_bytes_per_s, shimmed["raw_write_gb_s"].get<double>() * 1e9);
    raw->read_bytes_per_s = std::max(raw->read_bytes_per_s, shimmed["raw_read_gb_s"].get<double>() * 1e9);
  }
  json out = {{"raw",
               {{"write_gb_s", raw->write_bytes_per_s / 1e9},
                {"read_gb_s", raw->read_bytes_per_s / 1e9},
                {"direct_io", raw->direct_io},
                {"notes", raw->notes}}},
              {"without_shim", plain},
              {"with_shim", shimmed}};
  if (plain.contains("error") || shimmed.contains("error")) {
    std::fprintf(stderr, "%s\n", out.dump(2).c_str());
    return 1;
  }
  const double pw = shimmed["pause_gb_s"].get<double>(), rr = shimmed["resume_gb_s"].get<double>();
  out["ratios"] = {{"pause_over_raw_write", pw / (raw->write_bytes_per_s / 1e9)},
                   {"resume_over_raw_read", rr / (raw->read_bytes_per_s / 1e9)},
                   {"alloc_free_latency_shim_over_plain", ratio(shimmed, plain, "alloc_free_us")},
                   {"launch_rate_shim_over_plain", ratio(shimmed, plain, "launches_per_s")},
                   {"d2h_shim_over_plain", ratio(shimmed, plain, "d2h_gb_s")}};
  // Bytes that need not move: the same pause when nothing changed, and when the memory is mostly
  // zero, over the pause of memory that all changed.
  if (shimmed.contains("unchanged_pause_gb_s")) {
    out["ratios"]["unchanged_pause_over_pause"] = shimmed["unchanged_pause_gb_s"].get<double>() / pw;
    for (const char* key : {"half_changed", "one_piece_changed"})
      if (shimmed.contains(std::string(key) + "_pause_gb_s"))
        out["ratios"][std::string(key) + "_pause_over_pause"] =
            shimmed[std::string(key) + "_pause_gb_s"].get<double>() / pw;
    out["ratios"]["mostly_zero_pause_over_pause"] = shimmed["mostly_zero_pause_gb_s"].get<double>() / pw;
    out["ratios"]["mostly_zero_resume_over_resume"] = shimmed["mostly_zero_resume_gb_s"].get<double>() / rr;
  }
  if (plain.contains("naive_save_gb_s")) {
    out["ratios"]["pause_over_naive_save"] = pw / plain["naive_save_gb_s"].get<double>();
    out["ratios"]["resume_over_naive_restore"] = rr / plain["naive_restore_gb_s"].get<double>();
  }
  if (as_json) {
    std::printf("%s\n", out.dump(2).c_str());
    return shimmed["intact"].get<bool>() ? 0 : 1;
  }
  std::printf("device               %s\n", shimmed["device"].get<std::string>().c_str());
  std::printf("pause                %.3f GB/s  = %.3f x raw O_DIRECT write (%.3f GB/s) of %s\n", pw,
              out["ratios"]["pause_over_raw_write"].get<double>(), raw->write_bytes_per_s / 1e9, dir.c_str());
  std::printf("resume               %.3f GB/s  = %.3f x raw O_DIRECT read  (%.3f GB/s)\n", rr,
              out["ratios"]["resume_over_raw_read"].get<double>(), raw->read_bytes_per_s / 1e9);
  if (shimmed.contains("passes") && shimmed["passes"].size() > 1)
    for (const auto& p : shimmed["passes"])
      std::printf("  pass               raw write %.3f, pause %.3f; raw read %.3f, resume %.3f GB/s\n",
                  p["raw_write_gb_s"].get<double>(), p["pause_gb_s"].get<double>(), p["raw_read_gb_s"].get<double>(),
                  p["resume_gb_s"].get<double>());
  if (plain.contains("naive_save_gb_s"))
    std::printf("naive engine         save %.3f GB/s, restore %.3f GB/s (data %s): pause x%.2f, resume x%.2f\n",
                plain["naive_save_gb_s"].get<double>(), plain["naive_restore_gb_s"].get<double>(),
                plain["naive_intact"].get<bool>() ? "intact" : "CORRUPTED",
                out["ratios"]["pause_over_naive_save"].get<double>(),
                out["ratios"]["resume_over_naive_restore"].get<double>());
  if (shimmed.contains("unchanged_pause_gb_s")) {
    std::printf("unchanged pause      %.3f GB/s: x%.2f the pause above\n",
                shimmed["unchanged_pause_gb_s"].get<double>(),
                out["ratios"]["unchanged_pause_over_pause"].get<double>());
    for (const char* key : {"half_changed", "one_piece_changed"})
      if (shimmed.contains(std::string(key) + "_pause_gb_s"))
        std::printf("  %.0f%% changed       %.3f GB/s: x%.2f the pause above\n",
                    shimmed[std::string(key) + "_fraction"].get<double>() * 100,
                    shimmed[std::string(key) + "_pause_gb_s"].get<double>(),
                    out["ratios"][std::string(key) + "_pause_over_pause"].get<double>());
  }
  std::printf("pinned copies        D2H %.1f GB/s, H2D %.1f GB/s (without shim)\n", plain["d2h_gb_s"].get<double>(),
              plain["h2d_gb_s"].get<double>());
  std::printf("freed by the pause   %.2f GiB of %.2f GiB paused; data %s\n",
              shimmed["freed_by_pause_bytes"].get<double>() / (1ull << 30),
              shimmed["paused_bytes"].get<double>() / (1ull << 30),
              shimmed["intact"].get<bool>() ? "intact" : "CORRUPTED");
  std::printf("cuMemAlloc+Free 64M  %.1f us with shim, %.1f us without (x%.2f)\n",
              shimmed["alloc_free_us"].get<double>(), plain["alloc_free_us"].get<double>(),
              out["ratios"]["alloc_free_latency_shim_over_plain"].get<double>());
  if (plain.contains("launches_per_s"))
    std::printf("kernel launches      %.0f/s with shim, %.0f/s without (x%.3f)\n",
                shimmed["launches_per_s"].get<double>(), plain["launches_per_s"].get<double>(),
                out["ratios"]["launch_rate_shim_over_plain"].get<double>());
  else
    std::printf("kernel launches      not measured (no PTX JIT on this driver)\n");
  return shimmed["intact"].get<bool>() ? 0 : 1;
}
