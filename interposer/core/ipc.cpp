// SPDX-License-Identifier: Apache-2.0
// Legacy CUDA IPC for the shim's own allocations, brokered by tmsdiskd (README.md, "Known limitations").
//
// The shim backs cuMemAlloc with VMM memory, which the driver never shares through legacy IPC. So
// cuIpcGetMemHandle on it hands the physical memory to the daemon as a POSIX fd and returns a
// handle naming the export; a shimmed importer's cuIpcOpenMemHandle asks the daemon for the fd and
// maps it. The exchanges with the daemon are the broker's (ipc_broker.h); this file holds the hooks
// and the importer's mappings.
// Native allocations (below TMSDISK_MIN_BYTES, devices without VMM) keep the driver's own IPC.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "config.h"
#include "driver.h"
#include "engine.h"
#include "gate.h"
#include "log.h"
#include "registry.h"
#include "shim.h"

namespace tmsdisk::shim {
namespace {

// What a brokered CUipcMemHandle holds. The magic tells it from the driver's own handles (which a
// shimmed importer passes through unchanged); only the export id is trusted, and only by the daemon.
constexpr char kMagic[8] = {'T', 'M', 'S', 'D', 'I', 'P', 'C', '1'};
struct BrokeredHandle {
  char magic[8];
  uint64_t export_id;
  uint64_t bytes;
  int32_t exporter_pid;
  int32_t device;
};
static_assert(sizeof(BrokeredHandle) <= CU_IPC_HANDLE_SIZE);

bool parse(const CUipcMemHandle& h, BrokeredHandle* out) {
  std::memcpy(out, h.reserved, sizeof(*out));
  return std::memcmp(out->magic, kMagic, sizeof(kMagic)) == 0 && out->export_id != 0;
}

// Memory this process opened through the daemon, by the address it was mapped at.
struct Import {
  uint64_t export_id = 0;
  CUmemGenericAllocationHandle handle = 0;
  std::size_t bytes = 0;
  CUcontext ctx = nullptr;
  uint32_t refs = 0;  // opens of the same handle share one mapping, as with the driver
};
struct Imports {
  std::mutex mu;  // also serializes opens, so two threads opening one handle share the mapping
  std::map<CUdeviceptr, Import> by_base;
};
Imports& imports() {
  static auto* t = new Imports;  // never destroyed: hooks may run during static destruction
  return *t;
}

CUresult open_brokered(const DriverApi& api, const BrokeredHandle& h, CUdeviceptr* pdptr) {
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  if (api.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx || api.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
    return CUDA_ERROR_INVALID_CONTEXT;
  Imports& t = imports();
  std::lock_guard lock(t.mu);
  for (auto& [base, imp] : t.by_base) {
    if (imp.export_id == h.export_id) {
      ++imp.refs;
      *pdptr = base;
      return CUDA_SUCCESS;
    }
  }
  Engine* e = Engine::instance();
  if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
  Result<IpcBroker::Opened> opened = e->ipc().open(h.export_id);
  if (!opened) {
    const int rc = -opened.error().errnum();
    TMS_WARN("cuIpcOpenMemHandle: %s", opened.error().message.c_str());
    if (rc == -EINVAL) return CUDA_ERROR_INVALID_CONTEXT;  // our own handle, refused like the driver does
    if (rc == -EAGAIN) return kGateClosedError;            // the exporter is paused
    if (rc == -ENOMEM) return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  const proto::IpcOpened& info = opened->info;
  UniqueFd& fd = opened->fd;
  auto undo = [&](const char* what, CUresult r) {
    TMS_WARN("cuIpcOpenMemHandle: %s failed (%s) for export %llu", what, cu_error_name(r),
             static_cast<unsigned long long>(h.export_id));
    (void)e->ipc().close(h.export_id);
    return r;
  };
  const std::size_t bytes = info.bytes;
  CUmemGenericAllocationHandle mem = 0;
  CUresult r = api.cuMemImportFromShareableHandle(&mem, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  fd.reset();  // the imported handle holds the memory now
  if (r != CUDA_SUCCESS) return undo("cuMemImportFromShareableHandle", r);
  CUdeviceptr va = 0;
  r = api.cuMemAddressReserve(&va, bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(mem);
    return undo("cuMemAddressReserve", r);
  }
  r = api.cuMemMap(va, bytes, 0, mem, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = api.cuMemSetAccess(va, bytes, &access, 1);
    if (r != CUDA_SUCCESS) api.cuMemUnmap(va, bytes);
  }
  if (r != CUDA_SUCCESS) {
    api.cuMemRelease(mem);
    api.cuMemAddressFree(va, bytes);
    return undo("mapping the imported memory", r);
  }
  try {
    t.by_base.emplace(va, Import{h.export_id, mem, bytes, ctx, 1});
  } catch (...) {
    api.cuMemUnmap(va, bytes);
    api.cuMemRelease(mem);
    api.cuMemAddressFree(va, bytes);
    return undo("recording the import", CUDA_ERROR_OUT_OF_MEMORY);
  }
  registry().add_unmanaged(va, bytes, proto::Unmanaged::Imported);
  TMS_DEBUG("opened export %llu of pid %d: %zu bytes at 0x%llx", static_cast<unsigned long long>(h.export_id),
            info.exporter_pid, bytes, static_cast<unsigned long long>(va));
  *pdptr = va;
  return CUDA_SUCCESS;
}

template <class Real>
CUresult open_hook(const Driver& d, Real real, CUdeviceptr* pdptr, const CUipcMemHandle& handle, unsigned int flags) {
  BrokeredHandle h;
  if (!parse(handle, &h)) return real(pdptr, handle, flags);  // the driver's own handle
  if (!pdptr || (flags & ~static_cast<unsigned>(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  ensure_init();
  try {
    return open_brokered(d.api, h, pdptr);
  } catch (...) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Hooks

namespace hook {

CUresult cuIpcGetMemHandle(CUipcMemHandle* pHandle, CUdeviceptr dptr) noexcept {
  return intercept<&DriverApi::cuIpcGetMemHandle>(
      [&](const Driver& d) -> CUresult {
        try {
          std::shared_ptr<Allocation> a = registry().find(dptr);
          if (!pHandle || !a || a->app_vmm) return d.api.cuIpcGetMemHandle(pHandle, dptr);  // the driver's own IPC
          ensure_init();
          Engine* e = Engine::instance();
          if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
          for (int attempt = 0;; ++attempt) {
            {
              // Paused memory has no physical memory to share: wait, resume or fail (TMSDISK_ON_TOUCH).
              // Not held across the export, which runs on the control thread that also runs pauses.
              GateScope gate("cuIpcGetMemHandle", [&]() noexcept { return gate::range_touch(dptr, 1); });
              if (gate.result() != CUDA_SUCCESS) return gate.result();
            }
            Result<uint64_t> exported = e->ipc().share(a);
            const int rc = exported ? 0 : -exported.error().errnum();
            if (rc == -EAGAIN && attempt < 100) continue;  // paused again between the gate and the export
            if (rc < 0) {
              TMS_WARN("cuIpcGetMemHandle: %s; legacy IPC of memory tmsdisk manages goes through tmsdiskd",
                       exported.error().message.c_str());
              if (rc == -ENOMEM) return CUDA_ERROR_OUT_OF_MEMORY;
              if (rc == -EINVAL) return CUDA_ERROR_INVALID_VALUE;
              return CUDA_ERROR_NOT_SUPPORTED;
            }
            BrokeredHandle h{};
            std::memcpy(h.magic, kMagic, sizeof(kMagic));
            h.export_id = *exported;
            h.bytes = a->mapped;
            h.exporter_pid = static_cast<int32_t>(::getpid());
            h.device = a->device;
            std::memset(pHandle, 0, sizeof(*pHandle));
            std::memcpy(pHandle->reserved, &h, sizeof(h));
            return CUDA_SUCCESS;
          }
        } catch (...) {
          return CUDA_ERROR_OUT_OF_MEMORY;
        }
      },
      pHandle, dptr);
}

CUresult cuIpcOpenMemHandle(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) noexcept {
  return intercept<&DriverApi::cuIpcOpenMemHandle>(
      [&](const Driver& d) -> CUresult { return open_hook(d, d.api.cuIpcOpenMemHandle, pdptr, handle, Flags); }, pdptr,
      handle, Flags);
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr, CUipcMemHandle handle, unsigned int Flags) noexcept {
  return intercept<&DriverApi::cuIpcOpenMemHandle_v2>(
      [&](const Driver& d) -> CUresult { return open_hook(d, d.api.cuIpcOpenMemHandle_v2, pdptr, handle, Flags); },
      pdptr, handle, Flags);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) noexcept {
  return intercept<&DriverApi::cuIpcCloseMemHandle>(
      [&](const Driver& d) -> CUresult {
        try {
          Import imp;
          {
            Imports& t = imports();
            std::lock_guard lock(t.mu);
            auto it = t.by_base.find(dptr);
            if (it == t.by_base.end()) return d.api.cuIpcCloseMemHandle(dptr);
            if (--it->second.refs > 0) return CUDA_SUCCESS;
            imp = it->second;
            t.by_base.erase(it);
          }
          // Unmapped and closed outside the lock: other threads' opens and closes do not wait on this one.
          registry().remove_unmanaged(dptr);
          {
            // Work of this process still reading the memory finishes before it is unmapped.
            CtxScope scope(d.api, imp.ctx);
            if (scope.ok()) (void)d.api.cuCtxSynchronize();
          }
          d.api.cuMemUnmap(dptr, imp.bytes);
          d.api.cuMemRelease(imp.handle);
          d.api.cuMemAddressFree(dptr, imp.bytes);
          if (Engine* e = Engine::instance()) {
            if (Status closed = e->ipc().close(imp.export_id); !closed)
              TMS_DEBUG("closing legacy IPC export %llu: %s", static_cast<unsigned long long>(imp.export_id),
                        closed.error().message.c_str());
          }
          return CUDA_SUCCESS;
        } catch (...) {
          return CUDA_ERROR_UNKNOWN;
        }
      },
      dptr);
}

}  // namespace hook
}  // namespace tmsdisk::shim
