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
# 3: TMS's own test suite, TMS_SRC_DIR/test/test_examples.py (commit 4a43c97), unmodified, with pytest
# under `tmsctl run --tms-compat`, against a daemon with a host tier (TAGS_SUITE_HOST_TIER_MB) and
# --host-tier-keep=false (where every one-GPU case is expected to pass), one with the tier kept (the
# default: TMS's two RSS checks fail by design), and one without a tier: pytest's summary line for each
# ("19 passed, 11 skipped"), each test's outcome against what is expected of it, the whole output in
# OUT_DIR/suite-<run>.log (JUnit XML beside). The three take about 6 minutes on an H200 node. The suite runs each example in a child started with
# multiprocessing's spawn (`_run_in_subprocess`), which inherits the environment and sys.path: the
# child imports the compatibility module too, and for hook mode preload the suite's
# `torch_memory_saver.configure_subprocess()` (the compatibility module's) keeps libtmsdisk.so in
# LD_PRELOAD. It needs nothing of TMS's compiled code: it imports `torch_memory_saver`,
# `torch_memory_saver.testing_utils.is_xpu` and `torch_memory_saver.utils.change_env`, which the
# compatibility module offers, and the examples reach TMS's C side only through
# `_impl._binary_wrapper.cdll.tms_get_*` (answered by the module), `cudaHostGetFlags` through that
# same cdll (cpu_backup: answered with the driver's cuMemHostGetFlags), and
# ctypes.CDLL(None) (cuda_vmm_granularity: tms_pause/tms_resume, which libtmsdisk.so exports, and
# cudaMalloc/cudaMemcpy/cudaFree/cudaSetDevice, which resolve from PyTorch's libcudart where torch
# loaded it into the global scope; TMS's own preload library linked libcudart itself). The suite is
# copied, with its examples/, into a directory of its own and run from an empty one, so that neither
# TMS's package nor its built libraries can be imported.
#
# Writes OUT_DIR/tags.txt (per case: exit status, PASS/FAIL, what was expected, the last lines of its
# output), every log beside it, and OUT_DIR/tags-logs.tar.gz. Exit status 0 when torch_tags.py passed
# and every case and test expected to pass did; cases expected to fail (calls that tmsdisk's
# torch_memory_saver refuses by design; README "torch_memory_saver compatibility") are reported, not
# counted.
#   tests/gpu/run_gpu_tags.sh BUNDLE_DIR OUT_DIR [TMS_SRC_DIR]
# All three parts take more than one 10-minute command: run TAGS_CASES="program examples" in one and
# TAGS_CASES=suite in another.
# Environment: TAGS_CASES ("program examples suite": the parts to run), TAGS_EXAMPLE_TIMEOUT_S (180: per
# example), TAGS_PROGRAM_TIMEOUT_S (600: torch_tags.py), TAGS_SUITE_TIMEOUT_S (300: per run of the
# suite), TAGS_SUITE_TEST_TIMEOUT_S (150: per test, with pytest-timeout where it is installed; without
# it, stacks are dumped after that long), TAGS_SUITE_HOST_TIER_MB (16384: the tier of the first run),
# TAGS_SUITE_RUNS ("tier-nokeep tier disk": the suite's runs: with the tier and --host-tier-keep=false,
# with the tier kept, without a tier),
# TAGS_DEADLINE_S (560: seconds from the start after which no run starts and each run is cut short, so
# that it fits in a 10-minute command), TAGS_TAIL_LINES (15).
set -uo pipefail  # not -e: every case runs and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
tms_src=$(cd "${3:-$here/../../gpu-extra/tms-src}" 2>/dev/null && pwd) || tms_src=""
example_timeout=${TAGS_EXAMPLE_TIMEOUT_S:-180}
program_timeout=${TAGS_PROGRAM_TIMEOUT_S:-600}
deadline=$((SECONDS + ${TAGS_DEADLINE_S:-560}))
tail_lines=${TAGS_TAIL_LINES:-15}
cases=" ${TAGS_CASES:-program examples suite} "
suite_timeout=${TAGS_SUITE_TIMEOUT_S:-300}
suite_test_timeout=${TAGS_SUITE_TEST_TIMEOUT_S:-150}
suite_tier_mb=${TAGS_SUITE_HOST_TIER_MB:-16384}
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

# part NAME TITLE: true when NAME is one of TAGS_CASES, once its title is in the report.
part() {
  [[ $cases == *" $1 "* ]] || return 1
  echo | tee -a "$report"
  echo "== $2" | tee -a "$report"
}

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
  echo "tags on a GPU: torch_tags.py, torch_memory_saver's examples and test suite under tmsctl run --tms-compat"
  echo "  parts run:$cases"
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
if part program "1. torch_tags.py: weights (backup) and KV cache (discard) through the tmsdisk package"; then
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
fi

# 2. TMS's examples
exdir=${tms_src:+$tms_src/test/examples}
# An empty working directory: `python3 -c` puts it first on sys.path, so nothing there may shadow
# the compatibility module (TMS's tree, say).
cwd=$out/cwd
mkdir -p "$cwd"
if part examples "2. torch_memory_saver's examples, unmodified, under tmsctl run --tms-compat"; then
  if [ -z "$exdir" ] || [ ! -d "$exdir" ]; then
    echo "examples: NOT RUN (no test/examples in TMS_SRC_DIR=${3:-gpu-extra/tms-src})" | tee -a "$report"
    failed=1
  elif ! start_node "$bundle_dir" "$out" tmsex; then
    echo "examples: NOT RUN (the daemon did not start: tmsdiskd-tmsex.log)" | tee -a "$report"
    failed=1
  else
    ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || nvidia-smi -L 2>/dev/null | wc -l)
    echo "visible GPUs: $ngpu" | tee -a "$report"
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
      # A temporary directory on a disk (disk_backup makes its backup directory there; see suite_run).
      mkdir -p "$work/tmp"
      (cd "$cwd" && env TMPDIR="$work/tmp" $envs "$tmsctl" run --tms-compat --job "tmsex-$name" -- timeout -k 10 "$t" \
        "${cmd[@]}") >>"$log" 2>&1
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
    example cpu_backup-preload "" pass - cpu_backup run preload
    example cpu_backup-torch "" pass - cpu_backup run torch
    # Expected to fail: what tmsdisk's torch_memory_saver does otherwise by design, or not yet (the
    # report says "PASS, though expected to fail": then make them expected to pass).
    rss="checks that the process's RSS drops after the resume (host-tier-keep keeps the copy mapped: README)"
    example cpu_backup_rss-torch "" "$rss" - cpu_backup run_rss torch
    example cpu_backup_backend_from_env-preload "" pass TMS_INIT_CPU_BACKUP_BACKEND=mmap cpu_backup run_backend_from_env preload
    example cpu_backup_backend_from_env-torch "" pass TMS_INIT_CPU_BACKUP_BACKEND=mmap cpu_backup run_backend_from_env torch
    example cpu_backup_preload_backend_from_env-preload "" "$rss" \
      "TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 TMS_INIT_CPU_BACKUP_BACKEND=mmap" cpu_backup run_preload_backend_from_env preload
    example cpu_backup_retain_from_env-preload "" pass TMS_RETAIN_CPU_BACKUP=1 cpu_backup run_retain_from_env preload
    example cpu_backup_retain_from_env-torch "" pass TMS_RETAIN_CPU_BACKUP=1 cpu_backup run_retain_from_env torch
    example disk_backup-preload "" pass - disk_backup run preload
    example disk_backup-torch "" pass - disk_backup run torch
    example cuda_vmm_granularity-preload "" pass TMS_INIT_ENABLE=1 cuda_vmm_granularity run preload
    for x in disable_unsupported resume_failure cleanup_failure free_failure multi_device_sync memory_margin_unsupported; do
      echo "-- xpu_scenarios $x: SKIPPED (XPU only)" | tee -a "$report"
      skipped=$((skipped + 1))
    done
    echo "examples: $passed passed, $refused failed as expected, $unexpected failed UNEXPECTEDLY, $skipped skipped, $notrun not run" |
      tee -a "$report"
    "$tmsctl" status >"$out/tmsex-daemon-status.txt" 2>&1
    stop_node
  fi
fi

# 3. TMS's own test suite
# Its tests by what is expected of them here: SUITE_PASS must pass; SUITE_PASS_OR_SKIP need two GPUs
# (skipped on one, as the suite itself skips them); the others fail by design, or may pass now.
suite_expect() {
  python3 - "$@" <<'PY'
import os, re, sys
import xml.etree.ElementTree as ET

xml_path, log_path, run = sys.argv[1], sys.argv[2], sys.argv[3]
MUST_PASS = {"test_cpu_backup[preload]", "test_cpu_backup[torch]","test_simple[preload]", "test_simple[torch]", "test_cuda_graph[preload]", "test_cuda_graph[torch]",
             "test_rl_example[preload]", "test_rl_example[torch]", "test_training_engine", "test_nested_region",
             "test_disk_backup[preload]", "test_disk_backup[torch]", "test_cuda_vmm_granularity",
             "test_cpu_backup_backend_from_env[preload]", "test_cpu_backup_backend_from_env[torch]",
             "test_cpu_backup_retain_from_env[preload]", "test_cpu_backup_retain_from_env[torch]"}
PASS_OR_SKIP = ("test_multi_device", "test_multi_device_torch_mode", "test_cpu_backup_multi_device_mmap_restore")
WHY = {
    "test_cpu_backup": "without a host tier there is no host copy to view: get_cpu_backup(x, zero_copy=True) copies",
    "test_cpu_backup_rss": "checks the process's RSS drops after a resume: host-tier-keep keeps the copy mapped (README)",
    "test_cpu_backup_preload_backend_from_env": "the same RSS checks",
}
outcomes = {}
try:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name")
        tags = {child.tag for child in case}
        outcomes[name] = ("failed" if "failure" in tags else "error" if "error" in tags else
                          "skipped" if "skipped" in tags else "passed")
    source = "JUnit XML"
except (OSError, ET.ParseError):
    # No XML (the run was cut short): the -v lines it printed.
    for line in open(log_path, errors="replace"):
        m = re.search(r"test_examples\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", line)
        if m:
            outcomes[m.group(1)] = m.group(2).lower()
    source = "pytest -v lines (no XML)"
if run == "disk":  # the cases that ask for a host copy's view need the host tier
    MUST_PASS -= {"test_cpu_backup[preload]", "test_cpu_backup[torch]"}
if run == "tier-nokeep":  # every resume unmaps the host copy, as TMS frees its copy: RSS drops as TMS's checks expect
    MUST_PASS |= {"test_cpu_backup_rss", "test_cpu_backup_preload_backend_from_env"}
bad = 0
for name in sorted(set(outcomes) | MUST_PASS):
    got = outcomes.get(name, "not run")
    base = name.split("[")[0]
    if name in MUST_PASS:
        note = "expected to pass" if got == "passed" else "expected to pass: UNEXPECTED"
        bad += got != "passed"
    elif base in PASS_OR_SKIP:
        note = "needs two GPUs" if got == "skipped" else ("expected to pass" if got == "passed" else "expected to pass: UNEXPECTED")
        bad += got not in ("passed", "skipped")
    elif base.endswith("_xpu"):
        note = "XPU only"
    else:
        why = WHY.get(base, "not classified")
        note = f"{'passed, though' if got == 'passed' else 'as'} expected to fail: {why}"
    print(f"   {name:<55} {got:<8} {note}")
print(f"   ({source}; {bad} expected to pass did not)")
sys.exit(1 if bad else 0)
PY
}

# suite_run NAME DAEMON_ARGS: the suite once, against a daemon with DAEMON_ARGS ("-": none).
suite_run() {
  local name=$1 dargs=$2 t rc log=$out/suite-$1.log summary timeout_opt=()
  [ "$dargs" = - ] && dargs=""
  t=$(budget "$suite_timeout")
  if [ "$t" -eq 0 ]; then
    echo "suite-$name: NOT RUN (out of time)" | tee -a "$report"
    failed=1
    return
  fi
  if ! NODE_DAEMON_ARGS="$dargs" start_node "$bundle_dir" "$out" "suite-$name"; then
    echo "suite-$name: NOT RUN (the daemon did not start: tmsdiskd-suite-$name.log)" | tee -a "$report"
    failed=1
    return
  fi
  python3 -c 'import pytest_timeout' 2>/dev/null && timeout_opt=(--timeout "$suite_test_timeout")
  local cmd=(python3 -m pytest -p no:cacheprovider -p no:randomly --import-mode=prepend -v -rA
    -o "faulthandler_timeout=$suite_test_timeout" ${timeout_opt[@]+"${timeout_opt[@]}"}
    --junitxml="$out/suite-$name.xml" "$suite/test_examples.py")
  {
    printf '$ (cd %q && %q run --tms-compat --job %q -- timeout -k 10 %s' "$suite_cwd" "$tmsctl" "suite-$name" "$t"
    printf ' %q' "${cmd[@]}"
    printf ')   # tmsdiskd %s\n' "${dargs:-without a host tier}"
  } >"$log"
  rm -f "$out/suite-$name.xml"
  local t0=$SECONDS
  # Its tests make their directories with tempfile (test_disk_backup: set_disk_backup_dir(mkdtemp())):
  # on a disk, as the daemon takes no directory in memory, where the node's /tmp is a tmpfs.
  local tests_tmp=$work/tmp
  mkdir -p "$tests_tmp"
  (cd "$suite_cwd" && TMPDIR=$tests_tmp "$tmsctl" run --tms-compat --job "suite-$name" -- timeout -k 10 "$t" "${cmd[@]}") \
    >>"$log" 2>&1
  rc=$?
  "$tmsctl" status >"$out/suite-$name-daemon-status.txt" 2>&1
  stop_node
  summary=$(grep -E '^=+ .*[0-9.]+s( \([0-9:]+\))? =+$' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] &&
    summary="CUT SHORT after $t s (last test reached: $(grep -oE 'test_examples\.py::\S+' "$log" | tail -n 1))"
  echo "suite-$name ($((SECONDS - t0)) s, pytest exit $rc): ${summary:-no summary line (suite-$name.log)}" | tee -a "$report"
  suite_expect "$out/suite-$name.xml" "$log" "$name" >>"$report" 2>&1 || failed=1
}

if part suite "3. torch_memory_saver's test suite, test/test_examples.py, unmodified, with pytest under tmsctl run --tms-compat"; then
  suite_file=${tms_src:+$tms_src/test/test_examples.py}
  if [ -z "$suite_file" ] || [ ! -f "$suite_file" ] || [ ! -d "$tms_src/test/examples" ]; then
    echo "suite: NOT RUN (no test/test_examples.py and test/examples in TMS_SRC_DIR=${3:-gpu-extra/tms-src})" |
      tee -a "$report"
    failed=1
  elif ! python3 -m pytest --version >"$out/suite-pytest.txt" 2>&1; then
    echo "suite: NOT RUN (python3 -m pytest: $(tail -n 1 "$out/suite-pytest.txt"))" | tee -a "$report"
    failed=1
  else
    # The suite and its examples/ alone in a directory of their own (pytest puts it first on sys.path:
    # `from examples import ...`), its pytest.ini ending pytest's search for a configuration there; run
    # from an empty directory, so that neither TMS's package nor its built libraries are importable.
    suite=$out/suite-src
    suite_cwd=$out/suite-cwd
    rm -rf "$suite" "$suite_cwd"
    mkdir -p "$suite" "$suite_cwd"
    cp "$suite_file" "$suite/" && cp -r "$tms_src/test/examples" "$suite/"
    printf '[pytest]\n' >"$suite/pytest.ini"
    {
      echo "$(head -n 1 "$out/suite-pytest.txt"); TMS commit $(cat "$tms_src/COMMIT" 2>/dev/null || echo unknown);" \
        "test_examples.py sha256 $(sha256sum "$suite_file" | cut -c1-16)"
      echo "pytest-timeout: $(python3 -c 'import pytest_timeout; print("yes: --timeout '"$suite_test_timeout"'")' 2>/dev/null ||
        echo "no (a hung test stops the run at TAGS_SUITE_TIMEOUT_S; faulthandler dumps its stacks first)")"
    } | tee -a "$report"
    if start_node "$bundle_dir" "$out" suite-probe; then
      probe=$(cd "$suite_cwd" && "$tmsctl" run --tms-compat --job suite-probe -- python3 -c \
        'import torch_memory_saver, torch_memory_saver.testing_utils as t, torch_memory_saver.utils as u; print(torch_memory_saver.__file__, t.is_xpu, u.change_env)' \
        2>"$out/suite-probe.log")
      stop_node
      echo "under --tms-compat from the suite's directory: $probe" | tee -a "$report"
      case $probe in
        "$bundle_dir"/python/tms-compat/torch_memory_saver/*) ;;
        *) echo "FAIL: torch_memory_saver is not the bundle's compatibility module (suite-probe.log)" | tee -a "$report"; failed=1 ;;
      esac
    fi
    for run in ${TAGS_SUITE_RUNS:-tier-nokeep tier disk}; do
      case $run in
        tier) suite_run tier "--host-tier-mb $suite_tier_mb" ;;
        tier-nokeep) suite_run tier-nokeep "--host-tier-mb $suite_tier_mb --host-tier-keep=false" ;;
        disk) suite_run disk - ;;
        *) echo "suite: unknown run '$run' in TAGS_SUITE_RUNS (tier, tier-nokeep, disk)" | tee -a "$report"; failed=1 ;;
      esac
    done
  fi
fi

echo | tee -a "$report"
[ "$bundle_ok" -eq 1 ] || { echo "the bundle lacks what --tms-compat needs (see BUNDLE above)" | tee -a "$report"; failed=1; }
echo "result: $([ "$failed" -eq 0 ] && echo PASS || echo FAIL) (exit $failed), $((SECONDS)) s" | tee -a "$report"
tmp=$(mktemp "${TMPDIR:-/tmp}/tags-logs.XXXXXX")
tar -czf "$tmp" -C "$out" --exclude=./tags-logs.tar.gz . && mv "$tmp" "$out/tags-logs.tar.gz"
rm -f "$tmp"
exit $failed
