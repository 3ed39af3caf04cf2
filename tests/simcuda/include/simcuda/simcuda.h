// SPDX-License-Identifier: Apache-2.0
// The simcuda-only introspection API: tests link it or find it with dlsym on libcuda.so.1.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SIMCUDA_API __attribute__((visibility("default")))

// Bytes charged on `device` by every process sharing SIMCUDA_STATE (0 before cuInit).
SIMCUDA_API uint64_t simcuda_used_bytes(int device);
// Capacity of `device` (SIMCUDA_DEVICE_MEM_MB), 0 before cuInit or for a bad ordinal.
SIMCUDA_API uint64_t simcuda_capacity_bytes(int device);
// Bytes this process has charged, over all devices.
SIMCUDA_API uint64_t simcuda_held_bytes(void);
// 1 when every byte of [addr, addr+len) is backed by physical memory in this process (a VMM mapping,
// a cuMemAlloc allocation or an opened IPC handle), whatever its access flags; 0 otherwise. From
// simcuda's own tables: asking never touches, and so never faults on, the memory.
SIMCUDA_API int simcuda_is_mapped(unsigned long long addr, size_t len);
// Bytes of device address space backed by physical memory in this process.
SIMCUDA_API uint64_t simcuda_mapped_bytes(void);

#ifdef __cplusplus
}
#endif
