// SPDX-License-Identifier: Apache-2.0
// What vmm.cpp offers the rest of the core: peer access to replay and pools to trim.
#pragma once

#include <vector>

#include "cuda_api.h"

namespace tmsdisk::shim {

// Adds the devices granted access to `owner`'s memory by cuCtxEnablePeerAccess to `access`.
void vmm_peer_access(CUdevice owner, std::vector<CUmemAccessDesc>& access);

// Called whenever an application mapping becomes a managed allocation (the engine starts its
// control thread then). Registered at initialization, so that vmm.cpp depends on nothing above it.
using ManagedHook = void (*)() noexcept;
void vmm_on_managed(ManagedHook hook) noexcept;

// cuMemPoolTrimTo(pool, 0) on every pool the program allocated from (and each device's current
// pool), so a pause hands their unused memory back too. Pool memory in use stays resident.
void vmm_trim_pools() noexcept;

}  // namespace tmsdisk::shim
