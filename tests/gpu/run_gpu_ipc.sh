#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Legacy CUDA IPC brokered by tmsdiskd on real GPUs: the two-process C program of the e2e test
# (tests/e2e/cuda_ipc.cpp, driven by ipc_check.py; again with the importer on GPU 1 when there are
# two) and PyTorch sharing a tensor with a spawned process (torch_ipc.py), each paused from outside
# while the memory is open elsewhere.
#   tests/gpu/run_gpu_ipc.sh BUNDLE_DIR OUT_DIR [GIB]
set -uo pipefail  # not -e: every case runs and reports
out=$2
gib=${3:-1}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" ipc || exit 1
export TMSCTL=$tmsctl TMSDISK_LOG=info

echo "== driver API, two processes" | tee "$out/ipc.txt"
python3 "$here/ipc_check.py" "$bundle/cuda_ipc" "$gib" >>"$out/ipc.txt" 2>"$out/ipc-c-shim.log"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  echo "== driver API, two processes, importer on GPU 1" | tee -a "$out/ipc.txt"
  python3 "$here/ipc_check.py" "$bundle/cuda_ipc" "$gib" 1 >>"$out/ipc.txt" 2>"$out/ipc-c-peer-shim.log"
fi
echo "== PyTorch, torch.multiprocessing" | tee -a "$out/ipc.txt"
"$tmsctl" run --job torch-ipc -- python3 "$here/torch_ipc.py" "$gib" >>"$out/ipc.txt" 2>"$out/ipc-torch-shim.log"
echo "== PyTorch, torch.multiprocessing, expandable segments (shared by VMM handle)" | tee -a "$out/ipc.txt"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$tmsctl" run --job torch-ipc-exp -- python3 "$here/torch_ipc.py" "$gib" \
  >>"$out/ipc.txt" 2>"$out/ipc-torch-exp-shim.log"
cat "$out/ipc.txt"
