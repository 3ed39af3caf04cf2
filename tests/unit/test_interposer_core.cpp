// SPDX-License-Identifier: Apache-2.0
// Unit tests of the shim's core without a driver: hook table and lookup map, versioned-name
// resolution, the dlsym replacement, registry, settings, and the C API when libcuda is absent.
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "driver.h"
#include "engine.h"
#include "gate.h"
#include "host_copy.h"
#include "registry.h"
#include "shim.h"
#include "skip.h"
#include "touch.h"

using namespace tmsdisk::shim;

namespace {

// Settings are read once per process: point the shim at a socket nobody listens on before any test
// runs, so nothing here can reach a daemon of the machine.
const bool g_env_ready = [] {
  ::setenv("TMSDISK_SOCKET", "/nonexistent/tmsdisk-unit-test.sock", 1);
  ::setenv("TMSDISK_LOG", "error", 1);
  return true;
}();

int index_of(const char* name) {
  for (std::size_t i = 0; i < kHookCount; ++i)
    if (std::strcmp(kHooks[i].name, name) == 0) return static_cast<int>(i);
  return -1;
}

}  // namespace

TEST_CASE("hook table: the lookup map covers every entry") {
  REQUIRE(g_env_ready);
  std::set<void*> addresses;
  for (std::size_t i = 0; i < kHookCount; ++i) {
    INFO(kHooks[i].name);
    CHECK(find_hook(kHooks[i].name) == static_cast<int>(i));
    void* addr = hook_address(i);
    CHECK(addr != nullptr);
    addresses.insert(addr);
    CHECK(std::strncmp(kHooks[i].base, "cu", 2) == 0);
  }
  CHECK(addresses.size() == kHookCount);
  CHECK(hook_address(kHookCount) == nullptr);
  CHECK(find_hook("cuMemAlloc") == -1);  // the unversioned CUDA 3.1 symbol is not hooked
  CHECK(find_hook("cuMemAlloc_v3") == -1);
  CHECK(find_hook("cuGetExportTable") == -1);  // must always reach the driver untouched
  CHECK(find_hook("malloc") == -1);
  CHECK(find_hook("") == -1);
  CHECK(find_hook("c") == -1);
}

TEST_CASE("versioned names: cuGetProcAddress base names resolve to the right variant") {
  const auto resolve = [](const char* base, int version, uint64_t flags = 0) {
    int i = resolve_by_base(kHooks, base, version, flags);
    return i < 0 ? std::string("-") : std::string(kHooks[static_cast<std::size_t>(i)].name);
  };
  CHECK(resolve("cuMemAlloc", 12000) == "cuMemAlloc_v2");
  CHECK(resolve("cuMemAlloc", 3020) == "cuMemAlloc_v2");
  CHECK(resolve("cuMemAlloc", 3010) == "-");  // the 32-bit CUDA 3.1 function is not ours
  CHECK(resolve("cuMemAlloc", 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) == "cuMemAlloc_v2");
  CHECK(resolve("cuMemAllocPitch", 12080) == "cuMemAllocPitch_v2");
  CHECK(resolve("cuMemFree", 11080, CU_GET_PROC_ADDRESS_LEGACY_STREAM) == "cuMemFree_v2");
  CHECK(resolve("cuGetProcAddress", 11030) == "cuGetProcAddress");
  CHECK(resolve("cuGetProcAddress", 11080) == "cuGetProcAddress");
  CHECK(resolve("cuGetProcAddress", 12000) == "cuGetProcAddress_v2");
  CHECK(resolve("cuGetProcAddress", 13000) == "cuGetProcAddress_v2");
  CHECK(resolve("cuGetProcAddress", 11020) == "-");
  CHECK(resolve("cuMemCreate", 12000) == "cuMemCreate");
  CHECK(resolve("cuMemAlloc_v2", 12000) == "-");
  // Gated calls: the newest variant at each version, per-thread twins by flag.
  constexpr uint64_t kPt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  CHECK(resolve("cuMemcpyHtoD", 12000) == "cuMemcpyHtoD_v2");
  CHECK(resolve("cuMemcpyHtoD", 12000, kPt) == "cuMemcpyHtoD_v2_ptds");
  CHECK(resolve("cuMemcpyHtoDAsync", 12000, kPt) == "cuMemcpyHtoDAsync_v2_ptsz");
  CHECK(resolve("cuLaunchKernel", 6050, kPt) == "cuLaunchKernel");  // before per-thread streams
  CHECK(resolve("cuLaunchKernel", 12000, kPt) == "cuLaunchKernel_ptsz");
  CHECK(resolve("cuStreamBeginCapture", 10000) == "cuStreamBeginCapture");
  CHECK(resolve("cuStreamBeginCapture", 12000) == "cuStreamBeginCapture_v2");
  CHECK(resolve("cuStreamBeginCapture", 12000, kPt) == "cuStreamBeginCapture_v2_ptsz");
  CHECK(resolve("cuMemPrefetchAsync", 12000) == "cuMemPrefetchAsync");
  CHECK(resolve("cuMemPrefetchAsync", 12020) == "cuMemPrefetchAsync_v2");
  CHECK(resolve("cuMemcpyBatchAsync", 12080) == "cuMemcpyBatchAsync");
  CHECK(resolve("cuMemcpyBatchAsync", 13000, kPt) == "cuMemcpyBatchAsync_v2_ptsz");
  CHECK(resolve("cuStreamSynchronize", 12000) == "-");  // queries and synchronizations are never gated
  CHECK(resolve("cuEventQuery", 12000) == "-");         // cuGetProcAddress takes base names only
  // Beyond the CUDA major the table was written for, only pointer identity substitutes.
  CHECK(resolve("cuMemAlloc", kNameResolutionLimit) == "-");
  CHECK(resolve("cuMemAlloc", kNameResolutionLimit - 10) == "cuMemAlloc_v2");
}

TEST_CASE("versioned names: per-thread twins follow the flags") {
  const HookInfo table[] = {
      {"cuFoo", "cuFoo", 3020, Variant::Legacy, Need::Required},
      {"cuFoo_ptsz", "cuFoo", 7000, Variant::PerThread, Need::Required},
      {"cuFoo_v2", "cuFoo", 12000, Variant::Legacy, Need::Required},
      {"cuFoo_v2_ptsz", "cuFoo", 12000, Variant::PerThread, Need::Required},
      {"cuBar", "cuBar", 4000, Variant::Any, Need::Optional},
  };
  const auto resolve = [&](const char* base, int version, uint64_t flags) {
    int i = resolve_by_base(table, base, version, flags);
    return i < 0 ? std::string("-") : std::string(table[i].name);
  };
  constexpr uint64_t kPtds = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  constexpr uint64_t kLegacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
  CHECK(resolve("cuFoo", 10000, 0) == "cuFoo");
  CHECK(resolve("cuFoo", 10000, kLegacy) == "cuFoo");
  CHECK(resolve("cuFoo", 10000, kPtds) == "cuFoo_ptsz");
  CHECK(resolve("cuFoo", 5000, kPtds) == "cuFoo");  // no per-thread twin yet: the legacy one
  CHECK(resolve("cuFoo", 12000, 0) == "cuFoo_v2");
  CHECK(resolve("cuFoo", 12000, kPtds) == "cuFoo_v2_ptsz");
  CHECK(resolve("cuFoo", 2000, kPtds) == "-");
  CHECK(resolve("cuBar", 12000, kPtds) == "cuBar");
  CHECK(resolve("cuBar", 12000, 0) == "cuBar");
}

TEST_CASE("dlsym replacement resolves like glibc") {
  void* (*glibc_dlsym)(void*, const char*) = real_dlsym();
  REQUIRE(glibc_dlsym != nullptr);
  CHECK(dlsym_hook(RTLD_DEFAULT, "strlen", nullptr) == glibc_dlsym(RTLD_DEFAULT, "strlen"));
  void* libc = ::dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
  REQUIRE(libc != nullptr);
  CHECK(dlsym_hook(libc, "memcpy", nullptr) == glibc_dlsym(libc, "memcpy"));

  // RTLD_NEXT is relative to the caller, not to the shim: from this executable it is what glibc
  // answers here; from inside libstdc++ (loaded before libc) it is libc's own malloc.
  const void* here = reinterpret_cast<const void*>(&index_of);
  CHECK(dlsym_hook(RTLD_NEXT, "malloc", here) == ::dlsym(RTLD_NEXT, "malloc"));
  const void* in_libstdcxx = reinterpret_cast<const void*>(&std::terminate);
  CHECK(dlsym_hook(RTLD_NEXT, "malloc", in_libstdcxx) == glibc_dlsym(libc, "malloc"));

  CHECK(dlsym_hook(RTLD_DEFAULT, "tmsdisk_no_such_symbol", nullptr) == nullptr);
  CHECK(::dlerror() != nullptr);
  CHECK(dlsym_hook(RTLD_NEXT, "tmsdisk_no_such_symbol", here) == nullptr);
  ::dlclose(libc);
}

TEST_CASE("registry: managed ranges by containing address, native bytes by reason") {
  Registry r;
  const uint64_t v0 = r.version();
  auto make = [](CUdeviceptr base, std::size_t size, std::size_t mapped) {
    auto a = std::make_unique<Allocation>();
    a->base = base;
    a->size = size;
    a->mapped = mapped;
    return a;
  };
  auto a = r.add(make(0x100000, 3000, 4096));
  auto b = r.add(make(0x200000, 8192, 8192));
  CHECK(a->id != 0);
  CHECK(b->id > a->id);
  CHECK(r.version() > v0);

  CHECK(r.find(0x100000) == a);
  CHECK(r.find(0x100000 + 4095) == a);  // padding up to the granularity belongs to it
  CHECK(r.find(0x100000 + 4096) == nullptr);
  CHECK(r.find(0xfffff) == nullptr);
  CHECK(r.find(0x200000 + 100) == b);
  CHECK(r.find(0x300000) == nullptr);
  CHECK(r.snapshot().size() == 2);
  CHECK(r.snapshot()[0] == a);
  // A range of memory names every allocation it touches (an object's range must be resident whole).
  CHECK(r.overlapping(0x100000 + 100, 10) == std::vector<std::shared_ptr<Allocation>>{a});
  CHECK(r.overlapping(0x100000 + 4000, 0x200000 - 0x100000) == std::vector<std::shared_ptr<Allocation>>{a, b});
  CHECK(r.overlapping(0x101000, 0x200000 - 0x101000).empty());  // ends where b starts
  CHECK(r.overlapping(0x1ff000, 0x1001) == std::vector<std::shared_ptr<Allocation>>{b});
  CHECK(r.overlapping(0x100000, 0).empty());

  b->state.store(AllocState::Paused);
  r.add_unmanaged(0x5000, 100, tmsdisk::proto::Unmanaged::Small);
  r.add_unmanaged(0x6000, 200, tmsdisk::proto::Unmanaged::Small);
  r.add_unmanaged(0x7000, 1 << 20, tmsdisk::proto::Unmanaged::Other);
  auto t = r.totals();
  CHECK(t.managed_allocations == 2);
  CHECK(t.paused_allocations == 1);
  CHECK(t.resident_bytes == 3000);
  CHECK(t.paused_bytes == 8192);
  CHECK(t.unmanaged_bytes[0] == 300);
  CHECK(t.unmanaged_bytes[static_cast<std::size_t>(tmsdisk::proto::Unmanaged::Other)] == (1u << 20));

  CHECK(r.remove_unmanaged(0x5000));
  CHECK_FALSE(r.remove_unmanaged(0x5000));
  // An address reused after a free we never saw replaces the stale record.
  r.add_unmanaged(0x6000, 50, tmsdisk::proto::Unmanaged::Small);
  CHECK(r.totals().unmanaged_bytes[0] == 50);

  CHECK(r.remove(0x100000 + 1) == nullptr);  // only exact bases
  CHECK(r.remove(0x100000) == a);
  CHECK(r.find(0x100000) == nullptr);
  CHECK(r.totals().managed_allocations == 1);
}

TEST_CASE("gate: a closed gate holds new calls, drain waits for the calls inside") {
  REQUIRE(gate::enter("test") == CUDA_SUCCESS);  // this thread is inside
  gate::close();
  std::atomic<bool> drained{false}, entered{false};
  std::thread drainer([&] { drained = gate::drain(60000); });
  std::thread late([&] {
    // TMSDISK_ON_TOUCH is unset: wait until the gate opens.
    if (gate::enter("late") == CUDA_SUCCESS) {
      entered = true;
      gate::leave();
    }
  });
  // The late call is held at the closed gate before anything is checked (not a sleep that hopes so).
  REQUIRE(tmsdisk::testing::eventually([] { return gate::held_count() == 1; }));
  CHECK_FALSE(drained.load());
  gate::leave();
  drainer.join();
  CHECK(drained.load());
  CHECK_FALSE(entered.load());
  gate::open();
  late.join();
  CHECK(entered.load());
  CHECK_FALSE(gate::is_closed());
}

TEST_CASE("gate: drain gives up after its deadline while a call stays inside") {
  REQUIRE(gate::enter("stuck") == CUDA_SUCCESS);  // e.g. a copy queued behind a collective
  gate::close();
  CHECK_FALSE(gate::drain(50));
  gate::leave();
  CHECK(gate::drain(50));
  gate::open();
  CHECK_FALSE(gate::is_closed());
}

TEST_CASE("gate: stream captures are remembered until they end") {
  CHECK(gate::no_capture_active());
  gate::capture_begin(nullptr, true);  // the per-thread stream: trusted, the driver is not asked
  const tmsdisk::Status busy = gate::no_capture_active();
  REQUIRE_FALSE(busy);
  CHECK(busy.error().errnum() == EBUSY);
  CHECK(busy.error().message.find("capture") != std::string::npos);
  gate::capture_end(nullptr, false);  // another stream
  CHECK_FALSE(gate::no_capture_active());
  gate::capture_end(nullptr, true);
  CHECK(gate::no_capture_active());
}

TEST_CASE("gate: with lost memory only the calls naming it are held, until the lost ranges change") {
  constexpr CUdeviceptr kBase = 0x7000'0000'0000ull;
  constexpr std::size_t kSize = 8 << 20;
  gate::set_lost({{kBase, kSize}});
  CHECK_FALSE(gate::is_closed());
  CHECK(gate::lost(kBase, 1));
  CHECK(gate::lost(kBase - 10, 11));        // its last byte is the range's first
  CHECK_FALSE(gate::lost(kBase - 10, 10));  // ends just before
  CHECK(gate::lost(kBase + kSize - 1, 1));
  CHECK_FALSE(gate::lost(kBase + kSize, 4096));
  CHECK(gate::lost(kBase - 1, UINT64_MAX));  // a saturated bounding range still overlaps
  CHECK_FALSE(gate::lost(kBase, 0));

  {
    GateScope elsewhere("copy elsewhere", []() noexcept { return gate::range_touch(kBase + kSize, 4096); });
    CHECK(elsewhere.result() == CUDA_SUCCESS);
  }
  {
    GateScope launch("launch");  // names no memory: proceeds (a kernel reading lost memory faults)
    CHECK(launch.result() == CUDA_SUCCESS);
  }

  // TMSDISK_ON_TOUCH is unset: a call naming lost memory waits until the lost ranges change.
  std::atomic<bool> entered{false};
  std::thread copy([&] {
    GateScope g("copy from lost memory", []() noexcept { return gate::range_touch(kBase + 4096, 4096); });
    entered = g.result() == CUDA_SUCCESS;
  });
  REQUIRE(tmsdisk::testing::eventually([] { return gate::held_count() == 1; }));
  CHECK_FALSE(entered.load());
  gate::set_lost({{kBase + kSize, kSize}});  // another allocation lost, this one restored
  copy.join();
  CHECK(entered.load());
  CHECK(gate::held_count() == 0);

  // A call let in because it touches nothing lost counts as inside: a pause still waits for it.
  REQUIRE(gate::enter(
              "inside", [](const void*) noexcept { return gate::Touch::Clear; }, nullptr) == CUDA_SUCCESS);
  gate::close();
  CHECK_FALSE(gate::drain(50));
  gate::leave();
  CHECK(gate::drain(50));
  gate::open();

  // A freed allocation's range is no longer lost (its address may be handed out again at once).
  gate::forget_lost(kBase + kSize);
  CHECK_FALSE(gate::lost(kBase + kSize, kSize));
  gate::set_lost({});
}

TEST_CASE("touch: each gated call names the device memory its arguments describe") {
  using gate::Touch;
  using touch::Shape;
  static_assert(touch::shape_of("cuLaunchKernel_ptsz") == Shape::Unseen);
  static_assert(touch::shape_of("cuGraphLaunch") == Shape::Unseen);
  static_assert(touch::shape_of("cuMemcpyHtoDAsync_v2_ptsz") == Shape::Dst0Len2);
  static_assert(touch::shape_of("cuMemcpy3DPeerAsync_ptsz") == Shape::Copy3DPeer);
  static_assert(touch::shape_of("cuMemcpy3DBatchAsync_v2") == Shape::Batch3D);
  static_assert(touch::shape_of("cuMemcpy3D_v2") == Shape::Copy3D);
  static_assert(touch::shape_of("cuMemcpy_ptds") == Shape::Dst0Src1Len2);
  static_assert(touch::shape_of("cuMemcpyAsync_ptsz") == Shape::Dst0Src1Len2);
  static_assert(touch::shape_of("cuMemsetD2D16Async") == Shape::Set2D2);
  static_assert(touch::shape_of("cuMemsetD32_v2") == Shape::Set4);
  static_assert(touch::shape_of("cuStreamWaitValue64_v2") == Shape::Value8);
  static_assert(touch::shape_of("cuMemGetInfo") == Shape::Unknown);  // not gated: would not compile there

  gate::set_lost({{0x10000, 0x1000}});
  CHECK(touch::check<Shape::Dst0Len2>(CUdeviceptr{0x10800}, static_cast<const void*>(nullptr), std::size_t{16}) ==
        Touch::Lost);
  CHECK(touch::check<Shape::Src1Len2>(static_cast<void*>(nullptr), CUdeviceptr{0x20000}, std::size_t{16}) ==
        Touch::Clear);
  CHECK(touch::check<Shape::Dst0Src1Len2>(CUdeviceptr{0x1000}, CUdeviceptr{0x10fff}, std::size_t{1}) == Touch::Lost);
  // Sets count elements: 0x401 words from 0xf000 reach 0x10000, 0x400 stop before it.
  CHECK(touch::check<Shape::Set4>(CUdeviceptr{0xf000}, 0u, std::size_t{0x401}) == Touch::Lost);
  CHECK(touch::check<Shape::Set4>(CUdeviceptr{0xf000}, 0u, std::size_t{0x400}) == Touch::Clear);
  CHECK(touch::check<Shape::Value8>(static_cast<CUstream>(nullptr), CUdeviceptr{0xfffc}, cuuint64_t{0}, 0u) ==
        Touch::Lost);
  // A 2D copy reaches the lost range with its last row only.
  CUDA_MEMCPY2D c{};
  c.srcMemoryType = CU_MEMORYTYPE_HOST;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.dstDevice = 0x8000;
  c.dstPitch = 0x1000;
  c.WidthInBytes = 16;
  c.Height = 9;  // rows at 0x8000 ... 0x10000
  CHECK(touch::check<Shape::Copy2D>(static_cast<const CUDA_MEMCPY2D*>(&c)) == Touch::Lost);
  c.Height = 8;  // ... 0xf000
  CHECK(touch::check<Shape::Copy2D>(static_cast<const CUDA_MEMCPY2D*>(&c)) == Touch::Clear);
  CHECK(touch::check<Shape::Unseen>(static_cast<CUgraphExec>(nullptr), static_cast<CUstream>(nullptr)) ==
        Touch::Unseen);
  gate::set_lost({});
}

TEST_CASE("settings: TMSDISK_ON_TOUCH") {
  bool valid = false;
  CHECK(parse_on_touch(nullptr, &valid) == OnTouch::Wait);
  CHECK(valid);
  CHECK(parse_on_touch("wait", &valid) == OnTouch::Wait);
  CHECK(parse_on_touch("resume", &valid) == OnTouch::Resume);
  CHECK(parse_on_touch("fail", &valid) == OnTouch::Fail);
  CHECK(valid);
  CHECK(parse_on_touch("Resume", &valid) == OnTouch::Wait);
  CHECK_FALSE(valid);
}

TEST_CASE("settings: parsers") {
  CHECK_FALSE(parse_plain_integer(nullptr));
  CHECK_FALSE(parse_plain_integer(""));
  CHECK(parse_plain_integer("1048576") == 1048576u);
  CHECK(parse_plain_integer("0") == 0u);
  CHECK(parse_plain_integer("18446744073709551615") == UINT64_MAX);
  // Sizes are plain integers: a suffix, a sign, spaces or an overflow are refused, never guessed.
  for (const char* bad : {"2M", "2MiB", "4k", "1G", "-1", "+1", " 1", "1 ", "12X", "abc", "0x10",
                          "18446744073709551616", "99999999999999999999"})
    CHECK_FALSE(parse_plain_integer(bad));
  // MiB, as tmsctl reads TMS_DISK_BACKUP_CHUNK_MB: the same rule, and its bytes must fit in 64 bits.
  CHECK(tmsdisk::parse_plain_mib("256") == 256u);
  CHECK(tmsdisk::parse_plain_mib("17592186044415") == (UINT64_MAX >> 20));
  CHECK_FALSE(tmsdisk::parse_plain_mib("17592186044416"));
  CHECK_FALSE(tmsdisk::parse_plain_mib("1G"));

  CHECK(parse_rank("3") == 3);
  CHECK(parse_rank("0") == 0);
  CHECK(parse_rank("-1") == -1);
  CHECK(parse_rank("x") == -1);
  CHECK(parse_rank("3x") == -1);
  CHECK(parse_rank(nullptr) == -1);

  CHECK(sanitize_job("a.b-c_D9") == "a.b-c_D9");
  CHECK(sanitize_job("my job/1") == "my_job_1");
  CHECK(sanitize_job(".hidden") == "_hidden");
  CHECK(sanitize_job("..") == "_.");
  CHECK(sanitize_job("") == "default");
  CHECK(sanitize_job(std::string(100, 'j')).size() == 64);
  CHECK(sanitize_job("job\n\x01") == "job__");
}

TEST_CASE("settings: read once from the environment") {
  const Config& c = config();
  CHECK(c.socket_path == "/nonexistent/tmsdisk-unit-test.sock");
  CHECK(&config() == &c);
}

// The unit-test binary has no libcuda.so.1 (simcuda is not on its library path): the shim must
// disable itself and answer with the driver's error codes rather than crash. Where a real driver is
// on the library path there is no absent driver to test with: the case is skipped (its own CTest
// test, test_interposer_core:no-driver), never passed.
TEST_CASE("without libcuda the shim passes through and the C API reports it", "[no-driver]") {
  if (driver().usable)
    tmsdisk::testing::skip("a usable libcuda.so.1 is loadable here, so the shim is not without a driver");
  CUdeviceptr p = 0;
  CHECK(hook::cuMemAlloc_v2(&p, 1 << 20) == CUDA_ERROR_NOT_INITIALIZED);
  CHECK(hook::cuMemFree_v2(p) == CUDA_ERROR_NOT_INITIALIZED);
  void* fn = nullptr;
  CHECK(hook::cuGetProcAddress_v2("cuMemAlloc", &fn, 12000, 0, nullptr) == CUDA_ERROR_NOT_SUPPORTED);
  int marker = 0;
  CHECK(substitute_proc("cuMemAlloc", &marker, 12000, 0) == &marker);

  struct tmsdisk_status st;
  std::memset(&st, 0xff, sizeof(st));
  REQUIRE(api_status(&st, sizeof(st)) == 0);
  CHECK(st.enabled == 0);
  CHECK(st.connected == 0);
  CHECK(st.managed_allocations == 0);
  CHECK(api_status(nullptr, sizeof(st)) == -EINVAL);

  // The request goes through the control thread and comes back with the reason.
  CHECK(api_pause() == -ENOTSUP);
  REQUIRE(api_status(&st, sizeof(st)) == 0);
  CHECK(st.last_error == ENOTSUP);
  CHECK(std::string(st.last_message).find("libcuda") != std::string::npos);
  CHECK(api_resume() == -ENOTSUP);

  // A caller built against an older, shorter struct gets only what it asked for.
  unsigned char small[8];
  std::memset(small, 0xab, sizeof(small));
  REQUIRE(api_status(reinterpret_cast<struct tmsdisk_status*>(small), 4) == 0);
  CHECK(small[4] == 0xab);
  CHECK(std::string(api_version()).rfind("tmsdisk ", 0) == 0);
}

TEST_CASE("host copies: runs of bytes and of zeros land where asked, slices cutting through them") {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const uint64_t src_bytes = 24 * kMiB, dst_bytes = 40 * kMiB;
  std::vector<uint8_t> src(src_bytes);
  for (uint64_t i = 0; i < src_bytes; ++i) src[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  // Fresh, never-touched pages, as the paused reader's caller hands them (torch.empty).
  void* mapped = ::mmap(nullptr, dst_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mapped != MAP_FAILED);
  auto* dst = static_cast<uint8_t*>(mapped);
  std::memset(dst + 30 * kMiB, 0xEE, 2 * kMiB);  // what the zeros must overwrite
  {
    HostCopies copies;
    copies.add(dst, src.data(), 5 * kMiB);                          // two parts that merge:
    copies.add(dst + 5 * kMiB, src.data() + 5 * kMiB, 7 * kMiB);    // src [0, 12) to dst [0, 12)
    copies.add(dst + 12 * kMiB, src.data() + 20 * kMiB, 4 * kMiB);  // src [20, 24) to dst [12, 16)
    copies.add(dst + 16 * kMiB, src.data() + 100, 4099);            // unaligned both ends
    copies.add(dst + 30 * kMiB, nullptr, 2 * kMiB - 1);             // zeros, all but the last byte
    copies.add(dst + 33 * kMiB, nullptr, 0);                        // nothing
    copies.populate(dst + 34 * kMiB + 1, kMiB);                     // pages made, bytes left as they are
    CHECK(copies.bytes() == 17 * kMiB + 4099 + 2 * kMiB - 1);
    copies.start();
    copies.wait();
  }
  CHECK(std::memcmp(dst, src.data(), 12 * kMiB) == 0);
  CHECK(std::memcmp(dst + 12 * kMiB, src.data() + 20 * kMiB, 4 * kMiB) == 0);
  CHECK(std::memcmp(dst + 16 * kMiB, src.data() + 100, 4099) == 0);
  CHECK(dst[16 * kMiB + 4099] == 0);  // untouched around the parts
  bool zeros = true;
  for (uint64_t i = 30 * kMiB; i < 32 * kMiB - 1; ++i) zeros &= dst[i] == 0;
  CHECK(zeros);
  CHECK(dst[32 * kMiB - 1] == 0xEE);
  CHECK(dst[30 * kMiB - 1] == 0);
  // The whole pages inside a populated range are resident, and still read zero.
  unsigned char resident[255] = {};
  REQUIRE(::mincore(dst + 34 * kMiB + 4096, sizeof(resident) * 4096, resident) == 0);
  int present = 0;
  for (unsigned char r : resident) present += r & 1;
#ifdef MADV_POPULATE_WRITE
  void* probe = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(probe != MAP_FAILED);
  const bool populates = ::madvise(probe, 4096, MADV_POPULATE_WRITE) == 0;
  ::munmap(probe, 4096);
#else
  const bool populates = false;
#endif
  if (populates)
    CHECK(present == static_cast<int>(sizeof(resident)));
  else
    WARN("this kernel has no MADV_POPULATE_WRITE (Linux 5.14): populated pages not checked");
  CHECK(dst[34 * kMiB + 5000] == 0);

  // Waiting without starting, and a copy too small for a second thread, on the caller's thread.
  {
    HostCopies idle;
    idle.wait();
    HostCopies small;
    small.add(dst + 36 * kMiB, src.data(), 3);
    small.start();
  }  // the destructor waits
  CHECK(std::memcmp(dst + 36 * kMiB, src.data(), 3) == 0);
  ::munmap(mapped, dst_bytes);
}
