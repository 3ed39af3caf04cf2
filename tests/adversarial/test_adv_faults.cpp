// SPDX-License-Identifier: Apache-2.0
// Adversarial suite, family 3: faults. Each case asserts the promises that hold whatever breaks:
// nothing wrong is ever returned as good data (a chunk that cannot be verified is refused, a program
// reads its bytes or an error, never other bytes), a failed pause leaves the program's data resident,
// and the daemon never destroys the files of a live rank.
//
// The daemon is killed (SIGKILL), terminated (SIGTERM) or stopped (SIGSTOP) mid-pause and mid-resume,
// under a rank played on the wire (ShimClient, deterministic) and under a real program on simcuda
// with the real shim. A fault "mid-way" on simcuda is placed by freezing the daemon (SIGSTOP) when
// the first progress report of the operation reaches the test, and reading the rank's manifest: a
// pause still says "writing", a resume still "paused"; a case whose operation had already finished
// (a very loaded machine) is skipped, not passed. The victim is killed mid-pause and while paused.
// Its files are damaged: a byte of the checksum journal flipped across a crash, the data file
// truncated (daemon running and stopped), the manifest deleted or corrupted before a restart. The
// disk fills up after the reservation.
//
// Already elsewhere, not repeated here: SIGKILL mid-pause (test_daemon_sessions.cpp and
// test_daemon_restart.cpp on the wire, test_e2e.cpp on simcuda), a victim that exits or is killed
// mid-transfer (test_daemon_sessions.cpp), a flipped data byte (test_daemon_restart.cpp, and
// tests/e2e/test_damaged.cpp with what the program sees), ENOSPC at reservation (test_daemon_io.cpp,
// test_e2e.cpp), injected EIO and short transfers (test_daemon_io.cpp, test_e2e.cpp), a daemon
// stopped before tmsctl connects and a rank that never answers (test_cli_tmsctl.cpp).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>

#include "adversarial.h"
#include "e2e.h"
#include "small_filesystem.h"

using namespace tmsdisk;
using namespace tmsdisk::adversarial;

namespace {

const std::vector<proto::BlobSize> kBlobs = {{1, 4 * MiB}, {2, 3 * MiB + 4096}};  // 1 MiB chunks

// A rank on the wire with 1 MiB chunks and room for four of them in flight.
ShimClient rank_of(const Daemon& d, const std::string& job, uint64_t token = 0) {
  return d.shim({.job = job, .rank = 0, .staging_budget_bytes = 4 * MiB, .chunk_bytes = 1 * MiB, .token = token});
}

// Writes chunk `index` of `blob` through slot 0 and waits for its acknowledgement.
Status write_chunk(ShimClient& c, const proto::BlobSize& blob, uint64_t index) {
  const uint64_t off = index * MiB;
  const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(MiB, blob.size - off));
  fill_pattern(blob.id, off, c.slot(0), len);
  auto r = c.call(proto::Write{{.slot = 0, .length = len, .blob = blob.id, .offset = off}});
  if (!r) return std::move(r).error();
  if (!std::holds_alternative<proto::Written>(*r)) return make_error(EPROTO, "WRITE answered with something else");
  return {};
}

// Reads chunk `index` of `blob` into slot 1: 0 when the daemon served it and it holds the pattern,
// EILSEQ when it served other bytes (the one answer that must never come), else the daemon's refusal.
int read_chunk(ShimClient& c, const proto::BlobSize& blob, uint64_t index) {
  const uint64_t off = index * MiB;
  const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(MiB, blob.size - off));
  std::memset(c.slot(1), 0xEE, len);
  auto r = c.call(proto::Read{{.slot = 1, .length = len, .blob = blob.id, .offset = off}});
  if (!r) return r.error().errnum();
  return check_pattern(blob.id, off, c.slot(1), len) ? 0 : EILSEQ;
}

uint64_t chunks_of(const proto::BlobSize& b) {
  return (b.size + MiB - 1) / MiB;
}

// Reads every chunk of kBlobs back: each must be served with its bytes (`expect_served`) or refused.
// Never served with other bytes.
void check_every_chunk(ShimClient& c, const std::function<bool(uint64_t blob, uint64_t chunk)>& expect_served) {
  for (const auto& b : kBlobs) {
    for (uint64_t i = 0; i < chunks_of(b); ++i) {
      const int got = read_chunk(c, b, i);
      INFO("blob " << b.id << " chunk " << i << ": " << (got ? std::strerror(got) : "served, verified"));
      CHECK(got != EILSEQ);
      CHECK((got == 0) == expect_served(b.id, i));
    }
  }
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits until `pid` is stopped (state T in /proc/<pid>/stat): a SIGSTOP is delivered asynchronously.
bool stopped(pid_t pid) {
  return eventually(
      [&] {
        std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
        std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const auto close = stat.rfind(')');
        return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T';
      },
      std::chrono::seconds(10));
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The daemon dies or stops under a rank on the wire

TEST_CASE(
    "the daemon terminated (SIGTERM) mid-pause exits cleanly, and restarted serves the acknowledged chunks verified") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "term");
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(kBlobs));
  // All of blob 1 (the shim would have released it) and the first chunk of blob 2.
  for (uint64_t i = 0; i < chunks_of(kBlobs[0]); ++i) REQUIRE(write_chunk(c, kBlobs[0], i));
  REQUIRE(write_chunk(c, kBlobs[1], 0));
  CHECK(d.proc.stop() == 0);
  c.close();
  const std::string dir = d.rank_dir(0, "term", 0, ::getpid());
  CHECK(fs::exists(dir + "/data"));
  CHECK(fs::exists(dir + "/sums"));
  d.start();
  auto again = rank_of(d, "term", token);
  CHECK(again.welcome().restored == 0);  // no committed pause...
  check_every_chunk(again, [](uint64_t blob, uint64_t chunk) { return blob == 1 || chunk == 0; });
  // ...and the pause, done again in full, commits and reads back.
  REQUIRE(again.reserve(kBlobs));
  REQUIRE(again.write_all(kBlobs, fill_pattern));
  REQUIRE(again.commit(proto::CommitState::Paused));
  CHECK(again.read_all(kBlobs, check_pattern));
  CHECK(again.commit(proto::CommitState::Resumed));
}

namespace {

// A committed pause, a resume that has read back some chunks, then `fault` to the daemon; restarted,
// the rank reconnects with its token and the pause is restored whole.
void interrupt_resume(int sig) {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "resume");
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  for (uint64_t i = 0; i < 3; ++i) REQUIRE(read_chunk(c, kBlobs[0], i) == 0);
  if (sig == SIGKILL) {
    d.proc.kill9();
  } else {
    CHECK(d.proc.stop() == 0);
  }
  c.close();
  const std::string dir = d.rank_dir(0, "resume", 0, ::getpid());
  CHECK(manifest_state(dir) == kManifestPaused);
  d.start();
  auto again = rank_of(d, "resume", token);
  CHECK(again.welcome().restored == 1);
  check_every_chunk(again, [](uint64_t, uint64_t) { return true; });
  REQUIRE(again.commit(proto::CommitState::Resumed));
  again.close();  // resumed: nothing to keep
  CHECK(eventually([&] { return !fs::exists(dir); }));
}

}  // namespace

TEST_CASE("the daemon killed (SIGKILL) mid-resume: restarted, the committed pause is restored whole, verified") {
  interrupt_resume(SIGKILL);
}

TEST_CASE("the daemon terminated (SIGTERM) mid-resume: restarted, the committed pause is restored whole, verified") {
  interrupt_resume(SIGTERM);
}

TEST_CASE(
    "the daemon stopped (SIGSTOP) mid-pause: tmsctl --timeout gives up naming the rank, and continued the pause "
    "completes") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "stopped");
  const auto started = std::chrono::steady_clock::now();
  e2e::Proc ctl({TMSCTL_PATH, "pause", "--job", "stopped", "--timeout", "5", "--socket", d.socket}, {});
  auto cmd = c.receive();  // the daemon routed the pause: tmsctl has been told whom it asked
  REQUIRE(cmd);
  REQUIRE(std::holds_alternative<proto::Command>(cmd->body));
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(write_chunk(c, kBlobs[0], 0));
  REQUIRE(::kill(d.proc.pid(), SIGSTOP) == 0);
  struct Continue {
    pid_t pid;
    ~Continue() { ::kill(pid, SIGCONT); }
  } continue_daemon{d.proc.pid()};
  REQUIRE(stopped(d.proc.pid()));
  // A write the stopped daemon cannot answer.
  fill_pattern(1, MiB, c.slot(0), MiB);
  auto pending_write = c.send(proto::Write{{.slot = 0, .length = MiB, .blob = 1, .offset = MiB}});
  REQUIRE(pending_write);

  std::string out, line;
  while (!(line = ctl.line(60000)).empty()) out += line + "\n";
  const int rc = ctl.wait();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO(out);
  CHECK(rc == 1);
  CHECK(took < 30);
  CHECK(out.find("stopped rank 0 (pid " + std::to_string(::getpid()) + "): no answer within 5 s") != std::string::npos);

  // Continued: the write is answered, the pause completes and its data reads back, untouched by the stop.
  ::kill(d.proc.pid(), SIGCONT);
  auto written = c.receive();
  REQUIRE(written);
  CHECK(written->request_id == *pending_write);
  CHECK(std::holds_alternative<proto::Written>(written->body));
  for (uint64_t i = 2; i < chunks_of(kBlobs[0]); ++i) REQUIRE(write_chunk(c, kBlobs[0], i));
  for (uint64_t i = 0; i < chunks_of(kBlobs[1]); ++i) REQUIRE(write_chunk(c, kBlobs[1], i));
  REQUIRE(c.commit(proto::CommitState::Paused));
  // The answer goes to nobody: tmsctl has left. The daemon takes it and keeps serving.
  REQUIRE(c.send(proto::CommandDone{.bytes = 1, .outcome = static_cast<uint8_t>(proto::Outcome::Done)}));
  check_every_chunk(c, [](uint64_t, uint64_t) { return true; });
  d.check_serving();
}

// ------------------------------------------------------------------------------------------------
// Damaged files

TEST_CASE("a checksum journal damaged across a crash mid-pause: the chunk it vouched for is refused, never served") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "journal");
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(kBlobs));
  for (uint64_t i = 0; i < 3; ++i) REQUIRE(write_chunk(c, kBlobs[0], i));
  d.proc.kill9();
  c.close();
  // One record per chunk of the set, 40 bytes each (daemon/storage/checksum_journal.h): chunk 1's.
  const std::string dir = d.rank_dir(0, "journal", 0, ::getpid());
  flip_byte(dir + "/sums", 40 + 17);
  d.start();
  auto again = rank_of(d, "journal", token);
  check_every_chunk(again, [](uint64_t blob, uint64_t chunk) { return blob == 1 && (chunk == 0 || chunk == 2); });
}

TEST_CASE("a data file truncated under a paused rank: the chunks past its end are refused, those before served") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "cut");
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  const std::string dir = d.rank_dir(0, "cut", 0, ::getpid());
  const uint64_t size = fs::file_size(dir + "/data");
  fs::resize_file(dir + "/data", size / 2);
  ::sync();
  // Which chunks lie past the cut depends on the layout: count them, and check each one either way.
  uint64_t served = 0, refused = 0;
  for (const auto& b : kBlobs) {
    for (uint64_t i = 0; i < chunks_of(b); ++i) {
      const int got = read_chunk(c, b, i);
      INFO("blob " << b.id << " chunk " << i << ": " << (got ? std::strerror(got) : "served"));
      CHECK(got != EILSEQ);
      (got == 0 ? served : refused) += 1;
    }
  }
  CHECK(served > 0);
  CHECK(refused > 0);
  // The rank lives: its files stay, for a repair or an accept-loss resume.
  CHECK(fs::exists(dir + "/data"));
  CHECK(manifest_state(dir) == kManifestPaused);
}

TEST_CASE("a data file truncated while the daemon is down: no chunk past its end is served, its files kept") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "cutdown");
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  CHECK(d.proc.stop() == 0);
  c.close();
  const std::string dir = d.rank_dir(0, "cutdown", 0, ::getpid());
  fs::resize_file(dir + "/data", 4096);
  const std::string manifest = file_bytes(dir + "/manifest");
  d.start();
  // The rank may reconnect (its record is intact); nothing the file no longer holds reads as data.
  auto again = d.try_shim({.job = "cutdown", .rank = 0, .chunk_bytes = 1 * MiB, .token = token});
  if (again) check_every_chunk(*again, [](uint64_t, uint64_t) { return false; });
  // A live rank's files, even damaged ones, are not the daemon's to destroy: not at the reconnect,
  // not by gc (they are kept for a repair or an accept-loss resume).
  auto gc = d.control().gc();
  REQUIRE(gc);
  CHECK(gc->removed_dirs == 0);
  CHECK(fs::file_size(dir + "/data") == 4096);
  CHECK(file_bytes(dir + "/manifest") == manifest);
  d.check_serving();
}

TEST_CASE("a corrupted manifest: after a restart nothing is served, the rank's data file and manifest kept") {
  Daemon d(kSmallSessions);
  d.start();
  auto c = rank_of(d, "corrupt");
  const uint64_t token = c.welcome().token;
  REQUIRE(c.reserve(kBlobs));
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  REQUIRE(c.commit(proto::CommitState::Paused));
  CHECK(d.proc.stop() == 0);
  c.close();
  const std::string dir = d.rank_dir(0, "corrupt", 0, ::getpid());
  flip_byte(dir + "/manifest", 40);
  const std::string data = file_bytes(dir + "/data");
  const std::string manifest = file_bytes(dir + "/manifest");
  d.start();
  auto again = d.try_shim({.job = "corrupt", .rank = 0, .chunk_bytes = 1 * MiB, .token = token});
  if (again) {
    // Accepted, every read is refused as damaged (EUCLEAN), naming the unreadable record...
    const int got = read_chunk(*again, kBlobs[0], 0);
    CHECK(got == EUCLEAN);
    check_every_chunk(*again, [](uint64_t, uint64_t) { return false; });
    // ...and nothing that would overwrite the files is allowed until the user decides.
    auto reserve = again->reserve(kBlobs);
    REQUIRE_FALSE(reserve);
    CHECK(reserve.error().errnum() == EBUSY);
  }
  auto gc = d.control().gc();
  REQUIRE(gc);
  CHECK(gc->removed_dirs == 0);
  CHECK(file_bytes(dir + "/data") == data);
  CHECK(file_bytes(dir + "/manifest") == manifest);
  d.check_serving();
}

namespace {

// A committed pause whose manifest is deleted while the daemon is down; the rank reconnects with its
// token to the restarted daemon. Returns the rank, and the data file's bytes before the restart.
struct ManifestDeleted {
  Daemon d{kSmallSessions};
  std::string dir;
  std::string data_before;
  std::optional<ShimClient> again;
  ManifestDeleted() {
    d.start();
    auto c = rank_of(d, "nomanifest");
    const uint64_t token = c.welcome().token;
    REQUIRE(c.reserve(kBlobs));
    REQUIRE(c.write_all(kBlobs, fill_pattern));
    REQUIRE(c.commit(proto::CommitState::Paused));
    CHECK(d.proc.stop() == 0);
    c.close();
    dir = d.rank_dir(0, "nomanifest", 0, ::getpid());
    REQUIRE(fs::remove(dir + "/manifest"));
    data_before = file_bytes(dir + "/data");
    REQUIRE(data_before.size() >= 7 * MiB);
    d.start();
    auto r = d.try_shim({.job = "nomanifest", .rank = 0, .chunk_bytes = 1 * MiB, .token = token});
    if (r) again.emplace(std::move(r.value()));
  }
};

}  // namespace

TEST_CASE("a deleted manifest: after a restart nothing of the lost pause is served as data") {
  ManifestDeleted m;
  // Refusing the reconnect serves nothing either; accepted, the rank has no committed pause to read.
  if (m.again) {
    CHECK(m.again->welcome().restored == 0);
    check_every_chunk(*m.again, [](uint64_t, uint64_t) { return false; });
  }
  m.d.check_serving();
}

// Found by the adversarial run this suite keeps: the daemon took the rank for one that never paused
// and truncated its data file to nothing, destroying the only copy of its paused memory (a manifest
// can be rebuilt; the data cannot).
TEST_CASE("a deleted manifest: the daemon leaves the rank's data file as it was") {
  ManifestDeleted m;
  CHECK(file_bytes(m.dir + "/data") == m.data_before);
}

// ------------------------------------------------------------------------------------------------
// A full disk after the reservation

namespace {

// Fills the filesystem of `dir` with a file of its own until the kernel says ENOSPC (root also takes
// the blocks reserved for root); returns its path.
std::string fill_up(const std::string& dir) {
  const std::string path = dir + "/filler";
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  REQUIRE(fd);
  const std::string block(1 << 20, 'F');
  for (std::size_t step : {std::size_t{1} << 20, std::size_t{4096}, std::size_t{1}}) {
    while (::write(fd.get(), block.data(), step) == static_cast<ssize_t>(step)) {
    }
  }
  REQUIRE(errno == ENOSPC);
  ::fsync(fd.get());
  return path;
}

}  // namespace

TEST_CASE(
    "the disk fills up after the reservation: chunks and the commit are refused cleanly, never half-acknowledged") {
  std::string why_not;
  auto small = SmallFilesystem::mount(48, &why_not);
  if (!small) skip(why_not);
  Daemon d(kSmallSessions);
  d.roots = {small->path() + "/root"};
  fs::create_directories(d.roots[0]);
  d.start();
  auto c = rank_of(d, "full");
  REQUIRE(c.reserve(kBlobs));

  // Full before the first chunk: its seal cannot be journaled, so it is refused, not acknowledged.
  std::string filler = fill_up(small->path());
  auto first = write_chunk(c, kBlobs[0], 0);
  INFO((first ? "written" : first.error().describe()));
  CHECK_FALSE(first);
  CHECK(read_chunk(c, kBlobs[0], 0) == ENODATA);  // never written, so never served
  CHECK_FALSE(c.commit(proto::CommitState::Paused));
  fs::remove(filler);
  ::sync();  // ext4 reuses freed blocks once the transaction that freed them commits

  // Room again: the pause is written whole. Full again before the commit: the manifest cannot be
  // written, the commit is refused, and what was written is still served, verified.
  REQUIRE(c.write_all(kBlobs, fill_pattern));
  filler = fill_up(small->path());
  auto commit = c.commit(proto::CommitState::Paused);
  INFO((commit ? "committed" : commit.error().describe()));
  CHECK_FALSE(commit);
  check_every_chunk(c, [](uint64_t, uint64_t) { return true; });
  fs::remove(filler);
  ::sync();
  REQUIRE(c.commit(proto::CommitState::Paused));
  CHECK(c.read_all(kBlobs, check_pattern));
  CHECK(c.commit(proto::CommitState::Resumed));
}

// ------------------------------------------------------------------------------------------------
// Faults under a real program on simcuda

namespace {

// A program on simcuda with four patterned allocations of 16 MiB under the real shim, and its node.
struct Program {
  e2e::Node node;
  std::unique_ptr<e2e::Proc> prog;
  std::string job;

  explicit Program(const std::string& job_name, const e2e::Env& extra = {}) : job(job_name) {
    node.device_mb = 512;
    node.start_daemon();
    e2e::Env env = node.shim_env(job, 0);
    for (auto& [k, v] : extra) env[k] = v;
    prog = std::make_unique<e2e::Proc>(std::vector<std::string>{CUDA_PATTERN_PATH}, env);
    REQUIRE(prog->line() == "ready");
    for (int id = 1; id <= 4; ++id)
      REQUIRE_FALSE(e2e::ok_addr(prog->cmd("alloc " + std::to_string(id) + " 16777216 direct")).empty());
    REQUIRE(prog->cmd("check") == "ok 4");
  }
  std::string dir() const { return node.rank_dir(job, 0, prog->pid()); }
  pid_t daemon() const { return node.daemon.pid(); }

  // `op` (pause or resume) of the job through the control protocol; at its first progress report the
  // daemon is frozen (SIGSTOP), the manifest's state read, and `fault` called. Returns that state (0
  // if no progress came). What the control call returned goes to *answer.
  uint32_t interrupt(proto::CommandOp op, const std::function<void()>& fault, Result<ctl::ControlAnswer>* answer,
                     std::chrono::milliseconds silence = std::chrono::seconds(60)) {
    auto ctl = ctl::Client::connect(node.socket);
    REQUIRE(ctl);
    proto::Control req;
    req.op = static_cast<uint8_t>(op);
    req.match = proto::kMatchJob;
    req.job = job;
    uint32_t state = 0;
    bool done = false;
    *answer = ctl->control(req, ctl::Deadline::silence(silence), [&](const proto::Progress& p) {
      if (done || p.total_bytes == 0 || p.done_bytes >= p.total_bytes) return;
      done = true;
      ::kill(daemon(), SIGSTOP);
      if (!stopped(daemon())) return;
      state = manifest_state(dir());
      fault();
    });
    return state;
  }

  // Ends a case that could not place its fault mid-way: the processes go first (skip() exits at once).
  [[noreturn]] void skip_because(const std::string& why) {
    ::kill(daemon(), SIGCONT);
    node.daemon.kill9();
    prog.reset();
    skip(why);
  }

  // The shim reconnected to the (restarted) daemon: its session is listed again.
  bool reconnected(std::size_t sessions = 1) const {
    return eventually(
        [&] {
          auto c = ctl::Client::connect(node.socket);
          if (!c) return false;
          auto s = c->list_sessions();
          return s && s->size() == sessions;
        },
        std::chrono::seconds(60));
  }

  // The program's bytes are all there, and it goes on: a pause and a resume, then its bytes again.
  void check_intact_and_working() {
    CHECK(prog->cmd("check") == "ok 4");
    auto p = node.pause(job);
    INFO(p.text);
    CHECK(p.ok());
    auto r = node.resume(job);
    INFO(r.text);
    CHECK(r.ok());
    CHECK(prog->cmd("check") == "ok 4");
    prog->cmd("exit");
    CHECK(prog->wait() == 0);
  }
};

}  // namespace

TEST_CASE(
    "on simcuda, the daemon terminated (SIGTERM) mid-pause: the program keeps its data and resumes through a new "
    "daemon") {
  Program p("term");
  Result<ctl::ControlAnswer> answer = make_error(EINVAL, "not run");
  const uint32_t state = p.interrupt(
      proto::CommandOp::Pause,
      [&] {
        ::kill(p.daemon(), SIGTERM);
        ::kill(p.daemon(), SIGCONT);
      },
      &answer);
  if (state != kManifestWriting) p.skip_because("the pause had finished before the daemon was stopped");
  CHECK(p.node.daemon.wait_exit(std::chrono::seconds(30)) == 0);  // a clean stop, I/O drained
  CHECK(fs::exists(p.dir() + "/data"));                           // a live rank's files stay
  p.node.start_daemon();
  REQUIRE(p.reconnected());
  auto r = p.node.resume(p.job);  // whatever the pause had released comes back
  INFO(r.text);
  CHECK(r.ok());
  p.check_intact_and_working();
}

namespace {

void kill_daemon_mid_resume(int sig) {
  Program p(sig == SIGKILL ? "killres" : "termres");
  auto paused = p.node.pause(p.job);
  INFO(paused.text);
  REQUIRE(paused.ok());
  Result<ctl::ControlAnswer> answer = make_error(EINVAL, "not run");
  const uint32_t state = p.interrupt(
      proto::CommandOp::Resume,
      [&] {
        ::kill(p.daemon(), sig);
        if (sig != SIGKILL) ::kill(p.daemon(), SIGCONT);
      },
      &answer);
  if (state != kManifestPaused) p.skip_because("the resume had finished before the daemon was stopped");
  if (sig == SIGKILL)
    p.node.daemon.kill9();  // reaps it
  else
    CHECK(p.node.daemon.wait_exit(std::chrono::seconds(30)) == 0);
  CHECK(manifest_state(p.dir()) == kManifestPaused);
  p.node.start_daemon();
  REQUIRE(p.reconnected());
  auto r = p.node.resume(p.job);
  INFO(r.text);
  CHECK(r.ok());
  p.check_intact_and_working();
}

}  // namespace

TEST_CASE("on simcuda, the daemon killed (SIGKILL) mid-resume: a resume through a new daemon restores every byte") {
  kill_daemon_mid_resume(SIGKILL);
}

TEST_CASE("on simcuda, the daemon terminated (SIGTERM) mid-resume: a resume through a new daemon restores every byte") {
  kill_daemon_mid_resume(SIGTERM);
}

TEST_CASE(
    "on simcuda, the daemon stopped (SIGSTOP) mid-pause: the client's deadline passes, continued the pause completes") {
  Program p("stop");
  Result<ctl::ControlAnswer> answer = make_error(EINVAL, "not run");
  struct Continue {
    pid_t pid;
    ~Continue() { ::kill(pid, SIGCONT); }
  } continue_daemon{p.daemon()};
  const auto started = std::chrono::steady_clock::now();
  const uint32_t state = p.interrupt(
      proto::CommandOp::Pause, [] {}, &answer, std::chrono::seconds(2));
  if (state != kManifestWriting) p.skip_because("the pause had finished before the daemon was stopped");
  INFO((answer ? "" : answer.error().describe()));
  REQUIRE(answer);
  CHECK(answer->results.empty());
  REQUIRE(answer->unanswered.size() == 1);  // named as the rank that did not answer
  CHECK(answer->unanswered[0].pid == p.prog->pid());
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
  ::kill(p.daemon(), SIGCONT);
  // The pause was never abandoned: it completes, and the program's memory comes back whole.
  CHECK(eventually(
      [&] {
        auto ranks = p.node.status();
        return ranks.size() == 1 && ranks[0].totals.state == "paused";
      },
      std::chrono::seconds(60)));
  auto r = p.node.resume(p.job);
  INFO(r.text);
  CHECK(r.ok());
  p.check_intact_and_working();
}

TEST_CASE("on simcuda, the program killed (SIGKILL) mid-pause: its files go once it is gone, another rank unharmed") {
  Program p("victim");
  e2e::Proc bystander({CUDA_PATTERN_PATH}, p.node.shim_env("bystander", 0));
  REQUIRE(bystander.line() == "ready");
  REQUIRE_FALSE(e2e::ok_addr(bystander.cmd("alloc 1 8388608 direct")).empty());
  const std::string dir = p.dir();
  const pid_t victim = p.prog->pid();
  Result<ctl::ControlAnswer> answer = make_error(EINVAL, "not run");
  const uint32_t state = p.interrupt(
      proto::CommandOp::Pause,
      [&] {
        ::kill(victim, SIGKILL);
        ::kill(p.daemon(), SIGCONT);
      },
      &answer);
  if (state != kManifestWriting) p.skip_because("the pause had finished before the daemon was stopped");
  INFO((answer ? "" : answer.error().describe()));
  REQUIRE(answer);
  REQUIRE(answer->results.size() == 1);
  CHECK(answer->results[0].code == ECONNRESET);  // "the rank exited or lost its connection"
  CHECK(p.prog->wait() == 128 + SIGKILL);
  CHECK(eventually([&] { return !fs::exists(dir); }));
  auto pb = p.node.pause("bystander");
  INFO(pb.text);
  CHECK(pb.ok());
  auto rb = p.node.resume("bystander");
  CHECK(rb.ok());
  CHECK(bystander.cmd("check") == "ok 1");
}

TEST_CASE("on simcuda, the program killed (SIGKILL) while paused: its files go once it is gone") {
  Program p("killedpaused");
  auto paused = p.node.pause(p.job);
  INFO(paused.text);
  REQUIRE(paused.ok());
  const std::string dir = p.dir();
  REQUIRE(manifest_state(dir) == kManifestPaused);
  ::kill(p.prog->pid(), SIGKILL);
  CHECK(p.prog->wait() == 128 + SIGKILL);
  CHECK(eventually([&] { return !fs::exists(dir); }));
  CHECK(p.node.status().empty());
}

TEST_CASE("on simcuda, a data file truncated under a paused program: the resume refuses, copies fail, no wrong byte") {
  Program p("cut", {{"TMSDISK_ON_TOUCH", "fail"}});
  auto paused = p.node.pause(p.job);
  INFO(paused.text);
  REQUIRE(paused.ok());
  fs::resize_file(p.dir() + "/data", 0);
  ::sync();
  auto r = p.node.resume(p.job);
  INFO(r.text);
  CHECK_FALSE(r.ok());
  // Every allocation stays paused and says why; reading it is an error, never other bytes.
  auto [rc, out] = p.node.tmsctl({"status"});
  INFO(out);
  CHECK(out.find("read-error") != std::string::npos);
  for (int id = 1; id <= 4; ++id) {
    const std::string answer = p.prog->cmd("check " + std::to_string(id));
    INFO("allocation " << id << ": " << answer);
    CHECK(answer.rfind("err", 0) == 0);
  }
  CHECK(fs::exists(p.dir() + "/data"));  // kept while the program lives
  p.prog->cmd("exit");
  CHECK(p.prog->wait() == 0);
}

TEST_CASE(
    "on simcuda, a manifest deleted under a paused program before a restart: the program never reads a wrong byte") {
  Program p("lost", {{"TMSDISK_ON_TOUCH", "fail"}});
  auto paused = p.node.pause(p.job);
  INFO(paused.text);
  REQUIRE(paused.ok());
  CHECK(p.node.daemon.stop() == 0);
  REQUIRE(fs::remove(p.dir() + "/manifest"));
  p.node.start_daemon();
  REQUIRE(p.reconnected());
  auto r = p.node.resume(p.job);
  INFO(r.text);
  // Whether the resume is refused (the daemon lost the record of the pause) or restores the bytes, the
  // program reads its own bytes or an error.
  for (int id = 1; id <= 4; ++id) {
    const std::string answer = p.prog->cmd("check " + std::to_string(id));
    INFO("allocation " << id << ": " << answer);
    CHECK((answer == "ok" || answer.rfind("err", 0) == 0));
  }
  p.prog->cmd("exit");
  CHECK(p.prog->wait() == 0);
}
