// SPDX-License-Identifier: Apache-2.0
// simcuda tests: cuGetProcAddress, errors, devices, contexts, legacy IPC and the dlsym-able API.
#include <dlfcn.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "simcuda_fixture.h"

using namespace simtest;

namespace {

// The library's own definition of `name`, whatever the executable's PLT would say.
void* own_symbol(const char* name) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(lib != nullptr);
  void* sym = dlsym(lib, name);
  dlclose(lib);
  return sym;
}

}  // namespace

TEST_CASE("cuGetProcAddress resolves base names to versioned symbols", "[simcuda][proc]") {
  setup();
  void* fn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;

  REQUIRE(cuGetProcAddress("cuMemAlloc", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_SUCCESS);
  CHECK(status == CU_GET_PROC_ADDRESS_SUCCESS);
  CHECK(fn == own_symbol("cuMemAlloc_v2"));
  CHECK(fn != nullptr);

  // NULL symbolStatus is allowed.
  REQUIRE(cuGetProcAddress("cuCtxCreate", &fn, 13000, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuCtxCreate_v4"));
  REQUIRE(cuGetProcAddress("cuCtxCreate", &fn, 11040, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuCtxCreate_v3"));
  REQUIRE(cuGetProcAddress("cuCtxDestroy", &fn, 3020, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuCtxDestroy"));
  REQUIRE(cuGetProcAddress("cuEventElapsedTime", &fn, 12080, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuEventElapsedTime_v2"));
  REQUIRE(cuGetProcAddress("cuGetProcAddress", &fn, 12000, 0, nullptr) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuGetProcAddress_v2"));

  // Per-thread default stream variants, on request.
  REQUIRE(cuGetProcAddress("cuMemcpyHtoD", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status) ==
          CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuMemcpyHtoD_v2_ptds"));
  REQUIRE(cuGetProcAddress("cuLaunchKernel", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, nullptr) ==
          CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuLaunchKernel_ptsz"));
  REQUIRE(cuGetProcAddress("cuMemAlloc", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, nullptr) ==
          CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuMemAlloc_v2"));

  // Too old, unknown, or a versioned name: not found, with the reason.
  status = CU_GET_PROC_ADDRESS_SUCCESS;
  CHECK(cuGetProcAddress("cuMemAlloc", &fn, 3000, 0, &status) == CUDA_ERROR_NOT_FOUND);
  CHECK(status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  CHECK(fn == nullptr);
  CHECK(cuGetProcAddress("cuNoSuchFunction", &fn, 13000, 0, &status) == CUDA_ERROR_NOT_FOUND);
  CHECK(status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  CHECK(cuGetProcAddress("cuMemAlloc_v2", &fn, 13000, 0, nullptr) == CUDA_ERROR_NOT_FOUND);
  CHECK(cuGetProcAddress("cuMemAlloc", &fn, 13000, 0x80, nullptr) == CUDA_ERROR_INVALID_VALUE);

  // The older four-argument export answers the same.
  using Legacy = CUresult (*)(const char*, void**, int, cuuint64_t);
  auto legacy = reinterpret_cast<Legacy>(own_symbol("cuGetProcAddress"));
  REQUIRE(legacy != nullptr);
  REQUIRE(legacy("cuMemFree", &fn, 12000, 0) == CUDA_SUCCESS);
  CHECK(fn == own_symbol("cuMemFree_v2"));

  // What comes back is callable.
  REQUIRE(cuGetProcAddress("cuDriverGetVersion", &fn, 13000, 0, nullptr) == CUDA_SUCCESS);
  int version = 0;
  REQUIRE(reinterpret_cast<CUresult (*)(int*)>(fn)(&version) == CUDA_SUCCESS);
  CHECK(version == 13000);
}

TEST_CASE("Before cuInit only resolvers, versions and error strings answer", "[simcuda][proc]") {
  setup();
  // A fork child starts with a fresh, uninitialized driver.
  int rc = run_in_child([] {
    void* fn = nullptr;
    if (cuGetProcAddress("cuInit", &fn, 13000, 0, nullptr) != CUDA_SUCCESS || fn == nullptr) return 1;
    int v = 0;
    if (cuDriverGetVersion(&v) != CUDA_SUCCESS || v != 13000) return 2;
    const char* s = nullptr;
    if (cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &s) != CUDA_SUCCESS) return 3;
    int n = 0;
    if (cuDeviceGetCount(&n) != CUDA_ERROR_NOT_INITIALIZED) return 4;
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, 16) != CUDA_ERROR_NOT_INITIALIZED) return 5;
    if (cuInit(1) != CUDA_ERROR_INVALID_VALUE) return 6;
    if (reinterpret_cast<CUresult (*)(unsigned)>(fn)(0) != CUDA_SUCCESS) return 7;
    if (cuDeviceGetCount(&n) != CUDA_SUCCESS || n != 2) return 8;
    return 0;
  });
  CHECK(rc == 0);
}

TEST_CASE("Error names and strings", "[simcuda][errors]") {
  const char* s = nullptr;
  REQUIRE(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s) == CUDA_SUCCESS);
  CHECK(std::string(s) == "CUDA_ERROR_OUT_OF_MEMORY");
  REQUIRE(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s) == CUDA_SUCCESS);
  CHECK(std::string(s) == "out of memory");
  REQUIRE(cuGetErrorName(CUDA_ERROR_ILLEGAL_ADDRESS, &s) == CUDA_SUCCESS);
  CHECK(std::string(s) == "CUDA_ERROR_ILLEGAL_ADDRESS");
  CHECK(cuGetErrorString(static_cast<CUresult>(12345), &s) == CUDA_ERROR_INVALID_VALUE);
  CHECK(s == nullptr);
}

TEST_CASE("Devices and contexts", "[simcuda][context]") {
  CUcontext primary = setup();
  int n = 0;
  REQUIRE(cuDeviceGetCount(&n) == CUDA_SUCCESS);
  CHECK(n == 2);
  CUdevice dev = -1;
  CHECK(cuDeviceGet(&dev, 2) == CUDA_ERROR_INVALID_DEVICE);
  REQUIRE(cuDeviceGet(&dev, 1) == CUDA_SUCCESS);
  char name[64] = {};
  REQUIRE(cuDeviceGetName(name, sizeof name, dev) == CUDA_SUCCESS);
  CHECK(std::string(name) == "simcuda device 1");
  size_t total = 0;
  REQUIRE(cuDeviceTotalMem(&total, dev) == CUDA_SUCCESS);
  CHECK(total == kCapacity);
  CHECK(simcuda_capacity_bytes(1) == kCapacity);

  auto attr = [&](CUdevice_attribute a) {
    int v = -1;
    REQUIRE(cuDeviceGetAttribute(&v, a, dev) == CUDA_SUCCESS);
    return v;
  };
  CHECK(attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) == 9);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) == 0);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) == 1);
  CHECK(attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY) == 1);

  const void* table = &n;
  CUuuid id{};
  CHECK(cuGetExportTable(&table, &id) == CUDA_ERROR_NOT_SUPPORTED);
  CHECK(table == nullptr);

  // Primary contexts are reference counted; the handle is stable.
  CUcontext p1 = nullptr;
  REQUIRE(cuDevicePrimaryCtxRetain(&p1, 1) == CUDA_SUCCESS);
  unsigned flags = 0;
  int active = 0;
  REQUIRE(cuDevicePrimaryCtxGetState(1, &flags, &active) == CUDA_SUCCESS);
  CHECK(active == 1);
  REQUIRE(cuCtxPushCurrent(p1) == CUDA_SUCCESS);
  CUdevice cur_dev = -1;
  REQUIRE(cuCtxGetDevice(&cur_dev) == CUDA_SUCCESS);
  CHECK(cur_dev == 1);
  REQUIRE(cuCtxEnablePeerAccess(primary, 0) == CUDA_SUCCESS);
  CHECK(cuCtxEnablePeerAccess(primary, 0) == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  CUcontext popped = nullptr;
  REQUIRE(cuCtxPopCurrent(&popped) == CUDA_SUCCESS);
  CHECK(popped == p1);
  REQUIRE(cuDevicePrimaryCtxRelease(1) == CUDA_SUCCESS);
  REQUIRE(cuDevicePrimaryCtxGetState(1, &flags, &active) == CUDA_SUCCESS);
  CHECK(active == 0);
  CUcontext again = nullptr;
  REQUIRE(cuDevicePrimaryCtxRetain(&again, 1) == CUDA_SUCCESS);
  CHECK(again == p1);
  REQUIRE(cuDevicePrimaryCtxRelease(1) == CUDA_SUCCESS);

  size_t free_bytes = 0;
  REQUIRE(cuMemGetInfo(&free_bytes, &total) == CUDA_SUCCESS);
  CHECK(total == kCapacity);
}

TEST_CASE("Legacy IPC shares cuMemAlloc memory with another process", "[simcuda][ipc]") {
  setup();
  CUdeviceptr d = 0;
  REQUIRE(cuMemAlloc(&d, 8192) == CUDA_SUCCESS);
  REQUIRE(cuMemsetD32(d, 0x01020304u, 2048) == CUDA_SUCCESS);
  CUipcMemHandle handle{};
  REQUIRE(cuIpcGetMemHandle(&handle, d) == CUDA_SUCCESS);
  CUdeviceptr self = 0;
  CHECK(cuIpcOpenMemHandle(&self, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_ERROR_INVALID_CONTEXT);

  int rc = run_in_child([handle] {
    if (child_setup() != CUDA_SUCCESS) return 1;
    CUdeviceptr p = 0;
    if (cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS) return 2;
    uint32_t v = 0;
    if (cuMemcpyDtoH(&v, p + 4096, 4) != CUDA_SUCCESS || v != 0x01020304u) return 3;
    if (cuMemsetD32(p, 0xa0a0a0a0u, 1) != CUDA_SUCCESS) return 4;
    if (cuIpcCloseMemHandle(p) != CUDA_SUCCESS) return 5;
    return 0;
  });
  REQUIRE(rc == 0);
  uint32_t v = 0;
  REQUIRE(cuMemcpyDtoH(&v, d, 4) == CUDA_SUCCESS);
  CHECK(v == 0xa0a0a0a0u);
  REQUIRE(cuMemFree(d) == CUDA_SUCCESS);

  // VMM memory goes through shareable handles, not legacy IPC.
  CUdeviceptr va = 0;
  REQUIRE(cuMemAddressReserve(&va, kGran, 0, 0, 0) == CUDA_SUCCESS);
  CHECK(cuIpcGetMemHandle(&handle, va) == CUDA_ERROR_NOT_SUPPORTED);
  REQUIRE(cuMemAddressFree(va, kGran) == CUDA_SUCCESS);
}

TEST_CASE("Host allocations and the dlsym-able introspection API", "[simcuda][host]") {
  setup();
  void* pinned = nullptr;
  REQUIRE(cuMemAllocHost(&pinned, 10000) == CUDA_SUCCESS);
  unsigned type = 0;
  REQUIRE(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(pinned)) ==
          CUDA_SUCCESS);
  CHECK(type == CU_MEMORYTYPE_HOST);
  CUdeviceptr dp = 0;
  REQUIRE(cuMemHostGetDevicePointer(&dp, pinned, 0) == CUDA_SUCCESS);
  CHECK(dp == reinterpret_cast<CUdeviceptr>(pinned));
  CHECK(cuMemHostUnregister(pinned) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  REQUIRE(cuMemFreeHost(pinned) == CUDA_SUCCESS);
  CHECK(cuMemFreeHost(pinned) == CUDA_ERROR_INVALID_VALUE);

  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(lib != nullptr);
  auto used = reinterpret_cast<uint64_t (*)(int)>(dlsym(lib, "simcuda_used_bytes"));
  auto is_mapped = reinterpret_cast<int (*)(CUdeviceptr, size_t)>(dlsym(lib, "simcuda_is_mapped"));
  auto mapped = reinterpret_cast<uint64_t (*)()>(dlsym(lib, "simcuda_mapped_bytes"));
  REQUIRE(used != nullptr);
  REQUIRE(is_mapped != nullptr);
  REQUIRE(mapped != nullptr);
  CHECK(dlsym(lib, "_ZN7simcuda6driverEv") == nullptr);  // internals stay hidden
  const uint64_t before = mapped();
  CUdeviceptr d = 0;
  REQUIRE(cuMemAlloc(&d, 100) == CUDA_SUCCESS);
  CHECK(is_mapped(d, 100) == 1);
  CHECK(mapped() == before + 4096);
  CHECK(used(0) == simcuda_used_bytes(0));
  REQUIRE(cuMemFree(d) == CUDA_SUCCESS);
  CHECK(is_mapped(d, 100) == 0);
  dlclose(lib);
}

TEST_CASE("cuMemAllocManaged is charged host memory the device reads and writes", "[simcuda][managed]") {
  setup();
  const uint64_t used0 = simcuda_used_bytes(0);
  CUdeviceptr p = 0;
  CHECK(cuMemAllocManaged(&p, 4096, 0) == CUDA_ERROR_INVALID_VALUE);  // flags: GLOBAL or HOST
  REQUIRE(cuMemAllocManaged(&p, 3 * kGran, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS);
  CHECK(p % kGran == 0);
  CHECK(simcuda_used_bytes(0) == used0 + 3 * kGran);
  REQUIRE(cuMemsetD32(p, 0x5a5a5a5a, 3 * kGran / 4) == CUDA_SUCCESS);
  CHECK(*reinterpret_cast<uint32_t*>(p + kGran) == 0x5a5a5a5au);  // the host sees it too
  unsigned managed = 0;
  REQUIRE(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, p + 16) == CUDA_SUCCESS);
  CHECK(managed == 1);
  CUdeviceptr base = 0;
  size_t size = 0;
  REQUIRE(cuMemGetAddressRange(&base, &size, p + 100) == CUDA_SUCCESS);
  CHECK(base == p);
  CHECK(size == 3 * kGran);
  CUipcMemHandle ipc{};
  CHECK(cuIpcGetMemHandle(&ipc, p) == CUDA_ERROR_INVALID_VALUE);
  REQUIRE(cuMemFree(p) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0);
}

TEST_CASE("stream-ordered pools - allocate, free in stream order, reuse, trim", "[simcuda][pool]") {
  setup();
  const uint64_t used0 = simcuda_used_bytes(0);
  CUmemoryPool pool = nullptr, current = nullptr;
  REQUIRE(cuDeviceGetDefaultMemPool(&pool, 0) == CUDA_SUCCESS);
  REQUIRE(cuDeviceGetMemPool(&current, 0) == CUDA_SUCCESS);
  CHECK(pool == current);
  CUmemoryPool pool1 = nullptr;
  REQUIRE(cuDeviceGetDefaultMemPool(&pool1, 1) == CUDA_SUCCESS);
  CHECK(pool1 != pool);
  CHECK(cuDeviceGetDefaultMemPool(&pool1, 7) == CUDA_ERROR_INVALID_DEVICE);

  CUstream s = nullptr;
  REQUIRE(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  CUdeviceptr a = 0, b = 0;
  REQUIRE(cuMemAllocAsync(&a, 4 * kGran, s) == CUDA_SUCCESS);
  REQUIRE(cuMemAllocAsync(&b, kGran, s) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0 + 5 * kGran);
  REQUIRE(cuMemsetD32Async(a, 7, 4 * kGran / 4, s) == CUDA_SUCCESS);
  CUmemoryPool owner = nullptr;
  REQUIRE(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, a) == CUDA_SUCCESS);
  CHECK(owner == pool);

  // The free runs in stream order: the set queued before it still finds the memory.
  REQUIRE(cuMemFreeAsync(a, s) == CUDA_SUCCESS);
  REQUIRE(cuStreamSynchronize(s) == CUDA_SUCCESS);
  unsigned mapped = 1;
  CHECK(cuPointerGetAttribute(&mapped, CU_POINTER_ATTRIBUTE_MAPPED, a) == CUDA_ERROR_INVALID_VALUE);
  CHECK(cuMemFreeAsync(a, s) == CUDA_ERROR_INVALID_VALUE);  // already freed
  CHECK(simcuda_used_bytes(0) == used0 + 5 * kGran);        // the pool keeps it
  CUdeviceptr c = 0;
  REQUIRE(cuMemAllocAsync(&c, 4 * kGran, s) == CUDA_SUCCESS);  // same size: reused
  CHECK(c == a);
  CHECK(simcuda_used_bytes(0) == used0 + 5 * kGran);
  REQUIRE(cuMemFreeAsync(c, s) == CUDA_SUCCESS);
  REQUIRE(cuMemFreeAsync(b, s) == CUDA_SUCCESS);
  REQUIRE(cuStreamSynchronize(s) == CUDA_SUCCESS);

  // Trimming hands idle memory back to the device, keeping at least what was asked.
  REQUIRE(cuMemPoolTrimTo(pool, kGran) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) <= used0 + kGran);
  REQUIRE(cuMemPoolTrimTo(pool, 0) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0);
  CHECK(cuMemPoolTrimTo(reinterpret_cast<CUmemoryPool>(&owner), 0) == CUDA_ERROR_INVALID_VALUE);

  // A cuMemAlloc pointer is not pool memory.
  CUdeviceptr n = 0;
  REQUIRE(cuMemAlloc(&n, kGran) == CUDA_SUCCESS);
  CHECK(cuMemFreeAsync(n, s) == CUDA_ERROR_INVALID_VALUE);
  REQUIRE(cuMemFree(n) == CUDA_SUCCESS);
  REQUIRE(cuStreamDestroy(s) == CUDA_SUCCESS);
}
