// SPDX-License-Identifier: Apache-2.0
// tmsctl's subcommands: status, pause/resume, gc, env, run.
#include "commands.h"

#include <elf.h>
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "client.h"
#include "deadline.h"
#include "tmsdisk/common/human.h"
#include "tmsdisk/common/paths.h"
#include "tmsdisk/common/plain_integer.h"
#include "tmsdisk/common/private_daemon.h"
#include "tmsdisk/common/sizes.h"
#include "tmsdisk/common/unique_fd.h"

namespace tmsdisk::ctl {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string socket_of(const Common& c) {
  return c.socket.empty() ? default_socket_path() : c.socket;
}

// A failure of `tmsctl WHAT`. The error's message is whole (client.h), so no strerror is appended.
int fail(const Common& common, const std::string& what, const Error& e) {
  print_failure(common.json, "tmsctl " + what, e.message, e.errnum(), false);
  return kExitFailed;
}

int fail(const Common& common, const std::string& what, const std::string& message, int exit_status) {
  print_failure(common.json, "tmsctl " + what, message, 0, exit_status == kExitUsage);
  return exit_status;
}

double gb_per_s(uint64_t bytes, uint64_t nanos) {
  return nanos ? static_cast<double>(bytes) / static_cast<double>(nanos) : 0.0;
}

// A rank that declared none (no RANK/SLURM_PROCID) is shown as "-".
std::string rank_text(int64_t rank) {
  return rank < 0 ? "-" : std::to_string(rank);
}

std::string rate_text(uint64_t bytes, uint64_t nanos) {
  if (!nanos) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB/s", gb_per_s(bytes, nanos));
  return buf;
}

uint64_t unmanaged_total(const proto::RankStats& s) {
  uint64_t t = 0;
  for (auto b : s.unmanaged_bytes) t += b;
  return t;
}

// "0x7f2a40000000" as programs and CUDA print addresses.
std::string address_text(uint64_t address) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

std::string damage_reason_text(const proto::DamagedRange& d) {
  const std::string chunk = std::to_string(d.chunk);
  switch (static_cast<proto::Damage>(d.reason)) {
    case proto::Damage::ChecksumMismatch: return "checksum mismatch in chunk " + chunk;
    case proto::Damage::ReadError: return "read error in chunk " + chunk + " (I/O error or short read)";
    case proto::Damage::Missing: return "chunk " + chunk + " missing from the backup";
  }
  return "damaged";
}

// The status line under a rank whose backup is damaged: each range, and the way out.
std::string damaged_text(const proto::RankStats& s) {
  std::string out = std::to_string(s.damaged_allocations) + " allocation(s), " + human_bytes(s.damaged_bytes) + ": ";
  for (std::size_t i = 0; i < s.damaged.size(); ++i)
    out += (i ? ", " : "") + address_text(s.damaged[i].address) + " (" + human_bytes(s.damaged[i].size) + "; " +
           damage_reason_text(s.damaged[i]) + ")";
  if (s.damaged_allocations > s.damaged.size())
    out += " and " + std::to_string(s.damaged_allocations - s.damaged.size()) + " more";
  return out + "; repair the file and `tmsctl resume`, or `tmsctl resume --accept-loss` (zero-filled)";
}

// Where `bytes` went, in words, empty when all of it went through the disk: ": 16.0 GiB written,
// 5.0 GiB zero, 0 B unchanged (not written)" on a pause, ": 16.0 GiB read, 5.0 GiB zero (set on the
// device)" on a resume; with ", 8.0 GiB in host memory" after the first figure when the host tier
// kept some.
std::string skipped_text(uint64_t bytes, const proto::Skipped& s, bool pause) {
  if (s.zero_bytes == 0 && s.unchanged_bytes == 0 && s.host_bytes == 0 && s.discarded_bytes == 0) return {};
  const uint64_t moved = bytes - s.zero_bytes - s.unchanged_bytes - s.host_bytes - s.discarded_bytes;
  const std::string host = (s.host_bytes ? ", " + human_bytes(s.host_bytes) + " in host memory" : "") +
                           (s.discarded_bytes ? ", " + human_bytes(s.discarded_bytes) +
                                                    (pause ? " discarded (not saved)" : " discarded (zero-filled)")
                                              : "");
  if (!pause)
    return ": " + human_bytes(moved) + " read" + host + ", " + human_bytes(s.zero_bytes) + " zero (set on the device)";
  return ": " + human_bytes(moved) + " written" + host + ", " + human_bytes(s.zero_bytes) + " zero, " +
         human_bytes(s.unchanged_bytes) + " unchanged (not written)";
}

// Bytes per tag and policy, in words: "weights (backup) 4.0 GiB resident; kv_cache (discard) 1.0 GiB
// paused"; empty while every allocation is untagged with the default policy (nothing to tell apart).
std::string tags_text(const proto::RankStats& st) {
  if (st.tags.empty() || (st.tags.size() == 1 && st.tags[0].tag == "untagged" && st.tags[0].policy == 0)) return {};
  std::string out;
  for (const auto& t : st.tags) {
    if (!out.empty()) out.append("; ");
    out.append(t.tag).append(t.policy ? " (discard)" : " (backup)");
    if (t.resident_bytes) out.append(" ").append(human_bytes(t.resident_bytes)).append(" resident");
    if (t.resident_bytes && t.paused_bytes) out.append(",");
    if (t.paused_bytes) out.append(" ").append(human_bytes(t.paused_bytes)).append(" paused");
  }
  return out;
}

json tags_json(const proto::RankStats& st) {
  json out = json::array();
  for (const auto& t : st.tags)
    out.push_back({{"tag", t.tag},
                   {"policy", t.policy ? "discard" : "backup"},
                   {"resident_bytes", t.resident_bytes},
                   {"paused_bytes", t.paused_bytes}});
  return out;
}

// The same, as JSON fields beside "bytes": moved_bytes went through the disk.
json skipped_json(uint64_t bytes, const proto::Skipped& s) {
  return {{"moved_bytes", bytes - s.zero_bytes - s.unchanged_bytes - s.host_bytes - s.discarded_bytes},
          {"host_bytes", s.host_bytes},
          {"discarded_bytes", s.discarded_bytes},
          {"zero_bytes", s.zero_bytes},
          {"unchanged_bytes", s.unchanged_bytes}};
}

// A last pause or resume in `tmsctl status --json`.
json last_json(uint64_t bytes, uint64_t nanos, const proto::Skipped& s) {
  json j = {{"bytes", bytes}, {"ns", nanos}};
  j.update(skipped_json(bytes, s));
  return j;
}

json damaged_json(const proto::RankStats& s) {
  json ranges = json::array();
  for (const auto& d : s.damaged)
    ranges.push_back({{"address", address_text(d.address)},
                      {"size", d.size},
                      {"reason", proto::damage_name(static_cast<proto::Damage>(d.reason))},
                      {"chunk", d.chunk}});
  return {{"allocations", s.damaged_allocations}, {"bytes", s.damaged_bytes}, {"ranges", ranges}};
}

// "2024-05-01 14:03:07" in local time, as people read a clock.
std::string local_time_text(uint64_t unix_ms) {
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  char buf[32];
  if (!::localtime_r(&t, &tm) || std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm) == 0) return "?";
  return buf;
}

// "3h 12m", "4m 05s", "12s": how long ago `unix_ms` was.
std::string age_text(uint64_t unix_ms) {
  const auto now = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  const uint64_t s = now > unix_ms ? (now - unix_ms) / 1000 : 0;
  char buf[48];
  if (s >= 86400)
    std::snprintf(buf, sizeof(buf), "%llud %lluh", static_cast<unsigned long long>(s / 86400),
                  static_cast<unsigned long long>(s % 86400 / 3600));
  else if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%lluh %02llum", static_cast<unsigned long long>(s / 3600),
                  static_cast<unsigned long long>(s % 3600 / 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof(buf), "%llum %02llus", static_cast<unsigned long long>(s / 60),
                  static_cast<unsigned long long>(s % 60));
  else
    std::snprintf(buf, sizeof(buf), "%llus", static_cast<unsigned long long>(s));
  return buf;
}

// An orphan is kept with no time limit: until its rank comes back or its process ends.
std::string kept_until_text(const proto::SessionInfo& s) {
  return "it reconnects with its session token or pid " + std::to_string(s.pid) + " exits";
}

// The state column: an orphan's own, since the rank's last report predates its lost connection.
const char* session_state_text(const proto::SessionInfo& s) {
  return s.orphaned ? "orphaned" : proto::state_name(static_cast<proto::RankState>(s.stats.state));
}

// The status line under an orphan: since when, what it holds, until when it is kept.
std::string orphan_text(const proto::SessionInfo& s) {
  return "lost its connection at " + local_time_text(s.orphaned_unix_ms) + " (" + age_text(s.orphaned_unix_ms) +
         " ago) while " + proto::state_name(static_cast<proto::RankState>(s.stats.state)) + "; its files (" +
         human_bytes(s.disk_bytes) + " on disk) are kept, and count against max-sessions-per-uid, until " +
         kept_until_text(s);
}

fs::path self_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return {};
  buf[n] = '\0';
  return fs::path(buf).parent_path();
}

// $`env` (when named), else what `find` sees beside this executable (paths.h: install tree, then build
// tree), made canonical: it goes into LD_PRELOAD, PYTHONPATH and messages.
std::string find_next_to_self(const char* env, std::string (*find)(const std::string&)) {
  if (const char* e = env ? std::getenv(env) : nullptr; e && *e) return e;
  const std::string found = find(self_dir().string());
  if (found.empty()) return {};
  std::error_code ec;
  fs::path p = fs::weakly_canonical(found, ec);
  return ec ? found : p.string();
}

std::string find_daemon() {
  return find_next_to_self("TMSDISK_DAEMON", find_daemon_beside_tmsctl);
}

}  // namespace

void print_failure(bool json, const std::string& where, const std::string& message, int errnum, bool usage) {
  if (!json) {
    std::fprintf(stderr, "%s: %s\n", where.c_str(), message.c_str());
    return;
  }
  nlohmann::json out = {{"ok", false}, {"error", message}, {"usage", usage}};
  if (errnum) out["errno"] = errnum;
  std::printf("%s\n", out.dump(2).c_str());
}

std::string find_shim_library() {
  return find_next_to_self("TMSDISK_LIBRARY", find_shim_beside_tmsctl);
}

std::string find_python_startup() {
  // No variable names another: the module only registers a callback through the C API, which every
  // libtmsdisk.so since API version 3 has.
  return find_next_to_self(nullptr, find_python_startup_beside_tmsctl);
}

std::string find_tms_compat() {
  const std::string python = find_python_startup();
  if (python.empty()) return {};
  const std::string dir = python + "/tms-compat";
  return ::access((dir + "/torch_memory_saver/__init__.py").c_str(), R_OK) == 0 ? dir : std::string();
}

int cmd_status(const Common& common) {
  const CommandDeadlines deadlines = command_deadlines(common.timeout_s);
  auto client = Client::connect(socket_of(common), deadlines.answer);
  if (!client) return fail(common, "status", client.error());
  Client::HostTier host_tier;
  auto sessions = client->list_sessions(deadlines.answer, &host_tier);
  if (!sessions) return fail(common, "status", sessions.error());
  if (common.json) {
    json out = json::array();
    for (const auto& s : *sessions) {
      json unmanaged = json::object();
      for (std::size_t i = 0; i < proto::kUnmanagedReasons; ++i)
        if (s.stats.unmanaged_bytes[i])
          unmanaged[proto::unmanaged_name(static_cast<proto::Unmanaged>(i))] = s.stats.unmanaged_bytes[i];
      out.push_back(
          {{"session", s.session_id},
           {"pid", s.pid},
           {"uid", s.uid},
           {"job", s.job},
           {"rank", s.rank},
           {"state", session_state_text(s)},
           {"resident_bytes", s.stats.resident_bytes},
           {"paused_bytes", s.stats.paused_bytes},
           {"unmanaged_bytes", unmanaged},
           {"managed_allocations", s.stats.managed_allocations},
           {"disk_bytes", s.disk_bytes},
           {"host_tier_bytes", s.host_tier_bytes},
           {"host_tier_kept", s.host_tier_kept != 0},
           {"objects", s.objects},
           {"object_bytes", s.object_bytes},
           {"object_host_bytes", s.object_host_bytes},
           {"tags", tags_json(s.stats)},
           {"last_pause", last_json(s.stats.last_pause_bytes, s.stats.last_pause_ns, s.stats.last_pause_skipped)},
           {"last_resume", last_json(s.stats.last_resume_bytes, s.stats.last_resume_ns, s.stats.last_resume_skipped)},
           {"last_change_unix_ms", s.stats.last_change_unix_ms},
           {"damaged", damaged_json(s.stats)},
           {"orphaned", s.orphaned
                            ? json{{"since_unix_ms", s.orphaned_unix_ms},
                                   {"last_state", proto::state_name(static_cast<proto::RankState>(s.stats.state))},
                                   {"kept_until", kept_until_text(s)}}
                            : json(nullptr)}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  // The node's host tier, whoever holds it (other users' ranks included, as a number).
  if (host_tier.budget_bytes)
    std::printf("host tier: %s of %s in use on this node\n", human_bytes(host_tier.used_bytes).c_str(),
                human_bytes(host_tier.budget_bytes).c_str());
  if (sessions->empty()) {
    std::printf("no ranks connected to %s\n", client->socket_path().c_str());
    return 0;
  }
  std::printf("%-16s %5s %8s %-16s %10s %10s %10s %10s %s\n", "JOB", "RANK", "PID", "STATE", "RESIDENT", "PAUSED",
              "UNMANAGED", "DISK", "LAST PAUSE / RESUME");
  for (const auto& s : *sessions) {
    std::string last = "-";
    if (s.stats.last_pause_ns || s.stats.last_resume_ns)
      last = human_bytes(s.stats.last_pause_bytes) + " " + rate_text(s.stats.last_pause_bytes, s.stats.last_pause_ns) +
             " / " + rate_text(s.stats.last_resume_bytes, s.stats.last_resume_ns);
    std::printf("%-16s %5s %8d %-16s %10s %10s %10s %10s %s\n", s.job.c_str(), rank_text(s.rank).c_str(), s.pid,
                session_state_text(s), human_bytes(s.stats.resident_bytes).c_str(),
                human_bytes(s.stats.paused_bytes).c_str(), human_bytes(unmanaged_total(s.stats)).c_str(),
                human_bytes(s.disk_bytes).c_str(), last.c_str());
    // Why the unmanaged bytes are not paused, so that nobody has to guess what stayed on the GPU.
    std::string why;
    for (std::size_t i = 0; i < proto::kUnmanagedReasons; ++i) {
      if (!s.stats.unmanaged_bytes[i]) continue;
      why += (why.empty() ? "" : ", ") + std::string(proto::unmanaged_name(static_cast<proto::Unmanaged>(i))) + " " +
             human_bytes(s.stats.unmanaged_bytes[i]);
    }
    if (!why.empty()) std::printf("%-16s %5s %8s   unmanaged: %s\n", "", "", "", why.c_str());
    // Memory a resume could not restore, in the program's terms, and what to do about it.
    if (s.stats.damaged_allocations)
      std::printf("%-16s %5s %8s   damaged: %s\n", "", "", "", damaged_text(s.stats).c_str());
    if (s.orphaned) std::printf("%-16s %5s %8s   orphaned: %s\n", "", "", "", orphan_text(s).c_str());
    if (const std::string tags = tags_text(s.stats); !tags.empty())
      std::printf("%-16s %5s %8s   tags: %s\n", "", "", "", tags.c_str());
    if (s.host_tier_bytes)
      std::printf("%-16s %5s %8s   host tier: holds %s%s\n", "", "", "", human_bytes(s.host_tier_bytes).c_str(),
                  s.host_tier_kept ? " (empty, kept for its next pause)" : "");
    // The rank's stored objects (a streamed optimizer's state): in the host tier or on disk beside its
    // pauses, never moved by them.
    if (s.objects)
      std::printf("%-16s %5s %8s   objects: %u, %s in the host tier, %s on disk\n", "", "", "", s.objects,
                  human_bytes(s.object_host_bytes).c_str(), human_bytes(s.object_bytes).c_str());
    // What the last pause and resume did not have to move (zero and unchanged chunks).
    const std::string skipped_pause = skipped_text(s.stats.last_pause_bytes, s.stats.last_pause_skipped, true);
    const std::string skipped_resume = skipped_text(s.stats.last_resume_bytes, s.stats.last_resume_skipped, false);
    if (!skipped_pause.empty()) std::printf("%-16s %5s %8s   last pause%s\n", "", "", "", skipped_pause.c_str());
    if (!skipped_resume.empty()) std::printf("%-16s %5s %8s   last resume%s\n", "", "", "", skipped_resume.c_str());
  }
  return 0;
}

namespace {

// "--job J --rank R": the selector as the user typed it, for messages.
std::string selector_text(const Selector& sel) {
  if (sel.all) return "--all";
  std::string out;
  if (!sel.job.empty()) out += "--job " + sel.job;
  if (sel.rank >= 0) out += (out.empty() ? "" : " ") + std::string("--rank ") + std::to_string(sel.rank);
  if (sel.pid > 0) out += (out.empty() ? "" : " ") + std::string("--pid ") + std::to_string(sel.pid);
  return out;
}

// What one rank's part came to, in words: "paused 256.0 MiB in 0.59 s (0.45 GB/s)", and what of it
// did not have to move.
const char* op_verb(proto::CommandOp op) {
  switch (op) {
    case proto::CommandOp::Pause: return "pause";
    case proto::CommandOp::Resume: return "resume";
    case proto::CommandOp::Prefetch: return "prefetch";
  }
  return "?";
}

std::string result_text(const proto::RankResult& r, proto::CommandOp op) {
  const bool pause = op == proto::CommandOp::Pause;
  if (r.code != 0) return "FAILED: " + r.message + " (" + std::strerror(r.code) + ")";
  if (r.outcome == static_cast<uint8_t>(proto::Outcome::NoOp))
    return (r.message.empty() ? std::string(pause ? "already paused" : "not paused") : r.message) + " (nothing to do)";
  // Answered once started: the reads go on in the rank, and its resume takes what they brought.
  if (op == proto::CommandOp::Prefetch) return r.message + " (in the background)";
  char figures[96];
  std::snprintf(figures, sizeof(figures), " in %.2f s (%.2f GB/s)", static_cast<double>(r.nanos) / 1e9,
                gb_per_s(r.bytes, r.nanos));
  // Every chunk a resume reads is checked against the checksum taken when it was written. What else
  // the rank says (memory lost to a damaged backup, replaced with zeros) follows: it must be seen.
  return std::string(pause ? "paused " : "resumed and verified ") + human_bytes(r.bytes) + figures +
         skipped_text(r.bytes, r.skipped, pause) + (r.message.empty() ? "" : "; " + r.message);
}

// A rank that did not answer before the deadline, in words: it may still be at work.
std::string unanswered_text(const Deadline& deadline, proto::CommandOp op) {
  const std::string still = op == proto::CommandOp::Pause    ? "still pausing?"
                            : op == proto::CommandOp::Resume ? "still resuming?"
                                                             : "busy?";
  return (deadline.renewed() ? "no answer and no progress for " : "no answer within ") + deadline.seconds_text() +
         " (" + still + " see `tmsctl status`)";
}

// The request that pauses, resumes or prefetches `sel`, or nullopt once the usage mistake that
// refuses it has been told (exit status kExitUsage).
std::optional<proto::Control> control_request(const Common& common, const Selector& sel, proto::CommandOp op,
                                              bool accept_loss) {
  const std::string verb = op_verb(op);
  proto::Control req;
  req.op = static_cast<uint8_t>(op);
  if (accept_loss) req.flags = proto::kAcceptLoss;
  // On the wire an empty tag means the whole process: `--tag ""` (an unset variable in a script) must
  // not pause or discard everything.
  if (sel.tag_given && (sel.tag.empty() || !proto::valid_tag(sel.tag))) {
    fail(common, verb,
         "--tag '" + sel.tag + "': a tag is 1 to 63 of A-Z a-z 0-9 _ . -" +
             (sel.tag.empty() ? "; leave out --tag to " + verb + " the whole process" : ""),
         kExitUsage);
    return std::nullopt;
  }
  req.tag = sel.tag;
  if (sel.all) {
    if (!sel.job.empty() || sel.rank >= 0 || sel.pid > 0) {
      fail(common, verb, "--all cannot be combined with --job, --rank or --pid", kExitUsage);
      return std::nullopt;
    }
    req.match = proto::kMatchAll;
  }
  if (!sel.job.empty()) req.match |= proto::kMatchJob, req.job = sel.job;
  if (sel.rank >= 0) req.match |= proto::kMatchRank, req.rank = sel.rank;
  if (sel.pid > 0) req.match |= proto::kMatchPid, req.pid = sel.pid;
  if (req.match == 0) {
    fail(common, verb, "say which ranks: --job J, --rank R, --pid P, or --all", kExitUsage);
    return std::nullopt;
  }
  // The daemon gets the same limit, so that it ends the request (and drops the late answers) when
  // tmsctl gives up; whichever deadline passes first, the silent ranks are named alike (client.h).
  req.timeout_ms = static_cast<uint32_t>(std::lround(common.timeout_s * 1000));  // at most 1e9: main.cpp's range
  return req;
}

// The line a pause or resume keeps up to date on a terminal's stderr while the ranks work: a progress
// bar, or, while they are silent, whom the command waits for and until when.
class ProgressLine {
 public:
  ProgressLine(std::string verb, const Deadline& ranks, bool tty) : verb_(std::move(verb)), ranks_(ranks), tty_(tty) {}

  void progress(const proto::Progress& p) {
    if (!tty_) return;
    progress_[p.session_id] = p;
    uint64_t done = 0, total = 0;
    for (auto& [id, q] : progress_) done += q.done_bytes, total += q.total_bytes;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
    const int width = 30;
    const int filled = total ? static_cast<int>(width * static_cast<double>(done) / static_cast<double>(total)) : 0;
    // \x1b[K clears what a longer waiting line left on the right.
    std::fprintf(stderr, "\r%s [%-*s] %s / %s  %.2f GB/s  ETA %.0fs\x1b[K", verb_.c_str(), width,
                 std::string(filled, '#').c_str(), human_bytes(done).c_str(), human_bytes(total).c_str(), rate / 1e9,
                 eta);
  }

  // One rank that never answers (wedged, or another user's under root's `pause --all`) holds an
  // untimed command for kSilenceLimit, which nobody would guess from a still progress bar.
  void waiting(const std::vector<proto::RankTarget>& silent, std::chrono::milliseconds quiet) {
    if (!tty_ || silent.empty()) return;
    waited_ = true;
    std::string who;
    for (std::size_t i = 0; i < silent.size() && i < 3; ++i)
      who += (i ? ", " : "") + silent[i].job + " rank " + rank_text(silent[i].rank) + " (pid " +
             std::to_string(silent[i].pid) + ")";
    if (silent.size() > 3) who += " and " + std::to_string(silent.size() - 3) + " more";
    const std::string until =
        ranks_.renewed() ? "gives up after " + ranks_.seconds_text() + " without a word (--timeout S sets a limit)"
                         : "gives up at " + ranks_.seconds_text() + " (--timeout)";
    std::fprintf(stderr, "\r%s: waiting for %s: nothing for %lld s; %s\x1b[K", verb_.c_str(), who.c_str(),
                 static_cast<long long>(quiet.count() / 1000), until.c_str());
  }

  // Ends the line, if one was shown, so that what follows starts on its own.
  void finish() const {
    if (tty_ && (!progress_.empty() || waited_)) std::fprintf(stderr, "\n");
  }

 private:
  const std::string verb_;
  const Deadline& ranks_;
  const bool tty_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::map<uint64_t, proto::Progress> progress_;
  bool waited_ = false;
};

// Tells each rank's part of a pause or resume (the answers, then the ranks that gave none) and returns
// the exit status.
int report_control(const Common& common, const std::string& verb, proto::CommandOp op, const ControlAnswer& answer,
                   const Deadline& ranks) {
  const auto& results = answer.results;
  const auto& unanswered = answer.unanswered;
  int failed = 0;
  json out = json::array();
  for (const auto& r : results) {
    if (r.code != 0) ++failed;
    if (common.json) {
      out.push_back({{"job", r.job},
                     {"rank", r.rank},
                     {"pid", r.pid},
                     {"ok", r.code == 0},
                     {"answered", true},
                     {"outcome", proto::outcome_name(static_cast<proto::Outcome>(r.outcome))},
                     {"errno", r.code},
                     {"bytes", r.bytes},
                     {"ns", r.nanos},
                     {"gb_per_s", gb_per_s(r.bytes, r.nanos)},
                     {"message", r.message}});
      out.back().update(skipped_json(r.bytes, r.skipped));
    } else {
      std::printf("%s rank %s (pid %d): %s\n", r.job.c_str(), rank_text(r.rank).c_str(), r.pid,
                  result_text(r, op).c_str());
    }
  }
  // After the answers, the ranks that gave none: whether they paused is not known ("outcome":
  // "unknown"), and they may still finish.
  const std::string silent = unanswered_text(ranks, op);
  for (const auto& t : unanswered) {
    if (common.json) {
      out.push_back({{"job", t.job},
                     {"rank", t.rank},
                     {"pid", t.pid},
                     {"ok", false},
                     {"answered", false},
                     {"outcome", "unknown"},
                     {"errno", ETIMEDOUT},
                     {"bytes", 0},
                     {"ns", 0},
                     {"gb_per_s", 0.0},
                     {"message", silent}});
      out.back().update(skipped_json(0, {}));
    } else {
      std::printf("%s rank %s (pid %d): %s\n", t.job.c_str(), rank_text(t.rank).c_str(), t.pid, silent.c_str());
    }
  }
  if (common.json) std::printf("%s\n", out.dump(2).c_str());
  const std::size_t asked = results.size() + unanswered.size();
  if (failed && !common.json)
    std::fprintf(stderr, "tmsctl %s: %d of %zu rank(s) failed\n", verb.c_str(), failed, asked);
  if (!unanswered.empty() && !common.json)
    std::fprintf(stderr, "tmsctl %s: %zu of %zu rank(s) did not answer in time\n", verb.c_str(), unanswered.size(),
                 asked);
  return failed || !unanswered.empty() ? kExitFailed : 0;
}

}  // namespace

int cmd_control(const Common& common, const Selector& sel, proto::CommandOp op, bool accept_loss) {
  const std::string verb = op_verb(op);
  const std::optional<proto::Control> req = control_request(common, sel, op, accept_loss);
  if (!req) return kExitUsage;

  const CommandDeadlines deadlines = command_deadlines(common.timeout_s);
  auto client = Client::connect(socket_of(common), deadlines.answer);
  if (!client) return fail(common, verb, client.error());

  ProgressLine line(verb, deadlines.ranks, !common.json && ::isatty(STDERR_FILENO));
  auto answer = client->control(
      *req, deadlines.ranks, [&](const proto::Progress& p) { line.progress(p); },
      [&](const std::vector<proto::RankTarget>& silent, std::chrono::milliseconds quiet) {
        line.waiting(silent, quiet);
      });
  line.finish();
  if (!answer) return fail(common, verb + " " + selector_text(sel), answer.error());
  return report_control(common, verb, op, *answer, deadlines.ranks);
}

int cmd_gc(const Common& common) {
  const CommandDeadlines deadlines = command_deadlines(common.timeout_s);
  auto client = Client::connect(socket_of(common), deadlines.answer);
  if (!client) return fail(common, "gc", client.error());
  auto r = client->gc(deadlines.answer);
  if (!r) return fail(common, "gc", r.error());
  if (common.json)
    std::printf("%s\n", json{{"removed_dirs", r->removed_dirs}, {"removed_bytes", r->removed_bytes}}.dump(2).c_str());
  else
    std::printf("removed %u directories of dead ranks (%s)\n", r->removed_dirs, human_bytes(r->removed_bytes).c_str());
  return 0;
}

namespace {

// Why a launch cannot work, found before the program starts (a program started without the shim, or
// whose shim the daemon refuses, would run unmanaged after a warning few people read).
struct Refusal {
  std::string message;
  int exit_status = kExitUsage;
};

// Whether `path` is an ELF shared object the dynamic loader can preload into programs like this one
// (same class and machine as tmsctl itself). Empty when it is; else what is wrong.
std::string shared_object_problem(const std::string& path) {
  auto header_of = [](const char* file, Elf64_Ehdr& h) -> std::string {
    UniqueFd fd(::open(file, O_RDONLY | O_CLOEXEC));
    if (!fd) return std::string("cannot read it: ") + std::strerror(errno);
    const ssize_t n = ::pread(fd.get(), &h, sizeof(h), 0);
    if (n != static_cast<ssize_t>(sizeof(h)) || std::memcmp(h.e_ident, ELFMAG, SELFMAG) != 0)
      return "it is not an ELF file";
    return {};
  };
  Elf64_Ehdr lib{}, self{};
  if (std::string why = header_of(path.c_str(), lib); !why.empty()) return why;
  if (!header_of("/proc/self/exe", self).empty()) return {};  // nothing to compare with: let the loader judge
  if (lib.e_ident[EI_CLASS] != self.e_ident[EI_CLASS] || lib.e_machine != self.e_machine)
    return "it is built for another architecture";
  if (lib.e_type != ET_DYN) return "it is an ELF file but not a shared library";
  return {};
}

// What can be checked without the daemon: the job name, the library, and the staging budget's form.
std::optional<Refusal> check_launch(const LaunchOptions& launch, const std::string& lib) {
  if (!launch.job.empty() && !proto::valid_job_name(launch.job))
    return Refusal{"--job '" + launch.job + "' is not a job name: " + proto::kJobNameRule};
  const char* env_lib = std::getenv("TMSDISK_LIBRARY");
  if (lib.empty())
    return Refusal{"cannot find libtmsdisk.so next to tmsctl; set TMSDISK_LIBRARY to its path", kExitFailed};
  if (std::string why = shared_object_problem(lib); !why.empty()) {
    const std::string what = env_lib && *env_lib ? "TMSDISK_LIBRARY=" + lib : lib;
    return Refusal{what + " cannot be preloaded: " + why +
                       (env_lib && *env_lib ? "; point TMSDISK_LIBRARY at libtmsdisk.so, or unset it to use the one "
                                              "installed beside tmsctl"
                                            : "; reinstall tmsdisk, or set TMSDISK_LIBRARY to a good libtmsdisk.so"),
                   kExitFailed};
  }
  if (launch.tms_compat && find_tms_compat().empty())
    return Refusal{
        "--tms-compat: torch_memory_saver's compatibility module (tms-compat/torch_memory_saver in the "
        "directory of tmsdisk's Python start-up module) is not installed beside tmsctl; reinstall tmsdisk",
        kExitFailed};
  if (!launch.stream_optimizer.empty() && find_python_startup().empty())
    return Refusal{
        "--stream-optimizer: tmsdisk's Python start-up module (sitecustomize.py), which replaces "
        "torch.optim's AdamW and Adam, is not installed beside tmsctl; reinstall tmsdisk",
        kExitFailed};
  if (!launch.staging_budget_mb) {
    const char* inherited = std::getenv("TMS_DISK_BACKUP_CHUNK_MB");
    if (inherited && !parse_plain_mib(inherited))
      return Refusal{std::string("TMS_DISK_BACKUP_CHUNK_MB=") + inherited +
                     " is not a size in MiB (a plain integer, e.g. 256); fix it or pass --staging-budget-mb"};
  }
  return std::nullopt;
}

// The staging budget against the daemon's limits (from its WELCOME): no more than it allows. One
// smaller than two of its chunks is not refused: the daemon gives such a rank smaller chunks.
std::optional<Refusal> check_staging_budget(const LaunchOptions& launch, const proto::Welcome& daemon) {
  uint64_t mib = launch.staging_budget_mb;
  std::string named = "--staging-budget-mb " + std::to_string(mib);
  if (!mib) {
    const auto inherited = parse_plain_mib(std::getenv("TMS_DISK_BACKUP_CHUNK_MB"));
    if (!inherited || *inherited == 0) return std::nullopt;  // the daemon's default
    mib = *inherited;
    named = "TMS_DISK_BACKUP_CHUNK_MB=" + std::to_string(mib);
  }
  if (daemon.max_staging_budget_bytes && mib * kMiB > daemon.max_staging_budget_bytes)
    return Refusal{named + " is more than this daemon allows per rank (max-staging-budget-mb = " +
                   std::to_string(daemon.max_staging_budget_bytes / kMiB) + ")"};
  return std::nullopt;
}

// PYTHONPATH with `dirs` first, in order, and the inherited entries after them (once: a `tmsctl run`
// inside another one does not add them twice).
std::string python_path_with(const std::vector<std::string>& dirs) {
  std::string path;
  for (const auto& dir : dirs) (path.empty() ? path : path += ':') += dir;
  const char* old = std::getenv("PYTHONPATH");
  for (std::string_view rest = old ? old : ""; !rest.empty();) {
    const auto colon = rest.find(':');
    const std::string_view entry = rest.substr(0, colon);
    if (std::find(dirs.begin(), dirs.end(), entry) == dirs.end()) (path += ':') += entry;
    rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
  }
  return path;
}

// Where the Python start-up module is, when the launch wants it; a warning on stderr (stdout may be
// JSON or `export` lines) when it is missing: the program runs all the same, its cache paused with the
// rest of its memory.
std::string python_startup_for(const LaunchOptions& launch, const char* where) {
  std::string dir = find_python_startup();  // also the tmsdisk package's: on the path either way
  if (dir.empty() && launch.empty_torch_cache && !launch.tms_compat)
    std::fprintf(stderr,
                 "%s: warning: the Python start-up module (sitecustomize.py) is not installed beside tmsctl: "
                 "PyTorch's cached memory will be paused with the rest (reinstall tmsdisk, or pass "
                 "--keep-torch-cache to say so)\n",
                 where);
  return dir;
}

// The variables a launch needs, in a stable order. `root` is where the daemon keeps files;
// `python_dir`, the start-up module's and tmsdisk package's directory (empty: missing); with --tms-compat, the
// compatibility module's directory comes before it (check_launch made sure it is there).
std::vector<std::pair<std::string, std::string>> launch_env(const std::string& socket, const std::string& root,
                                                            const LaunchOptions& launch, const std::string& lib,
                                                            const std::string& python_dir) {
  std::vector<std::pair<std::string, std::string>> env;
  std::string preload = lib;
  if (const char* old = std::getenv("LD_PRELOAD"); old && *old && std::string(old).find(lib) == std::string::npos)
    preload += std::string(":") + old;
  env.emplace_back("LD_PRELOAD", preload);
  env.emplace_back("TMSDISK_SOCKET", socket);
  if (!root.empty() && !std::getenv("TMS_DISK_BACKUP_DIR")) env.emplace_back("TMS_DISK_BACKUP_DIR", root);
  if (launch.staging_budget_mb) env.emplace_back("TMS_DISK_BACKUP_CHUNK_MB", std::to_string(launch.staging_budget_mb));
  if (!launch.job.empty()) env.emplace_back("TMSDISK_JOB", launch.job);
  if (launch.min_mb) env.emplace_back("TMSDISK_MIN_BYTES", std::to_string(launch.min_mb << 20));
  if (!launch.on_touch.empty()) env.emplace_back("TMSDISK_ON_TOUCH", launch.on_touch);
  if (!launch.stream_optimizer.empty()) env.emplace_back("TMSDISK_STREAM_OPTIMIZER", launch.stream_optimizer);
  std::vector<std::string> python_path;
  if (launch.tms_compat) python_path.push_back(find_tms_compat());
  if (!python_dir.empty()) python_path.push_back(python_dir);
  if (!python_path.empty()) env.emplace_back("PYTHONPATH", python_path_with(python_path));
  // Programs written for torch_memory_saver expect its accounting: PyTorch's cached blocks stay, and
  // pause (or are discarded) with their region, as TMS does (its training_engine example checks it).
  if (!launch.empty_torch_cache || launch.tms_compat) {
    // Also off where an outer launch already put the module on PYTHONPATH.
    env.emplace_back("TMSDISK_TORCH_EMPTY_CACHE", "0");
  } else if (!python_dir.empty()) {
    env.emplace_back("TMSDISK_TORCH_EMPTY_CACHE", "1");
  }
  return env;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

int cmd_env(const Common& common, const LaunchOptions& launch) {
  const std::string socket = socket_of(common);
  const std::string lib = find_shim_library();
  if (auto refused = check_launch(launch, lib)) return fail(common, "env", refused->message, refused->exit_status);
  // Without a daemon the environment is still printed (a launcher may start one later); with one, what
  // it would refuse is refused here.
  std::string root;
  if (auto client = Client::connect(socket, command_deadlines(common.timeout_s).answer)) {
    if (auto refused = check_staging_budget(launch, client->welcome()))
      return fail(common, "env", refused->message, refused->exit_status);
    root = client->first_root();
  }
  auto env = launch_env(socket, root, launch, lib, python_startup_for(launch, "tmsctl env"));
  if (common.json) {
    json out = json::object();
    for (auto& [k, v] : env) out[k] = v;
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    for (auto& [k, v] : env) std::printf("export %s=%s\n", k.c_str(), shell_quote(v).c_str());
  }
  return 0;
}

int cmd_run(const Common& common, const LaunchOptions& launch, const std::vector<std::string>& command) {
  const std::string lib = find_shim_library();
  if (auto refused = check_launch(launch, lib)) return fail(common, "run", refused->message, refused->exit_status);
  std::string socket = socket_of(common);
  const CommandDeadlines deadlines = command_deadlines(common.timeout_s);
  auto client = Client::connect(socket, deadlines.answer);
  // A daemon that is there but does not answer (stopped, wedged) is reported, not replaced: a private
  // one beside it would split the node's ranks between two daemons.
  const bool silent = !client && client.error().errnum() == ETIMEDOUT;
  if (!client && !silent && launch.start_daemon && common.socket.empty() && !std::getenv("TMSDISK_SOCKET")) {
    // No system daemon: start (or join) this user's private one, as the shim itself would.
    const std::string daemon = find_daemon();
    if (daemon.empty())
      return fail(common, "run", "no tmsdiskd answers and none was found next to tmsctl (set TMSDISK_DAEMON)",
                  kExitFailed);
    socket = private_socket_path();
    // Said before anything starts: a directory another user made first (/tmp is everyone's) is theirs.
    if (const std::string squat = private_dir_problem(socket); !squat.empty())
      return fail(common, "run", "cannot start a private tmsdiskd: " + squat, kExitFailed);
    std::string why;
    if (int rc = spawn_private_daemon(daemon, socket, 10000, &why); rc < 0) {
      // The daemon's own words when it said any (it stops at once on what it cannot use), and its
      // log only where it got far enough to write one.
      std::string message = "could not start a private tmsdiskd (" + daemon +
                            "): " + (why.empty() ? std::string(std::strerror(-rc)) : why);
      const std::string log = (fs::path(socket).parent_path() / "tmsdiskd.log").string();
      if (std::error_code ec; fs::exists(log, ec)) message += "; its log: " + log;
      return fail(common, "run", message, kExitFailed);
    }
    client = Client::connect(socket, deadlines.answer);
  }
  if (!client) return fail(common, "run", client.error());
  if (auto refused = check_staging_budget(launch, client->welcome()))
    return fail(common, "run", refused->message, refused->exit_status);
  auto env = launch_env(socket, client->first_root(), launch, lib, python_startup_for(launch, "tmsctl run"));
  for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const int e = errno;
  return fail(common, "run", std::string("cannot run ") + argv[0] + ": " + std::strerror(e), 127);
}

}  // namespace tmsdisk::ctl
