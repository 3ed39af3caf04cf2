#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job, end to end: build, start a daemon on a temp directory, launch a CUDA program with
# `tmsctl run`, fill its device memory, `tmsctl pause` it, show the memory is free for another
# process, `tmsctl resume` it and check every byte at the same addresses.
# Uses the real driver when a GPU is present, otherwise the simulated one (and says so).
#
#   scripts/demo.sh [GIB]      GIB: device memory the program fills (default 4 on a GPU, 0.25 simulated)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target tmsdiskd tmsctl tmsdisk cuda_pattern cuda_probe simcuda

work=$(mktemp -d "${TMSDISK_DEMO_DIR:-/var/tmp}/tmsdisk-demo.XXXXXX")
daemon_pid=""
cleanup() {
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  mode="GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), real driver)"
  gib=${1:-4}
else
  mode="SIMULATED DRIVER (no GPU found: simcuda, host memory with real virtual-memory semantics)"
  gib=${1:-0.25}
  export LD_LIBRARY_PATH="$PWD/build/simcuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMCUDA_STATE="$work/simcuda-state" SIMCUDA_DEVICE_MEM_MB=512
fi
bytes=$(awk -v g="$gib" 'BEGIN { printf "%d", g * 1073741824 }')
echo "== tmsdisk demo: $mode; $gib GiB"

mkdir -p "$work/root"
export TMSDISK_SOCKET="$work/tmsdiskd.sock"
build/daemon/tmsdiskd --root "$work/root" --socket "$TMSDISK_SOCKET" --log-level warn &
daemon_pid=$!
for _ in $(seq 100); do build/tools/tmsctl/tmsctl status >/dev/null 2>&1 && break; sleep 0.1; done
build/tools/tmsctl/tmsctl status >/dev/null

# The program reads commands on stdin and answers one line each (see tests/e2e/cuda_pattern.cpp).
coproc PROG { exec build/tools/tmsctl/tmsctl run --job demo -- build/tests/e2e/cuda_pattern; }
ask() { echo "$1" >&"${PROG[1]}"; read -r answer <&"${PROG[0]}"; echo "$answer"; }
read -r ready <&"${PROG[0]}"
[ "$ready" = ready ] || { echo "program did not start: $ready"; exit 1; }

alloc=$(ask "alloc 1 $bytes direct")
echo "program allocated and filled $gib GiB at ${alloc##* }"
free_before=$(build/tests/e2e/cuda_probe free)

build/tools/tmsctl/tmsctl pause --job demo
build/tools/tmsctl/tmsctl status
free_paused=$(build/tests/e2e/cuda_probe free)
echo "device free memory: $free_before MiB before the pause, $free_paused MiB while paused"
want=$(( bytes / 1048576 * 9 / 10 ))
build/tests/e2e/cuda_probe "$want"   # another process takes most of what the pause freed

build/tools/tmsctl/tmsctl resume --job demo
check=$(ask check)
addr=$(ask "addr 1")
ask exit >/dev/null || true
if [ "$check" = "ok 1" ] && [ "${addr#ok }" = "${alloc##* }" ]; then
  echo "== PASS ($mode): every byte restored at ${addr#ok }"
else
  echo "== FAIL: check said '$check', address '$addr' (was ${alloc##* })"
  exit 1
fi
