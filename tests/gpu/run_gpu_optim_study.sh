#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What the moments' dtype of tmsdisk.optim's StreamedAdamW does to training (moment_dtype_study.py): a
# GPT-2-shaped model trained four times with its optimizer state in the daemon's store: fp32 moments with
# two data orders (the noise floor), bf16 and fp8 moments. Losses per step in OUT_DIR/moment_dtype_study.csv,
# the summary in OUT_DIR/moment_dtype_study.txt.
#   tests/gpu/run_gpu_optim_study.sh BUNDLE_DIR OUT_DIR [moment_dtype_study.py's options...]
set -uo pipefail
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
start_node "$1" "$out" optim-study || exit 1
shift 2
"$tmsctl" run --job optim-study -- python3 "$here/moment_dtype_study.py" --csv "$out/moment_dtype_study.csv" "$@" \
  2>"$out/optim-study-shim.log" | tee "$out/moment_dtype_study.txt"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "FAIL: moment_dtype_study.py exited $status (see optim-study-shim.log)"
exit "$status"
