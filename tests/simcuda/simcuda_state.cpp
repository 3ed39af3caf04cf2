// SPDX-License-Identifier: Apache-2.0
// simcuda driver lifetime: settings read once from the environment, the cross-process capacity
// ledger, cuInit, fork children, and returning this process's charges at exit.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "simcuda_internal.h"

namespace simcuda {
namespace {

constexpr uint64_t kLedgerMagic = 0x31414455'434d4953ull;  // "SIMCUDA1", little-endian

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the ledger is shared between processes: its atomics must not hide a lock");

std::mutex g_init_mu;
bool g_init_done = false;                             // guarded by g_init_mu
CUresult g_init_result = CUDA_ERROR_NOT_INITIALIZED;  // guarded by g_init_mu
bool g_atfork_registered = false;                     // guarded by g_init_mu
uint64_t g_epoch = 0;                                 // guarded by g_init_mu
std::atomic<Driver*> g_driver{nullptr};

long long env_int(const char* name, long long def, long long lo, long long hi) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < lo || x > hi) {
    log("ignoring %s=%s (expected an integer in %lld..%lld); using %lld", name, v, lo, hi, def);
    return def;
  }
  return x;
}

Config read_config() {
  Config c;
  c.device_count = static_cast<int>(env_int("SIMCUDA_DEVICE_COUNT", 1, 0, kMaxDevices));
  c.capacity = static_cast<uint64_t>(env_int("SIMCUDA_DEVICE_MEM_MB", 1024, 1, 1LL << 24)) << 20;
  c.rdma_with_vmm = static_cast<int>(env_int("SIMCUDA_GPU_DIRECT_RDMA_WITH_CUDA_VMM", 1, 0, 1));
  c.vmm = static_cast<int>(env_int("SIMCUDA_VIRTUAL_MEMORY_MANAGEMENT", 1, 0, 1));
  c.fail_after_creates = env_int("SIMCUDA_FAIL_AFTER_CREATES", -1, 0, LLONG_MAX);
  const char* s = getenv("SIMCUDA_STATE");
  if (s != nullptr && *s != '\0') {
    c.state_path = s;
  } else {
    c.state_path = "/dev/shm/simcuda-" + std::to_string(getuid());
  }
  return c;
}

Ledger* open_ledger(const std::string& path) {
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    log("cannot open the state file %s (SIMCUDA_STATE): %s", path.c_str(), strerror(errno));
    return nullptr;
  }
  struct stat st {};
  // Every process may race to size a new file; all of them grow it to the same size, and the new
  // bytes are zero, which is the correct initial ledger.
  if (fstat(fd, &st) != 0 || (static_cast<size_t>(st.st_size) < sizeof(Ledger) && ftruncate(fd, sizeof(Ledger)) != 0)) {
    log("cannot size the state file %s: %s", path.c_str(), strerror(errno));
    close(fd);
    return nullptr;
  }
  void* m = mmap(nullptr, sizeof(Ledger), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    log("cannot map the state file %s: %s", path.c_str(), strerror(errno));
    return nullptr;
  }
  auto* l = static_cast<Ledger*>(m);
  uint64_t seen = 0;
  if (!l->magic.compare_exchange_strong(seen, kLedgerMagic) && seen != kLedgerMagic) {
    log("%s is not a simcuda state file", path.c_str());
    munmap(m, sizeof(Ledger));
    return nullptr;
  }
  return l;
}

void atfork_prepare() {
  g_init_mu.lock();
}
void atfork_parent() {
  g_init_mu.unlock();
}

// The real driver is unusable in a fork child. simcuda lets the child start over instead (its own
// cuInit, contexts, streams and charges), so tests can fork helper processes; the parent's objects
// are abandoned, never freed, since their locks may be held by threads that no longer exist.
void atfork_child() {
  g_driver.store(nullptr, std::memory_order_release);
  g_init_done = false;
  g_init_result = CUDA_ERROR_NOT_INITIALIZED;
  g_init_mu.unlock();
}

// Orderly exits give back what this process still holds; a crash leaks its charge in the ledger
// (tests use a fresh SIMCUDA_STATE each).
__attribute__((destructor)) void release_at_exit() {
  Driver* d = g_driver.load(std::memory_order_acquire);
  if (d == nullptr) return;
  for (int i = 0; i < kMaxDevices; ++i) {
    uint64_t h = d->held[i].exchange(0);
    if (h != 0) d->ledger->used[i].fetch_sub(h);
  }
}

}  // namespace

void log(const char* fmt, ...) {
  char buf[512];
  int n = snprintf(buf, sizeof buf, "[simcuda %d] ", static_cast<int>(getpid()));
  size_t len = n < 0 ? 0 : static_cast<size_t>(n);
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + len, sizeof buf - len - 1, fmt, ap);  // one byte kept for the newline
  va_end(ap);
  if (m > 0) len = std::min(len + static_cast<size_t>(m), sizeof buf - 2);
  buf[len++] = '\n';
  ssize_t ignored = write(STDERR_FILENO, buf, len);
  (void)ignored;
}

Driver* driver() {
  return g_driver.load(std::memory_order_acquire);
}

CUresult init(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lk(g_init_mu);
  if (g_init_done) return g_init_result;
  if (!g_atfork_registered) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    g_atfork_registered = true;
  }
  g_init_done = true;
  auto d = std::make_unique<Driver>();
  d->cfg = read_config();
  d->epoch = ++g_epoch;
  long pg = sysconf(_SC_PAGESIZE);
  d->page = pg > 0 ? static_cast<size_t>(pg) : 4096;
  if (d->cfg.device_count == 0) {
    g_init_result = CUDA_ERROR_NO_DEVICE;
    return g_init_result;
  }
  d->ledger = open_ledger(d->cfg.state_path);
  if (d->ledger == nullptr) {
    g_init_result = CUDA_ERROR_OPERATING_SYSTEM;
    return g_init_result;
  }
  d->primaries.assign(static_cast<size_t>(d->cfg.device_count), nullptr);
  d->primary_flags.assign(static_cast<size_t>(d->cfg.device_count), 0);
  g_driver.store(d.release(), std::memory_order_release);  // never deleted: workers may outlive exit
  g_init_result = CUDA_SUCCESS;
  return g_init_result;
}

bool charge(Driver& d, int device, uint64_t bytes) {
  std::atomic<uint64_t>& used = d.ledger->used[device];
  uint64_t cur = used.load();
  do {
    if (bytes > d.cfg.capacity || cur > d.cfg.capacity - bytes) return false;
  } while (!used.compare_exchange_weak(cur, cur + bytes));
  d.held[device].fetch_add(bytes);
  return true;
}

void uncharge(Driver& d, int device, uint64_t bytes) {
  // Only what this process still holds goes back: after the exit hook has returned everything, a
  // late free (a static destructor in the application) must not return it twice.
  std::atomic<uint64_t>& held = d.held[device];
  uint64_t h = held.load();
  do {
    if (h < bytes) return;
  } while (!held.compare_exchange_weak(h, h - bytes));
  d.ledger->used[device].fetch_sub(bytes);
}

}  // namespace simcuda
