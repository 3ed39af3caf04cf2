// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's Prometheus metrics, exported through node-exporter's textfile collector: the
// daemon writes them, in the text exposition format, to --metrics-file (atomically: a temp file in the
// same directory renamed over it), every --metrics-interval-s seconds and after each pause or resume a
// rank completes. No listening port and no HTTP library on a root daemon of shared nodes; node-exporter
// is what fleets already scrape.
//
// What is counted: each pause and resume the daemon asks of a rank (tmsctl), once, when the rank
// answers or its connection drops before it does, whether or not the tmsctl that asked still waits;
// each chunk the daemon wrote or read (moved bytes, by tier), whoever asked for the pause. A pause or
// resume a process runs on itself (tmsdisk_pause(), TMSDISK_ON_TOUCH=resume) moves bytes through the
// daemon but sends it no result, so it appears in the moved bytes only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "io_engine.h"
#include "metrics_observer.h"
#include "tmsdisk/common/unique_fd.h"
#include "tmsdisk/protocol/messages.h"

namespace tmsdisk::storage {
class Roots;
}

namespace tmsdisk::server {

struct Config;
class SessionTable;

// ------------------------------------------------------------------------------------------------
// The text exposition format (version 0.0.4)

struct Label {
  std::string_view name;
  std::string value;
};

// A label value as the format writes it between double quotes: backslash, double quote and newline
// escaped (\\, \", \n), every other byte as it is.
std::string escape_label_value(std::string_view value);

// Builds one exposition: each family's # HELP and # TYPE lines, then its samples.
class Exposition {
 public:
  // `type`: counter, gauge or histogram. The help text is escaped as the format wants it (\\, \n).
  void family(std::string_view name, std::string_view type, std::string_view help);
  // One `name{labels} value` line; `name` is the family's, or with _bucket, _sum or _count.
  void sample(std::string_view name, std::span<const Label> labels, uint64_t value);
  void sample(std::string_view name, std::span<const Label> labels, double value);
  const std::string& text() const noexcept { return text_; }

 private:
  void start_sample(std::string_view name, std::span<const Label> labels);
  std::string text_;
};

// A Prometheus histogram: observations counted in the first bucket whose upper bound holds them. Its
// samples are cumulative, as the format requires: each bucket counts every observation at or below its
// bound, and the last, le="+Inf", all of them (equal to _count).
class Histogram {
 public:
  explicit Histogram(std::span<const double> upper_bounds);
  void observe(double value);
  uint64_t count() const noexcept { return count_; }
  // Its _bucket lines (`labels` plus le), then _sum and _count.
  void write(Exposition& out, std::string_view name, std::span<const Label> labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> in_bucket_;  // per bucket, not cumulative; the last one is above every bound
  double sum_ = 0;
  uint64_t count_ = 0;
};

// ------------------------------------------------------------------------------------------------
// What tmsdiskd counts

enum class Operation { pause, resume };
enum class OperationResult { ok, failed, no_op };
// Why a pause or resume failed, from the rank's errno (or the daemon's, for a rank that went away).
enum class FailureCause { enospc, enomem, eio, timeout, disconnected, other };

FailureCause failure_cause(int code) noexcept;
std::string_view name_of(Operation op) noexcept;
std::string_view name_of(OperationResult result) noexcept;
std::string_view name_of(FailureCause cause) noexcept;

// Upper bounds of the duration histogram, in seconds: a pause of a few MiB takes a tenth of a second,
// one of a whole GPU's memory over a slow disk most of an hour.
inline constexpr double kDurationBuckets[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600};

// What is true now rather than counted, taken when the file is written.
struct MetricsSnapshot {
  uint64_t sessions_connected = 0;
  uint64_t sessions_orphaned = 0;
  // Pinned staging the daemon holds mapped for its sessions.
  uint64_t staging_bytes = 0;
  // Per root: bytes allocated in the files of its ranks.
  std::vector<std::pair<std::string, uint64_t>> disk_bytes;
  uint64_t objects = 0;       // in the ranks' stores of named objects
  uint64_t object_bytes = 0;  // ... on disk
  // The node's host tier: its budget, and what sessions hold or are being granted of it.
  uint64_t host_tier_budget_bytes = 0;
  uint64_t host_tier_used_bytes = 0;
  uint64_t host_tier_kept_bytes = 0;    // of the used: kept by running ranks for their next pause
  uint64_t host_tier_object_bytes = 0;  // of the used: what ranks' objects live in
};

// Takes the snapshot from the session table: every session's staging and host tier, and its store's
// bytes on each root.
MetricsSnapshot take_snapshot(SessionTable& sessions, const storage::Roots& roots);

class Metrics final : public MetricsObserver {
 public:
  Metrics(std::string version, std::chrono::system_clock::time_point started);

  // What the control router and the chunk I/O report (metrics_observer.h).
  void command_sent(uint64_t command_id, uint64_t session_id, proto::CommandOp op) override;
  void command_answered(uint64_t command_id, const proto::CommandDone& answer) override;
  void session_lost(uint64_t session_id) override;
  void moved(io::Op op, uint64_t bytes) override;
  void skipped(SkipReason reason, uint64_t bytes) override;

  // One operation's result: its code (0, or a positive errno), duration and outcome.
  void record(Operation op, const proto::CommandDone& answer);

  // Called after every recorded operation (the exporter writes the file then).
  void on_recorded(std::function<void()> callback) { on_recorded_ = std::move(callback); }

  // Every family, every known label set included (at 0 until it happens, so that rate() sees the
  // first one), then the snapshot's gauges.
  std::string format(const MetricsSnapshot& now) const;

 private:
  struct Sent {
    uint64_t session_id = 0;
    Operation op = Operation::pause;
  };
  static constexpr std::size_t kOps = 2, kResults = 3, kCauses = 6;

  std::string version_;
  double start_time_seconds_ = 0;
  std::map<uint64_t, Sent> sent_;  // COMMANDs not counted yet, by command id
  uint64_t results_[kOps][kResults]{};
  uint64_t failures_[kOps][kCauses]{};
  uint64_t moved_bytes_[kOps]{};
  uint64_t host_moved_bytes_[kOps]{};  // as the ranks' answers report them
  uint64_t skipped_bytes_[2]{};        // by SkipReason, of pauses
  std::vector<Histogram> durations_;   // per operation, of those that succeeded
  std::function<void()> on_recorded_;
};

// ------------------------------------------------------------------------------------------------
// The file

// Writes an exposition to `path` atomically: a temp file in the same directory (named so that the
// textfile collector, which reads only *.prom, skips it), mode 0644, renamed over `path`. A failure
// is logged once per distinct error (and the recovery once), never fatal.
//
// The directory is opened once (at construction, or at the first write that finds it, if it did not
// exist yet), never through a symbolic link in its own place, and every later step (temp file,
// rename, removal on stopping) is made relative to that descriptor. Its parent may belong to another
// user (Debian's node-exporter directory lies in /var/lib/prometheus, owned by `prometheus`), who
// could otherwise swap the directory for a link between two writes and have root overwrite, then
// delete, a file of their choosing.
class MetricsFile {
 public:
  explicit MetricsFile(std::string path);
  // True when written.
  bool write(std::string_view text);
  // A clean stop: the figures of a daemon that no longer runs must not look current.
  void remove();
  const std::string& path() const noexcept { return path_; }

 private:
  // Opens dir_path_ into dir_; the reason it could not, empty when it could.
  std::string open_dir();

  std::string path_;
  std::string dir_path_;    // the directory, as named
  std::string name_;        // the file's name in it
  UniqueFd dir_;            // O_PATH handle of the directory, once opened
  std::string last_error_;  // what was last logged, empty once a write succeeds
};

// What the event loop holds: the counters, which the router and the chunk I/O report to (the server
// hands them metrics()); the file, written at once when created, after each recorded operation and
// when the interval has passed.
class MetricsExporter {
 public:
  using Clock = std::chrono::steady_clock;
  // `config` decides the file (none: counting only) and the interval. `sessions` and `roots` must
  // outlive the exporter.
  MetricsExporter(const Config& config, SessionTable& sessions, const storage::Roots& roots);
  ~MetricsExporter();
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  Metrics& metrics() noexcept { return metrics_; }
  // Writes the file if the interval has passed; returns ms until the next write is due, or -1 (no file).
  int write_if_due();

 private:
  void write_now();

  Metrics metrics_;
  SessionTable& sessions_;
  const storage::Roots& roots_;
  std::unique_ptr<MetricsFile> file_;
  std::chrono::seconds interval_;
  Clock::time_point next_write_;
};

}  // namespace tmsdisk::server
