// SPDX-License-Identifier: Apache-2.0
// The session with tmsdiskd (daemon_session.h).
#include "daemon_session.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include "config.h"
#include "driver.h"
#include "log.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/private_daemon.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::shim {
namespace {

constexpr int kHandshakeTimeoutS = 10;
constexpr int kPrivateDaemonStartMs = 10000;
constexpr int64_t kMaxConnectBackoffMs = 30000;
constexpr int kWaitSliceMs = 1000;  // await_reply wakes at least this often

std::string errtext(int errnum) {
  return std::strerror(errnum);
}

// tmsdiskd for the private daemon: $TMSDISK_DAEMON, else beside this library (paths.h: install tree,
// then build tree), else on PATH.
std::string find_daemon() {
  if (const char* env = std::getenv("TMSDISK_DAEMON"); env && *env) return env;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&start_private_daemon), &info) && info.dli_fname) {
    std::string dir = info.dli_fname;
    dir = dir.substr(0, dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/'));
    if (std::string p = find_daemon_beside_shim(dir); !p.empty()) return p;
  }
  if (const char* path = std::getenv("PATH")) {
    std::string_view rest = path;
    while (!rest.empty()) {
      auto colon = rest.find(':');
      std::string p = std::string(rest.substr(0, colon)) + "/tmsdiskd";
      if (::access(p.c_str(), X_OK) == 0) return p;
      rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    }
  }
  return {};
}

}  // namespace

int64_t now_ms() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int start_private_daemon() noexcept {
  try {
    const std::string daemon = find_daemon();
    if (daemon.empty()) {
      TMS_WARN("no tmsdiskd found beside libtmsdisk.so or on PATH (set TMSDISK_DAEMON) to start a private daemon");
      return -ENOENT;
    }
    std::string why;  // the daemon's own words when it could not start
    int rc = spawn_private_daemon(daemon, config().private_socket, kPrivateDaemonStartMs, &why);
    if (rc < 0)
      TMS_WARN("could not start a private tmsdiskd (%s): %s", daemon.c_str(),
               why.empty() ? std::strerror(-rc) : why.c_str());
    else
      TMS_INFO("using the private tmsdiskd at %s", config().private_socket.c_str());
    return rc;
  } catch (...) {
    return -ENOMEM;
  }
}

// Connects (starting the private daemon when no system daemon answers) and runs the HELLO
// handshake through protocol/'s client, the one tmsctl and the tests use.
Result<DaemonSession::Welcomed> DaemonSession::hello() {
  const Config& cfg = config();
  int fd = proto::connect_seqpacket(cfg.socket_path);
  if (fd < 0 && !cfg.socket_explicit && start_private_daemon() == 0) fd = proto::connect_seqpacket(cfg.private_socket);
  if (fd < 0) {
    return make_error(
        -fd, cfg.socket_explicit
                 ? fmt::format("cannot reach tmsdiskd at {} (TMSDISK_SOCKET): {}", cfg.socket_path, errtext(-fd))
                 : fmt::format("cannot reach tmsdiskd at {}, nor start a private one at {}: {}", cfg.socket_path,
                               cfg.private_socket, errtext(-fd)));
  }
  Welcomed out;
  out.sock.reset(fd);
  // A daemon that accepts but never answers must not hold the control thread past the handshake.
  timeval tv{kHandshakeTimeoutS, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));

  // TMS_DISK_BACKUP_DIR is handed over as a directory; one this process cannot open goes as a path
  // alone, which the daemon takes only under one of its roots (and otherwise refuses, saying why).
  int dir_error = 0;
  if (!backup_dir_ && !cfg.backup_dir.empty()) {
    backup_dir_.reset(::open(cfg.backup_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!backup_dir_) dir_error = errno;
    backup_dir_path_ = cfg.backup_dir;
  }
  proto::Hello h;
  h.role = static_cast<uint8_t>(proto::Role::Shim);
  h.rank = cfg.rank;
  int devices = 0;
  if (driver().api.cuDeviceGetCount && driver().api.cuDeviceGetCount(&devices) != CUDA_SUCCESS) devices = 0;
  h.device_count = static_cast<uint32_t>(std::max(devices, 0));
  h.job = cfg.job;
  h.backup_dir = proto::wire_text(backup_dir_path_, proto::kMaxPathLength);
  if (backup_dir_) h.flags |= proto::kHelloRankDir;
  h.token = token_;
  h.staging_budget_bytes = cfg.staging_budget_bytes;
  proto::HelloReply reply = proto::say_hello(fd, h, kHandshakeTimeoutS * 1000, next_id(), backup_dir_.get());
  if (!reply) {
    std::string why =
        reply.refused ? "tmsdiskd refused the session: " + reply.message : "no session with tmsdiskd: " + reply.message;
    if (dir_error)
      why += fmt::format(
          " (TMS_DISK_BACKUP_DIR={} cannot be opened: {}; create it, or unset it to keep this rank's "
          "files under tmsdiskd's root)",
          cfg.backup_dir, errtext(dir_error));
    return make_error(reply.error, why);
  }
  out.memfd.reset(std::exchange(reply.fd, -1));
  out.welcome = std::move(reply.welcome);
  return out;
}

void DaemonSession::attach(Welcomed& w) {
  sock_ = w.sock.release();
  ++attached_;
  token_ = w.welcome.token;
  connect_backoff_ms_ = 1000;
  unreachable_logged_ = false;
}

void DaemonSession::close_after_fork() noexcept {
  if (sock_ >= 0) ::close(sock_);
  sock_ = -1;
}

void DaemonSession::attempt_failed(const Error& e, int64_t now) {
  if (!unreachable_logged_) {
    TMS_WARN("%s; allocations keep working, pause and resume fail until it is reachable", e.message.c_str());
    unreachable_logged_ = true;
  } else {
    TMS_DEBUG("%s", e.message.c_str());
  }
  next_connect_ms_ = now + connect_backoff_ms_;
  connect_backoff_ms_ = std::min(connect_backoff_ms_ * 2, kMaxConnectBackoffMs);
}

void DaemonSession::drop(const char* why) {
  if (sock_ < 0) return;
  ::close(sock_);
  sock_ = -1;
  next_connect_ms_ = now_ms() + 1000;
  if (lost_) lost_(why);
}

int DaemonSession::send(uint64_t request_id, const proto::Message& body, int fd) {
  if (sock_ < 0) return -ENOTCONN;
  auto bytes = proto::encode(request_id, body);
  if (bytes.empty()) return -EMSGSIZE;
  const int e = proto::send_message(sock_, bytes, fd);
  if (e == -EPIPE || e == -ECONNRESET) drop(std::strerror(-e));
  return e;
}

int DaemonSession::receive(proto::Envelope& env, int timeout_ms, UniqueFd* fd) {
  if (sock_ < 0) return -ENOTCONN;
  pollfd p{sock_, POLLIN, 0};
  const int n = ::poll(&p, 1, timeout_ms);
  if (n <= 0) return 0;
  int passed = -1;
  const long got = proto::recv_message(sock_, rx_, &passed);
  UniqueFd owned(passed);
  if (fd) *fd = std::move(owned);
  if (got == -EMSGSIZE || got == -ETOOMANYREFS || got == -EINTR || got == -EAGAIN) return 0;
  if (got <= 0) {
    const int e = got == 0 ? ECONNRESET : static_cast<int>(-got);
    drop(got == 0 ? "tmsdiskd closed the connection" : std::strerror(e));
    return -e;
  }
  auto decoded = proto::decode(rx_);
  if (!decoded.envelope) {
    TMS_WARN("ignoring a bad message from tmsdiskd: %s", decoded.error.c_str());
    return 0;
  }
  env = std::move(*decoded.envelope);
  return 1;
}

Status DaemonSession::await_reply(uint64_t request_id, proto::Envelope& reply, UniqueFd* fd) {
  const int64_t deadline = now_ms() + kReplyTimeoutMs;
  for (;;) {
    const int64_t left = deadline - now_ms();
    if (left <= 0)
      return make_error(ETIMEDOUT, fmt::format("tmsdiskd did not answer within {} s", kReplyTimeoutMs / 1000));
    UniqueFd passed;
    const int got = receive(reply, static_cast<int>(std::min<int64_t>(left, kWaitSliceMs)), &passed);
    if (got < 0) return make_error(-got, fmt::format("lost the connection to tmsdiskd: {}", errtext(-got)));
    if (got == 0) continue;
    if (reply.request_id == request_id) {
      if (fd) *fd = std::move(passed);
      return {};
    }
    other(reply);
  }
}

Status DaemonSession::set_backup_dir(const std::string& path) {
  UniqueFd dir(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) return make_error(errno, fmt::format("cannot open the directory {}: {}", path, errtext(errno)));
  if (!connected()) {
    UniqueFd before = std::exchange(backup_dir_, std::move(dir));
    std::string before_path = std::exchange(backup_dir_path_, path);
    Status st = connect();
    if (st) return st;
    // No daemon to ask now: the next HELLO hands the directory over. One that refused it: the rank
    // keeps the directory it had, and the caller hears why.
    const int e = st.error().errnum();
    if (e == ECONNREFUSED || e == ENOENT || e == ETIMEDOUT || e == ECONNRESET) return {};
    backup_dir_ = std::move(before);
    backup_dir_path_ = std::move(before_path);
    return st;
  }
  proto::SetRankDir m;
  m.path = proto::wire_text(path, proto::kMaxPathLength);
  proto::Envelope reply;
  if (Status st = exchange(m, dir.get(), reply, nullptr); !st) return st;
  backup_dir_ = std::move(dir);
  backup_dir_path_ = path;
  return {};
}

Status DaemonSession::exchange(const proto::Message& m, int fd, proto::Envelope& reply, UniqueFd* reply_fd) {
  reply.body = proto::OkReply{};  // an empty Envelope would read as an ErrorReply (the first alternative)
  if (!connected()) {
    if (Status st = connect(); !st) return st;
  }
  const uint64_t id = next_id();
  if (int e = send(id, m, fd); e < 0) return make_error(-e, std::string("cannot send to tmsdiskd: ") + errtext(-e));
  if (Status st = await_reply(id, reply, reply_fd); !st) return st;
  if (const auto* err = std::get_if<proto::ErrorReply>(&reply.body))
    return make_error(err->code, "tmsdiskd: " + err->message);
  return {};
}

}  // namespace tmsdisk::shim
