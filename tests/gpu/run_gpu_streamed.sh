#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: the streamed optimizer's rows that run_gpu_optim.sh does not give (issue 25), against one
# daemon with a host tier of STREAMED_TIER_MB on a fresh root (node.sh):
#   gpt2    torch_streamed_optim.py: a GPT-2-sized model (124 M fp32 parameters) for 50 steps with
#           buckets of 20 M elements, depth 3, torch.optim.AdamW(fused=True) beside StreamedAdamW(fused=True):
#           parameters bit-identical, and the state's peak device memory at most depth x bucket.
#   pause   torch_streamed_pause.py: a trainer with streamed state paused between steps: the pause moves
#           at most parameters + gradients + 1 %, and training goes on bit-identical.
#   fsdp2   torch_streamed_fsdp2.py under torchrun on one GPU (a mesh of one): local shards, outputs and
#           state_dict bit-identical to torch.optim.AdamW on the same fully_shard-ed model.
# Writes OUT_DIR/streamed.txt (each case's PASS/FAIL lines and exit status), each case's output beside it.
# About 4 minutes on an H200 node.
#   tests/gpu/run_gpu_streamed.sh BUNDLE_DIR OUT_DIR
# Environment: STREAMED_CASES ("gpt2 pause fsdp2"), STREAMED_TIER_MB (4096; 0: the state on disk).
set -uo pipefail  # not -e: every case runs and reports
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
mkdir -p "$out"
out=$(cd "$out" && pwd)
cases=" ${STREAMED_CASES:-gpt2 pause fsdp2} "
tier_mb=${STREAMED_TIER_MB:-4096}
report=$out/streamed.txt
: >"$report"
failed=0

# run NAME TIMEOUT_S CMD...: CMD under tmsctl run, its output in OUT_DIR/NAME.txt, its verdict in the report.
run() {
  local name=$1 t=$2 rc
  shift 2
  [[ $cases == *" $name "* ]] || return 0
  (cd "$out" && timeout -k 10 "$t" "$tmsctl" run --job "$name" -- "$@") >"$out/$name.txt" 2>&1
  rc=$?
  {
    echo "== $name (exit $rc): $*"
    grep -E '^(PASS|FAIL|SKIP)' "$out/$name.txt" || tail -n 5 "$out/$name.txt"
  } | tee -a "$report"
  [ "$rc" -eq 0 ] || failed=1
}

NODE_DAEMON_ARGS="--host-tier-mb $tier_mb" start_node "$1" "$out" streamed || exit 3
STREAM_FUSED=1 run gpt2 300 python3 "$here/torch_streamed_optim.py" 124 50 20 3
run pause 200 python3 "$here/torch_streamed_pause.py"
run fsdp2 200 torchrun --nproc-per-node 1 "$here/torch_streamed_fsdp2.py"
"$tmsctl" status >"$out/daemon-status.txt" 2>&1
stop_node
echo "result: $([ "$failed" -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$report"
exit $failed
