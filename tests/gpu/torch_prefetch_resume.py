# SPDX-License-Identifier: Apache-2.0
# On a GPU: how fast a resume runs after tmsdisk.prefetch() brought a tag's paused memory from disk into
# the daemon's host tier, against a resume from the tier alone and one from disk. Run under tmsctl
# (TMSCTL set, for the daemon's figures of where each pause and resume put the bytes), once per daemon
# by run_gpu_paused_read.sh:
#   tmsctl run --job J -- python3 torch_prefetch_resume.py --phase full|half [--gib 16] [--repeats 2]
#
# The program: GIB GiB of random fp32 tensors (TENSOR_MIB each) in tmsdisk.region("data"), FILLER_MIB of
# non-zero bytes in tmsdisk.region("filler"), each region with a private torch.cuda.MemPool (its tensors
# get memory allocated under its tag), and a copy of the data on the GPU that is never paused
# (tmsdisk.disabled()), against which the data is compared bit for bit after every resume.
#
# Cases (each pause and resume of "data" is timed as wall seconds around the call, after and with a
# torch.cuda.synchronize(); the shim's own figures are kept beside them):
#   tier      pause("data") with the daemon's tier holding all of it (the daemon's host-tier-mb is the
#             data and more); resume("data"): the tier-only resume.
#   disk      pause("filler"), then pause("data"): the filler's chunks hold the rank's host-tier memory
#             (--filler-mib as large as the tier), so the data goes to disk, all of it (a second tag's
#             pause takes only the free end of the tier memory its rank holds: README "Tags");
#             resume("filler"), which leaves that memory kept and empty; the page
#             cache dropped (root); resume("data"): all of it from disk, no prefetch.
#   prefetch  as disk, then tmsdisk.prefetch("data", wait=True) (timed too): the data's disk chunks read
#             into the tier, as far as the rank's share goes (the memory the filler held is not in use
#             any more, so the prefetch asks the daemon for the data's size); resume("data").
# This way one daemon and one process give all three; nothing is restarted and no environment changes
# between them. Each case checks, with `tmsctl --json status`, that the bytes went where it says (tier:
# nothing on disk; disk and prefetch: nothing of the pause in the tier; prefetch with a tier that holds
# all: nothing of the resume from disk), and reports how the resume split between tier and disk.
#   --phase full  (a daemon whose tier holds all the data): tier x REPEATS, disk, prefetch x REPEATS
#   --phase half  (a daemon whose tier holds half):          disk, prefetch x REPEATS
# run_gpu_paused_read.sh puts the two phases together: resume after prefetch / tier-only resume (goal
# <= 1.2), and, with half the tier, the resume after prefetch against half at the tier's rate plus half
# at the disk's (goal: within 10 %).
#
# stdout: one JSON line per measurement {"kind": "measurement", "phase", "case", "rep", "bytes",
# "pause_s", "resume_s", "prefetch_s", "prefetched", "intact", "placement_ok", "daemon": {...}, ...}, a
# {"kind": "done", "ok": ...} line, and a last line "PASS torch_prefetch_resume ..." or "FAIL ...".
# Progress on stderr. Exit status 0 when every case ran, placed as it says, and every resume was
# bit-identical (the ratios are judged by the run script).
import argparse
import contextlib
import faulthandler
import json
import os
import sys
import time

import gpu_helpers  # beside this script (the scripts run as files)

import torch

import tmsdisk

GiB = 1 << 30
MiB = 1 << 20
POOLS = []  # the regions' MemPools, alive as long as their tensors


def log(msg):
    print(f"[torch_prefetch_resume {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj, sort_keys=True, default=str), flush=True)


@contextlib.contextmanager
def pool_region(tag=None):
    """A private MemPool, inside tmsdisk.region(tag) (backup) or, without a tag, tmsdisk.disabled()."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pool = torch.cuda.MemPool()
    POOLS.append(pool)
    with torch.cuda.use_mem_pool(pool), (tmsdisk.region(tag) if tag else tmsdisk.disabled()):
        yield


def daemon_last(kind, wait_s=10.0):
    return gpu_helpers.daemon_last(tmsdisk, kind, log, wait_s)


def disk_bytes(last):
    return last.get("moved_bytes", 0) + last.get("unchanged_bytes", 0)


class Run:
    def __init__(self, args):
        self.args = args
        self.paused = set()
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        n = args.tensor_mib * MiB // 4
        count = max(1, int(args.gib * GiB) // (args.tensor_mib * MiB))
        with pool_region("data"):
            self.data = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(1.0, 2.0, generator=gen)
                         for _ in range(count)]
        with pool_region("filler"):
            # Non-zero: zero chunks take no tier memory, and the filler must hold some.
            self.filler = torch.full((args.filler_mib * MiB // 4,), 3.0, dtype=torch.float32, device="cuda")
        with pool_region():
            self.ref = [d.clone() for d in self.data]
        torch.cuda.synchronize()
        self.bytes = sum(d.numel() * 4 for d in self.data)

    def intact(self):
        torch.cuda.synchronize()
        same = all(torch.equal(d.view(torch.int32), r.view(torch.int32)) for d, r in zip(self.data, self.ref))
        return same and bool((self.filler == 3.0).all().item())

    def pause(self, tag):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        self.paused.add(tag)
        tmsdisk.pause(tag)
        took = time.monotonic() - t0
        st = tmsdisk.status()
        return took, st.last_pause_ns / 1e9, daemon_last("pause")

    def resume(self, tag):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        tmsdisk.resume(tag)
        torch.cuda.synchronize()
        took = time.monotonic() - t0
        self.paused.discard(tag)
        st = tmsdisk.status()
        return took, st.last_resume_ns / 1e9, daemon_last("resume")

    def data_to_disk(self, m):
        """The filler paused into the tier, the data to disk beside it, the filler back: the data is on
        disk alone and the rank's tier memory kept, empty. True when the daemon says so."""
        _, _, lf = self.pause("filler")
        m["daemon"]["filler_pause"] = lf
        m["pause_s"], m["pause_shim_s"], lp = self.pause("data")
        m["daemon"]["pause"] = lp
        _, _, lr = self.resume("filler")
        m["daemon"]["filler_resume"] = lr
        if lf is None or lp is None:
            return None  # not known
        return lf.get("host_bytes", 0) > 0 and lp.get("host_bytes", 0) == 0 and disk_bytes(lp) > 0

    def case(self, name, rep):
        m = {"kind": "measurement", "phase": self.args.phase, "case": name, "rep": rep, "bytes": self.bytes,
             "daemon": {}, "prefetch_s": None, "prefetched": None}
        placed = None
        if name == "tier":
            m["pause_s"], m["pause_shim_s"], lp = self.pause("data")
            m["daemon"]["pause"] = lp
            placed = None if lp is None else lp.get("host_bytes", 0) > 0 and disk_bytes(lp) == 0
        else:
            placed = self.data_to_disk(m)
        m["page_cache_dropped"] = gpu_helpers.drop_caches()
        if name == "prefetch":
            t0 = time.monotonic()
            m["prefetched"] = tmsdisk.prefetch("data", wait=True)
            m["prefetch_s"] = round(time.monotonic() - t0, 4)
        m["resume_s"], m["resume_shim_s"], lr = self.resume("data")
        m["daemon"]["resume"] = lr
        m["intact"] = self.intact()
        if lr is not None:
            m["resume_host_bytes"], m["resume_disk_bytes"] = lr.get("host_bytes", 0), lr.get("moved_bytes", 0)
            if name == "tier":
                placed = placed and lr.get("moved_bytes", 0) == 0
            elif name == "disk":
                placed = placed and lr.get("host_bytes", 0) == 0
            elif name == "prefetch" and self.args.phase == "full":
                placed = placed and lr.get("moved_bytes", 0) == 0  # all of it was prefetched
            elif name == "prefetch":
                placed = placed and lr.get("host_bytes", 0) > 0  # part of it was prefetched
        m["placement_ok"] = placed
        if name == "prefetch" and not m["prefetched"]:
            m["placement_ok"] = False
        for k in ("pause_s", "pause_shim_s", "resume_s", "resume_shim_s"):
            m[k] = round(m[k], 4)
        emit(m)
        host, disk = m.get("resume_host_bytes"), m.get("resume_disk_bytes")
        prefetch = "" if m["prefetch_s"] is None else f"prefetch {m['prefetch_s']:.2f} s ({m['prefetched']}), "
        split = "" if host is None else f"; {host / GiB:.2f} GiB from the tier, {disk / GiB:.2f} GiB from disk"
        where = "as said" if placed else ("unknown" if placed is None else "NOT as said")
        log(f"{self.args.phase} {name} {rep}: pause {m['pause_s']:.2f} s, {prefetch}resume {m['resume_s']:.3f} s "
            f"({self.bytes / m['resume_s'] / 1e9:.2f} GB/s{split}); placement {where}, "
            f"{'intact' if m['intact'] else 'NOT INTACT'}")
        return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["full", "half"], required=True)
    ap.add_argument("--gib", type=float, default=float(os.environ.get("PREFETCH_GIB", 16)), help="GiB of data")
    ap.add_argument("--tensor-mib", type=int, default=int(os.environ.get("PREFETCH_TENSOR_MIB", 1024)))
    ap.add_argument("--filler-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("PREFETCH_REPEATS", 2)),
                    help="runs of the tier and prefetch cases (the disk case runs once)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--watchdog-s", type=int, default=300, help="per case: dump stacks and exit if it hangs")
    args = ap.parse_args()
    faulthandler.enable()
    if not tmsdisk.loaded():
        sys.exit("torch_prefetch_resume: libtmsdisk.so is not loaded; run it under `tmsctl run -- python3 ...`")
    if not os.environ.get("TMSCTL"):
        log("TMSCTL is unset: where each pause put the bytes is not checked")

    plan = ([("tier", r) for r in range(1, args.repeats + 1)] if args.phase == "full" else []) + [("disk", 1)] + \
        [("prefetch", r) for r in range(1, args.repeats + 1)]
    results, run, ok = [], None, True
    try:
        torch.cuda.init()
        t0 = time.monotonic()
        run = Run(args)
        emit({"kind": "setup", "phase": args.phase, "bytes": run.bytes, "tensors": len(run.data),
              "tensor_bytes": run.data[0].numel() * 4, "filler_bytes": run.filler.numel() * 4,
              "repeats": args.repeats, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cuda": torch.version.cuda, "tmsdisk": tmsdisk.version(), "uid": os.geteuid(),
              "setup_s": round(time.monotonic() - t0, 3)})
        for name, rep in plan:
            faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
            m = run.case(name, rep)
            faulthandler.cancel_dump_traceback_later()
            results.append(m)
            ok = ok and m["intact"] and m["placement_ok"] is not False
    except Exception as e:  # pylint: disable=broad-except
        faulthandler.cancel_dump_traceback_later()
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        log(f"stopped: {e!r}")
        ok = False
        if run is not None:
            for tag in sorted(run.paused):
                with contextlib.suppress(Exception):
                    tmsdisk.resume(tag)
    ok = ok and len(results) == len(plan)
    emit({"kind": "done", "phase": args.phase, "ok": ok, "cases": len(results), "planned": len(plan)})

    def best(case):
        rs = [m["resume_s"] for m in results if m["case"] == case]
        return min(rs) if rs else None

    t_tier, t_disk, t_pf = best("tier"), best("disk"), best("prefetch")
    size = run.bytes if run else 0
    words = []
    for label, t in (("tier-only", t_tier), ("disk", t_disk), ("after prefetch", t_pf)):
        if t:
            words.append(f"{label} resume {t:.3f} s ({size / t / 1e9:.2f} GB/s)")
    if t_tier and t_pf:
        words.append(f"after prefetch / tier-only {t_pf / t_tier:.3f}")
    print(f"{'PASS' if ok else 'FAIL'} torch_prefetch_resume {args.phase}: {size / GiB:.1f} GiB; " + "; ".join(words),
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
