#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's Slurm recipe as a job script (test_slurm.sh runs it with salloc, inside a two-task
# allocation; `tmsctl` is on PATH): two ranks launched by srun under `tmsctl run`, then the whole job
# paused and resumed by one `tmsctl` per node, each started by `srun --overlap`. The answers go to
# DIR for test_slurm.sh to check: pause.json, status.json, resume.json, and the ranks' rank<R>.out.
#   job.sh CUDA_PATTERN DIR MIB
set -euo pipefail
prog=$1 dir=$2 mib=$3
here=$(cd "$(dirname "$0")" && pwd)
echo "$SLURM_JOB_ID" >"$dir/job_id"

# The ranks: the shim is preloaded into each task (and its children); the job's name is Slurm's job
# id, the rank Slurm's SLURM_PROCID.
srun tmsctl run --job "$SLURM_JOB_ID" -- bash "$here/rank.sh" "$prog" "$dir" "$mib" &
ranks=$!

# Both ranks have allocated and filled their memory: two "ok ID 0xADDR" lines each, within 30 s.
allocated() { [[ $(grep -c '^ok [12] 0x' "$dir/rank$1.out" 2>/dev/null) == 2 ]]; }
for _ in $(seq 300); do
  allocated 0 && allocated 1 && break
  kill -0 "$ranks" 2>/dev/null || { echo "job.sh: the ranks' srun ended before they allocated" >&2; exit 1; }
  sleep 0.1
done
if ! { allocated 0 && allocated 1; }; then
  echo "job.sh: the ranks did not allocate within 30 s" >&2
  exit 1
fi

# One tmsctl per node of the job, as a step beside the ranks' step: --overlap lets it share the CPUs
# the ranks hold; each pauses the job's ranks on its node through that node's daemon. --ntasks: srun
# takes the job's task count from SLURM_NTASKS, and with more tasks than nodes it ignores
# --ntasks-per-node=1 (a warning) and starts as many tmsctl as ranks, which then race.
per_node=(srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1)
"${per_node[@]}" tmsctl --json --timeout 20 pause --job "$SLURM_JOB_ID" >"$dir/pause.json"
"${per_node[@]}" tmsctl --json --timeout 20 status >"$dir/status.json"
"${per_node[@]}" tmsctl --json --timeout 20 resume --job "$SLURM_JOB_ID" >"$dir/resume.json"

# The ranks check their memory and exit.
touch "$dir/resumed"
wait "$ranks"
