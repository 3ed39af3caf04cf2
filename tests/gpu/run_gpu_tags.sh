#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Tags on a GPU. 1: torch_tags.py, a PyTorch program that tags its weights (backup) and KV cache
# (discard) through the `tmsdisk` package, pauses itself whole and then the KV cache alone while it
# computes on the weights, and checks bytes, per-tag figures and the GPU memory released. 2: each of
# torch_memory_saver's (TMS) example programs (TMS_SRC_DIR/test/examples, the cases and environment of
# its test/test_examples.py), unmodified, under `tmsctl run --tms-compat`: `import torch_memory_saver`
# loads tmsdisk's compatibility module from the bundle, never TMS's (its tree is not put on the path).
# A case TMS's runner calls as a function other than the example's run() is run the same way with
# `python3 -c`, from an empty directory. Multi-device cases are skipped on one GPU; XPU-only ones
# always.
#
# Writes OUT_DIR/tags.txt (per case: exit status, PASS/FAIL, what was expected, the last lines of its
# output), every log beside it, and OUT_DIR/tags-logs.tar.gz. Exit status 0 when torch_tags.py passed
# and every case expected to pass did; cases expected to fail (calls that tmsdisk's torch_memory_saver
# refuses by design, or TMS's C functions; README "torch_memory_saver compatibility") are
# reported, not counted.
#   tests/gpu/run_gpu_tags.sh BUNDLE_DIR OUT_DIR [TMS_SRC_DIR]
# Environment: TAGS_EXAMPLE_TIMEOUT_S (180: per example), TAGS_PROGRAM_TIMEOUT_S (600: torch_tags.py),
# TAGS_DEADLINE_S (560: seconds from the start after which no run starts and each run is cut short,
# so that the whole fits in a 10-minute command), TAGS_TAIL_LINES (15).
set -uo pipefail  # not -e: every case runs and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
tms_src=$(cd "${3:-$here/../../gpu-extra/tms-src}" 2>/dev/null && pwd) || tms_src=""
example_timeout=${TAGS_EXAMPLE_TIMEOUT_S:-180}
program_timeout=${TAGS_PROGRAM_TIMEOUT_S:-600}
deadline=$((SECONDS + ${TAGS_DEADLINE_S:-560}))
tail_lines=${TAGS_TAIL_LINES:-15}
mkdir -p "$out"
out=$(cd "$out" && pwd)
bundle_dir=$(cd "$bundle_dir" && pwd -P) || exit 1
. "$here/node.sh"
export PYTHONUNBUFFERED=1 TMSDISK_LOG=info
# TMS's settings come from each case alone.
unset TMS_INIT_ENABLE TMS_INIT_ENABLE_CPU_BACKUP TMS_INIT_ENABLE_DISK_BACKUP TMS_INIT_CPU_BACKUP_BACKEND \
  TMS_RETAIN_CPU_BACKUP TMS_DISK_BACKUP_DIR TMS_DISK_BACKUP_CHUNK_MB
report=$out/tags.txt
failed=0

# Seconds the next run may take: at most $1, and what is left before the deadline less 15 s.
budget() {
  local left=$((deadline - SECONDS - 15))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1
  echo "TMS source: ${tms_src:-missing} commit $(cat "$tms_src/COMMIT" 2>/dev/null || echo unknown)"
  echo "torch_memory_saver without tmsctl: $(cd / && python3 -c 'import importlib.util as u; s = u.find_spec("torch_memory_saver"); print(s.origin if s else "not importable")' 2>&1)"
} >"$out/machine.txt" 2>&1
{
  echo "tags on a GPU: torch_tags.py, then torch_memory_saver's examples under tmsctl run --tms-compat"
  sed 's/^/  /' "$out/machine.txt"
} >"$report"

# What --tms-compat needs in the bundle: tmsctl finds python/ (the start-up module's directory) beside
# itself, and the compatibility module in its tms-compat/.
bundle_ok=1
for f in python/sitecustomize.py python/tmsdisk/__init__.py python/tms-compat/torch_memory_saver/__init__.py; do
  if [ ! -r "$bundle_dir/$f" ]; then
    echo "BUNDLE: $bundle_dir/$f is missing (tests/gpu/bundle.sh copies build-release/python/ there; rebuild the bundle)" |
      tee -a "$report"
    bundle_ok=0
  fi
done

# 1. torch_tags.py
echo | tee -a "$report"
echo "== 1. torch_tags.py: weights (backup) and KV cache (discard) through the tmsdisk package" | tee -a "$report"
if start_node "$bundle_dir" "$out" tags; then
  t=$(budget "$program_timeout")
  if [ "$t" -eq 0 ]; then
    echo "torch_tags: NOT RUN (out of time)" | tee -a "$report"
    failed=1
  else
    TMSCTL=$tmsctl "$tmsctl" run --job tags -- timeout -k 10 "$t" python3 "$here/torch_tags.py" \
      >"$out/torch_tags.out" 2>"$out/torch_tags.log"
    rc=$?
    "$tmsctl" status >>"$out/torch_tags.log" 2>&1
    grep -v '^{' "$out/torch_tags.out" | sed 's/^/  /' >>"$report"
    grep '^{"kind": "result"' "$out/torch_tags.out" >"$out/torch_tags.json"
    verdict=FAIL
    [ "$rc" -eq 0 ] && tail -n 1 "$out/torch_tags.out" | grep -q '^PASS' && verdict=PASS
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="FAIL (timed out after $t s)"; fi
    echo "torch_tags: $verdict (exit $rc; torch_tags.out, torch_tags.json, torch_tags.log)" | tee -a "$report"
    if [ "$verdict" != PASS ]; then
      failed=1
      echo "  last lines of torch_tags.log:" >>"$report"
      tail -n "$tail_lines" "$out/torch_tags.log" | sed 's/^/    /' >>"$report"
    fi
  fi
  stop_node
else
  echo "torch_tags: NOT RUN (the daemon did not start: tmsdiskd-tags.log)" | tee -a "$report"
  failed=1
fi

# 2. TMS's examples
echo | tee -a "$report"
echo "== 2. torch_memory_saver's examples, unmodified, under tmsctl run --tms-compat" | tee -a "$report"
exdir=${tms_src:+$tms_src/test/examples}
if [ -z "$exdir" ] || [ ! -d "$exdir" ]; then
  echo "examples: NOT RUN (no test/examples in TMS_SRC_DIR=${3:-gpu-extra/tms-src})" | tee -a "$report"
  failed=1
elif ! start_node "$bundle_dir" "$out" tmsex; then
  echo "examples: NOT RUN (the daemon did not start: tmsdiskd-tmsex.log)" | tee -a "$report"
  failed=1
else
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || nvidia-smi -L 2>/dev/null | wc -l)
  echo "visible GPUs: $ngpu" | tee -a "$report"
  # An empty working directory: `python3 -c` puts it first on sys.path, so nothing there may shadow
  # the compatibility module (TMS's tree, say).
  cwd=$out/cwd
  mkdir -p "$cwd"
  # Which torch_memory_saver and tmsdisk a job imports.
  probe=$(cd "$cwd" && "$tmsctl" run --tms-compat --job tmsex-probe -- python3 -c \
    'import torch_memory_saver, tmsdisk; print(torch_memory_saver.__file__, tmsdisk.__file__)' 2>"$out/tmsex-probe.log")
  echo "under --tms-compat: import torch_memory_saver, tmsdisk -> $probe" | tee -a "$report"
  case $probe in
    "$bundle_dir"/python/tms-compat/torch_memory_saver/*) ;;
    *) echo "FAIL: torch_memory_saver is not the bundle's compatibility module" | tee -a "$report"; failed=1 ;;
  esac
  unexpected=0 passed=0 refused=0 skipped=0 notrun=0

  # example NAME NEEDS EXPECT ENV MODULE FUNC HOOK
  #   NEEDS: "" or "multi" (two GPUs); EXPECT: "pass", or why it should fail; ENV: VAR=VALUE words
  #   (or "-"); FUNC run: `python3 MODULE.py HOOK`, as its __main__ does; another: that function,
  #   imported as TMS's runner imports it, with hook_mode=HOOK.
  example() {
    local name=$1 needs=$2 expect=$3 envs=$4 module=$5 func=$6 hook=$7 t rc verdict log
    log=$out/tmsex-$name.log
    if [ "$needs" = multi ] && [ "${ngpu:-0}" -lt 2 ]; then
      echo "-- $name: SKIPPED (needs two GPUs, $ngpu visible; TMS's runner skips it too)" | tee -a "$report"
      skipped=$((skipped + 1))
      return
    fi
    t=$(budget "$example_timeout")
    if [ "$t" -eq 0 ]; then
      echo "-- $name: NOT RUN (out of time)" | tee -a "$report"
      notrun=$((notrun + 1))
      [ "$expect" = pass ] && failed=1
      return
    fi
    [ "$envs" = - ] && envs=""
    local cmd=(python3 "$exdir/$module.py" "$hook")
    if [ "$func" != run ]; then
      cmd=(python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import $module as m; m.$func(hook_mode=sys.argv[2])"
        "$exdir" "$hook")
    fi
    printf '$ (cd %q && %s%q run --tms-compat --job %q -- timeout -k 10 %s' "$cwd" "${envs:+env $envs }" "$tmsctl" \
      "tmsex-$name" "$t" >"$log"
    printf ' %q' "${cmd[@]}" >>"$log"
    printf ')\n' >>"$log"
    local t0=$SECONDS
    # shellcheck disable=SC2086  # envs is a list of VAR=VALUE words
    (cd "$cwd" && env $envs "$tmsctl" run --tms-compat --job "tmsex-$name" -- timeout -k 10 "$t" "${cmd[@]}") >>"$log" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      verdict="FAIL (timed out after $t s)"
    elif [ "$rc" -eq 0 ]; then
      verdict=PASS
    else
      verdict=FAIL
    fi
    if [ "$expect" = pass ]; then
      if [ "$verdict" = PASS ]; then passed=$((passed + 1)); else verdict="$verdict, UNEXPECTED"; unexpected=$((unexpected + 1)); failed=1; fi
    else
      if [ "$verdict" = PASS ]; then
        verdict="PASS, though expected to fail ($expect): look"
        passed=$((passed + 1))
      else
        verdict="$verdict, expected: $expect"
        refused=$((refused + 1))
      fi
    fi
    echo "-- $name: $verdict (exit $rc, $((SECONDS - t0)) s; tmsex-$name.log)" | tee -a "$report"
    tail -n "$tail_lines" "$log" | sed 's/^/     | /' >>"$report"
  }

  # Expected to pass: the API tmsdisk offers.
  example simple-preload "" pass - simple run preload
  example simple-torch "" pass - simple run torch
  example cuda_graph-preload "" pass - cuda_graph run preload
  example cuda_graph-torch "" pass - cuda_graph run torch
  example rl_example-preload "" pass - rl_example run preload
  example rl_example-torch "" pass - rl_example run torch
  example training_engine-preload "" pass "TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1" training_engine run preload
  example nested_region-preload "" pass "TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1" nested_region run preload
  example multi_device-preload multi pass - multi_device run preload
  example multi_device-torch multi pass - multi_device run torch
  example multi_device_torch_mode-torch multi pass - multi_device_torch_mode run torch
  # Two backed-up tags paused one after the other, then resumed together.
  example cpu_backup_multi_device_mmap_restore-preload multi pass - cpu_backup run_multi_device_mmap_restore preload
  example cpu_backup_multi_device_mmap_restore-torch multi pass - cpu_backup run_multi_device_mmap_restore torch
  # Expected to fail: what tmsdisk's torch_memory_saver refuses by design, or TMS's C functions.
  nocopy="get_cpu_backup is refused (no host copy Python could read)"
  example cpu_backup-preload "" "$nocopy" - cpu_backup run preload
  example cpu_backup-torch "" "$nocopy" - cpu_backup run torch
  example cpu_backup_rss-torch "" "the process's RSS does not grow by a host copy (no host shadow)" - cpu_backup run_rss torch
  example cpu_backup_backend_from_env-preload "" "$nocopy" TMS_INIT_CPU_BACKUP_BACKEND=mmap cpu_backup run_backend_from_env preload
  example cpu_backup_backend_from_env-torch "" "$nocopy" TMS_INIT_CPU_BACKUP_BACKEND=mmap cpu_backup run_backend_from_env torch
  example cpu_backup_preload_backend_from_env-preload "" "$nocopy" \
    "TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 TMS_INIT_CPU_BACKUP_BACKEND=mmap" cpu_backup run_preload_backend_from_env preload
  example cpu_backup_retain_from_env-preload "" "TMS_RETAIN_CPU_BACKUP=1 is refused (retain_cpu_backup stays False)" \
    TMS_RETAIN_CPU_BACKUP=1 cpu_backup run_retain_from_env preload
  example cpu_backup_retain_from_env-torch "" "TMS_RETAIN_CPU_BACKUP=1 is refused (retain_cpu_backup stays False)" \
    TMS_RETAIN_CPU_BACKUP=1 cpu_backup run_retain_from_env torch
  example disk_backup-preload "" "set_disk_backup_dir(another directory) is refused; no tms_* files" - disk_backup run preload
  example disk_backup-torch "" "set_disk_backup_dir(another directory) is refused; no tms_* files" - disk_backup run torch
  example cuda_vmm_granularity-preload "" "calls TMS's C functions tms_pause/tms_resume, which libtmsdisk.so does not export" \
    TMS_INIT_ENABLE=1 cuda_vmm_granularity run preload
  for x in disable_unsupported resume_failure cleanup_failure free_failure multi_device_sync memory_margin_unsupported; do
    echo "-- xpu_scenarios $x: SKIPPED (XPU only)" | tee -a "$report"
    skipped=$((skipped + 1))
  done
  echo "examples: $passed passed, $refused failed as expected, $unexpected failed UNEXPECTEDLY, $skipped skipped, $notrun not run" |
    tee -a "$report"
  "$tmsctl" status >"$out/tmsex-daemon-status.txt" 2>&1
  stop_node
fi

echo | tee -a "$report"
[ "$bundle_ok" -eq 1 ] || { echo "the bundle lacks what --tms-compat needs (see BUNDLE above)" | tee -a "$report"; failed=1; }
echo "result: $([ "$failed" -eq 0 ] && echo PASS || echo FAIL) (exit $failed), $((SECONDS)) s" | tee -a "$report"
tmp=$(mktemp "${TMPDIR:-/tmp}/tags-logs.XXXXXX")
tar -czf "$tmp" -C "$out" --exclude=./tags-logs.tar.gz . && mv "$tmp" "$out/tags-logs.tar.gz"
rm -f "$tmp"
exit $failed
