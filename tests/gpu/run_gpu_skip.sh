#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: bytes that need not move (README.md, "What moves"). The zero-chunk scan is a PTX kernel
# compiled by the driver, so only a GPU checks it: an unmodified CUDA program holds mostly-zero
# memory with single non-zero bytes placed at the edges the kernel must not miss (the last byte of a
# chunk, the last byte of an allocation of odd size); it is paused, another process takes the
# memory, and after the resume every byte is compared (zeros included). A second pause of unchanged
# memory rewrites nothing. Then JAX with its default preallocation (75% of the GPU) pauses and
# resumes bit for bit, and PyTorch's free cached blocks are handed back before a pause
# (torch_cache.py), and kept with `tmsctl run --keep-torch-cache`.
#   tests/gpu/run_gpu_skip.sh BUNDLE_DIR OUT_DIR
set -uo pipefail  # not -e: every section runs and reports
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" skip || exit 1
chunk=$((8 << 20))  # the daemon's default chunk-mb

echo "== 1. mostly-zero memory: non-zero bytes at chunk edges" | tee "$out/skip.txt"
coproc PROG { exec "$tmsctl" run --job skip -- "$bundle/cuda_pattern" 2>>"$out/skip-shim.log"; }
ask() { echo "$1" >&"${PROG[1]}"; read -t 900 -r a <&"${PROG[0]}"; echo "$a"; }
read -t 300 -r ready <&"${PROG[0]}"; echo "program: $ready" >>"$out/skip.txt"
{
  # 8 GiB, the pattern in the first 4 KiB of every GiB; then one byte at the end of chunks 3 and
  # 700, and the last byte of the allocation.
  ask "alloc 1 8589934592 direct sparse 1073741824"
  for off in $((4 * chunk - 1)) $((701 * chunk - 1)) $((8589934592 - 1)); do echo "edit 1 $off: $(ask "edit 1 $off")"; done
  # 1 GiB + 4099 bytes, all zero but its very last byte (past the last 16-byte boundary).
  ask "alloc 2 1073745923 direct sparse 0"
  echo "edit 2 last byte: $(ask 'edit 2 1073745922')"
  # 4 GiB of pattern everywhere: every chunk is data.
  ask "alloc 3 4294967296 direct"
  echo "check before: $(ask check)"
  "$tmsctl" --json pause --job skip | tee "$out/skip-pause.json"
  "$tmsctl" status
  "$bundle/cuda_probe" 12000
  "$tmsctl" --json resume --job skip | tee "$out/skip-resume.json"
  echo "check after resume: $(ask check)"
  "$tmsctl" --json pause --job skip | tee "$out/skip-pause-unchanged.json"
  "$tmsctl" resume --job skip
  echo "check after an unchanged pause: $(ask check)"
  ask exit >/dev/null || true
} >>"$out/skip.txt" 2>&1
wait $PROG_PID 2>/dev/null || true
python3 - "$out" >>"$out/skip.txt" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
p = json.load(open(f"{out}/skip-pause.json"))[0]
u = json.load(open(f"{out}/skip-pause-unchanged.json"))[0]
chunk = 8 << 20
# Data chunks: 8 of allocation 1 (one per GiB) + 2 edited ones + its last; allocation 2's last; all
# 512 of allocation 3.
want_zero = 8589934592 - 11 * chunk + 128 * chunk
print("zero bytes", p["zero_bytes"], "expected", want_zero, "PASS" if p["zero_bytes"] == want_zero else "FAIL")
print("unchanged pause: moved", u["moved_bytes"], "unchanged", u["unchanged_bytes"],
      "PASS" if u["moved_bytes"] == 0 and u["unchanged_bytes"] == p["moved_bytes"] else "FAIL")
PY

echo "== 2. JAX with its default preallocation" | tee -a "$out/skip.txt"
unset XLA_PYTHON_CLIENT_PREALLOCATE
TMSCTL=$tmsctl "$tmsctl" run --job jax-prealloc -- python3 "$here/frameworks.py" jax >>"$out/skip.txt" 2>"$out/jax-shim.log" ||
  echo "FAIL jax-prealloc: exited $? (see jax-shim.log)" >>"$out/skip.txt"
echo "== 3. PyTorch's free cached blocks are not moved" | tee -a "$out/skip.txt"
TMSCTL=$tmsctl "$tmsctl" run --job torch-cache -- python3 "$here/torch_cache.py" 4 >>"$out/skip.txt" 2>"$out/torch-cache-shim.log" ||
  echo "FAIL torch-cache: exited $? (see torch-cache-shim.log)" >>"$out/skip.txt"
TMSCTL=$tmsctl "$tmsctl" run --keep-torch-cache --job torch-kept -- python3 "$here/torch_cache.py" 4 keep \
  >>"$out/skip.txt" 2>"$out/torch-kept-shim.log" || echo "FAIL torch-kept: exited $? (see torch-kept-shim.log)" >>"$out/skip.txt"
cat "$out/skip.txt"
