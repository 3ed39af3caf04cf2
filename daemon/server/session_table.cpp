// SPDX-License-Identifier: Apache-2.0
// The session table (session_table.h).
#include "session_table.h"

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "tmsdisk/common/proc.h"
#include "tmsdisk/common/staging_budget.h"

namespace tmsdisk::server {
namespace {

constexpr uint32_t kMinChunkBytes = 64 * 1024;
constexpr uint32_t kMaxChunkBytes = 64 * kMiB;

}  // namespace

uint64_t SessionTable::host_tier_used() const noexcept {
  uint64_t used = 0;
  for (const auto& [id, s] : sessions_) used += s.host_tier.bytes + s.host_tier_pending + object_host_bytes(s);
  return used;
}

uint64_t random_token() {
  uint64_t t = 0;
  while (t == 0)
    if (::getrandom(&t, sizeof(t), 0) != sizeof(t))
      t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return t;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

SessionTable::SessionTable(const Config& config, storage::Roots& roots, io::Engine& engine, IpcExports& ipc,
                           StagingWorkers& workers, int epoll_fd,
                           std::function<void(const IpcExports::Users&)> notify_users)
    : config_(config),
      roots_(roots),
      engine_(engine),
      ipc_(ipc),
      workers_(workers),
      epoll_fd_(epoll_fd),
      notify_users_(std::move(notify_users)) {}

Session* SessionTable::find(uint64_t id) {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : &it->second;
}

// Staging is pinned memory: bounded per user and for the whole daemon, so that no user can pin the
// node's RAM by opening sessions. Sessions still being opened count, with the staging they asked for.
Status SessionTable::check_quotas(const ucred& cred, uint64_t staging) const {
  uint64_t uid_sessions = 0, uid_staging = 0, all_staging = 0;
  uint64_t uid_orphans = 0, uid_orphan_staging = 0;
  auto count = [&](const ucred& owner, uint64_t charge, bool orphan) {
    all_staging += charge;
    if (owner.uid != cred.uid) return;
    ++uid_sessions;
    uid_staging += charge;
    if (orphan) {
      ++uid_orphans;
      uid_orphan_staging += charge;
    }
  };
  for (auto& [sid, other] : sessions_) count(other.cred, other.staging_charge, other.orphan);
  for (auto& [conn, o] : openings_) count(o.cred, o.staging_charge, false);
  // Orphans count like any session but run no program the user can see: the refusal says how many
  // there are and how long they stay, so that the user can tell why the limit is reached.
  const std::string orphans_note =
      uid_orphans == 0 ? std::string()
                       : fmt::format(
                             " ({} orphaned: ranks that lost their connection, kept for reconnection until "
                             "each reconnects with its session token or its process exits)",
                             uid_orphans);
  if (cred.uid != 0 && uid_sessions >= config_.max_sessions_per_uid)
    return make_error(EDQUOT, fmt::format("uid {} already has {} sessions{}, the most this daemon allows "
                                          "(max-sessions-per-uid); `tmsctl status` lists them",
                                          cred.uid, uid_sessions, orphans_note));
  if (cred.uid != 0 && uid_staging + staging > config_.max_staging_per_uid_bytes)
    return make_error(EDQUOT,
                      fmt::format("uid {} would hold {} MiB of staging, more than {} MiB (max-staging-per-uid-mb){}; "
                                  "lower TMS_DISK_BACKUP_CHUNK_MB",
                                  cred.uid, (uid_staging + staging) / kMiB, config_.max_staging_per_uid_bytes / kMiB,
                                  uid_orphans == 0 ? std::string()
                                                   : fmt::format(", {} MiB of it kept for {} orphaned session(s)",
                                                                 uid_orphan_staging / kMiB, uid_orphans)));
  if (all_staging + staging > config_.max_total_staging_bytes)
    return make_error(ENOMEM, fmt::format("the daemon's staging budget ({} MiB, max-total-staging-mb) is exhausted",
                                          config_.max_total_staging_bytes / kMiB));
  return {};
}

Result<std::unique_ptr<storage::Roots>> SessionTable::rank_chosen_roots(const ucred& cred, UniqueFd dir,
                                                                        const std::string& named) {
  if (!dir) return make_error(EINVAL, "the rank's directory was to ride along and did not");
  if (roots_.holds(dir.get())) return std::unique_ptr<storage::Roots>();
  auto own = storage::Roots::open_rank_directory(std::move(dir), cred.uid, named, config_.allow_tmpfs);
  if (!own) return std::move(own).error();
  return std::make_unique<storage::Roots>(std::move(own).value());
}

Result<SessionTable::StagingShape> SessionTable::begin_open(const ucred& cred, uint64_t conn_id, const proto::Hello& h,
                                                            UniqueFd dir) {
  if (!proto::valid_job_name(h.job))
    return make_error(EINVAL, fmt::format("job name '{}' is not allowed: {}", h.job, proto::kJobNameRule));
  std::unique_ptr<storage::Roots> own_roots;
  if (h.flags & proto::kHelloRankDir) {
    auto chosen = rank_chosen_roots(cred, std::move(dir), h.backup_dir);
    if (!chosen) return std::move(chosen).error();
    own_roots = std::move(chosen).value();
  } else if (!h.backup_dir.empty()) {
    auto root = roots_.root_for(h.backup_dir);
    if (!root) return std::move(root).error();
  }
  uint64_t staging = h.staging_budget_bytes ? h.staging_budget_bytes : config_.staging_budget_bytes;
  uint64_t slot = h.chunk_bytes ? h.chunk_bytes : config_.chunk_bytes;
  // A staging budget too small for two of the daemon's chunks (TMS_DISK_BACKUP_CHUNK_MB=1, as
  // torch_memory_saver's tests set it) takes smaller chunks, when the rank left their size to the daemon.
  if (!h.chunk_bytes && staging < min_staging_budget_bytes(slot))
    slot = std::max<uint64_t>(kMinChunkBytes, staging / 2 / storage::kIoAlignment * storage::kIoAlignment);
  if (slot < kMinChunkBytes || slot > kMaxChunkBytes || slot % storage::kIoAlignment != 0)
    return make_error(EINVAL, fmt::format("chunk size {} must be a multiple of 4 KiB between 64 KiB and 64 MiB", slot));
  if (staging > config_.max_staging_budget_bytes)
    return make_error(EINVAL, fmt::format("asked for {} MiB of staging; this daemon allows at most {} MiB "
                                          "(TMS_DISK_BACKUP_CHUNK_MB)",
                                          staging / kMiB, config_.max_staging_budget_bytes / kMiB));
  if (staging < min_staging_budget_bytes(slot))
    return make_error(EINVAL, fmt::format("a staging budget of {} KiB (TMS_DISK_BACKUP_CHUNK_MB) holds fewer than two "
                                          "chunks of {} KiB; ask for {} MiB or more",
                                          staging >> 10, slot >> 10, min_staging_budget_mib(slot)));
  const auto slot_count = static_cast<uint32_t>(staging / slot);
  staging = uint64_t{slot_count} * slot;  // what the buffer will hold, and so what is charged
  if (auto st = check_quotas(cred, staging); !st) return std::move(st).error();
  const auto start_time = process_start_time(cred.pid);
  if (!start_time) return make_error(ESRCH, fmt::format("cannot read the start time of pid {}", cred.pid));
  Opening o;
  o.cred = cred;
  o.hello = h;
  o.chunk_bytes = static_cast<uint32_t>(slot);
  o.staging_charge = staging;
  o.id.uid = cred.uid;
  o.id.gid = cred.gid;
  o.id.job = h.job;
  o.id.rank = h.rank;
  o.id.pid = cred.pid;
  o.id.start_time = *start_time;
  o.id.token = h.token ? h.token : random_token();
  o.relative_dir = storage::rank_relative_dir(o.id);
  o.own_roots = std::move(own_roots);
  for (auto& [sid, other] : sessions_) {
    if (other.relative_dir != o.relative_dir) continue;
    if (!other.orphan)
      return make_error(EBUSY, fmt::format("pid {} already has a session as job {} rank {}", cred.pid, h.job, h.rank));
    if (h.token != other.token)
      return make_error(EPERM,
                        "this rank's files are kept for a session that lost its connection; reconnect with "
                        "that session's token");
  }
  for (auto& [conn, other] : openings_)
    if (other.relative_dir == o.relative_dir)
      return make_error(EBUSY,
                        fmt::format("pid {} is already opening a session as job {} rank {}", cred.pid, h.job, h.rank));
  // A pidfd names this very process (no pid reuse); its start time is checked once more after
  // opening it, in case the pid changed hands since SO_PEERCRED was taken.
  o.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0)));
  if (o.pidfd && !process_alive(cred.pid, *start_time))
    return make_error(ESRCH, fmt::format("pid {} exited while connecting", cred.pid));
  openings_.insert_or_assign(conn_id, std::move(o));
  return StagingShape{static_cast<uint32_t>(slot), slot_count};
}

void SessionTable::abandon_open(uint64_t conn_id) {
  openings_.erase(conn_id);
}

std::vector<uint64_t> SessionTable::openings_where(
    const std::function<bool(const ucred&, const std::string&, int64_t)>& wanted) const {
  std::vector<uint64_t> out;
  for (const auto& [conn, o] : openings_)
    if (wanted(o.cred, o.hello.job, o.hello.rank)) out.push_back(conn);
  return out;
}

Result<Session*> SessionTable::finish_open(uint64_t conn_id, StagingPtr staging) {
  auto node = openings_.extract(conn_id);
  if (node.empty()) return make_error(ENOENT, "internal: no session is being opened on this connection");
  Opening& o = node.mapped();
  const proto::Hello& h = o.hello;

  Session s;
  s.id = next_id_++;
  s.cred = o.cred;
  s.job = h.job;
  s.rank = h.rank;
  s.relative_dir = o.relative_dir;
  s.token = o.id.token;
  s.start_time = o.id.start_time;
  s.pidfd = std::move(o.pidfd);
  s.staging = std::move(staging);
  s.staging_charge = o.staging_charge;

  // The orphan this rank reconnects to: its files are adopted below, from disk, by a fresh store. The
  // host-tier memory it holds stays the rank's and stays counted against the node's budget: a rank
  // that finds its session adopted hands nothing over again (TIER_ADOPT is for a new daemon).
  uint64_t adopted = 0;
  for (auto& [sid, other] : sessions_) {
    if (other.relative_dir != o.relative_dir) continue;
    adopted = sid;
    s.host_tier = std::move(other.host_tier);
    s.host_tier_kept = other.host_tier_kept;
    s.from_earlier_daemon = other.from_earlier_daemon;
    s.host_tier_adopted = other.host_tier_adopted;
    s.object_memory = std::move(other.object_memory);
    s.objects_held_before = std::move(other.objects_held_before);
    forget_orphan(sid);
    break;
  }
  bool from_disk = h.token != 0;
  s.own_roots = std::move(o.own_roots);
  storage::Roots& roots = roots_of(s, roots_);
  auto store = h.token ? storage::RankStore::adopt(roots, o.id, o.chunk_bytes)
                       : storage::RankStore::create(roots, o.id, o.chunk_bytes);
  // A token but nothing on disk: its earlier session ended with nothing to keep (the connection
  // was closed on it), so it starts afresh under the same token.
  if (!store && h.token && store.error().errnum() == ENOENT) {
    store = storage::RankStore::create(roots, o.id, o.chunk_bytes);
    from_disk = false;
  }
  if (!store) return std::move(store).error();
  s.store = std::move(store.value());
  if (from_disk) {
    // Objects an earlier session of the rank stored come back with it.
    // A store that cannot be opened never keeps the rank from its session (its paused memory must
    // stay resumable): STORE_OPEN then says why.
    auto objects = storage::ObjectStore::open_existing(roots, s.store->dir_fds(), s.store->file_names(), o.chunk_bytes,
                                                       [](const std::string& what) { spdlog::warn("{}", what); });
    if (objects) {
      s.objects = std::move(*objects);
      // Objects that lived in host-tier memory live there still, in the rank: it hands that memory
      // back (kStoreOpenHeld) to have it counted again. Only objects of the earlier daemon qualify.
      if (!adopted && s.objects)
        for (const auto& info : s.objects->list()) s.objects_held_before.insert(info.name);
    } else
      spdlog::error("session {} (pid {}): its objects cannot be opened: {}", s.id, s.cred.pid,
                    objects.error().describe());
  }
  if (!adopted) s.from_earlier_daemon = from_disk;
  if (!s.store->record_problem().empty())
    spdlog::error("session {} (pid {}): {}", s.id, s.cred.pid, s.store->record_problem());

  s.conn_id = conn_id;
  s.stats.last_change_unix_ms = unix_ms();
  if (s.store->paused()) {
    s.stats.state = static_cast<uint8_t>(proto::RankState::Paused);
    for (const auto& b : s.store->blobs()) s.stats.paused_bytes += b.size;
  }
  const uint64_t sid = s.id;
  Session& placed = sessions_.emplace(sid, std::move(s)).first->second;
  had_session_ = true;
  if (adopted) {
    ipc_.rename_session(adopted, sid);
    placed.adopted = true;
  }
  return &placed;
}

Status SessionTable::move_files(Session& s, UniqueFd dir, const std::string& named) {
  const std::string refused = fmt::format("cannot move this rank's files to {}: ", named);
  if (s.store->paused() || s.store->holds_unresumed_data() || s.io_in_flight != 0 || !s.pending_reserve.empty())
    return make_error(EBUSY, refused + "some of its memory is paused, or being paused or resumed; its files stay in " +
                                 s.store->dir_path() + ". Resume it first");
  if ((s.objects && s.objects->object_count() != 0) || !s.object_memory.empty() || s.object_memory_pending != 0)
    return make_error(EBUSY, refused + fmt::format("it stores {} object(s) in {} (tmsdisk.optim's state, the C "
                                                   "API's store), which stay there; choose the directory before "
                                                   "the first object is opened",
                                                   s.objects ? s.objects->object_count() : 0, s.store->dir_path()));
  auto chosen = rank_chosen_roots(s.cred, std::move(dir), named);
  if (!chosen) return std::move(chosen).error();
  std::unique_ptr<storage::Roots> own = std::move(chosen).value();
  // The directory it is in already: nothing to do.
  const int new_dir = own ? (*own)[0].dir.get() : -1;
  if ((!own && !s.own_roots) || (own && s.own_roots && s.own_roots->holds(new_dir))) return {};
  storage::RankIdentity id;
  id.uid = s.cred.uid;
  id.gid = s.cred.gid;
  id.job = s.job;
  id.rank = s.rank;
  id.pid = s.cred.pid;
  id.start_time = s.start_time;
  id.token = s.token;
  // The new store first: when it cannot be made, the rank keeps the one it has.
  auto store = storage::RankStore::create(own ? *own : roots_, id, s.store->chunk_bytes());
  if (!store) return std::move(store).error();
  s.objects.reset();
  if (auto st = s.store->remove(); !st)
    spdlog::warn("session {}: its files in {} cannot all be removed: {}", s.id, s.store->dir_path(),
                 st.error().describe());
  spdlog::info("session {} (pid {}): its files move from {} to {}", s.id, s.cred.pid, s.store->dir_path(),
               (*store)->dir_path());
  s.store = std::move(store).value();
  s.own_roots = std::move(own);
  return {};
}

void SessionTable::detach(uint64_t id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  it->second.conn_id = 0;
  maybe_destroy(id);
}

void SessionTable::maybe_destroy(uint64_t sid) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end() || it->second.conn_id != 0 || it->second.io_in_flight != 0) return;
  Session& s = it->second;
  const bool holds_objects = s.objects && s.objects->object_count() != 0;
  if (s.objects) s.objects->discard_all();  // a range written and not committed is never committed now
  if (!s.orphan && (s.store->holds_unresumed_data() || holds_objects || ipc_.holds(sid)) && rank_alive(s)) {
    // The connection dropped but the process lives, and these files are the only copy of memory it
    // released (invariant 6) or of the objects it stored, or it shares memory through legacy IPC
    // (what it exported, what it maps of others': an exporter pausing it then would leave the
    // importer on stale memory): keep the session until it reconnects with its token or exits.
    s.orphan = true;
    s.orphaned_unix_ms = unix_ms();
    s.staging.reset();
    if (s.pidfd) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = kOrphanKeyBit | sid;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, s.pidfd.get(), &ev);
    }
    spdlog::warn(
        "session {} (pid {}) lost its connection with paused memory on disk; keeping its files until it "
        "reconnects or exits",
        sid, s.cred.pid);
    return;
  }
  if (s.pidfd) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, s.pidfd.get(), nullptr);
  // No paused chunk of it lives in its host-tier memory now (or nobody is left to resume them): the
  // memory stops counting, so it is taken back from whoever still holds it.
  if (s.host_tier.bytes) workers_.take_back_tier(std::move(s.host_tier));
  for (auto& [name, memory] : s.object_memory) workers_.take_back_tier(std::move(memory));
  if (auto st = s.store->remove(); !st)
    spdlog::error("session {}: cannot remove its files: {}", sid, st.error().describe());
  spdlog::info("session {} (pid {}) closed; its files are removed", sid, s.cred.pid);
  sessions_.erase(it);
  for (const auto& u : ipc_.drop([&](uint64_t id) { return id == sid; })) notify_users_(u);
}

// Whether the rank's process still runs. Its pidfd turns readable as soon as it exits, even while
// it is an unreaped zombie whose /proc entry still matches.
bool SessionTable::rank_alive(const Session& s) {
  if (s.pidfd) {
    pollfd p{s.pidfd.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  return process_alive(s.cred.pid, s.start_time);
}

// Drops an orphan's in-memory state without touching its files (its rank reconnected).
void SessionTable::forget_orphan(uint64_t sid) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end()) return;
  if (it->second.pidfd) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.pidfd.get(), nullptr);
  sessions_.erase(it);
}

void SessionTable::reap_orphan(uint64_t sid) {
  auto it = sessions_.find(sid);
  if (it == sessions_.end() || !it->second.orphan || rank_alive(it->second)) return;
  it->second.orphan = false;
  maybe_destroy(sid);  // not alive, so this removes the files
}

std::set<std::string> SessionTable::reap_dead() {
  std::vector<uint64_t> dead_orphans;
  for (auto& [id, s] : sessions_)
    if (s.orphan && !rank_alive(s)) dead_orphans.push_back(id);
  for (uint64_t id : dead_orphans) reap_orphan(id);
  // Exports and opens of sessions that vanished without passing maybe_destroy (an orphan whose
  // rank failed to reconnect).
  for (const auto& u : ipc_.drop([&](uint64_t id) { return sessions_.count(id) == 0; })) notify_users_(u);
  std::set<std::string> live;
  for (auto& [id, s] : sessions_) live.insert(s.relative_dir);
  return live;
}

}  // namespace tmsdisk::server
