# SPDX-License-Identifier: Apache-2.0
# On a GPU: tmsdisk side by side with torch_memory_saver's disk backup (TMS,
# github.com/fzyzcjy/torch_memory_saver). One PyTorch program, run once per tool and case by
# run_gpu_tms_compare.sh, which compares the two runs.
#
#   --mode tms      TMS, hook mode preload (LD_PRELOAD=.../torch_memory_saver_hook_mode_preload_cu13*.so,
#                   PYTHONPATH=its source tree with the built extensions, TMS_DISK_BACKUP_DIR=DIR): every
#                   tensor is made inside torch_memory_saver.region(enable_disk_backup=True), and the
#                   program pauses itself with torch_memory_saver.pause() / resume().
#   --mode tmsdisk  no TMS: run as `tmsctl run --job J -- python3 tms_compare.py --mode tmsdisk ...`; the
#                   program pauses itself with tmsdisk_pause() / tmsdisk_resume(), which the preloaded
#                   libtmsdisk.so exports (ctypes.CDLL(None), which releases the GIL while it waits, so
#                   that the start-up module's callback can empty PyTorch's cache before the pause).
#
# Cases (sizes for --gib 16, the default: 16 tensors of GIB/16 GiB each):
#   cache   16 GiB of random tensors live, and 5 more such tensors freed into PyTorch's caching
#           allocator without empty_cache (21 GiB reserved). CYCLES pause/resume cycles; the live
#           tensors never change after the first, like frozen weights in RL; before each cycle after
#           the first, 5 temporaries are allocated, filled and freed again, as a step between pauses
#           would, so that the cache is in play every cycle.
#   random  16 GiB of random tensors, nothing else cached; before each pause every tensor is filled
#           with new random data, so every pause must write everything.
#
# Each cycle's pause and resume are timed as wall seconds around the call (after a
# torch.cuda.synchronize(), and with one inside the resume's time), and the live tensors are checked
# after each resume against a digest taken before the pause: per tensor, int64 sums of its 16 KiB rows,
# summed plain and position-weighted on the GPU (a changed, lost or moved row changes them), plus the
# first and last MiB compared byte for byte on the host. While paused, nvidia-smi says how much GPU
# memory the process still holds, and the disk's own counters (/proc/diskstats) give the bytes written
# and read by each pause and resume, whichever process did the I/O.
#
# stdout: one JSON object per line: {"kind": "setup", ...}, one {"kind": "measurement", ...} per cycle,
# and {"kind": "done", "ok": ...}. Progress goes to stderr. Exit status 0 when every cycle paused,
# resumed and verified.
#   python3 tms_compare.py --mode tms|tmsdisk --case cache|random [--gib 16] [--cycles 3]
#                          [--tensors 16] [--cache-tensors 5] [--disk-dir DIR] [--drop-caches auto|yes|no]
import argparse
import contextlib
import ctypes
import json
import os
import re
import subprocess
import sys
import time

import gpu_helpers  # beside this script (the scripts run as files)

import torch


def log(msg):
    print(f"[tms_compare {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj, sort_keys=True), flush=True)


def gpu_used_mib():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=30, env=gpu_helpers.child_env())
        return int(r.stdout.strip().splitlines()[0])
    except Exception as e:  # pylint: disable=broad-except
        log(f"nvidia-smi failed: {e!r}")
        return None


class DiskCounters:
    """Bytes read and written by the block device that holds DIR, from /proc/diskstats."""

    WHOLE_DISK = re.compile(r"^(vd[a-z]+|sd[a-z]+|xvd[a-z]+|nvme\d+n\d+)$")

    def __init__(self, path):
        st = os.stat(path)
        self.dev = (os.major(st.st_dev), os.minor(st.st_dev))
        self.names = None
        for fields in self._lines():
            if (int(fields[0]), int(fields[1])) == self.dev:
                self.names = {fields[2]}
        if self.names is None:  # overlay or device mapper: count every whole disk
            self.names = {f[2] for f in self._lines() if self.WHOLE_DISK.match(f[2])}
        self.where = ",".join(sorted(self.names))

    @staticmethod
    def _lines():
        with open("/proc/diskstats") as f:
            return [line.split() for line in f if len(line.split()) >= 10]

    def read(self):
        rd = wr = 0
        for f in self._lines():
            if f[2] in self.names:
                rd += int(f[5]) * 512
                wr += int(f[9]) * 512
        return rd, wr


def drop_caches(enabled):
    return enabled and gpu_helpers.drop_caches()


def digest(tensors):
    """Per tensor: (sum of row sums, position-weighted sum of row sums), as int64 on the GPU."""
    out = []
    for t in tensors:
        rows = t.view(torch.int64).view(-1, 2048).sum(dim=1)
        w = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.int64)
        out.append((rows.sum().item(), (rows * w).sum().item()))
        del rows, w
    return out


def edges(tensors):
    n = (1 << 20) // 4
    return [(t[:n].cpu().clone(), t[-n:].cpu().clone()) for t in tensors]


class Tms:
    name = "tms"

    def __init__(self, args):
        from torch_memory_saver import torch_memory_saver  # pylint: disable=import-outside-toplevel

        self.saver = torch_memory_saver
        self.saver.hook_mode = args.tms_hook
        if args.disk_dir:
            self.saver.set_disk_backup_dir(args.disk_dir)
        self.disk_dir = args.disk_dir or os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")

    def region(self):
        return self.saver.region(enable_disk_backup=True)

    def pause(self):
        self.saver.pause()
        return 0

    def resume(self):
        self.saver.resume()
        return 0

    def while_paused(self):
        files = [f for f in os.listdir(self.disk_dir) if f.startswith("tms_")]
        return {"tms_files": len(files),
                "tms_file_bytes": sum(os.path.getsize(os.path.join(self.disk_dir, f)) for f in files)}

    def after_resume(self):
        return {}

    def info(self):
        return {"tms_hook": self.saver._impl._hook_mode,  # pylint: disable=protected-access
                "tms_library": str(self.saver._impl._hook_util.get_path_binary()),  # pylint: disable=protected-access
                "tms_chunk_mb": int(os.environ.get("TMS_DISK_BACKUP_CHUNK_MB", "256") or 256),
                "disk_dir": self.disk_dir}


class Status(ctypes.Structure):  # struct tmsdisk_status, API version 3 (interposer/include/tmsdisk.h)
    _fields_ = [("state", ctypes.c_uint32), ("connected", ctypes.c_uint32), ("enabled", ctypes.c_uint32),
                ("managed_allocations", ctypes.c_uint32), ("paused_allocations", ctypes.c_uint32),
                ("last_error", ctypes.c_int32), ("session_id", ctypes.c_uint64),
                ("resident_bytes", ctypes.c_uint64), ("paused_bytes", ctypes.c_uint64),
                ("unmanaged_bytes", ctypes.c_uint64 * 8), ("last_pause_bytes", ctypes.c_uint64),
                ("last_pause_ns", ctypes.c_uint64), ("last_resume_bytes", ctypes.c_uint64),
                ("last_resume_ns", ctypes.c_uint64), ("last_message", ctypes.c_char * 256),
                ("damaged_allocations", ctypes.c_uint32), ("damaged_bytes", ctypes.c_uint64)]


class Tmsdisk:
    name = "tmsdisk"

    def __init__(self, args):
        self.lib = ctypes.CDLL(None)  # CDLL, not PyDLL: the GIL is released while a pause waits
        try:
            self.lib.tmsdisk_pause.restype = ctypes.c_int
            self.lib.tmsdisk_resume.restype = ctypes.c_int
            self.lib.tmsdisk_version.restype = ctypes.c_char_p
        except AttributeError:
            sys.exit("tms_compare: libtmsdisk.so is not loaded; run this under `tmsctl run -- python3 ...`")
        self.disk_dir = args.disk_dir

    def region(self):
        return contextlib.nullcontext()

    def pause(self):
        return self.lib.tmsdisk_pause()

    def resume(self):
        return self.lib.tmsdisk_resume()

    def status(self):
        s = Status()
        self.lib.tmsdisk_status(ctypes.byref(s), ctypes.c_size_t(ctypes.sizeof(s)))
        return s

    def while_paused(self):
        s = self.status()
        return {"tmsdisk_paused_bytes": s.paused_bytes, "tmsdisk_resident_bytes": s.resident_bytes,
                "tmsdisk_pause_message": s.last_message.decode(errors="replace")}

    def after_resume(self):
        s = self.status()
        out = {"tmsdisk_state": s.state, "tmsdisk_resume_message": s.last_message.decode(errors="replace"),
               "tmsdisk_last_pause_ns": s.last_pause_ns, "tmsdisk_last_resume_ns": s.last_resume_ns,
               "tmsdisk_unmanaged_bytes": sum(s.unmanaged_bytes)}
        tmsctl = os.environ.get("TMSCTL")
        if tmsctl:
            try:
                r = subprocess.run([tmsctl, "--json", "status"], capture_output=True, text=True, timeout=30,
                                   env=gpu_helpers.child_env())
                for rank in json.loads(r.stdout):
                    if rank.get("pid") == os.getpid():
                        out["tmsdisk_last_pause"] = rank.get("last_pause")
                        out["tmsdisk_last_resume"] = rank.get("last_resume")
            except Exception as e:  # pylint: disable=broad-except
                log(f"tmsctl status failed: {e!r}")
        return out

    def info(self):
        s = self.status()
        return {"tmsdisk_version": self.lib.tmsdisk_version().decode(), "tmsdisk_enabled": s.enabled,
                "tmsdisk_connected": s.connected, "disk_dir": self.disk_dir,
                "staging_budget_mb": os.environ.get("TMS_DISK_BACKUP_CHUNK_MB", "daemon default"),
                "torch_empty_cache": os.environ.get("TMSDISK_TORCH_EMPTY_CACHE"),
                "host_tier": os.environ.get("TMSDISK_HOST_TIER", "daemon default")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["tms", "tmsdisk"], required=True)
    ap.add_argument("--case", choices=["cache", "random"], required=True)
    ap.add_argument("--gib", type=float, default=16.0, help="GiB of live tensors")
    ap.add_argument("--tensors", type=int, default=16, help="live tensors (each GIB/TENSORS)")
    ap.add_argument("--cache-tensors", type=int, default=5, help="cache case: tensors of the same size freed into the cache")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--disk-dir", default=None, help="where the backup goes (TMS's directory; for tmsdisk, the daemon's root, for the disk counters)")
    ap.add_argument("--drop-caches", choices=["auto", "yes", "no"], default="auto",
                    help="drop the page cache before each timed pause and resume (outside the timing); auto: when root")
    ap.add_argument("--tms-hook", choices=["preload", "torch"], default="preload")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    drop = args.drop_caches == "yes" or (args.drop_caches == "auto" and os.geteuid() == 0)

    tool = Tms(args) if args.mode == "tms" else Tmsdisk(args)
    disk = DiskCounters(args.disk_dir or "/var/tmp")
    tensor_bytes = int(args.gib * (1 << 30)) // args.tensors
    tensor_bytes -= tensor_bytes % (2 << 20)  # whole 2 MiB pages: PyTorch's and the driver's granularity
    n = tensor_bytes // 4
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    t_setup = time.monotonic()
    with tool.region():
        live = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(generator=gen) for _ in range(args.tensors)]
        if args.case == "cache":
            garbage = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(generator=gen)
                       for _ in range(args.cache_tensors)]
            del garbage  # into PyTorch's cache: reserved, used by no tensor; no empty_cache
    if args.case == "random":
        torch.cuda.empty_cache()  # nothing cached: the pause covers the tensors alone
    torch.cuda.synchronize()
    emit({"kind": "setup", "tool": tool.name, "case": args.case, "pid": os.getpid(),
          "live_bytes": tensor_bytes * args.tensors, "tensor_bytes": tensor_bytes, "tensors": args.tensors,
          "cache_tensors": args.cache_tensors if args.case == "cache" else 0, "cycles": args.cycles,
          "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
          "setup_s": round(time.monotonic() - t_setup, 3), "disk_device": disk.where,
          "drop_caches": drop, **tool.info()})

    all_ok = True
    for cycle in range(1, args.cycles + 1):
        with tool.region():
            if args.case == "random":
                for t in live:  # new data in place: every byte changes, nothing is allocated
                    t.uniform_(generator=gen)
            elif cycle > 1:  # a step between pauses: temporaries through the cache, live tensors untouched
                tmp = [torch.empty(n, dtype=torch.float32, device="cuda").uniform_(generator=gen)
                       for _ in range(args.cache_tensors)]
                del tmp
        torch.cuda.synchronize()
        before = digest(live)
        before_edges = edges(live)
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        used_before = gpu_used_mib()
        dropped = drop_caches(drop)

        d0 = disk.read()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        rc_pause = tool.pause()
        t1 = time.monotonic()
        d1 = disk.read()

        paused_info = tool.while_paused()
        used_paused = gpu_used_mib()
        drop_caches(drop)

        d2 = disk.read()
        t2 = time.monotonic()
        rc_resume = tool.resume()
        torch.cuda.synchronize()
        t3 = time.monotonic()
        d3 = disk.read()

        after_info = tool.after_resume()
        after = digest(live)
        after_edges = edges(live)
        same = before == after and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                       for a, b in zip(before_edges, after_edges))
        released = None if used_before is None or used_paused is None else used_before - used_paused
        ok = rc_pause == 0 and rc_resume == 0 and same
        all_ok = all_ok and ok
        m = {"kind": "measurement", "tool": tool.name, "case": args.case, "cycle": cycle,
             "pause_s": round(t1 - t0, 4), "resume_s": round(t3 - t2, 4),
             "rc_pause": rc_pause, "rc_resume": rc_resume, "intact": same, "ok": ok,
             "live_bytes": tensor_bytes * args.tensors, "allocated_bytes": allocated, "reserved_bytes": reserved,
             "gpu_used_mib_before": used_before, "gpu_used_mib_paused": used_paused, "gpu_released_mib": released,
             "disk_written_pause": d1[1] - d0[1], "disk_read_pause": d1[0] - d0[0],
             "disk_written_resume": d3[1] - d2[1], "disk_read_resume": d3[0] - d2[0],
             "page_cache_dropped": dropped, **paused_info, **after_info}
        emit(m)
        log(f"{tool.name} {args.case} cycle {cycle}: pause {m['pause_s']:.2f} s, resume {m['resume_s']:.2f} s, "
            f"{'intact' if same else 'DIFFERENT'}; wrote {m['disk_written_pause'] / 2**30:.2f} GiB, "
            f"read {m['disk_read_resume'] / 2**30:.2f} GiB; released {released} MiB of GPU memory")
    emit({"kind": "done", "tool": tool.name, "case": args.case, "ok": all_ok})
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
