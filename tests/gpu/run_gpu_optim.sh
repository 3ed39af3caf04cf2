#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: tmsdisk.optim.StreamedAdamW against miles' --stream-optimizer-state-to-disk loop
# (bench/miles_loop.py), on the same buckets and disk, in one run (issue 25;
# bench/streamed_optim_bench.py says what each case is). Three daemons one after another on
# $NODE_DISK (default /var/tmp), each on a fresh root:
#   1. a host tier that holds all the state: resident AdamW (the floor and the reference), pinned
#      copies, raw O_DIRECT, StreamedAdamW (ours_full), miles warm, miles with the page cache dropped
#      before each step, miles in a memory cgroup of OPTIM_GIB GiB of page cache;
#   2. a host tier of OPTIM_GIB GiB: StreamedAdamW (ours_tier);
#   3. no host tier: raw O_DIRECT again, StreamedAdamW (ours_disk).
# Then the table, the ratios with their goals, and PASS/FAIL: every case's fp32 masters after the
# steps must be bit-identical to the resident torch.optim.AdamW's (exit 1 otherwise; 3 when a case
# failed to run).
#   tests/gpu/run_gpu_optim.sh BUNDLE_DIR [OUT_DIR]      (OUT_DIR: default ./optim-bench-out)
# Environment (defaults: 4.8 GB of state, about 4 minutes on an H200 node):
#   OPTIM_BUCKETS (4) buckets of OPTIM_ELEMENTS (100000000) elements, 12 bytes each;
#   OPTIM_STEPS (3) timed steps after OPTIM_WARMUP (1); OPTIM_DEPTH (3) StreamedAdamW's depth;
#   OPTIM_GIB (2): N, miles' cgroup headroom and ours' tier in phase 2;
#   OPTIM_CASES: the labels to run, of "resident pinned raw_before ours_full miles_warm miles_cold
#   miles_cgroup ours_tier raw ours_disk" (default all);
#   OPTIM_DEVICE (cuda): cpu is a dry run of the phases on a machine without a GPU (ours skipped).
# Issue 25's full size (4 x 200M elements, 9.6 GB of state; N = 4 GiB), about 8 minutes: a call of
# its own with a 600 s limit:
#   OPTIM_ELEMENTS=200000000 OPTIM_GIB=4 tests/gpu/run_gpu_optim.sh gpu-bundle $S/optim-full
set -uo pipefail  # not -e: every phase runs and reports
bundle_dir=$1
out=${2:-optim-bench-out}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
. "$here/node.sh"
mkdir -p "$out"
out=$(cd "$out" && pwd)
bench=$repo/bench/streamed_optim_bench.py
json=$out/optim.json
rm -f "$json"

buckets=${OPTIM_BUCKETS:-4}
elements=${OPTIM_ELEMENTS:-100000000}
steps=${OPTIM_STEPS:-3}
warmup=${OPTIM_WARMUP:-1}
depth=${OPTIM_DEPTH:-3}
gib=${OPTIM_GIB:-2}
wanted=" ${OPTIM_CASES:-resident pinned raw_before ours_full miles_warm miles_cold miles_cgroup ours_tier raw ours_disk} "
state_mib=$(( buckets * elements * 12 / 1048576 + 1 ))
common=(--buckets "$buckets" --elements "$elements" --steps "$steps" --warmup "$warmup" --depth "$depth"
        --cgroup-gib "$gib" --out "$json" --logs "$out" --device "${OPTIM_DEVICE:-cuda}")

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  uname -r
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  df -h "${NODE_DISK:-/var/tmp}" | tail -1
  grep -h "MemTotal\|MemAvailable" /proc/meminfo
  echo "cgroup: $(stat -f -c %T /sys/fs/cgroup 2>&1); own $(grep '^0::' /proc/self/cgroup)"
  echo "state: $buckets x $elements elements x 12 bytes = $state_mib MiB; N = $gib GiB"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# phase NAME TIER_MIB KIND:LABEL... : a daemon with that host tier (0: none), the cases OPTIM_CASES keeps.
phase() {
  local name=$1 tier=$2 cases="" item
  shift 2
  for item in "$@"; do [[ $wanted == *" ${item#*:} "* ]] && cases+=" $item"; done
  [ -n "$cases" ] || return 0
  local args=""
  [ "$tier" -gt 0 ] && args="--host-tier-mb $tier"
  echo "== phase $name: daemon host tier $tier MiB:$cases" | tee -a "$out/optim-run.txt"
  if ! NODE_DAEMON_ARGS="$args" start_node "$bundle_dir" "$out" "optim-$name"; then
    echo "FAIL: the daemon of phase $name did not start (tmsdiskd-optim-$name.log)" | tee -a "$out/optim-run.txt"
    return 1
  fi
  python3 "$bench" run "${common[@]}" --dir "$work/bench" --tmsctl "$tmsctl" --rawdisk "$bundle/tmsdisk-rawdisk" \
    --daemon-tier-mib "$tier" --cases "$cases" 2>&1 | tee -a "$out/optim-run.txt"
  grep -hi "tier\|object" "$out/tmsdiskd-optim-$name.log" | tail -5 >>"$out/optim-run.txt"
  stop_node
}

phase full "$((state_mib + 1024))" resident pinned raw:raw_before ours:ours_full miles_warm miles_cold miles_cgroup
phase tier "$((gib * 1024))" ours:ours_tier
phase disk 0 raw ours:ours_disk

python3 "$bench" report --out "$json" | tee "$out/optim.txt"
exit "${PIPESTATUS[0]}"
