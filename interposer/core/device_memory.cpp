// SPDX-License-Identifier: Apache-2.0
// An allocation's physical memory through a pause and a resume (device_memory.h).
#include "device_memory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>

#include "driver.h"
#include "log.h"
#include "tmsdisk/common/human.h"
#include "vmm.h"

namespace tmsdisk::shim {

std::string cuda_failure(const char* what, CUresult r) {
  return fmt::format("{} failed: {} ({})", what, cu_error_name(r), static_cast<int>(r));
}

Status map_job(TransferJob& j) {
  const DriverApi& api = driver().api;
  Allocation& a = *j.a;
  CtxScope scope(api, a.ctx);
  auto fail = [&](int code, const char* what, CUresult r) {
    return make_error(code, fmt::format("{:#x} ({}): {}", a.base, human_bytes(a.size), cuda_failure(what, r)));
  };
  CUmemGenericAllocationHandle h = 0;
  CUresult r = api.cuMemCreate(&h, a.mapped, &a.prop, 0);
  if (r != CUDA_SUCCESS) return fail(r == CUDA_ERROR_OUT_OF_MEMORY ? ENOMEM : EIO, "cuMemCreate", r);
  r = api.cuMemMap(a.base, a.mapped, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(h);
    return fail(EIO, "cuMemMap", r);
  }
  // Devices that enabled peer access while this allocation was paused (allowed while only lost
  // memory is held back) see it too; the shim's own allocations only, as cuCtxEnablePeerAccess does.
  if (!a.app_vmm) {
    try {
      vmm_peer_access(a.device, a.access);
    } catch (...) {
      TMS_WARN("blob %llu: out of memory recording peer access; peers enabled while it was paused do not see it",
               static_cast<unsigned long long>(a.id));
    }
  }
  // Application mappings paused before their first cuMemSetAccess have no rights to restore.
  if (!a.access.empty()) r = api.cuMemSetAccess(a.base, a.mapped, a.access.data(), a.access.size());
  if (r != CUDA_SUCCESS) {
    api.cuMemUnmap(a.base, a.mapped);
    api.cuMemRelease(h);
    return fail(EIO, "cuMemSetAccess", r);
  }
  j.handle = h;
  j.mapped = true;
  return {};
}

void unmap_job(TransferJob& j) noexcept {
  if (!j.mapped) return;
  const DriverApi& api = driver().api;
  CtxScope scope(api, j.a->ctx);
  api.cuMemUnmap(j.a->base, j.a->mapped);
  api.cuMemRelease(j.handle);
  j.handle = 0;
  j.mapped = false;
}

Status zero_fill(TransferJob& j) {
  if (Status st = map_job(j); !st) return st;
  const DriverApi& api = driver().api;
  CtxScope scope(api, j.a->ctx);
  CUresult r = api.cuMemsetD8_v2 ? api.cuMemsetD8_v2(j.a->base, 0, j.a->mapped) : CUDA_ERROR_NOT_FOUND;
  if (r == CUDA_SUCCESS) r = api.cuCtxSynchronize();
  if (r != CUDA_SUCCESS) {
    unmap_job(j);
    return make_error(EIO, cuda_failure("cuMemsetD8", r));
  }
  return {};
}

Status synchronize_users(const std::vector<std::shared_ptr<Allocation>>& list) {
  const DriverApi& api = driver().api;
  std::vector<CUcontext> contexts;
  for (const auto& a : list)
    if (std::find(contexts.begin(), contexts.end(), a->ctx) == contexts.end()) contexts.push_back(a->ctx);
  for (CUcontext ctx : contexts) {
    CtxScope scope(api, ctx);
    if (!scope.ok()) return make_error(EIO, "cannot make an allocation's context current (was it destroyed?)");
    if (CUresult r = api.cuCtxSynchronize(); r != CUDA_SUCCESS)
      return make_error(EIO, cuda_failure("cuCtxSynchronize", r));
  }
  // Peer devices granted access (cuCtxEnablePeerAccess, application access lists) may have kernels
  // still writing this memory from their own contexts: synchronize their primary contexts too, those
  // that are active (retaining an inactive one would create it).
  if (api.cuDevicePrimaryCtxGetState && api.cuDevicePrimaryCtxRetain && api.cuDevicePrimaryCtxRelease_v2 &&
      api.cuDeviceGet) {
    std::vector<int> peers;
    for (const auto& a : list)
      for (const CUmemAccessDesc& d : a->access)
        if (d.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
            std::find(peers.begin(), peers.end(), d.location.id) == peers.end())
          peers.push_back(d.location.id);
    for (int ordinal : peers) {
      CUdevice dev;
      unsigned int flags = 0;
      int active = 0;
      CUcontext primary = nullptr;
      if (api.cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS ||
          api.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active ||
          api.cuDevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS)
        continue;
      CUresult r = CUDA_SUCCESS;
      if (std::find(contexts.begin(), contexts.end(), primary) == contexts.end()) {
        CtxScope scope(api, primary);
        r = scope.ok() ? api.cuCtxSynchronize() : CUDA_ERROR_INVALID_CONTEXT;
      }
      api.cuDevicePrimaryCtxRelease_v2(dev);
      if (r != CUDA_SUCCESS) return make_error(EIO, cuda_failure("cuCtxSynchronize (peer device)", r));
    }
  }
  return {};
}

Status release_memory(Allocation& a) {
  const DriverApi& api = driver().api;
  CtxScope scope(api, a.ctx);
  if (CUresult r = api.cuMemUnmap(a.base, a.mapped); r != CUDA_SUCCESS)
    return make_error(EIO, cuda_failure("cuMemUnmap", r));  // still mapped: the allocation stays resident
  if (CUresult r = api.cuMemRelease(a.handle); r != CUDA_SUCCESS)
    TMS_ERROR("blob %llu: %s; its physical memory may leak", static_cast<unsigned long long>(a.id),
              cuda_failure("cuMemRelease", r).c_str());
  a.handle = 0;
  return {};
}

}  // namespace tmsdisk::shim
