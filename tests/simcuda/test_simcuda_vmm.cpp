// SPDX-License-Identifier: Apache-2.0
// simcuda tests: virtual memory management, pointer queries, shareable handles, and capacity shared
// across processes.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "simcuda_fixture.h"

using namespace simtest;

TEST_CASE("VMM reserve, create, map, access and unmap round trip", "[simcuda][vmm]") {
  setup();
  CUmemAllocationProp prop = device_prop(0);
  size_t gran = 0;
  REQUIRE(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);
  REQUIRE(gran == kGran);

  const uint64_t used0 = simcuda_used_bytes(0);
  const uint64_t mapped0 = simcuda_mapped_bytes();
  CUdeviceptr base = 0;
  REQUIRE(cuMemAddressReserve(&base, 4 * gran, 0, 0, 0) == CUDA_SUCCESS);
  CHECK(base % gran == 0);
  CUdeviceptr bad = 0;
  CHECK(cuMemAddressReserve(&bad, gran + 1, 0, 0, 0) == CUDA_ERROR_INVALID_VALUE);

  CUmemGenericAllocationHandle h = 0;
  REQUIRE(cuMemCreate(&h, 2 * gran, &prop, 0) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0 + 2 * gran);
  CHECK(simcuda_is_mapped(base + gran, 2 * gran) == 0);

  const CUdeviceptr p = base + gran;
  REQUIRE(cuMemMap(p, 2 * gran, 0, h, 0) == CUDA_SUCCESS);
  CHECK(simcuda_is_mapped(p, 2 * gran) == 1);
  CHECK(simcuda_is_mapped(base, gran) == 0);
  CHECK(simcuda_is_mapped(p, 3 * gran) == 0);
  CHECK(simcuda_mapped_bytes() == mapped0 + 2 * gran);
  CHECK(cuMemMap(p, gran, 0, h, 0) == CUDA_ERROR_INVALID_VALUE);  // overlaps

  // Mapped but not yet accessible: the driver refuses to touch it.
  CUmemLocation loc{CU_MEM_LOCATION_TYPE_DEVICE, 0};
  unsigned long long flags = 99;
  REQUIRE(cuMemGetAccess(&flags, &loc, p) == CUDA_SUCCESS);
  CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE);
  CHECK(cuMemsetD8(p, 1, 16) == CUDA_ERROR_INVALID_VALUE);

  CUmemAccessDesc access = rw(0);
  REQUIRE(cuMemSetAccess(p, 2 * gran, &access, 1) == CUDA_SUCCESS);
  REQUIRE(cuMemGetAccess(&flags, &loc, p + gran) == CUDA_SUCCESS);
  CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  loc.id = 1;
  REQUIRE(cuMemGetAccess(&flags, &loc, p) == CUDA_SUCCESS);
  CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE);

  auto* words = reinterpret_cast<uint32_t*>(p);
  for (size_t i = 0; i < 2 * gran / 4; i += 1024) words[i] = static_cast<uint32_t>(i);
  words[2 * gran / 4 - 1] = 0xabcdef01u;
  std::vector<uint32_t> back(2 * gran / 4);
  REQUIRE(cuMemcpyDtoH(back.data(), p, 2 * gran) == CUDA_SUCCESS);
  CHECK(back[1024] == 1024);
  CHECK(back.back() == 0xabcdef01u);

  // Unmap: the pages are gone from the address space but the handle keeps the bytes (and the
  // charge), which is what lets a pause release memory and a resume map it back.
  REQUIRE(cuMemUnmap(p, 2 * gran) == CUDA_SUCCESS);
  CHECK(simcuda_is_mapped(p, 1) == 0);
  CHECK(simcuda_mapped_bytes() == mapped0);
  CHECK(simcuda_used_bytes(0) == used0 + 2 * gran);
  CHECK(cuMemcpyDtoH(back.data(), p, 64) == CUDA_ERROR_INVALID_VALUE);
  CHECK(cuMemUnmap(p, 2 * gran) == CUDA_ERROR_INVALID_VALUE);

  REQUIRE(cuMemMap(p, 2 * gran, 0, h, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemSetAccess(p, 2 * gran, &access, 1) == CUDA_SUCCESS);
  CHECK(words[2 * gran / 4 - 1] == 0xabcdef01u);
  REQUIRE(cuMemUnmap(p, 2 * gran) == CUDA_SUCCESS);

  REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0);
  CHECK(cuMemRelease(h) == CUDA_ERROR_INVALID_VALUE);
  REQUIRE(cuMemAddressFree(base, 4 * gran) == CUDA_SUCCESS);
}

TEST_CASE("Physical memory lives while a handle or a mapping holds it", "[simcuda][vmm]") {
  setup();
  CUmemAllocationProp prop = device_prop(0);
  const uint64_t used0 = simcuda_used_bytes(0);
  CUdeviceptr va = 0;
  REQUIRE(cuMemAddressReserve(&va, 2 * kGran, kGran * 4, 0, 0) == CUDA_SUCCESS);
  CHECK(va % (kGran * 4) == 0);
  CUmemGenericAllocationHandle h = 0;
  REQUIRE(cuMemCreate(&h, 2 * kGran, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemMap(va, 2 * kGran, 0, h, 0) == CUDA_SUCCESS);

  // Releasing the handle while mapped keeps the memory; retaining returns the same handle.
  REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0 + 2 * kGran);
  CUmemGenericAllocationHandle again = 0;
  REQUIRE(cuMemRetainAllocationHandle(&again, reinterpret_cast<void*>(va + kGran)) == CUDA_SUCCESS);
  CHECK(again == h);
  CUmemAllocationProp got{};
  REQUIRE(cuMemGetAllocationPropertiesFromHandle(&got, again) == CUDA_SUCCESS);
  CHECK(got.location.id == 0);
  CHECK(got.type == CU_MEM_ALLOCATION_TYPE_PINNED);
  REQUIRE(cuMemRelease(again) == CUDA_SUCCESS);

  CHECK(cuMemAddressFree(va, 2 * kGran) == CUDA_ERROR_INVALID_VALUE);  // still mapped
  REQUIRE(cuMemUnmap(va, 2 * kGran) == CUDA_SUCCESS);
  CHECK(simcuda_used_bytes(0) == used0);
  REQUIRE(cuMemAddressFree(va, 2 * kGran) == CUDA_SUCCESS);
}

TEST_CASE("Pointer attributes and address ranges of VMM and cuMemAlloc memory", "[simcuda][vmm]") {
  CUcontext ctx = setup();

  SECTION("cuMemAlloc") {
    CUdeviceptr d = 0;
    REQUIRE(cuMemAlloc(&d, 3 * kGran + 100) == CUDA_SUCCESS);
    CHECK(d % kGran == 0);
    CUdeviceptr base = 0;
    size_t size = 0;
    REQUIRE(cuMemGetAddressRange(&base, &size, d + 4096) == CUDA_SUCCESS);
    CHECK(base == d);
    CHECK(size == 3 * kGran + 100);

    CUcontext owner = nullptr;
    REQUIRE(cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, d + 8) == CUDA_SUCCESS);
    CHECK(owner == ctx);
    unsigned type = 0;
    REQUIRE(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d) == CUDA_SUCCESS);
    CHECK(type == CU_MEMORYTYPE_DEVICE);
    int ordinal = -1;
    REQUIRE(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d) == CUDA_SUCCESS);
    CHECK(ordinal == 0);
    CUdeviceptr dp = 0;
    REQUIRE(cuPointerGetAttribute(&dp, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, d + 16) == CUDA_SUCCESS);
    CHECK(dp == d + 16);
    CUdeviceptr start = 0;
    size_t range = 0;
    REQUIRE(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 5) == CUDA_SUCCESS);
    REQUIRE(cuPointerGetAttribute(&range, CU_POINTER_ATTRIBUTE_RANGE_SIZE, d + 5) == CUDA_SUCCESS);
    CHECK(start == d);
    CHECK(range == 3 * kGran + 100);
    unsigned ipc = 0;
    REQUIRE(cuPointerGetAttribute(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, d) == CUDA_SUCCESS);
    CHECK(ipc == 1);
    REQUIRE(cuMemFree(d) == CUDA_SUCCESS);
    CHECK(cuMemGetAddressRange(&base, &size, d) == CUDA_ERROR_NOT_FOUND);
    CHECK(cuMemFree(d) == CUDA_ERROR_INVALID_VALUE);
  }

  SECTION("VMM") {
    CUmemAllocationProp prop = device_prop(1);
    CUdeviceptr va = 0;
    REQUIRE(cuMemAddressReserve(&va, 8 * kGran, 0, 0, 0) == CUDA_SUCCESS);
    CUmemGenericAllocationHandle h = 0;
    REQUIRE(cuMemCreate(&h, 2 * kGran, &prop, 0) == CUDA_SUCCESS);
    const CUdeviceptr p = va + 2 * kGran;
    REQUIRE(cuMemMap(p, 2 * kGran, 0, h, 0) == CUDA_SUCCESS);
    CUmemAccessDesc access = rw(1);
    REQUIRE(cuMemSetAccess(p, 2 * kGran, &access, 1) == CUDA_SUCCESS);

    CUdeviceptr base = 0;
    size_t size = 0;
    REQUIRE(cuMemGetAddressRange(&base, &size, p + kGran + 5) == CUDA_SUCCESS);
    CHECK(base == p);
    CHECK(size == 2 * kGran);
    CHECK(cuMemGetAddressRange(&base, &size, va) == CUDA_ERROR_NOT_FOUND);

    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_CONTEXT,           CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   CU_POINTER_ATTRIBUTE_RANGE_SIZE,        CU_POINTER_ATTRIBUTE_MAPPED,
                                   CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, CU_POINTER_ATTRIBUTE_MAPPING_SIZE};
    CUcontext owner = ctx;
    unsigned type = 0, mapped = 0;
    int ordinal = -1;
    CUdeviceptr start = 0, map_base = 0;
    size_t range = 0, map_size = 0;
    void* data[] = {&owner, &type, &ordinal, &start, &range, &mapped, &map_base, &map_size};
    REQUIRE(cuPointerGetAttributes(8, attrs, data, p + 7) == CUDA_SUCCESS);
    CHECK(owner == nullptr);  // VMM memory belongs to no context
    CHECK(type == CU_MEMORYTYPE_DEVICE);
    CHECK(ordinal == 1);
    CHECK(start == va);  // the reservation, per the driver documentation
    CHECK(range == 8 * kGran);
    CHECK(mapped == 1);
    CHECK(map_base == p);
    CHECK(map_size == 2 * kGran);

    // Reserved but unmapped: only the range and MAPPED=0 are known.
    REQUIRE(cuPointerGetAttributes(8, attrs, data, va + 1) == CUDA_SUCCESS);
    CHECK(mapped == 0);
    CHECK(start == va);
    CHECK(type == 0);
    CHECK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + 1) == CUDA_ERROR_INVALID_VALUE);

    REQUIRE(cuMemUnmap(p, 2 * kGran) == CUDA_SUCCESS);
    REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);
    REQUIRE(cuMemAddressFree(va, 8 * kGran) == CUDA_SUCCESS);
  }

  SECTION("unknown host memory") {
    int local = 0;
    auto hp = reinterpret_cast<CUdeviceptr>(&local);
    unsigned type = 7;
    CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    void* data[] = {&type};
    REQUIRE(cuPointerGetAttributes(1, &attr, data, hp) == CUDA_SUCCESS);
    CHECK(type == 0);
    CHECK(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hp) == CUDA_ERROR_INVALID_VALUE);

    REQUIRE(cuMemHostRegister(&local, sizeof local, 0) == CUDA_SUCCESS);
    REQUIRE(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, hp) == CUDA_SUCCESS);
    CHECK(type == CU_MEMORYTYPE_HOST);
    CHECK(cuMemHostRegister(&local, sizeof local, 0) == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    REQUIRE(cuMemHostUnregister(&local) == CUDA_SUCCESS);
    CHECK(cuMemHostUnregister(&local) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  }
}

TEST_CASE("An exported shareable handle imports to the same bytes", "[simcuda][vmm]") {
  setup();
  CUmemAllocationProp prop = device_prop(0, true);
  CUmemGenericAllocationHandle h = 0;
  REQUIRE(cuMemCreate(&h, kGran, &prop, 0) == CUDA_SUCCESS);
  int fd = -1;
  REQUIRE(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS);
  REQUIRE(fd >= 0);

  CUdeviceptr a = 0;
  REQUIRE(cuMemAddressReserve(&a, kGran, 0, 0, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemMap(a, kGran, 0, h, 0) == CUDA_SUCCESS);
  CUmemAccessDesc access = rw(0);
  REQUIRE(cuMemSetAccess(a, kGran, &access, 1) == CUDA_SUCCESS);
  REQUIRE(cuMemsetD32(a, 0x5a5a5a5au, kGran / 4) == CUDA_SUCCESS);

  const uint64_t used = simcuda_used_bytes(0);
  SECTION("in this process") {
    CUmemGenericAllocationHandle imported = 0;
    REQUIRE(cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_SUCCESS);
    CHECK(imported != h);
    CHECK(simcuda_used_bytes(0) == used);  // the creator pays, once
    CUdeviceptr b = 0;
    REQUIRE(cuMemAddressReserve(&b, kGran, 0, 0, 0) == CUDA_SUCCESS);
    REQUIRE(cuMemMap(b, kGran, 0, imported, 0) == CUDA_SUCCESS);
    REQUIRE(cuMemSetAccess(b, kGran, &access, 1) == CUDA_SUCCESS);
    CHECK(reinterpret_cast<uint32_t*>(b)[100] == 0x5a5a5a5au);
    reinterpret_cast<uint32_t*>(b)[7] = 42;
    CHECK(reinterpret_cast<uint32_t*>(a)[7] == 42);
    REQUIRE(cuMemUnmap(b, kGran) == CUDA_SUCCESS);
    REQUIRE(cuMemRelease(imported) == CUDA_SUCCESS);
    REQUIRE(cuMemAddressFree(b, kGran) == CUDA_SUCCESS);
  }

  SECTION("in another process") {
    int rc = run_in_child([fd] {
      if (child_setup() != CUDA_SUCCESS) return 1;
      CUmemGenericAllocationHandle imported = 0;
      if (cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS) {
        return 2;
      }
      CUdeviceptr b = 0;
      CUmemAccessDesc acc = rw(0);
      if (cuMemAddressReserve(&b, kGran, 0, 0, 0) != CUDA_SUCCESS ||
          cuMemMap(b, kGran, 0, imported, 0) != CUDA_SUCCESS || cuMemSetAccess(b, kGran, &acc, 1) != CUDA_SUCCESS) {
        return 3;
      }
      if (reinterpret_cast<uint32_t*>(b)[100] != 0x5a5a5a5au) return 4;
      reinterpret_cast<uint32_t*>(b)[9] = 4242;
      return 0;
    });
    REQUIRE(rc == 0);
    CHECK(reinterpret_cast<uint32_t*>(a)[9] == 4242);
    CHECK(simcuda_used_bytes(0) == used);
  }

  CUmemAllocationProp plain = device_prop(0);
  CUmemGenericAllocationHandle h2 = 0;
  REQUIRE(cuMemCreate(&h2, kGran, &plain, 0) == CUDA_SUCCESS);
  int fd2 = -1;
  CHECK(cuMemExportToShareableHandle(&fd2, h2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) ==
        CUDA_ERROR_INVALID_VALUE);
  REQUIRE(cuMemRelease(h2) == CUDA_SUCCESS);

  close(fd);
  REQUIRE(cuMemUnmap(a, kGran) == CUDA_SUCCESS);
  REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);
  REQUIRE(cuMemAddressFree(a, kGran) == CUDA_SUCCESS);
}

TEST_CASE("Capacity is shared by every process of the ledger", "[simcuda][capacity]") {
  setup();
  const uint64_t used0 = simcuda_used_bytes(0);
  REQUIRE(used0 + 4 * kGran < kCapacity);
  const size_t child_bytes = (kCapacity - used0) / kGran * kGran - kGran;  // leaves one granule

  int to_child[2], to_parent[2];
  REQUIRE(pipe(to_child) == 0);
  REQUIRE(pipe(to_parent) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child: hold most of device 0, tell the parent, free when told, and exit in order.
    close(to_parent[0]);
    close(to_child[1]);
    char c = 'x';
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp prop = device_prop(0);
    int rc = 0;
    if (child_setup() != CUDA_SUCCESS || cuMemCreate(&h, child_bytes, &prop, 0) != CUDA_SUCCESS) rc = 1;
    c = rc == 0 ? 'a' : 'e';
    if (write(to_parent[1], &c, 1) != 1 || read(to_child[0], &c, 1) != 1) rc = 2;
    if (rc == 0 && cuMemRelease(h) != CUDA_SUCCESS) rc = 3;
    c = 'f';
    if (write(to_parent[1], &c, 1) != 1) rc = 4;
    // A second allocation that is never freed: the exit hook must give it back.
    CUdeviceptr leak = 0;
    if (rc == 0 && cuMemAlloc(&leak, kGran) != CUDA_SUCCESS) rc = 5;
    std::exit(rc);
  }
  // Only the child writes to_parent, so its death reads as end of file rather than a hang; and
  // whatever fails below, the child is let go (end of file on to_child) and reaped.
  close(to_parent[1]);
  close(to_child[0]);
  struct Reaper {
    pid_t pid;
    int to_child_w;
    int to_parent_r;
    int status = -1;
    void finish() {
      if (pid <= 0) return;
      close(to_child_w);
      close(to_parent_r);
      waitpid(pid, &status, 0);
      pid = -1;
    }
    ~Reaper() { finish(); }
  } reaper{pid, to_child[1], to_parent[0]};
  char c = 0;
  REQUIRE(read(to_parent[0], &c, 1) == 1);
  REQUIRE(c == 'a');
  CHECK(simcuda_used_bytes(0) == used0 + child_bytes);

  size_t free_bytes = 0, total = 0;
  REQUIRE(cuMemGetInfo(&free_bytes, &total) == CUDA_SUCCESS);
  CHECK(total == kCapacity);
  CHECK(free_bytes == kCapacity - used0 - child_bytes);

  CUmemAllocationProp prop = device_prop(0);
  CUmemGenericAllocationHandle h = 0;
  CHECK(cuMemCreate(&h, 2 * kGran, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY);
  CUdeviceptr d = 0;
  CHECK(cuMemAlloc(&d, 2 * kGran) == CUDA_ERROR_OUT_OF_MEMORY);
  // Device 1 has its own capacity.
  CUmemAllocationProp prop1 = device_prop(1);
  REQUIRE(cuMemCreate(&h, 2 * kGran, &prop1, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);

  c = 'g';
  REQUIRE(write(to_child[1], &c, 1) == 1);
  REQUIRE(read(to_parent[0], &c, 1) == 1);
  REQUIRE(c == 'f');
  REQUIRE(cuMemCreate(&h, 2 * kGran, &prop, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemRelease(h) == CUDA_SUCCESS);

  reaper.finish();
  CHECK(WIFEXITED(reaper.status));
  CHECK(WEXITSTATUS(reaper.status) == 0);
  CHECK(simcuda_used_bytes(0) == used0);
}

TEST_CASE("SIMCUDA_FAIL_AFTER_CREATES makes cuMemCreate run out", "[simcuda][capacity]") {
  setup();
  int rc = run_in_child([] {
    setenv("SIMCUDA_FAIL_AFTER_CREATES", "2", 1);  // read by the child's own cuInit
    if (child_setup() != CUDA_SUCCESS) return 1;
    CUmemAllocationProp prop = device_prop(0);
    CUmemGenericAllocationHandle h[3] = {};
    if (cuMemCreate(&h[0], kGran, &prop, 0) != CUDA_SUCCESS) return 2;
    if (cuMemCreate(&h[1], kGran, &prop, 0) != CUDA_SUCCESS) return 3;
    if (cuMemCreate(&h[2], kGran, &prop, 0) != CUDA_ERROR_OUT_OF_MEMORY) return 4;
    cuMemRelease(h[0]);
    cuMemRelease(h[1]);
    return 0;
  });
  CHECK(rc == 0);
}
