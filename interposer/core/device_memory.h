// SPDX-License-Identifier: Apache-2.0
// What a pause and a resume do to an allocation's physical memory with the driver: let every context
// using it finish, release it once its bytes are saved, and create and map it again at the same
// address with the original access rights (or zero-filled, when its data is lost or discarded).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cuda_api.h"
#include "registry.h"
#include "tmsdisk/common/result.h"
#include "transfer.h"

namespace tmsdisk::shim {

// "cuMemUnmap failed: CUDA_ERROR_... (N)".
std::string cuda_failure(const char* what, CUresult r);
// Every context that `list` was used from, and the active primary contexts of peers granted access,
// finish their work (before the memory is copied or released).
Status synchronize_users(const std::vector<std::shared_ptr<Allocation>>& list);
// Unmaps and releases `a`'s physical memory (its handle becomes 0). A failed unmap leaves it mapped
// and resident (the error); a failed release is logged (the memory may leak) and counts as done.
Status release_memory(Allocation& a);
// Resume: new physical memory with the original properties, at the same address, with the original
// access rights (peers included), in j.handle (j.mapped).
Status map_job(TransferJob& j);
// Undoes map_job (a job that failed).
void unmap_job(TransferJob& j) noexcept;
// The loss of a damaged allocation is accepted: new memory as map_job makes it, zero-filled (the
// driver does not clear what cuMemCreate hands out), instead of the data.
Status zero_fill(TransferJob& j);

}  // namespace tmsdisk::shim
