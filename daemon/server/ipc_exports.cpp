// SPDX-License-Identifier: Apache-2.0
#include "ipc_exports.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdio>
#include <string>

namespace tmsdisk::server {

namespace {
// The NVIDIA driver's character devices (/dev/nvidiactl, /dev/nvidia<N>) have this fixed major; an
// exported POSIX handle is an open file of /dev/nvidiactl carrying the allocation.
constexpr unsigned kNvidiaMajor = 195;
}  // namespace

Status check_memory_fd(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error("cannot inspect the exported descriptor");
  if (S_ISCHR(st.st_mode) && ::major(st.st_rdev) == kNvidiaMajor) return {};
  // F_GET_SEALS answers only for shmem files (memfd, tmpfs), whose close never blocks.
  if (S_ISREG(st.st_mode) && ::fcntl(fd, F_GET_SEALS) >= 0) return {};
  char what[64];
  std::snprintf(what, sizeof(what), "mode 0%o, device %u:%u", static_cast<unsigned>(st.st_mode), ::major(st.st_rdev),
                ::minor(st.st_rdev));
  return make_error(EINVAL, std::string("the descriptor passed with IPC_EXPORT is not GPU memory (neither an NVIDIA "
                                        "device file nor a memfd: ") +
                                what + ")");
}

Result<uint64_t> IpcExports::add(uint64_t owner, uid_t uid, pid_t pid, UniqueFd fd, uint64_t bytes, int32_t device) {
  const auto held = per_uid_.find(uid);
  const std::size_t mine = held == per_uid_.end() ? 0 : held->second;
  if (uid != 0 && mine >= limits_.per_uid)
    return make_error(EDQUOT, fmt::format("uid {} already shares {} allocations through legacy IPC, the most this "
                                          "daemon allows (max-ipc-exports-per-uid)",
                                          uid, mine));
  if (exports_.size() >= limits_.total)
    return make_error(ENFILE, fmt::format("tmsdiskd already holds {} legacy IPC exports, the most it allows for all "
                                          "users",
                                          exports_.size()));
  uint64_t id = 0;
  do id = random_();
  while (id == 0 || exports_.count(id));
  Export e;
  e.owner = owner;
  e.uid = uid;
  e.pid = pid;
  e.fd = std::move(fd);
  e.bytes = bytes;
  e.device = device;
  exports_.emplace(id, std::move(e));
  ++per_uid_[uid];
  return id;
}

void IpcExports::erase(std::map<uint64_t, Export>::iterator it) {
  auto n = per_uid_.find(it->second.uid);
  if (n != per_uid_.end() && --n->second == 0) per_uid_.erase(n);
  exports_.erase(it);
}

Result<IpcExports::Export*> IpcExports::owned(uint64_t id, uint64_t owner) {
  auto it = exports_.find(id);
  // Another session's id is answered as unknown: ids are not to be probed.
  if (it == exports_.end() || it->second.owner != owner)
    return make_error(ENOENT, fmt::format("no legacy IPC export {} of this process", id));
  return &it->second;
}

Status IpcExports::refresh(uint64_t id, uint64_t owner, UniqueFd fd, uint64_t bytes) {
  auto e = owned(id, owner);
  if (!e) return std::move(e).error();
  if ((*e)->fd || !(*e)->opens.empty())
    return make_error(EBUSY, fmt::format("export {} is live; only a revoked export takes new memory", id));
  if ((*e)->bytes != bytes)
    return make_error(EINVAL, fmt::format("export {} cannot change size from {} to {} bytes", id, (*e)->bytes, bytes));
  (*e)->fd = std::move(fd);
  return {};
}

Status IpcExports::revoke(uint64_t id, uint64_t owner) {
  auto e = owned(id, owner);
  if (!e) return std::move(e).error();
  if (!(*e)->opens.empty())
    return make_error(EBUSY, fmt::format("{} process(es) have export {} open", importers(**e), id));
  (*e)->fd.reset();
  return {};
}

Status IpcExports::forget(uint64_t id, uint64_t owner) {
  auto e = owned(id, owner);
  if (!e) return std::move(e).error();
  erase(exports_.find(id));
  return {};
}

Result<IpcExports::Opened> IpcExports::open(uint64_t id, uint64_t importer, uid_t uid) {
  auto it = exports_.find(id);
  // Another user's export is answered as unknown too: ids are not to be probed.
  if (it == exports_.end() || it->second.uid != uid)
    return make_error(ENOENT, fmt::format("no legacy IPC export {} of this user (the exporter freed it or exited, or "
                                          "it belongs to another uid)",
                                          id));
  Export& e = it->second;
  if (e.owner == importer)
    return make_error(EINVAL, "a process cannot open its own legacy IPC handle (the driver refuses it as well)");
  if (!e.fd)
    return make_error(EAGAIN,
                      fmt::format("the exporting process (pid {}) is paused; open the handle after it resumes", e.pid));
  ++e.opens[importer];
  Opened o;
  o.fd = e.fd.get();
  o.bytes = e.bytes;
  o.device = e.device;
  o.exporter_pid = e.pid;
  o.users = Users{e.owner, id, importers(e)};
  return o;
}

Result<IpcExports::Users> IpcExports::close(uint64_t id, uint64_t importer) {
  auto it = exports_.find(id);
  // One answer for "no such export" and "not open by you": ids are not to be probed.
  if (it == exports_.end() || it->second.opens.count(importer) == 0)
    return make_error(ENOENT, fmt::format("this process has no legacy IPC export {} open", id));
  Export& e = it->second;
  auto open = e.opens.find(importer);
  if (--open->second == 0) e.opens.erase(open);
  return Users{e.owner, id, importers(e)};
}

std::vector<IpcExports::Users> IpcExports::drop(const std::function<bool(uint64_t session)>& gone) {
  std::vector<Users> notices;
  for (auto it = exports_.begin(); it != exports_.end();) {
    if (gone(it->second.owner)) {
      erase(it++);
      continue;
    }
    if (std::erase_if(it->second.opens, [&](const auto& kv) { return gone(kv.first); }) > 0)
      notices.push_back(Users{it->second.owner, it->first, importers(it->second)});
    ++it;
  }
  return notices;
}

void IpcExports::rename_session(uint64_t from, uint64_t to) {
  for (auto& [id, e] : exports_) {
    if (e.owner == from) e.owner = to;
    if (auto n = e.opens.extract(from)) {
      n.key() = to;
      e.opens.insert(std::move(n));
    }
  }
}

bool IpcExports::holds(uint64_t sid) const {
  for (const auto& [id, e] : exports_)
    if (e.owner == sid || e.opens.count(sid)) return true;
  return false;
}

std::vector<IpcExports::Users> IpcExports::exports_of(uint64_t owner) const {
  std::vector<Users> out;
  for (const auto& [id, e] : exports_)
    if (e.owner == owner) out.push_back(Users{owner, id, importers(e)});
  return out;
}

}  // namespace tmsdisk::server
