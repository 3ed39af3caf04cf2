// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's Prometheus metrics (metrics.h).
#include "metrics.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>

#include "config.h"
#include "session_table.h"
#include "storage.h"

namespace tmsdisk::server {

// ------------------------------------------------------------------------------------------------
// The text exposition format

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Exposition::family(std::string_view name, std::string_view type, std::string_view help) {
  // HELP escapes backslash and newline, not the double quote.
  std::string escaped;
  for (char c : help) escaped += c == '\\' ? "\\\\" : c == '\n' ? "\\n" : std::string(1, c);
  text_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, escaped, name, type);
}

void Exposition::start_sample(std::string_view name, std::span<const Label> labels) {
  text_ += name;
  if (labels.empty()) {
    text_ += ' ';
    return;
  }
  text_ += '{';
  for (std::size_t i = 0; i < labels.size(); ++i)
    text_ += fmt::format("{}{}=\"{}\"", i ? "," : "", labels[i].name, escape_label_value(labels[i].value));
  text_ += "} ";
}

void Exposition::sample(std::string_view name, std::span<const Label> labels, uint64_t value) {
  start_sample(name, labels);
  text_ += fmt::format("{}\n", value);
}

void Exposition::sample(std::string_view name, std::span<const Label> labels, double value) {
  start_sample(name, labels);
  // The shortest text that reads back as the same double (1.5, 1e-05, 1764000000.25): Prometheus
  // parses it as Go's ParseFloat does.
  text_ += fmt::format("{}\n", value);
}

Histogram::Histogram(std::span<const double> upper_bounds)
    : bounds_(upper_bounds.begin(), upper_bounds.end()), in_bucket_(upper_bounds.size() + 1, 0) {}

void Histogram::observe(double value) {
  std::size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++in_bucket_[i];
  sum_ += value;
  ++count_;
}

void Histogram::write(Exposition& out, std::string_view name, std::span<const Label> labels) const {
  std::vector<Label> with_le(labels.begin(), labels.end());
  with_le.push_back({"le", {}});
  const std::string bucket = fmt::format("{}_bucket", name);
  uint64_t cumulative = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += in_bucket_[i];
    with_le.back().value = i < bounds_.size() ? fmt::format("{}", bounds_[i]) : "+Inf";
    out.sample(bucket, with_le, cumulative);
  }
  out.sample(fmt::format("{}_sum", name), labels, sum_);
  out.sample(fmt::format("{}_count", name), labels, count_);
}

// ------------------------------------------------------------------------------------------------
// What tmsdiskd counts

FailureCause failure_cause(int code) noexcept {
  switch (code) {
    case ENOSPC:
    case EDQUOT: return FailureCause::enospc;
    case ENOMEM: return FailureCause::enomem;
    // The disk failed, or what it gave back is not what was written (checksum mismatch, a chunk missing).
    case EIO:
    case EBADMSG:
    case ENODATA: return FailureCause::eio;
    case ETIMEDOUT: return FailureCause::timeout;
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case ENOTCONN:
    case EPIPE:
    case ESHUTDOWN: return FailureCause::disconnected;
    default: return FailureCause::other;
  }
}

std::string_view name_of(Operation op) noexcept {
  return op == Operation::pause ? "pause" : "resume";
}

std::string_view name_of(OperationResult result) noexcept {
  switch (result) {
    case OperationResult::ok: return "ok";
    case OperationResult::failed: return "failed";
    case OperationResult::no_op: return "no_op";
  }
  return "failed";
}

std::string_view name_of(FailureCause cause) noexcept {
  switch (cause) {
    case FailureCause::enospc: return "enospc";
    case FailureCause::enomem: return "enomem";
    case FailureCause::eio: return "eio";
    case FailureCause::timeout: return "timeout";
    case FailureCause::disconnected: return "disconnected";
    case FailureCause::other: return "other";
  }
  return "other";
}

MetricsSnapshot take_snapshot(SessionTable& sessions, const storage::Roots& roots) {
  MetricsSnapshot now;
  now.host_tier_budget_bytes = sessions.host_tier_budget();
  now.host_tier_used_bytes = sessions.host_tier_used();
  std::vector<uint64_t> disk(roots.size(), 0);
  uint64_t own_disk = 0;  // in directories ranks chose (TMS_DISK_BACKUP_DIR), counted together
  for (const auto& [id, s] : sessions.all()) {
    if (s.conn_id != 0) ++now.sessions_connected;
    if (s.orphan) ++now.sessions_orphaned;
    if (s.staging) now.staging_bytes += s.staging->bytes();
    if (s.host_tier_kept) now.host_tier_kept_bytes += s.host_tier.bytes;
    now.host_tier_object_bytes += object_host_bytes(s);
    if (s.store && s.own_roots)
      own_disk += s.store->disk_bytes_on(0);
    else if (s.store)
      for (std::size_t i = 0; i < disk.size() && i < s.store->root_count(); ++i) disk[i] += s.store->disk_bytes_on(i);
    if (s.objects) {
      now.objects += s.objects->object_count();
      now.object_bytes += s.objects->disk_bytes();
    }
  }
  for (std::size_t i = 0; i < roots.size(); ++i) now.disk_bytes.emplace_back(roots[i].path, disk[i]);
  if (own_disk) now.disk_bytes.emplace_back("directories ranks chose", own_disk);
  return now;
}

Metrics::Metrics(std::string version, std::chrono::system_clock::time_point started)
    : version_(std::move(version)),
      start_time_seconds_(std::chrono::duration<double>(started.time_since_epoch()).count()),
      durations_(kOps, Histogram(kDurationBuckets)) {}

void Metrics::command_sent(uint64_t command_id, uint64_t session_id, proto::CommandOp op) {
  if (op == proto::CommandOp::Prefetch) return;  // a hint, answered once started: not a pause nor a resume
  sent_[command_id] = Sent{session_id, op == proto::CommandOp::Resume ? Operation::resume : Operation::pause};
}

void Metrics::command_answered(uint64_t command_id, const proto::CommandDone& answer) {
  auto it = sent_.find(command_id);
  if (it == sent_.end()) return;  // counted already: an answer repeated by a confused peer counts once
  const Operation op = it->second.op;
  sent_.erase(it);
  record(op, answer);
}

void Metrics::session_lost(uint64_t session_id) {
  // The same code and outcome the router gives tmsctl for such a rank.
  proto::CommandDone lost;
  lost.code = ECONNRESET;
  lost.outcome = static_cast<uint8_t>(proto::Outcome::Done);
  for (auto it = sent_.begin(); it != sent_.end();) {
    if (it->second.session_id != session_id) {
      ++it;
      continue;
    }
    const Operation op = it->second.op;
    it = sent_.erase(it);
    record(op, lost);
  }
}

void Metrics::moved(io::Op op, uint64_t bytes) {
  moved_bytes_[static_cast<std::size_t>(op == io::Op::Write ? Operation::pause : Operation::resume)] += bytes;
}

void Metrics::skipped(SkipReason reason, uint64_t bytes) {
  skipped_bytes_[static_cast<std::size_t>(reason)] += bytes;
}

void Metrics::record(Operation op, const proto::CommandDone& answer) {
  const auto o = static_cast<std::size_t>(op);
  OperationResult result = OperationResult::ok;
  if (answer.code != 0) {
    result = OperationResult::failed;
    ++failures_[o][static_cast<std::size_t>(failure_cause(answer.code))];
  } else if (answer.outcome == static_cast<uint8_t>(proto::Outcome::NoOp)) {
    result = OperationResult::no_op;
  } else {
    durations_[o].observe(static_cast<double>(answer.nanos) / 1e9);
  }
  // The host tier's bytes move by DMA in the rank: its answer is the daemon's only account of them.
  host_moved_bytes_[o] += answer.skipped.host_bytes;
  ++results_[o][static_cast<std::size_t>(result)];
  if (on_recorded_) on_recorded_();
}

std::string Metrics::format(const MetricsSnapshot& now) const {
  constexpr Operation kAllOps[] = {Operation::pause, Operation::resume};
  constexpr OperationResult kAllResults[] = {OperationResult::ok, OperationResult::failed, OperationResult::no_op};
  constexpr FailureCause kAllCauses[] = {FailureCause::enospc,  FailureCause::enomem,       FailureCause::eio,
                                         FailureCause::timeout, FailureCause::disconnected, FailureCause::other};
  auto op_label = [](Operation op) { return Label{"op", std::string(name_of(op))}; };
  Exposition out;

  out.family("tmsdisk_build_info", "gauge", "tmsdiskd's version, as the label version; the value is always 1.");
  out.sample("tmsdisk_build_info", std::vector<Label>{{"version", version_}}, uint64_t{1});
  out.family("tmsdisk_start_time_seconds", "gauge", "When tmsdiskd started, in seconds since the Unix epoch.");
  out.sample("tmsdisk_start_time_seconds", {}, start_time_seconds_);

  for (Operation op : kAllOps) {
    const std::string name = fmt::format("tmsdisk_{}s_total", name_of(op));
    out.family(
        name, "counter",
        fmt::format("{} the daemon asked of ranks (tmsctl {}), one per rank, by result: ok, failed, or no_op "
                    "(nothing to {}). A process's own {}s (tmsdisk_{}()) are not counted.",
                    op == Operation::pause ? "Pauses" : "Resumes", name_of(op), name_of(op), name_of(op), name_of(op)));
    for (OperationResult r : kAllResults)
      out.sample(name, std::vector<Label>{{"result", std::string(name_of(r))}},
                 results_[static_cast<std::size_t>(op)][static_cast<std::size_t>(r)]);
  }

  out.family("tmsdisk_operation_failures_total", "counter",
             "Failed pauses and resumes by cause: enospc (no disk space or quota), enomem (no memory, e.g. the GPU's "
             "taken by another process), eio (I/O error, checksum mismatch, chunk missing), timeout, disconnected (the "
             "rank's connection dropped before it answered), other.");
  for (Operation op : kAllOps)
    for (FailureCause c : kAllCauses)
      out.sample("tmsdisk_operation_failures_total",
                 std::vector<Label>{op_label(op), {"cause", std::string(name_of(c))}},
                 failures_[static_cast<std::size_t>(op)][static_cast<std::size_t>(c)]);

  out.family("tmsdisk_moved_bytes_total", "counter",
             "Bytes the daemon wrote (op=pause) or read back and verified (op=resume), by tier; every pause and resume "
             "counts, a process's own included.");
  for (Operation op : kAllOps) {
    out.sample("tmsdisk_moved_bytes_total", std::vector<Label>{op_label(op), {"tier", "disk"}},
               moved_bytes_[static_cast<std::size_t>(op)]);
    out.sample("tmsdisk_moved_bytes_total", std::vector<Label>{op_label(op), {"tier", "host"}},
               host_moved_bytes_[static_cast<std::size_t>(op)]);
  }

  out.family("tmsdisk_skipped_bytes_total", "counter",
             "Bytes a pause did not write, by reason: zero (chunks whose bytes are all zero, counted when reserved: "
             "they take no disk space) or unchanged (the rank's file already held those very bytes); every pause "
             "counts, a process's own included.");
  out.sample("tmsdisk_skipped_bytes_total", std::vector<Label>{op_label(Operation::pause), {"reason", "zero"}},
             skipped_bytes_[static_cast<std::size_t>(SkipReason::zero)]);
  out.sample("tmsdisk_skipped_bytes_total", std::vector<Label>{op_label(Operation::pause), {"reason", "unchanged"}},
             skipped_bytes_[static_cast<std::size_t>(SkipReason::unchanged)]);

  out.family("tmsdisk_operation_duration_seconds", "histogram",
             "Duration of the pauses and resumes that succeeded (no-ops left out), as each rank measured it.");
  for (Operation op : kAllOps)
    durations_[static_cast<std::size_t>(op)].write(out, "tmsdisk_operation_duration_seconds",
                                                   std::vector<Label>{op_label(op)});

  out.family("tmsdisk_sessions", "gauge",
             "Rank sessions: connected, or orphaned (connection lost while its files hold the rank's only copy of "
             "paused memory; kept until it reconnects or exits).");
  out.sample("tmsdisk_sessions", std::vector<Label>{{"state", "connected"}}, now.sessions_connected);
  out.sample("tmsdisk_sessions", std::vector<Label>{{"state", "orphaned"}}, now.sessions_orphaned);

  out.family("tmsdisk_staging_bytes", "gauge", "Pinned staging memory the daemon holds for its sessions.");
  out.sample("tmsdisk_staging_bytes", {}, now.staging_bytes);

  out.family("tmsdisk_disk_bytes", "gauge",
             "Bytes allocated in the pause files of the ranks the daemon serves (connected and orphaned), per root.");
  for (const auto& [root, bytes] : now.disk_bytes)
    out.sample("tmsdisk_disk_bytes", std::vector<Label>{{"root", root}}, bytes);

  out.family("tmsdisk_objects", "gauge",
             "Objects in the ranks' stores of named objects (a streamed optimizer's state), apart from their pauses.");
  out.sample("tmsdisk_objects", {}, now.objects);
  out.family("tmsdisk_object_bytes", "gauge", "Bytes those objects hold in the ranks' files, on all roots.");
  out.sample("tmsdisk_object_bytes", {}, now.object_bytes);

  out.family("tmsdisk_host_tier_bytes", "gauge",
             "The node's host-memory tier: its budget (host-tier-mb), what ranks hold of it now, the part of "
             "that ranks kept after resuming, for their next pause, and the part their objects live in.");
  out.sample("tmsdisk_host_tier_bytes", std::vector<Label>{{"kind", "budget"}}, now.host_tier_budget_bytes);
  out.sample("tmsdisk_host_tier_bytes", std::vector<Label>{{"kind", "used"}}, now.host_tier_used_bytes);
  out.sample("tmsdisk_host_tier_bytes", std::vector<Label>{{"kind", "kept"}}, now.host_tier_kept_bytes);
  out.sample("tmsdisk_host_tier_bytes", std::vector<Label>{{"kind", "objects"}}, now.host_tier_object_bytes);
  return out.text();
}

// ------------------------------------------------------------------------------------------------
// The file

MetricsFile::MetricsFile(std::string path) : path_(std::move(path)) {
  const std::filesystem::path target(path_);
  dir_path_ = target.has_parent_path() ? target.parent_path().string() : ".";
  name_ = target.filename().string();
  // Opened now, before anyone could swap it; a directory made later is opened by the first write
  // that finds it (whose failures are logged there).
  (void)open_dir();
}

std::string MetricsFile::open_dir() {
  // O_NOFOLLOW on the last component: a link there is refused, never followed (O_PATH|O_DIRECTORY
  // fails on one with ENOTDIR or ELOOP). The components above are the administrator's.
  const int fd = ::open(dir_path_.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    dir_.reset(fd);
    return {};
  }
  const int err = errno;
  struct stat st {};
  if (::lstat(dir_path_.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    return fmt::format(
        "its directory {} is a symbolic link, which tmsdiskd does not follow (whoever may write the "
        "directory above it could point it at any file root can write): name the directory itself",
        dir_path_);
  }
  return fmt::format("cannot open its directory {}: {}", dir_path_, std::strerror(err));
}

bool MetricsFile::write(std::string_view text) {
  auto fail = [&](const std::string& what) {
    // Logged once per distinct error: a directory that is missing or read-only says so once, not every
    // 15 s. The text names the directory, never the temp file, whose name differs each time.
    if (what != last_error_) {
      spdlog::warn(
          "metrics: cannot write {}: {}; the daemon goes on without it (create the directory, or under systemd "
          "allow it with ReadWritePaths=, see tmsdiskd(8))",
          path_, what);
      last_error_ = what;
    }
    return false;
  };
  if (!dir_) {
    if (std::string why = open_dir(); !why.empty()) return fail(why);
  }
  // Hidden and without the .prom suffix: the textfile collector reads only *.prom, never a half-written file.
  // Built by appending: GCC 12 at -O3 misreads `"." + string` as an overlapping memcpy (-Wrestrict).
  std::string temp = ".";
  temp += name_;
  temp += ".XXXXXX";
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    unsigned char bytes[6] = {};
    if (::getrandom(bytes, sizeof bytes, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof bytes)) {
      // No entropy yet this early in boot: unique enough with O_EXCL and the retries.
      const auto mix = static_cast<uint64_t>(::getpid()) * 1000003u +
                       static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) +
                       static_cast<uint64_t>(attempt);
      for (std::size_t i = 0; i < sizeof bytes; ++i) bytes[i] = static_cast<unsigned char>(mix >> (8 * i));
    }
    for (std::size_t i = 0; i < sizeof bytes; ++i)
      temp[temp.size() - sizeof bytes + i] = kAlphabet[bytes[i] % (sizeof kAlphabet - 1)];
    // O_EXCL|O_NOFOLLOW: a name someone planted in the directory, link or not, is never written through.
    fd = ::openat(dir_.get(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int err = errno;
    // A directory removed since it was opened takes no more files: the next write opens whatever
    // directory then has its name (a link there refused as at the start).
    struct stat st {};
    if (::fstat(dir_.get(), &st) == 0 && st.st_nlink == 0) dir_.reset();
    return fail(fmt::format("cannot create a temp file in {}: {}", dir_path_, std::strerror(err)));
  }
  auto discard = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlinkat(dir_.get(), temp.c_str(), 0);
    return fail(fmt::format("{}: {}", what, std::strerror(err)));
  };
  // node-exporter runs as its own user: the file must be readable by others (the umask may have narrowed it).
  if (::fchmod(fd, 0644) != 0) return discard("cannot make the temp file readable");
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return discard(fmt::format("cannot write a temp file in {}", dir_path_));
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlinkat(dir_.get(), temp.c_str(), 0);
    return fail(fmt::format("cannot write a temp file in {}: {}", dir_path_, std::strerror(err)));
  }
  if (::renameat(dir_.get(), temp.c_str(), dir_.get(), name_.c_str()) != 0) {
    const int err = errno;
    ::unlinkat(dir_.get(), temp.c_str(), 0);
    return fail(fmt::format("cannot rename a temp file over it: {}", std::strerror(err)));
  }
  if (!last_error_.empty()) {
    spdlog::info("metrics: {} is written again", path_);
    last_error_.clear();
  }
  return true;
}

void MetricsFile::remove() {
  // Only from the directory written to: nothing was written if it was never opened.
  if (!dir_) return;
  if (::unlinkat(dir_.get(), name_.c_str(), 0) != 0 && errno != ENOENT)
    spdlog::warn("metrics: cannot remove {} on stopping: {}", path_, std::strerror(errno));
}

MetricsExporter::MetricsExporter(const Config& config, SessionTable& sessions, const storage::Roots& roots)
    : metrics_(TMSDISK_VERSION, std::chrono::system_clock::now()),
      sessions_(sessions),
      roots_(roots),
      interval_(config.metrics_interval_s) {
  if (config.metrics_file.empty()) return;
  // Absolute, so that messages name the file a reader can find whatever the daemon's working directory.
  std::error_code ec;
  const std::filesystem::path path = std::filesystem::absolute(config.metrics_file, ec);
  file_ = std::make_unique<MetricsFile>(ec ? config.metrics_file : path.string());
  // After each operation, before its result goes on to tmsctl: whoever saw the result finds it counted.
  metrics_.on_recorded([this] { write_now(); });
  write_now();
}

MetricsExporter::~MetricsExporter() {
  if (file_) file_->remove();
}

int MetricsExporter::write_if_due() {
  if (!file_) return -1;
  const auto now = Clock::now();
  if (now >= next_write_) write_now();
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next_write_ - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(left, 0)) + 1;
}

void MetricsExporter::write_now() {
  next_write_ = Clock::now() + interval_;
  try {
    file_->write(metrics_.format(take_snapshot(sessions_, roots_)));
  } catch (const std::exception& e) {
    // Out of memory formatting a few KB: the metrics wait for the next turn, the daemon goes on.
    spdlog::warn("metrics: cannot format them: {}", e.what());
  }
}

}  // namespace tmsdisk::server
