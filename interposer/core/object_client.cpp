// SPDX-License-Identifier: Apache-2.0
// The rank's side of its store of named objects (object_client.h).
#include "object_client.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <variant>

#include "config.h"
#include "driver.h"
#include "log.h"
#include "registry.h"

namespace tmsdisk::shim {
namespace {

Error cuda_error(const char* what, CUresult r) {
  return make_error(EIO, fmt::format("{} failed: {} ({})", what, cu_error_name(r), static_cast<int>(r)));
}

// Where `p` lies: the shim's own allocations (which the driver knows only as mappings) and memory the
// driver calls device memory are copied by the pipeline in their context; the caller's host memory,
// pageable or pinned, with memcpy, which needs no context. Device memory whose context cannot be
// found is refused: memcpy of it would fault.
enum class Memory { Host, Device, Unknown };
Memory memory_kind(const DriverApi& api, CUdeviceptr p, CUcontext* ctx) {
  if (auto a = registry().find(p)) {
    *ctx = a->ctx;
    return Memory::Device;
  }
  unsigned int type = 0;
  if (!api.cuPointerGetAttribute ||
      api.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS)
    return Memory::Host;  // the driver does not know it: the process's own memory
  if (type != CU_MEMORYTYPE_DEVICE) return Memory::Host;
  if (api.cuPointerGetAttribute(ctx, CU_POINTER_ATTRIBUTE_CONTEXT, p) == CUDA_SUCCESS && *ctx) return Memory::Device;
  return api.cuCtxGetCurrent(ctx) == CUDA_SUCCESS && *ctx ? Memory::Device : Memory::Unknown;
}

// The daemon's answer to a request that only says yes or no.
Status ok_reply(const proto::Envelope& reply, const char* what) {
  if (std::holds_alternative<proto::OkReply>(reply.body)) return {};
  return make_error(EPROTO, fmt::format("unexpected answer to {}", what));
}

}  // namespace

Result<uint64_t> ObjectClient::chunk_bytes() noexcept try {
  uint64_t chunk = 0;
  Status st = control_.call([&]() -> Status {
    if (!session_.connected())
      if (Status c = session_.connect(); !c) return c;
    chunk = slots_.chunk_bytes();
    return {};
  });
  if (!st) return std::move(st).error();
  return chunk;
} catch (...) {
  return make_error(ENOMEM, "out of memory asking for the chunk size");
}

Result<uint64_t> ObjectClient::open(std::string_view name, uint64_t size) noexcept {
  try {
    if (!valid_object_name(name))
      return make_error(
          EINVAL, fmt::format("'{}' is no object name: use {}", std::string(name).substr(0, 200), kObjectNameRule));
    if (size == 0) return make_error(EINVAL, "an object holds at least one byte");
    // The host-tier memory is pinned in the caller's context (portable: every context copies by DMA).
    CUcontext ctx = nullptr;
    if (driver().api.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) ctx = nullptr;
    const bool host = config().host_tier && config().store_host_tier;
    uint64_t handle = 0;
    // Looked up and made on the control thread, one open after another: two threads that open one
    // new name get one object (and one placement).
    Status st = control_.call([&]() -> Status {
      std::optional<std::size_t> removed;  // the slot of a removed object of that name: its handle again
      {
        std::lock_guard lock(mu_);
        for (std::size_t i = 0; i < objects_.size() && !removed; ++i) {
          if (objects_[i].name != name) continue;
          if (objects_[i].daemon_handle == 0) {
            removed = i;
          } else if (objects_[i].size != size) {
            return make_error(EEXIST, fmt::format("object '{}' holds {} bytes, not {}: remove it first",
                                                  objects_[i].name, objects_[i].size, size));
          } else {
            handle = i + 1;
            return {};
          }
        }
      }
      if (!session_.connected())
        if (Status c = session_.connect(); !c) return c;
      Object o{.name = std::string(name), .size = size};
      if (Status x = open_on_daemon(o, host, ctx); !x) return x;
      std::lock_guard lock(mu_);
      if (removed) {
        objects_[*removed] = std::move(o);
        handle = *removed + 1;
      } else {
        objects_.push_back(std::move(o));
        handle = objects_.size();
      }
      return {};
    });
    if (!st) return std::move(st).error();
    return handle;
  } catch (...) {
    return make_error(ENOMEM, "out of memory opening an object");
  }
}

Status ObjectClient::open_on_daemon(Object& o, bool host, CUcontext ctx) {
  const uint8_t flags = host ? proto::kStoreOpenHost : 0;
  if (host && before_host_open_) before_host_open_();
  proto::Envelope reply;
  UniqueFd memory;
  if (Status x =
          session_.exchange(proto::StoreOpen{.name = o.name, .size = o.size, .flags = flags}, -1, reply, &memory);
      !x)
    return x;
  const auto* opened = std::get_if<proto::StoreOpened>(&reply.body);
  if (!opened) return make_error(EPROTO, "unexpected answer to STORE_OPEN");
  o.daemon_handle = opened->handle;
  o.connection = session_.connection();
  if (!opened->host_bytes) return {};
  auto mapped = map_host(o, opened->host_bytes, std::move(memory), ctx);
  if (mapped) {
    o.host = std::move(*mapped);
    return {};
  }
  // The object is new and empty: removed (its memory with it) and made again on disk.
  TMS_WARN("object '%s': %s; it lives on disk instead", o.name.c_str(), mapped.error().describe().c_str());
  if (Status x = session_.exchange(proto::StoreRemove{.name = o.name}, -1, reply, nullptr); !x) return x;
  return open_on_daemon(o, false, ctx);
}

Result<std::shared_ptr<ObjectClient::HostCopy>> ObjectClient::map_host(const Object& o, uint64_t bytes, UniqueFd memory,
                                                                       CUcontext ctx) {
  const uint64_t chunk = slots_.chunk_bytes();
  if (!memory || chunk == 0 || bytes < o.size || bytes - o.size >= chunk ||
      !RegisteredMapping::holds(memory.get(), bytes))
    return make_error(EPROTO,
                      "tmsdiskd's STORE_OPENED names host-tier memory it did not send, or not the object's size");
  auto host = std::make_shared<HostCopy>();
  if (Status st = host->mapping.map(memory.get(), bytes, "object's host-tier memory"); !st)
    return std::move(st).error();
  host->fd = std::move(memory);
  (void)::madvise(host->mapping.data(), host->mapping.bytes(), MADV_HUGEPAGE);  // as the daemon made it
  if (ctx && RegisteredMapping::can_pin())
    if (const CUresult r = host->mapping.pin(ctx); r != CUDA_SUCCESS)
      TMS_WARN(
          "object '%s': cannot pin its host-tier memory (cuMemHostRegister failed: %s (%d)); its copies will be "
          "slower",
          o.name.c_str(), cu_error_name(r), static_cast<int>(r));
  host->written.assign(bytes / chunk, 0);
  TMS_INFO("object '%s': %llu bytes in the host tier", o.name.c_str(), static_cast<unsigned long long>(o.size));
  return host;
}

Status ObjectClient::remove(std::string_view name) noexcept {
  try {
    const std::string n(name);
    // On the control thread, after the ranges queued before it: they still find the object as it was.
    return control_.call([&]() -> Status {
      if (!session_.connected())
        if (Status c = session_.connect(); !c) return c;
      proto::Envelope reply;
      if (Status x = session_.exchange(proto::StoreRemove{.name = n}, -1, reply, nullptr); !x) return x;
      if (Status ok = ok_reply(reply, "STORE_REMOVE"); !ok) return ok;
      // Gone: its host-tier memory with it (the daemon punched it). The handle stays (an open of the
      // same name makes the object again); the daemon's is gone.
      std::lock_guard lock(mu_);
      for (Object& o : objects_)
        if (o.name == n) o.host.reset(), o.daemon_handle = 0;
      return {};
    });
  } catch (...) {
    return make_error(ENOMEM, "out of memory removing an object");
  }
}

Result<uint64_t> ObjectClient::write(uint64_t handle, uint64_t offset, const void* src, uint64_t length,
                                     CUstream stream) noexcept {
  return queue(Range{.dir = Direction::ToStorage,
                     .handle = handle,
                     .offset = offset,
                     .length = length,
                     .memory = reinterpret_cast<CUdeviceptr>(src),
                     .stream = stream});
}

Result<uint64_t> ObjectClient::read(uint64_t handle, uint64_t offset, void* dst, uint64_t length,
                                    CUstream stream) noexcept {
  return queue(Range{.dir = Direction::FromStorage,
                     .handle = handle,
                     .offset = offset,
                     .length = length,
                     .memory = reinterpret_cast<CUdeviceptr>(dst),
                     .stream = stream});
}

Status ObjectClient::checked(const Range& r) const {
  std::lock_guard lock(mu_);
  if (r.handle == 0 || r.handle > objects_.size()) return make_error(EINVAL, "no object has this handle");
  const Object& o = objects_[r.handle - 1];
  const uint64_t chunk = slots_.chunk_bytes();
  if (chunk == 0) return make_error(ENOTCONN, "no session with tmsdiskd");
  if (r.length == 0 || r.offset > o.size || r.length > o.size - r.offset)
    return make_error(EINVAL, fmt::format("bytes [{}, {}) lie outside object '{}' ({} bytes)", r.offset,
                                          r.offset + r.length, o.name, o.size));
  if (r.offset % chunk != 0 || ((r.offset + r.length) % chunk != 0 && r.offset + r.length != o.size))
    return make_error(EINVAL, fmt::format("a range of an object starts at a multiple of {} bytes and ends at one or "
                                          "at the object's end, not [{}, {})",
                                          chunk, r.offset, r.offset + r.length));
  if (!r.memory) return make_error(EINVAL, "no memory to copy from or to");
  return {};
}

Result<uint64_t> ObjectClient::queue(Range r) noexcept {
  try {
    if (Status st = checked(r); !st) return std::move(st).error();
    const DriverApi& api = driver().api;
    const Memory kind = memory_kind(api, r.memory, &r.ctx);
    if (kind == Memory::Unknown)
      return make_error(EINVAL,
                        "the range is device memory of no context this thread can reach: make its context "
                        "current first");
    r.host = kind == Memory::Host;
    // The range moves after the work its caller queued so far on `stream` (host memory too: a copy
    // out of the device may still be filling it, on the legacy stream as on another). Without a
    // context no such work can exist.
    CUcontext ctx = r.ctx;
    if (r.host && api.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) ctx = nullptr;
    if (ctx) {
      CtxScope scope(api, ctx);
      // An event recorded during a capture is a node of the graph, not a point in time: waiting for it
      // would copy the bytes before the captured work that makes them ever ran.
      CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
      if (api.cuStreamIsCapturing && api.cuStreamIsCapturing(r.stream, &capture) == CUDA_SUCCESS &&
          capture != CU_STREAM_CAPTURE_STATUS_NONE)
        return make_error(EBUSY, "the stream is being captured into a CUDA graph: move objects outside the capture");
      if (CUresult e = api.cuEventCreate(&r.after, CU_EVENT_DISABLE_TIMING); e != CUDA_SUCCESS)
        return cuda_error("cuEventCreate", e);
      if (CUresult e = api.cuEventRecord(r.after, r.stream); e != CUDA_SUCCESS) {
        api.cuEventDestroy_v2(r.after);
        return cuda_error("cuEventRecord on the caller's stream", e);
      }
    }
    // From here the task owns the event, and the ticket gets an outcome whatever happens: a waiter
    // never hangs. Everything that can throw comes before the ticket is registered.
    struct EventGuard {
      CUevent e;
      ~EventGuard() {
        if (e) driver().api.cuEventDestroy_v2(e);
      }
    } guard{r.after};
    uint64_t ticket = 0;
    {
      std::lock_guard lock(mu_);
      ticket = next_ticket_++;
    }
    std::function<void()> task = [this, r, ticket] {
      Status st;
      try {
        st = transfer(r);
      } catch (...) {
        st = make_error(ENOMEM, "out of memory moving an object's range");
      }
      if (r.after) driver().api.cuEventDestroy_v2(r.after);
      finish(ticket, r.dir, std::move(st));
    };
    {
      std::lock_guard lock(mu_);
      tickets_.emplace(ticket, Ticket{.outcome = std::nullopt, .write = r.dir == Direction::ToStorage});
      if (r.dir == Direction::ToStorage) ++writes_in_flight_;
    }
    guard.e = nullptr;
    if (const int posted = control_.post(std::move(task), false); posted < 0) {
      if (r.after) api.cuEventDestroy_v2(r.after);
      finish(ticket, r.dir, make_error(-posted, "cannot queue the transfer on the shim's control thread"));
    }
    return ticket;
  } catch (...) {
    return make_error(ENOMEM, "out of memory queueing an object's transfer");
  }
}

Result<uint64_t> ObjectClient::daemon_handle(uint64_t handle) {
  Object o;
  {
    std::lock_guard lock(mu_);
    o = objects_[handle - 1];
  }
  if (o.daemon_handle && o.connection == session_.connection()) return o.daemon_handle;
  // A new session (the daemon restarted, or the connection was lost): the object is named again.
  proto::Envelope reply;
  if (Status x = session_.exchange(proto::StoreOpen{.name = o.name, .size = o.size}, -1, reply, nullptr); !x)
    return std::move(x).error();
  const auto* opened = std::get_if<proto::StoreOpened>(&reply.body);
  if (!opened) return make_error(EPROTO, "unexpected answer to STORE_OPEN");
  std::lock_guard lock(mu_);
  objects_[handle - 1].daemon_handle = opened->handle;
  objects_[handle - 1].connection = session_.connection();
  return opened->handle;
}

void ObjectClient::session_started() noexcept {
  try {
    std::size_t count = 0;
    {
      std::lock_guard lock(mu_);
      count = objects_.size();
    }
    for (uint64_t handle = 1; handle <= count; ++handle) (void)keep_counted(handle, false);
  } catch (...) {
  }
}

Status ObjectClient::keep_counted(uint64_t handle, bool or_to_disk) {
  Object o;
  {
    std::lock_guard lock(mu_);
    o = objects_[handle - 1];
  }
  if (!o.host || (o.daemon_handle && o.connection == session_.connection())) return {};
  proto::Envelope reply;
  Status held = session_.exchange(proto::StoreOpen{.name = o.name, .size = o.size, .flags = proto::kStoreOpenHeld},
                                  o.host->fd.get(), reply, nullptr);
  if (held) {
    const auto* opened = std::get_if<proto::StoreOpened>(&reply.body);
    if (!opened) return make_error(EPROTO, "unexpected answer to STORE_OPEN");
    std::lock_guard lock(mu_);
    objects_[handle - 1].daemon_handle = opened->handle;
    objects_[handle - 1].connection = session_.connection();
    return {};
  }
  // The daemon went again, or the caller writes to disk later: asked again at the object's next range.
  if (!session_.connected() || !or_to_disk) return held;
  // Not counted here: the bytes written so far go to disk, in runs of written chunks, and the object
  // lives there from now on.
  TMS_WARN("object '%s': tmsdiskd does not count its host-tier memory (%s); writing it to disk", o.name.c_str(),
           held.error().describe().c_str());
  {
    std::lock_guard lock(mu_);
    objects_[handle - 1].daemon_handle = 0;
  }
  Result<uint64_t> on_disk = daemon_handle(handle);
  if (!on_disk) return std::move(on_disk).error();
  const uint64_t chunk = slots_.chunk_bytes();
  const std::vector<uint8_t>& written = o.host->written;
  for (std::size_t first = 0; first < written.size();) {
    if (!written[first]) {
      ++first;
      continue;
    }
    std::size_t end = first;
    while (end < written.size() && written[end]) ++end;
    const uint64_t offset = first * chunk;
    const Range run{.dir = Direction::ToStorage,
                    .handle = handle,
                    .offset = offset,
                    .length = std::min<uint64_t>(end * chunk, o.size) - offset,
                    .memory = reinterpret_cast<CUdeviceptr>(o.host->mapping.data() + offset),
                    .host = true};
    if (Status st = through_daemon(run, *on_disk); !st) return st;
    first = end;
  }
  std::lock_guard lock(mu_);
  objects_[handle - 1].host.reset();
  return {};
}

Status ObjectClient::copy_host(const Range& r, const std::string& name, HostCopy& host) {
  const uint64_t chunk = slots_.chunk_bytes();
  const std::size_t first = r.offset / chunk, end = (r.offset + r.length + chunk - 1) / chunk;
  if (r.dir == Direction::FromStorage)
    for (std::size_t c = first; c < end; ++c)
      if (!host.written[c])
        return make_error(ENODATA, fmt::format("object '{}' holds no version of bytes [{}, {}): never written", name,
                                               c * chunk, std::min(r.offset + r.length, (c + 1) * chunk)));
  uint8_t* at = host.mapping.data() + r.offset;
  if (r.host) {
    auto* memory = reinterpret_cast<uint8_t*>(r.memory);
    r.dir == Direction::ToStorage ? std::memcpy(at, memory, r.length) : std::memcpy(memory, at, r.length);
  } else {
    // On the shim's own stream of the context: the caller's streams (the legacy one too) never wait for it.
    Result<int> ctx = pipeline_.context(r.ctx);
    if (!ctx) return std::move(ctx).error();
    const DriverApi& api = driver().api;
    CtxScope scope(api, r.ctx);
    const CUstream stream = pipeline_.stream(*ctx);
    const CUresult copied = r.dir == Direction::ToStorage ? api.cuMemcpyDtoHAsync_v2(at, r.memory, r.length, stream)
                                                          : api.cuMemcpyHtoDAsync_v2(r.memory, at, r.length, stream);
    if (copied != CUDA_SUCCESS) return cuda_error("copying an object's range to or from its host-tier memory", copied);
    if (Status st = pipeline_.drain(*ctx); !st) return st;
  }
  if (r.dir == Direction::ToStorage) std::fill(host.written.begin() + first, host.written.begin() + end, 1);
  return {};
}

// On the control thread: a range of a host-tier object copied in or out of its memory, or of an object
// on disk through the pipeline.
Status ObjectClient::transfer(const Range& r) {
  const DriverApi& api = driver().api;
  if (!session_.connected())
    if (Status c = session_.connect(); !c) return c;
  // The memory may have been paused since the range was queued (a pause queued after it ran first:
  // a command the daemon sent while this thread was busy): it has no pages to copy now.
  for (const auto& a : registry().overlapping(r.memory, r.length))
    if (a->state.load() != AllocState::Resident)
      return make_error(EAGAIN, "the range's device memory is paused: resume the process, then write or read it again");
  if (Status st = keep_counted(r.handle, true); !st) return st;
  if (r.after)  // destroyed by the task once this returns
    if (const CUresult waited = api.cuEventSynchronize(r.after); waited != CUDA_SUCCESS)
      return cuda_error("waiting for the caller's stream", waited);
  Object o;
  {
    std::lock_guard lock(mu_);
    o = objects_[r.handle - 1];
  }
  if (o.host) return copy_host(r, o.name, *o.host);
  Result<uint64_t> handle = daemon_handle(r.handle);
  if (!handle) return std::move(handle).error();
  return through_daemon(r, *handle);
}

Status ObjectClient::through_daemon(const Range& r, uint64_t daemon_handle) {
  TransferJob j;
  j.base = r.memory;
  j.size = r.length;
  j.blob = daemon_handle;
  j.blob_offset = r.offset;
  j.object = true;
  j.host_memory = r.host;
  if (!r.host) {
    Result<int> ctx = pipeline_.context(r.ctx);
    if (!ctx) return std::move(ctx).error();
    j.ctx = *ctx;
    slots_.register_with(r.ctx);
  }
  std::vector<TransferJob> jobs{std::move(j)};  // every chunk on disk: nothing of a range is placed elsewhere
  std::optional<Error> failed = pipeline_.run_plain(r.dir, jobs);
  if (r.dir == Direction::FromStorage) return failed ? Status(std::move(*failed)) : Status{};
  // A write: the range becomes the object's current version, or what was written of it is dropped.
  if (failed && !session_.connected()) return std::move(*failed);  // the daemon drops it with the session
  proto::Envelope reply;
  const proto::StoreCommit commit{.handle = daemon_handle,
                                  .offset = r.offset,
                                  .length = r.length,
                                  .flags = static_cast<uint8_t>(failed ? proto::kStoreDiscard : 0)};
  Status committed = session_.exchange(commit, -1, reply, nullptr);
  if (committed) committed = ok_reply(reply, "STORE_COMMIT");
  if (failed) return std::move(*failed);
  return committed;
}

void ObjectClient::finish(uint64_t ticket, Direction dir, Status st) {
  std::lock_guard lock(mu_);
  if (dir == Direction::ToStorage) {
    --writes_in_flight_;
    if (!st && !write_error_) write_error_ = st.error();
  }
  auto it = tickets_.find(ticket);
  if (it != tickets_.end()) it->second.outcome = std::move(st);
  cv_.notify_all();
}

Status ObjectClient::wait(uint64_t ticket) noexcept {
  try {
    std::unique_lock lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return make_error(EINVAL, "no operation has this ticket (or it was waited for)");
    cv_.wait(lock, [&] { return it->second.outcome.has_value(); });
    Status st = std::move(*it->second.outcome);
    tickets_.erase(it);
    return st;
  } catch (...) {
    return make_error(ENOMEM, "out of memory waiting for an object's transfer");
  }
}

Status ObjectClient::flush() noexcept {
  try {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return writes_in_flight_ == 0; });
    std::erase_if(tickets_, [](const auto& t) { return t.second.write && t.second.outcome; });
    if (!write_error_) return {};
    Error e = std::move(*write_error_);
    write_error_.reset();
    return e;
  } catch (...) {
    return make_error(ENOMEM, "out of memory waiting for an object's transfers");
  }
}

}  // namespace tmsdisk::shim
