# SPDX-License-Identifier: Apache-2.0
"""How fast host memory is copied into fresh pages on this node, by way of copying (host_copy.h).

A weight sync reads a paused trainer's parameters into new CPU tensors: the cost is the first touch of
each fresh page. This copies 92 pieces shaped like a 4 GiB model's parameters out of a populated memfd
mapping (as the host tier's memory is) into new torch.empty() tensors, each way twice: torch's own
parallel copy_, and libc memcpy on 1, 8 and 16 threads, with and without MADV_POPULATE_WRITE of the
destination first. One JSON line per case: seconds, GB/s, and whether the bytes arrived.
    python3 bench/host_copy_probe.py          (PROBE_SCALE=16 divides every piece, for a small machine)
"""
import ctypes
import json
import mmap
import os
import threading
import time

import torch

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.memcpy.restype = ctypes.c_void_p
libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23
PAGE = 4096

scale = int(os.environ.get("PROBE_SCALE", "1"))
pieces = [max(PAGE, p // scale) for p in [262144000] * 2 + [33554432] * 60 + [90177536] * 20 + [8192] * 10]
total = sum(pieces)
fd = os.memfd_create("probe-tier")
os.ftruncate(fd, total)
mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
src = torch.frombuffer(mapping, dtype=torch.uint8)
src.fill_(7)  # populated, as the tier's pages are
base = src.data_ptr()
print(json.dumps({"pieces": len(pieces), "bytes": total, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}),
      flush=True)


def populate(addr, n):
    lo, hi = (addr + PAGE - 1) & ~(PAGE - 1), (addr + n) & ~(PAGE - 1)
    if hi > lo:
        libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE)


def threaded(dst, at, n, threads, pop):
    if threads <= 1 or n < (8 << 20):
        if pop:
            populate(dst, n)
        libc.memcpy(dst, at, n)
        return
    piece = (n + threads - 1) // threads

    def work(i):
        lo, hi = i * piece, min(n, (i + 1) * piece)
        if lo < hi:
            if pop:
                populate(dst + lo, hi - lo)
            libc.memcpy(dst + lo, at + lo, hi - lo)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def run(name, copy):
    outs, offset = [], 0
    t0 = time.monotonic()
    for p in pieces:
        d = torch.empty(p, dtype=torch.uint8)
        copy(d, offset, p)
        outs.append(d)
        offset += p
    seconds = time.monotonic() - t0
    ok = all(bool(o[:16].eq(7).all()) and bool(o[-16:].eq(7).all()) for o in outs)
    print(json.dumps({"case": name, "s": round(seconds, 4), "gb_s": round(total / seconds / 1e9, 2), "ok": ok}),
          flush=True)


for _ in range(2):
    run("torch copy_", lambda d, off, p: d.copy_(src[off:off + p]))
    for threads in (1, 8, 16):
        for pop in (False, True):
            run("memcpy threads=%d populate=%s" % (threads, pop),
                lambda d, off, p, t=threads, q=pop: threaded(d.data_ptr(), base + off, p, t, q))
