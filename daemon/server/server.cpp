// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's event loop: one thread, epoll over the listening socket, every connection, the I/O
// engine's eventfd and a sweep timer. Nothing in the loop blocks on a peer: replies that do not fit
// in a socket buffer wait in a per-connection outbox.
#include "server.h"

#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <set>

#include "fd_reaper.h"
#include "ipc_exports.h"
#include "storage.h"
#include "tmsdisk/common/proc.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::server {
namespace {

using Clock = std::chrono::steady_clock;
namespace proto = tmsdisk::proto;

constexpr uint64_t kMiB = 1ull << 20;
constexpr std::size_t kMaxOutboxBytes = 16 << 20;  // queued reply bytes before a non-reading peer is dropped
constexpr std::size_t kReadPauseReplies = 256;    // stop reading a peer with this many replies queued
constexpr std::size_t kMaxQueuedFds = 16;         // descriptors queued for a peer that does not read them
constexpr auto kHelloDeadline = std::chrono::seconds(10);
constexpr std::size_t kMaxConnectionsPerUid = 512;
constexpr auto kIdleExitAfter = std::chrono::seconds(60);
constexpr std::size_t kMaxReserveBlobs = 1 << 20;
constexpr std::size_t kSessionsPerPage = 128;
constexpr std::size_t kResultsPerMessage = 100;
constexpr uint32_t kMinSlotBytes = 64 * 1024;
constexpr uint32_t kMaxSlotBytes = 64 * kMiB;

// epoll keys below kFirstConnection name the server's own descriptors.
enum : uint64_t { kKeyListen = 1, kKeyStop = 2, kKeyIo = 3, kKeySweep = 4, kFirstConnection = 16 };
// The pidfd of an orphaned session (see Server::Impl::maybe_destroy) is keyed by its session id
// with this bit set.
constexpr uint64_t kOrphanKeyBit = 1ull << 63;

uint64_t random_token() {
  uint64_t t = 0;
  while (t == 0)
    if (::getrandom(&t, sizeof(t), 0) != sizeof(t)) t = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return t;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

// A reply waiting in a connection's outbox, with the descriptor it passes (IPC_OPENED).
struct Outgoing {
  std::vector<uint8_t> bytes;
  UniqueFd fd;
};

struct Connection {
  uint64_t id = 0;
  UniqueFd fd;
  ucred cred{};
  bool hello_done = false;
  proto::Role role = proto::Role::Control;
  uint64_t session_id = 0;  // shim connections
  std::deque<Outgoing> outbox;
  std::size_t outbox_bytes = 0;
  std::size_t outbox_fds = 0;  // descriptors among the queued replies (each one of ours)
  uint32_t interest = 0;  // the epoll events currently asked for
  Clock::time_point accepted = Clock::now();
  bool closing = false;  // close once the outbox drains (after a fatal error reply)
};

struct Session {
  uint64_t id = 0;
  uint64_t conn_id = 0;  // 0 once the shim disconnected (teardown waits for I/O in flight)
  uint64_t token = 0;
  ucred cred{};
  std::string job;
  int64_t rank = -1;
  std::string relative_dir;  // "<uid>/<job>/rank<R>-<pid>", what the sweep must not touch
  UniqueFd memfd;
  uint8_t* staging = nullptr;
  uint64_t staging_bytes = 0;
  uint32_t slot_bytes = 0;
  uint32_t slot_count = 0;
  int buf_index = -1;
  std::vector<uint8_t> slot_busy;
  std::size_t io_in_flight = 0;
  std::unique_ptr<storage::RankStore> store;
  uint64_t start_time = 0;  // of the rank's process, with cred.pid its identity
  UniqueFd pidfd;           // readable once the rank's process has exited (-1 on kernels without pidfd)
  bool orphan = false;      // connection gone, process alive, files hold its only copy: kept
  bool adopted = false;     // continues an orphan: its files, exports and opens carried over
  std::vector<proto::BlobSize> pending_reserve;
  proto::RankStats stats;
  std::map<uint64_t, uint64_t> commands;  // our Command request id -> control op id
};

struct PendingIo {
  uint64_t session_id = 0;
  uint64_t request_id = 0;
  io::Op op = io::Op::Write;
  uint32_t slot = 0;
  uint64_t blob = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint64_t checksum = 0;  // computed at submit for writes, expected for reads
};

struct ControlOp {
  uint64_t id = 0;
  uint64_t conn_id = 0;
  uint64_t request_id = 0;
  proto::CommandOp op = proto::CommandOp::Pause;
  std::map<uint64_t, proto::RankResult> results;  // by session id
  std::set<uint64_t> waiting;                     // session ids that have not answered
  Clock::time_point deadline = Clock::time_point::max();
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
  bool had_session = false;

  std::map<uint64_t, std::unique_ptr<Connection>> conns;
  std::map<uint64_t, Session> sessions;
  std::map<uint64_t, PendingIo> ios;
  std::map<uint64_t, ControlOp> control_ops;
  uint64_t next_conn = kFirstConnection;
  uint64_t next_session = 1;
  uint64_t next_tag = 1;
  uint64_t next_request = 1;
  uint64_t next_control = 1;
  std::vector<io::Completion> completions;
  IpcExports ipc{random_token, IpcExports::Limits{config.max_ipc_exports_per_uid, config.max_ipc_exports}};
  FdReaper reaper;  // descriptors clients passed that are not kept

  explicit Impl(Config c) : config(std::move(c)) {}

  // ----------------------------------------------------------------------------------------------
  // Setup

  Status take_lock() {
    const std::string path = config.socket_path + ".lock";
    lock_fd.reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock_fd) return errno_error("cannot open the lock file " + path);
    if (::flock(lock_fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK)
        return make_error(EADDRINUSE, "another tmsdiskd already serves " + config.socket_path +
                                          " (it holds " + path + "); stop it first or pick another --socket");
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
    struct stat st{};
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
      return make_error(EINVAL, "no storage root configured: pass --root DIR (one per NVMe) or root= in the config");
    if (config.slot_mb == 0 || (config.slot_mb * kMiB) > kMaxSlotBytes)
      return make_error(EINVAL, "slot size must be 1..64 MiB");
    if (config.staging_mb < config.slot_mb * 2ull)
      return make_error(EINVAL, "the staging buffer must hold at least two slots (staging >= 2 x slot)");
    if (config.max_staging_mb < config.staging_mb)
      return make_error(EINVAL, "max staging must be at least the default staging size");

    auto r = storage::Roots::open(config.roots, config.allow_tmpfs);
    if (!r) return std::move(r).error();
    roots = std::move(r.value());
    for (std::size_t i = 0; i < roots.size(); ++i) {
      // A root daemon creates directories for every user inside its roots; a root others can write
      // to would let them plant or swap those directories between our checks.
      struct stat st{};
      if (::geteuid() == 0 && ::fstat(roots[i].dir.get(), &st) == 0 && (st.st_uid != 0 || (st.st_mode & 022) != 0))
        return make_error(EPERM, "root " + roots[i].path + " must be owned by root and not writable by group or others "
                                 "(mkdir -m 0755 a dedicated directory, e.g. /var/lib/tmsdisk/nvme0)");
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
    eo.fault = config.io_fault;
    auto e = io::Engine::create(eo);
    if (!e) return std::move(e).error();
    engine = std::move(e.value());
    if (!engine->uses_io_uring())
      spdlog::warn("io_uring unavailable ({}); using synchronous pread/pwrite, which is slower", engine->fallback_reason());

    if (auto s = take_lock(); !s) return s;
    sweep();
    if (auto s = bind_socket(); !s) return s;

    epoll_fd.reset(::epoll_create1(EPOLL_CLOEXEC));
    stop_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_fd || !stop_fd) return errno_error("cannot create epoll/eventfd");
    if (config.sweep_interval_s > 0) {
      sweep_fd.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
      if (!sweep_fd) return errno_error("cannot create the sweep timer");
      itimerspec its{};
      its.it_interval.tv_sec = config.sweep_interval_s;
      its.it_value.tv_sec = config.sweep_interval_s;
      ::timerfd_settime(sweep_fd.get(), 0, &its, nullptr);
    }
    for (auto [fd, key] : {std::pair{listen_fd.get(), uint64_t{kKeyListen}}, {stop_fd.get(), uint64_t{kKeyStop}},
                           {engine->event_fd(), uint64_t{kKeyIo}}, {sweep_fd.get(), uint64_t{kKeySweep}}}) {
      if (fd < 0) continue;
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = key;
      if (::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return errno_error("epoll_ctl");
    }
    return {};
  }

  ~Impl() {
    for (auto& [id, s] : sessions) release_session_resources(s);
    if (bound_socket) ::unlink(config.socket_path.c_str());
  }

  // ----------------------------------------------------------------------------------------------
  // Sweeping dead ranks (startup, timer, tmsctl gc)

  storage::SweepStats sweep() {
    std::vector<uint64_t> dead_orphans;
    for (auto& [id, s] : sessions)
      if (s.orphan && !rank_alive(s)) dead_orphans.push_back(id);
    for (uint64_t id : dead_orphans) reap_orphan(id);
    // Exports and opens of sessions that vanished without passing maybe_destroy (an orphan whose
    // rank failed to reconnect).
    for (const auto& u : ipc.drop([&](uint64_t id) { return sessions.count(id) == 0; })) notify_users(u);
    std::set<std::string> live;
    for (auto& [id, s] : sessions) live.insert(s.relative_dir);
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
    auto bytes = proto::encode(request_id, m);
    if (bytes.empty()) {
      spdlog::error("internal: could not encode a reply to connection {}", c.id);
      return;
    }
    if (c.outbox.empty()) {
      int rc = proto::send_message(c.fd.get(), bytes, fd);
      if (rc == 0) return;
      if (rc != -EAGAIN) {
        c.closing = true;  // peer gone; the read side notices too
        return;
      }
    }
    Outgoing out;
    out.bytes = std::move(bytes);
    if (fd >= 0 && c.outbox_fds >= kMaxQueuedFds) {
      spdlog::warn("connection {} (pid {}) does not read the descriptors it asked for; closing it", c.id, c.cred.pid);
      c.closing = true;
      return;
    }
    if (fd >= 0) {
      // The descriptor must outlive whatever owns it now (an export revoked meanwhile).
      out.fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (!out.fd) {
        spdlog::warn("connection {} (pid {}): cannot queue a descriptor: {}", c.id, c.cred.pid, std::strerror(errno));
        c.closing = true;
        return;
      }
    }
    if (c.outbox_bytes + out.bytes.size() > kMaxOutboxBytes) {
      spdlog::warn("connection {} (pid {}) does not read its replies; closing it", c.id, c.cred.pid);
      c.closing = true;
      drop_outbox(c);
      return;
    }
    c.outbox_bytes += out.bytes.size();
    c.outbox_fds += out.fd ? 1 : 0;
    c.outbox.push_back(std::move(out));
    update_interest(c);
  }

  static void drop_outbox(Connection& c) {
    c.outbox.clear();
    c.outbox_bytes = 0;
    c.outbox_fds = 0;
  }

  void send_error(Connection& c, uint64_t request_id, int code, const std::string& message) {
    proto::ErrorReply e;
    e.code = code > 0 ? code : EIO;
    e.message = message.substr(0, proto::kMaxTextLength);
    send(c, request_id, e);
  }

  // Writable while replies wait; readable unless a peer that does not read its replies has many
  // queued (backpressure: it cannot make the daemon buffer without bound by sending more requests).
  void update_interest(Connection& c) {
    uint32_t want = 0;
    if (c.outbox.size() < kReadPauseReplies) want |= EPOLLIN;
    if (!c.outbox.empty()) want |= EPOLLOUT;
    if (want == c.interest) return;
    c.interest = want;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = c.id;
    ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  }

  void flush(Connection& c) {
    while (!c.outbox.empty()) {
      int rc = proto::send_message(c.fd.get(), c.outbox.front().bytes, c.outbox.front().fd.get());
      if (rc == -EAGAIN) break;
      if (rc != 0) {
        drop_outbox(c);
        c.closing = true;
        break;
      }
      c.outbox_bytes -= c.outbox.front().bytes.size();
      c.outbox_fds -= c.outbox.front().fd ? 1 : 0;
      c.outbox.pop_front();
    }
    update_interest(c);
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
          }) >= static_cast<long>(kMaxConnectionsPerUid)) {
        spdlog::warn("uid {} has {} connections open; refusing more", c->cred.uid, kMaxConnectionsPerUid);
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
      if (c->hello_done) continue;
      const auto deadline = c->accepted + kHelloDeadline;
      if (deadline <= now) silent.push_back(id);
      else next = std::min(next, deadline);
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
    if (c.session_id) detach_session(c.session_id);
    // A tmsctl that went away no longer waits for its results.
    for (auto op = control_ops.begin(); op != control_ops.end();) {
      if (op->second.conn_id == id) {
        for (auto& [sid, s] : sessions)
          std::erase_if(s.commands, [&](const auto& kv) { return kv.second == op->first; });
        op = control_ops.erase(op);
      } else {
        ++op;
      }
    }
    conns.erase(it);
    set_accepting(true);
  }

  void on_readable(Connection& c) {
    std::vector<uint8_t> buf;
    // Bounded per wakeup so one busy peer cannot starve the others; a peer that leaves its replies
    // unread is not read further (update_interest).
    for (int i = 0; i < 64 && !c.closing && c.outbox.size() < kReadPauseReplies; ++i) {
      int fd = -1;
      std::vector<int> extra;
      long n = proto::recv_message(c.fd.get(), buf, &fd, &extra);
      UniqueFd passed(fd);  // only IPC_EXPORT keeps one; the reaper closes any other, on every path
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
        drop_outbox(c);
        return;
      }
      if (n == -EMSGSIZE) {
        send_error(c, 0, EMSGSIZE, "message exceeds the 64 KiB protocol limit");
        c.closing = true;
        return;
      }
      if (n < 0) {
        c.closing = true;
        drop_outbox(c);
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
      on_hello(c, env.request_id, *hello);
      return;
    }
    const uint64_t rid = env.request_id;
    std::visit(
        [&](auto& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, proto::Reserve> || std::is_same_v<T, proto::Write> ||
                        std::is_same_v<T, proto::Read> || std::is_same_v<T, proto::Commit> ||
                        std::is_same_v<T, proto::Report> || std::is_same_v<T, proto::CommandDone> ||
                        std::is_same_v<T, proto::Progress>) {
            if (c.role != proto::Role::Shim) return protocol_violation(c, rid, T::kType);
            on_shim(c, rid, m);
          } else if constexpr (std::is_same_v<T, proto::IpcExport>) {
            if (c.role != proto::Role::Shim) return protocol_violation(c, rid, T::kType);
            on_ipc_export(c, rid, m, passed);
          } else if constexpr (std::is_same_v<T, proto::IpcRevoke> || std::is_same_v<T, proto::IpcOpen> ||
                               std::is_same_v<T, proto::IpcClose>) {
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
    send_error(c, rid, EPROTO, std::string("unexpected ") + proto::type_name(type) + " on this connection");
    c.closing = true;
  }

  bool connect_allowed(const Connection& c) const {
    if (c.cred.uid == 0) return true;
    if (config.allowed_uids.empty() && config.allowed_gids.empty()) return true;
    if (std::find(config.allowed_uids.begin(), config.allowed_uids.end(), c.cred.uid) != config.allowed_uids.end())
      return true;
    std::vector<gid_t> groups(64);
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0 && errno == ERANGE) {
      groups.resize(len / sizeof(gid_t));  // the kernel said how many there are
      if (::getsockopt(c.fd.get(), SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0) len = 0;
    } else if (errno == ERANGE) {
      len = 0;
    }
    groups.resize(std::min<std::size_t>(groups.size(), len / sizeof(gid_t)));
    groups.push_back(c.cred.gid);
    for (gid_t g : groups)
      if (std::find(config.allowed_gids.begin(), config.allowed_gids.end(), g) != config.allowed_gids.end())
        return true;
    return false;
  }

  void on_hello(Connection& c, uint64_t rid, const proto::Hello& h) {
    if (!connect_allowed(c)) {
      send_error(c, rid, EACCES,
                 "uid " + std::to_string(c.cred.uid) + " is not allowed to use this tmsdiskd (see allowed-uid/allowed-gid)");
      c.closing = true;
      return;
    }
    c.role = static_cast<proto::Role>(h.role);
    if (c.role == proto::Role::Control) {
      c.hello_done = true;
      proto::Welcome w;
      w.rank_dir = roots[0].path;  // tmsctl env offers it as TMS_DISK_BACKUP_DIR
      send(c, rid, w);
      return;
    }
    auto r = open_session(c, h);
    if (!r) {
      spdlog::warn("refused session for pid {} uid {}: {}", c.cred.pid, c.cred.uid, r.error().describe());
      send_error(c, rid, r.error().errnum(), r.error().describe());
      c.closing = true;
      return;
    }
    Session& s = sessions.at(*r);
    c.hello_done = true;
    c.session_id = s.id;
    proto::Welcome w;
    w.session_id = s.id;
    w.token = s.token;
    w.staging_bytes = s.staging_bytes;
    w.slot_bytes = s.slot_bytes;
    w.slot_count = s.slot_count;
    w.restored = s.store->paused() ? 1 : 0;
    w.rank_dir = s.store->dir_path();
    w.adopted = s.adopted ? 1 : 0;
    send(c, rid, w, s.memfd.get());
    spdlog::info("session {}: pid {} uid {} job {} rank {} ({} slots of {} MiB){}", s.id, s.cred.pid, s.cred.uid,
                 s.job, s.rank, s.slot_count, s.slot_bytes / kMiB, w.restored ? ", restored paused state" : "");
    // A rank back from an orphaned connection learns who has its exports open now.
    for (const auto& u : ipc.exports_of(s.id)) notify_users(u);
  }

  Result<uint64_t> open_session(Connection& c, const proto::Hello& h) {
    if (!storage::valid_name(h.job))
      return make_error(EINVAL, "job name '" + h.job +
                                    "' is not allowed: use 1-64 letters, digits, '.', '_' or '-', not starting with '.'");
    if (!h.backup_dir.empty()) {
      auto root = roots.root_for(h.backup_dir);
      if (!root) return std::move(root).error();
    }
    const uint64_t slot = h.slot_bytes ? h.slot_bytes : config.slot_mb * kMiB;
    if (slot < kMinSlotBytes || slot > kMaxSlotBytes || slot % storage::kIoAlignment != 0)
      return make_error(EINVAL, "slot size " + std::to_string(slot) + " must be a multiple of 4 KiB between 64 KiB and 64 MiB");
    uint64_t staging = h.staging_bytes ? h.staging_bytes : config.staging_mb * kMiB;
    if (staging > config.max_staging_mb * kMiB)
      return make_error(EINVAL, "asked for " + std::to_string(staging / kMiB) + " MiB of staging; this daemon allows at most " +
                                    std::to_string(config.max_staging_mb) + " MiB (TMS_DISK_BACKUP_CHUNK_MB)");
    if (staging < 2 * slot)
      return make_error(EINVAL, "staging of " + std::to_string(staging) + " bytes holds fewer than two slots of " +
                                    std::to_string(slot));
    // Staging is pinned memory: bounded per user and for the whole daemon, so that no user can pin
    // the node's RAM by opening sessions.
    uint64_t uid_sessions = 0, uid_staging = 0, all_staging = 0;
    for (auto& [sid, other] : sessions) {
      all_staging += other.staging_bytes;
      if (other.cred.uid != c.cred.uid) continue;
      ++uid_sessions;
      uid_staging += other.staging_bytes;
    }
    if (c.cred.uid != 0 && uid_sessions >= config.max_sessions_per_uid)
      return make_error(EDQUOT, "uid " + std::to_string(c.cred.uid) + " already has " + std::to_string(uid_sessions) +
                                    " sessions, the most this daemon allows (max-sessions-per-uid)");
    if (c.cred.uid != 0 && uid_staging + staging > config.max_staging_per_uid_mb * kMiB)
      return make_error(EDQUOT, "uid " + std::to_string(c.cred.uid) + " would hold " +
                                    std::to_string((uid_staging + staging) / kMiB) + " MiB of staging, more than " +
                                    std::to_string(config.max_staging_per_uid_mb) +
                                    " MiB (max-staging-per-uid-mb); lower TMS_DISK_BACKUP_CHUNK_MB");
    if (all_staging + staging > config.max_total_staging_mb * kMiB)
      return make_error(ENOMEM, "the daemon's staging budget (" + std::to_string(config.max_total_staging_mb) +
                                    " MiB, max-total-staging-mb) is exhausted");
    const auto start_time = process_start_time(c.cred.pid);
    if (!start_time) return make_error(ESRCH, "cannot read the start time of pid " + std::to_string(c.cred.pid));
    storage::RankIdentity id;
    id.uid = c.cred.uid;
    id.gid = c.cred.gid;
    id.job = h.job;
    id.rank = h.rank;
    id.pid = c.cred.pid;
    id.start_time = *start_time;
    id.token = h.token ? h.token : random_token();
    const std::string relative_dir = storage::rank_relative_dir(id);
    uint64_t adopted = 0;  // the orphan session this rank reconnects to
    for (auto it = sessions.begin(); it != sessions.end(); ++it) {
      Session& other = it->second;
      if (other.relative_dir != relative_dir) continue;
      if (!other.orphan)
        return make_error(EBUSY, "pid " + std::to_string(c.cred.pid) + " already has a session as job " + h.job +
                                     " rank " + std::to_string(h.rank));
      if (h.token != other.token)
        return make_error(EPERM, "this rank's files are kept for a session that lost its connection; reconnect with "
                                 "that session's token");
      // The rank is back: its files are adopted below, from disk, by a fresh store.
      adopted = it->first;
      forget_orphan(it->first);
      break;
    }

    Session s;
    s.id = next_session++;
    s.cred = c.cred;
    s.job = h.job;
    s.rank = h.rank;
    s.relative_dir = relative_dir;
    s.token = id.token;
    s.start_time = *start_time;
    // A pidfd names this very process (no pid reuse); its start time is checked once more after
    // opening it, in case the pid changed hands since SO_PEERCRED was taken.
    s.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, c.cred.pid, 0)));
    if (s.pidfd && !process_alive(c.cred.pid, *start_time))
      return make_error(ESRCH, "pid " + std::to_string(c.cred.pid) + " exited while connecting");
    auto store = h.token ? storage::RankStore::adopt(roots, id, static_cast<uint32_t>(slot))
                         : storage::RankStore::create(roots, id, static_cast<uint32_t>(slot));
    // A token but nothing on disk: its earlier session ended with nothing to keep (the connection
    // was closed on it), so it starts afresh under the same token.
    if (!store && h.token && store.error().errnum() == ENOENT)
      store = storage::RankStore::create(roots, id, static_cast<uint32_t>(slot));
    if (!store) return std::move(store).error();
    s.store = std::move(store.value());

    s.slot_bytes = static_cast<uint32_t>(slot);
    s.slot_count = static_cast<uint32_t>(staging / slot);
    s.staging_bytes = uint64_t{s.slot_count} * slot;
    // Sealed against shrinking: a client that truncated the memfd would make our next access to the
    // mapping a SIGBUS, taking down the daemon for everyone.
    s.memfd.reset(::memfd_create("tmsdisk-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!s.memfd) return errno_error("memfd_create for the staging buffer");
    if (::ftruncate(s.memfd.get(), static_cast<off_t>(s.staging_bytes)) != 0) {
      (void)s.store->remove();
      return errno_error("cannot size the staging buffer to " + std::to_string(s.staging_bytes) + " bytes");
    }
    if (::fcntl(s.memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      (void)s.store->remove();
      return errno_error("cannot seal the staging buffer");
    }
    void* p = ::mmap(nullptr, s.staging_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.memfd.get(), 0);
    if (p == MAP_FAILED) {
      (void)s.store->remove();
      return errno_error("cannot map the staging buffer");
    }
    s.staging = static_cast<uint8_t*>(p);
    std::string why;
    s.buf_index = engine->register_buffer(s.staging, s.staging_bytes, &why);
    if (s.buf_index < 0) spdlog::info("session {}: staging not registered with io_uring ({}); using plain I/O", s.id, why);
    s.slot_busy.assign(s.slot_count, 0);
    s.conn_id = c.id;
    s.stats.last_change_unix_ms = unix_ms();
    if (s.store->paused()) {
      s.stats.state = static_cast<uint8_t>(proto::RankState::Paused);
      for (const auto& b : s.store->blobs()) s.stats.paused_bytes += b.size;
    }
    const uint64_t sid = s.id;
    sessions.emplace(sid, std::move(s));
    had_session = true;
    if (adopted) {
      ipc.rename_session(adopted, sid);
      sessions.at(sid).adopted = true;
    }
    return sid;
  }

  void release_session_resources(Session& s) {
    if (s.buf_index >= 0) engine->unregister_buffer(s.buf_index);
    s.buf_index = -1;
    if (s.staging) ::munmap(s.staging, s.staging_bytes);
    s.staging = nullptr;
  }

  // The shim's connection closed: fail its pending commands, and remove its files once no I/O of it
  // is in flight (the kernel may still be writing into its staging pages).
  void detach_session(uint64_t sid) {
    auto it = sessions.find(sid);
    if (it == sessions.end()) return;
    Session& s = it->second;
    s.conn_id = 0;
    for (auto& [cmd, op_id] : s.commands)
      finish_rank(op_id, sid, ECONNRESET, 0, 0, "the rank exited or lost its connection before answering");
    s.commands.clear();
    maybe_destroy(sid);
  }

  void maybe_destroy(uint64_t sid) {
    auto it = sessions.find(sid);
    if (it == sessions.end() || it->second.conn_id != 0 || it->second.io_in_flight != 0) return;
    Session& s = it->second;
    if (!s.orphan && (s.store->holds_unresumed_data() || ipc.holds(sid)) && rank_alive(s)) {
      // The connection dropped but the process lives, and these files are the only copy of memory it
      // released (invariant 6), or it shares memory through legacy IPC (what it exported, what it
      // maps of others': an exporter pausing it then would leave the importer on stale memory): keep
      // the session until it reconnects with its token or exits.
      s.orphan = true;
      release_session_resources(s);
      s.memfd.reset();
      if (s.pidfd) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = kOrphanKeyBit | sid;
        ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, s.pidfd.get(), &ev);
      }
      spdlog::warn("session {} (pid {}) lost its connection with paused memory on disk; keeping its files until it "
                   "reconnects or exits", sid, s.cred.pid);
      return;
    }
    if (s.pidfd) ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, s.pidfd.get(), nullptr);
    if (auto st = s.store->remove(); !st) spdlog::error("session {}: cannot remove its files: {}", sid, st.error().describe());
    release_session_resources(s);
    spdlog::info("session {} (pid {}) closed; its files are removed", sid, s.cred.pid);
    sessions.erase(it);
    for (const auto& u : ipc.drop([&](uint64_t id) { return id == sid; })) notify_users(u);
    if (config.exit_when_idle && sessions.empty()) {
      spdlog::info("last session ended; exiting (idle exit)");
      stopping = true;
    }
  }

  // Whether the rank's process still runs. Its pidfd turns readable as soon as it exits, even while
  // it is an unreaped zombie whose /proc entry still matches.
  static bool rank_alive(const Session& s) {
    if (s.pidfd) {
      pollfd p{s.pidfd.get(), POLLIN, 0};
      return ::poll(&p, 1, 0) == 0;
    }
    return process_alive(s.cred.pid, s.start_time);
  }

  // Drops an orphan's in-memory state without touching its files (its rank reconnected).
  void forget_orphan(uint64_t sid) {
    auto it = sessions.find(sid);
    if (it == sessions.end()) return;
    if (it->second.pidfd) ::epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, it->second.pidfd.get(), nullptr);
    sessions.erase(it);
  }

  // An orphan's process exited (pidfd readable), or the sweep found it gone: its files go now.
  void reap_orphan(uint64_t sid) {
    auto it = sessions.find(sid);
    if (it == sessions.end() || !it->second.orphan || rank_alive(it->second)) return;
    it->second.orphan = false;
    maybe_destroy(sid);  // not alive, so this removes the files
  }

  // ----------------------------------------------------------------------------------------------
  // Shim requests

  Session* session_of(Connection& c) {
    auto it = sessions.find(c.session_id);
    return it == sessions.end() ? nullptr : &it->second;
  }

  void on_shim(Connection& c, uint64_t rid, proto::Reserve& m) {
    Session& s = *session_of(c);
    if (s.io_in_flight) return send_error(c, rid, EBUSY, "RESERVE while chunks are still in flight");
    if (m.flags & proto::kReserveFirst) s.pending_reserve.clear();
    if (s.pending_reserve.size() + m.blobs.size() > kMaxReserveBlobs)
      return send_error(c, rid, E2BIG, "more than " + std::to_string(kMaxReserveBlobs) + " blobs in one reservation");
    s.pending_reserve.insert(s.pending_reserve.end(), m.blobs.begin(), m.blobs.end());
    if (!(m.flags & proto::kReserveLast)) return send(c, rid, proto::OkReply{});
    auto blobs = std::move(s.pending_reserve);
    s.pending_reserve.clear();
    if (auto st = s.store->reserve(blobs); !st) {
      spdlog::warn("session {}: reservation refused: {}", s.id, st.error().describe());
      return send_error(c, rid, st.error().errnum(), st.error().describe());
    }
    send(c, rid, proto::OkReply{});
  }

  // Shared validation of WRITE and READ; on success the slot is marked busy and the I/O queued.
  // `client_checksum` is what WRITTEN acknowledged to the client (reads only; 0 if unknown).
  void start_chunk_io(Connection& c, uint64_t rid, const proto::ChunkRef& m, io::Op op, uint64_t client_checksum = 0) {
    Session& s = *session_of(c);
    if (m.slot >= s.slot_count)
      return send_error(c, rid, ERANGE, "slot " + std::to_string(m.slot) + " out of range (session has " +
                                            std::to_string(s.slot_count) + ")");
    if (s.slot_busy[m.slot]) return send_error(c, rid, EBUSY, "slot " + std::to_string(m.slot) + " already has I/O in flight");
    if (m.length > s.slot_bytes) return send_error(c, rid, ERANGE, "chunk longer than a slot");
    auto loc = s.store->locate(m.blob, m.offset, m.length);
    if (!loc) return send_error(c, rid, loc.error().errnum(), loc.error().describe());
    PendingIo p;
    p.session_id = s.id;
    p.request_id = rid;
    p.op = op;
    p.slot = m.slot;
    p.blob = m.blob;
    p.offset = m.offset;
    p.length = m.length;
    uint8_t* slot_ptr = s.staging + uint64_t{m.slot} * s.slot_bytes;
    if (op == io::Op::Write) {
      p.checksum = XXH3_64bits(slot_ptr, m.length);
    } else {
      auto expected = s.store->expected_checksum(m.blob, m.offset);
      if (expected) {
        if (client_checksum != 0 && client_checksum != *expected)
          return send_error(c, rid, EBADMSG, "the checksum the rank holds for blob " + std::to_string(m.blob) +
                                                 " at offset " + std::to_string(m.offset) + " differs from the daemon's");
        p.checksum = *expected;
      } else if (client_checksum != 0) {
        p.checksum = client_checksum;  // daemon restarted before this pause was committed
      } else {
        return send_error(c, rid, expected.error().errnum(), expected.error().describe());
      }
    }
    io::Request req;
    req.op = op;
    req.fd = loc->fd;
    req.buf = slot_ptr;
    req.buf_index = s.buf_index;
    req.length = loc->io_length;
    req.offset = loc->file_offset;
    req.tag = next_tag++;
    try {
      engine->queue(req);
    } catch (const std::bad_alloc&) {
      return send_error(c, rid, ENOMEM, "daemon out of memory queueing I/O");
    }
    ios.emplace(req.tag, p);
    s.slot_busy[m.slot] = 1;
    ++s.io_in_flight;
  }

  void on_shim(Connection& c, uint64_t rid, proto::Write& m) { start_chunk_io(c, rid, m, io::Op::Write); }
  void on_shim(Connection& c, uint64_t rid, proto::Read& m) { start_chunk_io(c, rid, m, io::Op::Read, m.checksum); }

  void on_shim(Connection& c, uint64_t rid, proto::Commit& m) {
    Session& s = *session_of(c);
    if (s.io_in_flight) return send_error(c, rid, EBUSY, "COMMIT while chunks are still in flight");
    if (auto st = s.store->commit(static_cast<proto::CommitState>(m.state), m.generation); !st)
      return send_error(c, rid, st.error().errnum(), st.error().describe());
    send(c, rid, proto::OkReply{});
  }

  void on_shim(Connection& c, uint64_t, proto::Report& m) {
    Session& s = *session_of(c);
    s.stats = m.stats;
    if (s.stats.last_change_unix_ms == 0) s.stats.last_change_unix_ms = unix_ms();
  }

  void on_shim(Connection& c, uint64_t rid, proto::CommandDone& m) {
    Session& s = *session_of(c);
    auto it = s.commands.find(rid);
    if (it == s.commands.end()) return;  // the tmsctl that asked has gone; nothing to forward
    const uint64_t op_id = it->second;
    s.commands.erase(it);
    finish_rank(op_id, s.id, m.code, m.bytes, m.nanos, m.message);
  }

  void on_shim(Connection& c, uint64_t rid, proto::Progress& m) {
    Session& s = *session_of(c);
    auto it = s.commands.find(rid);
    if (it == s.commands.end()) return;
    auto op = control_ops.find(it->second);
    if (op == control_ops.end()) return;
    Connection* ctl = conn(op->second.conn_id);
    if (!ctl) return;
    m.session_id = s.id;
    send(*ctl, op->second.request_id, m);
  }

  // ----------------------------------------------------------------------------------------------
  // Legacy IPC (ipc_exports.h)

  // Takes `fd` only when the export is recorded.
  void on_ipc_export(Connection& c, uint64_t rid, const proto::IpcExport& m, UniqueFd& fd) {
    Session& s = *session_of(c);
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
    Session& s = *session_of(c);
    auto st = m.freed ? ipc.forget(m.export_id, s.id) : ipc.revoke(m.export_id, s.id);
    if (!st) return send_error(c, rid, st.error().errnum(), st.error().describe());
    send(c, rid, proto::OkReply{});
  }

  void on_ipc(Connection& c, uint64_t rid, const proto::IpcOpen& m) {
    Session& s = *session_of(c);
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
    Session& s = *session_of(c);
    auto u = ipc.close(m.export_id, s.id);
    if (!u) return send_error(c, rid, u.error().errnum(), u.error().describe());
    send(c, rid, proto::OkReply{});
    notify_users(*u);
  }

  // Unsolicited (request id 0); lost if the exporter is disconnected, which resends on reconnect.
  void notify_users(const IpcExports::Users& u) {
    auto it = sessions.find(u.owner);
    if (it == sessions.end() || it->second.conn_id == 0) return;
    Connection* c = conn(it->second.conn_id);
    if (!c) return;
    send(*c, 0, proto::IpcUsers{.export_id = u.export_id, .importers = u.importers});
  }

  // ----------------------------------------------------------------------------------------------
  // I/O completions

  void on_io() {
    completions.clear();
    engine->reap(completions);
    for (const auto& done : completions) {
      auto it = ios.find(done.tag);
      if (it == ios.end()) continue;
      PendingIo p = it->second;
      ios.erase(it);
      auto sit = sessions.find(p.session_id);
      if (sit == sessions.end()) continue;
      Session& s = sit->second;
      s.slot_busy[p.slot] = 0;
      --s.io_in_flight;
      Connection* c = s.conn_id ? conn(s.conn_id) : nullptr;
      if (!c) {
        maybe_destroy(s.id);
        continue;
      }
      const char* what = p.op == io::Op::Write ? "write" : "read";
      if (done.result < 0) {
        const int e = -done.result;
        spdlog::error("session {}: {} of blob {} at offset {} failed: {}", s.id, what, p.blob, p.offset, std::strerror(e));
        send_error(*c, p.request_id, e,
                   std::string(what) + " of blob " + std::to_string(p.blob) + " at offset " + std::to_string(p.offset) +
                       " failed: " + std::strerror(e));
        continue;
      }
      if (p.op == io::Op::Write) {
        s.store->record_checksum(p.blob, p.offset, p.checksum);
        proto::Written w;
        w.checksum = p.checksum;
        send(*c, p.request_id, w);
      } else {
        const uint64_t got = XXH3_64bits(s.staging + uint64_t{p.slot} * s.slot_bytes, p.length);
        if (got != p.checksum) {
          spdlog::error("session {}: checksum mismatch in blob {} at offset {} (file corrupted)", s.id, p.blob, p.offset);
          send_error(*c, p.request_id, EBADMSG,
                     "checksum mismatch in blob " + std::to_string(p.blob) + " at offset " + std::to_string(p.offset) +
                         ": the backup file is corrupted; the allocation stays paused and the file is kept");
          continue;
        }
        proto::ReadDone r;
        r.checksum = got;
        send(*c, p.request_id, r);
      }
    }
  }

  // ----------------------------------------------------------------------------------------------
  // tmsctl requests

  bool may_act_on(const Connection& c, const Session& s) const { return c.cred.uid == 0 || c.cred.uid == s.cred.uid; }

  void on_control(Connection& c, uint64_t rid, proto::ListSessions& m) {
    proto::Sessions out;
    std::vector<const Session*> visible;
    for (auto& [id, s] : sessions)
      if (may_act_on(c, s) && s.conn_id != 0) visible.push_back(&s);
    out.total = static_cast<uint32_t>(visible.size());
    for (std::size_t i = m.start; i < visible.size() && out.sessions.size() < kSessionsPerPage; ++i) {
      const Session& s = *visible[i];
      proto::SessionInfo info;
      info.session_id = s.id;
      info.pid = s.cred.pid;
      info.uid = s.cred.uid;
      info.rank = s.rank;
      info.job = s.job;
      info.disk_bytes = s.store->disk_bytes();
      info.stats = s.stats;
      out.sessions.push_back(std::move(info));
    }
    send(c, rid, out);
  }

  void on_control(Connection& c, uint64_t rid, proto::Gc&) {
    auto st = sweep();
    proto::GcResult r;
    r.removed_dirs = st.removed_dirs;
    r.removed_bytes = st.removed_bytes;
    send(c, rid, r);
  }

  void on_control(Connection& c, uint64_t rid, proto::Control& m) {
    for (auto& [id, other] : control_ops)
      if (other.conn_id == c.id)
        return send_error(c, rid, EBUSY, "this connection already waits for a pause or resume; one at a time");
    ControlOp op;
    op.id = next_control++;
    op.conn_id = c.id;
    op.request_id = rid;
    op.op = static_cast<proto::CommandOp>(m.op);
    if (m.timeout_ms) op.deadline = Clock::now() + std::chrono::milliseconds(m.timeout_ms);
    std::size_t denied = 0;
    for (auto& [sid, s] : sessions) {
      if (s.conn_id == 0) continue;
      const bool match = (m.match & proto::kMatchAll) ||
                         (!((m.match & proto::kMatchJob) && s.job != m.job) &&
                          !((m.match & proto::kMatchRank) && s.rank != m.rank) &&
                          !((m.match & proto::kMatchPid) && s.cred.pid != m.pid));
      if (!match) continue;
      if (!may_act_on(c, s)) {
        ++denied;
        continue;
      }
      op.waiting.insert(sid);
      proto::RankResult r;
      r.session_id = sid;
      r.pid = s.cred.pid;
      r.rank = s.rank;
      r.job = s.job;
      op.results.emplace(sid, r);
    }
    if (op.waiting.empty()) {
      if (denied)
        return send_error(c, rid, EPERM,
                          std::to_string(denied) + " matching rank(s) belong to other users; only root or their owner may "
                                                   "pause or resume them");
      return send_error(c, rid, ENOENT, "no running rank matches; see `tmsctl status`");
    }
    const uint64_t op_id = op.id;
    auto waiting = op.waiting;
    control_ops.emplace(op_id, std::move(op));
    for (uint64_t sid : waiting) {
      Session& s = sessions.at(sid);
      proto::Command cmd;
      cmd.op = m.op;
      const uint64_t cmd_id = next_request++;
      s.commands.emplace(cmd_id, op_id);
      if (Connection* sc = conn(s.conn_id)) send(*sc, cmd_id, cmd);
    }
  }

  void finish_rank(uint64_t op_id, uint64_t sid, int code, uint64_t bytes, uint64_t nanos, const std::string& message) {
    auto it = control_ops.find(op_id);
    if (it == control_ops.end()) return;
    ControlOp& op = it->second;
    if (!op.waiting.erase(sid)) return;
    auto& r = op.results[sid];
    r.code = code;
    r.bytes = bytes;
    r.nanos = nanos;
    r.message = message.substr(0, proto::kMaxResultText);
    if (op.waiting.empty()) complete_control(it);
  }

  void complete_control(std::map<uint64_t, ControlOp>::iterator it) {
    ControlOp& op = it->second;
    if (Connection* c = conn(op.conn_id)) {
      std::vector<proto::RankResult> all;
      for (auto& [sid, r] : op.results) all.push_back(r);
      std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
        return a.job != b.job ? a.job < b.job : a.rank != b.rank ? a.rank < b.rank : a.pid < b.pid;
      });
      for (std::size_t i = 0; i < all.size() || i == 0; i += kResultsPerMessage) {
        proto::ControlResult out;
        const std::size_t end = std::min(all.size(), i + kResultsPerMessage);
        out.results.assign(all.begin() + static_cast<long>(i), all.begin() + static_cast<long>(end));
        out.last = end >= all.size() ? 1 : 0;
        send(*c, op.request_id, out);
        if (out.last) break;
      }
    }
    control_ops.erase(it);
  }

  // Fails ranks that did not answer before their tmsctl's deadline; returns ms until the next one.
  int expire_control_ops() {
    const auto now = Clock::now();
    auto next = Clock::time_point::max();
    for (auto it = control_ops.begin(); it != control_ops.end();) {
      auto cur = it++;
      ControlOp& op = cur->second;
      if (op.deadline <= now) {
        for (uint64_t sid : std::vector<uint64_t>(op.waiting.begin(), op.waiting.end())) {
          auto s = sessions.find(sid);
          if (s != sessions.end())
            std::erase_if(s->second.commands, [&](const auto& kv) { return kv.second == cur->first; });
          auto& r = op.results[sid];
          r.code = ETIMEDOUT;
          r.message = "no answer before the timeout; the rank may still finish";
        }
        op.waiting.clear();
        complete_control(cur);
      } else {
        next = std::min(next, op.deadline);
      }
    }
    if (next == Clock::time_point::max()) return -1;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    return static_cast<int>(std::min<int64_t>(ms, INT32_MAX));  // deadlines may be weeks away
  }

  // A private daemon that nobody ever connected to (its starter died first) must not linger.
  // Returns ms until it gives up, or -1.
  int idle_exit_timeout() {
    if (!config.exit_when_idle || had_session || !sessions.empty() || !conns.empty()) return -1;
    const auto left = started + kIdleExitAfter - Clock::now();
    if (left <= Clock::duration::zero()) {
      spdlog::info("no session came in {} s; exiting (idle exit)", kIdleExitAfter.count());
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
      int timeout = expire_control_ops();
      const int hello = expire_silent_connections();
      if (hello >= 0 && (timeout < 0 || hello < timeout)) timeout = hello;
      const int idle = idle_exit_timeout();
      if (stopping) break;
      if (idle >= 0 && (timeout < 0 || idle < timeout)) timeout = idle;
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
          case kKeySweep: {
            uint64_t ticks;
            (void)!::read(sweep_fd.get(), &ticks, sizeof(ticks));
            sweep();
            break;
          }
          default: {
            if (key & kOrphanKeyBit) {
              reap_orphan(key & ~kOrphanKeyBit);
              break;
            }
            Connection* c = conn(key);
            if (!c) break;
            if (events[i].events & EPOLLOUT) flush(*c);
            if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(*c);
            if (c->closing && (c->outbox.empty() || (events[i].events & (EPOLLHUP | EPOLLERR)))) close_connection(key);
          }
        }
      }
      // Replies produced while handling one connection may have closed another (send failures).
      std::vector<uint64_t> dead;
      for (auto& [id, c] : conns)
        if (c->closing && c->outbox.empty()) dead.push_back(id);
      for (uint64_t id : dead) close_connection(id);
    }
    return drain();
  }

  // Graceful stop: wait for I/O already submitted (its memory must stay mapped), then close every
  // session. Files of live ranks stay on disk: they survive a daemon restart (invariant 6).
  Status drain() {
    spdlog::info("stopping: waiting for {} I/O request(s) in flight", engine->in_flight());
    while (engine->in_flight() > 0) {
      completions.clear();
      engine->wait(completions);
    }
    conns.clear();
    for (auto& [id, s] : sessions) release_session_resources(s);
    sessions.clear();
    return {};
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::create(Config config) {
  try {
    auto impl = std::make_unique<Impl>(std::move(config));
    if (auto st = impl->setup(); !st) return std::move(st).error();
    return std::unique_ptr<Server>(new Server(std::move(impl)));
  } catch (const std::exception& e) {
    return make_error(ENOMEM, std::string("daemon setup failed: ") + e.what());
  }
}

Status Server::run() {
  try {
    return impl_->run();
  } catch (const std::exception& e) {
    return make_error(EIO, std::string("daemon loop failed: ") + e.what());
  }
}

void Server::stop() noexcept {
  uint64_t one = 1;
  (void)!::write(impl_->stop_fd.get(), &one, sizeof(one));
}

const Config& Server::config() const noexcept { return impl_->config; }

}  // namespace tmsdisk::server
