#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# torchrun with NCCL on two GPUs: `tmsctl run` launches it, `tmsctl pause --job` pauses both ranks
# in their idle phase, a second process takes the freed memory of each GPU, `tmsctl resume --job`
# brings them back; training then continues and must end bit-identical to a run without the pause.
#   tests/gpu/run_gpu_ddp.sh BUNDLE_DIR OUT_DIR [STEPS]
set -uo pipefail  # not -e: every step runs and reports
out=$2
steps=${3:-20}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" ddp || exit 1

touch "$work/go-ref"
ref=$("$tmsctl" run --job ddp-ref -- torchrun --nproc-per-node 2 "$here/torch_ddp_idle.py" "$steps" "$work/go-ref" 2>"$out/ddp-ref.log" | grep final)
echo "reference: $ref" | tee "$out/ddp.txt"

coproc DDP { exec "$tmsctl" run --job ddp -- torchrun --nproc-per-node 2 "$here/torch_ddp_idle.py" "$steps" "$work/go" 2>"$out/ddp-shim.log"; }
got=""
while read -t 900 -r line <&"${DDP[0]}"; do
  case "$line" in
    idle)
      {
        "$tmsctl" status
        "$tmsctl" pause --job ddp; echo "pause exit $?"
        "$tmsctl" status
        CUDA_VISIBLE_DEVICES=0 python3 "$here/take_memory.py" 0.9
        CUDA_VISIBLE_DEVICES=1 python3 "$here/take_memory.py" 0.9
        "$tmsctl" resume --job ddp; echo "resume exit $?"
      } >>"$out/ddp.txt" 2>&1
      touch "$work/go" ;;
    final*) got=$line ;;
  esac
done
wait $DDP_PID 2>/dev/null
verdict=FAIL
[ -n "$got" ] && [ "$got" = "$ref" ] && verdict=PASS
echo "torchrun 2 ranks, NCCL: $verdict (reference ${ref#final }, paused run ${got#final })" | tee -a "$out/ddp.txt"
cat "$out/ddp.txt"
