# SPDX-License-Identifier: Apache-2.0
"""tmsdisk.optim.StreamedAdamW against miles' `--stream-optimizer-state-to-disk` loop (bench/miles_loop.py),
on the same buckets, in the same directory, in one run (issue 25).

N buckets of E elements: N bf16 parameters of E elements each on the GPU, so that each bucket's state
is the same 12 bytes per element in both optimizers (fp32 master, exp_avg, exp_avg_sq), one file per
bucket for miles and one store object per bucket for StreamedAdamW (bucket_elements = E). Gradients
are bf16, drawn on the GPU from a seed per (step, bucket), the same in every case. Every case runs
WARMUP + STEPS steps and reports the median, min and max of the last STEPS (the time of a whole step:
for StreamedAdamW step() + flush(), so that its last write-backs are in it as miles' are).

Cases (KIND[:LABEL]; each in a child process of its own so that its memory and cgroup are clean):

  resident      torch.optim.AdamW on fp32 masters, resident on the GPU: its default (foreach) kernel,
                the correctness reference (its masters' SHA-256), then fused=True (the floor, timed)
  pinned        pinned host tensor .copy_() of the state's bytes, both ways (the host tier's ceiling)
  raw           raw O_DIRECT write then read of the state's bytes in --dir (tmsdisk-rawdisk when given,
                else Python O_DIRECT with aligned buffers)
  miles_warm    miles' loop, page cache warm (the files were just written; the state fits in memory)
  miles_cold    miles' loop, page cache dropped before each step (sync, then echo 1 >
                /proc/sys/vm/drop_caches; where that is not permitted, fsync + POSIX_FADV_DONTNEED on
                the files, which drops the same pages; said in the results). The sync's time is reported
                apart (it writes the previous step's dirty pages).
  miles_cgroup  miles' loop in a memory cgroup whose memory.max is the child's own memory after its
                set-up (CUDA context, pinned buffer, tensors; files written, synced and dropped) plus
                --cgroup-gib GiB: N GiB of page cache for the state. Skipped, with the reason, where
                cgroup v2 has no memory controller this process may use (a new cgroup at the root or
                beside its own, whose parent has memory in subtree_control, else a systemd-run scope)
  ours          StreamedAdamW(bucket_elements=E, depth=--depth) in a child run under `tmsctl run`
                (--tmsctl), with the daemon the caller started: label it by the daemon's host tier
                (ours_full: a tier that holds all the state, ours_tier: --cgroup-gib GiB, ours_disk: none)

    python3 bench/streamed_optim_bench.py run --dir DIR --out R.json --cases "resident pinned raw miles_warm" ...
    python3 bench/streamed_optim_bench.py report --out R.json     # the table, ratios, PASS/FAIL

`run` adds its cases to R.json (made with the first run; a later run must give the same sizes), so that
one JSON gathers the cases run under differently configured daemons (tests/gpu/run_gpu_optim.sh).
`report` exits 1 when a case's masters differ from the resident AdamW's (or none could be compared),
3 when no case differs but one failed to run, else 0.
"""

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("resident", "pinned", "raw", "miles_warm", "miles_cold", "miles_cgroup", "ours")
CONFIG_KEYS = ("buckets", "elements", "steps", "warmup", "depth", "cgroup_gib", "lr", "weight_decay", "seed")
GIB = 1 << 30


def state_bytes(cfg):
    return 12 * cfg["buckets"] * cfg["elements"]


def config_of(args):
    return {k: getattr(args, k) for k in CONFIG_KEYS}


# --- what every child shares: parameters, gradients, timing -----------------------------------------


def _torch():
    import torch  # pylint: disable=import-outside-toplevel

    return torch


def device_of(args):
    torch = _torch()
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def sync(dev):
    if dev.type == "cuda":
        _torch().cuda.synchronize(dev)


def make_params(cfg, dev):
    """N bf16 parameters of E elements, the same in every process."""
    torch = _torch()
    params = []
    for b in range(cfg["buckets"]):
        g = torch.Generator(device=dev)
        g.manual_seed(cfg["seed"] * 1_000_003 + b)
        values = torch.randn(cfg["elements"], generator=g, device=dev) * 0.02
        params.append(torch.nn.Parameter(values.to(torch.bfloat16)))
        del values
    return params


def set_grads(params, step, cfg):
    """bf16 gradients of step `step`, drawn from a seed per (step, bucket)."""
    torch = _torch()
    grads = []
    for b, p in enumerate(params):
        g = torch.Generator(device=p.device)
        g.manual_seed(cfg["seed"] * 1_000_003 + 7919 * (step + 1) + 104_729 * (b + 1))
        values = torch.randn(p.numel(), generator=g, device=p.device) * 1e-2
        p.grad = values.to(torch.bfloat16)
        grads.append(p.grad)
        del values
    return grads


def summary(times, cfg):
    timed = times[cfg["warmup"]:] or times
    return {
        "step_s": [round(t, 4) for t in times],
        "median_s": round(statistics.median(timed), 4),
        "min_s": round(min(timed), 4),
        "max_s": round(max(timed), 4),
    }


# --- the children -------------------------------------------------------------------------------------


def child_resident(args, cfg):
    torch = _torch()
    sys.path.insert(0, HERE)
    from miles_loop import tensors_sha256  # pylint: disable=import-outside-toplevel

    dev = device_of(args)
    total = cfg["warmup"] + cfg["steps"]
    result = {}
    for variant, options in (("foreach", {}), ("fused", {"fused": True})):
        params = make_params(cfg, dev)
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        try:
            opt = torch.optim.AdamW(masters, lr=cfg["lr"], weight_decay=cfg["weight_decay"], **options)
        except (RuntimeError, ValueError, TypeError) as e:
            result[variant] = {"error": str(e)}
            continue
        times = []
        for step in range(total):
            grads = set_grads(params, step, cfg)
            for m, g in zip(masters, grads):
                m.grad = g.float()
            sync(dev)
            t0 = time.perf_counter()
            try:
                opt.step()
            except RuntimeError as e:  # fused where this torch or device has none
                result[variant] = {"error": str(e)}
                break
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            sync(dev)
            times.append(time.perf_counter() - t0)
        else:
            result[variant] = dict(summary(times, cfg), masters_sha256=tensors_sha256(masters))
        del opt, masters, params
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = {"variants": result}
    ref = result.get("foreach", {})
    if "masters_sha256" in ref:
        out["masters_sha256"] = ref["masters_sha256"]  # the reference
    floor = result.get("fused", {}) if "median_s" in result.get("fused", {}) else ref
    for key in ("step_s", "median_s", "min_s", "max_s"):
        if key in floor:
            out[key] = floor[key]
    out["timed_variant"] = "fused" if floor is result.get("fused") else "foreach"
    return out


def child_pinned(args, cfg):
    torch = _torch()
    dev = device_of(args)
    nbytes = 12 * cfg["elements"]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    device.copy_(host, non_blocking=True)
    host.copy_(device, non_blocking=True)
    sync(dev)
    h2d, d2h = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(cfg["buckets"]):
            device.copy_(host, non_blocking=True)
        sync(dev)
        t1 = time.perf_counter()
        for _ in range(cfg["buckets"]):
            host.copy_(device, non_blocking=True)
        sync(dev)
        t2 = time.perf_counter()
        h2d.append(t1 - t0)
        d2h.append(t2 - t1)
    total = state_bytes(cfg)
    return {
        "pinned": dev.type == "cuda",
        "h2d_s": round(min(h2d), 4), "d2h_s": round(min(d2h), 4),
        "h2d_gb_s": round(total / min(h2d) / 1e9, 2), "d2h_gb_s": round(total / min(d2h) / 1e9, 2),
        "h2d_all_s": [round(t, 4) for t in h2d], "d2h_all_s": [round(t, 4) for t in d2h],
        "median_s": round(min(h2d) + min(d2h), 4),  # the state in and out once, at the best rates
    }


def _read_int(path):
    with open(path) as f:
        return int(f.read().split()[0])


def _read_kv(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                out[k] = int(v) if v.strip().isdigit() else v.strip()
    except OSError:
        pass
    return out


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def own_cgroup():
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return "/sys/fs/cgroup" + line[3:].strip().rstrip("/")
    return None


def drop_caches():
    """echo 1 > /proc/sys/vm/drop_caches; None when done, else why not."""
    try:
        _write("/proc/sys/vm/drop_caches", "1")
        return None
    except OSError as e:
        return "drop_caches: %s" % e


def child_miles(args, cfg, mode):
    sys.path.insert(0, HERE)
    from miles_loop import MilesLoop  # pylint: disable=import-outside-toplevel

    dev = device_of(args)
    directory = os.path.join(args.dir, "miles")
    os.makedirs(directory, exist_ok=True)
    prefix = args.label
    for name in os.listdir(directory):  # a leftover's cached pages must not serve this case
        if name.startswith(prefix + "."):
            os.unlink(os.path.join(directory, name))
    params = make_params(cfg, dev)
    loop = MilesLoop([[p] for p in params], directory, lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                     prefix=prefix)
    t0 = time.perf_counter()
    loop.initialize()
    for fd in loop.fds:
        os.fsync(fd)
    out = {"mode": mode, "directory": directory, "initialize_s": round(time.perf_counter() - t0, 3),
           "piece_bytes": loop.piece_bytes, "pinned": loop.host.is_pinned()}
    cgroup = None
    if mode == "cgroup":
        cgroup = own_cgroup()
        if not cgroup or not os.path.exists(os.path.join(cgroup, "memory.max")):
            raise RuntimeError("this process's cgroup %s has no memory.max" % cgroup)
        loop.drop_cache()
        current = _read_int(os.path.join(cgroup, "memory.current"))
        stat = _read_kv(os.path.join(cgroup, "memory.stat"))
        base = current - int(stat.get("file", 0))
        limit = base + int(cfg["cgroup_gib"] * GIB)
        _write(os.path.join(cgroup, "memory.max"), str(limit))
        out["cgroup"] = {"path": cgroup, "baseline_bytes": base, "memory_max": limit,
                         "events_before": _read_kv(os.path.join(cgroup, "memory.events"))}
    drop_how = None
    if mode == "cold":
        why = drop_caches()
        drop_how = "drop_caches" if why is None else "fsync + POSIX_FADV_DONTNEED (%s)" % why
        out["cache_drop"] = drop_how
    times, syncs, phases = [], [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        set_grads(params, step, cfg)
        sync(dev)
        if mode == "cold":
            t0 = time.perf_counter()
            os.sync()
            syncs.append(time.perf_counter() - t0)
            if drop_how == "drop_caches":
                drop_caches()
            loop.drop_cache()  # harmless after drop_caches; the whole drop where it was refused
        t0 = time.perf_counter()
        phases.append({k: round(v, 4) for k, v in loop.step().items()})
        sync(dev)
        times.append(time.perf_counter() - t0)
    out.update(summary(times, cfg))
    out["phases_s"] = phases
    if syncs:
        out["sync_before_step_s"] = [round(t, 4) for t in syncs]
    if cgroup:
        out["cgroup"]["events_after"] = _read_kv(os.path.join(cgroup, "memory.events"))
        out["cgroup"]["stat_after"] = {k: v for k, v in _read_kv(os.path.join(cgroup, "memory.stat")).items()
                                       if k in ("anon", "file", "file_dirty", "file_writeback", "pgmajfault")}
        if os.path.exists(os.path.join(cgroup, "memory.peak")):
            out["cgroup"]["peak_bytes"] = _read_int(os.path.join(cgroup, "memory.peak"))
        _write(os.path.join(cgroup, "memory.max"), "max")  # hashing below needs no limit
    out["masters_sha256"] = loop.masters_sha256()
    loop.close(remove=True)
    return out


def child_ours(args, cfg):
    sys.path.insert(0, HERE)
    from miles_loop import tensors_sha256  # pylint: disable=import-outside-toplevel
    from tmsdisk.optim import MASTER_KEY, StreamedAdamW  # pylint: disable=import-outside-toplevel

    dev = device_of(args)
    params = make_params(cfg, dev)
    opt = StreamedAdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], bucket_elements=cfg["elements"],
                        depth=cfg["depth"], name="optbench-%s" % args.label)
    times, returned = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        set_grads(params, step, cfg)
        sync(dev)
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        opt.flush()
        sync(dev)
        times.append(time.perf_counter() - t0)
        returned.append(t1 - t0)
    out = summary(times, cfg)
    out["step_returned_s"] = [round(t, 4) for t in returned]
    out["first_step_writes_only"] = True
    state = opt.state_dict()
    masters = [state["state"][i][MASTER_KEY] for i in range(len(params))]
    out["masters_sha256"] = tensors_sha256(masters)
    del state, masters
    opt.close()
    return out


def run_child(args):
    cfg = config_of(args)
    kind = args.kind
    if kind == "resident":
        result = child_resident(args, cfg)
    elif kind == "pinned":
        result = child_pinned(args, cfg)
    elif kind in ("miles_warm", "miles_cold", "miles_cgroup"):
        result = child_miles(args, cfg, kind.split("_", 1)[1])
    elif kind == "ours":
        result = child_ours(args, cfg)
    else:
        raise SystemExit("no child for kind %r" % kind)
    result["kind"] = kind
    with open(args.result + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(args.result + ".tmp", args.result)


# --- raw disk (in the driver: no torch) -----------------------------------------------------------------


def raw_rawdisk(binary, directory, nbytes, timeout):
    proc = subprocess.run([binary, directory, "--gib", "%.6f" % (nbytes / GIB)], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (binary, proc.returncode, proc.stderr.strip()[-500:]))
    text = proc.stdout

    def field(name):
        m = re.search(r"^%s\s+(.*)$" % name, text, re.M)
        return m.group(1).strip() if m else None

    write = float(field("write").split()[0])
    read = float(field("read").split()[0])
    return {"tool": binary, "write_gb_s": write, "read_gb_s": read, "o_direct": field("O_DIRECT"),
            "engine": field("engine"), "output": text.strip()}


def raw_python(directory, nbytes, request=8 << 20, threads=4):
    """Sequential O_DIRECT write (+ fdatasync) then read of a preallocated file, `threads` requests of
    `request` bytes in flight, page-aligned buffers from mmap."""
    count = max(1, nbytes // request)
    path = os.path.join(directory, "raw.%d.bin" % os.getpid())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, count * request)
        pattern = os.urandom(1 << 20)
        buffers = []
        for _ in range(threads):
            buf = mmap.mmap(-1, request)
            for at in range(0, request, len(pattern)):
                buf[at : at + len(pattern)] = pattern[: request - at]
            buffers.append(buf)
        errors = []

        def work(t, write):
            try:
                for i in range(t, count, threads):
                    if write:
                        n = os.pwrite(fd, buffers[t], i * request)
                    else:
                        n = os.preadv(fd, [buffers[t]], i * request)
                    if n != request:
                        raise OSError("short transfer: %d of %d bytes" % (n, request))
            except OSError as e:
                errors.append(e)

        def timed(write):
            t0 = time.perf_counter()
            workers = [threading.Thread(target=work, args=(t, write)) for t in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if write:
                os.fdatasync(fd)
            if errors:
                raise errors[0]
            return time.perf_counter() - t0

        write_s = timed(True)
        read_s = timed(False)
    finally:
        os.close(fd)
        os.unlink(path)
    total = count * request
    return {"tool": "python O_DIRECT (%d x %d MiB in flight)" % (threads, request >> 20),
            "write_gb_s": round(total / write_s / 1e9, 3), "read_gb_s": round(total / read_s / 1e9, 3),
            "o_direct": "yes", "engine": "pwrite/preadv threads"}


def case_raw(args, cfg):
    directory = os.path.join(args.dir, "raw")
    os.makedirs(directory, exist_ok=True)
    nbytes = state_bytes(cfg)
    notes = []
    result = None
    if args.rawdisk and os.access(args.rawdisk, os.X_OK):
        try:
            result = raw_rawdisk(args.rawdisk, directory, nbytes, args.case_timeout)
        except (RuntimeError, OSError, subprocess.SubprocessError, AttributeError, ValueError) as e:
            notes.append("tmsdisk-rawdisk failed (%s); Python O_DIRECT instead" % e)
    elif args.rawdisk:
        notes.append("%s is not an executable; Python O_DIRECT instead" % args.rawdisk)
    if result is None:
        result = raw_python(directory, nbytes)
    result["bytes"] = nbytes
    result["write_s"] = round(nbytes / (result["write_gb_s"] * 1e9), 4)
    result["read_s"] = round(nbytes / (result["read_gb_s"] * 1e9), 4)
    result["median_s"] = round(result["write_s"] + result["read_s"], 4)  # the state out and in once
    if notes:
        result["notes"] = notes
    shutil.rmtree(directory, ignore_errors=True)
    return result


# --- cgroups --------------------------------------------------------------------------------------------


def cgroup_place(name):
    """Where a child may get a memory.max of its own: ("dir", PATH) (a cgroup made here, at the root or
    beside this process's cgroup, whose parent has memory in subtree_control already: nothing existing is
    reconfigured), ("systemd-run", None), or (None, REASON)."""
    reasons = []
    root = "/sys/fs/cgroup"
    fstype = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[1] == root:
                    fstype = fields[2]
    except OSError:
        pass
    if fstype != "cgroup2":
        reasons.append("%s is %s, not cgroup v2" % (root, fstype or "not mounted"))
    else:
        own = own_cgroup()
        candidates = [root]
        if own and own != root:
            candidates.append(os.path.dirname(own))
        for parent in dict.fromkeys(candidates):
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError as e:
                reasons.append("%s: %s" % (parent, e))
                continue
            if "memory" not in enabled:
                reasons.append("%s has no memory controller for its children (subtree_control: %r)" % (
                    parent, " ".join(enabled)))
                continue
            path = os.path.join(parent, name)
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            except OSError as e:
                reasons.append("cannot make %s: %s" % (path, e))
                continue
            if os.path.exists(os.path.join(path, "memory.max")):
                return "dir", path
            reasons.append("%s has no memory.max" % path)
            cgroup_remove(path)
    if os.path.isdir("/run/systemd/system") and shutil.which("systemd-run"):
        return "systemd-run", None
    reasons.append("no systemd (PID 1) to ask for a scope with systemd-run")
    return None, "; ".join(reasons)


def cgroup_remove(path):
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


# --- the driver -----------------------------------------------------------------------------------------


def load_results(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def save_results(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.rename(path + ".tmp", path)


def tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def child_argv(args, kind, label, result_path):
    argv = [sys.executable, os.path.abspath(__file__), "child", "--kind", kind, "--label", label, "--result",
            result_path, "--dir", args.dir, "--device", args.device]
    for k in CONFIG_KEYS:
        argv += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return argv


def run_case(args, cfg, kind, label):
    """One case; its result (or why it was skipped or failed)."""
    if kind == "raw":
        return case_raw(args, cfg)
    if kind == "ours" and not args.tmsctl:
        return {"skipped": "no --tmsctl: StreamedAdamW runs under `tmsctl run` with a daemon"}
    if kind == "ours" and args.device != "cuda":
        return {"skipped": "StreamedAdamW's store needs the shim and a GPU"}
    result_path = os.path.join(args.logs, "optim-%s.result.json" % label)
    log_path = os.path.join(args.logs, "optim-%s.log" % label)
    if os.path.exists(result_path):
        os.unlink(result_path)
    argv = child_argv(args, kind, label, result_path)
    preexec = None
    cgroup = None
    extra = {}
    if kind == "ours":
        argv = [args.tmsctl, "run", "--job", "optbench-" + label, "--"] + argv
        extra["daemon_tier_mib"] = args.daemon_tier_mib
    if kind == "miles_cgroup":
        how, where = cgroup_place("tmsdisk-optim-bench-%d-%s" % (os.getpid(), label))
        if how is None:
            return {"skipped": "no memory cgroup: " + where}
        extra["cgroup_by"] = how
        if how == "systemd-run":
            argv = ["systemd-run", "--scope", "--quiet", "--collect", "-p", "MemoryAccounting=yes", "--"] + argv
        else:
            cgroup = where

            def preexec():
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=args.case_timeout,
                                  preexec_fn=preexec, check=False)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout after %d s" % args.case_timeout
    except (OSError, subprocess.SubprocessError) as e:
        rc = "could not start: %s" % e
    finally:
        if cgroup:
            # An OOM kill in the cgroup leaves no result: its events say so.
            extra["cgroup_events"] = _read_kv(os.path.join(cgroup, "memory.events"))
            cgroup_remove(cgroup)
    wall = round(time.perf_counter() - t0, 1)
    result = load_results(result_path)
    if rc != 0 or result is None:
        return dict(extra, error="child exit status %s" % rc, log=log_path, log_tail=tail(log_path), wall_s=wall)
    result.update(extra)
    result["log"] = log_path
    result["wall_s"] = wall
    return result


def cmd_run(args):
    cfg = config_of(args)
    os.makedirs(args.logs, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    data = load_results(args.out)
    if data is None:
        data = {"config": cfg, "state_bytes": state_bytes(cfg), "cases": {}, "order": []}
    elif data["config"] != cfg:
        raise SystemExit("%s holds a run of other sizes (%s); give another --out or remove it" % (args.out,
                                                                                                 data["config"]))
    cases = args.cases.replace(",", " ").split()
    for item in cases:
        kind, _, label = item.partition(":")
        label = label or kind
        if kind not in KINDS:
            raise SystemExit("unknown case %r (kinds: %s)" % (kind, " ".join(KINDS)))
    print("state: %d buckets x %d elements x 12 bytes = %.2f GB; %d warm-up + %d timed steps; dir %s" % (
        cfg["buckets"], cfg["elements"], state_bytes(cfg) / 1e9, cfg["warmup"], cfg["steps"], args.dir), flush=True)
    for item in cases:
        kind, _, label = item.partition(":")
        label = label or kind
        t0 = time.perf_counter()
        try:
            result = run_case(args, cfg, kind, label)
        except Exception as e:  # pylint: disable=broad-except
            result = {"error": "%s: %s" % (type(e).__name__, e)}
        result.setdefault("kind", kind)
        result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data["cases"][label] = result
        if label not in data["order"]:
            data["order"].append(label)
        save_results(args.out, data)
        if "skipped" in result:
            said = "skipped: " + result["skipped"]
        elif "error" in result:
            said = "ERROR: %s (%s)%s" % (result["error"], result.get("log", ""),
                                         ("\n" + result["log_tail"]) if result.get("log_tail") else "")
        else:
            said = "median %.3f s%s" % (result["median_s"], (", masters %s" % result["masters_sha256"][:16])
                                        if "masters_sha256" in result else "")
        print("%-13s %-13s %6.1f s  %s" % (label, kind, time.perf_counter() - t0, said), flush=True)
    return 0


# --- the report -----------------------------------------------------------------------------------------

RATIOS = (
    # name, numerator, denominator, goal, what
    ("ours_full / miles_warm", "ours_full", "miles_warm", 0.3,
     "ours, tier holding all the state, against miles with a warm page cache"),
    ("ours_tier / miles_cgroup", "ours_tier", "miles_cgroup", 0.8,
     "ours with an N GiB tier against miles in an N GiB memory cgroup"),
    ("ours_full / pinned copy", "ours_full", "pinned", 1.15,
     "ours, tier holding all, against the state copied in and out through pinned memory"),
    ("ours_disk / raw O_DIRECT", "ours_disk", "raw", 1.15,
     "ours without a tier against the state read and written at the raw O_DIRECT rates"),
)
INFO = (
    ("miles_warm / resident", "miles_warm", "resident"),
    ("ours_full / resident", "ours_full", "resident"),
    ("miles_cold / raw O_DIRECT", "miles_cold", "raw"),
    ("miles_cgroup / raw O_DIRECT", "miles_cgroup", "raw"),
    ("ours_tier / miles_warm", "ours_tier", "miles_warm"),
    ("ours_disk / miles_cold", "ours_disk", "miles_cold"),
)


def cmd_report(args):
    data = load_results(args.out)
    if data is None:
        raise SystemExit("no results at %s" % args.out)
    cfg, cases = data["config"], data["cases"]
    moved = 2 * data["state_bytes"]
    print("streamed optimizer vs miles' loop: %d buckets x %d elements (%.2f GB of state: fp32 master + exp_avg + "
          "exp_avg_sq), %d warm-up + %d timed steps, depth %d, N = %g GiB" % (
              cfg["buckets"], cfg["elements"], data["state_bytes"] / 1e9, cfg["warmup"], cfg["steps"], cfg["depth"],
              cfg["cgroup_gib"]))
    print("%-13s %9s %9s %9s %8s  %-16s %s" % ("case", "median s", "min s", "max s", "GB/s", "masters", "notes"))
    for label in data["order"]:
        c = cases[label]
        if "median_s" not in c:
            print("%-13s %s" % (label, "skipped: " + c["skipped"] if "skipped" in c else "ERROR: " + c.get("error", "?")))
            continue
        notes = []
        if c["kind"] == "resident":
            notes.append("timed: %s; reference: foreach" % c.get("timed_variant"))
            fused = c.get("variants", {}).get("fused", {})
            if "error" in fused:
                notes.append("fused: " + fused["error"][:60])
            elif "masters_sha256" in fused:
                notes.append("fused bits %s" % ("equal" if fused["masters_sha256"] == c.get("masters_sha256")
                                                 else "differ (not required)"))
        if c["kind"] == "pinned":
            notes.append("H2D %.1f, D2H %.1f GB/s%s" % (c["h2d_gb_s"], c["d2h_gb_s"], "" if c["pinned"] else " (not pinned)"))
        if c["kind"] == "raw":
            notes.append("write %.2f, read %.2f GB/s, %s" % (c["write_gb_s"], c["read_gb_s"], c.get("tool", "")))
        if c["kind"] == "miles_cold":
            notes.append("drop: %s" % c.get("cache_drop"))
            if c.get("sync_before_step_s"):
                notes.append("sync before step %.2f s" % statistics.median(c["sync_before_step_s"][cfg["warmup"]:] or
                                                                           c["sync_before_step_s"]))
        if c["kind"] == "miles_cgroup" and "cgroup" in c:
            g = c["cgroup"]
            notes.append("memory.max %.2f GiB (%.2f + N), by %s" % (g["memory_max"] / GIB, g["baseline_bytes"] / GIB,
                                                                 c.get("cgroup_by")))
        if c["kind"] == "ours":
            notes.append("daemon tier %s MiB" % c.get("daemon_tier_mib"))
        rate = "%.2f" % (moved / c["median_s"] / 1e9) if c["kind"] not in ("resident",) else "-"
        print("%-13s %9.3f %9.3f %9.3f %8s  %-16s %s" % (label, c["median_s"], c.get("min_s", c["median_s"]),
                                                     c.get("max_s", c["median_s"]), rate,
                                                     c.get("masters_sha256", "")[:16], "; ".join(notes)))
    print("(GB/s: the state read and written once, %.2f GB, over the median)" % (moved / 1e9))

    ratios = {}
    print("\nratios (goal):")
    for name, num, den, goal, what in RATIOS:
        a, b = cases.get(num, {}).get("median_s"), cases.get(den, {}).get("median_s")
        if a is None or b is None:
            print("  %-26s not measured (%s)" % (name, ", ".join(x for x, v in ((num, a), (den, b)) if v is None)))
            continue
        r = a / b
        ratios[name] = {"ratio": round(r, 3), "goal_max": goal, "met": r <= goal}
        print("  %-26s %6.3f  (<= %.2f: %s)  %s" % (name, r, goal, "met" if r <= goal else "MISSED", what))
    print("for context:")
    for name, num, den in INFO:
        a, b = cases.get(num, {}).get("median_s"), cases.get(den, {}).get("median_s")
        if a is not None and b is not None:
            ratios[name] = {"ratio": round(a / b, 3)}
            print("  %-26s %6.3f" % (name, a / b))

    reference = cases.get("resident", {}).get("masters_sha256")
    compared, differ, errors = [], [], []
    for label in data["order"]:
        c = cases[label]
        if "error" in c:
            errors.append(label)
        if label == "resident" or "masters_sha256" not in c:
            continue
        compared.append(label)
        if c["masters_sha256"] != reference:
            differ.append(label)
    print()
    if reference is None:
        status = 1 if compared else 3
        print("FAIL: no reference (the resident AdamW case did not run); masters of %s not checked" % (
            ", ".join(compared) or "no case"))
    elif not compared:
        status = 1
        print("FAIL: no case's masters to compare with the resident AdamW's")
    elif differ:
        status = 1
        print("FAIL: masters after %d steps differ from the resident AdamW's in: %s" % (
            cfg["warmup"] + cfg["steps"], ", ".join(differ)))
    else:
        status = 3 if errors else 0
        print("PASS: masters after %d steps bit-identical to the resident AdamW's (%s): %s" % (
            cfg["warmup"] + cfg["steps"], reference[:16], ", ".join(compared)))
    if errors:
        print("ERROR: these cases failed to run: %s" % ", ".join(errors))
    data["ratios"] = ratios
    data["correctness"] = {"reference": reference, "compared": compared, "differ": differ, "errors": errors,
                           "pass": status == 0}
    save_results(args.out, data)
    return status


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def sizes(p):
        p.add_argument("--buckets", type=int, default=4, help="N buckets (one bf16 parameter each)")
        p.add_argument("--elements", type=int, default=200_000_000, help="E elements per bucket (miles: <= 200M)")
        p.add_argument("--steps", type=int, default=3, help="timed steps (K)")
        p.add_argument("--warmup", type=int, default=1, help="steps before them (ours' first only writes)")
        p.add_argument("--depth", type=int, default=3, help="StreamedAdamW's depth")
        p.add_argument("--cgroup-gib", type=float, default=4, help="N: miles' cgroup headroom (ours' tier: the caller's)")
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--weight-decay", type=float, default=0.1)
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--dir", help="directory on the disk under test (miles' files, the raw test)")
        p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the driver")

    run = sub.add_parser("run", help="run cases, adding them to --out")
    sizes(run)
    run.add_argument("--cases", required=True, help="KIND[:LABEL] ..., kinds: " + " ".join(KINDS))
    run.add_argument("--out", required=True, help="the JSON of all figures")
    run.add_argument("--logs", help="the children's logs (default: beside --out)")
    run.add_argument("--tmsctl", help="tmsctl, to run the `ours` cases under (`tmsctl run`)")
    run.add_argument("--rawdisk", help="tmsdisk-rawdisk (bench/rawdisk_main.cpp); else Python O_DIRECT")
    run.add_argument("--daemon-tier-mib", type=int, default=None, help="the daemon's --host-tier-mb, recorded")
    run.add_argument("--case-timeout", type=int, default=300, help="seconds a case may take")
    report = sub.add_parser("report", help="print the table, ratios and PASS/FAIL of --out")
    report.add_argument("--out", required=True)
    child = sub.add_parser("child", help=argparse.SUPPRESS)
    sizes(child)
    child.add_argument("--kind", required=True)
    child.add_argument("--label", required=True)
    child.add_argument("--result", required=True)
    args = parser.parse_args()
    if args.command == "run":
        if not args.dir:
            parser.error("run needs --dir")
        args.dir = os.path.abspath(args.dir)
        args.out = os.path.abspath(args.out)
        args.logs = os.path.abspath(args.logs or os.path.dirname(args.out))
        return cmd_run(args)
    if args.command == "report":
        return cmd_report(args)
    run_child(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
