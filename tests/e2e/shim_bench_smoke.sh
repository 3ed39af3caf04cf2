#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs tmsdisk-shim-bench on simcuda for correctness (CI has no GPU): 1 GiB paused and resumed through
# a real daemon, every byte verified; the figures themselves mean nothing here.
#   shim_bench_smoke.sh TMSDISKD TMSCTL BENCH SHIM SIMCUDA_DIR TMPDIR
set -euo pipefail
daemon=$1 tmsctl=$2 bench=$3 shim=$4 simcuda=$5 base=$6
mkdir -p "$base"
work=$(mktemp -d "$base/shim-bench.XXXXXX")
mkdir -p "$work/root"
export TMSDISK_SOCKET=$work/d.sock
"$daemon" --root "$work/root" --socket "$TMSDISK_SOCKET" --staging-budget-mb 32 --chunk-mb 4 --log-level warn &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
# Readiness: the daemon answers `tmsctl status` once its socket listens.
for _ in $(seq 500); do "$tmsctl" status >/dev/null 2>&1 && break; sleep 0.02; done
LD_LIBRARY_PATH=$simcuda SIMCUDA_STATE=$work/simcuda SIMCUDA_DEVICE_MEM_MB=3072 \
  "$bench" --dir "$work/root" --gib 1 --shim "$shim" --repeat 2
