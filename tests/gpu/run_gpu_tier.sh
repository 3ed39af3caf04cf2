#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: the node's host-memory tier (README.md, "The host tier"). The shim bench pauses and
# resumes 8 GiB three times against a daemon whose tier holds all of it, then against one whose tier
# holds half, each run measuring in the same process the pinned copy bandwidth and the raw O_DIRECT
# disk bandwidth to compare with. The first pause makes and pins the tier's memory; the later ones
# reuse what the rank kept (host-tier-keep): both are reported.
# Then four ranks of 4 GiB pause together under a budget for two: the tier never holds more than the
# budget, and every rank's memory is checked after the resume. Last, a PyTorch rank with 16 GiB of
# tensors and 4 GiB of cache (torch_tier_size.py): the memory it keeps after its first pause is sized
# by what that pause placed in the tier, not by what it asked for ahead of it.
# About 7 minutes on an H200 node: give it a call of its own, or a limit of 480 s or more.
#   tests/gpu/run_gpu_tier.sh BUNDLE_DIR OUT_DIR
# Environment: TIER_CASES ("full half four torch": the parts to run; the full/half comparison needs both).
set -uo pipefail  # not -e: every section runs and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
gib=8
report=$out/tier.txt
cases=" ${TIER_CASES:-full half four torch} "
: >"$report"

bench() {  # BUDGET_MIB NAME
  NODE_DAEMON_ARGS="--host-tier-mb $1" start_node "$bundle_dir" "$out" "tier-$2" || return 1
  echo "== shim bench, $gib GiB, host tier of $1 MiB" | tee -a "$report"
  TMSDISK_LOG=info "$bundle/tmsdisk-shim-bench" --dir "$work/root" --gib $gib --shim "$bundle/libtmsdisk.so" --repeat 3 --json \
    >"$out/bench-$2.json" 2>"$out/bench-$2.err" || echo "FAIL: shim bench failed (bench-$2.err)" >>"$report"
  grep -h "host tier\|pause:\|resume:" "$out/bench-$2.err" | tail -8 >>"$report"
  stop_node
}
[[ $cases == *" full "* ]] && bench "$((gib * 1024 + 1024))" full
[[ $cases == *" half "* ]] && bench "$((gib * 512))" half

[[ $cases == *" full "* && $cases == *" half "* ]] && python3 - "$out" >>"$report" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
full = json.load(open(f"{out}/bench-full.json"))
half = json.load(open(f"{out}/bench-half.json"))
f, h = full["with_shim"], half["with_shim"]
d2h, h2d = full["without_shim"]["d2h_gb_s"], full["without_shim"]["h2d_gb_s"]
first = f["passes"][0]
print(f"full tier, first pause (memory made and pinned): pause {first['pause_gb_s']:.2f} GB/s = "
      f"{first['pause_gb_s'] / d2h:.2f} x pinned D2H; resume {first['resume_gb_s']:.2f} GB/s = "
      f"{first['resume_gb_s'] / h2d:.2f} x pinned H2D")
for i, p in enumerate(f["passes"][1:], 2):
    print(f"full tier, pause {i} (kept memory reused): pause {p['pause_gb_s']:.2f} GB/s = {p['pause_gb_s'] / d2h:.2f} x "
          f"pinned D2H ({d2h:.1f}); resume {p['resume_gb_s']:.2f} GB/s = {p['resume_gb_s'] / h2d:.2f} x pinned H2D "
          f"({h2d:.1f}); goal >= 0.7")
print(f"full tier best: pause {f['pause_gb_s'] / d2h:.2f} x pinned D2H, resume {f['resume_gb_s'] / h2d:.2f} x pinned H2D; "
      f"intact {f['intact']}")
size = f["paused_bytes"]
for op, raw in (("pause", "raw_write_gb_s"), ("resume", "raw_read_gb_s")):
    tier_s = size / 2 / (f[f"{op}_gb_s"] * 1e9)
    disk_s = size / 2 / (h[raw] * 1e9)
    took = size / (h[f"{op}_gb_s"] * 1e9)
    print(f"half tier {op}: {took:.2f} s; half at the tier's speed + half at the raw disk's = "
          f"{tier_s:.2f} + {disk_s:.2f} = {tier_s + disk_s:.2f} s; ratio {took / (tier_s + disk_s):.2f} (goal <= 1.10); "
          f"intact {h['intact']}")
PY

if [[ $cases == *" torch "* ]]; then
  echo "== PyTorch: 16 GiB of tensors, 4 GiB of cache; host tier of 24 GiB" | tee -a "$report"
  if NODE_DAEMON_ARGS="--host-tier-mb 24576" start_node "$bundle_dir" "$out" tier-torch; then
    TMSCTL=$tmsctl TMSDISK_LOG=info timeout 300 "$tmsctl" run --job tiersize -- python3 "$here/torch_tier_size.py" \
      >"$out/torch-tier-size.log" 2>&1 || echo "FAIL: torch_tier_size.py (torch-tier-size.log)" >>"$report"
    grep -h "^PASS\|^FAIL\|ahead of the first\|after the first\|pauses:" "$out/torch-tier-size.log" >>"$report"
    grep -h "granted\|reuses\|released" "$out/tmsdiskd-tier-torch.log" | tail -6 >>"$report"
    stop_node
  fi
fi

if [[ $cases != *" four "* ]]; then cat "$report"; exit 0; fi
echo "== four ranks of 4 GiB, a budget for two (8 GiB)" | tee -a "$report"
NODE_DAEMON_ARGS="--host-tier-mb 8192" start_node "$bundle_dir" "$out" tier-ranks || exit 1
pids=()
for r in 0 1 2 3; do
  mkfifo "$work/in$r" "$work/out$r"
  RANK=$r "$tmsctl" run --job four -- "$bundle/cuda_pattern" <"$work/in$r" >"$work/out$r" 2>>"$out/four-shim.log" &
  pids+=($!)
  exec {fd}>"$work/in$r"
  eval "in$r=$fd"
  exec {fd}<"$work/out$r"
  eval "out$r=$fd"
done
ask() {  # RANK COMMAND
  local i o
  eval "i=\$in$1 o=\$out$1"
  echo "$2" >&"$i"
  read -t 600 -r a <&"$o"
  echo "$a"
}
for r in 0 1 2 3; do
  eval "o=\$out$r"
  read -t 300 -r ready <&"$o"
  echo "rank $r: $ready, alloc $(ask $r 'alloc 1 4294967296 direct')" >>"$report"
done
"$tmsctl" --json pause --job four >"$out/four-pause.json"
"$tmsctl" status >>"$report"
"$tmsctl" --json resume --job four >"$out/four-resume.json"
for r in 0 1 2 3; do echo "rank $r check: $(ask $r check)" >>"$report"; ask $r exit >/dev/null; done
wait "${pids[@]}" 2>/dev/null
python3 - "$out" >>"$report" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
p = json.load(open(f"{out}/four-pause.json"))
r = json.load(open(f"{out}/four-resume.json"))
host = sum(x["host_bytes"] for x in p)
print("pause per rank (host, disk):", [(x["host_bytes"] >> 20, x["moved_bytes"] >> 20) for x in p], "MiB")
print("sum in the tier", host >> 20, "MiB of a budget of 8192:", "PASS" if host <= 8192 << 20 and len(p) == 4 else "FAIL")
print("resume:", "PASS" if all(x["ok"] for x in r) and len(r) == 4 else "FAIL")
PY
cat "$report"
