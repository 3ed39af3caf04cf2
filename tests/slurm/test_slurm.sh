#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's Slurm recipe, end to end on simcuda: starts a one-node Slurm cluster of its
# own (munged, slurmctld and slurmd in the foreground, a generated slurm.conf, everything in a temp
# dir) and a tmsdiskd, then runs job.sh in a two-task allocation: two ranks launched by srun under
# `tmsctl run`, paused and resumed as a job by `srun --overlap --ntasks-per-node=1 tmsctl`. It checks
# that both ranks paused and resumed all their bytes, that status showed them paused with nothing
# resident, and that each rank found every byte intact afterwards.
#   test_slurm.sh TMSDISKD TMSCTL SHIM SIMCUDA_DIR CUDA_PATTERN TMPDIR
# Exits 77 (CTest: skipped), saying why, where Slurm or MUNGE is not installed. Root is not needed:
# the daemons run as the user who runs the test, and so do the job's steps.
set -euo pipefail
daemon=$1 tmsctl=$2 shim=$3 simcuda=$4 prog=$5 base=$6
here=$(cd "$(dirname "$0")" && pwd)

skip() {
  echo "SKIPPED: $*" >&2
  exit 77
}
for cmd in munged slurmctld slurmd salloc srun sinfo scontrol squeue scancel python3; do
  command -v "$cmd" >/dev/null ||
    skip "$cmd is not installed (Debian: apt-get install slurm-wlm munge python3)"
done

mkdir -p "$base"
work=$(mktemp -d "$base/slurm.XXXXXX")
mkdir -p "$work/munge" "$work/ctld" "$work/slurmd" "$work/root" "$work/job"
pids=()

fail() {
  echo "FAILED: $*" >&2
  for log in "$work"/job/* "$work"/*.log "$work/munge/munged.log"; do
    [[ -s $log ]] && { echo "--- last lines of $log" >&2; tail -n 30 "$log" >&2; }
  done
  exit 1
}

# The processes started from this test's cluster: every one whose environment names its slurm.conf
# (the daemons, salloc, job.sh, the steps' slurmstepd and tasks), found by pid, never by name. This
# shell exported SLURM_CONF after it started, so its own environment (and its subshells') does not.
leftovers() {
  local conf=${SLURM_CONF:-} p
  [[ -n $conf ]] || return 0
  for p in /proc/[0-9]*; do
    SLURM_CONF='' grep -qzxF "SLURM_CONF=$conf" "$p/environ" 2>/dev/null && echo "${p#/proc/}"
  done
  return 0
}

# Whether a process runs (a zombie, already ended, does not).
alive() {
  local state=
  [[ -r /proc/$1/stat ]] && read -r _ _ state _ <"/proc/$1/stat" 2>/dev/null
  [[ -n $state && $state != Z ]]
}

any_alive() {
  local p
  for p; do alive "$p" && return 0; done
  return 1
}

# Ends the given processes: SIGTERM, and SIGKILL for any that still run 5 s later (a stopped or
# wedged one does not act on SIGTERM, and waiting for it would hang the test).
terminate() {
  local p
  (($#)) || return 0
  kill "$@" 2>/dev/null
  for _ in $(seq 50); do
    any_alive "$@" || break
    sleep 0.1
  done
  for p; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
  return 0
}

cleanup() {
  local rc=$? i reversed=() left=()
  set +e
  # The job first, while slurmctld and slurmd can still end its steps: a slurmstepd outlives slurmd.
  if [[ -n ${SLURM_CONF:-} ]] && scontrol ping >/dev/null 2>&1; then
    scancel --partition tmsdisk 2>/dev/null
    for _ in $(seq 100); do
      [[ -z $(squeue -h -o %i 2>/dev/null) && -z $(scontrol listpids 2>/dev/null | tail -n +2) ]] && break
      sleep 0.1
    done
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do reversed+=("${pids[i]}"); done
  terminate "${reversed[@]}"
  wait 2>/dev/null
  # What is left of the job when slurmd died first: its slurmstepd stays, and its tasks until they give up.
  mapfile -t left < <(leftovers)
  terminate "${left[@]}"
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# Polls `what` every 0.1 s until it succeeds, at most `seconds`; fails naming `desc`.
wait_until() {
  local seconds=$1 desc=$2
  shift 2
  for _ in $(seq $((seconds * 10))); do
    "$@" >/dev/null 2>&1 && return 0
    for pid in "${pids[@]}"; do alive "$pid" || fail "a daemon (pid $pid) exited while waiting for $desc"; done
    sleep 0.1
  done
  fail "$desc not within $seconds s"
}

# --- MUNGE, with a key of its own: Slurm 22.05 authenticates every message with it. --force: munged
# would refuse a socket in a directory that others cannot search (a build tree under /root).
head -c 1024 /dev/urandom >"$work/munge/munge.key"
chmod 600 "$work/munge/munge.key"
munged --force --foreground --socket="$work/munge/munge.sock" --key-file="$work/munge/munge.key" \
  --log-file="$work/munge/munged.log" --pid-file="$work/munge/munged.pid" --seed-file="$work/munge/munged.seed" \
  2>"$work/munged.log" &
pids+=($!)
wait_until 20 "munged's socket" test -S "$work/munge/munge.sock"

# --- Slurm: one node, this host, its CPUs; free ports, so that a cluster on this machine is left alone.
# The daemons log to stderr (-D, no log file named), kept in $work/*.log.
node=$(hostname -s)
read -r ctld_port slurmd_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
export SLURM_CONF=$work/slurm.conf
: >"$work/plugstack.conf" # no SPANK plugins of this machine's /etc/slurm
cat >"$SLURM_CONF" <<EOF
ClusterName=tmsdisk
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/munge.sock
StateSaveLocation=$work/ctld
SlurmdSpoolDir=$work/slurmd
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
PlugStackConfig=$work/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=tmsdisk Nodes=$node Default=YES MaxTime=10 State=UP
EOF
slurmctld -D -f "$SLURM_CONF" 2>>"$work/slurmctld.log" &
pids+=($!)
wait_until 30 "slurmctld to answer" scontrol ping
slurmd -D -f "$SLURM_CONF" -N "$node" 2>>"$work/slurmd.log" &
pids+=($!)
node_idle() { [[ $(sinfo -h -n "$node" -o %T) == idle ]]; }
wait_until 30 "node $node to be idle" node_idle

# --- tmsdiskd, on a root of this test's own.
export TMSDISK_SOCKET=$work/tmsdiskd.sock TMSDISK_LIBRARY=$shim
"$daemon" --root "$work/root" --socket "$TMSDISK_SOCKET" --staging-budget-mb 32 --chunk-mb 4 --log-level warn \
  2>"$work/tmsdiskd.log" &
pids+=($!)
wait_until 20 "tmsdiskd to answer" "$tmsctl" status

# --- The job: job.sh in a two-task allocation (--overcommit: two tasks even on a one-CPU machine),
# tmsctl on its PATH, the ranks on simcuda (one ledger, as two processes sharing a GPU). Bounded
# twice: the allocation must come within 30 s, and the whole job within 100 s (it takes about one).
# In the background, so that a signal to this test ends it at once (bash runs traps between commands).
mib=16
PATH=$(dirname "$tmsctl"):$PATH LD_LIBRARY_PATH=$simcuda SIMCUDA_STATE=$work/simcuda SIMCUDA_DEVICE_MEM_MB=256 \
  timeout 100 salloc --immediate=30 --nodes=1 --ntasks=2 --overcommit --time=5 --job-name=tmsdisk-test \
  bash "$here/job.sh" "$prog" "$work/job" "$mib" >"$work/job.log" 2>&1 &
pids+=($!)
rc=0
wait "${pids[-1]}" || rc=$?
cat "$work/job.log"
((rc == 0)) || fail "the job failed (exit status $rc; 124: it ran past 100 s)"

# --- What it did.
python3 - "$work/job" "$((2 * mib << 20))" <<'EOF' || fail "the answers are not what the recipe should give"
import json, sys
d, per_rank = sys.argv[1], int(sys.argv[2])
job = open(f"{d}/job_id").read().strip()
def load(name):
    return json.load(open(f"{d}/{name}"))
problems = []
for name, verb in (("pause.json", "pause"), ("resume.json", "resume")):
    results = load(name)
    ranks = sorted(r["rank"] for r in results if r["job"] == job)
    if ranks != [0, 1] or len(results) != 2:
        problems.append(f"{verb}: ranks {ranks} of job {job} answered, in {len(results)} results; want 0 and 1")
    for r in results:
        done = r["ok"] and r["answered"] and r["outcome"] == "done"
        if not (done and r["bytes"] == per_rank and r["moved_bytes"] == per_rank):
            problems.append(f"{verb}: rank {r['rank']}: {r}")
        else:
            print(f"{verb}: rank {r['rank']} (pid {r['pid']}): {r['moved_bytes']} bytes moved")
status = [s for s in load("status.json") if s["job"] == job]
if sorted(s["rank"] for s in status) != [0, 1]:
    problems.append(f"status: ranks {[s['rank'] for s in status]} of job {job}; want 0 and 1")
for s in status:
    if s["state"] != "paused" or s["resident_bytes"] != 0 or s["paused_bytes"] != per_rank:
        problems.append(f"status while paused: rank {s['rank']}: state {s['state']}, "
                        f"resident {s['resident_bytes']}, paused {s['paused_bytes']}")
for rank in (0, 1):
    lines = open(f"{d}/rank{rank}.out").read().split("\n")
    if "ok 2" not in lines:
        problems.append(f"rank {rank}'s check after resume: {lines}")
    else:
        print(f"rank {rank}: every byte of its 2 allocations checked after resume")
for p in problems:
    print("  " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
echo "slurm recipe: job paused and resumed through srun --overlap, both ranks intact"
