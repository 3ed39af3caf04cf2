// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's settings table (options.h), and the two ways in: the config file, read with toml++, and
// the command line, read with CLI11. Both store values through the same table and the same checks,
// so an option and its key accept the same values and are refused with the same words.
#include "options.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <ostream>
#include <sstream>
#include <type_traits>
#include <utility>

// toml++ is used header-only (TOML_HEADER_ONLY, daemon/CMakeLists.txt): tmsdiskd is copied to GPU
// nodes that do not have libtomlplusplus.so.
#include <toml++/toml.h>

#include "tmsdisk/common/edit_distance.h"

namespace tmsdisk {

// The table stores ids, counts and seconds as uint32_t; these are the same type on Linux.
static_assert(std::is_same_v<uid_t, uint32_t> && std::is_same_v<gid_t, uint32_t> && std::is_same_v<unsigned, uint32_t>);

namespace {

constexpr std::string_view kLogLevels[] = {"trace", "debug", "info", "warn", "error"};
constexpr int64_t kMaxBudgetMiB = int64_t{1} << 20;  // 1 TiB of staging for one rank
constexpr int64_t kMaxLimitMiB = int64_t{1} << 30;   // far beyond any node's RAM, far from overflow in bytes
constexpr int64_t kMaxCount = 1'000'000;
constexpr int64_t kMaxId = 4294967294;  // (uid_t)-1 means "no id" to the kernel, never a user

// Renamed so that each quantity has one name (the staging budget; the chunk): an old spelling, on the
// command line or as a key, is refused with its new name rather than ignored, which would run the
// daemon with the built-in value.
constexpr std::pair<std::string_view, std::string_view> kRenamed[] = {
    {"staging-mb", "staging-budget-mb"}, {"max-staging-mb", "max-staging-budget-mb"}, {"slot-mb", "chunk-mb"}};

using Target = SettingTarget;
constexpr Setting kSettings[] = {
    {.name = "config",
     .value_name = "FILE",
     .target = [](DaemonOptions& o) -> Target { return &o.config_file; },
     .help = "TOML file whose keys are the long options without dashes (root = [\"/nvme0/tmsdisk\"]); the "
             "command line wins over it. The default file may be absent; a file named here must exist",
     .command_line_only = true},
    {.name = "check-config",
     .target = [](DaemonOptions& o) -> Target { return &o.check_config; },
     .help = "check the config file together with the command line, print the effective settings and exit "
             "(0: valid, 2: not); starts nothing",
     .command_line_only = true},
    {.name = "root",
     .value_name = "DIR",
     .target = [](DaemonOptions& o) -> Target { return &o.config.roots; },
     .help = "storage root directory, one per NVMe (chunks stripe across them)"},
    {.name = "socket",
     .value_name = "PATH",
     .target = [](DaemonOptions& o) -> Target { return &o.config.socket_path; },
     .help = "Unix socket ranks and tmsctl connect to; a missing directory for it is created (one level, "
             "mode 0755)"},
    {.name = "staging-budget-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.staging_budget_bytes; },
     .help = "default staging budget per rank (pinned host memory); at least 2 x chunk-mb",
     .min = 2,
     .max = kMaxBudgetMiB,
     .unit = "MiB"},
    {.name = "max-staging-budget-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_staging_budget_bytes; },
     .help = "largest staging budget a rank may ask for (TMS_DISK_BACKUP_CHUNK_MB); at least staging-budget-mb",
     .min = 2,
     .max = kMaxBudgetMiB,
     .unit = "MiB"},
    {.name = "max-staging-per-uid-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_staging_per_uid_bytes; },
     .help = "pinned staging all sessions of one user may hold together (root: unlimited)",
     .min = 0,
     .max = kMaxLimitMiB,
     .unit = "MiB"},
    {.name = "max-total-staging-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_total_staging_bytes; },
     .help = "pinned staging of all sessions together",
     .min = 2,
     .max = kMaxLimitMiB,
     .unit = "MiB"},
    {.name = "max-sessions-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_sessions_per_uid; },
     .help = "sessions (ranks) one user may hold (root: unlimited)",
     .min = 0,
     .max = kMaxCount},
    {.name = "max-connections-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_connections_per_uid; },
     .help = "connections one user may have open to the daemon: each rank and each running tmsctl holds one, "
             "and one of the daemon's file descriptors (root: unlimited)",
     .min = 1,
     .max = kMaxCount},
    {.name = "max-unread-replies-mb-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_unread_replies_bytes_per_uid; },
     .help = "replies the daemon keeps for one user's connections that do not read them; a connection whose "
             "reply does not fit is closed (root: unlimited)",
     .min = 1,
     .max = kMaxLimitMiB,
     .unit = "MiB"},
    {.name = "max-blobs-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_blobs_per_uid; },
     .help = "allocations all ranks of one user may have reserved for pausing, and, separately, in "
             "reservations being sent; each costs the daemon about 300 bytes (root: unlimited)",
     .min = 1,
     .max = kMaxCount * 4},
    {.name = "max-chunks-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_chunks_per_uid; },
     .help = "chunks all ranks of one user may have reserved for pausing, zero chunks included (they take no "
             "disk space, so disk space no longer bounds them), and, separately, in reservations being sent; each "
             "costs the daemon about 24 bytes (root: unlimited)",
     .min = 1,
     .max = kMaxCount * 1000},
    {.name = "max-ipc-exports-per-uid",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_ipc_exports_per_uid; },
     .help = "allocations one user may share through legacy CUDA IPC at once; each holds one of the daemon's "
             "file descriptors (root: unlimited)",
     .min = 0,
     .max = kMaxCount},
    {.name = "max-ipc-exports",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.max_ipc_exports; },
     .help = "legacy CUDA IPC exports of all users together (keep well below the descriptor limit)",
     .min = 0,
     .max = kMaxCount},
    {.name = "host-tier-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.host_tier_bytes; },
     .help = "host memory of the whole node that pausing ranks use before the disk (the host tier; default 0: "
             "off). Each rank gets at most this divided by the ranks on the node, and never what the node cannot "
             "spare at pause time (MemAvailable less 5% of memory and 1 GiB, the daemon's cgroup limit): the rest "
             "goes to disk",
     .min = 0,
     .max = kMaxLimitMiB,
     .unit = "MiB"},
    {.name = "host-tier-keep",
     .target = [](DaemonOptions& o) -> Target { return &o.config.host_tier_keep; },
     .help = "a rank that resumed keeps its host-tier memory, mapped and pinned, for its next pause, which then "
             "only copies (default on; making and pinning memory takes seconds per few GiB). It still counts "
             "against host-tier-mb and is taken back when another rank's pause needs it or the node runs short "
             "of memory (--host-tier-keep=false: every resume gives it back)"},
    {.name = "host-tier-ahead",
     .target = [](DaemonOptions& o) -> Target { return &o.config.host_tier_ahead; },
     .help = "with host-tier-keep, a rank whose GPU memory has stopped growing gets its host-tier memory before "
             "its first pause, made and pinned while it runs, so that even that pause only copies (default on). "
             "Only what is free is given (nobody's memory is taken back for it) and it is taken back as kept "
             "memory is (--host-tier-ahead=false: made at the first pause)"},
    {.name = "chunk-mb",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.chunk_bytes; },
     .help = "chunk size (bytes per request and per checksum)",
     .min = 1,
     .max = 64,
     .unit = "MiB"},
    {.name = "allow-uid",
     .value_name = "UID",
     .target = [](DaemonOptions& o) -> Target { return &o.config.allowed_uids; },
     .help = "uid allowed to connect (default: everyone; root always)",
     .min = 0,
     .max = kMaxId},
    {.name = "allow-gid",
     .value_name = "GID",
     .target = [](DaemonOptions& o) -> Target { return &o.config.allowed_gids; },
     .help = "group whose members may connect",
     .min = 0,
     .max = kMaxId},
    {.name = "allow-tmpfs",
     .target = [](DaemonOptions& o) -> Target { return &o.config.allow_tmpfs; },
     .help = "accept tmpfs/ramfs roots (data would stay in RAM; for tests)"},
    {.name = "sweep-interval",
     .value_name = "S",
     .target = [](DaemonOptions& o) -> Target { return &o.config.sweep_interval_s; },
     .help = "seconds between sweeps for dead ranks' files (0: startup only)",
     .min = 0,
     .max = 86400,
     .unit = "s"},
    {.name = "queue-depth",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.queue_depth; },
     .help = "io_uring submission queue entries",
     .min = 1,
     .max = 4096},
    {.name = "hash-threads",
     .value_name = "N",
     .target = [](DaemonOptions& o) -> Target { return &o.config.hash_threads; },
     .help = "threads that hash chunks (XXH3-128) side by side: those of WRITEs, to find the ones unchanged since "
             "the last pause, and those of READs, to verify them (0: one per two CPUs the daemon may run on, at "
             "least 2, at most 8)",
     .min = 0,
     .max = 64},
    {.name = "metrics-file",
     .value_name = "PATH",
     .target = [](DaemonOptions& o) -> Target { return &o.config.metrics_file; },
     .help = "Prometheus metrics for node-exporter's textfile collector, e.g. "
             "/var/lib/node_exporter/textfile_collector/tmsdisk.prom: written atomically every metrics-interval-s "
             "and after each pause or resume, removed on stopping (default: none)",
     .may_be_empty = true},
    {.name = "metrics-interval-s",
     .value_name = "S",
     .target = [](DaemonOptions& o) -> Target { return &o.config.metrics_interval_s; },
     .help = "seconds between writes of metrics-file (it is also written after each pause or resume)",
     .min = 1,
     .max = 3600,
     .unit = "s"},
    {.name = "private",
     .target = [](DaemonOptions& o) -> Target { return &o.private_mode; },
     .help = "run as this user's private daemon (what `tmsctl run` and the shim start when no daemon answers): "
             "socket under $XDG_RUNTIME_DIR/tmsdisk, root $TMS_DISK_BACKUP_DIR, else $SCRATCH/tmsdisk-<uid>, else "
             "/var/tmp/tmsdisk-<uid>; logs to tmsdiskd.log beside the socket; exits when idle (as --exit-when-idle)",
     .command_line_only = true},
    {.name = "exit-when-idle",
     .target = [](DaemonOptions& o) -> Target { return &o.config.exit_when_idle; },
     .help = "exit after the last session ends, or when no session has come within idle-exit-s of the start "
             "(private per-user daemon)"},
    {.name = "idle-exit-s",
     .value_name = "S",
     .target = [](DaemonOptions& o) -> Target { return &o.config.idle_exit_s; },
     .help = "with exit-when-idle (or --private): seconds after the start to wait for a first session before "
             "exiting; ignored otherwise",
     .min = 1,
     .max = 86400,
     .unit = "s"},
    {.name = "detach",
     .target = [](DaemonOptions& o) -> Target { return &o.detach; },
     .help = "fork into the background (how the shim and tmsctl start a private daemon)",
     .command_line_only = true},
    {.name = "log-level",
     .value_name = "LEVEL",
     .target = [](DaemonOptions& o) -> Target { return &o.log_level; },
     .help = "how much to log",
     .choices = kLogLevels},
};

template <class T>
constexpr bool kIsList = std::is_same_v<T, std::vector<std::string>> || std::is_same_v<T, std::vector<uint32_t>>;

template <class T>
constexpr bool kIsInteger =
    std::is_same_v<T, uint64_t> || std::is_same_v<T, uint32_t> || std::is_same_v<T, std::vector<uint32_t>>;

// A setting given in MiB is held in bytes (Config's *_bytes): converted here, where it is read and
// shown, and nowhere else.
uint64_t bytes_per_unit(const Setting& s) {
  return s.unit == "MiB" ? server::kMiB : 1;
}

bool is_list(const Setting& s) {
  DaemonOptions scratch;
  return std::visit([](auto* t) { return kIsList<std::remove_pointer_t<decltype(t)>>; }, s.target(scratch));
}
bool is_flag(const Setting& s) {
  DaemonOptions scratch;
  return std::holds_alternative<bool*>(s.target(scratch));
}
bool is_integer(const Setting& s) {
  DaemonOptions scratch;
  return std::visit([](auto* t) { return kIsInteger<std::remove_pointer_t<decltype(t)>>; }, s.target(scratch));
}

// One value as given, before it is checked: a TOML integer, boolean or string, a command-line word
// read as the setting's kind, or anything else (a float, a date, a table, a word that is no
// integer), which no setting accepts.
using Element = std::variant<std::monostate, int64_t, bool, std::string>;

// Stores `elements` (exactly one for a setting that is not a list) into the setting's place in `o`.
// Returns false, leaving `o` as it was, when one is of the wrong kind or outside the allowed values.
bool store(const Setting& s, const std::vector<Element>& elements, DaemonOptions& o) {
  auto integer = [&](const Element& e) -> std::optional<int64_t> {
    const auto* v = std::get_if<int64_t>(&e);
    if (!v || *v < s.min || *v > s.max) return std::nullopt;
    return *v;
  };
  auto text = [&](const Element& e) -> std::optional<std::string> {
    const auto* v = std::get_if<std::string>(&e);
    if (!v || (v->empty() && !s.may_be_empty)) return std::nullopt;
    if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(), *v) == s.choices.end()) return std::nullopt;
    return *v;
  };
  return std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (kIsList<T>) {
          T all;
          for (const Element& e : elements) {
            if constexpr (std::is_same_v<T, std::vector<std::string>>) {
              auto v = text(e);
              if (!v) return false;
              all.push_back(std::move(*v));
            } else {
              auto v = integer(e);
              if (!v) return false;
              all.push_back(static_cast<uint32_t>(*v));
            }
          }
          *target = std::move(all);
          return true;
        } else {
          if (elements.size() != 1) return false;
          if constexpr (std::is_same_v<T, bool>) {
            const auto* v = std::get_if<bool>(&elements[0]);
            if (!v) return false;
            *target = *v;
          } else if constexpr (std::is_same_v<T, std::string>) {
            auto v = text(elements[0]);
            if (!v) return false;
            *target = std::move(*v);
          } else {
            auto v = integer(elements[0]);
            if (!v) return false;
            *target = static_cast<T>(static_cast<uint64_t>(*v) * bytes_per_unit(s));
          }
          return true;
        }
      },
      s.target(o));
}

// A command-line word as the setting reads it: an integer setting takes the whole word as a decimal
// integer ("64", not "64M" or " 64"); anything else takes the word as it is.
Element element_of(const Setting& s, const std::string& word) {
  if (!is_integer(s)) return word;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
  if (ec != std::errc() || end != word.data() + word.size()) return std::monostate{};
  return v;
}

Element element_of(const toml::node& n) {
  if (const auto* v = n.as_integer()) return v->get();
  if (const auto* v = n.as_boolean()) return v->get();
  if (const auto* v = n.as_string()) return v->get();
  return std::monostate{};
}

// A value as TOML writes it (double-quoted strings, as the example config and the man page do).
std::string toml_text(const toml::node& n) {
  std::ostringstream os;
  os << toml::toml_formatter{n, toml::format_flags::allow_unicode_strings};
  return os.str();
}

// A setting's value in `o`, as a config file would write it.
std::string toml_value(const Setting& s, DaemonOptions& o) {
  return std::visit(
      [&s](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return *v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return toml_text(toml::value<std::string>(*v));
        } else if constexpr (kIsList<T>) {
          toml::array a;
          for (const auto& e : *v) {
            if constexpr (std::is_same_v<T, std::vector<std::string>>) {
              a.push_back(e);
            } else {
              a.push_back(int64_t{e});
            }
          }
          return toml_text(a);
        } else {
          return std::to_string(*v / bytes_per_unit(s));
        }
      },
      s.target(o));
}

// The default --help shows (N=256); empty for flags and lists, whose default is "not given".
std::string shown_default(const Setting& s, DaemonOptions& defaults) {
  return std::visit(
      [&s](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool> || kIsList<T>) {
          return "";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return *v;
        } else {
          return std::to_string(*v / bytes_per_unit(s));
        }
      },
      s.target(defaults));
}

std::string joined(std::span<const std::string_view> words, std::string_view quote) {
  std::string out;
  for (const auto& w : words) out += fmt::format("{}{}{}{}", out.empty() ? "" : ", ", quote, w, quote);
  return out;
}

std::string valid_keys() {
  std::string out;
  for (const Setting& s : kSettings)
    if (!s.command_line_only) out += fmt::format("{}{}", out.empty() ? "" : ", ", s.name);
  return out;
}

int read_whole_file(const std::string& path, std::string& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return err;
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return 0;
}

// CLI11's own words name the option ("--root: 1 required DIR missing", "Could not convert: --private =
// maybe"); they are replaced with the option's form when the option is one of ours.
std::string describe_parse_error(const CLI::ParseError& e) {
  const std::string what = e.what();
  for (auto at = what.find("--"); at != std::string::npos; at = what.find("--", at + 2)) {
    const auto end = what.find_first_of(" :=", at);
    const Setting* s =
        find_setting(std::string_view(what).substr(at + 2, end == std::string::npos ? end : end - at - 2));
    if (!s) continue;
    // "--host-tier-keep=maybe": CLI11 reads a flag's value as a boolean and could not.
    if (s->value_name.empty() && dynamic_cast<const CLI::ConversionError*>(&e)) {
      const auto eq = what.find(" = ", at);
      const std::string value = eq == std::string::npos ? std::string() : what.substr(eq + 3);
      return fmt::format("--{}={}: expected true or false (also yes/no, on/off, 1/0); --{} alone means true", s->name,
                         value, s->name);
    }
    if (s->value_name.empty())
      return fmt::format("--{} is a flag: give it alone (--{}), without a value", s->name, s->name);
    return fmt::format("--{} needs a value (--{} {}): expected {}", s->name, s->name, s->value_name,
                       expected_form(*s, Source::command_line));
  }
  return what + " (tmsdiskd --help lists the options)";
}

std::string describe_unexpected(const std::string& word) {
  if (word.empty() || word[0] != '-')
    return fmt::format("unexpected argument \"{}\": tmsdiskd takes options only (tmsdiskd --help lists them)", word);
  const std::string name = word.substr(0, word.find('='));
  return fmt::format("unknown option {}{}", name, hint_for_unknown(name, Source::command_line));
}

constexpr const char* kDescription =
    "tmsdiskd: the tmsdisk node daemon. Owns the NVMe directories where paused GPU memory is kept, the\n"
    "staging buffers shared with each rank, and the file I/O (io_uring, O_DIRECT). Ranks started with\n"
    "`tmsctl run` (or LD_PRELOAD=libtmsdisk.so) connect to it; `tmsctl pause/resume/status` drive it.";
constexpr const char* kFooter =
    "Every option but --config, --check-config, --private and --detach may also be a key of the config file\n"
    "(TOML; `tmsdiskd --check-config` checks it). Exit status: 0 done; 1 a runtime failure; 2 a usage or\n"
    "config error (nothing was started); 3 another tmsdiskd already serves the socket. See tmsdiskd(8).";

}  // namespace

std::span<const Setting> daemon_settings() {
  return kSettings;
}

const Setting* find_setting(std::string_view name) {
  for (const Setting& s : kSettings)
    if (s.name == name) return &s;
  return nullptr;
}

std::string expected_form(const Setting& s, Source source) {
  const bool file = source == Source::config_file;
  const std::string unit = s.unit.empty() ? "" : fmt::format(" ({})", s.unit);
  DaemonOptions scratch;
  return std::visit(
      [&](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return file ? "true or false" : "no value";
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!s.choices.empty()) return "one of " + joined(s.choices, file ? "\"" : "");
          if (s.may_be_empty) return file ? "a path, as a string in double quotes (\"\": none)" : "a path";
          return file ? "a path, as a string in double quotes" : "a path";
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return file ? fmt::format("an array of paths, e.g. {} = [\"/nvme0/tmsdisk\", \"/nvme1/tmsdisk\"]", s.name)
                      : fmt::format("a path (repeat --{} for more)", s.name);
        } else if constexpr (std::is_same_v<T, std::vector<uint32_t>>) {
          return file ? fmt::format("an array of integers from {} to {}, e.g. {} = [1000, 1001]", s.min, s.max, s.name)
                      : fmt::format("an integer from {} to {} (repeat --{} for more)", s.min, s.max, s.name);
        } else {
          return fmt::format("an integer from {} to {}{}", s.min, s.max, unit);
        }
      },
      s.target(scratch));
}

std::string hint_for_unknown(std::string_view name, Source source) {
  const std::string dashes = source == Source::command_line ? "--" : "";
  // Case, underscores and dashes in front are what people get wrong most: compare without them.
  std::string wanted(name.substr(std::min(name.find_first_not_of('-'), name.size())));
  for (char& c : wanted) c = c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::string value_form = source == Source::command_line ? " " : " = ";
  for (const auto& [old_name, new_name] : kRenamed) {
    if (wanted != old_name) continue;
    const Setting* s = find_setting(new_name);
    if (name == dashes + std::string(old_name))
      return fmt::format(": renamed, use {}{}{}{}", dashes, new_name, value_form, s->value_name);
    return fmt::format(": did you mean {}{}? ({}{} was renamed)", dashes, new_name, dashes, old_name);
  }
  const Setting* best = nullptr;
  std::size_t best_distance = SIZE_MAX;
  for (const Setting& s : kSettings) {
    if (source == Source::config_file && s.command_line_only) continue;
    // A name cut short or run on ("staging-budget" for "staging-budget-mb") counts as close.
    const bool prefix = std::min(wanted.size(), s.name.size()) >= 4 &&
                        (s.name.starts_with(wanted) || std::string_view(wanted).starts_with(s.name));
    const std::size_t d = prefix ? 0 : edit_distance(wanted, s.name);
    if (d < best_distance) best = &s, best_distance = d;
  }
  if (best && best_distance <= std::max<std::size_t>(2, best->name.size() / 4))
    return fmt::format(": did you mean {}{}?", dashes, best->name);
  if (source == Source::command_line) return " (tmsdiskd --help lists the options)";
  return fmt::format(" (valid keys: {})", valid_keys());
}

Problems apply_config_text(std::string_view text, const std::string& file, DaemonOptions& o) {
  toml::table doc;
  try {
    doc = toml::parse(text, std::string_view(file));
  } catch (const toml::parse_error& e) {
    return {fmt::format("{}:{}:{}: {}", file, e.source().begin.line, e.source().begin.column, e.description())};
  }
  // The table iterates in key order; problems are reported in line order, as the file reads.
  std::vector<std::pair<toml::source_index, std::string>> found;
  for (auto&& [key, node] : doc) {
    const toml::source_index line = key.source().begin.line;
    const std::string where = fmt::format("{}:{}: ", file, line);
    const Setting* s = find_setting(key.str());
    if (!s) {
      found.emplace_back(line, fmt::format("{}unknown key \"{}\"{}", where, key.str(),
                                           hint_for_unknown(key.str(), Source::config_file)));
      continue;
    }
    if (s->command_line_only) {
      found.emplace_back(line, fmt::format("{}{} is a command-line option only: give --{} to tmsdiskd, not a key",
                                           where, s->name, s->name));
      continue;
    }
    std::vector<Element> elements;
    if (const auto* array = node.as_array()) {
      for (const toml::node& e : *array) elements.push_back(element_of(e));
    } else {
      elements.push_back(element_of(node));
    }
    // A single value for a list (root = "/nvme0") is a list of one; an array for a single value is wrong.
    if ((node.is_array() && !is_list(*s)) || !store(*s, elements, o))
      found.emplace_back(line, fmt::format("{}{} = {}: expected {}", where, s->name, toml_text(node),
                                           expected_form(*s, Source::config_file)));
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Problems problems;
  for (auto& [line, message] : found) problems.push_back(std::move(message));
  return problems;
}

Problems apply_config_file(const std::string& file, bool required, DaemonOptions& o, bool* found) {
  if (found) *found = false;
  std::string text;
  if (const int err = read_whole_file(file, text); err != 0) {
    if (err == ENOENT && !required) return {};
    if (required)
      return {fmt::format("--config {}: cannot read it: {} (name an existing file, or leave out --config)", file,
                          std::strerror(err))};
    return {fmt::format("{}: cannot read the config file: {} (make it readable, or name another with --config FILE)",
                        file, std::strerror(err))};
  }
  if (found) *found = true;
  return apply_config_text(text, file, o);
}

Problems check_consistency(const DaemonOptions& o) {
  Problems problems = server::inconsistencies(o.config);
  if (!o.private_mode && o.config.roots.empty())
    problems.push_back(
        fmt::format("no storage root: pass --root DIR (once per NVMe), set root = [\"DIR\"] in {}, or use --private",
                    o.config_file));
  return problems;
}

std::string effective_settings(const DaemonOptions& options) {
  DaemonOptions o = options;  // the table hands out pointers into a mutable DaemonOptions
  std::string out;
  for (const Setting& s : kSettings)
    if (!s.command_line_only) out += fmt::format("{} = {}\n", s.name, toml_value(s, o));
  return out;
}

Invocation parse_invocation(int argc, const char* const* argv, const std::string& default_config_file,
                            std::ostream& out, std::ostream& err) {
  Invocation invocation;
  DaemonOptions& o = invocation.options;
  auto refuse = [&](const Problems& problems) {
    for (const auto& p : problems) err << "tmsdiskd: " << p << '\n';
    invocation.exit_now = kExitUsage;
    return std::move(invocation);
  };

  // What the command line gave, as words: each is read through the table after the config file, so
  // that it wins over the file and is checked exactly as the file's value would be.
  struct Given {
    CLI::Option* option = nullptr;
    std::string word;                // a single value
    std::vector<std::string> words;  // a list (--root DIR --root DIR)
    bool flag = false;
  };
  std::vector<Given> given(std::size(kSettings));
  DaemonOptions defaults;
  defaults.config_file = default_config_file;

  CLI::App app{kDescription, "tmsdiskd"};
  app.footer(kFooter);
  // Outside the settings table: it is no setting, and a config file has no use for it.
  app.set_version_flag("--version", "tmsdiskd (tmsdisk) " TMSDISK_VERSION, "print the version and exit");
  app.allow_extras();  // unknown options are reported here, with the closest name or the renamed one
  for (std::size_t i = 0; i < given.size(); ++i) {
    const Setting& s = kSettings[i];
    const std::string name = fmt::format("--{}", s.name);
    std::string help(s.help);
    if (is_list(s) || s.max > s.min || !s.choices.empty())
      help += fmt::format("; {}", expected_form(s, Source::command_line));
    if (is_flag(s)) {
      given[i].option = app.add_flag(name, given[i].flag, help);
      continue;
    }
    if (is_list(s)) {
      // One value per occurrence (--root A --root B): a stray word after it is reported, not taken as a root.
      given[i].option = app.add_option(name, given[i].words, help)->allow_extra_args(false);
    } else {
      given[i].option = app.add_option(name, given[i].word, help)
                            ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
                            ->default_str(shown_default(s, defaults));
    }
    given[i].option->type_name(std::string(s.value_name));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      app.exit(e, out, err);
      invocation.exit_now = 0;
      return invocation;
    }
    return refuse({describe_parse_error(e)});
  }
  if (const auto extra = app.remaining(); !extra.empty()) return refuse({describe_unexpected(extra.front())});

  const auto config_index = static_cast<std::size_t>(find_setting("config") - kSettings);
  const bool config_given = given[config_index].option->count() > 0;
  o.config_file = config_given ? given[config_index].word : default_config_file;
  bool config_found = false;
  Problems problems = apply_config_file(o.config_file, config_given, o, &config_found);
  for (std::size_t i = 0; i < given.size(); ++i) {
    const Setting& s = kSettings[i];
    if (given[i].option->count() == 0 || i == config_index) continue;
    if (is_flag(s)) {
      store(s, {given[i].flag}, o);
      continue;
    }
    const std::vector<std::string> words = is_list(s) ? given[i].words : std::vector<std::string>{given[i].word};
    std::vector<Element> elements;
    for (const auto& w : words) {
      // Each word is checked alone, so that the message names the one that is wrong.
      DaemonOptions scratch;
      if (!store(s, {element_of(s, w)}, scratch)) {
        problems.push_back(fmt::format("--{} {}: expected {}", s.name, w.empty() ? "\"\"" : w,
                                       expected_form(s, Source::command_line)));
        elements.clear();
        break;
      }
      elements.push_back(element_of(s, w));
    }
    if (!elements.empty()) store(s, elements, o);
  }
  if (problems.empty()) problems = check_consistency(o);
  if (!problems.empty()) return refuse(problems);

  if (o.check_config) {
    if (config_found) {
      out << "tmsdiskd: " << o.config_file << ": ok\n";
    } else {
      out << "tmsdiskd: " << o.config_file << ": absent; the defaults and the command line: ok\n";
    }
    // A TOML comment, so that the rest stays a config file. The roots are the daemon's to open (and
    // maybe create) as the user it runs as; a check here, as whoever runs it, could only mislead.
    out << "# the storage roots are not checked here but when tmsdiskd starts; `tmsctl doctor --root DIR` "
           "checks one now (filesystem, O_DIRECT, free space)\n";
    out << effective_settings(o);
    invocation.exit_now = 0;
  }
  return invocation;
}

}  // namespace tmsdisk
