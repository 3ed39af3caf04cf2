# SPDX-License-Identifier: Apache-2.0
# Tags on a GPU, from Python (the `tmsdisk` package): a PyTorch program that pauses itself whole and in
# part. Run under tmsctl, which preloads libtmsdisk.so and puts the package on the path:
#   TMSCTL=/path/to/tmsctl tmsctl run --job tags -- python3 torch_tags.py [--weights-gib 4] [--kv-gib 1]
#
# 1. Inside tmsdisk.region("weights") (policy backup): WEIGHTS_GIB tensors of 1 GiB of random data,
#    bf16 and float32 by turns. Inside tmsdisk.region("kv_cache", "discard"): one KV_GIB GiB tensor,
#    filled with non-zero bytes. Each region gets a private torch.cuda.MemPool (as tmsdisk's
#    torch_memory_saver does), after torch.cuda.empty_cache(), so that its tensors get memory the
#    caching allocator obtains while the tag is pushed, never blocks it cached under another tag.
#    The SHA-256 of the weights' bytes is taken on the host.
# 2. tmsdisk.pause(): the whole process. tmsdisk.status() must show the weights paused as backup and
#    the KV cache paused as discard (per tag), and the GPU must have got the memory back
#    (torch.cuda.mem_get_info on a helper thread, in case the query is held while the process is
#    paused, and nvidia-smi). tmsdisk.resume(): the weights bit-identical (SHA-256), the KV cache
#    readable at the same data_ptr() and all zeros. With TMSCTL set, `tmsctl --json status` must say
#    the daemon's view of the same pause: the KV cache's bytes discarded, the weights' saved.
# 3. The KV cache refilled; tmsdisk.pause("kv_cache") alone: per-tag figures (KV cache paused, weights
#    resident), its memory back on the GPU, and a matmul on the weights (which must not wait: the rest
#    of the process runs) equal to the one computed before the pause. tmsdisk.resume("kv_cache"): zeros
#    again at the same address, weights still bit-identical.
#
# stdout: progress lines, then one JSON line {"kind": "result", "ok": ..., "checks": {...}, ...} and a
# last line "PASS torch_tags ..." or "FAIL torch_tags: ...". Exit status 0 on PASS, 1 on FAIL. A
# watchdog (faulthandler) ends the program with its stacks printed if a phase hangs (--watchdog-s).
import argparse
import contextlib
import ctypes
import faulthandler
import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import torch

import tmsdisk

GiB = 1 << 30
MiB = 1 << 20
HASH_CHUNK = 256 * MiB  # bytes copied to the host per step of the SHA-256

POOLS = []  # the regions' MemPools, alive as long as the program (their tensors live in them)


def log(msg):
    print(f"[torch_tags {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def child_env():
    """The environment for helpers (nvidia-smi, tmsctl): without the preloaded shim."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def with_timeout(fn, seconds):
    """(fn(), None) if it returns within `seconds`, else (None, "timed out"): on a helper thread, so that
    a CUDA query held while the process is paused cannot hang the program (the thread finishes once the
    process is resumed)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:  # pylint: disable=broad-except
            box["error"] = repr(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return None, f"no answer within {seconds} s"
    return box.get("value"), box.get("error")


def free_bytes():
    """torch.cuda.mem_get_info()[0] (free bytes on this device), or None if it did not answer in time."""
    device = torch.cuda.current_device()
    value, err = with_timeout(lambda: torch.cuda.mem_get_info(device)[0], 10)
    if err:
        log(f"torch.cuda.mem_get_info: {err}")
    return value


def smi_used_mib():
    """memory.used of this process's GPU as nvidia-smi says (MiB), or None."""
    want = None
    try:
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        if uuid is not None:
            want = str(uuid).lower()
            if not want.startswith("gpu-"):
                want = "gpu-" + want
    except Exception:  # pylint: disable=broad-except
        want = None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30, env=child_env())
        rows = [[f.strip() for f in line.split(",")] for line in r.stdout.strip().splitlines() if line.count(",") == 2]
    except Exception as e:  # pylint: disable=broad-except
        log(f"nvidia-smi failed: {e!r}")
        return None
    if not rows:
        return None
    pick = None
    if want:
        pick = next((row for row in rows if row[1].lower() == want), None)
    if pick is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        pick = next((row for row in rows if row[0] == visible), rows[0])
    try:
        return int(pick[2])
    except ValueError:
        return None


@contextlib.contextmanager
def fresh_region(tag, policy):
    """tmsdisk.region(tag, policy) in which tensors get memory allocated while the tag is pushed."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with contextlib.ExitStack() as stack:
        if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            pool = torch.cuda.MemPool()
            POOLS.append(pool)
            stack.enter_context(torch.cuda.use_mem_pool(pool))
        stack.enter_context(tmsdisk.region(tag, policy))
        yield


def sha256(tensors, buf):
    """SHA-256 of the tensors' bytes, in order (and one per tensor), through the pinned host buffer."""
    whole = hashlib.sha256()
    each = []
    for t in tensors:
        h = hashlib.sha256()
        flat = t.reshape(-1).view(torch.uint8)
        for off in range(0, flat.numel(), HASH_CHUNK):
            n = min(HASH_CHUNK, flat.numel() - off)
            buf[:n].copy_(flat[off:off + n])  # synchronous: the bytes are on the host when it returns
            view = memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr()))
            h.update(view)
            whole.update(view)
        each.append(h.hexdigest())
    return whole.hexdigest(), each


def tag_fig(st, name):
    t = st.tag(name)
    if t is None:
        return None
    return {"policy": t.policy, "allocations": t.allocations, "paused_allocations": t.paused_allocations,
            "resident_bytes": t.resident_bytes, "paused_bytes": t.paused_bytes}


def status_fig(st):
    return {"state": st.state, "resident_bytes": st.resident_bytes, "paused_bytes": st.paused_bytes,
            "managed_allocations": st.managed_allocations, "paused_allocations": st.paused_allocations,
            "last_pause_bytes": st.last_pause_bytes, "last_pause_ns": st.last_pause_ns,
            "last_resume_bytes": st.last_resume_bytes, "last_resume_ns": st.last_resume_ns,
            "last_message": st.last_message, "last_error": st.last_error,
            "unmanaged_bytes": {k: v for k, v in st.unmanaged_bytes.items() if v},
            "tags": [t.__dict__ for t in st.tags]}


def daemon_view(want_pause_bytes, wait_s=10.0):
    """This rank in `tmsctl --json status` once the daemon has the last pause of `want_pause_bytes`
    (reports reach it shortly after a state change), or the last answer, or None without TMSCTL."""
    tmsctl = os.environ.get("TMSCTL")
    if not tmsctl:
        return None
    deadline = time.monotonic() + wait_s
    rank = None
    while True:
        try:
            r = subprocess.run([tmsctl, "--json", "status"], capture_output=True, text=True, timeout=30, env=child_env())
            for row in json.loads(r.stdout):
                if row.get("pid") == os.getpid():
                    rank = row
        except Exception as e:  # pylint: disable=broad-except
            log(f"tmsctl status failed: {e!r}")
        if rank and (rank.get("last_pause") or {}).get("bytes") == want_pause_bytes:
            return rank
        if time.monotonic() > deadline:
            return rank
        time.sleep(0.5)


class Checks:
    def __init__(self):
        self.results = {}

    def add(self, name, ok, detail=None):
        self.results[name] = bool(ok)
        line = f"{'ok  ' if ok else 'FAIL'} {name}"
        if detail is not None:
            line += f": {detail}"
        print(line, flush=True)
        return ok

    def failed(self):
        return [k for k, v in self.results.items() if not v]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=int, default=4, help="GiB of weights (one 1 GiB tensor per GiB)")
    ap.add_argument("--kv-gib", type=int, default=1, help="GiB of KV cache (one tensor)")
    ap.add_argument("--seed", type=int, default=20240611)
    ap.add_argument("--watchdog-s", type=int, default=300, help="per phase: dump stacks and exit if it hangs")
    args = ap.parse_args()

    checks = Checks()
    fig = {"pid": os.getpid()}
    paused = None  # None, "all" or a tag: what to resume if something raises while paused
    faulthandler.enable()

    def phase(name):
        log(name)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)

    try:
        phase("setup")
        if not tmsdisk.loaded():
            raise RuntimeError("libtmsdisk.so is not loaded: run this under `tmsctl run -- python3 torch_tags.py`")
        fig.update({"tmsdisk": tmsdisk.version(), "library": tmsdisk.library_path(), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                    "mempool": hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"),
                    "on_touch": os.environ.get("TMSDISK_ON_TOUCH", "wait (default)")})
        torch.cuda.init()
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        w_bytes, kv_bytes = args.weights_gib * GiB, args.kv_gib * GiB

        # 1. Weights (backup) and KV cache (discard), each in a region of its own.
        weights = []
        with fresh_region("weights", tmsdisk.BACKUP):
            for i in range(args.weights_gib):
                dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
                t = torch.empty(GiB // (2 if dtype == torch.bfloat16 else 4), dtype=dtype, device="cuda")
                t.normal_(generator=gen)  # in place: nothing else is allocated in the region
                weights.append(t)
        with fresh_region("kv_cache", tmsdisk.DISCARD):
            kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
        kv.fill_(0xA5)
        kv_ptr = kv.data_ptr()
        torch.cuda.synchronize()
        st = tmsdisk.status()
        fig["after_alloc"] = {"weights": tag_fig(st, "weights"), "kv_cache": tag_fig(st, "kv_cache"),
                              "status": status_fig(st)}
        w, k = st.tag("weights"), st.tag("kv_cache")
        checks.add("alloc.weights_tagged", w is not None and w.policy == "backup" and w_bytes <= w.resident_bytes <= w_bytes + 64 * MiB,
                   fig["after_alloc"]["weights"])
        checks.add("alloc.kv_cache_tagged", k is not None and k.policy == "discard" and kv_bytes <= k.resident_bytes <= kv_bytes + 64 * MiB,
                   fig["after_alloc"]["kv_cache"])

        buf = torch.empty(HASH_CHUNK, dtype=torch.uint8, pin_memory=True)
        t0 = time.monotonic()
        digest0, each0 = sha256(weights, buf)
        fig["sha256_s"] = round(time.monotonic() - t0, 2)
        fig["weights_sha256"] = digest0
        # The matmul of phase 3, computed now (untagged operands and result).
        a = weights[0].view(16384, -1)  # bf16, 16384 x 32768
        x = torch.randn(a.shape[1], 256, dtype=a.dtype, device="cuda", generator=gen)
        y_ref = a @ x
        torch.cuda.synchronize()

        # 2. The whole process.
        phase("pause(): the whole process")
        free_before, smi_before = free_bytes(), smi_used_mib()
        t0 = time.monotonic()
        paused = "all"
        tmsdisk.pause()
        fig["pause_all_s"] = round(time.monotonic() - t0, 3)
        st = tmsdisk.status()
        free_paused, smi_paused = free_bytes(), smi_used_mib()
        fig["paused_all"] = {"weights": tag_fig(st, "weights"), "kv_cache": tag_fig(st, "kv_cache"), "status": status_fig(st),
                             "free_before": free_before, "free_paused": free_paused,
                             "smi_used_mib_before": smi_before, "smi_used_mib_paused": smi_paused}
        w, k = st.tag("weights"), st.tag("kv_cache")
        w_res = fig["after_alloc"]["weights"]["resident_bytes"] if fig["after_alloc"]["weights"] else w_bytes
        kv_res = fig["after_alloc"]["kv_cache"]["resident_bytes"] if fig["after_alloc"]["kv_cache"] else kv_bytes
        checks.add("pause_all.state", st.state == "paused", st.state)
        checks.add("pause_all.weights_saved", w is not None and w.policy == "backup" and w.paused_bytes == w_res and w.resident_bytes == 0,
                   fig["paused_all"]["weights"])
        checks.add("pause_all.kv_cache_discarded", k is not None and k.policy == "discard" and k.paused_bytes == kv_res and k.resident_bytes == 0,
                   fig["paused_all"]["kv_cache"])
        checks.add("pause_all.bytes", st.last_pause_bytes >= w_res + kv_res, f"last_pause_bytes {st.last_pause_bytes}")
        released = None
        how = None
        if free_before is not None and free_paused is not None:
            released, how = free_paused - free_before, "mem_get_info"
        elif smi_before is not None and smi_paused is not None:
            released, how = (smi_before - smi_paused) * MiB, "nvidia-smi"
        fig["paused_all"]["released_bytes"], fig["paused_all"]["released_by"] = released, how
        checks.add("pause_all.gpu_memory_released", released is not None and released >= 0.9 * (w_bytes + kv_bytes),
                   f"{None if released is None else round(released / GiB, 3)} GiB ({how}); nvidia-smi "
                   f"{smi_before} -> {smi_paused} MiB")

        phase("resume(): the whole process")
        t0 = time.monotonic()
        tmsdisk.resume()
        paused = None
        fig["resume_all_s"] = round(time.monotonic() - t0, 3)
        st = tmsdisk.status()
        fig["resumed_all"] = {"status": status_fig(st), "free": free_bytes(), "smi_used_mib": smi_used_mib()}
        checks.add("resume_all.state", st.state == "running" and st.paused_bytes == 0, f"{st.state}, paused_bytes {st.paused_bytes}")
        digest1, each1 = sha256(weights, buf)
        checks.add("resume_all.weights_bit_identical", digest1 == digest0,
                   "sha256 " + ("equal" if digest1 == digest0 else f"differs in tensor(s) {[i for i, (p, q) in enumerate(zip(each0, each1)) if p != q]}"))
        nz = int(torch.count_nonzero(kv).item())
        checks.add("resume_all.kv_cache_zero_at_same_address", kv.data_ptr() == kv_ptr and nz == 0,
                   f"data_ptr {kv.data_ptr():#x} (was {kv_ptr:#x}), {nz} non-zero bytes")
        rank = daemon_view(st.last_pause_bytes)
        if rank is not None:
            lp = rank.get("last_pause") or {}
            fig["daemon_after_pause_all"] = {"last_pause": lp, "tags": rank.get("tags"), "state": rank.get("state")}
            checks.add("pause_all.daemon_says_discarded", lp.get("discarded_bytes") == kv_res, f"tmsctl status last_pause {lp}")
            checks.add("pause_all.daemon_says_saved", lp.get("bytes", 0) - lp.get("discarded_bytes", 0) >= w_res,
                       "bytes - discarded_bytes >= the weights")

        # 3. The KV cache alone, while the weights compute.
        kv.fill_(0x5A)
        torch.cuda.synchronize()
        phase('pause("kv_cache")')
        free_before, smi_before = free_bytes(), smi_used_mib()
        t0 = time.monotonic()
        paused = "kv_cache"
        tmsdisk.pause("kv_cache")
        fig["pause_kv_s"] = round(time.monotonic() - t0, 3)
        st = tmsdisk.status()
        free_paused, smi_paused = free_bytes(), smi_used_mib()
        fig["paused_kv"] = {"weights": tag_fig(st, "weights"), "kv_cache": tag_fig(st, "kv_cache"), "status": status_fig(st),
                            "free_before": free_before, "free_paused": free_paused,
                            "smi_used_mib_before": smi_before, "smi_used_mib_paused": smi_paused}
        w, k = st.tag("weights"), st.tag("kv_cache")
        checks.add("pause_kv.kv_cache_paused", k is not None and k.paused_bytes == kv_res and k.resident_bytes == 0, fig["paused_kv"]["kv_cache"])
        checks.add("pause_kv.weights_resident", w is not None and w.resident_bytes == w_res and w.paused_bytes == 0, fig["paused_kv"]["weights"])
        released, how = None, None
        if free_before is not None and free_paused is not None:
            released, how = free_paused - free_before, "mem_get_info"
        elif smi_before is not None and smi_paused is not None:
            released, how = (smi_before - smi_paused) * MiB, "nvidia-smi"
        fig["paused_kv"]["released_bytes"], fig["paused_kv"]["released_by"] = released, how
        checks.add("pause_kv.gpu_memory_released", released is not None and released >= 0.9 * kv_bytes,
                   f"{None if released is None else round(released / GiB, 3)} GiB ({how})")
        t0 = time.monotonic()
        y = a @ x
        s = sum(float(t.float().sum().item()) for t in weights[1:2])  # a float32 tensor read whole, too
        torch.cuda.synchronize()
        fig["matmul_while_kv_paused_s"] = round(time.monotonic() - t0, 3)
        same = torch.equal(y, y_ref)
        close = same or torch.allclose(y.float(), y_ref.float(), rtol=1e-2, atol=1e-2)
        checks.add("pause_kv.matmul_on_weights", close and s == s,
                   f"{'bit-identical to' if same else ('close to' if close else 'DIFFERENT from')} the result before the "
                   f"pause, in {fig['matmul_while_kv_paused_s']} s")

        phase('resume("kv_cache")')
        t0 = time.monotonic()
        tmsdisk.resume("kv_cache")
        paused = None
        fig["resume_kv_s"] = round(time.monotonic() - t0, 3)
        st = tmsdisk.status()
        fig["resumed_kv"] = {"status": status_fig(st)}
        k = st.tag("kv_cache")
        checks.add("resume_kv.resident", st.paused_bytes == 0 and k is not None and k.resident_bytes == kv_res,
                   f"{st.state}, paused_bytes {st.paused_bytes}")
        nz = int(torch.count_nonzero(kv).item())
        checks.add("resume_kv.kv_cache_zero_at_same_address", kv.data_ptr() == kv_ptr and nz == 0,
                   f"data_ptr {kv.data_ptr():#x} (was {kv_ptr:#x}), {nz} non-zero bytes")
        digest2, _ = sha256(weights, buf)
        checks.add("resume_kv.weights_bit_identical", digest2 == digest0, "sha256 " + ("equal" if digest2 == digest0 else "DIFFERS"))
        faulthandler.cancel_dump_traceback_later()
    except Exception as e:  # pylint: disable=broad-except
        faulthandler.cancel_dump_traceback_later()
        import traceback  # pylint: disable=import-outside-toplevel

        traceback.print_exc()
        checks.add("no_exception", False, repr(e))
        if paused is not None:
            try:
                if paused == "all":
                    tmsdisk.resume()
                else:
                    tmsdisk.resume(paused)
            except Exception as e2:  # pylint: disable=broad-except
                log(f"resume after the failure failed too: {e2!r}")

    failed = checks.failed()
    ok = not failed and bool(checks.results)
    print(json.dumps({"kind": "result", "ok": ok, "checks": checks.results, "failed": failed, **fig}, sort_keys=True, default=str),
          flush=True)
    if ok:
        print(f"PASS torch_tags: {len(checks.results)} checks; whole pause {fig.get('pause_all_s')} s / resume "
              f"{fig.get('resume_all_s')} s, kv_cache pause {fig.get('pause_kv_s')} s / resume {fig.get('resume_kv_s')} s",
              flush=True)
        return 0
    print(f"FAIL torch_tags: {', '.join(failed) or 'no check ran'}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
