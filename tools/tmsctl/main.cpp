// SPDX-License-Identifier: Apache-2.0
// tmsctl: the tmsdisk command line. Parses options and hands off to commands.cpp.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "commands.h"

int main(int argc, char** argv) {
  using namespace tmsdisk::ctl;
  CLI::App app{
      "tmsctl: pause a CUDA job's GPU memory to local NVMe and resume it, with no code changes.\n\n"
      "  tmsctl run -- python train.py        launch with the tmsdisk shim preloaded\n"
      "  tmsctl pause --job J                 move every rank of job J to disk, freeing its GPU memory\n"
      "  tmsctl resume --job J                bring it back at the same addresses\n"
      "  tmsctl status                        what each rank holds where"};
  app.require_subcommand(1);
  Common common;
  app.add_option("--socket", common.socket, "tmsdiskd socket (default: $TMSDISK_SOCKET, the system socket, or the private one)");
  app.add_flag("--json", common.json, "machine-readable output");

  auto* status = app.add_subcommand("status", "list ranks: state, resident, paused and unmanaged bytes, last pause/resume");

  Selector sel;
  auto add_selector = [&](CLI::App* sub) {
    sub->add_option("--job", sel.job, "ranks of this job (TMSDISK_JOB, TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...)");
    sub->add_option("--rank", sel.rank, "only this rank")->check(CLI::NonNegativeNumber);
    sub->add_option("--pid", sel.pid, "only this process")->check(CLI::PositiveNumber);
    sub->add_flag("--all", sel.all, "every rank you may act on");
    sub->add_option("--timeout", sel.timeout_s, "seconds to wait for the ranks (0: no limit)")->capture_default_str();
  };
  auto* pause = app.add_subcommand("pause", "write the selected ranks' GPU memory to disk and release it");
  add_selector(pause);
  auto* resume = app.add_subcommand("resume", "restore the selected ranks' GPU memory at the same addresses");
  add_selector(resume);

  auto* gc = app.add_subcommand("gc", "remove files left by ranks that no longer run");

  LaunchOptions launch;
  auto add_launch = [&](CLI::App* sub) {
    sub->add_option("--job", launch.job, "job name given to the ranks (TMSDISK_JOB)");
    sub->add_option("--staging-budget-mb", launch.staging_budget_mb, "staging per rank in MiB (TMS_DISK_BACKUP_CHUNK_MB; default: the daemon's)");
    sub->add_option("--min-mb", launch.min_mb, "allocations below this many MiB stay native (TMSDISK_MIN_BYTES)");
    sub->add_option("--on-touch", launch.on_touch,
                    "what a CUDA launch or copy does while paused: wait (until resumed), resume (automatically) "
                    "or fail (CUDA_ERROR_NOT_PERMITTED) (TMSDISK_ON_TOUCH; default: wait)")
        ->check(CLI::IsMember({"wait", "resume", "fail"}));
  };
  auto* env = app.add_subcommand("env", "print the environment a launch needs (LD_PRELOAD, TMSDISK_*, TMS_DISK_BACKUP_*)");
  add_launch(env);
  std::vector<std::string> command;
  auto* run = app.add_subcommand("run", "run a command with the shim preloaded (torchrun's children inherit it): tmsctl run [options] -- CMD ARGS...");
  add_launch(run);
  run->add_flag("!--no-start-daemon", launch.start_daemon, "fail instead of starting a private daemon when none answers");

  // `tmsctl run [options] -- CMD ARGS...`: everything after the first `--` is the command, untouched
  // by option parsing (its own flags may look like ours).
  int ours = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      ours = i;
      break;
    }
  }
  for (int i = ours + 1; i < argc; ++i) command.emplace_back(argv[i]);
  CLI11_PARSE(app, ours, argv);

  if (status->parsed()) return cmd_status(common);
  if (pause->parsed()) return cmd_control(common, sel, true);
  if (resume->parsed()) return cmd_control(common, sel, false);
  if (gc->parsed()) return cmd_gc(common);
  if (env->parsed()) return cmd_env(common, launch);
  if (!command.empty() && !run->parsed()) {
    std::fprintf(stderr, "tmsctl: only `run` takes a command after --\n");
    return 2;
  }
  if (run->parsed()) {
    if (command.empty()) {
      std::fprintf(stderr, "tmsctl run: no command given; usage: tmsctl run [options] -- COMMAND [ARGS...]\n");
      return 2;
    }
    return cmd_run(common, launch, command);
  }
  return 2;
}
