// SPDX-License-Identifier: Apache-2.0
// torch_memory_saver's C entry points (its csrc/entrypoint.cpp at commit 4a43c97), which its Python
// layer and tests call through ctypes, with its signatures and meaning: a program that loads TMS's
// binary by path, or looks these names up in the process (ctypes.CDLL(None)), works with libtmsdisk.so
// in its place. One table: hooks.cpp exports each name, forwarding to tms_api.cpp
// (tmsdisk::shim::tms::<name>), and version_script.cpp lists them for the version script.
//
// X(return type, name, parameters, arguments)
#pragma once

#include <cstdint>

#define TMSDISK_TMS_ENTRY_POINTS(X)                                      \
  X(void, tms_set_interesting_region, (bool interesting), (interesting)) \
  X(bool, tms_get_interesting_region, (void), ())                        \
  X(void, tms_set_current_tag, (const char* tag), (tag))                 \
  X(const char*, tms_get_current_tag, (void), ())                        \
  X(void, tms_set_enable_cpu_backup, (bool enable), (enable))            \
  X(bool, tms_get_enable_cpu_backup, (void), ())                         \
  X(void, tms_set_cpu_backup_backend, (const char* backend), (backend))  \
  X(const char*, tms_get_cpu_backup_backend, (void), ())                 \
  X(void, tms_set_enable_disk_backup, (bool enable), (enable))           \
  X(bool, tms_get_enable_disk_backup, (void), ())                        \
  X(void, tms_set_disk_backup_dir, (const char* dir), (dir))             \
  X(void, set_memory_margin_bytes, (uint64_t bytes), (bytes))            \
  X(void, tms_set_retain_cpu_backup, (bool retain), (retain))            \
  X(bool, tms_get_retain_cpu_backup, (void), ())                         \
  X(int, tms_pause, (const char* tag), (tag))                            \
  X(int, tms_resume, (const char* tag), (tag))                           \
  X(uint8_t*, tms_get_cpu_backup_pointer, (const uint8_t* gpu_ptr, uint64_t size), (gpu_ptr, size))

namespace tmsdisk::shim::tms {
#define TMSDISK_TMS_DECLARE(ret, name, params, args) ret name params noexcept;
TMSDISK_TMS_ENTRY_POINTS(TMSDISK_TMS_DECLARE)
#undef TMSDISK_TMS_DECLARE
}  // namespace tmsdisk::shim::tms
