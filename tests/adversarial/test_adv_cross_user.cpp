// SPDX-License-Identifier: Apache-2.0
// Adversarial suite, family 2: one user against another's ranks, and paths built to leave the root.
//
// As root, a second uid (65534, other_user.h) tries to pause, resume and select root's ranks by every
// selector, to collect them with gc, to take one over with its token, to revoke, refresh or close
// root's legacy IPC export, and to point TMS_DISK_BACKUP_DIR or a job name at root's directory or
// outside the root. Symlinks planted in a root (a job directory, a rank directory swapped mid-pause
// and before the session ends) must never be followed: a sentinel directory outside the root, made to
// look like a rank's, is snapshotted before and compared after (contents, sizes, modes, times).
//
// Already elsewhere, not repeated here: another uid cannot list or pause by job, nor open an export
// by its id (tests/integration/test_daemon_hostile.cpp, test_daemon_ipc.cpp); per-user session and
// staging limits (test_daemon_limits.cpp); symlinks as <root>/<uid> at the daemon and at every level
// in storage (test_daemon_hostile.cpp, tests/unit/test_storage_rank_dirs.cpp); directories planted
// by another owner (test_storage_root.cpp).
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <optional>

#include "adversarial.h"
#include "other_user.h"
#include "tmsdisk/protocol/client.h"
#include "tmsdisk/protocol/socket.h"

using namespace tmsdisk;
using namespace tmsdisk::adversarial;

namespace {

constexpr uid_t kOtherUid = 65534;  // other_user.h

void need_root() {
  if (::geteuid() != 0) skip("needs root to act as a second user (other_user.h)");
}

// Whether the daemon sent anything on `sock` that is waiting to be read (a COMMAND, say).
bool pending(int sock) {
  pollfd p{sock, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1;
}

// A rank of root's with a committed pause of `blobs`, ready to be read back.
void pause_committed(ShimClient& c, const std::vector<proto::BlobSize>& blobs) {
  REQUIRE(c.reserve(blobs));
  REQUIRE(c.write_all(blobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
}

// A memfd holding `text`, standing in for the POSIX handle of GPU memory.
UniqueFd memory_fd(const std::string& text) {
  UniqueFd fd(::memfd_create("adv-ipc-memory", MFD_CLOEXEC));
  REQUIRE(fd);
  REQUIRE(::pwrite(fd.get(), text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()));
  return fd;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Another user's requests

TEST_CASE("another user cannot pause or resume root's ranks by job, rank, pid or all, and they receive no COMMAND") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  auto running = d.shim({.job = "owned", .rank = 0});
  auto paused = d.shim({.job = "owned", .rank = 1});
  const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
  pause_committed(paused, blobs);
  const pid_t root_pid = ::getpid();
  CHECK(as_other_user([&] {
          auto ctl = ctl::Client::connect(d.socket);
          if (!ctl) return ctl.error().errnum() == EACCES ? kUnreachable : 11;
          auto list = ctl->list_sessions();
          if (!list || !list->empty()) return 12;  // root's two ranks are not even listed
          const std::vector<proto::Control> selectors = {
              {.op = 1, .match = proto::kMatchJob, .job = "owned"},
              {.op = 1, .match = proto::kMatchJob | proto::kMatchRank, .job = "owned", .rank = 1},
              {.op = 1, .match = proto::kMatchPid, .pid = root_pid},
              {.op = 1, .match = proto::kMatchAll},
              {.op = 2, .match = proto::kMatchJob, .job = "owned"},
              {.op = 2, .match = proto::kMatchPid, .pid = root_pid, .flags = proto::kAcceptLoss},
              {.op = 2, .match = proto::kMatchAll, .flags = proto::kAcceptLoss},
          };
          int step = 20;
          for (const auto& req : selectors) {
            auto r = ctl->control(req);
            if (r || r.error().errnum() != EPERM) return step;
            ++step;
          }
          return 0;
        }) == 0);
  // Refused before any rank was asked: nothing came to either.
  CHECK_FALSE(pending(running.fd()));
  CHECK_FALSE(pending(paused.fd()));
  auto back = paused.read_all(blobs, check_pattern);
  INFO((back ? "" : back.error().describe()));
  CHECK(back);
}

TEST_CASE("another user's gc removes none of root's live ranks: running, mid-pause or paused") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
  auto running = d.shim({.job = "gc", .rank = 0});
  auto midway = d.shim({.job = "gc", .rank = 1});
  REQUIRE(midway.reserve(blobs));
  REQUIRE(midway.write_all(blobs, fill_pattern));  // written, not committed
  auto paused = d.shim({.job = "gc", .rank = 2});
  pause_committed(paused, blobs);
  const Tree before = snapshot(d.roots[0]);
  CHECK(as_other_user([&] {
          auto ctl = ctl::Client::connect(d.socket);
          if (!ctl) return ctl.error().errnum() == EACCES ? kUnreachable : 11;
          auto r = ctl->gc();
          if (!r) return 12;
          return r->removed_dirs == 0 && r->removed_bytes == 0 ? 0 : 13;
        }) == 0);
  const std::string changes = diff(before, snapshot(d.roots[0]));
  INFO(changes);
  CHECK(changes.empty());
  CHECK(midway.read_all(blobs, check_pattern));
  CHECK(paused.read_all(blobs, check_pattern));
}

TEST_CASE("a token stolen from root's orphaned rank gives another user a session of its own, never root's files") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  const std::vector<proto::BlobSize> blobs = {{1, 3 * MiB}};
  uint64_t token = 0;
  {
    auto c = d.shim({.job = "stolen", .rank = 0});
    token = c.welcome().token;
    pause_committed(c, blobs);
  }  // connection lost while paused: kept for a reconnect with the token
  const std::string root_dir = d.rank_dir(0, "stolen", 0, ::getpid());
  REQUIRE(eventually([&] {
    auto list = d.control().list_sessions();
    return fs::exists(root_dir + "/manifest") && list && list->size() == 1 && (*list)[0].orphaned;
  }));
  const Tree before = snapshot(root_dir);
  const std::string own_prefix = d.roots[0] + "/" + std::to_string(kOtherUid) + "/";
  CHECK(as_other_user([&] {
          auto c = ShimClient::connect(
              d.socket,
              {.job = "stolen", .rank = 0, .staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB, .token = token});
          if (!c) return c.error().errnum() == EACCES ? kUnreachable : 11;
          if (c->welcome().restored != 0 || c->welcome().adopted != 0) return 12;
          if (c->welcome().rank_dir.rfind(own_prefix, 0) != 0) return 13;
          proto::Read rd;
          rd.slot = 0;
          rd.length = 1 * MiB;
          rd.blob = 1;
          auto r = c->call(rd);  // root's blob 1 is not this session's
          return !r && r.error().errnum() == ENOENT ? 0 : 14;
        }) == 0);
  const std::string changes = diff(before, snapshot(root_dir));
  INFO(changes);
  CHECK(changes.empty());
  // Root's rank still comes back with its token, every byte verified.
  auto again = d.shim({.job = "stolen", .rank = 0, .token = token});
  CHECK(again.welcome().restored == 1);
  auto back = again.read_all(blobs, check_pattern);
  INFO((back ? "" : back.error().describe()));
  CHECK(back);
}

TEST_CASE("another user cannot revoke, forget, refresh, close or open root's legacy IPC export, even knowing its id") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  auto exporter = d.shim({.job = "ipc", .rank = 0});
  UniqueFd mem = memory_fd("root's device bytes");
  auto exported = exporter.call(proto::IpcExport{.export_id = 0, .bytes = 4096, .device = 0}, mem.get());
  REQUIRE(exported);
  const uint64_t id = std::get<proto::IpcExported>(*exported).export_id;
  CHECK(as_other_user([&] {
          auto c = ShimClient::connect(
              d.socket, {.job = "ipc", .rank = 1, .staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB});
          if (!c) return c.error().errnum() == EACCES ? kUnreachable : 11;
          auto code = [&](const proto::Message& m, int fd = -1) {
            auto r = c->call(m, fd);
            return r ? 0 : r.error().errnum();
          };
          if (code(proto::IpcRevoke{.export_id = id, .freed = 0}) != ENOENT) return 12;
          if (code(proto::IpcRevoke{.export_id = id, .freed = 1}) != ENOENT) return 13;
          UniqueFd mine(::memfd_create("not-root's", MFD_CLOEXEC));
          if (!mine || ::ftruncate(mine.get(), 4096) != 0) return 14;
          if (code(proto::IpcExport{.export_id = id, .bytes = 4096, .device = 0}, mine.get()) != ENOENT) return 15;
          if (code(proto::IpcClose{.export_id = id}) != ENOENT) return 16;
          if (code(proto::IpcOpen{.export_id = id}) != ENOENT) return 17;
          return 0;
        }) == 0);
  // The export is root's as before: one of root's processes opens the very memory root handed over.
  auto importer = d.shim({.job = "ipc", .rank = 2});
  UniqueFd got;
  auto opened = importer.call(proto::IpcOpen{.export_id = id}, -1, &got);
  REQUIRE(opened);
  REQUIRE(got);
  std::string text(19, '\0');
  REQUIRE(::pread(got.get(), text.data(), text.size(), 0) == 19);
  CHECK(text == "root's device bytes");
  // And it is still live: a revoke is refused while root's importer has it open.
  auto revoke = exporter.call(proto::IpcRevoke{.export_id = id, .freed = 0});
  REQUIRE_FALSE(revoke);
  CHECK(revoke.error().errnum() == EBUSY);
}

// ------------------------------------------------------------------------------------------------
// Paths built to leave the root

TEST_CASE("another user's TMS_DISK_BACKUP_DIR at root's rank directory or outside the root is refused or confined") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  Sentinel outside;
  auto victim = d.shim({.job = "victim", .rank = 0});
  const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
  pause_committed(victim, blobs);
  const std::string victim_dir = d.rank_dir(0, "victim", 0, ::getpid());
  const Tree before = snapshot(d.roots[0] + "/0");
  const std::string own_prefix = d.roots[0] + "/" + std::to_string(kOtherUid) + "/";
  const std::string root = d.roots[0];
  CHECK(as_other_user([&] {
          if (auto probe = ctl::Client::connect(d.socket); !probe)
            return probe.error().errnum() == EACCES ? kUnreachable : 10;
          int64_t rank = 0;  // one rank each: a closed session's teardown never holds up the next
          auto as = [&](const std::string& dir) {
            return ShimClient::connect(d.socket, {.job = "mine",
                                                  .rank = rank++,
                                                  .staging_budget_bytes = 4 * MiB,
                                                  .chunk_bytes = 1 * MiB,
                                                  .backup_dir = dir});
          };
          // Under the root, so allowed as a hint; the rank's directory is still its own.
          for (const std::string& dir : {victim_dir, root + "/0", root}) {
            auto c = as(dir);
            if (!c) return 11;
            if (c->welcome().rank_dir.rfind(own_prefix, 0) != 0) return 12;
            if (!c->reserve({{1, 1 * MiB}})) return 13;
          }
          int step = 20;
          for (const std::string& dir : {outside.path(), std::string("/etc"), std::string("/"), root + "/../..",
                                         root + "/0/../../etc", std::string("relative/dir"), std::string("../") + root,
                                         "/proc/self/root" + root, std::string("/proc/self/cwd"), root + "/\x01"}) {
            auto c = as(dir);
            if (c) return step;  // a directory outside the roots was taken
            ++step;
          }
          return 0;
        }) == 0);
  const std::string changes = diff(before, snapshot(d.roots[0] + "/0"));
  INFO(changes);
  CHECK(changes.empty());
  outside.check_untouched();
  CHECK(victim.read_all(blobs, check_pattern));
}

TEST_CASE("job names built to leave the root are refused for another user, and nothing is made outside its own") {
  need_root();
  Daemon d(kSmallSessions);
  d.start();
  Sentinel outside;
  auto victim = d.shim({.job = "victim", .rank = 0});
  const Tree before = snapshot(d.roots[0]);
  struct Name {
    std::string job;
    int code;  // EBADMSG: the decoder refuses it (NUL, control characters); EINVAL: not a job name
  };
  const std::vector<Name> names = {
      {"..", EINVAL},
      {".", EINVAL},
      {"../0", EINVAL},
      {"../0/victim", EINVAL},
      {"../../../etc", EINVAL},
      {"/", EINVAL},
      {"/etc", EINVAL},
      {"a/b", EINVAL},
      {"victim/../../0", EINVAL},
      {"a\\b", EINVAL},
      {"", EINVAL},
      {".hidden", EINVAL},
      {std::string(65, 'x'), EINVAL},
      {"j\xc3\xb6"
       "b",
       EINVAL},                                          // "jöb"
      {"\xe3\x82\xb8\xe3\x83\xa7\xe3\x83\x96", EINVAL},  // "ジョブ"
      {"\xc0\xae\xc0\xae", EINVAL},                      // ".." in overlong UTF-8
      {"job name", EINVAL},
      {"~root", EINVAL},
      {"$(id)", EINVAL},
      {std::string("a\0b", 3), EBADMSG},
      {std::string("\0", 1), EBADMSG},
      {"job\n", EBADMSG},
      {"\x1b[2J", EBADMSG},
  };
  const std::string own = d.roots[0] + "/" + std::to_string(kOtherUid);
  CHECK(as_other_user([&] {
          int step = 100;
          for (const auto& n : names) {
            auto c = ShimClient::connect(
                d.socket, {.job = n.job, .rank = 0, .staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB});
            if (!c && c.error().errnum() == EACCES) return kUnreachable;
            if (c || c.error().errnum() != n.code) return step;
            ++step;
          }
          // The longest name allowed works, inside its own directory.
          auto longest = ShimClient::connect(
              d.socket,
              {.job = std::string(64, 'x'), .rank = 0, .staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB});
          if (!longest) return 11;
          return longest->welcome().rank_dir.rfind(own + "/" + std::string(64, 'x') + "/", 0) == 0 ? 0 : 12;
        }) == 0);
  // The other user's directory goes with its last session; nothing else under the root changed.
  CHECK(eventually([&] { return !fs::exists(own); }));
  const std::string changes = diff(before, snapshot(d.roots[0]));
  INFO(changes);
  CHECK(changes.empty());
  outside.check_untouched();
  d.check_serving();
}

// ------------------------------------------------------------------------------------------------
// Symlinks planted in a root (any user: the daemon's own directories)

TEST_CASE("a job directory that is a symlink out of the root: the session is refused, gc passes it by") {
  Daemon d(kSmallSessions);
  d.start();
  Sentinel outside;
  const std::string uid_dir = d.roots[0] + "/" + std::to_string(::getuid());
  fs::create_directories(uid_dir);
  ::chmod(uid_dir.c_str(), 0711);
  fs::create_directory_symlink(outside.path(), uid_dir + "/linked");
  auto c = d.try_shim({.job = "linked", .rank = 0});
  REQUIRE_FALSE(c);
  CHECK((c.error().errnum() == ELOOP || c.error().errnum() == ENOTDIR));
  auto gc = d.control().gc();
  REQUIRE(gc);
  CHECK(gc->removed_dirs == 0);
  CHECK(fs::is_symlink(uid_dir + "/linked"));
  outside.check_untouched();
  d.check_serving();
}

namespace {

// A rank in a child process, driven one step at a time over a pipe (so that the test can plant
// something between two steps, kill the daemon, or kill the rank): each command byte is answered
// with one status byte, 0 for success or an errno value.
class ChildRank {
 public:
  ChildRank(const Daemon& d, std::string job, std::vector<proto::BlobSize> blobs)
      : job_(std::move(job)), blobs_(std::move(blobs)) {
    int to[2], from[2];
    REQUIRE(::pipe2(to, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(from, O_CLOEXEC) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::close(to[1]);
      ::close(from[0]);
      serve(d, to[0], from[1]);
      ::_exit(0);
    }
    ::close(to[0]);
    ::close(from[1]);
    to_.reset(to[1]);
    from_.reset(from[0]);
  }
  ~ChildRank() { kill(); }
  pid_t pid() const { return pid_; }

  // 'c' connect, 'r' reserve, 'h' write the first half of the chunks, 'w' write the rest, 'p' commit
  // paused, 'v' read back and verify, 'd' drop the connection, 'a' reconnect with the token.
  int step(char what) {
    REQUIRE(::write(to_.get(), &what, 1) == 1);
    unsigned char status = 0xFF;
    pollfd p{from_.get(), POLLIN, 0};
    REQUIRE(::poll(&p, 1, 60000) == 1);
    REQUIRE(::read(from_.get(), &status, 1) == 1);
    return status;
  }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  void serve(const Daemon& d, int in, int out) {
    std::optional<ShimClient> c;
    uint64_t token = 0;
    const uint32_t chunk = 1 * MiB;
    auto chunks = [&](bool first_half) -> Status {
      for (const auto& b : blobs_) {
        const uint64_t n = (b.size + chunk - 1) / chunk;
        for (uint64_t i = first_half ? 0 : n / 2; i < (first_half ? n / 2 : n); ++i) {
          const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(chunk, b.size - i * chunk));
          fill_pattern(b.id, i * chunk, c->slot(0), len);
          auto r = c->call(proto::Write{{.slot = 0, .length = len, .blob = b.id, .offset = i * chunk}});
          if (!r) return std::move(r).error();
        }
      }
      return {};
    };
    char what = 0;
    while (::read(in, &what, 1) == 1) {
      int status = 0;
      auto code = [](const Status& s) { return s ? 0 : s.error().errnum(); };
      switch (what) {
        case 'c':
        case 'a': {
          auto r = d.try_shim({.job = job_, .rank = 0, .chunk_bytes = chunk, .token = what == 'a' ? token : 0});
          status = r ? 0 : r.error().errnum();
          if (r) {
            c.emplace(std::move(r.value()));
            token = c->welcome().token;
          }
          break;
        }
        case 'r': status = c ? code(c->reserve(blobs_)) : ENOTCONN; break;
        case 'h': status = c ? code(chunks(true)) : ENOTCONN; break;
        case 'w': status = c ? code(chunks(false)) : ENOTCONN; break;
        case 'p': status = c ? code(c->commit(proto::CommitState::Paused)) : ENOTCONN; break;
        case 'v': status = c ? code(c->read_all(blobs_, check_pattern)) : ENOTCONN; break;
        case 'd': c.reset(); break;
        default: status = EINVAL;
      }
      const unsigned char byte = static_cast<unsigned char>(std::min(status, 254));
      if (::write(out, &byte, 1) != 1) return;
    }
  }

  std::string job_;
  std::vector<proto::BlobSize> blobs_;
  pid_t pid_ = -1;
  UniqueFd to_, from_;
};

// Moves `dir` aside (to `dir`.moved, in the same directory) and plants a symlink to `target` in its
// place, as someone able to write there could at any moment.
void swap_for_symlink(const std::string& dir, const std::string& target) {
  fs::rename(dir, dir + ".moved");
  fs::create_directory_symlink(target, dir);
}

}  // namespace

TEST_CASE(
    "a rank directory swapped for a symlink mid-pause: nothing outside the root is touched, through a restart and gc") {
  Daemon d(kSmallSessions);
  d.start();
  const std::vector<proto::BlobSize> blobs = {{1, 4 * MiB}};
  ChildRank rank(d, "swapped", blobs);
  Sentinel outside(rank.pid());  // its owner file names the live rank, as the real one does
  REQUIRE(rank.step('c') == 0);
  REQUIRE(rank.step('r') == 0);
  REQUIRE(rank.step('h') == 0);
  const std::string dir = d.rank_dir(0, "swapped", 0, rank.pid());
  REQUIRE(fs::is_directory(dir));
  swap_for_symlink(dir, outside.path());
  // The pause goes on in the files the daemon has open, wherever they now are; never through the link.
  CHECK(rank.step('w') == 0);
  CHECK(rank.step('p') == 0);
  CHECK(rank.step('v') == 0);
  outside.check_untouched();
  // The daemon dies and comes back: its startup sweep, and the rank's reconnect with its token, meet
  // the link. The reconnect is refused rather than adopting whatever the link points at.
  d.proc.kill9();
  d.start();
  CHECK(rank.step('a') != 0);
  auto gc = d.control().gc();
  CHECK(gc);
  outside.check_untouched();
  // The rank dies: the sweep finds a dead rank behind a link and leaves the link alone.
  rank.kill();
  auto gc2 = d.control().gc();
  CHECK(gc2);
  CHECK(fs::is_symlink(dir));
  outside.check_untouched();
  d.check_serving();
}

TEST_CASE("rank and job directories swapped for symlinks before their sessions end: closing removes nothing outside") {
  Daemon d(kSmallSessions);
  d.start();
  Sentinel outside;
  const std::vector<proto::BlobSize> blobs = {{1, 2 * MiB}};
  {
    auto rank_swapped = d.shim({.job = "rankswap", .rank = 0});
    auto job_swapped = d.shim({.job = "jobswap", .rank = 0});
    for (ShimClient* c : {&rank_swapped, &job_swapped}) {
      REQUIRE(c->reserve(blobs));
      REQUIRE(c->write_all(blobs, fill_pattern));
      REQUIRE(c->commit(proto::CommitState::Paused));
      REQUIRE(c->read_all(blobs, check_pattern));
      REQUIRE(c->commit(proto::CommitState::Resumed));  // nothing to keep: its files go when it closes
    }
    swap_for_symlink(d.rank_dir(0, "rankswap", 0, ::getpid()), outside.path());
    swap_for_symlink(d.roots[0] + "/" + std::to_string(::getuid()) + "/jobswap", outside.path());
  }
  CHECK(eventually([&] {
    auto list = d.control().list_sessions();
    return list && list->empty();
  }));
  auto gc = d.control().gc();
  CHECK(gc);
  outside.check_untouched();
  d.check_serving();
}
