// SPDX-License-Identifier: Apache-2.0
// tmsctl: the tmsdisk command line. Parses options and hands off to commands.cpp.
//
// Usage errors are tmsctl's own, not CLI11's: one line naming the mistake and the valid choices,
// exit status 2 (the man page's promise), and a JSON object instead when --json was asked for.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "doctor.h"
#include "tmsdisk/common/edit_distance.h"

namespace {

using namespace tmsdisk::ctl;

constexpr const char* kGlobalGroup = "Global options (before or after the command)";

// Options whose value is the next argument, wherever they appear (to find the command word).
bool takes_value(std::string_view arg) {
  for (std::string_view o : {"--socket", "--job", "--rank", "--pid", "--timeout", "--staging-budget-mb", "--min-mb",
                             "--on-touch", "--chunk-mb", "--root"})
    if (arg == o) return true;
  return false;
}

// "--a, --b, --c": the options `sub` accepts, as its --help lists them.
std::string option_list(const CLI::App& sub) {
  std::string out;
  for (const CLI::Option* o : sub.get_options()) {
    if (o->get_group().empty()) continue;  // hidden: renamed options kept only to explain the rename
    std::string name = o->get_name(false, false);
    if (name.empty() || name == "--help") continue;
    if (name.find(',') != std::string::npos) name = name.substr(name.rfind(',') + 1);
    out += (out.empty() ? "" : ", ") + name;
  }
  return out;
}

std::string command_list(const CLI::App& app) {
  std::string out;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    out += (out.empty() ? "" : ", ") + sub->get_name();
  return out;
}

// "unknown command 'staus': did you mean status? (commands: ...)": a command one or two typing
// mistakes away is named (none of tmsctl's commands is that close to another).
std::string unknown_command(const std::string& word, const CLI::App& app) {
  std::string meant;
  std::size_t best = 3;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    const std::size_t d = tmsdisk::edit_distance(word, sub->get_name());
    if (d < best) best = d, meant = sub->get_name();
  }
  return "unknown command '" + word + "'" + (meant.empty() ? "" : ": did you mean " + meant + "?") +
         " (commands: " + command_list(app) + ")";
}

// Rewrites CLI11's message into one line that names the mistake and what would be right.
std::string usage_message(const CLI::ParseError& e, const CLI::App& app, const CLI::App* sub) {
  const std::string what = e.what();
  const std::string help = sub ? "tmsctl " + sub->get_name() + " --help" : "tmsctl --help";
  const std::string_view kExtra1 = "The following argument was not expected: ";
  const std::string_view kExtraN = "The following arguments were not expected: ";
  if (what.rfind(kExtra1, 0) == 0 || what.rfind(kExtraN, 0) == 0) {
    // CLI11 lists the leftovers in no useful order ("x --jbo" for `--jbo x`): an option among them
    // is the mistake to name, its value only followed it.
    std::string args = what.substr(what.find(": ") + 2), option;
    for (std::size_t at = 0; at < args.size();) {
      std::size_t end = args.find(' ', at);
      if (end == std::string::npos) end = args.size();
      if (option.empty() && args[at] == '-') option = args.substr(at, end - at);
      at = end + 1;
    }
    if (!sub) return unknown_command(args, app);
    if (!option.empty())
      return "unknown option " + option + " for " + sub->get_name() + " (options: " + option_list(*sub) + ")";
    return "unexpected argument '" + args + "'" +
           (sub->get_name() == "run" ? " (the command goes after --: tmsctl run [options] -- CMD ARGS...)"
                                     : " (see " + help + ")");
  }
  if (dynamic_cast<const CLI::RequiredError*>(&e) && !sub)
    return "no command given (commands: " + command_list(app) + "; see tmsctl --help)";
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e)) {
    // "--job: 1 required TEXT missing": the option came last with no value.
    const std::string opt = what.substr(0, what.find(':'));
    return opt + " needs a value (see " + help + ")";
  }
  return what + " (see " + help + ")";
}

int usage_error(bool json, const std::string& where, const std::string& message) {
  print_failure(json, where, message, 0, /*usage=*/true);
  return kExitUsage;
}

// A validator for a whole number within [lo, hi], whose message names the option and the range in
// words (CLI11's own would print a double's full range for "non-negative").
CLI::Validator whole_number(long long lo, long long hi, const std::string& what) {
  return CLI::Validator(
      [lo, hi, what](std::string& s) -> std::string {
        long long v = 0;
        std::size_t used = 0;
        try {
          v = std::stoll(s, &used);
        } catch (...) {
          used = 0;
        }
        if (used == 0 || used != s.size() || v < lo || v > hi)
          return "'" + s + "' is not " + what + " (" + std::to_string(lo) + " to " + std::to_string(hi) + ")";
        return {};
      },
      what);
}

// A number of seconds within [0, max], whose message names the option's unit and range (CLI11's
// Range would print "FLOAT in [0 - 1e+06]" into --help).
CLI::Validator seconds(double max) {
  return CLI::Validator(
      [max](std::string& s) -> std::string {
        double v = -1;
        std::size_t used = 0;
        try {
          v = std::stod(s, &used);
        } catch (...) {
          used = 0;
        }
        if (used == 0 || used != s.size() || !(v >= 0 && v <= max))
          return "'" + s + "' is not a number of seconds (0 to " + std::to_string(static_cast<long long>(max)) + ")";
        return {};
      },
      "");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [choices, list](std::string& s) -> std::string {
        for (const auto& c : choices)
          if (s == c) return {};
        return "'" + s + "' is not one of " + list;
      },
      "{" + list + "}");
}

// What the command line fills in: each subcommand's options write here.
struct Inputs {
  Common common;
  Selector sel;                  // pause, resume, prefetch
  bool accept_loss = false;      // resume
  LaunchOptions launch;          // env, run
  bool no_start_daemon = false;  // run
  DoctorOptions doctor;
  std::vector<std::string> command;  // run: the words after --
};

// The subcommands, in the order --help lists them.
struct Subcommands {
  CLI::App* status = nullptr;
  CLI::App* pause = nullptr;
  CLI::App* resume = nullptr;
  CLI::App* prefetch = nullptr;
  CLI::App* gc = nullptr;
  CLI::App* env = nullptr;
  CLI::App* run = nullptr;
  CLI::App* doctor = nullptr;
  std::vector<CLI::App*> all() const { return {status, pause, resume, prefetch, gc, env, run, doctor}; }
};

// --socket, --json and --timeout are global: accepted before the command (`tmsctl --json status`)
// and after it (`tmsctl status --json`), and listed in every command's --help.
void add_global_options(CLI::App& a, Common& common) {
  a.add_option("--socket", common.socket,
               "tmsdiskd socket (default: $TMSDISK_SOCKET, else /run/tmsdisk/tmsdiskd.sock, else the private "
               "daemon's)")
      ->type_name("PATH")
      ->group(kGlobalGroup);
  a.add_flag("--json", common.json, "machine-readable output, errors included")->group(kGlobalGroup);
  a.add_option("--timeout", common.timeout_s,
               "give up after S seconds, print what answered and name what did not (exit 1); default: 30 s for "
               "the daemon's answers, and for pause/resume until the ranks send nothing for 120 s")
      ->type_name("S")
      ->check(seconds(1e6))
      ->group(kGlobalGroup);
}

// Which ranks pause and resume act on.
void add_selector_options(CLI::App& sub, Selector& sel) {
  sub.add_option("--job", sel.job, "ranks of this job (TMSDISK_JOB, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...)")
      ->type_name("JOB");
  sub.add_option("--rank", sel.rank, "only this rank")
      ->type_name("R")
      ->check(whole_number(0, INT64_MAX, "a rank number"));
  sub.add_option("--pid", sel.pid, "only this process")
      ->type_name("PID")
      ->check(whole_number(1, INT32_MAX, "a process id"));
  sub.add_flag("--all", sel.all, "every rank you may act on");
  sub.add_option("--tag", sel.tag,
                 "only the allocations carrying this tag (made inside tmsdisk.region(TAG) or between "
                 "tmsdisk_tag_push and _pop; \"untagged\": the others); a rank without it has nothing to do")
      ->type_name("TAG");
}

// How env and run launch the ranks.
void add_launch_options(CLI::App& sub, LaunchOptions& launch) {
  sub.add_option("--job", launch.job, "job name given to the ranks (TMSDISK_JOB; default: the launcher's job id)")
      ->type_name("JOB");
  sub.add_option("--staging-budget-mb", launch.staging_budget_mb,
                 "pinned host memory each rank streams through, MiB (TMS_DISK_BACKUP_CHUNK_MB; below two of the "
                 "daemon's chunks, the rank's chunks are half of it; default: the daemon's staging-budget-mb)")
      ->type_name("MIB")
      ->check(whole_number(1, 1 << 20, "a size in MiB"));
  // Its old name said "chunk", which is the unit of one request (the daemon's chunk-mb): refuse it
  // with the new one instead of guessing.
  sub.add_option_function<std::string>("--chunk-mb",
                                       [](const std::string&) {
                                         throw CLI::ValidationError(
                                             "--chunk-mb", "renamed --staging-budget-mb (pinned memory per rank)");
                                       })
      ->group("");
  sub.add_option("--min-mb", launch.min_mb,
                 "allocations below this many MiB stay native (TMSDISK_MIN_BYTES; default: the shim's, 2 MiB)")
      ->type_name("MIB")
      ->check(whole_number(0, 1 << 30, "a size in MiB"));
  sub.add_option("--on-touch", launch.on_touch,
                 "what a CUDA launch or copy does while paused: wait (until resumed), resume (automatically) "
                 "or fail (CUDA_ERROR_NOT_PERMITTED) (TMSDISK_ON_TOUCH; default: wait)")
      ->type_name("MODE")
      ->check(one_of({"wait", "resume", "fail"}));
  sub.add_flag_function(
      "--keep-torch-cache", [&launch](std::int64_t) { launch.empty_torch_cache = false; },
      "pause PyTorch's cached memory with the rest (TMSDISK_TORCH_EMPTY_CACHE=0); by default a Python start-up "
      "module put first on PYTHONPATH calls torch.cuda.empty_cache() before each pause, so that memory no tensor "
      "uses does not move");
  sub.add_flag("--stream-optimizer{fp32}", launch.stream_optimizer,
               "keep the optimizer state of torch.optim.AdamW and Adam in tmsdiskd's store and stream it through "
               "each step (tmsdisk.optim; the start-up module makes them the streamed classes, "
               "TMSDISK_STREAM_OPTIMIZER): fp32 moments (the default), bf16 moments (half the bytes), or fp8 "
               "moments (float8_e4m3fn with an fp32 scale per 128 elements, about a quarter; PyTorch 2.1 or "
               "later); masters stay fp32")
      ->type_name("DTYPE")
      ->check(one_of({"fp32", "bf16", "fp8"}));
  sub.add_flag("--tms-compat", launch.tms_compat,
               "make `import torch_memory_saver` load tmsdisk's compatibility module (its directory first on "
               "PYTHONPATH): programs written for torch_memory_saver pause and resume through tmsdisk, its TMS_* "
               "variables read as torch_memory_saver reads them, and PyTorch's cache kept as it keeps it "
               "(implies --keep-torch-cache)");
}

// Each subcommand with its own options, then the global ones (add_global_options).

CLI::App* add_status(CLI::App& app, Inputs&) {
  return app.add_subcommand("status", "list ranks: state, resident, paused and unmanaged bytes, last pause/resume");
}

CLI::App* add_pause(CLI::App& app, Inputs& in) {
  auto* pause = app.add_subcommand("pause", "write the selected ranks' GPU memory to disk and release it");
  add_selector_options(*pause, in.sel);
  return pause;
}

CLI::App* add_resume(CLI::App& app, Inputs& in) {
  auto* resume = app.add_subcommand("resume", "restore the selected ranks' GPU memory at the same addresses");
  add_selector_options(*resume, in.sel);
  // Resume only: a pause has nothing to lose.
  resume->add_flag("--accept-loss", in.accept_loss,
                   "allocations whose backup is damaged (see status) get zero-filled memory at their addresses: "
                   "their data is LOST; without it they stay paused and the rest of the process runs");
  return resume;
}

CLI::App* add_prefetch(CLI::App& app, Inputs& in) {
  auto* prefetch = app.add_subcommand(
      "prefetch",
      "start reading the selected ranks' paused memory from disk into the node's host tier, ahead of their "
      "resume (which then copies that part from memory); answered once started, it goes on in the background, "
      "and a pause or resume that comes meanwhile goes first and uses what was read");
  add_selector_options(*prefetch, in.sel);
  return prefetch;
}

CLI::App* add_gc(CLI::App& app, Inputs&) {
  return app.add_subcommand("gc", "remove files left by ranks that no longer run");
}

CLI::App* add_env(CLI::App& app, Inputs& in) {
  auto* env =
      app.add_subcommand("env", "print the environment a launch needs (LD_PRELOAD, TMSDISK_*, TMS_DISK_BACKUP_*)");
  add_launch_options(*env, in.launch);
  return env;
}

CLI::App* add_run(CLI::App& app, Inputs& in) {
  auto* run = app.add_subcommand(
      "run",
      "run a command with the shim preloaded (torchrun's children inherit it): tmsctl run [options] -- CMD ARGS...");
  add_launch_options(*run, in.launch);
  run->add_flag("--no-start-daemon", in.no_start_daemon, "fail instead of starting a private daemon when none answers");
  return run;
}

CLI::App* add_doctor(CLI::App& app, Inputs& in) {
  auto* doctor = app.add_subcommand(
      "doctor",
      "check this node before enabling the service: storage roots, io_uring, memlock, the CUDA driver and its VMM "
      "support, the systemd socket, the daemon; each problem comes with what to do");
  doctor
      ->add_option("--root", in.doctor.roots,
                   "a storage root to check; repeat for each (default: the daemon's "
                   "first root)")
      ->type_name("DIR");
  doctor->footer(
      "Checks, one line each (ok, warn or FAIL, what was looked at, and for a problem what to do):\n"
      "  daemon    tmsdiskd answers at the socket, and its version\n"
      "  systemd   tmsdiskd.socket installed, enabled and listening\n"
      "  driver    libcuda.so.1 loads and initializes; each device's memory, and its virtual memory\n"
      "            management (without it the shim cannot pause anything on that device)\n"
      "  root      not on tmpfs, ramfs or overlay; O_DIRECT works (one 4 KiB block written and read back\n"
      "            in a file removed at once); free space against the device memory of the node\n"
      "  io_uring  a ring can be created, or why not (kernel.io_uring_disabled, seccomp, the kernel)\n"
      "  memlock   tmsdiskd's RLIMIT_MEMLOCK against the staging it pins (budget per rank x GPUs)\n"
      "Only the roots given, or the daemon's first one, are checked: name each root of the daemon's\n"
      "configuration with --root to check them all. Exit status: 0 when nothing FAILed (warnings\n"
      "included), 1 otherwise, 2 on a usage error.");
  return doctor;
}

// The command line as CLI11 is to parse it: the words before a first `--`, with "--tag=" split into
// "--tag" and "", and the command after the `--` set aside.
struct Words {
  std::vector<std::string> words;
  std::vector<char*> pointers;  // into `words`, for CLI11
  std::vector<std::string> command;
};

Words split_words(int argc, char** argv) {
  Words out;
  // `tmsctl run [options] -- CMD ARGS...`: everything after the first `--` is the command, untouched
  // by option parsing (its own flags may look like ours).
  int ours = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--") {
      ours = i;
      break;
    }
  }
  for (int i = ours + 1; i < argc; ++i) out.command.emplace_back(argv[i]);
  // "--tag=" is an option given the empty value, but CLI11 would take the next word as its value
  // (`--tag= --json` pauses the tag "--json"): it is split into "--tag" and "" before parsing.
  for (int i = 0; i < ours; ++i) {
    const std::string_view a = argv[i];
    if (i > 0 && a.size() > 3 && a.substr(0, 2) == "--" && a.find('=') == a.size() - 1) {
      out.words.emplace_back(a.substr(0, a.size() - 1));
      out.words.emplace_back();
    } else {
      out.words.emplace_back(a);
    }
  }
  for (auto& w : out.words) out.pointers.push_back(w.data());
  return out;
}

// What is told before parsing, which may fail: --json (it decides how a usage error is told), the
// command word, and the options given before it.
struct FirstLook {
  std::string command;
  bool json = false;
  std::vector<std::pair<std::string, std::string>> before;  // options before the command, with their values
};

FirstLook first_look(const std::vector<std::string>& words) {
  FirstLook out;
  const int n = static_cast<int>(words.size());
  for (int i = 1; i < n; ++i) {
    const std::string_view a = words[i];
    if (a == "--json") out.json = true;
    if (out.command.empty() && a.size() > 2 && a.substr(0, 2) == "--")
      out.before.emplace_back(a.substr(0, a.find('=')), takes_value(a) && i + 1 < n ? words[i + 1] : "");
    if (takes_value(a)) {
      ++i;
    } else if (out.command.empty() && !a.empty() && a[0] != '-') {
      out.command = a;
    }
  }
  return out;
}

// An unknown command word, or a command's own option before it: refused in tmsctl's words, since
// CLI11 would call that option unknown to the very command that lists it. Only the global options
// may come first.
std::optional<int> refuse_before_command(const CLI::App& app, const Subcommands& subs, const FirstLook& look) {
  if (look.command.empty()) return std::nullopt;
  const CLI::App* command_app = nullptr;
  for (const CLI::App* sub : subs.all())
    if (sub->get_name() == look.command) command_app = sub;
  if (!command_app) return usage_error(look.json, "tmsctl", unknown_command(look.command, app));
  for (const auto& [option, value] : look.before) {
    const CLI::Option* o = command_app->get_option_no_throw(option);
    if (!o || o->get_group() == kGlobalGroup || option == "--help") continue;
    const std::string given = option + (value.empty() ? "" : " " + value);
    return usage_error(look.json, "tmsctl " + look.command,
                       "put " + option + " after the command: tmsctl " + look.command + " " + given +
                           " (only --socket, --json and --timeout may come before it)");
  }
  return std::nullopt;
}

// Runs the subcommand that was parsed.
int run_parsed(const Subcommands& subs, Inputs& in) {
  in.launch.start_daemon = !in.no_start_daemon;
  // `--tag ""` is a tag given empty, which must not read as no --tag (the whole process).
  for (CLI::App* sub : {subs.pause, subs.resume, subs.prefetch})
    if (sub->parsed()) in.sel.tag_given = sub->get_option("--tag")->count() > 0;

  if (!in.command.empty() && !subs.run->parsed())
    return usage_error(in.common.json, "tmsctl", "only `run` takes a command after --");
  if (subs.status->parsed()) return cmd_status(in.common);
  if (subs.pause->parsed()) return cmd_control(in.common, in.sel, tmsdisk::proto::CommandOp::Pause);
  if (subs.resume->parsed()) return cmd_control(in.common, in.sel, tmsdisk::proto::CommandOp::Resume, in.accept_loss);
  if (subs.prefetch->parsed()) return cmd_control(in.common, in.sel, tmsdisk::proto::CommandOp::Prefetch);
  if (subs.gc->parsed()) return cmd_gc(in.common);
  if (subs.env->parsed()) return cmd_env(in.common, in.launch);
  if (subs.doctor->parsed()) return cmd_doctor(in.common, in.doctor);
  if (in.command.empty())
    return usage_error(in.common.json, "tmsctl run", "no command given: tmsctl run [options] -- COMMAND [ARGS...]");
  return cmd_run(in.common, in.launch, in.command);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tmsctl: pause a CUDA job's GPU memory to local NVMe and resume it, with no code changes.\n\n"
      "  tmsctl run -- python train.py        launch with the tmsdisk shim preloaded\n"
      "  tmsctl pause --job J                 move every rank of job J to disk, freeing its GPU memory\n"
      "  tmsctl prefetch --job J              read it back into host memory ahead of its resume\n"
      "  tmsctl resume --job J                bring it back at the same addresses\n"
      "  tmsctl status                        what each rank holds where\n"
      "  tmsctl doctor                        check this node before enabling the service\n\n"
      "Exit status: 0 success (also when there was nothing to do), 1 a rank, the daemon or a doctor check\n"
      "failed, or a rank or the daemon did not answer in time (--timeout), 2 a usage error."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "tmsctl (tmsdisk) " TMSDISK_VERSION, "print the version and exit");
  Inputs in;
  add_global_options(app, in.common);
  // Designated initializers run in order: the order --help lists the commands in.
  const Subcommands subs{.status = add_status(app, in),
                         .pause = add_pause(app, in),
                         .resume = add_resume(app, in),
                         .prefetch = add_prefetch(app, in),
                         .gc = add_gc(app, in),
                         .env = add_env(app, in),
                         .run = add_run(app, in),
                         .doctor = add_doctor(app, in)};
  for (CLI::App* sub : subs.all()) add_global_options(*sub, in.common);

  Words words = split_words(argc, argv);
  in.command = std::move(words.command);
  const FirstLook look = first_look(words.words);
  if (const auto refused = refuse_before_command(app, subs, look)) return *refused;
  try {
    app.parse(static_cast<int>(words.pointers.size()), words.pointers.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    const std::vector<CLI::App*> parsed = app.get_subcommands();
    const CLI::App* sub = parsed.empty() ? nullptr : parsed.back();
    return usage_error(look.json, sub ? "tmsctl " + sub->get_name() : "tmsctl", usage_message(e, app, sub));
  }
  return run_parsed(subs, in);
}
