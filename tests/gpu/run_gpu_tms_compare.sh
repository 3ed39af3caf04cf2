#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: tmsdisk side by side with torch_memory_saver's disk backup (TMS), the same PyTorch
# program (tms_compare.py) under each, on one GPU and the same disk (NODE_DISK, /var/tmp by default; not tmpfs):
#   cache   16 GiB of tensors with PyTorch's own cache in play (5 GiB more freed into it), several
#           pause/resume cycles, the tensors unchanged after the first; goal: tmsdisk <= 0.5 x TMS
#   random  16 GiB of random tensors, new data before every pause, disk only (no host tier);
#           goal: tmsdisk <= 0.9 x TMS
# TMS is built on the node from its source (TMS_SRC_DIR: a tree of github.com/fzyzcjy/torch_memory_saver,
# with its commit in TMS_SRC_DIR/COMMIT) and runs in hook mode preload with its defaults (256 MiB chunks);
# tmsdisk runs under `tmsctl run` against a daemon on a fresh root with its defaults. The page cache is
# dropped before each run and, inside the program, before each timed pause and resume. Writes
# OUT_DIR/tms_compare.txt (figures, ratios tmsdisk/TMS per case and cycle, PASS/FAIL against the goals)
# and OUT_DIR/tms_compare-logs.tar.gz (everything else under OUT_DIR). Exit status 0 when every run
# finished with its tensors intact, whatever the ratios.
#   tests/gpu/run_gpu_tms_compare.sh BUNDLE_DIR OUT_DIR [TMS_SRC_DIR]
# Environment: TMS_COMPARE_GIB (16), TMS_COMPARE_CACHE_CYCLES (3), TMS_COMPARE_RANDOM_CYCLES (3),
# TMS_COMPARE_DEADLINE_S (no limit: seconds from the start after which no run starts, and each run is
# stopped), TMS_COMPARE_TMS_HOOK (preload, or torch), TMS_COMPARE_HOST_TIER_MB (0: the cache case's
# tmsdisk daemon gets a host tier of this many MiB, --host-tier-mb; the random case stays on disk),
# TMS_COMPARE_CASES ("cache random": the cases to run), NODE_DISK (/var/tmp: the directory both tools'
# files go under; tests/gpu/ram_disk.sh makes a faster block device to compare on), TMS_COMPARE_RAW
# (1: before each tool's random run, a raw O_DIRECT pass of the same size on the same disk,
# tmsdisk-rawdisk, so that the report shows each resume against the disk's read ceiling of that
# moment, and how low a ratio that ceiling lets any tool reach; 0: none).
set -uo pipefail  # not -e: every run happens and reports
bundle_dir=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
tms_src=$(cd "${3:-$here/../../gpu-extra/tms-src}" && pwd) || exit 1
gib=${TMS_COMPARE_GIB:-16}
cache_cycles=${TMS_COMPARE_CACHE_CYCLES:-3}
random_cycles=${TMS_COMPARE_RANDOM_CYCLES:-3}
tms_hook=${TMS_COMPARE_TMS_HOOK:-preload}
host_tier_mb=${TMS_COMPARE_HOST_TIER_MB:-0}
cases=${TMS_COMPARE_CASES:-cache random}
deadline=$((SECONDS + ${TMS_COMPARE_DEADLINE_S:-100000}))
raw_ceiling=${TMS_COMPARE_RAW:-1}
mkdir -p "$out"
out=$(cd "$out" && pwd)
. "$here/node.sh"
unset TMS_DISK_BACKUP_DIR TMS_DISK_BACKUP_CHUNK_MB  # each tool gets its own below
export PYTHONUNBUFFERED=1

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  uname -r
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -2
  df -h "${NODE_DISK:-/var/tmp}" | tail -1
  findmnt -no FSTYPE,SOURCE --target "${NODE_DISK:-/var/tmp}" || true
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  nproc
  echo "TMS commit: $(cat "$tms_src/COMMIT" 2>/dev/null || echo unknown)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# The page cache, before each run (root on the node).
drop_caches() {
  sync
  if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then echo "page cache dropped"; else echo "page cache NOT dropped (not root?)"; fi
}

# How long the next run may take: what is left before the deadline, less 20 s for the summary.
budget() {
  local left=$((deadline - SECONDS - 20))
  [ "$left" -gt 30 ] && echo "$left" || echo 0
}

# 1. TMS, built from its source (setup.py build_ext --inplace; one extension at a time, as both
#    compile the same sources into the same objects).
echo "== building TMS $(cat "$tms_src/COMMIT" 2>/dev/null) in $tms_src" | tee "$out/tms-build.log"
cuda_major=$(python3 -c 'import torch; print(torch.version.cuda.split(".")[0])' 2>/dev/null || echo 13)
(cd "$tms_src" && TMS_CUDA_MAJOR=$cuda_major python3 setup.py build_ext --inplace) >>"$out/tms-build.log" 2>&1
built=("$tms_src"/torch_memory_saver_hook_mode_*.so)
preload=("$tms_src"/torch_memory_saver_hook_mode_preload_cu"$cuda_major"*.so)
tms_so=""
[ -e "${preload[0]}" ] && tms_so=${preload[0]}
if [ -n "$tms_so" ]; then
  echo "built: ${built[*]}" | tee -a "$out/tms-build.log"
else
  echo "FAIL: TMS did not build (tms-build.log)" | tee -a "$out/tms-build.log"
fi
# The libcudart PyTorch loads, so that TMS's preloaded library (which needs libcudart.so.N) and
# PyTorch share one.
cudart_dir=$(python3 - "$cuda_major" <<'PY' 2>/dev/null
import glob, os, sys, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
hits = glob.glob(os.path.join(site, "nvidia", "**", f"libcudart.so.{sys.argv[1]}"), recursive=True)
print(os.path.dirname(hits[0]) if hits else "")
PY
)
[ -n "$cudart_dir" ] || cudart_dir=/usr/local/cuda/lib64
echo "libcudart for TMS's preload: $cudart_dir" | tee -a "$out/tms-build.log"

failed=0
run_tmsdisk() {  # CASE CYCLES
  local case=$1 cycles=$2 t
  t=$(budget)
  if [ "$t" -eq 0 ]; then echo "tmsdisk $case: NOT RUN (out of time)" | tee -a "$out/runs.txt"; failed=1; return; fi
  local tier=0
  [ "$case" = cache ] && tier=$host_tier_mb
  NODE_DAEMON_ARGS="--host-tier-mb $tier" start_node "$bundle_dir" "$out" "cmp-$case" ||
    { echo "tmsdisk $case: daemon did not start" | tee -a "$out/runs.txt"; failed=1; return; }
  echo "== tmsdisk $case (host tier $tier MiB): $(drop_caches)" | tee -a "$out/runs.txt"
  TMSDISK_HOST_TIER=$((tier > 0 ? 1 : 0)) TMSCTL=$tmsctl "$tmsctl" run --job "cmp-$case" -- timeout -k 10 "$t" \
    python3 "$here/tms_compare.py" --mode tmsdisk --case "$case" --gib "$gib" --cycles "$cycles" --disk-dir "$work/root" \
    >"$out/tmsdisk-$case.jsonl" 2>"$out/tmsdisk-$case.log"
  local rc=$?
  echo "tmsdisk $case: exit $rc" | tee -a "$out/runs.txt"
  [ $rc -eq 0 ] || failed=1
  "$tmsctl" status >>"$out/tmsdisk-$case.log" 2>&1
  stop_node
}
run_tms() {  # CASE CYCLES
  local case=$1 cycles=$2 t dir=${NODE_DISK:-/var/tmp}/tms-compare-disk
  t=$(budget)
  if [ "$t" -eq 0 ]; then echo "tms $case: NOT RUN (out of time)" | tee -a "$out/runs.txt"; failed=1; return; fi
  if [ -z "$tms_so" ]; then echo "tms $case: NOT RUN (TMS did not build)" | tee -a "$out/runs.txt"; failed=1; return; fi
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "== tms $case: $(drop_caches)" | tee -a "$out/runs.txt"
  # TMS's documented set-up: its preload library first in LD_PRELOAD, its package on the path, the
  # backup directory in TMS_DISK_BACKUP_DIR (the program also sets it with set_disk_backup_dir), the
  # chunk left at its default.
  timeout -k 10 "$t" env LD_PRELOAD="$tms_so" LD_LIBRARY_PATH="$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$tms_src${PYTHONPATH:+:$PYTHONPATH}" TMS_DISK_BACKUP_DIR="$dir" \
    python3 "$here/tms_compare.py" --mode tms --tms-hook "$tms_hook" --case "$case" --gib "$gib" --cycles "$cycles" --disk-dir "$dir" \
    >"$out/tms-$case.jsonl" 2>"$out/tms-$case.log"
  local rc=$?
  echo "tms $case: exit $rc" | tee -a "$out/runs.txt"
  [ $rc -eq 0 ] || failed=1
  ls -la "$dir" >>"$out/tms-$case.log" 2>&1
  rm -rf "$dir"
}

# The disk's raw O_DIRECT ceiling for the random case's bytes, just before TOOL's run (raw-TOOL.txt).
raw_pass() {  # TOOL
  [ "$raw_ceiling" = 1 ] || return 0
  local dir=${NODE_DISK:-/var/tmp}/tms-compare-raw t
  t=$(budget)
  [ "$t" -eq 0 ] && return 0
  mkdir -p "$dir"
  drop_caches >/dev/null
  timeout "$t" "$(cd "$bundle_dir" && pwd)/tmsdisk-rawdisk" "$dir" --gib "$gib" --request-mib 8 --queue-depth 32 >"$out/raw-$1.txt" 2>&1 ||
    echo "raw pass before $1: exit $?" | tee -a "$out/runs.txt"
  rm -rf "$dir"
}

: >"$out/runs.txt"
for c in $cases; do
  cycles=$cache_cycles
  [ "$c" = random ] && cycles=$random_cycles
  [ "$c" = random ] && raw_pass tmsdisk
  run_tmsdisk "$c" "$cycles"
  [ "$c" = random ] && raw_pass tms
  run_tms "$c" "$cycles"
done

python3 - "$out" "$(cat "$tms_src/COMMIT" 2>/dev/null || echo unknown)" >"$out/tms_compare.txt" 2>&1 <<'PY'
import json, os, sys
out, commit = sys.argv[1], sys.argv[2]
GOALS = {"cache": 0.5, "random": 0.9}
GiB = 2**30


def load(tool, case):
    setup, rows, done = None, {}, None
    try:
        for line in open(os.path.join(out, f"{tool}-{case}.jsonl")):
            line = line.strip()
            if not line.startswith("{"):
                continue
            o = json.loads(line)
            if o.get("kind") == "setup":
                setup = o
            elif o.get("kind") == "measurement":
                rows[o["cycle"]] = o
            elif o.get("kind") == "done":
                done = o
    except OSError:
        pass
    return setup, rows, done


def gib(b):
    return "-" if b is None else f"{b / GiB:.2f}"


print("tmsdisk against torch_memory_saver's disk backup (TMS), one program (tests/gpu/tms_compare.py), "
      "pause and resume wall seconds per cycle")
print(f"TMS commit {commit}")
for line in open(os.path.join(out, "machine.txt")):
    print("  " + line.rstrip())


def raw_rates(tool):
    """(write, read) GB/s of the raw pass before TOOL's run (raw_pass), or None."""
    rates = {}
    try:
        for line in open(os.path.join(out, f"raw-{tool}.txt")):
            parts = line.split()
            if len(parts) >= 3 and parts[0] in ("write", "read") and parts[2] == "GB/s":
                rates[parts[0]] = float(parts[1])
    except OSError:
        return None
    return (rates["write"], rates["read"]) if len(rates) == 2 else None


def raw_ceiling(m_d, m_t, cycles):
    """Each tool's resume against the disk's raw read of the same bytes just before its run: no
    tool reads random data faster than the disk, so raw read s / TMS resume s is the lowest
    resume ratio this disk allows."""
    raw = {tool: raw_rates(tool) for tool in ("tmsdisk", "tms")}
    if not all(raw.values()):
        print("disk ceiling: no raw pass (TMS_COMPARE_RAW=0, or it failed)")
        return
    size = next(iter(m_d.values()))["live_bytes"]
    print(f"disk ceiling (tmsdisk-rawdisk, {size / GiB:.0f} GiB, O_DIRECT 8 MiB x 32, just before each tool's run):")
    for tool, ms in (("tmsdisk", m_d), ("tms", m_t)):
        w, r = raw[tool]
        resume = sum(ms[c]["resume_s"] for c in cycles) / len(cycles)
        pause = sum(ms[c]["pause_s"] for c in cycles) / len(cycles)
        print(f"  before {tool:>7}: raw write {w:.2f} GB/s, read {r:.2f} GB/s; {tool} pause {size / pause / 1e9:.2f} "
              f"GB/s = {size / pause / 1e9 / w:.3f} of it, resume {size / resume / 1e9:.2f} GB/s = "
              f"{size / resume / 1e9 / r:.3f} of it")
    best_read = max(raw["tmsdisk"][1], raw["tms"][1])
    tms_resume = sum(m_t[c]["resume_s"] for c in cycles) / len(cycles)
    fastest = max(size / ms[c]["resume_s"] / 1e9 for ms in (m_d, m_t) for c in cycles)
    if fastest > best_read:
        print(f"  a resume read at {fastest:.2f} GB/s, faster than either raw pass: the disk drifted between passes, "
              "so neither pass bounds the ratio")
    else:
        print(f"  lowest resume ratio the disk allows: raw read at the better pass's {best_read:.2f} GB/s over TMS's "
              f"resume = {size / best_read / 1e9 / tms_resume:.3f}")


verdicts = []
for case, goal in GOALS.items():
    print()
    s_d, m_d, done_d = load("tmsdisk", case)
    s_t, m_t, done_t = load("tms", case)
    for name, s in (("tmsdisk", s_d), ("tms", s_t)):
        if s:
            extra = {k: v for k, v in s.items() if k not in ("kind", "pid")}
            print(f"{case} {name} setup: {json.dumps(extra, sort_keys=True)}")
    print(f"== case {case}: goal tmsdisk <= {goal} x TMS")
    print(f"{'cycle':>5} {'tool':>8} {'pause s':>8} {'resume s':>9} {'total s':>8} {'reserved':>9} {'written':>8} "
          f"{'read':>6} {'GPU freed':>10} {'intact':>7}  notes")
    for tool, ms in (("tmsdisk", m_d), ("tms", m_t)):
        for c in sorted(ms):
            m = ms[c]
            note = ""
            if tool == "tmsdisk":
                lp, lr = m.get("tmsdisk_last_pause") or {}, m.get("tmsdisk_last_resume") or {}
                host = f", host tier {gib(lp.get('host_bytes'))}" if lp.get("host_bytes") else ""
                note = (f"tmsdisk: covered {gib(lp.get('bytes'))} GiB, written {gib(lp.get('moved_bytes'))}{host}, "
                        f"unchanged {gib(lp.get('unchanged_bytes'))}, zero {gib(lp.get('zero_bytes'))}; "
                        f"resume read {gib(lr.get('moved_bytes'))}")
            else:
                note = f"TMS files {m.get('tms_files')} of {gib(m.get('tms_file_bytes'))} GiB"
            freed = m.get("gpu_released_mib")
            print(f"{c:>5} {tool:>8} {m['pause_s']:>8.2f} {m['resume_s']:>9.2f} {m['pause_s'] + m['resume_s']:>8.2f} "
                  f"{gib(m['reserved_bytes']):>9} {gib(m['disk_written_pause']):>8} {gib(m['disk_read_resume']):>6} "
                  f"{'-' if freed is None else f'{freed / 1024:.2f}':>10} {'yes' if m['intact'] else 'NO':>7}  {note}")
    cycles = sorted(set(m_d) & set(m_t))
    if not cycles:
        print(f"no cycle measured by both tools: {case} NOT COMPARED")
        verdicts.append(f"{case} (goal <= {goal}): NOT MEASURED")
        continue
    print(f"ratios tmsdisk/TMS (<= {goal} passes):")
    for c in cycles:
        d, t = m_d[c], m_t[c]
        rp, rr = d["pause_s"] / t["pause_s"], d["resume_s"] / t["resume_s"]
        rt = (d["pause_s"] + d["resume_s"]) / (t["pause_s"] + t["resume_s"])
        print(f"  cycle {c}: pause {rp:.3f} {'ok' if rp <= goal else 'over'}, resume {rr:.3f} "
              f"{'ok' if rr <= goal else 'over'}, pause+resume {rt:.3f} {'ok' if rt <= goal else 'over'}")

    def ratio(cs, key):
        num = sum(m_d[c][key] if key != "total" else m_d[c]["pause_s"] + m_d[c]["resume_s"] for c in cs)
        den = sum(m_t[c][key] if key != "total" else m_t[c]["pause_s"] + m_t[c]["resume_s"] for c in cs)
        return num / den
    groups = [("all cycles", cycles)]
    if len(cycles) > 1:
        groups += [("first cycle", cycles[:1]), ("steady state (cycles 2+)", cycles[1:])]
    for label, cs in groups:
        rp, rr, rt = ratio(cs, "pause_s"), ratio(cs, "resume_s"), ratio(cs, "total")
        print(f"  {label}: pause {rp:.3f}, resume {rr:.3f}, pause+resume {rt:.3f}")
    if case == "random":
        raw_ceiling(m_d, m_t, cycles)
    rp, rr, rt = ratio(cycles, "pause_s"), ratio(cycles, "resume_s"), ratio(cycles, "total")
    intact = all(m["intact"] and m["ok"] for m in list(m_d.values()) + list(m_t.values()))
    complete = bool(done_d and done_t)
    both = rp <= goal and rr <= goal
    verdict = "PASS" if both else "FAIL"
    why = ("pause and resume each" if both else
           "pause " + ("ok" if rp <= goal else "over") + ", resume " + ("ok" if rr <= goal else "over"))
    verdicts.append(f"{case} (goal <= {goal}, {len(cycles)} cycle(s), summed): {verdict}: pause {rp:.3f}, resume {rr:.3f} "
                    f"({why}); pause+resume {rt:.3f} {'PASS' if rt <= goal else 'FAIL'}; tensors "
                    f"{'intact in every cycle' if intact else 'NOT INTACT or a call failed'}"
                    f"{'' if complete else '; a run did not finish'}")
print()
print("== verdicts (ratio of summed wall seconds over the cycles both tools ran; PASS on pause and on resume separately)")
for v in verdicts:
    print(v)
PY
cat "$out/tms_compare.txt"
cat "$out/runs.txt"

tar -czf "$out/../tms_compare-logs.$$.tar.gz" -C "$out" . && mv "$out/../tms_compare-logs.$$.tar.gz" "$out/tms_compare-logs.tar.gz"
exit $failed
