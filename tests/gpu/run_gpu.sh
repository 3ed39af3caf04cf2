#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU-node checks, with prebuilt binaries (tests/gpu/bundle.sh makes them): an unmodified CUDA
# program and an unmodified PyTorch training script paused and resumed through tmsctl while a second
# process takes the freed memory, then the shim and session benchmarks on the same directory.
#   tests/gpu/run_gpu.sh BUNDLE_DIR OUT_DIR [TORCH_LAYERS]
# Environment: GPU_BENCHES ("shim session": the benchmarks to run after the two programs; "" for none),
# BENCH_GIB (8) and BENCH_REPEAT (3): their size and passes (the shim benchmark at 8 GiB x 3 takes
# over 5 minutes on an H200 node's disk).
set -uo pipefail  # not -e: every section runs and reports, whatever an earlier one did
out=$2
layers=${3:-6}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" main || exit 1

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  uname -r
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  df -h /var/tmp | tail -1
} >"$out/machine.txt" 2>&1

echo "== 1. unmodified CUDA program (driver API, three allocation paths)" | tee "$out/cuda.txt"
coproc PROG { exec "$tmsctl" run --job cuda -- "$bundle/cuda_pattern" 2>>"$out/cuda-shim.log"; }
ask() { echo "$1" >&"${PROG[1]}"; read -t 900 -r a <&"${PROG[0]}"; echo "$a"; }
read -t 300 -r ready <&"${PROG[0]}"; echo "program: $ready" >>"$out/cuda.txt"
{
  ask "alloc 1 4294967296 direct"
  ask "alloc 2 2147483648 procaddr"
  ask "alloc 3 1073745920 dlsym"
  ask "alloc 4 65536 direct"
  echo "free MiB before pause: $("$bundle/cuda_probe" free)"
  "$tmsctl" pause --job cuda
  "$tmsctl" status
  echo "free MiB while paused: $("$bundle/cuda_probe" free)"
  "$bundle/cuda_probe" 6500
  "$tmsctl" resume --job cuda
  echo "check: $(ask check)"
  echo "addr 1: $(ask 'addr 1')"
  ask exit >/dev/null || true
} >>"$out/cuda.txt" 2>&1
wait $PROG_PID 2>/dev/null || true

echo "== 2. unmodified PyTorch training (Adam), paused from outside" | tee "$out/torch.txt"
coproc TORCH { exec "$tmsctl" run --job torch -- python3 "$here/torch_train.py" "$layers" 2>>"$out/torch-shim.log"; }
tsk() { echo "$1" >&"${TORCH[1]}"; read -t 900 -r a <&"${TORCH[0]}"; echo "$a"; }
read -t 300 -r ready <&"${TORCH[0]}"
{
  echo "script: $ready"
  echo "free before pause: $(python3 -c 'import torch; print(torch.cuda.mem_get_info()[0] >> 20)') MiB"
  "$tmsctl" --json pause --job torch | tee "$out/torch-pause.json"
  "$tmsctl" status
  python3 "$here/take_memory.py" 0.9
  "$tmsctl" --json resume --job torch | tee "$out/torch-resume.json"
  echo "check: $(tsk check)"
  echo "training goes on: $(tsk step)"
  echo "check after step: $(tsk check)"
  "$tmsctl" pause --job torch && "$tmsctl" resume --job torch
  echo "check after a second cycle: $(tsk check)"
  tsk exit >/dev/null || true
} >>"$out/torch.txt" 2>&1
wait $TORCH_PID 2>/dev/null || true

benches=" ${GPU_BENCHES-shim session} "
echo "== 3. benchmarks on $work/root:$benches" | tee "$out/bench.txt"
# Repeated passes, each beside a raw pass of its own: the disk drifts by more than what is measured.
[[ $benches == *" shim "* ]] && { "$bundle/tmsdisk-shim-bench" --dir "$work/root" --gib "${BENCH_GIB:-8}" --shim "$bundle/libtmsdisk.so" \
  --repeat "${BENCH_REPEAT:-3}" --json \
  >"$out/shim-bench.json" 2>"$out/shim-bench.err" || echo "shim bench failed" >>"$out/bench.txt"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["ratios"]; print("shim bench:", json.dumps(r))' \
  "$out/shim-bench.json" >>"$out/bench.txt" 2>&1 || true; }
[[ $benches == *" session "* ]] && { "$bundle/tmsdisk-session-bench" "$work/root" --gib "${BENCH_GIB:-8}" --repeat "${BENCH_REPEAT:-3}" >>"$out/bench.txt" 2>&1 ||
  echo "session bench failed" >>"$out/bench.txt"; }
cat "$out/cuda.txt" "$out/torch.txt" "$out/bench.txt"
