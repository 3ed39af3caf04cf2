# SPDX-License-Identifier: Apache-2.0
# On a GPU: the weight sync of a paused trainer. A model's bf16 parameters are paused, then every one is
# read back to the host without a resume, as an RL trainer sends its weights to the rollout engine
# while its GPU memory serves the engine. Run once per source by run_gpu_paused_read.sh:
#
#   --mode tmsdisk  under `tmsctl run --job J -- python3 torch_weight_sync.py --mode tmsdisk --expect tier|disk`:
#                   the parameters are allocated inside tmsdisk.region("weights") (a private
#                   torch.cuda.MemPool inside it, as tmsdisk's torch_memory_saver does, so that they get
#                   memory allocated under the tag), paused with tmsdisk.pause("weights") and read with
#                   tmsdisk.read_paused(p) (a copy) and tmsdisk.read_paused(p, zero_copy=True) (a view of
#                   the host tier's memory where all of p lies there, else a copy). --expect says where the
#                   pause must have put them: "tier" (the daemon's host tier holds all of them: nothing
#                   went to disk) or "disk" (nothing in the tier: a daemon without one, or
#                   TMSDISK_HOST_TIER=0); with TMSCTL set, `tmsctl --json status` must agree.
#   --mode tms      torch_memory_saver (TMS), its own build, in a process without libtmsdisk.so
#                   (LD_PRELOAD=its preload library, PYTHONPATH=its source tree): the parameters are
#                   allocated inside torch_memory_saver.region(tag="weights", enable_cpu_backup=True),
#                   paused with torch_memory_saver.pause("weights"), and read with its get_cpu_backup(p)
#                   (a clone of its pinned CPU backup) and get_cpu_backup(p, zero_copy=True) (a view of it).
#
# The parameters: the shapes of a Llama-style decoder (hidden 4096, MLP 11008, vocabulary 32000):
# embeddings and LM head, then layers (4 attention projections, 3 MLP matrices, 2 norms; the last one
# in part) while the total stays within --gib (3.98 GiB of 4), and a few odd shapes (1x4097, 12345, 1000x33, 3x5x7x11, 7) that end
# mid-chunk and mid-page; random normal bf16 from a fixed seed, so that every run holds the same bytes
# (their SHA-256 is printed, for the runs to be compared). Before the pause each parameter is copied to
# the host (the reference). While paused, each read mode runs --repeats times over every parameter,
# timed alone (the calls, to the last tensor returned), then each result is compared byte for byte with
# the reference. Zero-copy results are checked to be views (two calls for one parameter give the same
# address) or copies, and said so. After the reads the memory must still be paused (tmsdisk: per-tag
# figures); after the resume every parameter must equal its reference on the GPU too.
#
# stdout: one JSON line {"kind": "result", ...} (figures per read mode: seconds per pass, GB/s of the
# best and of the first pass, bytes equal) and a last line "PASS torch_weight_sync ..." or "FAIL ...".
# Progress on stderr. Exit status 0 on PASS.
#   python3 torch_weight_sync.py --mode tmsdisk|tms [--expect tier|disk] [--gib 4] [--repeats 2]
import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import sys
import time

import gpu_helpers  # beside this script (the scripts run as files)

import torch

GiB = 1 << 30
MiB = 1 << 20
HIDDEN, MLP, VOCAB = 4096, 11008, 32000
ODD_SHAPES = [(1, 4097), (12345,), (1000, 33), (3, 5, 7, 11), (7,)]

POOLS = []  # MemPools of the regions, alive as long as their tensors


def log(msg):
    print(f"[torch_weight_sync {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def shapes(total_bytes):
    """(name, shape) of the parameters: embeddings, LM head and final norm, layers while the total stays
    within total_bytes (at least one whole one), then the odd shapes."""
    def nbytes(shape):
        n = 2
        for d in shape:
            n *= d
        return n

    head = [("model.embed_tokens", (VOCAB, HIDDEN)), ("lm_head", (VOCAB, HIDDEN)), ("model.norm", (HIDDEN,))]
    layer = [("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (HIDDEN, HIDDEN)),
             ("self_attn.v_proj", (HIDDEN, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
             ("mlp.gate_proj", (MLP, HIDDEN)), ("mlp.up_proj", (MLP, HIDDEN)), ("mlp.down_proj", (HIDDEN, MLP)),
             ("input_layernorm", (HIDDEN,)), ("post_attention_layernorm", (HIDDEN,))]
    odd = [(f"odd.{i}", s) for i, s in enumerate(ODD_SHAPES)]
    fixed = sum(nbytes(s) for _, s in head + odd)
    per_layer = sum(nbytes(s) for _, s in layer)
    layers = max(1, (total_bytes - fixed) // per_layer)
    out = head[:1]
    for i in range(layers):
        out += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    # The next layer's first parameters, as far as they fit: the total comes close to total_bytes.
    room = total_bytes - fixed - layers * per_layer
    for n, s in layer:
        if nbytes(s) > room:
            break
        out.append((f"model.layers.{layers}.{n}", s))
        room -= nbytes(s)
    return out + head[1:] + odd


def as_bytes(t):
    return t.reshape(-1).view(torch.uint8)


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


class Tmsdisk:
    name = "tmsdisk"

    def __init__(self):
        import tmsdisk  # pylint: disable=import-outside-toplevel

        self.t = tmsdisk
        if not tmsdisk.loaded():
            raise RuntimeError("libtmsdisk.so is not loaded: run this under `tmsctl run -- python3 torch_weight_sync.py`")

    @contextlib.contextmanager
    def region(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        pool = torch.cuda.MemPool()
        POOLS.append(pool)
        with torch.cuda.use_mem_pool(pool), self.t.region("weights", self.t.BACKUP):
            yield

    def pause(self):
        self.t.pause("weights")

    def resume(self):
        self.t.resume("weights")

    def read(self, p, zero_copy):
        return self.t.read_paused(p, zero_copy=zero_copy)

    def paused_figures(self):
        st = self.t.status().tag("weights")
        return None if st is None else {"resident_bytes": st.resident_bytes, "paused_bytes": st.paused_bytes,
                                        "allocations": st.allocations, "paused_allocations": st.paused_allocations}

    def daemon_last(self, kind, wait_s=10.0):
        return gpu_helpers.daemon_last(self.t, kind, log, wait_s)

    def info(self):
        return {"tmsdisk": self.t.version(), "library": self.t.library_path(),
                "host_tier_env": os.environ.get("TMSDISK_HOST_TIER", "1 (default)")}


class Tms:
    name = "tms"

    def __init__(self):
        from torch_memory_saver import torch_memory_saver  # pylint: disable=import-outside-toplevel

        self.saver = torch_memory_saver
        self.saver.hook_mode = os.environ.get("WS_TMS_HOOK", "preload")

    def region(self):
        return self.saver.region(tag="weights", enable_cpu_backup=True)

    def pause(self):
        self.saver.pause("weights")

    def resume(self):
        self.saver.resume("weights")

    def read(self, p, zero_copy):
        return self.saver.get_cpu_backup(p, zero_copy=zero_copy)

    def paused_figures(self):
        return None

    def daemon_last(self, kind, wait_s=10.0):  # pylint: disable=unused-argument
        return None

    def info(self):
        impl = self.saver._impl  # pylint: disable=protected-access
        return {"tms_hook": impl._hook_mode if impl else None,  # pylint: disable=protected-access
                "tms_library": str(impl._hook_util.get_path_binary()) if impl else None,  # pylint: disable=protected-access
                "tms_module": sys.modules[type(self.saver).__module__].__file__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["tmsdisk", "tms"], required=True)
    ap.add_argument("--expect", choices=["tier", "disk", "any"], default="any",
                    help="tmsdisk: where the pause must have put the parameters")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of bf16 parameters (at most this, at least one layer)")
    ap.add_argument("--repeats", type=int, default=2, help="passes of each read mode")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--watchdog-s", type=int, default=300, help="per phase: dump stacks and exit if it hangs")
    args = ap.parse_args()
    faulthandler.enable()

    def phase(name):
        log(name)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)

    checks, fig = {}, {"kind": "result", "mode": args.mode, "expect": args.expect, "pid": os.getpid()}

    def check(name, ok, detail=""):
        checks[name] = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + str(detail) if detail != '' else ''}", file=sys.stderr, flush=True)

    paused = False
    src = None
    try:
        phase("setup")
        src = Tmsdisk() if args.mode == "tmsdisk" else Tms()
        torch.cuda.init()
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        plan = shapes(int(args.gib * GiB))
        params, names = [], []
        with src.region():
            for name, shape in plan:
                params.append(torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(generator=gen))
                names.append(name)
        torch.cuda.synchronize()
        total = sum(p.numel() * p.element_size() for p in params)
        fig.update({"tensors": len(params), "bytes": total, "gpu": torch.cuda.get_device_name(0),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "uid": os.geteuid(),
                    "largest": list(max(plan, key=lambda x: torch.Size(x[1]).numel())[1]),
                    "smallest": list(min(plan, key=lambda x: torch.Size(x[1]).numel())[1]), **src.info()})
        log(f"{len(params)} parameters, {total / GiB:.3f} GiB of bf16")

        phase("reference copy on the host")
        ref = [p.cpu() for p in params]
        h = hashlib.sha256()
        for r in ref:
            h.update(memoryview(as_bytes(r).numpy()))
        fig["sha256"] = h.hexdigest()

        phase("pause")
        torch.cuda.synchronize()
        t0 = time.monotonic()
        src.pause()
        paused = True
        fig["pause_s"] = round(time.monotonic() - t0, 4)
        last = src.daemon_last("pause")
        fig["daemon_pause"] = last
        if args.mode == "tmsdisk" and last is not None:
            host, disk = last.get("host_bytes", 0), last.get("moved_bytes", 0) + last.get("unchanged_bytes", 0)
            if args.expect == "tier":
                check("pause.host_tier_holds_all", host > 0 and disk == 0, f"{host} B in the tier, {disk} B on disk")
            elif args.expect == "disk":
                check("pause.disk_only", host == 0 and disk > 0, f"{host} B in the tier, {disk} B on disk")
        elif args.mode == "tmsdisk" and args.expect != "any":
            check("pause.placement_known", False, "TMSCTL is unset or tmsctl status did not answer")
        before = src.paused_figures()
        fig["paused_figures"] = before

        rows = []
        for zero_copy in (False, True):
            rows.append({"read": "zero_copy" if zero_copy else "copy", "seconds": [], "equal": True, "mismatched": [],
                         "none": 0, "kind_of_result": None})
        for rep in range(args.repeats):
            for row in rows:
                zero_copy = row["read"] == "zero_copy"
                phase(f"read pass {rep + 1}: {row['read']}")
                dropped = gpu_helpers.drop_caches()
                t0 = time.monotonic()
                outs = [src.read(p, zero_copy) for p in params]
                row["seconds"].append(round(time.monotonic() - t0, 4))
                row["page_cache_dropped"] = dropped
                for name, out, r in zip(names, outs, ref):
                    if out is None:
                        row["none"] += 1
                        row["equal"] = False
                        row["mismatched"].append(name)
                    elif not same_bytes(out, r):
                        row["equal"] = False
                        if name not in row["mismatched"]:
                            row["mismatched"].append(name)
                if rep == 0:
                    # A view returns the same address for the same parameter twice; a copy a new one.
                    again = src.read(params[0], zero_copy)
                    if outs[0] is not None and again is not None:
                        row["kind_of_result"] = "views" if again.data_ptr() == outs[0].data_ptr() else "copies"
                    del again
                del outs
                log(f"{row['read']} pass {rep + 1}: {row['seconds'][-1]:.3f} s, "
                    f"{total / row['seconds'][-1] / 1e9:.2f} GB/s, bytes {'equal' if row['equal'] else 'DIFFERENT'}")
        for row in rows:
            best = min(row["seconds"])
            row["gb_s_best"] = round(total / best / 1e9, 3)
            row["gb_s_first"] = round(total / row["seconds"][0] / 1e9, 3)
            row["mismatched"] = row["mismatched"][:20]
            check(f"read.{row['read']}.bytes_equal", row["equal"],
                  f"{row['none']} None, mismatched {row['mismatched']}" if not row["equal"] else "every parameter")
        fig["reads"] = rows
        if args.mode == "tmsdisk" and args.expect == "tier":
            zc = rows[1]["kind_of_result"]
            check("read.zero_copy_gives_views", zc == "views", zc)
        after = src.paused_figures()
        fig["paused_figures_after_reads"] = after
        if before is not None:
            check("read.still_paused", after is not None and after["paused_bytes"] == before["paused_bytes"] > 0
                  and after["resident_bytes"] == 0, after)

        phase("resume")
        t0 = time.monotonic()
        src.resume()
        torch.cuda.synchronize()
        paused = False
        fig["resume_s"] = round(time.monotonic() - t0, 4)
        fig["daemon_resume"] = src.daemon_last("resume")
        wrong = [n for n, p, r in zip(names, params, ref) if not same_bytes(p.cpu(), r)]
        check("resume.parameters_intact", not wrong, f"differ: {wrong[:20]}" if wrong else "every parameter")
        faulthandler.cancel_dump_traceback_later()
    except Exception as e:  # pylint: disable=broad-except
        faulthandler.cancel_dump_traceback_later()
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        check("no_exception", False, repr(e))
        if paused and src is not None:
            with contextlib.suppress(Exception):
                src.resume()

    failed = [k for k, v in checks.items() if not v]
    fig.update({"ok": not failed and bool(checks), "checks": checks, "failed": failed})
    print(json.dumps(fig, sort_keys=True, default=str), flush=True)
    if fig["ok"]:
        reads = ", ".join(f"{r['read']} {r['gb_s_best']} GB/s" for r in fig["reads"])
        print(f"PASS torch_weight_sync {args.mode} ({args.expect}): {fig['tensors']} parameters, "
              f"{fig['bytes'] / GiB:.2f} GiB; {reads}", flush=True)
        return 0
    print(f"FAIL torch_weight_sync {args.mode} ({args.expect}): {', '.join(failed) or 'no check ran'}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
