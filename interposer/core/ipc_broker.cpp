// SPDX-License-Identifier: Apache-2.0
// The exporter's and importer's side of legacy IPC brokered by tmsdiskd (ipc_broker.h).
#include "ipc_broker.h"

#include <cerrno>
#include <mutex>
#include <string>
#include <variant>

#include "driver.h"
#include "log.h"

namespace tmsdisk::shim {

Result<uint64_t> IpcBroker::share(const std::shared_ptr<Allocation>& a) noexcept {
  uint64_t export_id = 0;
  Status rc = control_.call([&]() -> Status {
    UniqueFd fd;
    {
      // No free of this allocation while its handle is exported (pauses run on this thread).
      std::unique_lock lock(op_lock_);
      if (registry().find(a->base) != a) {
        return make_error(EINVAL, "the allocation was freed");
      }
      if (a->state.load() != AllocState::Resident) {
        return make_error(EAGAIN, "the allocation is paused");
      }
      if (a->export_id) {
        export_id = a->export_id;
        return {};
      }
      int raw = -1;
      const CUresult r =
          driver().api.cuMemExportToShareableHandle(&raw, a->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) {
        return make_error(ENOTSUP,
                          std::string("cannot export the allocation's physical memory as a file descriptor (") +
                              cu_error_name(r) + "); this device or driver lacks POSIX file descriptor handles");
      }
      fd.reset(raw);
    }
    // The round trip runs without the lock: frees in the meantime must not wait for the daemon.
    proto::IpcExport m;
    m.bytes = a->mapped;
    m.device = a->device;
    proto::Envelope reply;
    if (Status st = session_.exchange(m, fd.get(), reply, nullptr); !st) return st;
    const auto* done = std::get_if<proto::IpcExported>(&reply.body);
    if (!done) {
      return make_error(EPROTO, "unexpected answer to IPC_EXPORT");
    }
    std::unique_lock lock(op_lock_);
    if (registry().find(a->base) != a) {
      // Freed while the daemon was answering: its free could not name the export yet.
      notify(proto::IpcRevoke{.export_id = done->export_id, .freed = 1});
      return make_error(EINVAL, "the allocation was freed");
    }
    a->export_id = done->export_id;
    export_id = done->export_id;
    return {};
  });
  if (!rc) return std::move(rc).error();
  return export_id;
}

Result<IpcBroker::Opened> IpcBroker::open(uint64_t export_id) noexcept {
  Opened out;
  Status rc = control_.call([&]() -> Status {
    proto::IpcOpen m;
    m.export_id = export_id;
    proto::Envelope reply;
    Status exchanged = session_.exchange(m, -1, reply, &out.fd);
    const bool refused = std::holds_alternative<proto::ErrorReply>(reply.body);
    const auto* opened = exchanged ? std::get_if<proto::IpcOpened>(&reply.body) : nullptr;
    if (opened && out.fd && opened->export_id == export_id) {
      out.info = *opened;
      return {};
    }
    if (exchanged) exchanged = make_error(EPROTO, "tmsdiskd's answer to IPC_OPEN carries no memory");
    out.fd.reset();
    // Unless the daemon said no, it may have counted the open (the answer was lost, or came
    // without its descriptor): close it there, or the exporter could never pause it again.
    if (!refused) notify(proto::IpcClose{.export_id = export_id});
    return exchanged;
  });
  if (!rc) return std::move(rc).error();
  return out;
}

Status IpcBroker::close(uint64_t export_id) noexcept {
  return control_.call([&]() -> Status {
    proto::IpcClose m;
    m.export_id = export_id;
    proto::Envelope reply;
    return session_.exchange(m, -1, reply, nullptr);
  });
}

void IpcBroker::forget(uint64_t export_id) noexcept {
  (void)control_.post([this, export_id] { notify(proto::IpcRevoke{.export_id = export_id, .freed = 1}); }, false);
}

void IpcBroker::revoke(std::vector<std::shared_ptr<Allocation>>& resident,
                       std::vector<std::shared_ptr<Allocation>>& revoked) {
  for (auto it = resident.begin(); it != resident.end();) {
    Allocation& a = **it;
    if (!a.export_id) {
      ++it;
      continue;
    }
    proto::IpcRevoke m;
    m.export_id = a.export_id;
    proto::Envelope reply;
    const Status rc = session_.exchange(m, -1, reply, nullptr);
    if (rc) {
      revoked.push_back(*it);
      ++it;
      continue;
    }
    const std::string& why = rc.error().message;
    if (rc.error().errnum() == EBUSY) {
      TMS_INFO("allocation %llu stays resident: %s", static_cast<unsigned long long>(a.id), why.c_str());
    } else if (rc.error().errnum() == ENOENT) {
      // The daemon lost the export (it restarted): whoever opened it before may still use it.
      TMS_WARN("allocation %llu stays resident for good: tmsdiskd no longer knows its legacy IPC export",
               static_cast<unsigned long long>(a.id));
      registry().pin(a, proto::Unmanaged::Exported);
    } else {
      TMS_WARN("allocation %llu stays resident: cannot revoke its legacy IPC export: %s",
               static_cast<unsigned long long>(a.id), why.c_str());
    }
    it = resident.erase(it);
  }
}

void IpcBroker::refresh(Allocation& a) noexcept {
  try {
    const DriverApi& api = driver().api;
    int fd = -1;
    CUresult r = api.cuMemExportToShareableHandle(&fd, a.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    Status rc = make_error(ENOTSUP, std::string("cuMemExportToShareableHandle: ") + cu_error_name(r));
    if (r == CUDA_SUCCESS) {
      UniqueFd owned(fd);
      proto::IpcExport m;
      m.export_id = a.export_id;
      m.bytes = a.mapped;
      m.device = a.device;
      proto::Envelope reply;
      rc = session_.exchange(m, owned.get(), reply, nullptr);
    }
    if (rc) return;
    // Handles given out before the pause no longer open; a new cuIpcGetMemHandle exports it anew.
    TMS_WARN("allocation %llu: cannot share its memory again through legacy IPC: %s",
             static_cast<unsigned long long>(a.id), rc.error().message.c_str());
    notify(proto::IpcRevoke{.export_id = a.export_id, .freed = 1});
    a.export_id = 0;
  } catch (...) {
    a.export_id = 0;
  }
}

void IpcBroker::on_users(const proto::IpcUsers& m) {
  for (const auto& a : registry().snapshot()) {
    if (a->export_id == m.export_id) {
      registry().set_importers(*a, m.importers);
      return;
    }
  }
}

void IpcBroker::notify(const proto::Message& m) {
  try {
    if (!session_.connected() || session_.send(session_.next_id(), m) < 0) pending_.push_back(m);
  } catch (...) {
    TMS_WARN("out of memory: a legacy IPC close or forget is lost");
  }
}

void IpcBroker::session_started(bool adopted) {
  if (adopted) {
    // The daemon kept our session: what waited for it goes now (answers are not awaited).
    for (const auto& m : pending_) (void)session_.send(session_.next_id(), m);
    pending_.clear();
    return;
  }
  pending_.clear();  // addressed to a session the daemon no longer has
  for (const auto& a : registry().snapshot()) {
    if (!a->export_id) continue;
    // Exported before the daemon restarted: whoever opened it may still map it, and the new daemon
    // cannot say. Resident memory stays so for good; paused memory was open nowhere (a pause needs
    // that), so it only loses its id. A new cuIpcGetMemHandle exports it anew.
    if (a->state.load() == AllocState::Resident) {
      registry().pin(*a, proto::Unmanaged::Exported);
      TMS_WARN("allocation %llu stays resident for good: tmsdiskd lost its legacy IPC export (restart)",
               static_cast<unsigned long long>(a->id));
    }
    a->export_id = 0;
  }
}

}  // namespace tmsdisk::shim
