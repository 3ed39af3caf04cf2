// SPDX-License-Identifier: Apache-2.0
// What libtmsdisk.so exports, as the build reads it: never compiled, only preprocessed, and
// make_version_script.cmake turns the result into libtmsdisk.map. The exports are thus the hook table
// and the C API themselves, not a hand-kept copy of them (HAMi-core's three lists kept in sync by CI).
#include "hook_table.h"
#include "tms_entry_points.h"
#include "tmsdisk.h"  // its function declarations are the C API

#define TMSDISK_X(name, ...) TMSDISK_EXPORT_HOOK(name)
TMSDISK_HOOKS(TMSDISK_X)
#undef TMSDISK_X

// hooks.cpp replaces dlsym: programs that dlopen libcuda and look it up by name get the hooks too.
TMSDISK_EXPORT_RESOLVER(dlsym)

// torch_memory_saver's C entry points, for programs written against its binary.
#define TMSDISK_X(ret, name, ...) TMSDISK_EXPORT_TMS(name)
TMSDISK_TMS_ENTRY_POINTS(TMSDISK_X)
#undef TMSDISK_X
