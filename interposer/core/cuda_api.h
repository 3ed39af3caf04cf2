// SPDX-License-Identifier: Apache-2.0
// The CUDA driver API as the shim sees it: cuda.h with every entry point named by its exported symbol.
#pragma once

#include <cuda.h>

// cuda.h maps cuGetProcAddress to cuGetProcAddress_v2. libcuda exports both (the unversioned one is
// the four-argument CUDA 11 resolver), and the hook table names each entry point by its exported
// symbol, so the macro must not rewrite the legacy name.
#undef cuGetProcAddress

// cuda.h also maps these base names to their newest variant. The hook table defines the older
// exported functions of the same names too (a program built against an older cuda.h calls them).
#undef cuMemPrefetchAsync
#undef cuStreamBeginCapture
#undef cuMemcpyBatchAsync
#undef cuMemcpy3DBatchAsync
#undef cuStreamWriteValue32
#undef cuStreamWaitValue32
#undef cuStreamWriteValue64
#undef cuStreamWaitValue64
#undef cuStreamBatchMemOp
#undef cuIpcOpenMemHandle
