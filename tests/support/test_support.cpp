// SPDX-License-Identifier: Apache-2.0
// Test helpers: temp dirs, a tmsdiskd child process with sd_notify readiness, a shim-role client.
#include "test_support.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tmsdisk/protocol/socket.h"

namespace tmsdisk::testing {

namespace fs = std::filesystem;

std::string test_tmp_root() {
  if (const char* e = std::getenv("TMSDISK_TEST_TMP"); e && *e) return e;
#ifdef TMSDISK_TEST_TMP_DEFAULT
  return TMSDISK_TEST_TMP_DEFAULT;
#else
  return "/var/tmp";
#endif
}

TempDir::TempDir(const std::string& parent, const std::string& prefix) {
  fs::create_directories(parent);
  std::string tmpl = parent + "/" + prefix + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp " + tmpl + ": " + std::strerror(errno));
  path_ = buf.data();
  ::chmod(path_.c_str(), 0755);
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

// ------------------------------------------------------------------------------------------------

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) kill9();
  if (!log_path_.empty()) ::unlink(log_path_.c_str());
}

int DaemonProcess::start(const std::string& binary, const std::vector<std::string>& args,
                         std::chrono::milliseconds timeout) {
  // An abstract-namespace datagram socket receives READY=1 exactly as systemd would.
  static int counter = 0;
  const std::string name = "tmsdisk-test-notify-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  UniqueFd notify(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (::bind(notify.get(), reinterpret_cast<sockaddr*>(&addr), addr_len) != 0)
    throw std::runtime_error(std::string("bind notify socket: ") + std::strerror(errno));

  log_path_ = test_tmp_root() + "/" + name + ".log";
  pid_ = ::fork();
  if (pid_ == 0) {
    int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log >= 0) ::dup2(log, 2);
    ::setenv("NOTIFY_SOCKET", ("@" + name).c_str(), 1);
    ::unsetenv("LD_PRELOAD");
    std::vector<char*> argv{const_cast<char*>(binary.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    ::_exit(127);
  }
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      kill9();
      return 124;
    }
    pollfd fds[2] = {{notify.get(), POLLIN, 0}, {pidfd.get(), POLLIN, 0}};
    int n = ::poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (fds[0].revents & POLLIN) {
      char msg[256];
      ssize_t len = ::recv(notify.get(), msg, sizeof(msg) - 1, 0);
      if (len > 0) {
        msg[len] = '\0';
        if (std::strstr(msg, "READY=1")) return 0;
      }
    }
    if (fds[1].revents & POLLIN) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      return WIFEXITED(status) ? (WEXITSTATUS(status) ? WEXITSTATUS(status) : 255) : 128 + WTERMSIG(status);
    }
  }
}

int DaemonProcess::stop() {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void DaemonProcess::kill9() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string DaemonProcess::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ------------------------------------------------------------------------------------------------

ShimClient::ShimClient(ShimClient&& o) noexcept
    : fd_(std::move(o.fd_)), staging_(std::exchange(o.staging_, nullptr)), welcome_(o.welcome_), next_request_(o.next_request_) {}

ShimClient& ShimClient::operator=(ShimClient&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::move(o.fd_);
    staging_ = std::exchange(o.staging_, nullptr);
    welcome_ = o.welcome_;
    next_request_ = o.next_request_;
  }
  return *this;
}

ShimClient::~ShimClient() { close(); }

void ShimClient::close() {
  if (staging_) ::munmap(staging_, welcome_.staging_bytes);
  staging_ = nullptr;
  fd_.reset();
}

Result<ShimClient> ShimClient::connect(const std::string& socket, const Options& o) {
  int fd = proto::connect_seqpacket(socket);
  if (fd < 0) return make_error(-fd, "connect " + socket);
  ShimClient c;
  c.fd_.reset(fd);
  proto::Hello h;
  h.role = static_cast<uint8_t>(proto::Role::Shim);
  h.job = o.job;
  h.rank = o.rank;
  h.staging_bytes = o.staging_bytes;
  h.slot_bytes = o.slot_bytes;
  h.token = o.token;
  h.backup_dir = o.backup_dir;
  auto id = c.send(h);
  if (!id) return std::move(id).error();
  std::vector<uint8_t> buf;
  int memfd = -1;
  long n = proto::recv_message(c.fd_.get(), buf, &memfd);
  UniqueFd staging_fd(memfd);
  if (n <= 0) return make_error(n == 0 ? ECONNRESET : static_cast<int>(-n), "no answer to HELLO");
  auto d = proto::decode(buf);
  if (!d.envelope) return make_error(d.code, d.error);
  if (auto* e = std::get_if<proto::ErrorReply>(&d.envelope->body)) return make_error(e->code, e->message);
  auto* w = std::get_if<proto::Welcome>(&d.envelope->body);
  if (!w) return make_error(EPROTO, "HELLO not answered with WELCOME");
  if (!staging_fd) return make_error(EPROTO, "WELCOME without the staging memfd");
  c.welcome_ = *w;
  void* p = ::mmap(nullptr, w->staging_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, staging_fd.get(), 0);
  if (p == MAP_FAILED) return errno_error("mmap staging");
  c.staging_ = static_cast<uint8_t*>(p);
  return c;
}

Result<uint64_t> ShimClient::send(const proto::Message& m, int fd) {
  const uint64_t id = next_request_++;
  auto bytes = proto::encode(id, m);
  if (bytes.empty()) return make_error(EINVAL, "encode failed");
  if (int rc = proto::send_message(fd_.get(), bytes, fd); rc < 0) return make_error(-rc, "send");
  return id;
}

Result<proto::Envelope> ShimClient::receive(UniqueFd* fd) {
  std::vector<uint8_t> buf;
  int passed = -1;
  long n = proto::recv_message(fd_.get(), buf, &passed);
  UniqueFd owned(passed);
  if (fd) *fd = std::move(owned);
  if (n == 0) return make_error(ECONNRESET, "daemon closed the connection");
  if (n < 0) return make_error(static_cast<int>(-n), "recv");
  auto d = proto::decode(buf);
  if (!d.envelope) return make_error(d.code, d.error);
  return std::move(*d.envelope);
}

Result<proto::Message> ShimClient::call(const proto::Message& m, int fd, UniqueFd* reply_fd) {
  auto id = send(m, fd);
  if (!id) return std::move(id).error();
  for (;;) {
    auto env = receive(reply_fd);
    if (!env) return std::move(env).error();
    if (env->request_id == 0) {
      notices_.push_back(std::move(*env));
      continue;
    }
    if (env->request_id != *id) return make_error(EPROTO, "answer to another request");
    if (auto* e = std::get_if<proto::ErrorReply>(&env->body)) return make_error(e->code, e->message);
    return std::move(env->body);
  }
}

Status ShimClient::reserve(const std::vector<proto::BlobSize>& blobs) {
  proto::Reserve r;
  r.flags = proto::kReserveFirst | proto::kReserveLast;
  r.blobs = blobs;
  auto reply = call(r);
  if (!reply) return std::move(reply).error();
  return {};
}

Status ShimClient::commit(proto::CommitState state, uint64_t generation) {
  proto::Commit c;
  c.state = static_cast<uint8_t>(state);
  c.generation = generation;
  auto reply = call(c);
  if (!reply) return std::move(reply).error();
  return {};
}

namespace {

// Runs chunk requests over every blob with all slots busy. `before(slot, blob, off, len)` prepares a
// slot before a request; `after(...)` consumes it once answered.
template <class Req, class Before, class After>
Status pipeline(ShimClient& c, const std::vector<proto::BlobSize>& blobs, Before before, After after) {
  const uint32_t slot_bytes = c.welcome().slot_bytes;
  std::vector<uint32_t> free_slots;
  for (uint32_t i = c.welcome().slot_count; i-- > 0;) free_slots.push_back(i);
  struct InFlight {
    uint32_t slot;
    uint64_t blob, offset;
    uint32_t len;
  };
  std::map<uint64_t, InFlight> in_flight;
  std::optional<Error> first_error;
  auto reap_one = [&]() -> Status {
    auto env = c.receive();
    if (!env) return std::move(env).error();
    auto it = in_flight.find(env->request_id);
    if (it == in_flight.end()) return make_error(EPROTO, "answer to an unknown request");
    InFlight f = it->second;
    in_flight.erase(it);
    free_slots.push_back(f.slot);
    if (auto* e = std::get_if<proto::ErrorReply>(&env->body)) {
      if (!first_error) first_error = make_error(e->code, e->message);
    } else if (!after(f.slot, f.blob, f.offset, f.len)) {
      if (!first_error) first_error = make_error(EBADMSG, "data mismatch in blob " + std::to_string(f.blob) + " at " + std::to_string(f.offset));
    }
    return {};
  };
  for (const auto& b : blobs) {
    for (uint64_t off = 0; off < b.size && !first_error; off += slot_bytes) {
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(slot_bytes, b.size - off));
      while (free_slots.empty())
        if (auto st = reap_one(); !st) return st;
      const uint32_t slot = free_slots.back();
      free_slots.pop_back();
      before(slot, b.id, off, len);
      Req r;
      r.slot = slot;
      r.length = len;
      r.blob = b.id;
      r.offset = off;
      auto id = c.send(r);
      if (!id) return std::move(id).error();
      in_flight.emplace(*id, InFlight{slot, b.id, off, len});
    }
  }
  while (!in_flight.empty())
    if (auto st = reap_one(); !st) return st;
  if (first_error) return *first_error;
  return {};
}

}  // namespace

Status ShimClient::write_all(const std::vector<proto::BlobSize>& blobs,
                             const std::function<void(uint64_t, uint64_t, uint8_t*, uint32_t)>& fill) {
  return pipeline<proto::Write>(
      *this, blobs, [&](uint32_t slot, uint64_t blob, uint64_t off, uint32_t len) { fill(blob, off, this->slot(slot), len); },
      [](uint32_t, uint64_t, uint64_t, uint32_t) { return true; });
}

Status ShimClient::read_all(const std::vector<proto::BlobSize>& blobs,
                            const std::function<bool(uint64_t, uint64_t, const uint8_t*, uint32_t)>& verify) {
  return pipeline<proto::Read>(
      *this, blobs, [&](uint32_t slot, uint64_t, uint64_t, uint32_t len) { std::memset(this->slot(slot), 0xEE, len); },
      [&](uint32_t slot, uint64_t blob, uint64_t off, uint32_t len) { return verify(blob, off, this->slot(slot), len); });
}

}  // namespace tmsdisk::testing
