// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's event loop: one thread, epoll over the listening socket, every connection, the I/O
// engine's eventfd and a sweep timer. Nothing in the loop blocks on a peer: replies that do not fit
// in a socket buffer wait in a per-connection outbox. What a message asks is done by the session
// table (session_table.h), chunk I/O (chunk_io.h) and the control router (control_router.h).
#include "server.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <set>

#include "chunk_io.h"
#include "connection.h"
#include "control_router.h"
#include "fd_reaper.h"
#include "hash_workers.h"
#include "host_tier.h"
#include "ipc_exports.h"
#include "metrics.h"
#include "object_requests.h"
#include "session_table.h"
#include "staging_workers.h"
#include "storage.h"
#include "tier_broker.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/staging_budget.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::server {
namespace {

using Clock = std::chrono::steady_clock;
namespace proto = tmsdisk::proto;

constexpr auto kHelloDeadline = std::chrono::seconds(10);
constexpr uint32_t kMaxChunkBytes = 64 * kMiB;

// epoll keys below kFirstConnection name the server's own descriptors; an orphan's pidfd is keyed
// by its session id with SessionTable::kOrphanKeyBit set.
enum : uint64_t {
  kKeyListen = 1,
  kKeyStop = 2,
  kKeyIo = 3,
  kKeySweep = 4,
  kKeyStaging = 5,
  kKeyHashed = 6,
  kFirstConnection = 16
};

}  // namespace

struct Server::Impl {
  Config config;
  storage::Roots roots;
  std::unique_ptr<io::Engine> engine;
  UniqueFd lock_fd;
  UniqueFd listen_fd;
  UniqueFd epoll_fd;
  UniqueFd stop_fd;
  UniqueFd sweep_fd;
  bool bound_socket = false;  // we created the socket file (and remove it on exit)
  bool accepting = true;      // the listening socket is in the epoll set
  Clock::time_point started = Clock::now();
  bool stopping = false;

  std::map<uint64_t, std::unique_ptr<Connection>> conns;
  ReplyQueues replies{config.max_unread_replies_bytes_per_uid};
  uint64_t next_conn = kFirstConnection;
  IpcExports ipc{random_token, IpcExports::Limits{config.max_ipc_exports_per_uid, config.max_ipc_exports}};
  FdReaper reaper;  // descriptors clients passed that are not kept
  // Declared after the engine, so destroyed before it: staging buffers unregister from it, and the
  // workers build and tear them down; before the sessions, so destroyed after them (a session's
  // buffer is handed to the workers to tear down).
  std::unique_ptr<StagingWorkers> staging;
  std::unique_ptr<SessionTable> sessions;
  std::unique_ptr<ChunkIo> chunks;
  std::unique_ptr<ObjectRequests> objects;
  std::unique_ptr<ControlRouter> router;
  std::unique_ptr<TierBroker> tier;
  std::unique_ptr<MetricsExporter> metrics;

  explicit Impl(Config c) : config(std::move(c)) {}

  // ----------------------------------------------------------------------------------------------
  // Setup

  Status take_lock() {
    const std::string path = config.socket_path + ".lock";
    lock_fd.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock_fd) return errno_error("cannot open the lock file " + path);
    if (::flock(lock_fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK)
        return make_error(EADDRINUSE, "another tmsdiskd already serves " + config.socket_path + " (it holds " + path +
                                          "); stop it first or pick another --socket");
      return errno_error("cannot lock " + path);
    }
    return {};
  }

  Status bind_socket() {
    if (config.listen_fd >= 0) {
      listen_fd.reset(config.listen_fd);
      return {};
    }
    sockaddr_un addr{};
    if (config.socket_path.size() >= sizeof(addr.sun_path))
      return make_error(ENAMETOOLONG, "socket path " + config.socket_path + " is too long");
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, config.socket_path.c_str(), config.socket_path.size() + 1);
    listen_fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listen_fd) return errno_error("cannot create the listening socket");
    // We hold the instance lock, so a socket file still there is a leftover of a daemon that died.
    struct stat st {};
    if (::lstat(config.socket_path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode))
        return make_error(EEXIST, config.socket_path + " exists and is not a socket; refusing to replace it");
      ::unlink(config.socket_path.c_str());
    }
    if (::bind(listen_fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
      return errno_error("cannot bind " + config.socket_path);
    bound_socket = true;
    // Anyone may connect; what a client may do is decided per request from SO_PEERCRED.
    if (::chmod(config.socket_path.c_str(), 0666) != 0) return errno_error("cannot chmod " + config.socket_path);
    if (::listen(listen_fd.get(), 128) != 0) return errno_error("cannot listen on " + config.socket_path);
    return {};
  }

  Status setup() {
    if (config.roots.empty())
      return make_error(EINVAL,
                        "no storage root configured: pass --root DIR (one per NVMe) or set root = [\"DIR\"] in the "
                        "config file");
    if (config.chunk_bytes == 0 || config.chunk_bytes > kMaxChunkBytes)
      return make_error(
          EINVAL, fmt::format("chunk-mb ({}) must be from 1 to {}", config.chunk_bytes / kMiB, kMaxChunkBytes / kMiB));
    if (auto wrong = inconsistencies(config); !wrong.empty()) return make_error(EINVAL, wrong.front());

    auto r = storage::Roots::open(config.roots, config.allow_tmpfs);
    if (!r) return std::move(r).error();
    roots = std::move(r.value());
    for (std::size_t i = 0; i < roots.size(); ++i) {
      // A root daemon creates directories for every user inside its roots; a root others can write
      // to would let them plant or swap those directories between our checks.
      struct stat st {};
      if (::geteuid() == 0 && ::fstat(roots[i].dir.get(), &st) == 0 && (st.st_uid != 0 || (st.st_mode & 022) != 0))
        return make_error(EPERM, fmt::format("root {} must be owned by root and not writable by group or others "
                                             "(mkdir -m 0755 a dedicated directory, e.g. /var/lib/tmsdisk/nvme0)",
                                             roots[i].path));
      if (!roots[i].direct_io)
        spdlog::warn("root {} does not support O_DIRECT: falling back to buffered I/O (page cache will hold data)",
                     roots[i].path);
      for (std::size_t j = 0; j < i; ++j)
        if (roots[j].dev == roots[i].dev)
          spdlog::warn("roots {} and {} are on the same filesystem: striping over them gains no bandwidth",
                       roots[j].path, roots[i].path);
    }

    io::Engine::Options eo;
    eo.queue_depth = config.queue_depth;
    eo.buffer_slots = 256;
    eo.fault = config.hooks.io_fault;
    auto e = io::Engine::create(eo);
    if (!e) return std::move(e).error();
    engine = std::move(e.value());
    if (!engine->uses_io_uring())
      spdlog::warn("io_uring unavailable ({}); using synchronous pread/pwrite, which is slower",
                   engine->fallback_reason());

    staging = std::make_unique<StagingWorkers>(*engine, config.hooks.before_staging);

    epoll_fd.reset(::epoll_create1(EPOLL_CLOEXEC));
    stop_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_fd || !stop_fd) return errno_error("cannot create epoll/eventfd");
    replies.watch_with(epoll_fd.get());
    sessions = std::make_unique<SessionTable>(config, roots, *engine, ipc, *staging, epoll_fd.get(),
                                              [this](const IpcExports::Users& u) { notify_users(u); });
    chunks = std::make_unique<ChunkIo>(*engine, *sessions, config.max_blobs_per_uid, config.max_chunks_per_uid,
                                       config.hash_threads ? config.hash_threads : automatic_hash_threads(),
                                       config.hooks.before_hash);
    spdlog::info("hashing chunks (WRITEs before their write, READs after their read) on {} thread(s){}",
                 chunks->hash_threads(), config.hash_threads ? "" : " (hash-threads = 0: one per two CPUs, 2 to 8)");
    router =
        std::make_unique<ControlRouter>(*sessions, [this](uint64_t conn_id, uint64_t rid, const proto::Message& m) {
          if (Connection* c = conn(conn_id)) send(*c, rid, m);
        });
    tier = std::make_unique<TierBroker>(*sessions, *staging, config.host_tier_keep, config.host_tier_ahead,
                                        [this](uint64_t conn_id, uint64_t rid, const proto::Message& m, int fd) {
                                          if (Connection* c = conn(conn_id)) send(*c, rid, m, fd);
                                        });
    objects = std::make_unique<ObjectRequests>(roots, *sessions, *tier, config.max_chunks_per_uid);

    if (auto s = take_lock(); !s) return s;
    // After the lock: a second daemon refused here must not overwrite (or remove) the first one's file.
    metrics = std::make_unique<MetricsExporter>(config, *sessions, roots);
    router->set_metrics(&metrics->metrics());
    chunks->set_metrics(&metrics->metrics());
    sweep();
    if (auto s = bind_socket(); !s) return s;
    if (config.sweep_interval_s > 0) {
      sweep_fd.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
      if (!sweep_fd) return errno_error("cannot create the sweep timer");
      itimerspec its{};
      its.it_interval.tv_sec = config.sweep_interval_s;
      its.it_value.tv_sec = config.sweep_interval_s;
      ::timerfd_settime(sweep_fd.get(), 0, &its, nullptr);
    }
    for (auto [fd, key] : {std::pair{listen_fd.get(), uint64_t{kKeyListen}},
                           {stop_fd.get(), uint64_t{kKeyStop}},
                           {engine->event_fd(), uint64_t{kKeyIo}},
                           {staging->event_fd(), uint64_t{kKeyStaging}},
                           {chunks->hash_event_fd(), uint64_t{kKeyHashed}},
                           {sweep_fd.get(), uint64_t{kKeySweep}}}) {
      if (fd < 0) continue;
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = key;
      if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return errno_error("epoll_ctl");
    }
    return {};
  }

  ~Impl() {
    router.reset();
    chunks.reset();
    sessions.reset();
    if (bound_socket) ::unlink(config.socket_path.c_str());
  }

  // ----------------------------------------------------------------------------------------------
  // Sweeping dead ranks (startup, timer, tmsctl gc)

  storage::SweepStats sweep() {
    const std::set<std::string> live = sessions->reap_dead();
    auto r = storage::sweep_dead_ranks(
        roots, [&](const std::string& rel) { return live.count(rel) > 0; },
        [](const std::string& w) { spdlog::warn("sweep: {}", w); });
    if (!r) {
      spdlog::error("sweep failed: {}", r.error().describe());
      return {};
    }
    if (r->removed_dirs > 0)
      spdlog::info("sweep: removed {} directories of dead ranks ({} bytes)", r->removed_dirs, r->removed_bytes);
    return *r;
  }

  // ----------------------------------------------------------------------------------------------
  // Sending

  void send(Connection& c, uint64_t request_id, const proto::Message& m, int fd = -1) {
    replies.send(c, request_id, m, fd);
  }

  void send_error(Connection& c, uint64_t request_id, int code, const std::string& message) {
    send(c, request_id, error_reply(code, message));
  }

  Connection* conn(uint64_t id) {
    auto it = conns.find(id);
    return it == conns.end() ? nullptr : it->second.get();
  }

  // ----------------------------------------------------------------------------------------------
  // Connections

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: the pending connection would wake us forever. Stop listening until
          // a connection closes (close_connection resumes it).
          spdlog::warn("out of file descriptors ({}); not accepting until a connection closes", std::strerror(errno));
          set_accepting(false);
        } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
          spdlog::warn("accept: {}", std::strerror(errno));
        }
        return;
      }
      auto c = std::make_unique<Connection>();
      c->id = next_conn++;
      c->fd.reset(fd);
      socklen_t len = sizeof(c->cred);
      if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) != 0) {
        spdlog::warn("SO_PEERCRED failed: {}; dropping the connection", std::strerror(errno));
        continue;
      }
      if (c->cred.uid != 0 && std::count_if(conns.begin(), conns.end(), [&](const auto& kv) {
                                return kv.second->cred.uid == c->cred.uid;
                              }) >= static_cast<long>(config.max_connections_per_uid)) {
        const std::string why = fmt::format(
            "uid {} already has {} connections to tmsdiskd, the most one user may have (max-connections-per-uid): "
            "each rank and each running tmsctl holds one; end some, or ask the administrator to raise the limit",
            c->cred.uid, config.max_connections_per_uid);
        spdlog::warn("refused a connection of pid {}: {}", c->cred.pid, why);
        // Said before the close, as the answer to whatever it sends first (HELLO): the socket's
        // buffer is empty, so this does not block, and a failure only loses the explanation.
        (void)proto::send_message(fd, proto::encode(0, error_reply(EDQUOT, why)));
        continue;
      }
      c->interest = EPOLLIN;
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = c->id;
      if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) continue;
      conns.emplace(c->id, std::move(c));
    }
  }

  void set_accepting(bool on) {
    if (accepting == on) return;
    accepting = on;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kKeyListen;
    ::epoll_ctl(epoll_fd.get(), on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, listen_fd.get(), &ev);
  }

  // Connections that have not said HELLO within the deadline are closed (a peer that connects and
  // says nothing must not hold a descriptor forever). Returns ms until the next deadline, or -1.
  int expire_silent_connections() {
    const auto now = Clock::now();
    auto next = Clock::time_point::max();
    std::vector<uint64_t> silent;
    for (auto& [id, c] : conns) {
      if (c->hello_done || c->hello_pending) continue;  // a HELLO being served said something
      const auto deadline = c->accepted + kHelloDeadline;
      if (deadline <= now)
        silent.push_back(id);
      else
        next = std::min(next, deadline);
    }
    for (uint64_t id : silent) close_connection(id);
    if (next == Clock::time_point::max()) return -1;
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count()) + 1;
  }

  void close_connection(uint64_t id) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Connection& c = *it->second;
    ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    if (c.hello_pending) {
      sessions->abandon_open(id);  // its charge goes now; its buffer when built
      router->opening_done(id);
    }
    if (c.session_id) {
      // The shim's pending commands fail; its files go once no I/O of it is in flight.
      if (Session* s = sessions->find(c.session_id)) router->session_lost(*s);
      sessions->detach(c.session_id);
    }
    router->connection_closed(id);
    replies.drop(c);  // its replies no longer count against its user
    conns.erase(it);
    set_accepting(true);
  }

  void on_readable(Connection& c) {
    std::vector<uint8_t> buf;
    // Bounded per wakeup so one busy peer cannot starve the others; a peer that leaves its replies
    // unread is not read further (update_interest).
    for (int i = 0; i < 64 && !c.closing && !ReplyQueues::reads_paused(c); ++i) {
      int fd = -1;
      std::vector<int> extra;
      long n = proto::recv_message(c.fd.get(), buf, &fd, &extra);
      UniqueFd passed(fd);  // kept by an on_shim_fd() that takes it; the reaper closes any other, on every path
      struct Discard {
        FdReaper& reaper;
        UniqueFd& fd;
        std::vector<int>& extra;
        ~Discard() {
          reaper.discard(std::move(fd));
          for (int e : extra) reaper.discard(UniqueFd(e));
        }
      } discard{reaper, passed, extra};
      if (n == -EAGAIN) return;
      if (n == 0) {
        c.closing = true;
        replies.drop(c);
        return;
      }
      if (n == -EMSGSIZE) {
        send_error(c, 0, EMSGSIZE, "message exceeds the 64 KiB protocol limit");
        c.closing = true;
        return;
      }
      if (n == -ETOOMANYREFS) {
        // The message arrived whole (so its request id is known), its descriptors did not: what it
        // asks cannot be done. Those that arrived are closed with the others (Discard).
        auto h = proto::peek_header(buf);
        send_error(c, h ? h->request_id : 0, EINVAL,
                   fmt::format("too many descriptors passed with one message (more than {}; at most {}, and only "
                               "HELLO, IPC_EXPORT, TIER_ADOPT, STORE_OPEN and SET_RANK_DIR take one)",
                               proto::kMaxPassedFds, proto::kMaxPassedFds));
        c.closing = true;
        return;
      }
      if (n < 0) {
        c.closing = true;
        replies.drop(c);
        return;
      }
      auto d = proto::decode(buf);
      if (!d.envelope) {
        auto h = proto::peek_header(buf);
        spdlog::warn("malformed message from pid {} uid {}: {}", c.cred.pid, c.cred.uid, d.error);
        send_error(c, h ? h->request_id : 0, d.code, d.error);
        c.closing = true;  // a peer that sends malformed messages cannot be trusted to stay in sync
        return;
      }
      handle(c, *d.envelope, passed);
    }
  }

  // ----------------------------------------------------------------------------------------------
  // Dispatch

  void handle(Connection& c, proto::Envelope& env, UniqueFd& passed) {
    if (!c.hello_done) {
      auto* hello = std::get_if<proto::Hello>(&env.body);
      if (!hello) {
        send_error(c, env.request_id, EPROTO, "the first message must be HELLO");
        c.closing = true;
        return;
      }
      on_hello(c, env.request_id, *hello, passed);
      return;
    }
    const uint64_t rid = env.request_id;
    std::visit(
        [&](auto& m) {
          using T = std::decay_t<decltype(m)>;
          // A shim's requests are the messages an on_shim() overload takes.
          if constexpr (requires { on_shim(c, rid, m); }) {
            if (c.role != proto::Role::Shim) return protocol_violation(c, rid, T::kType);
            on_shim(c, rid, m);
          } else if constexpr (requires { on_shim_fd(c, rid, m, passed); }) {
            // ... and those that may carry a descriptor, an on_shim_fd() overload's.
            if (c.role != proto::Role::Shim) return protocol_violation(c, rid, T::kType);
            on_shim_fd(c, rid, m, passed);
          } else if constexpr (requires { on_ipc(c, rid, m); }) {
            if (c.role != proto::Role::Shim) return protocol_violation(c, rid, T::kType);
            on_ipc(c, rid, m);
          } else if constexpr (std::is_same_v<T, proto::ListSessions> || std::is_same_v<T, proto::Control> ||
                               std::is_same_v<T, proto::Gc>) {
            on_control(c, rid, m);
          } else {
            protocol_violation(c, rid, T::kType);
          }
        },
        env.body);
  }

  void protocol_violation(Connection& c, uint64_t rid, proto::MsgType type) {
    send_error(c, rid, EPROTO, fmt::format("unexpected {} on this connection", proto::type_name(type)));
    c.closing = true;
  }

  void on_hello(Connection& c, uint64_t rid, const proto::Hello& h, UniqueFd& dir) {
    if (!peer_allowed(c, config.allowed_uids, config.allowed_gids)) {
      send_error(c, rid, EACCES,
                 fmt::format("uid {} is not allowed to use this tmsdiskd (see allowed-uid/allowed-gid)", c.cred.uid));
      c.closing = true;
      return;
    }
    c.role = static_cast<proto::Role>(h.role);
    if (c.role == proto::Role::Control) {
      c.hello_done = true;
      proto::Welcome w;
      w.rank_dir = roots[0].path;  // tmsctl env offers it as TMS_DISK_BACKUP_DIR
      w.staging_budget_bytes = config.staging_budget_bytes;
      w.chunk_bytes = config.chunk_bytes;
      w.max_staging_budget_bytes = config.max_staging_budget_bytes;
      w.version = TMSDISK_VERSION;  // `tmsctl doctor` names the daemon it reached
      send(c, rid, w);
      return;
    }
    // What is cheap is checked here; the staging buffer (seconds for a GiB on a loaded node) is
    // built by a worker, and the HELLO finishes in on_staging_done(). Meanwhile the connection is
    // not read, and its quotas are charged.
    auto shape = sessions->begin_open(c.cred, c.id, h, (h.flags & proto::kHelloRankDir) ? std::move(dir) : UniqueFd());
    if (!shape) {
      spdlog::warn("refused session for pid {} uid {}: {}", c.cred.pid, c.cred.uid, shape.error().describe());
      send_error(c, rid, shape.error().errnum(), shape.error().describe());
      c.closing = true;
      return;
    }
    c.hello_pending = true;
    c.hello_request_id = rid;
    replies.update_interest(c);
    std::string why;
    const int claimed = engine->claim_buffer_slot(&why);
    if (claimed < 0)
      spdlog::info("pid {}: staging not registered with io_uring ({}); using plain I/O", c.cred.pid, why);
    try {
      staging->build(c.id, h.job, shape->chunk_bytes, shape->slot_count, claimed);
    } catch (const std::bad_alloc&) {
      engine->release_buffer_slot(claimed);
      sessions->abandon_open(c.id);
      router->opening_done(c.id);
      c.hello_pending = false;
      send_error(c, rid, ENOMEM, "the daemon is out of memory; try again later");
      c.closing = true;
    }
  }

  // Staging buffers built (HELLOs to finish) and torn down (their fixed-buffer slots to release).
  void on_staging_done() {
    auto done = staging->finished();
    for (int slot : done.emptied_slots) engine->release_buffer_slot(slot);
    for (auto& t : done.tiers) tier->built(t);
    for (auto& b : done.built) {
      Connection* c = conn(b.conn_id);
      const bool awaited = c && c->hello_pending;
      if (b.claimed_index >= 0) {
        if (b.buffer && b.buffer->buf_index() == b.claimed_index) {
          engine->commit_buffer_slot(b.claimed_index, b.buffer->base(), b.buffer->bytes());
        } else {
          // Not registered there (a buffer tears down without it): the slot is free again.
          engine->release_buffer_slot(b.claimed_index);
          if (b.buffer && awaited)
            spdlog::info("pid {}: staging not registered with io_uring ({}); using plain I/O", c->cred.pid,
                         b.not_registered);
        }
      }
      if (!awaited) continue;  // the client went away: the buffer goes with `b` (StagingPtr)
      c->hello_pending = false;
      replies.update_interest(*c);
      if (b.buffer) {
        finish_hello(*c, std::move(b.buffer));
      } else {
        sessions->abandon_open(c->id);
        spdlog::warn("refused session for pid {} uid {}: {}", c->cred.pid, c->cred.uid, b.error.describe());
        send_error(*c, c->hello_request_id, b.error.errnum(), b.error.describe());
        c->closing = true;
      }
      router->opening_done(c->id);  // a pause or resume waiting for it asks it now, if it became a session
    }
  }

  void finish_hello(Connection& c, StagingPtr buffer) {
    const uint64_t rid = c.hello_request_id;
    auto r = sessions->finish_open(c.id, std::move(buffer));
    if (!r) {
      spdlog::warn("refused session for pid {} uid {}: {}", c.cred.pid, c.cred.uid, r.error().describe());
      send_error(c, rid, r.error().errnum(), r.error().describe());
      c.closing = true;
      return;
    }
    Session& s = **r;
    c.hello_done = true;
    c.session_id = s.id;
    proto::Welcome w;
    w.session_id = s.id;
    w.token = s.token;
    w.staging_budget_bytes = s.staging->bytes();
    w.chunk_bytes = s.staging->chunk_bytes();
    w.slot_count = s.staging->slot_count();
    w.restored = s.store->paused() ? 1 : 0;
    w.rank_dir = s.store->dir_path();
    w.adopted = s.adopted ? 1 : 0;
    send(c, rid, w, s.staging->memfd());
    spdlog::info("session {}: pid {} uid {} job {} rank {} ({} slots of {} MiB){}", s.id, s.cred.pid, s.cred.uid, s.job,
                 s.rank, w.slot_count, w.chunk_bytes / kMiB, w.restored ? ", restored paused state" : "");
    // A rank back from an orphaned connection learns who has its exports open now.
    for (const auto& u : ipc.exports_of(s.id)) notify_users(u);
  }

  // ----------------------------------------------------------------------------------------------
  // Shim requests

  Session& session_of(Connection& c) { return *sessions->find(c.session_id); }

  void on_shim(Connection& c, uint64_t rid, proto::Reserve& m) { send(c, rid, chunks->reserve(session_of(c), m)); }
  void on_shim(Connection& c, uint64_t rid, proto::Commit& m) { send(c, rid, chunks->commit(session_of(c), m)); }
  void on_shim(Connection& c, uint64_t rid, proto::PauseState&) { send(c, rid, chunks->pause_state(session_of(c))); }
  void on_shim(Connection& c, uint64_t rid, proto::Write& m) {
    if (auto reply = chunks->write(session_of(c), rid, m)) send(c, rid, *reply);
  }
  void on_shim(Connection& c, uint64_t rid, proto::Read& m) {
    if (auto reply = chunks->read(session_of(c), rid, m)) send(c, rid, *reply);
  }

  // The rank's objects (object_requests.h); their chunks go through ChunkIo as a pause's do.
  void on_shim(Connection& c, uint64_t rid, proto::StoreCommit& m) {
    if (auto reply = objects->commit(session_of(c), rid, m, *chunks)) send(c, rid, *reply);
  }
  void on_shim(Connection& c, uint64_t rid, proto::StoreRemove& m) { send(c, rid, objects->remove(session_of(c), m)); }
  // Its memfd rides along with kStoreOpenHeld; answered now, or by the tier broker once the object's
  // host-tier memory is made.
  void on_shim_fd(Connection& c, uint64_t rid, const proto::StoreOpen& m, UniqueFd& fd) {
    if (auto reply = objects->open(session_of(c), rid, m, fd)) send(c, rid, *reply);
  }
  void on_shim(Connection& c, uint64_t rid, proto::StoreWrite& m) {
    if (auto reply = chunks->write(session_of(c), rid, m)) send(c, rid, *reply);
  }
  void on_shim(Connection& c, uint64_t rid, proto::StoreRead& m) {
    if (auto reply = chunks->read(session_of(c), rid, m)) send(c, rid, *reply);
  }

  // torch_memory_saver's set_disk_backup_dir: the directory rides along.
  void on_shim_fd(Connection& c, uint64_t rid, const proto::SetRankDir& m, UniqueFd& fd) {
    if (Status st = sessions->move_files(session_of(c), std::move(fd), m.path); !st)
      return send_error(c, rid, st.error().errnum(), st.error().describe());
    send(c, rid, proto::OkReply{});
  }

  void on_shim(Connection& c, uint64_t, proto::Report& m) {
    Session& s = session_of(c);
    s.stats = m.stats;
    if (s.stats.last_change_unix_ms == 0) s.stats.last_change_unix_ms = unix_ms();
  }

  void on_shim(Connection& c, uint64_t rid, proto::CommandDone& m) { router->command_done(session_of(c), rid, m); }

  // ----------------------------------------------------------------------------------------------
  // Host-memory tier (host_tier.h)

  void on_shim(Connection& c, uint64_t rid, proto::TierAsk& m) { tier->ask(session_of(c), rid, m.bytes, m.flags); }
  void on_shim(Connection& c, uint64_t rid, proto::TierRelease&) {
    tier->release(session_of(c));
    send(c, rid, proto::OkReply{});
  }
  void on_shim(Connection& c, uint64_t, proto::TierKeep&) { tier->keep(session_of(c)); }

  // A rank kept host-tier memory holding paused chunks across a daemon restart: it counts against the
  // budget again, even past it (the bytes are the rank's either way; new grants wait until it is released).
  void on_shim_fd(Connection& c, uint64_t rid, const proto::TierAdopt&, UniqueFd& fd) {
    if (!fd) return send_error(c, rid, EINVAL, "TIER_ADOPT without the host-tier memory's descriptor");
    if (Status st = tier->adopt(session_of(c), fd); !st)
      return send_error(c, rid, st.error().errnum(), st.error().describe());
    send(c, rid, proto::OkReply{});
  }
  void on_shim(Connection& c, uint64_t rid, proto::Progress& m) { router->progress(session_of(c), rid, m); }

  // ----------------------------------------------------------------------------------------------
  // Legacy IPC (ipc_exports.h)

  // Takes `fd` only when the export is recorded.
  void on_shim_fd(Connection& c, uint64_t rid, const proto::IpcExport& m, UniqueFd& fd) {
    Session& s = session_of(c);
    if (!fd) return send_error(c, rid, EINVAL, "IPC_EXPORT without the allocation's descriptor");
    if (auto st = check_memory_fd(fd.get()); !st) return send_error(c, rid, st.error().errnum(), st.error().describe());
    proto::IpcExported out;
    if (m.export_id == 0) {
      auto id = ipc.add(s.id, s.cred.uid, s.cred.pid, std::move(fd), m.bytes, m.device);
      if (!id) return send_error(c, rid, id.error().errnum(), id.error().describe());
      out.export_id = *id;
      spdlog::debug("session {}: legacy IPC export {} ({} bytes on device {})", s.id, *id, m.bytes, m.device);
    } else {
      if (auto st = ipc.refresh(m.export_id, s.id, std::move(fd), m.bytes); !st)
        return send_error(c, rid, st.error().errnum(), st.error().describe());
      out.export_id = m.export_id;
    }
    send(c, rid, out);
  }

  void on_ipc(Connection& c, uint64_t rid, const proto::IpcRevoke& m) {
    Session& s = session_of(c);
    auto st = m.freed ? ipc.forget(m.export_id, s.id) : ipc.revoke(m.export_id, s.id);
    if (!st) return send_error(c, rid, st.error().errnum(), st.error().describe());
    send(c, rid, proto::OkReply{});
  }

  void on_ipc(Connection& c, uint64_t rid, const proto::IpcOpen& m) {
    Session& s = session_of(c);
    auto o = ipc.open(m.export_id, s.id, s.cred.uid);
    if (!o) return send_error(c, rid, o.error().errnum(), o.error().describe());
    proto::IpcOpened out;
    out.export_id = m.export_id;
    out.bytes = o->bytes;
    out.device = o->device;
    out.exporter_pid = o->exporter_pid;
    send(c, rid, out, o->fd);
    notify_users(o->users);
  }

  void on_ipc(Connection& c, uint64_t rid, const proto::IpcClose& m) {
    Session& s = session_of(c);
    auto u = ipc.close(m.export_id, s.id);
    if (!u) return send_error(c, rid, u.error().errnum(), u.error().describe());
    send(c, rid, proto::OkReply{});
    notify_users(*u);
  }

  // Unsolicited (request id 0); lost if the exporter is disconnected, which resends on reconnect.
  void notify_users(const IpcExports::Users& u) {
    Session* s = sessions->find(u.owner);
    if (!s || s->conn_id == 0) return;
    Connection* c = conn(s->conn_id);
    if (!c) return;
    send(*c, 0, proto::IpcUsers{.export_id = u.export_id, .importers = u.importers});
  }

  // ----------------------------------------------------------------------------------------------
  // I/O completions

  void on_io() {
    chunks->on_completions([&](Session& s, uint64_t rid, const proto::Message& reply) {
      if (Connection* c = conn(s.conn_id)) send(*c, rid, reply);
    });
  }

  void on_hashed() {
    chunks->on_hashed([&](Session& s, uint64_t rid, const proto::Message& reply) {
      if (Connection* c = conn(s.conn_id)) send(*c, rid, reply);
    });
  }

  // ----------------------------------------------------------------------------------------------
  // tmsctl requests

  void on_control(Connection& c, uint64_t rid, proto::ListSessions& m) {
    router->list_sessions(c.id, c.cred.uid, rid, m);
  }
  void on_control(Connection& c, uint64_t rid, proto::Control& m) { router->control(c.id, c.cred.uid, rid, m); }

  void on_control(Connection& c, uint64_t rid, proto::Gc&) {
    auto st = sweep();
    proto::GcResult r;
    r.removed_dirs = st.removed_dirs;
    r.removed_bytes = st.removed_bytes;
    send(c, rid, r);
  }

  // A private daemon that nobody ever connected to (its starter died first) must not linger.
  // Returns ms until it gives up, or -1.
  int idle_exit_timeout() {
    if (!config.exit_when_idle || sessions->had_session() || !sessions->empty() || !conns.empty()) return -1;
    const auto left = started + std::chrono::seconds(config.idle_exit_s) - Clock::now();
    if (left <= Clock::duration::zero()) {
      spdlog::info("no session came in {} s; exiting (idle exit, idle-exit-s)", config.idle_exit_s);
      stopping = true;
      return 0;
    }
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count()) + 1;
  }

  // ----------------------------------------------------------------------------------------------
  // Loop

  Status run() {
    std::vector<epoll_event> events(64);
    while (!stopping) {
      engine->submit();
      int timeout = router->expire();
      if (const int t = tier->expire(); t >= 0 && (timeout < 0 || t < timeout)) timeout = t;
      const int hello = expire_silent_connections();
      if (hello >= 0 && (timeout < 0 || hello < timeout)) timeout = hello;
      const int idle = idle_exit_timeout();
      if (stopping) break;
      if (idle >= 0 && (timeout < 0 || idle < timeout)) timeout = idle;
      if (const int m = metrics->write_if_due(); m >= 0 && (timeout < 0 || m < timeout)) timeout = m;
      int n = ::epoll_wait(epoll_fd.get(), events.data(), static_cast<int>(events.size()), timeout);
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno_error("epoll_wait");
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t key = events[i].data.u64;
        switch (key) {
          case kKeyListen: accept_all(); break;
          case kKeyStop: stopping = true; break;
          case kKeyIo: on_io(); break;
          case kKeyStaging: on_staging_done(); break;
          case kKeyHashed: on_hashed(); break;
          case kKeySweep: {
            uint64_t ticks;
            (void)!::read(sweep_fd.get(), &ticks, sizeof(ticks));
            sweep();
            tier->check_memory();
            break;
          }
          default: {
            if (key & SessionTable::kOrphanKeyBit) {
              sessions->reap_orphan(key & ~SessionTable::kOrphanKeyBit);
              break;
            }
            Connection* c = conn(key);
            if (!c) break;
            if (events[i].events & EPOLLOUT) replies.flush(*c);
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(*c);
            // Not read while its HELLO is served, but a hangup still says it has gone.
            if (c->hello_pending && (events[i].events & (EPOLLHUP | EPOLLERR))) c->closing = true;
            if (c->closing && (c->outbox.empty() || (events[i].events & (EPOLLHUP | EPOLLERR)))) close_connection(key);
          }
        }
      }
      // Replies produced while handling one connection may have closed another (send failures).
      std::vector<uint64_t> dead;
      for (auto& [id, c] : conns)
        if (c->closing && c->outbox.empty()) dead.push_back(id);
      for (uint64_t id : dead) close_connection(id);
      if (config.exit_when_idle && sessions->had_session() && sessions->empty()) {
        spdlog::info("last session ended; exiting (idle exit)");
        stopping = true;
      }
    }
    return drain();
  }

  // Graceful stop: wait for I/O already submitted and for the chunks being hashed (their memory must
  // stay mapped), then close every session. Files of live ranks stay on disk: they survive a daemon
  // restart (invariant 6).
  Status drain() {
    chunks->stop_hashing();
    spdlog::info("stopping: waiting for {} I/O request(s) in flight", engine->in_flight());
    std::vector<io::Completion> completions;
    while (engine->in_flight() > 0) {
      completions.clear();
      engine->wait(completions);
    }
    conns.clear();
    sessions->all().clear();  // their staging buffers unmap; their files stay
    return {};
  }
};

std::vector<std::string> inconsistencies(const Config& config) {
  std::vector<std::string> wrong;
  if (config.staging_budget_bytes < min_staging_budget_bytes(config.chunk_bytes))
    wrong.push_back(
        fmt::format("staging-budget-mb ({}) must be at least 2 x chunk-mb ({}): raise staging-budget-mb "
                    "or lower chunk-mb",
                    config.staging_budget_bytes / kMiB, config.chunk_bytes / kMiB));
  // Otherwise a rank that asks for nothing would be refused the daemon's own default.
  if (config.staging_budget_bytes > config.max_staging_budget_bytes)
    wrong.push_back(fmt::format("staging-budget-mb ({}) must be at most max-staging-budget-mb ({})",
                                config.staging_budget_bytes / kMiB, config.max_staging_budget_bytes / kMiB));
  return wrong;
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::create(Config config) {
  try {
    auto impl = std::make_unique<Impl>(std::move(config));
    if (auto st = impl->setup(); !st) return std::move(st).error();
    return std::unique_ptr<Server>(new Server(std::move(impl)));
  } catch (const std::exception& e) {
    return make_error(ENOMEM, fmt::format("daemon setup failed: {}", e.what()));
  }
}

Status Server::run() {
  try {
    return impl_->run();
  } catch (const std::exception& e) {
    return make_error(EIO, fmt::format("daemon loop failed: {}", e.what()));
  }
}

void Server::stop() noexcept {
  uint64_t one = 1;
  (void)!::write(impl_->stop_fd.get(), &one, sizeof(one));
}

const Config& Server::config() const noexcept {
  return impl_->config;
}

Server::ReplyBacklog Server::reply_backlog_peaks() const noexcept {
  return {impl_->replies.peak_connection_bytes(), impl_->replies.peak_uid_bytes()};
}

}  // namespace tmsdisk::server
