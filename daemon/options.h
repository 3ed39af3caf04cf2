// SPDX-License-Identifier: Apache-2.0
// tmsdiskd's settings: one table gives each its command-line option and config-file key, its type,
// range, unit and help, so that the two cannot drift apart. main.cpp hands argv here.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "config.h"
#include "server.h"

namespace tmsdisk {

// Everything the command line and the config file decide; run_daemon() (run.h) takes it.
struct DaemonOptions {
  server::Config config;
  std::string log_level = "info";  // trace, debug, info, warn, error
  bool private_mode = false;       // this user's private daemon (settings from the environment)
  bool detach = false;             // fork into the background first
  bool check_config = false;       // validate, print the effective settings, and exit
  std::string config_file;         // the config file read (or that would have been), for messages
};

// tmsdiskd's exit statuses (man tmsdiskd, EXIT STATUS).
inline constexpr int kExitRuntimeFailure = 1;
inline constexpr int kExitUsage = 2;  // a usage or config error: nothing was started

// Where a setting lives. Integers are stored in uint64_t or uint32_t (uid_t, gid_t and unsigned are
// uint32_t on Linux); the alternative held decides how a value is read and checked.
using SettingTarget =
    std::variant<uint64_t*, uint32_t*, bool*, std::string*, std::vector<std::string>*, std::vector<uint32_t>*>;

struct Setting {
  std::string_view name{};        // the long option without its dashes, and the config-file key
  std::string_view value_name{};  // N, DIR, PATH... in --help and messages; empty for a flag
  SettingTarget (*target)(DaemonOptions&) = nullptr;
  std::string_view help{};
  int64_t min = 0, max = 0;                     // integers (and each element of a list of them)
  std::string_view unit{};                      // integers: MiB (held in bytes: the value x 2^20), s
  std::span<const std::string_view> choices{};  // text that must be one of these
  bool command_line_only = false;               // refused as a config-file key (--config, --detach...)
  bool may_be_empty = false;                    // text: "" is a value, meaning none (metrics-file)
};

// Every setting, in the order --help, --check-config and the man page list them.
std::span<const Setting> daemon_settings();
const Setting* find_setting(std::string_view name);

// Where a value was given: the forms differ (`--root DIR` once per root, `root = ["/a", "/b"]`).
enum class Source { command_line, config_file };

// What a value must look like, for --help and messages: "an integer from 2 to 1048576 (MiB)".
std::string expected_form(const Setting& setting, Source source);

// Problems found, one line each, without the "tmsdiskd: " prefix; empty when all is well.
using Problems = std::vector<std::string>;

// Applies the TOML document `text` to `options`; `file` names it in messages ("FILE:LINE: ...").
// Every key is checked: unknown ones, values of the wrong type or out of range, syntax errors.
Problems apply_config_text(std::string_view text, const std::string& file, DaemonOptions& options);

// Reads `file` and applies it. A missing file is a problem only when `required` (named with --config).
// Sets *found to whether the file existed.
Problems apply_config_file(const std::string& file, bool required, DaemonOptions& options, bool* found = nullptr);

// Settings that are valid alone but not together, named by their options: a staging budget that holds
// fewer than two chunks, one above the largest a rank may ask for, no storage root.
Problems check_consistency(const DaemonOptions& options);

// Every config-file key with its value in `options`, one `key = value` line each (valid TOML).
std::string effective_settings(const DaemonOptions& options);

// For a name that is not a setting: ": did you mean X?", the new name of a renamed one, or the list of
// valid keys. `source` decides whether names are written as options (--root) or keys (root).
std::string hint_for_unknown(std::string_view name, Source source);

// What tmsdiskd does after reading its command line and config file: run with `options`, or exit
// now with `exit_now` (--help and --check-config print to `out`; errors, one line each, to `err`).
struct Invocation {
  DaemonOptions options;
  std::optional<int> exit_now;
};
Invocation parse_invocation(int argc, const char* const* argv, const std::string& default_config_file,
                            std::ostream& out, std::ostream& err);

}  // namespace tmsdisk
