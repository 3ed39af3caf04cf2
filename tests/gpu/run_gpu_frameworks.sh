#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# PyTorch with CUDA graphs, JAX and CuPy, each unmodified, paused and resumed from outside mid-run
# while another process takes the freed memory, and compared bit for bit with an unpaused run
# (frameworks.py).
#   tests/gpu/run_gpu_frameworks.sh BUNDLE_DIR OUT_DIR
set -uo pipefail  # not -e: every framework runs and reports
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" frameworks || exit 1
export TMSCTL=$tmsctl
# JAX would otherwise reserve 75% of the GPU at start, and a pause would write it all to disk.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

: >"$out/frameworks.txt"
for kind in torch-graphs jax cupy; do
  "$tmsctl" run --job "fw-$kind" -- python3 "$here/frameworks.py" "$kind" >>"$out/frameworks.txt" 2>"$out/$kind-shim.log" ||
    echo "FAIL $kind: exited $? (see $kind-shim.log)" >>"$out/frameworks.txt"
done
cat "$out/frameworks.txt"
