#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One rank of the Slurm test (job.sh starts two with srun, under `tmsctl run`): an unmodified CUDA
# program, cuda_pattern, fills two allocations with its pattern, then waits until the job script has
# paused and resumed the job (the file DIR/resumed appears) and checks every byte.
#   rank.sh CUDA_PATTERN DIR MIB
# Its answers go to DIR/rank<SLURM_PROCID>.out: "ready", "ok 1 0x...", "ok 2 0x...", then "ok 2".
set -euo pipefail
prog=$1 dir=$2 mib=$3
out=$dir/rank$SLURM_PROCID.out

# Waits for a file by polling, at most 60 s, as long as job.sh's three tmsctl steps may take (20 s
# each): a rank that waited forever would hold the job until Slurm's time limit.
wait_for() {
  for _ in $(seq 600); do
    [[ -e $1 ]] && return 0
    sleep 0.1
  done
  echo "rank $SLURM_PROCID: $1 did not appear within 60 s" >&2
  return 1
}

# The commands reach cuda_pattern's stdin in order; `check` only once the job has been resumed. If
# the wait fails, cuda_pattern reads the end of its input and exits, and so does this rank.
{
  echo "alloc 1 $((mib << 20)) direct"
  echo "alloc 2 $((mib << 20)) procaddr"
  wait_for "$dir/resumed"
  echo check
  echo exit
} | "$prog" >"$out"
