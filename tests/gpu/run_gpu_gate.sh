#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Pausing PyTorch at any moment: a training loop that never waits for us is paused and resumed from
# outside mid-loop (default allocator, then expandable segments), and must end bit-identical to the
# same loop run without a pause.
#   tests/gpu/run_gpu_gate.sh BUNDLE_DIR OUT_DIR [STEPS]
set -uo pipefail  # not -e: every case runs and reports
out=$2
steps=${3:-60}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" gate || exit 1

for alloc in default expandable; do
  conf=""
  [ "$alloc" = expandable ] && conf="expandable_segments:True"
  ref=$(PYTORCH_CUDA_ALLOC_CONF=$conf "$tmsctl" run --job ref-$alloc -- python3 "$here/torch_continuous.py" "$steps" | grep final)
  coproc TRAIN { PYTORCH_CUDA_ALLOC_CONF=$conf exec "$tmsctl" run --job gate-$alloc -- python3 "$here/torch_continuous.py" "$steps" 2>>"$out/gate-$alloc-shim.log"; }
  paused=""
  while read -t 600 -r line <&"${TRAIN[0]}"; do
    case "$line" in
      "step 10 "*)
        "$tmsctl" --json pause --job "gate-$alloc" >"$out/gate-$alloc-pause.json" 2>&1
        "$tmsctl" status >>"$out/gate-$alloc.txt" 2>&1
        python3 "$here/take_memory.py" 0.9 >>"$out/gate-$alloc.txt" 2>&1
        "$tmsctl" --json resume --job "gate-$alloc" >"$out/gate-$alloc-resume.json" 2>&1
        paused=yes ;;
      final*) got=$line ;;
    esac
  done
  wait $TRAIN_PID 2>/dev/null
  verdict=FAIL
  [ -n "$paused" ] && [ "${got:-none}" = "$ref" ] && verdict=PASS
  echo "$alloc allocator: $verdict (reference ${ref#final }, paused run ${got#final })" | tee -a "$out/gate.txt"
  cat "$out/gate-$alloc-pause.json" "$out/gate-$alloc-resume.json" >>"$out/gate.txt" 2>/dev/null
  cat "$out/gate-$alloc.txt" >>"$out/gate.txt" 2>/dev/null
done
cat "$out/gate.txt"
