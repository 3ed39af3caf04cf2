// SPDX-License-Identifier: Apache-2.0
// The shim's core over simcuda (libcuda.so.1 from the build tree) and a scripted in-process daemon:
// managed allocations, pause/resume round trips, and every failure path of the engine, checking
// the invariants (memory released only after all its chunks are acknowledged; failures leave
// unreleased allocations resident and intact; resume verifies before data is visible).
#include <dlfcn.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "driver.h"
#include "engine.h"
#include "gate.h"
#include "pause_callbacks.h"
#include "registry.h"
#include "shim.h"
#include "skip.h"
#include "tmsdisk/protocol/messages.h"
#include "tmsdisk/protocol/socket.h"

namespace proto = tmsdisk::proto;
using namespace tmsdisk::shim;
using tmsdisk::testing::eventually;

// Set by test_interposer_engine_main.cpp before the tests run.
extern std::string g_test_dir;

namespace {

constexpr uint32_t kSlotBytes = 1 << 20;
constexpr uint32_t kSlotCount = 4;

uint64_t checksum(const uint8_t* p, std::size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A daemon that keeps blobs in memory. It answers chunk requests in batches and in reverse order
// (replies may come out of order), checks the rules the real daemon enforces (slot not busy, chunk
// geometry, reservation), and fails on request.
class FakeDaemon {
 public:
  explicit FakeDaemon(std::string path) : path_(std::move(path)) {
    listen_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    ::unlink(path_.c_str());
    if (::bind(listen_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(listen_, 4) != 0)
      throw std::runtime_error("fake daemon cannot listen on " + path_);
    thread_ = std::thread([this] { run(); });
  }
  ~FakeDaemon() {
    stop_ = true;
    thread_.join();
    ::close(listen_);
  }

  // Knobs (set between operations).
  std::atomic<int> reserve_error{0};
  std::atomic<int> fail_write_at{-1};          // 0-based index of the WRITE to answer with EIO
  std::atomic<uint64_t> corrupt_blob{0};       // READs of this blob fail with EBADMSG
  std::atomic<bool> pause_on_ipc_open{false};  // an IPC_OPEN is answered after a pause COMMAND, with ENOENT
  std::atomic<int> resume_commit_error{0};     // the next COMMIT(resumed) fails with this (manifest not written)
  std::atomic<uint64_t> tier_grant_bytes{0};   // host-tier memory a TIER_ASK gets, at most (0: none)
  // The next TIER_ASK is told to reuse memory the rank kept (kTierReuse, no memory rides along), as a
  // daemon that still counts memory the rank let go of while it was disconnected would.
  std::atomic<bool> tier_say_reuse{false};
  std::atomic<bool> welcome_adopted{false};  // the next HELLO is answered as a session this daemon kept
  // The blob of the next WRITE is one the disk is slow to take: its WRITEs are answered only once
  // every other blob is written, or after 5 s (then hold_gave_up counts it: the shim sent nothing else).
  std::atomic<bool> hold_first_written_blob{false};
  std::atomic<int> hold_gave_up{0};

  std::atomic<int> writes{0};
  std::atomic<int> commits_paused{0};
  std::atomic<int> commits_resumed{0};
  std::atomic<int> progress_messages{0};
  std::atomic<int> reports{0};
  std::atomic<int> zero_runs{0};    // runs of zero chunks reserved
  std::atomic<int> host_chunks{0};  // chunks reserved as kept in the host tier
  std::atomic<int> carried{0};      // blobs a reservation kept as stored (Reserve.carry)
  std::atomic<int> tier_asks{0};
  std::atomic<int> tier_releases{0};
  std::atomic<int> violations{0};
  std::atomic<int> reads{0};               // READs answered (each one verified here against the sealed checksum)
  std::atomic<int> written_while_held{0};  // WRITEs answered while a held blob's WRITEs waited

  // The WRITEs received since the last call, in the order they came: (blob, offset).
  std::vector<std::pair<uint64_t, uint64_t>> take_write_order() {
    std::lock_guard lock(mu_);
    return std::exchange(write_order_, {});
  }

  // Ends the connection as a daemon that dropped it would (the loop below sees it end and closes it);
  // the shim reconnects.
  void drop_connection() {
    std::lock_guard lock(mu_);
    if (conn_ >= 0) ::shutdown(conn_, SHUT_RDWR);
  }

  // Waits (up to 30 s) until `n` TIER_RELEASEs came; false if they did not.
  bool await_tier_releases(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return tier_releases.load() >= n; });
  }

  // Chunks written for `blob` and the data, once complete.
  bool blob_complete(uint64_t blob, std::vector<uint8_t>* data) {
    std::lock_guard lock(mu_);
    auto it = blobs_.find(blob);
    if (it == blobs_.end()) return false;
    const Blob& b = it->second;
    for (bool w : b.written)
      if (!w) return false;
    if (data) *data = b.data;
    return true;
  }

  // Sends Command{op} to the shim and waits for CommandDone.
  proto::CommandDone command(proto::CommandOp op) {
    uint64_t id;
    {
      std::lock_guard lock(mu_);
      id = command_locked(op);
    }
    return command_done(id);
  }
  // The CommandDone of the last command sent (waits for it).
  proto::CommandDone last_command_done() { return command_done(pending_command_); }
  proto::CommandDone command_done(uint64_t id) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(60), [&] { return done_.count(id) > 0; });
    auto it = done_.find(id);
    if (it == done_.end()) {
      proto::CommandDone timeout;
      timeout.code = ETIMEDOUT;
      return timeout;
    }
    return it->second;
  }
  int progress_for_last_command() const { return command_progress_.load(); }

 private:
  struct Blob {
    uint64_t size = 0;
    std::vector<uint8_t> data;
    std::vector<bool> written;
    std::vector<bool> zero;  // reserved as zero: written and read never
    std::vector<uint64_t> sums;
  };
  struct Pending {
    uint64_t id;
    bool write;
    proto::ChunkRef ref;
  };

  uint64_t command_locked(proto::CommandOp op) {
    const uint64_t id = 1000000 + ++commands_sent_;
    proto::Command c;
    c.op = static_cast<uint8_t>(op);
    pending_command_ = id;
    send_locked(id, c);
    return id;
  }

  void send_locked(uint64_t id, const proto::Message& m, int fd = -1) {
    auto bytes = proto::encode(id, m);
    if (conn_ >= 0) proto::send_message(conn_, bytes, fd);
  }
  void error_locked(uint64_t id, int code, const std::string& msg) {
    proto::ErrorReply e;
    e.code = code;
    e.message = msg;
    send_locked(id, e);
  }

  void run() {
    std::vector<uint8_t> buf;
    while (!stop_) {
      pollfd fds[2] = {{listen_, POLLIN, 0}, {conn_, POLLIN, 0}};
      const int n = ::poll(fds, conn_ >= 0 ? 2 : 1, pending_.empty() ? 50 : 0);
      if (n > 0 && (fds[0].revents & POLLIN)) {
        int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        std::lock_guard lock(mu_);
        if (conn_ >= 0) ::close(conn_);
        conn_ = c;
        continue;
      }
      if (n > 0 && conn_ >= 0 && fds[1].revents) {
        const long got = proto::recv_message(conn_, buf);
        std::lock_guard lock(mu_);
        if (got <= 0) {
          ::close(conn_);
          conn_ = -1;
          continue;
        }
        auto d = proto::decode(buf);
        if (!d.envelope) {
          ++violations;
          continue;
        }
        handle_locked(*d.envelope);
        if (pending_.size() < 3) continue;  // let a batch build up
      }
      std::lock_guard lock(mu_);
      answer_pending_locked();
    }
  }

  void handle_locked(proto::Envelope& env) {
    const uint64_t id = env.request_id;
    std::visit(
        [&](auto& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, proto::Hello>) {
            int fd = ::memfd_create("fake-staging", MFD_CLOEXEC);
            ::ftruncate(fd, uint64_t{kSlotBytes} * kSlotCount);
            staging_ = static_cast<uint8_t*>(
                ::mmap(nullptr, uint64_t{kSlotBytes} * kSlotCount, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
            busy_.assign(kSlotCount, false);
            proto::Welcome w;
            w.session_id = 7;
            w.token = 42;
            w.staging_budget_bytes = uint64_t{kSlotBytes} * kSlotCount;
            w.chunk_bytes = kSlotBytes;
            w.slot_count = kSlotCount;
            w.rank_dir = "/fake";
            w.adopted = welcome_adopted.exchange(false) ? 1 : 0;
            send_locked(id, w, fd);
            ::close(fd);
          } else if constexpr (std::is_same_v<T, proto::Reserve>) {
            if (!pending_.empty()) ++violations;
            if (m.flags & proto::kReserveFirst) {
              reserve_set_.clear();
              zero_runs_.clear();
              host_runs_.clear();
              carry_.clear();
            }
            reserve_set_.insert(reserve_set_.end(), m.blobs.begin(), m.blobs.end());
            zero_runs_.insert(zero_runs_.end(), m.zero_runs.begin(), m.zero_runs.end());
            host_runs_.insert(host_runs_.end(), m.host_runs.begin(), m.host_runs.end());
            carry_.insert(carry_.end(), m.carry.begin(), m.carry.end());
            if (!(m.flags & proto::kReserveLast)) return send_locked(id, proto::OkReply{});
            if (int e = reserve_error.load()) return error_locked(id, e, "no space left (test)");
            if (paused_ && carry_.empty()) return error_locked(id, EBUSY, "a committed pause holds the only copy");
            std::map<uint64_t, Blob> next;
            // Carried blobs stay as stored: every chunk of them written in the set before.
            for (uint64_t c : carry_) {
              auto old = blobs_.find(c);
              if (old == blobs_.end() || std::find(old->second.written.begin(), old->second.written.end(), false) !=
                                             old->second.written.end()) {
                ++violations;
                return error_locked(id, EINVAL, "carried blob not stored whole");
              }
              next.emplace(c, old->second);
              ++carried;
            }
            for (const auto& b : reserve_set_) {
              if (next.count(b.id)) continue;
              Blob nb;
              nb.size = b.size;
              nb.data.assign(b.size, 0);
              const uint64_t chunks = (b.size + kSlotBytes - 1) / kSlotBytes;
              nb.written.assign(chunks, false);
              nb.zero.assign(chunks, false);
              nb.sums.assign(chunks, 0);
              next.emplace(b.id, std::move(nb));
            }
            // Zero chunks are recorded with the reservation: never written nor read.
            for (const auto& z : zero_runs_) {
              auto b = next.find(z.blob);
              if (b == next.end() || z.first_chunk + z.count > b->second.written.size()) {
                ++violations;
                return error_locked(id, EINVAL, "bad zero run");
              }
              for (uint64_t c = z.first_chunk; c < z.first_chunk + z.count; ++c) {
                b->second.written[c] = true;
                b->second.zero[c] = true;
              }
              ++zero_runs;
            }
            // So are host-tier chunks: the rank keeps them.
            for (const auto& z : host_runs_) {
              auto b = next.find(z.blob);
              if (b == next.end() || z.first_chunk + z.count > b->second.written.size()) {
                ++violations;
                return error_locked(id, EINVAL, "bad host run");
              }
              for (uint64_t c = z.first_chunk; c < z.first_chunk + z.count; ++c) {
                b->second.written[c] = true;
                b->second.zero[c] = true;  // nothing stored: a WRITE or READ of it is a violation
                ++host_chunks;
              }
            }
            blobs_ = std::move(next);
            paused_ = false;  // the set being written took the committed pause's place
            send_locked(id, proto::OkReply{});
          } else if constexpr (std::is_same_v<T, proto::Write> || std::is_same_v<T, proto::Read>) {
            constexpr bool is_write = std::is_same_v<T, proto::Write>;
            auto it = blobs_.find(m.blob);
            if (m.slot >= kSlotCount || busy_[m.slot] || it == blobs_.end() || m.offset % kSlotBytes != 0 ||
                m.offset >= it->second.size || m.length != std::min<uint64_t>(kSlotBytes, it->second.size - m.offset)) {
              ++violations;
              return error_locked(id, EINVAL, "bad chunk");
            }
            if (it->second.zero[m.offset / kSlotBytes]) {
              ++violations;
              return error_locked(id, EINVAL, "chunk reserved as zero");
            }
            busy_[m.slot] = true;
            pending_.push_back(Pending{id, is_write, m});
            if (is_write) {
              write_order_.emplace_back(m.blob, m.offset);
              if (hold_first_written_blob.exchange(false)) {
                held_blob_ = m.blob;
                hold_until_ = std::chrono::steady_clock::now() + std::chrono::seconds(5);
              }
            }
          } else if constexpr (std::is_same_v<T, proto::TierAsk>) {
            ++tier_asks;
            if (tier_say_reuse.exchange(false))
              return send_locked(id, proto::TierGrant{.bytes = m.bytes, .note = {}, .flags = proto::kTierReuse});
            const uint64_t bytes = std::min<uint64_t>(tier_grant_bytes.load(), m.bytes) / kSlotBytes * kSlotBytes;
            if (bytes == 0) return send_locked(id, proto::TierGrant{.bytes = 0, .note = "no host tier (test)"});
            int fd = ::memfd_create("fake-host-tier", MFD_CLOEXEC);
            if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) ++violations;
            send_locked(id, proto::TierGrant{.bytes = bytes, .note = {}}, fd);
            ::close(fd);
          } else if constexpr (std::is_same_v<T, proto::TierRelease>) {
            ++tier_releases;
            send_locked(id, proto::OkReply{});
            cv_.notify_all();
          } else if constexpr (std::is_same_v<T, proto::PauseState>) {
            send_locked(id, proto::PauseStateReply{.paused = static_cast<uint8_t>(paused_ ? 1 : 0), .generation = 0});
          } else if constexpr (std::is_same_v<T, proto::Commit>) {
            if (!pending_.empty()) ++violations;
            if (m.state == static_cast<uint8_t>(proto::CommitState::Resumed))
              if (int e = resume_commit_error.exchange(0))
                return error_locked(id, e, "cannot write the manifest (test)");
            if (m.state == static_cast<uint8_t>(proto::CommitState::Paused)) {
              for (auto& [bid, b] : blobs_)
                for (bool w : b.written)
                  if (!w) return error_locked(id, EINVAL, "chunks missing");
              paused_ = true;
              ++commits_paused;
            } else {
              paused_ = false;
              ++commits_resumed;
            }
            send_locked(id, proto::OkReply{});
          } else if constexpr (std::is_same_v<T, proto::Report>) {
            ++reports;
          } else if constexpr (std::is_same_v<T, proto::Progress>) {
            if (id == pending_command_) ++command_progress_;
            ++progress_messages;
          } else if constexpr (std::is_same_v<T, proto::CommandDone>) {
            done_[id] = m;
            cv_.notify_all();
          } else if constexpr (std::is_same_v<T, proto::IpcOpen>) {
            // What a busy daemon may do: route a tmsctl pause to the rank before answering it.
            if (pause_on_ipc_open.exchange(false)) command_locked(proto::CommandOp::Pause);
            error_locked(id, ENOENT, "no such export (test)");
          } else {
            ++violations;
          }
        },
        env.body);
  }

  // Whether the held blob's WRITEs still wait: another blob has a chunk to write.
  bool holding_locked() {
    if (held_blob_ == 0) return false;
    bool others_left = false;
    for (const auto& [id, b] : blobs_) {
      if (id == held_blob_) continue;
      for (std::size_t c = 0; c < b.written.size(); ++c) others_left |= !b.written[c] && !b.zero[c];
    }
    if (others_left && std::chrono::steady_clock::now() < hold_until_) return true;
    if (others_left) ++hold_gave_up;
    held_blob_ = 0;
    return false;
  }

  void answer_pending_locked() {
    // Newest first: the shim must match answers by request id, not by order.
    std::vector<Pending> held;
    while (!pending_.empty()) {
      Pending p = pending_.back();
      pending_.pop_back();
      if (p.write && p.ref.blob == held_blob_ && holding_locked()) {
        held.push_back(p);
        continue;
      }
      if (p.write && held_blob_ != 0) ++written_while_held;
      busy_[p.ref.slot] = false;
      Blob& b = blobs_[p.ref.blob];
      const uint64_t chunk = p.ref.offset / kSlotBytes;
      uint8_t* slot = staging_ + uint64_t{p.ref.slot} * kSlotBytes;
      if (p.write) {
        if (writes++ == fail_write_at.load()) {
          error_locked(p.id, EIO, "write failed (test)");
          continue;
        }
        std::memcpy(b.data.data() + p.ref.offset, slot, p.ref.length);
        b.written[chunk] = true;
        b.sums[chunk] = checksum(slot, p.ref.length);
        send_locked(p.id, proto::Written{});
      } else {
        if (!b.written[chunk]) {
          error_locked(p.id, ENODATA, "never written");
          continue;
        }
        ++reads;
        std::memcpy(slot, b.data.data() + p.ref.offset, p.ref.length);
        if (p.ref.blob == corrupt_blob.load()) slot[0] ^= 0xff;
        if (checksum(slot, p.ref.length) != b.sums[chunk]) {
          error_locked(p.id, EBADMSG, "checksum mismatch (test)");
          continue;
        }
        send_locked(p.id, proto::ReadDone{});
      }
    }
    pending_.assign(held.rbegin(), held.rend());
  }

  std::string path_;
  int listen_ = -1;
  int conn_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint8_t* staging_ = nullptr;
  std::vector<bool> busy_;
  std::vector<Pending> pending_;
  std::vector<proto::BlobSize> reserve_set_;
  std::vector<proto::ChunkRun> zero_runs_;
  std::vector<proto::ChunkRun> host_runs_;
  std::vector<uint64_t> carry_;
  std::map<uint64_t, Blob> blobs_;
  std::vector<std::pair<uint64_t, uint64_t>> write_order_;
  uint64_t held_blob_ = 0;  // hold_first_written_blob: the blob whose WRITEs wait
  std::chrono::steady_clock::time_point hold_until_;
  bool paused_ = false;
  uint64_t commands_sent_ = 0;
  uint64_t pending_command_ = 0;
  std::atomic<int> command_progress_{0};
  std::map<uint64_t, proto::CommandDone> done_;
};

// The simulated driver, called directly (not through the hooks) to set up contexts and move bytes.
struct Sim {
  void* lib = nullptr;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*cuMemcpyDtoH_v2)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemAlloc_v2)(CUdeviceptr*, size_t) = nullptr;  // native: another user of the device
  CUresult (*cuMemFree_v2)(CUdeviceptr) = nullptr;
  int (*is_mapped)(unsigned long long, size_t) = nullptr;
  uint64_t (*used_bytes)(int) = nullptr;
  uint64_t (*capacity_bytes)(int) = nullptr;
  CUcontext ctx = nullptr;

  Sim() {
    lib = ::dlopen("libcuda.so.1", RTLD_NOW);
    REQUIRE(lib);
#define LOAD(name) name = reinterpret_cast<decltype(name)>(::dlsym(lib, #name))
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxSetCurrent);
    LOAD(cuMemcpyHtoD_v2);
    LOAD(cuMemcpyDtoH_v2);
    LOAD(cuMemAlloc_v2);
    LOAD(cuMemFree_v2);
#undef LOAD
    is_mapped = reinterpret_cast<decltype(is_mapped)>(::dlsym(lib, "simcuda_is_mapped"));
    used_bytes = reinterpret_cast<decltype(used_bytes)>(::dlsym(lib, "simcuda_used_bytes"));
    capacity_bytes = reinterpret_cast<decltype(capacity_bytes)>(::dlsym(lib, "simcuda_capacity_bytes"));
    REQUIRE(is_mapped);
    REQUIRE(used_bytes);
    REQUIRE(capacity_bytes);
    REQUIRE(cuInit(0) == CUDA_SUCCESS);
    CUdevice dev;
    REQUIRE(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    REQUIRE(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
  }
  void make_current() {
    REQUIRE(cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
  }
};

struct World {
  FakeDaemon daemon{g_test_dir + "/d.sock"};
  Sim sim;
};

World& world() {
  static World* w = new World;  // lives until exit: the shim's control thread talks to it
  w->sim.make_current();
  return *w;
}

// A managed allocation with a known pattern.
struct Buffer {
  CUdeviceptr ptr = 0;
  std::size_t size = 0;
  uint8_t seed = 0;

  Buffer(std::size_t n, uint8_t s) : size(n), seed(s) {
    REQUIRE(hook::cuMemAlloc_v2(&ptr, n) == CUDA_SUCCESS);
    std::vector<uint8_t> data = expected();
    REQUIRE(world().sim.cuMemcpyHtoD_v2(ptr, data.data(), n) == CUDA_SUCCESS);
  }
  std::vector<uint8_t> expected() const {
    std::vector<uint8_t> d(size);
    for (std::size_t i = 0; i < size; ++i) d[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 20));
    return d;
  }
  bool mapped() const { return world().sim.is_mapped(ptr, size) == 1; }
  bool intact() const {
    std::vector<uint8_t> d(size);
    if (world().sim.cuMemcpyDtoH_v2(d.data(), ptr, size) != CUDA_SUCCESS) return false;
    return d == expected();
  }
  uint64_t id() const { return registry().find(ptr)->id; }
  void free() {
    REQUIRE(hook::cuMemFree_v2(ptr) == CUDA_SUCCESS);
    ptr = 0;
  }
};

// Resumes, then every buffer must be intact and the daemon must have seen no violation; frees them.
void resume_check_free(World& w, std::initializer_list<Buffer*> buffers) {
  REQUIRE(api_resume() == 0);
  for (Buffer* b : buffers) CHECK(b->intact());
  CHECK(w.daemon.violations.load() == 0);
  for (Buffer* b : buffers) b->free();
}

struct tmsdisk_status status() {
  struct tmsdisk_status st {};
  REQUIRE(api_status(&st, sizeof(st)) == 0);
  return st;
}

// The wall clock in milliseconds, as the rank's report stamps its last change (CLOCK_REALTIME).
uint64_t unix_ms_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000ull + static_cast<uint64_t>(ts.tv_nsec) / 1000000ull;
}

std::string hex(CUdeviceptr p) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%#llx", static_cast<unsigned long long>(p));
  return buf;
}

}  // namespace

TEST_CASE("allocations: VMM-backed at the threshold, native below it") {
  world();
  const auto before = registry().totals();
  CUdeviceptr big = 0, small = 0, pitched = 0;
  REQUIRE(hook::cuMemAlloc_v2(&big, 3 << 20) == CUDA_SUCCESS);
  REQUIRE(hook::cuMemAlloc_v2(&small, 100) == CUDA_SUCCESS);
  std::size_t pitch = 0;
  REQUIRE(hook::cuMemAllocPitch_v2(&pitched, &pitch, 1000, 2000, 4) == CUDA_SUCCESS);
  CHECK(pitch == 1024);
  auto a = registry().find(big + 12345);
  REQUIRE(a);
  CHECK(a->base == big);
  CHECK(a->size == (3u << 20));
  CHECK(a->mapped % (2u << 20) == 0);
  CHECK(a->access.size() == 1);
  CHECK(registry().find(pitched));
  CHECK_FALSE(registry().find(small));
  auto t = registry().totals();
  CHECK(t.managed_allocations == before.managed_allocations + 2);
  CHECK(t.unmanaged_bytes[0] == before.unmanaged_bytes[0] + 100);
  CHECK(hook::cuMemFree_v2(big + 1) == CUDA_ERROR_INVALID_VALUE);  // not an allocation's start
  CHECK(hook::cuMemFree_v2(big) == CUDA_SUCCESS);
  CHECK(hook::cuMemFree_v2(small) == CUDA_SUCCESS);
  CHECK(hook::cuMemFree_v2(pitched) == CUDA_SUCCESS);
  CHECK_FALSE(world().sim.is_mapped(big, 3 << 20));
  t = registry().totals();
  CHECK(t.managed_allocations == before.managed_allocations);
  CHECK(t.unmanaged_bytes[0] == before.unmanaged_bytes[0]);
}

TEST_CASE("the cuGetProcAddress and dlsym replacements hand out hooks for libcuda's functions") {
  World& w = world();
  void* fn = nullptr;
  CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  REQUIRE(hook::cuGetProcAddress_v2("cuMemAlloc", &fn, 12000, 0, &st) == CUDA_SUCCESS);
  CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuMemAlloc_v2));
  REQUIRE(hook::cuGetProcAddress_v2("cuMemFree", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, nullptr) ==
          CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuMemFree_v2));
  REQUIRE(hook::cuGetProcAddress_v2("cuGetProcAddress", &fn, 12000, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuGetProcAddress_v2));
  // Not hooked: the driver's own function comes back untouched.
  REQUIRE(hook::cuGetProcAddress_v2("cuStreamSynchronize", &fn, 12000, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == ::dlsym(w.sim.lib, "cuStreamSynchronize"));
  // Gated: copies and launches, with their per-thread twins.
  REQUIRE(hook::cuGetProcAddress_v2("cuMemcpyHtoD", &fn, 12000, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuMemcpyHtoD_v2));
  REQUIRE(hook::cuGetProcAddress_v2("cuMemcpyHtoD", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                                    nullptr) == CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuMemcpyHtoD_v2_ptds));
  REQUIRE(hook::cuGetProcAddress_v2("cuLaunchKernel", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                                    nullptr) == CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuLaunchKernel_ptsz));
  REQUIRE(hook::cuGetProcAddress("cuMemAlloc", &fn, 11080, 0) == CUDA_SUCCESS);
  CHECK(fn == reinterpret_cast<void*>(&hook::cuMemAlloc_v2));

  CHECK(dlsym_hook(w.sim.lib, "cuMemAlloc_v2", nullptr) == reinterpret_cast<void*>(&hook::cuMemAlloc_v2));
  CHECK(dlsym_hook(w.sim.lib, "cuGetProcAddress", nullptr) == reinterpret_cast<void*>(&hook::cuGetProcAddress));
  CHECK(dlsym_hook(w.sim.lib, "cuMemAlloc", nullptr) == ::dlsym(w.sim.lib, "cuMemAlloc"));
  CHECK(dlsym_hook(w.sim.lib, "cuGetExportTable", nullptr) == ::dlsym(w.sim.lib, "cuGetExportTable"));
}

TEST_CASE("pause and resume round trip, bit-exact, addresses unchanged") {
  World& w = world();
  Buffer a(5 * kSlotBytes + 123, 1), b(kSlotBytes, 2), c(8 * kSlotBytes, 3);
  const int commits = w.daemon.commits_paused.load();
  REQUIRE(api_pause() == 0);
  CHECK(w.daemon.commits_paused.load() == commits + 1);
  for (const Buffer* buf : {&a, &b, &c}) {
    CHECK_FALSE(buf->mapped());
    std::vector<uint8_t> saved;
    REQUIRE(w.daemon.blob_complete(buf->id(), &saved));
    CHECK(saved == buf->expected());
  }
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_PAUSED);
  CHECK(st.connected == 1);
  CHECK(st.paused_bytes == a.size + b.size + c.size);
  CHECK(st.last_pause_bytes == a.size + b.size + c.size);
  CHECK(api_pause() == 0);  // already paused: nothing to do

  const int reads_before = w.daemon.reads.load();
  REQUIRE(api_resume() == 0);
  for (const Buffer* buf : {&a, &b, &c}) {
    CHECK(buf->mapped());
    CHECK(buf->intact());
  }
  CHECK(w.daemon.reads.load() - reads_before == 6 + 1 + 8);  // every chunk read back once, verified by the daemon
  st = status();
  CHECK(st.state == TMSDISK_STATE_RUNNING);
  CHECK(st.paused_bytes == 0);
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
  c.free();
}

TEST_CASE("a pause's chunks go in lanes: one allocation waiting on the disk does not hold up the others") {
  // Four slots make two lanes. Where the first allocation's WRITEs wait (changed chunks the daemon
  // must write while the rest is unchanged and only hashed), the second allocation's chunks go on in
  // the other lane instead of waiting behind them for free slots.
  World& w = world();
  Buffer a(4 * kSlotBytes, 50), b(4 * kSlotBytes, 51);
  (void)w.daemon.take_write_order();
  const int gave_up = w.daemon.hold_gave_up.load(), while_held = w.daemon.written_while_held.load();
  w.daemon.hold_first_written_blob = true;
  struct Unhold {  // a pause that sends no WRITE must not leave the next test's first blob held
    World& w;
    ~Unhold() { w.daemon.hold_first_written_blob = false; }
  } unhold{w};
  REQUIRE(api_pause() == 0);
  CHECK(w.daemon.hold_gave_up.load() == gave_up);
  CHECK(w.daemon.written_while_held.load() - while_held == 4);  // the other allocation, whole
  // Every chunk written once.
  auto order = w.daemon.take_write_order();
  std::sort(order.begin(), order.end());
  CHECK(std::adjacent_find(order.begin(), order.end()) == order.end());
  CHECK(order.size() == 8);
  resume_check_free(w, {&a, &b});
}

TEST_CASE("a lane boundary inside one allocation: both halves go side by side") {
  // Four slots, two lanes over one allocation of eight chunks: the first slots go to chunks 0, 4, 1,
  // 5 (the lane holding the fewest, the first on a tie), so chunk 4 is sent before chunk 3 (which
  // needs two of the first slots back, and chunk 4's copy is done before either is). WRITEs go out as
  // their copies are collected, not always in the order the chunks started.
  World& w = world();
  Buffer a(8 * kSlotBytes, 52);
  (void)w.daemon.take_write_order();
  REQUIRE(api_pause() == 0);
  const auto order = w.daemon.take_write_order();
  REQUIRE(order.size() == 8);
  std::vector<uint64_t> chunks;
  for (const auto& [blob, offset] : order) {
    CHECK(blob == a.id());
    chunks.push_back(offset / kSlotBytes);
  }
  CHECK(std::find(chunks.begin(), chunks.end(), 4) < std::find(chunks.begin(), chunks.end(), 3));
  std::sort(chunks.begin(), chunks.end());
  CHECK(chunks == std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7});  // each once
  resume_check_free(w, {&a});
}

TEST_CASE("zero chunks are reserved as zero, never written nor read, and come back as zeros") {
  World& w = world();
  Buffer a(4 * kSlotBytes + 100, 7);
  // Chunks 1 and 2 all zero; the tail chunk (100 bytes) zero but its last byte.
  std::vector<uint8_t> want = a.expected();
  std::fill(want.begin() + kSlotBytes, want.begin() + 3 * kSlotBytes, 0);
  std::fill(want.begin() + 4 * kSlotBytes, want.end() - 1, 0);
  REQUIRE(w.sim.cuMemcpyHtoD_v2(a.ptr, want.data(), want.size()) == CUDA_SUCCESS);
  const int writes = w.daemon.writes.load(), runs = w.daemon.zero_runs.load();
  REQUIRE(api_pause() == 0);
  CHECK_FALSE(a.mapped());
  CHECK(w.daemon.writes.load() - writes == 3);  // chunks 0, 3 and the tail
  CHECK(w.daemon.zero_runs.load() - runs == 1);
  auto st = status();
  CHECK(st.last_pause_bytes == a.size);
  const int reads = w.daemon.reads.load();
  REQUIRE(api_resume() == 0);
  CHECK(w.daemon.reads.load() - reads == 3);
  std::vector<uint8_t> got(a.size);
  REQUIRE(w.sim.cuMemcpyDtoH_v2(got.data(), a.ptr, got.size()) == CUDA_SUCCESS);
  CHECK(got == want);
  CHECK(w.daemon.violations.load() == 0);
  a.free();
}

TEST_CASE("the host tier the daemon grants takes the first chunks by DMA; the rest goes to disk") {
  World& w = world();
  Buffer a(4 * kSlotBytes + 100, 9), b(2 * kSlotBytes, 10);
  w.daemon.tier_grant_bytes = 3 * kSlotBytes;
  const int writes = w.daemon.writes.load(), host = w.daemon.host_chunks.load();
  const int asks = w.daemon.tier_asks.load(), releases = w.daemon.tier_releases.load();
  REQUIRE(api_pause() == 0);
  w.daemon.tier_grant_bytes = 0;
  CHECK_FALSE(a.mapped());
  CHECK_FALSE(b.mapped());
  CHECK(w.daemon.tier_asks.load() - asks == 1);
  // The first three of the seven chunks (in the order the allocations are paused) in the host
  // tier, the other four on disk.
  CHECK(w.daemon.host_chunks.load() - host == 3);
  CHECK(w.daemon.writes.load() - writes == 4);
  CHECK(w.daemon.tier_releases.load() == releases);  // kept while it holds paused chunks
  const int reads = w.daemon.reads.load();
  REQUIRE(api_resume() == 0);
  CHECK(w.daemon.reads.load() - reads == 4);
  CHECK(a.intact());
  CHECK(b.intact());
  // Given back once nothing is kept there, after the answer (nobody waits for the unpinning).
  CHECK(w.daemon.await_tier_releases(releases + 1));
  CHECK(w.daemon.tier_releases.load() == releases + 1);
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
}

TEST_CASE("told to reuse host-tier memory it does not hold, a rank gives the daemon's count back and pauses to disk") {
  // The daemon counts memory against the node's budget that nobody holds until the rank says so.
  World& w = world();
  Buffer a(2 * kSlotBytes, 12);
  w.daemon.tier_grant_bytes = 2 * kSlotBytes;
  w.daemon.tier_say_reuse = true;
  const int writes = w.daemon.writes.load(), host = w.daemon.host_chunks.load();
  const int asks = w.daemon.tier_asks.load(), releases = w.daemon.tier_releases.load();
  REQUIRE(api_pause() == 0);
  w.daemon.tier_grant_bytes = 0;
  CHECK(w.daemon.tier_asks.load() - asks == 1);
  CHECK(w.daemon.tier_releases.load() - releases == 1);
  CHECK(w.daemon.host_chunks.load() - host == 0);
  CHECK(w.daemon.writes.load() - writes == 2);
  REQUIRE(api_resume() == 0);
  CHECK(a.intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
}

TEST_CASE("a rank that reconnects to a daemon that kept its session says at once that it holds no host-tier memory") {
  // The daemon may still count memory the rank let go of while it was disconnected: the rank's
  // TIER_RELEASE ends that count before another rank's pause is refused memory nobody holds.
  World& w = world();
  Buffer a(2 * kSlotBytes, 13);
  REQUIRE(api_pause() == 0);  // connected (the session starts at the first call that needs it)
  REQUIRE(api_resume() == 0);
  const int releases = w.daemon.tier_releases.load();
  w.daemon.welcome_adopted = true;
  w.daemon.drop_connection();
  CHECK(w.daemon.await_tier_releases(releases + 1));
  // The new connection serves a pause and a resume as before.
  REQUIRE(api_pause() == 0);
  REQUIRE(api_resume() == 0);
  CHECK(a.intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
}

TEST_CASE("a pause of a paused rank and a resume of a running one are no-ops that keep the last figures") {
  // A no-op once answered like a pause of 0 bytes and overwrote the rank's last pause (or resume)
  // with zeros: `tmsctl status` lost the figures of the operation that ran.
  World& w = world();
  Buffer a(3 * kSlotBytes + 17, 18), b(kSlotBytes, 19);
  Engine* e = Engine::instance();
  REQUIRE(e);
  const auto noop = static_cast<uint8_t>(proto::Outcome::NoOp);
  const auto done = static_cast<uint8_t>(proto::Outcome::Done);

  const proto::CommandDone paused = w.daemon.command(proto::CommandOp::Pause);
  INFO(paused.message);
  REQUIRE(paused.code == 0);
  CHECK(paused.outcome == done);
  CHECK(paused.bytes == a.size + b.size);
  const proto::RankStats after_pause = e->status().stats;
  CHECK(after_pause.last_pause_bytes == a.size + b.size);
  CHECK(after_pause.last_pause_ns > 0);
  CHECK(after_pause.last_change_unix_ms > 0);

  // A no-op that moved the time of the last change would show it once the clock has moved on.
  REQUIRE(eventually([&] { return unix_ms_now() > after_pause.last_change_unix_ms; }));
  const int commits_paused = w.daemon.commits_paused.load();
  const proto::CommandDone again = w.daemon.command(proto::CommandOp::Pause);
  CHECK(again.code == 0);
  CHECK(again.outcome == noop);
  CHECK(again.bytes == 0);
  CHECK(again.message == "already paused");
  CHECK(w.daemon.commits_paused.load() == commits_paused);
  proto::RankStats st = e->status().stats;
  CHECK(st.state == static_cast<uint8_t>(proto::RankState::Paused));
  CHECK(st.last_pause_bytes == after_pause.last_pause_bytes);
  CHECK(st.last_pause_ns == after_pause.last_pause_ns);
  CHECK(st.last_change_unix_ms == after_pause.last_change_unix_ms);
  CHECK(status().last_pause_bytes == a.size + b.size);  // the C API reads the same figures

  const proto::CommandDone resumed = w.daemon.command(proto::CommandOp::Resume);
  INFO(resumed.message);
  REQUIRE(resumed.code == 0);
  CHECK(resumed.outcome == done);
  CHECK(resumed.bytes == a.size + b.size);
  CHECK(a.intact());
  CHECK(b.intact());
  const proto::RankStats after_resume = e->status().stats;
  CHECK(after_resume.last_resume_bytes == a.size + b.size);
  CHECK(after_resume.last_resume_ns > 0);
  CHECK(after_resume.last_pause_ns == after_pause.last_pause_ns);

  REQUIRE(eventually([&] { return unix_ms_now() > after_resume.last_change_unix_ms; }));
  const proto::CommandDone again_resumed = w.daemon.command(proto::CommandOp::Resume);
  CHECK(again_resumed.code == 0);
  CHECK(again_resumed.outcome == noop);
  CHECK(again_resumed.bytes == 0);
  CHECK(again_resumed.message == "nothing is paused");
  st = e->status().stats;
  CHECK(st.state == static_cast<uint8_t>(proto::RankState::Running));
  CHECK(st.last_resume_bytes == after_resume.last_resume_bytes);
  CHECK(st.last_resume_ns == after_resume.last_resume_ns);
  CHECK(st.last_pause_bytes == after_pause.last_pause_bytes);
  CHECK(st.last_change_unix_ms == after_resume.last_change_unix_ms);
  CHECK(status().last_resume_ns == after_resume.last_resume_ns);
  CHECK(a.intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
}

TEST_CASE("after a resume whose commit failed, the next pause pauses: the daemon's manifest is the one pause state") {
  // The data came back, only the manifest write failed (disk full). The shim once kept its own
  // "committed pause" flag, still set, and the next pause said "already paused; 2 allocation(s) made
  // since stay resident until a resume" although nothing had been allocated since.
  World& w = world();
  Buffer a(2 * kSlotBytes, 40), b(kSlotBytes + 5, 41);
  REQUIRE(api_pause() == 0);
  w.daemon.resume_commit_error = ENOSPC;
  const int resumed_before = w.daemon.commits_resumed.load();
  CHECK(api_resume() == -ENOSPC);
  CHECK(w.daemon.commits_resumed.load() == resumed_before);
  CHECK(a.mapped());  // every chunk verified and copied back: resident, intact
  CHECK(b.mapped());
  CHECK(a.intact());
  CHECK(b.intact());
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_RUNNING);
  CHECK(std::string(st.last_message).find("commit failed") != std::string::npos);

  const int paused_before = w.daemon.commits_paused.load();
  REQUIRE(api_pause() == 0);  // the stale committed pause is closed first, then everything pauses
  CHECK(w.daemon.commits_resumed.load() == resumed_before + 1);
  CHECK(w.daemon.commits_paused.load() == paused_before + 1);
  CHECK_FALSE(a.mapped());
  CHECK_FALSE(b.mapped());
  resume_check_free(w, {&a, &b});
}

TEST_CASE("after a resume whose commit failed, a resume finds nothing paused and records the resume") {
  World& w = world();
  Buffer a(kSlotBytes, 42);
  REQUIRE(api_pause() == 0);
  w.daemon.resume_commit_error = ENOSPC;
  CHECK(api_resume() == -ENOSPC);
  CHECK(a.intact());
  const int resumed_before = w.daemon.commits_resumed.load();
  REQUIRE(api_resume() == 0);  // the daemon still records a pause: the commit is made now
  CHECK(w.daemon.commits_resumed.load() == resumed_before + 1);
  CHECK(api_resume() == 0);  // nothing is paused any more, anywhere
  CHECK(w.daemon.commits_resumed.load() == resumed_before + 1);
  CHECK(a.intact());
  a.free();
}

TEST_CASE("a refused reservation changes nothing") {
  World& w = world();
  Buffer a(3 * kSlotBytes, 4);
  w.daemon.reserve_error = ENOSPC;
  CHECK(api_pause() == -ENOSPC);
  w.daemon.reserve_error = 0;
  CHECK(a.mapped());
  CHECK(a.intact());
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_RUNNING);
  CHECK(st.last_error == ENOSPC);
  CHECK(std::string(st.last_message).find("reservation") != std::string::npos);
  a.free();
}

TEST_CASE("a failed write keeps every unreleased allocation resident and intact") {
  World& w = world();
  Buffer a(2 * kSlotBytes, 5), b(kSlotBytes + 7, 6), c(10 * kSlotBytes, 7);
  // The last of the 14 chunks fails: the allocations finished before it are released, the one it
  // belongs to stays.
  w.daemon.fail_write_at = w.daemon.writes.load() + 13;
  CHECK(api_pause() == -EIO);
  w.daemon.fail_write_at = -1;
  int paused = 0;
  for (const Buffer* buf : {&a, &b, &c}) {
    if (buf->mapped()) {
      CHECK(buf->intact());
    } else {
      // Invariant 1: released only with every chunk acknowledged.
      std::vector<uint8_t> saved;
      REQUIRE(w.daemon.blob_complete(buf->id(), &saved));
      CHECK(saved == buf->expected());
      ++paused;
    }
  }
  CHECK(paused >= 1);
  CHECK(paused <= 2);
  // What it released is unmapped and the program never agreed to keep off it: every call is held
  // (a kernel would fault on it), not only those naming it.
  CHECK(gate::is_closed());
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_PARTIALLY_PAUSED);
  CHECK(st.last_error == EIO);
  CHECK(st.paused_allocations == static_cast<uint32_t>(paused));

  // Pausing again first restores what the failed pause released, then pauses everything.
  REQUIRE(api_pause() == 0);
  for (const Buffer* buf : {&a, &b, &c}) CHECK_FALSE(buf->mapped());
  REQUIRE(api_resume() == 0);
  for (const Buffer* buf : {&a, &b, &c}) CHECK(buf->intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
  c.free();
}

TEST_CASE("a pause of the whole process that fails part-way holds every call, tagged memory included") {
  // Tagged memory paused by a pause of its tag lets the program run on (calls naming it wait); paused
  // by a whole pause that failed, the program never asked for it to go: a kernel may reach it.
  World& w = world();
  REQUIRE(api_tag_push("failing", TMSDISK_POLICY_BACKUP) == 0);
  Buffer a(2 * kSlotBytes, 11), b(kSlotBytes, 12), c(4 * kSlotBytes, 13);
  REQUIRE(api_tag_pop() == 0);
  w.daemon.fail_write_at = w.daemon.writes.load() + 6;  // the last chunk
  CHECK(api_pause() == -EIO);
  w.daemon.fail_write_at = -1;
  CHECK(status().paused_allocations >= 1);
  CHECK(gate::is_closed());
  resume_check_free(w, {&a, &b, &c});
  CHECK_FALSE(gate::is_closed());
}

TEST_CASE("a pause carrying a paused tag that fails part-way records again what stays paused") {
  // Its reservation took the place of the tag's committed pause: recorded again with what it
  // released, the next pause carries both and moves only the rest (nothing is read back first).
  World& w = world();
  REQUIRE(api_tag_push("early", TMSDISK_POLICY_BACKUP) == 0);
  Buffer a(2 * kSlotBytes, 14);
  REQUIRE(api_tag_pop() == 0);
  Buffer b(2 * kSlotBytes, 15), c(2 * kSlotBytes, 16);
  REQUIRE(api_pause_tag("early") == 0);
  const int carried = w.daemon.carried.load(), commits = w.daemon.commits_paused.load();
  w.daemon.fail_write_at = w.daemon.writes.load() + 3;  // the last of b's and c's four chunks
  CHECK(api_pause() == -EIO);
  w.daemon.fail_write_at = -1;
  CHECK_FALSE(a.mapped());
  CHECK(b.mapped() != c.mapped());                       // one released, one resident
  CHECK(w.daemon.carried.load() - carried == 1 + 2);     // a in the failed pause, a and one more after
  CHECK(w.daemon.commits_paused.load() == commits + 1);  // recorded again
  const int reads = w.daemon.reads.load();
  REQUIRE(api_pause() == 0);  // carries a and the released one, pauses the last
  CHECK(w.daemon.reads.load() == reads);
  for (const Buffer* buf : {&a, &b, &c}) CHECK_FALSE(buf->mapped());
  resume_check_free(w, {&a, &b, &c});
}

TEST_CASE("a checksum mismatch keeps that allocation paused and the others come back") {
  World& w = world();
  Buffer a(3 * kSlotBytes, 8), b(2 * kSlotBytes, 9), c(kSlotBytes, 10);
  REQUIRE(api_pause() == 0);
  w.daemon.corrupt_blob = b.id();
  CHECK(api_resume() == -EBADMSG);
  w.daemon.corrupt_blob = 0;
  CHECK(a.intact());
  CHECK(c.intact());
  CHECK_FALSE(b.mapped());  // never visible with unverified data
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_PARTIALLY_PAUSED);
  CHECK(st.last_error == EBADMSG);
  CHECK(api_pause() == -EBUSY);  // the committed pause still holds b's only copy

  REQUIRE(api_resume() == 0);
  CHECK(b.intact());
  CHECK(status().state == TMSDISK_STATE_RUNNING);
  a.free();
  b.free();
  c.free();
}

TEST_CASE("after a checksum mismatch the process runs: only the damaged range is held, until the loss is accepted") {
  World& w = world();
  Buffer a(3 * kSlotBytes, 18), b(2 * kSlotBytes, 19);
  REQUIRE(api_pause() == 0);
  w.daemon.corrupt_blob = b.id();
  CHECK(api_resume() == -EBADMSG);
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_PARTIALLY_PAUSED);
  CHECK(st.damaged_allocations == 1);
  CHECK(st.damaged_bytes == b.size);
  const std::string said = st.last_message;
  INFO(said);
  CHECK(said.find(hex(b.ptr) + " (2.0 MiB; checksum mismatch in chunk ") != std::string::npos);
  CHECK(said.find("blob") == std::string::npos);

  // The gate is open: the intact allocation is used through the hooks as usual.
  REQUIRE_FALSE(gate::is_closed());
  std::vector<uint8_t> got(a.size);
  REQUIRE(hook::cuMemcpyDtoH_v2(got.data(), a.ptr, a.size) == CUDA_SUCCESS);
  CHECK(got == a.expected());

  // A copy from the damaged allocation is held (TMSDISK_ON_TOUCH unset: wait)...
  std::vector<uint8_t> lost(b.size, 0xee);
  std::atomic<int> copied{-1};
  std::thread reader([&] {
    w.sim.cuCtxSetCurrent(w.sim.ctx);
    copied = hook::cuMemcpyDtoH_v2(lost.data(), b.ptr, b.size);
  });
  REQUIRE(eventually([] { return gate::held_count() == 1; }));
  CHECK(copied.load() == -1);
  // ...a pause is refused (it would reserve over what can still be saved), the copy still held...
  CHECK(api_pause() == -EBUSY);
  CHECK(std::string(status().last_message).find(hex(b.ptr)) != std::string::npos);
  REQUIRE(eventually([] { return gate::held_count() == 1; }));
  CHECK(copied.load() == -1);
  // ...until the loss is accepted: zero-filled memory at the same address, and the copy reads it.
  REQUIRE(api_resume_accept_loss() == 0);
  reader.join();
  CHECK(copied.load() == CUDA_SUCCESS);
  CHECK(lost == std::vector<uint8_t>(b.size, 0));
  st = status();
  CHECK(st.state == TMSDISK_STATE_RUNNING);
  CHECK(st.damaged_allocations == 0);
  CHECK(std::string(st.last_message).find("DATA LOST: 1 allocation(s)") != std::string::npos);
  CHECK(std::string(st.last_message).find(hex(b.ptr)) != std::string::npos);
  CHECK(a.intact());
  CHECK(registry().find(b.ptr)->state.load() == AllocState::Resident);
  w.daemon.corrupt_blob = 0;
  // Nothing is paused: the next pause and resume are ordinary ones.
  REQUIRE(api_pause() == 0);
  REQUIRE(api_resume() == 0);
  CHECK(a.intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
}

TEST_CASE("after a whole resume that leaves only damaged memory, a tag's pause holds only calls naming it") {
  // The whole pause is over: what it left is lost, not paused by anyone. A tag paused now is the
  // program's own request, and the rest of it runs on.
  World& w = world();
  REQUIRE(api_tag_push("after-loss", TMSDISK_POLICY_BACKUP) == 0);
  Buffer c(kSlotBytes, 23);
  REQUIRE(api_tag_pop() == 0);
  Buffer a(kSlotBytes, 21), b(kSlotBytes, 22);
  REQUIRE(api_pause() == 0);
  w.daemon.corrupt_blob = b.id();
  CHECK(api_resume() == -EBADMSG);
  w.daemon.corrupt_blob = 0;
  REQUIRE_FALSE(gate::is_closed());
  REQUIRE(api_pause_tag("after-loss") == 0);
  CHECK_FALSE(c.mapped());
  CHECK_FALSE(gate::is_closed());
  std::vector<uint8_t> got(a.size);
  REQUIRE(hook::cuMemcpyDtoH_v2(got.data(), a.ptr, a.size) == CUDA_SUCCESS);
  CHECK(got == a.expected());
  resume_check_free(w, {&a, &b, &c});  // b's chunk reads clean now: a plain resume retries it
}

TEST_CASE("freeing the damaged allocation leaves the rank running and closes the daemon's pause") {
  World& w = world();
  Buffer a(kSlotBytes, 20), b(kSlotBytes, 21);
  REQUIRE(api_pause() == 0);
  w.daemon.corrupt_blob = b.id();
  CHECK(api_resume() == -EBADMSG);
  w.daemon.corrupt_blob = 0;
  const int resumed = w.daemon.commits_resumed.load();
  const CUdeviceptr gone = b.ptr;
  REQUIRE(gate::lost(gone, 1));
  b.free();
  CHECK_FALSE(gate::lost(gone, 1));  // at once: the driver may hand the address out again
  // Nothing is paused any more: the daemon's committed pause is closed, without a resume.
  REQUIRE(eventually([&] { return w.daemon.commits_resumed.load() == resumed + 1; }));
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_RUNNING);
  CHECK(st.paused_allocations == 0);
  CHECK(st.damaged_allocations == 0);
  CHECK(api_resume() == 0);
  CHECK(std::string(status().last_message) == "nothing is paused");
  CHECK(a.intact());
  a.free();
}

TEST_CASE("a resume short of device memory keeps what does not fit paused - the next resume brings it back") {
  World& w = world();
  // b needs more than a and c together (2 MiB granularity): whatever order the chunks come back in,
  // room for a and c is not room for b.
  Buffer a(kSlotBytes, 14), b(5 * kSlotBytes + 1, 15), c(kSlotBytes, 16);
  const uint64_t room = registry().find(a.ptr)->mapped + registry().find(c.ptr)->mapped;
  REQUIRE(registry().find(b.ptr)->mapped > room);
  REQUIRE(api_pause() == 0);
  // Another process took the device meanwhile, all but `room`.
  const uint64_t free_now = w.sim.capacity_bytes(0) - w.sim.used_bytes(0);
  REQUIRE(free_now > room);
  CUdeviceptr filler = 0;
  REQUIRE(w.sim.cuMemAlloc_v2(&filler, free_now - room) == CUDA_SUCCESS);
  REQUIRE(w.sim.capacity_bytes(0) - w.sim.used_bytes(0) == room);

  CHECK(api_resume() == -ENOMEM);
  CHECK(a.intact());
  CHECK(c.intact());
  CHECK_FALSE(b.mapped());  // its data stays on disk
  auto st = status();
  CHECK(st.state == TMSDISK_STATE_PARTIALLY_PAUSED);
  CHECK(st.paused_bytes == b.size);
  CHECK(std::string(st.last_message).find("1 of 3 allocation(s) stay paused") != std::string::npos);

  REQUIRE(w.sim.cuMemFree_v2(filler) == CUDA_SUCCESS);
  REQUIRE(api_resume() == 0);
  CHECK(b.intact());
  CHECK(status().state == TMSDISK_STATE_RUNNING);
  CHECK(w.daemon.violations.load() == 0);
  a.free();
  b.free();
  c.free();
}

TEST_CASE("a pause the daemon asks for while an IPC exchange waits for its answer runs right after it") {
  World& w = world();
  Buffer a(2 * kSlotBytes, 17);
  Engine* e = Engine::instance();
  REQUIRE(e);
  w.daemon.pause_on_ipc_open = true;
  const auto opened = e->ipc().open(5);
  REQUIRE_FALSE(opened);
  CHECK(opened.error().errnum() == ENOENT);
  // Not refused as "another pause or resume is running": deferred, then done.
  const proto::CommandDone done = w.daemon.last_command_done();
  INFO(done.message);
  CHECK(done.code == 0);
  CHECK(done.bytes == a.size);
  CHECK_FALSE(a.mapped());
  REQUIRE(api_resume() == 0);
  CHECK(a.intact());
  CHECK(w.daemon.violations.load() == 0);
  a.free();
}

TEST_CASE("freeing a paused allocation, and pause/resume driven by daemon commands") {
  World& w = world();
  Buffer a(4 * kSlotBytes, 11), b(kSlotBytes, 12);
  auto done = w.daemon.command(proto::CommandOp::Pause);
  CHECK(done.code == 0);
  CHECK(done.bytes == a.size + b.size);
  CHECK(done.nanos > 0);
  CHECK(w.daemon.progress_for_last_command() >= 2);  // at least the first and the last
  b.free();                                          // paused: nothing mapped to release, the range is returned
  done = w.daemon.command(proto::CommandOp::Resume);
  CHECK(done.code == 0);
  CHECK(a.intact());
  CHECK(registry().find(b.ptr) == nullptr);
  CHECK(w.daemon.reports.load() > 0);
  a.free();
}

TEST_CASE("a fork child drops the inherited session") {
  world();
  Buffer a(kSlotBytes, 13);
  REQUIRE(status().connected == 1);
  const pid_t pid = ::fork();
  if (pid == 0) {
    struct tmsdisk_status st {};
    const int rc = api_status(&st, sizeof(st));
    ::_exit(rc == 0 && st.connected == 0 ? 0 : 1);
  }
  int wstatus = 0;
  REQUIRE(::waitpid(pid, &wstatus, 0) == pid);
  CHECK(WIFEXITED(wstatus));
  CHECK(WEXITSTATUS(wstatus) == 0);
  CHECK(status().connected == 1);
  REQUIRE(api_pause() == 0);  // the parent's session still works
  REQUIRE(api_resume() == 0);
  CHECK(a.intact());
  a.free();
}

// tmsdisk_on_pause, through which PyTorch hands back its cache before a pause.
namespace {

// What a pause callback saw, written on the callbacks' thread and read by the test after the pause.
struct CallbackProbe {
  std::atomic<int> calls{0};
  std::atomic<bool> gate_was_closed{false};
  std::atomic<bool> on_shim_thread{false};  // its driver calls bypass the hooks (they must not)
  std::atomic<CUresult> freed{CUDA_ERROR_UNKNOWN};
  std::atomic<CUresult> copied{CUDA_ERROR_UNKNOWN};
  CUdeviceptr cache = 0;  // freed by the callback, as torch.cuda.empty_cache() frees cached blocks
  CUdeviceptr tensor = 0;
  uint32_t tensor_word = 0;  // the tensor's first bytes, written again as they are
  Sim* sim = nullptr;

  static void on_pause(void* self) {
    auto* p = static_cast<CallbackProbe*>(self);
    p->gate_was_closed = gate::is_closed();
    {
      ReentryGuard guard;
      p->on_shim_thread = guard.nested();
    }
    if (p->cache) {
      p->freed = hook::cuMemFree_v2(p->cache);
      p->cache = 0;
    }
    // A gated call (a copy) still passes: the gate is open. Its thread is new, so it makes its context
    // current first, as cudart does for PyTorch.
    p->sim->cuCtxSetCurrent(p->sim->ctx);
    p->copied = hook::cuMemcpyHtoD_v2(p->tensor, &p->tensor_word, sizeof(p->tensor_word));
    p->calls++;
  }
};

// Forgets the callbacks a case registered, whatever its outcome.
struct CallbacksCleared {
  ~CallbacksCleared() { clear_pause_callbacks(); }
};

}  // namespace

TEST_CASE("tmsdisk_on_pause: a null callback is refused, the same one is registered once, 16 at most") {
  world();
  CallbacksCleared cleared;
  CHECK(api_on_pause(nullptr, nullptr) == -EINVAL);
  CallbackProbe probes[kMaxPauseCallbacks + 1];
  for (std::size_t i = 0; i < kMaxPauseCallbacks; ++i) REQUIRE(api_on_pause(&CallbackProbe::on_pause, &probes[i]) == 0);
  CHECK(api_on_pause(&CallbackProbe::on_pause, &probes[0]) == 0);  // already there: not a 17th
  CHECK(api_on_pause(&CallbackProbe::on_pause, &probes[kMaxPauseCallbacks]) == -ENOSPC);
}

TEST_CASE("a pause callback runs once per pause, before the gate closes, and what it frees is not paused") {
  World& w = world();
  CallbacksCleared cleared;
  Buffer tensor(2 * kSlotBytes, 21), cache(3 * kSlotBytes, 22);
  CallbackProbe probe;
  probe.cache = cache.ptr;
  probe.tensor = tensor.ptr;
  probe.sim = &w.sim;
  std::memcpy(&probe.tensor_word, tensor.expected().data(), sizeof(probe.tensor_word));
  REQUIRE(api_on_pause(&CallbackProbe::on_pause, &probe) == 0);

  REQUIRE(api_pause() == 0);
  CHECK(probe.calls.load() == 1);
  CHECK_FALSE(probe.gate_was_closed.load());
  CHECK_FALSE(probe.on_shim_thread.load());
  CHECK(probe.freed.load() == CUDA_SUCCESS);
  CHECK(probe.copied.load() == CUDA_SUCCESS);
  CHECK(registry().find(cache.ptr) == nullptr);
  auto st = status();
  CHECK(st.last_pause_bytes == tensor.size);  // the cache did not move
  CHECK(st.paused_bytes == tensor.size);
  CHECK(api_pause() == 0);  // already paused: nothing to do, and no callback
  CHECK(probe.calls.load() == 1);

  REQUIRE(api_resume() == 0);
  CHECK(probe.calls.load() == 1);  // not on resume
  CHECK(tensor.intact());
  REQUIRE(api_pause() == 0);  // the next pause calls it again
  CHECK(probe.calls.load() == 2);
  REQUIRE(api_resume() == 0);
  CHECK(tensor.intact());
  CHECK(w.daemon.violations.load() == 0);
  tensor.free();
}

TEST_CASE("a pause callback that does not return in time does not hold the pause, nor is it started twice") {
  world();
  CallbacksCleared cleared;
  struct Blocked {
    std::mutex mu;
    std::condition_variable cv;
    bool release = false;
    std::atomic<int> calls{0};
    static void on_pause(void* self) {
      auto* b = static_cast<Blocked*>(self);
      b->calls++;
      std::unique_lock lock(b->mu);
      b->cv.wait(lock, [&] { return b->release; });
    }
  };
  static Blocked blocked;  // the callback may outlive a failed case
  REQUIRE(api_on_pause(&Blocked::on_pause, &blocked) == 0);
  CHECK_FALSE(run_pause_callbacks(50));  // gave up waiting
  CHECK(blocked.calls.load() == 1);
  CHECK_FALSE(run_pause_callbacks(50));  // the first round still runs: not started again
  CHECK(blocked.calls.load() == 1);
  {
    std::lock_guard lock(blocked.mu);
    blocked.release = true;
  }
  blocked.cv.notify_all();
  // Once it returned, the next round runs (to completion: the callback no longer blocks).
  CHECK(eventually([] { return run_pause_callbacks(5000); }));
  CHECK(blocked.calls.load() >= 2);
}
