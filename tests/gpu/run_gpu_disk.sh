#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The disk-only figures of README.md's "Performance" on a GPU node. 1: the shim bench pauses and
# resumes DISK_GIB (16) GiB of random data through a daemon with its defaults (no host tier),
# DISK_REPEAT (3) times, each pass right after a raw O_DIRECT pass of its own; the daemon's peak
# resident memory (VmHWM) is read once the bench is done. 2: the session bench streams
# DISK_SESSION_GIB (32) GiB through a daemon of its own and reports that daemon's peak resident memory
# against its staging budget (goal: budget + 64 MiB). On an H200 node part 1 takes about 7 minutes
# with the defaults and part 2 about 3 (2026-12-01): give each a call of its own (DISK_PARTS).
#   tests/gpu/run_gpu_disk.sh BUNDLE_DIR OUT_DIR
# Environment: DISK_PARTS ("shim session": the parts to run), DISK_GIB, DISK_REPEAT, DISK_SESSION_GIB.
set -uo pipefail  # not -e: both parts run and report
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
gib=${DISK_GIB:-16}
repeat=${DISK_REPEAT:-3}
session_gib=${DISK_SESSION_GIB:-32}
parts=" ${DISK_PARTS:-shim session} "
report=$out/disk.txt
mkdir -p "$out"
: >"$report"

if [[ $parts == *" shim "* ]]; then
start_node "$bundle_dir" "$out" disk || exit 1
echo "== shim bench, $gib GiB x $repeat, disk only" | tee -a "$report"
"$bundle/tmsdisk-shim-bench" --dir "$work/root" --gib "$gib" --shim "$bundle/libtmsdisk.so" --repeat "$repeat" --json \
  >"$out/shim-disk.json" 2>"$out/shim-disk.err" || echo "FAIL: shim bench failed (shim-disk.err)" >>"$report"
echo "daemon peak RSS during the bench: $(awk '/VmHWM/ {print $2, $3}' "/proc/$node_daemon/status")" >>"$report"
stop_node
python3 - "$out/shim-disk.json" >>"$report" 2>&1 <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["with_shim"]
print("pass by pass (pause / raw write just before, resume / raw read just before):")
for i, p in enumerate(s["passes"], 1):
    print(f"  pass {i}: pause {p['pause_gb_s']:.2f} GB/s / {p['raw_write_gb_s']:.2f} = {p['pause_gb_s'] / p['raw_write_gb_s']:.2f}; "
          f"resume {p['resume_gb_s']:.2f} GB/s / {p['raw_read_gb_s']:.2f} = {p['resume_gb_s'] / p['raw_read_gb_s']:.2f}")
print("ratios:", json.dumps(r["ratios"]))
print("intact:", s["intact"])
PY
fi

if [[ $parts == *" session "* ]]; then
bundle=$(cd "$bundle_dir" && pwd)
export TMSDISK_DAEMON=$bundle/tmsdiskd  # the bench starts a daemon of its own
echo "== session bench, $session_gib GiB, its own daemon" | tee -a "$report"
sdir=/var/tmp/tmsdisk-gpu-session
rm -rf "$sdir" && mkdir -p "$sdir"
"$bundle/tmsdisk-session-bench" "$sdir" --gib "$session_gib" --repeat 1 >>"$report" 2>&1 ||
  echo "FAIL: session bench failed" >>"$report"
rm -rf "$sdir"
fi
cat "$report"
