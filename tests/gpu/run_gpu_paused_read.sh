#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: paused memory read without a resume (tmsdisk.read_paused), and read back into the host tier
# ahead of a resume (tmsdisk.prefetch). Two parts, each against daemons on a fresh root (node.sh):
#   sync      the weight sync of a paused trainer (torch_weight_sync.py): ~4 GiB of bf16 parameters in
#             tmsdisk.region("weights"), paused, every one read back with read_paused(p) and
#             read_paused(p, zero_copy=True) and compared byte for byte with its copy taken before the
#             pause; GB/s of the reads with the host tier holding all of them (a daemon with
#             --host-tier-mb above their size), and from disk only (a daemon without a tier, and
#             TMSDISK_HOST_TIER=0); beside them, torch_memory_saver's (TMS) get_cpu_backup on the same
#             tensors from its pinned CPU backup, in a process of its own without libtmsdisk.so (TMS
#             built on the node from TMS_SRC_DIR, hook mode preload, as run_gpu_tms_compare.sh runs it).
#   prefetch  torch_prefetch_resume.py: PREFETCH_GIB GiB of fp32 tensors in a tag, under a daemon whose
#             tier holds all of it (phase full: the tier-only resume, the resume from disk without a
#             prefetch, and the resume after tmsdisk.prefetch(tag, wait=True) of the tag paused to disk),
#             then under one whose tier holds half of it (phase half: the resume from disk and the one
#             after a prefetch, which brings half). Goals: resume after prefetch / tier-only resume <=
#             1.2; with half a tier, the resume after prefetch within 10 % of its bytes from the tier at
#             the tier-only rate (phase full) plus the rest from disk at the disk rate (phase half's own
#             resume from disk, nearest in time, decides; phase full's is shown too).
# Writes OUT_DIR/paused_read.txt (the table of GB/s and PASS/FAIL of the byte comparisons, the resume
# ratios), the programs' JSON and logs beside it, and OUT_DIR/paused_read-logs.tar.gz. Exit status 0 when
# every tmsdisk run finished with its bytes equal and placed as its case says, whatever the ratios (they
# are reported against their goals) and whatever TMS did (reported beside).
# About 3 minutes for sync (TMS's build included) and 3 for prefetch on an H200 with a 1.7 GB/s disk.
#   tests/gpu/run_gpu_paused_read.sh BUNDLE_DIR OUT_DIR [TMS_SRC_DIR]
# Environment: PAUSED_READ_CASES ("sync prefetch"), WS_GIB (4: GiB of parameters, an integer), WS_REPEATS
# (2: passes of each read mode), WS_TMS (1; 0: no TMS run), PREFETCH_GIB (16, an integer),
# PREFETCH_TENSOR_MIB (1024: each tensor), PREFETCH_REPEATS (2: runs of the tier-only and the prefetch
# cases; the best counts), PAUSED_READ_DEADLINE_S (570: seconds from the start after which no run starts and each run is cut
# short, so that the whole fits in a 10-minute command), NODE_DISK (/var/tmp: the daemons' roots).
set -uo pipefail  # not -e: every part runs and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
tms_src=$(cd "${3:-$here/../../gpu-extra/tms-src}" 2>/dev/null && pwd) || tms_src=""
cases=" ${PAUSED_READ_CASES:-sync prefetch} "
ws_gib=${WS_GIB:-4}
ws_repeats=${WS_REPEATS:-2}
ws_tms=${WS_TMS:-1}
pf_gib=${PREFETCH_GIB:-16}
pf_tensor_mib=${PREFETCH_TENSOR_MIB:-1024}
pf_repeats=${PREFETCH_REPEATS:-2}
deadline=$((SECONDS + ${PAUSED_READ_DEADLINE_S:-570}))
mkdir -p "$out"
out=$(cd "$out" && pwd)
bundle_dir=$(cd "$bundle_dir" && pwd -P) || exit 1
. "$here/node.sh"
export PYTHONUNBUFFERED=1 TMSDISK_LOG=info
unset TMS_DISK_BACKUP_DIR TMS_DISK_BACKUP_CHUNK_MB TMSDISK_HOST_TIER
report=$out/paused_read.txt
failed=0

# Seconds the next run may take: what is left before the deadline, less 20 s for the summary.
budget() {
  local left=$((deadline - SECONDS - 20))
  [ "$left" -gt 30 ] && echo "$left" || echo 0
}

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  uname -r
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  df -h "${NODE_DISK:-/var/tmp}" | tail -1
  findmnt -no FSTYPE,SOURCE --target "${NODE_DISK:-/var/tmp}" || true
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  nproc
  echo "uid $(id -u) (the page cache is dropped before reads from disk only as root)"
  echo "TMS source: ${tms_src:-missing} commit $(cat "$tms_src/COMMIT" 2>/dev/null || echo unknown)"
} >"$out/machine.txt" 2>&1
{
  echo "paused memory read without a resume, and prefetched ahead of one"
  sed 's/^/  /' "$out/machine.txt"
} >"$report"

# run_program NAME JOB DAEMON_ARGS ENV PROGRAM ARGS...: the program under `tmsctl run --job JOB` against a
# daemon of its own (DAEMON_ARGS, "-" for none), with ENV (VAR=VALUE words or "-"); NAME.jsonl (stdout)
# and NAME.log (stderr, tmsctl status after it). Sets rc.
run_program() {
  local name=$1 job=$2 dargs=$3 envs=$4 program=$5 t
  shift 5
  rc=1
  [ "$dargs" = - ] && dargs=""
  [ "$envs" = - ] && envs=""
  t=$(budget)
  if [ "$t" -eq 0 ]; then echo "$name: NOT RUN (out of time)" | tee -a "$report"; failed=1; return; fi
  if ! NODE_DAEMON_ARGS="$dargs" start_node "$bundle_dir" "$out" "$name"; then
    echo "$name: NOT RUN (the daemon did not start: tmsdiskd-$name.log)" | tee -a "$report"
    failed=1
    return
  fi
  # shellcheck disable=SC2086  # envs is a list of VAR=VALUE words
  env $envs TMSCTL="$tmsctl" "$tmsctl" run --job "$job" -- timeout -k 10 "$t" python3 "$here/$program" "$@" \
    >"$out/$name.jsonl" 2>"$out/$name.log"
  rc=$?
  "$tmsctl" status >>"$out/$name.log" 2>&1
  stop_node
  local verdict
  verdict=$(tail -n 1 "$out/$name.jsonl" 2>/dev/null)
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="FAIL (timed out after $t s)"
  echo "$name: exit $rc: ${verdict:-no output} ($name.jsonl, $name.log)" | tee -a "$report"
  [ "$rc" -eq 0 ] || failed=1
}

# TMS from its source, as run_gpu_tms_compare.sh builds and runs it: sets tms_so and cudart_dir.
build_tms() {
  tms_so=""
  if [ -z "$tms_src" ] || [ ! -f "$tms_src/setup.py" ]; then
    echo "TMS: no source (TMS_SRC_DIR)" | tee -a "$report"
    return 1
  fi
  local cuda_major
  cuda_major=$(python3 -c 'import torch; print(torch.version.cuda.split(".")[0])' 2>/dev/null || echo 13)
  echo "== building TMS $(cat "$tms_src/COMMIT" 2>/dev/null) in $tms_src (TMS_CUDA_MAJOR=$cuda_major)" >"$out/tms-build.log"
  (cd "$tms_src" && TMS_CUDA_MAJOR=$cuda_major python3 setup.py build_ext --inplace) >>"$out/tms-build.log" 2>&1
  local preload=("$tms_src"/torch_memory_saver_hook_mode_preload_cu"$cuda_major"*.so)
  [ -e "${preload[0]}" ] && tms_so=${preload[0]}
  # The libcudart PyTorch loads, so that TMS's preloaded library and PyTorch share one.
  cudart_dir=$(python3 - "$cuda_major" <<'PY' 2>/dev/null
import glob, os, sys, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
hits = glob.glob(os.path.join(site, "nvidia", "**", f"libcudart.so.{sys.argv[1]}"), recursive=True)
print(os.path.dirname(hits[0]) if hits else "")
PY
)
  [ -n "$cudart_dir" ] || cudart_dir=/usr/local/cuda/lib64
  if [ -z "$tms_so" ]; then echo "TMS: did not build (tms-build.log)" | tee -a "$report"; return 1; fi
  echo "TMS: built $tms_so; libcudart from $cudart_dir" | tee -a "$report"
}

# 1. The weight sync.
if [[ $cases == *" sync "* ]]; then
  echo | tee -a "$report"
  echo "== 1. weight sync: $ws_gib GiB of bf16 parameters, paused, read back without a resume" | tee -a "$report"
  run_program wsync-tier wsync-tier "--host-tier-mb $((ws_gib * 1024 + 2048))" - torch_weight_sync.py \
    --mode tmsdisk --expect tier --gib "$ws_gib" --repeats "$ws_repeats"
  run_program wsync-disk wsync-disk - TMSDISK_HOST_TIER=0 torch_weight_sync.py \
    --mode tmsdisk --expect disk --gib "$ws_gib" --repeats "$ws_repeats"
  if [ "$ws_tms" = 1 ]; then
    t=$(budget)
    if [ "$t" -eq 0 ]; then
      echo "wsync-tms: NOT RUN (out of time)" | tee -a "$report"
    elif build_tms; then
      # TMS's documented set-up (its preload library first in LD_PRELOAD, its package on the path); no
      # tmsctl, no libtmsdisk.so.
      t=$(budget)
      timeout -k 10 "$t" env LD_PRELOAD="$tms_so" LD_LIBRARY_PATH="$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        PYTHONPATH="$tms_src${PYTHONPATH:+:$PYTHONPATH}" \
        python3 "$here/torch_weight_sync.py" --mode tms --gib "$ws_gib" --repeats "$ws_repeats" \
        >"$out/wsync-tms.jsonl" 2>"$out/wsync-tms.log"
      rc=$?
      echo "wsync-tms: exit $rc: $(tail -n 1 "$out/wsync-tms.jsonl" 2>/dev/null || echo no output) (wsync-tms.jsonl, wsync-tms.log)" |
        tee -a "$report"
    fi
  fi
  python3 - "$out" >>"$report" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
GiB = 2**30


def result(name):
    try:
        for line in open(os.path.join(out, f"{name}.jsonl")):
            if line.startswith('{"') and '"kind": "result"' in line:
                return json.loads(line)
    except OSError:
        pass
    return None


runs = [("wsync-tier", "tmsdisk, host tier holds all", "read_paused"),
        ("wsync-disk", "tmsdisk, disk only", "read_paused"),
        ("wsync-tms", "TMS, pinned CPU backup", "get_cpu_backup")]
got = {name: result(name) for name, _, _ in runs}
first = next((r for r in got.values() if r), None)
if first is None:
    print("weight sync: no run gave a result")
    sys.exit(0)
print(f"weight sync: {first['bytes'] / GiB:.3f} GiB of bf16 in {first['tensors']} parameters "
      f"(largest {first.get('largest')}, smallest {first.get('smallest')}); GB/s of one pass over all of them, "
      f"best of {len(first['reads'][0]['seconds']) if first.get('reads') else '?'} (first pass)")
print(f"  {'source':<30} {'call':<32} {'GB/s best':>9} {'(first)':>9}  {'result':<8} bytes equal")
rate = {}
for name, label, call in runs:
    r = got[name]
    if r is None:
        print(f"  {label:<30} {'-':<32} {'-':>9} {'-':>9}  {'-':<8} NOT RUN")
        continue
    for row in r.get("reads", []):
        c = call + (", zero_copy=True" if row["read"] == "zero_copy" else "")
        rate[(name, row["read"])] = row["gb_s_best"]
        verdict = "PASS" if row["equal"] else f"FAIL ({row['none']} None; {', '.join(row['mismatched'][:5])})"
        print(f"  {label:<30} {c:<32} {row['gb_s_best']:>9.2f} {row['gb_s_first']:>9.2f}  "
              f"{row.get('kind_of_result') or '-':<8} {verdict}")
    if not r.get("reads"):
        print(f"  {label:<30} {'-':<32} {'-':>9} {'-':>9}  {'-':<8} FAIL: {', '.join(r.get('failed', []))}")
for name, label, _ in runs:
    r = got[name]
    if r is None:
        continue
    lp = r.get("daemon_pause") or {}
    where = (f"; the pause: {lp.get('host_bytes', 0) / GiB:.3f} GiB in the tier, "
             f"{(lp.get('moved_bytes', 0) + lp.get('unchanged_bytes', 0)) / GiB:.3f} GiB to disk") if lp else ""
    print(f"  {label}: {'PASS' if r['ok'] else 'FAIL ' + ', '.join(r.get('failed', []))}; pause {r.get('pause_s')} s, "
          f"resume {r.get('resume_s')} s{where}; SHA-256 of the parameters {r.get('sha256', '-')[:16]}")
shas = {r.get("sha256") for r in got.values() if r}
print(f"  the same parameters in every run (SHA-256 before the pause): {'yes' if len(shas) == 1 else 'NO: ' + str(shas)}")
for read in ("copy", "zero_copy"):
    a, b = rate.get(("wsync-tier", read)), rate.get(("wsync-tms", read))
    if a and b:
        print(f"  tmsdisk's tier / TMS's CPU backup, {read}: {a / b:.3f}")
    a, b = rate.get(("wsync-disk", read)), rate.get(("wsync-tms", read))
    if a and b:
        print(f"  tmsdisk's disk / TMS's CPU backup, {read}: {a / b:.3f}")
PY
  sed -n '/^weight sync:/,$p' "$report"
fi

# 2. Prefetch ahead of a resume.
if [[ $cases == *" prefetch "* ]]; then
  echo | tee -a "$report"
  echo "== 2. prefetch: $pf_gib GiB of fp32 in a tag; tier-only resume, resume from disk, resume after a prefetch" |
    tee -a "$report"
  pf_args=(--gib "$pf_gib" --tensor-mib "$pf_tensor_mib" --repeats "$pf_repeats")
  # The filler is as large as the tier: paused first, it holds all of the rank's tier memory, so the
  # data's pause finds none free (a second tag's pause takes only the free end of what the rank holds).
  run_program prefetch-full prefetch-full "--host-tier-mb $((pf_gib * 1024 + 2048))" - torch_prefetch_resume.py \
    --phase full --filler-mib $((pf_gib * 1024 + 2048)) "${pf_args[@]}"
  run_program prefetch-half prefetch-half "--host-tier-mb $((pf_gib * 512))" - torch_prefetch_resume.py \
    --phase half --filler-mib $((pf_gib * 512)) "${pf_args[@]}"
  python3 - "$out" >>"$report" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
GiB = 2**30


def load(name):
    ms = []
    try:
        for line in open(os.path.join(out, f"{name}.jsonl")):
            if line.startswith("{"):
                o = json.loads(line)
                if o.get("kind") == "measurement":
                    ms.append(o)
    except OSError:
        pass
    return ms


full, half = load("prefetch-full"), load("prefetch-half")
print("prefetch: resume wall seconds (the shim's own figure in brackets), where the resume's bytes came from")
for m in full + half:
    d = m.get("resume_disk_bytes")
    h = m.get("resume_host_bytes")
    split = "-" if h is None else f"{h / GiB:.2f} GiB tier + {d / GiB:.2f} GiB disk"
    pf = "" if m["prefetch_s"] is None else f", prefetch {m['prefetch_s']:.2f} s ({m['prefetched']})"
    print(f"  {m['phase']:<4} {m['case']:<8} {m['rep']}: pause {m['pause_s']:.2f} s{pf}, resume {m['resume_s']:.3f} s "
          f"[{m['resume_shim_s']:.3f}] = {m['bytes'] / m['resume_s'] / 1e9:.2f} GB/s; {split}; "
          f"placement {'as said' if m['placement_ok'] else ('unknown' if m['placement_ok'] is None else 'NOT AS SAID')}; "
          f"{'intact' if m['intact'] else 'NOT INTACT'}")


def best(ms, case):
    """The fastest intact resume of the case (placement is shown per run above)."""
    rs = [m for m in ms if m["case"] == case and m["intact"]]
    return min(rs, key=lambda m: m["resume_s"]) if rs else None


tier, disk, pf = best(full, "tier"), best(full, "disk"), best(full, "prefetch")
if tier and pf:
    r = pf["resume_s"] / tier["resume_s"]
    shim = pf["resume_shim_s"] / tier["resume_shim_s"] if tier["resume_shim_s"] else float("nan")
    print(f"tier holds all: resume after prefetch {pf['resume_s']:.3f} s / tier-only resume {tier['resume_s']:.3f} s = "
          f"{r:.3f} (goal <= 1.2): {'PASS' if r <= 1.2 else 'FAIL'}; the shim's own figures {shim:.3f}")
else:
    print("tier holds all: resume after prefetch / tier-only resume: NOT MEASURED (a case failed or did not run)")
if tier and disk:
    print(f"  for reference: resume from disk without prefetch {disk['resume_s']:.3f} s "
          f"({disk['bytes'] / disk['resume_s'] / 1e9:.2f} GB/s) = {disk['resume_s'] / tier['resume_s']:.1f} x the tier-only "
          f"resume; the prefetch itself took {pf['prefetch_s'] if pf else '-'} s")
h_disk, h_pf = best(half, "disk"), best(half, "prefetch")
if tier and h_pf and h_pf.get("resume_host_bytes") is not None:
    tier_rate = tier["bytes"] / tier["resume_s"]
    host, rest = h_pf["resume_host_bytes"], h_pf["resume_disk_bytes"]
    share = host / h_pf["bytes"]
    print(f"tier holds half: the prefetch brought {host / GiB:.2f} of {h_pf['bytes'] / GiB:.2f} GiB "
          f"({share:.3f}{'' if 0.4 <= share <= 0.6 else ': NOT about half, see the daemon log'}); the resume read "
          f"{rest / GiB:.2f} GiB from disk")
    verdicts = []
    for label, d in (("phase half's own disk resume", h_disk), ("phase full's disk resume", disk)):
        if not d:
            continue
        disk_rate = d["bytes"] / d["resume_s"]
        expected = host / tier_rate + rest / disk_rate
        r = h_pf["resume_s"] / expected
        verdicts.append(r)
        print(f"  with {label} ({disk_rate / 1e9:.2f} GB/s) and the tier-only rate ({tier_rate / 1e9:.2f} GB/s): "
              f"expected {host / GiB:.2f} GiB / tier + {rest / GiB:.2f} GiB / disk = {host / tier_rate:.3f} + "
              f"{rest / disk_rate:.3f} = {expected:.3f} s; took {h_pf['resume_s']:.3f} s; ratio {r:.3f} "
              f"(goal within 10 %: {'PASS' if abs(r - 1) <= 0.10 else ('faster than the model' if r < 1 else 'FAIL')})")
    if verdicts:
        r = verdicts[0]
        print(f"  verdict (the first disk rate above, nearest in time): ratio {r:.3f}, "
              f"{'PASS' if abs(r - 1) <= 0.10 else 'FAIL'} (within 10 % of the model)")
    else:
        print("  no disk rate measured: NOT COMPARED")
else:
    print("tier holds half: resume after prefetch against half at each rate: NOT MEASURED (a case failed or did not run)")
PY
  sed -n '/^prefetch: resume wall/,$p' "$report"
fi

echo | tee -a "$report"
echo "result: $([ "$failed" -eq 0 ] && echo PASS || echo FAIL) (exit $failed), $SECONDS s" | tee -a "$report"
tmp=$(mktemp "${TMPDIR:-/tmp}/paused_read-logs.XXXXXX")
tar -czf "$tmp" -C "$out" --exclude=./paused_read-logs.tar.gz . && mv "$tmp" "$out/paused_read-logs.tar.gz"
rm -f "$tmp"
exit $failed
