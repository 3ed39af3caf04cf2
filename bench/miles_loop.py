# SPDX-License-Identifier: Apache-2.0
"""miles' `--stream-optimizer-state-to-disk` loop, re-implemented from its description, to measure
tmsdisk.optim.StreamedAdamW against (bench/streamed_optim_bench.py).

The state of each bucket (at most 200 M elements: an fp32 master of each parameter, exp_avg and
exp_avg_sq) is one file, [masters][exp_avgs][exp_avg_sqs], in a directory. A step takes the buckets
one after another, with no overlap:

1. the bucket's file is read with synchronous buffered os.preadv (page cache on, no O_DIRECT) through
   ONE pinned host buffer of 256 MiB, piece by piece, each piece copied host -> device;
2. Adam runs on the device: the functional kernel torch.optim.AdamW itself calls in this torch, with
   its default foreach choice, exactly as tmsdisk.optim does (so that both are bit-identical to
   torch.optim.AdamW, and the comparison is one of I/O, not of kernels); the updated master is
   copied into the (bf16) parameter;
3. the same pieces go back device -> pinned buffer -> buffered os.pwritev into the file.

    loop = MilesLoop(buckets_of(params), directory)   # params with .grad set before each step()
    loop.initialize()                                 # master = param.float(), moments 0
    loop.step()

Self-test, on CPU tensors (any torch from 1.13), tiny buckets in a temporary directory, bit-identity
with torch.optim.AdamW over a few steps:

    python3 bench/miles_loop.py --self-test [--device cuda]
"""

import argparse
import hashlib
import inspect
import os
import sys
import tempfile
import time

import torch

PIECE_BYTES = 256 << 20  # the one pinned host buffer
BUCKET_ELEMENTS = 200_000_000

# --- the kernel: the one torch.optim.AdamW calls, found as tmsdisk/optim.py finds it ----------------
_ADAM = sys.modules[torch.optim.Adam.__module__].adam
ADAMW_KERNEL = (_ADAM if "decoupled_weight_decay" in inspect.signature(_ADAM).parameters
                else sys.modules[torch.optim.AdamW.__module__].adamw)


def kernel_options(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """The keyword arguments torch.optim.AdamW's step() passes its kernel, from the defaults of a probe
    of torch's own class (so foreach, maximize, decoupled_weight_decay... are this torch's)."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay)
    group = dict(probe.defaults)
    accepted = inspect.signature(ADAMW_KERNEL).parameters
    options = {k: group[k] for k in accepted if k in group and k != "params"}
    options["beta1"], options["beta2"] = group["betas"]
    for absent in ("grad_scale", "found_inf"):
        if absent in accepted:
            options[absent] = None
    if "has_complex" in accepted:
        options["has_complex"] = False
    return options


def new_step():
    """A step count as torch's class starts it (on the host)."""
    scalar_dtype = getattr(sys.modules[torch.optim.Optimizer.__module__], "_get_scalar_dtype", None)
    return torch.tensor(0.0, dtype=scalar_dtype()) if scalar_dtype else torch.tensor(0.0)


def buckets_of(params, max_elements=BUCKET_ELEMENTS):
    """Whole parameters, in order, grouped into buckets of at most max_elements (a larger parameter is
    a bucket of its own)."""
    buckets, current, n = [], [], 0
    for p in params:
        if current and n + p.numel() > max_elements:
            buckets.append(current)
            current, n = [], 0
        current.append(p)
        n += p.numel()
    if current:
        buckets.append(current)
    return buckets


class MilesLoop:
    """The loop. `buckets`: lists of parameters (any float dtype; their .grad of the same dtype); the
    state files are `directory/<prefix>.<k>.bin`."""

    def __init__(self, buckets, directory, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 piece_bytes=PIECE_BYTES, prefix="miles"):
        self.buckets = [list(b) for b in buckets]
        self.device = self.buckets[0][0].device
        self.options = kernel_options(lr, betas, eps, weight_decay)
        self.numels = [sum(p.numel() for p in b) for b in self.buckets]
        self.paths = [os.path.join(directory, "%s.%d.bin" % (prefix, k)) for k in range(len(self.buckets))]
        self.steps = [[new_step() for _ in b] for b in self.buckets]
        largest = max(self.numels)
        self.piece_bytes = min(piece_bytes, 12 * largest)
        pin = self.device.type == "cuda"
        self.host = torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=pin)
        self.host_view = memoryview(self.host.numpy())
        # One device buffer, the size of the largest bucket, reused by every bucket.
        self.device_buffer = torch.empty(3 * largest, dtype=torch.float32, device=self.device)
        self.fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.paths]
        self.last = {}  # seconds per phase of the last step

    # -- one bucket's bytes through the pinned buffer ------------------------------------------------

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _read(self, fd, dst, times):
        """dst (uint8 on the device) <- the file, piece by piece."""
        total = dst.numel()
        offset = 0
        while offset < total:
            n = min(self.piece_bytes, total - offset)
            t0 = time.perf_counter()
            got = 0
            while got < n:
                k = os.preadv(fd, [self.host_view[got:n]], offset + got)
                if k <= 0:
                    raise OSError("short read of a state file at byte %d" % (offset + got))
                got += k
            t1 = time.perf_counter()
            dst[offset : offset + n].copy_(self.host[:n])  # blocking: the buffer is reused next
            self._sync()
            t2 = time.perf_counter()
            times["read"] += t1 - t0
            times["h2d"] += t2 - t1
            offset += n

    def _write(self, fd, src, times):
        """The file <- src (uint8 on the device), piece by piece."""
        total = src.numel()
        offset = 0
        while offset < total:
            n = min(self.piece_bytes, total - offset)
            t0 = time.perf_counter()
            self.host[:n].copy_(src[offset : offset + n])
            self._sync()
            t1 = time.perf_counter()
            put = 0
            while put < n:
                k = os.pwritev(fd, [self.host_view[put:n]], offset + put)
                if k <= 0:
                    raise OSError("short write of a state file at byte %d" % (offset + put))
                put += k
            t2 = time.perf_counter()
            times["d2h"] += t1 - t0
            times["write"] += t2 - t1
            offset += n

    def _views(self, k):
        n = self.numels[k]
        buf = self.device_buffer[: 3 * n]
        return buf, buf[:n], buf[n : 2 * n], buf[2 * n :]

    @staticmethod
    def _slices(flat, params):
        out, at = [], 0
        for p in params:
            out.append(flat[at : at + p.numel()])
            at += p.numel()
        return out

    # -- the loop ------------------------------------------------------------------------------------

    @torch.no_grad()
    def initialize(self):
        """Each file <- master = parameter as fp32, moments zero (written as a step writes)."""
        times = dict.fromkeys(("read", "h2d", "adam", "d2h", "write"), 0.0)
        for k, params in enumerate(self.buckets):
            buf, master, exp_avg, exp_avg_sq = self._views(k)
            for m, p in zip(self._slices(master, params), params):
                m.copy_(p.detach().reshape(-1))
            exp_avg.zero_()
            exp_avg_sq.zero_()
            os.ftruncate(self.fds[k], 12 * self.numels[k])
            self._write(self.fds[k], buf.view(torch.uint8), times)
        self._sync()

    @torch.no_grad()
    def step(self):
        """One Adam step of every bucket, in order: read, update, write; returns the seconds per phase."""
        times = dict.fromkeys(("read", "h2d", "adam", "d2h", "write"), 0.0)
        for k, params in enumerate(self.buckets):
            buf, master, exp_avg, exp_avg_sq = self._views(k)
            raw = buf.view(torch.uint8)
            self._read(self.fds[k], raw, times)
            t0 = time.perf_counter()
            masters = self._slices(master, params)
            grads = [p.grad.detach().reshape(-1).float() for p in params]
            ADAMW_KERNEL(masters, grads, self._slices(exp_avg, params), self._slices(exp_avg_sq, params), [],
                         self.steps[k], **self.options)
            for p, m in zip(params, masters):
                p.detach().view(-1).copy_(m)
            del grads
            self._sync()
            times["adam"] += time.perf_counter() - t0
            self._write(self.fds[k], raw, times)
        self.last = times
        return times

    # -- around the loop -----------------------------------------------------------------------------

    def drop_cache(self):
        """fsync each file and drop its pages from the page cache (POSIX_FADV_DONTNEED): the effect of
        `echo 1 > /proc/sys/vm/drop_caches` on these files, without root."""
        for fd in self.fds:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def masters_sha256(self):
        """SHA-256 of the masters in parameter order (fp32, little-endian), read from the files."""
        h = hashlib.sha256()
        for fd, n in zip(self.fds, self.numels):
            nbytes, offset = 4 * n, 0
            while offset < nbytes:
                chunk = os.pread(fd, min(64 << 20, nbytes - offset), offset)
                if not chunk:
                    raise OSError("short read of a state file")
                h.update(chunk)
                offset += len(chunk)
        return h.hexdigest()

    def close(self, remove=False):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if remove:
            for path in self.paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def tensors_sha256(tensors):
    """SHA-256 of fp32 tensors' bytes, in order, through host memory in pieces."""
    h = hashlib.sha256()
    for t in tensors:
        flat = t.detach().reshape(-1)
        for at in range(0, flat.numel(), 16 << 20):
            h.update(flat[at : at + (16 << 20)].float().cpu().contiguous().numpy())
    return h.hexdigest()


# --- self-test ---------------------------------------------------------------------------------------


def self_test(device, steps=4):
    """Tiny buckets (odd sizes, pieces smaller than a bucket and not dividing it) against
    torch.optim.AdamW on fp32 masters with the same gradients; bf16 and fp32 parameters."""
    dev = torch.device(device)
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        shapes = [(37, 11), (1000,), (3, 5, 7), (513,), (2049,)]
        params = [(torch.randn(*s, device=dev) * 0.1).to(dtype) for s in shapes]
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
        with tempfile.TemporaryDirectory() as directory:
            loop = MilesLoop(buckets_of(params, max_elements=1500), directory, lr=1e-2, weight_decay=0.1,
                             piece_bytes=4096 + 12)
            assert len(loop.buckets) > 2 and loop.piece_bytes < 12 * max(loop.numels), "the test must cut pieces"
            loop.initialize()
            for step in range(steps):
                g = torch.Generator(device=dev)
                g.manual_seed(100 + step)
                for p, m in zip(params, masters):
                    grad = (torch.randn(p.shape, generator=g, device=dev) * 1e-2).to(dtype)
                    p.grad = grad
                    m.grad = grad.float()
                loop.step()
                reference.step()
                if step == 1:
                    loop.drop_cache()  # reads come back from the disk (or what the kernel kept) the same
            mine = loop.masters_sha256()
            theirs = tensors_sha256(masters)
            same_params = all(torch.equal(p, m.detach().to(dtype)) for p, m in zip(params, masters))
            # The moments too, from the files.
            moments_same = True
            for k, bucket in enumerate(loop.buckets):
                raw = loop.device_buffer[: 3 * loop.numels[k]]
                loop._read(loop.fds[k], raw.view(torch.uint8), dict.fromkeys(("read", "h2d"), 0.0))
                n = loop.numels[k]
                at = 0
                for p in bucket:
                    st = reference.state[_find(masters, params, p)]
                    moments_same &= torch.equal(raw[n + at : n + at + p.numel()], st["exp_avg"].reshape(-1))
                    moments_same &= torch.equal(raw[2 * n + at : 2 * n + at + p.numel()],
                                                st["exp_avg_sq"].reshape(-1))
                    at += p.numel()
            loop.close()
        good = mine == theirs and same_params and moments_same
        ok &= good
        print("%s: %d %s parameters, %d buckets, %d steps: masters %s (%s), parameters %s, moments %s" % (
            "PASS" if good else "FAIL", len(params), str(dtype).replace("torch.", ""), len(loop.buckets), steps,
            "bit-identical" if mine == theirs else "DIFFER", mine[:16], "equal" if same_params else "DIFFER",
            "equal" if moments_same else "DIFFER"))
    print("kernel: %s.%s, options %s" % (ADAMW_KERNEL.__module__, ADAMW_KERNEL.__name__, kernel_options(1e-2, weight_decay=0.1)))
    return ok


def _find(masters, params, p):
    for m, q in zip(masters, params):
        if q is p:
            return m
    raise KeyError("parameter not found")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="tiny buckets against torch.optim.AdamW")
    parser.add_argument("--device", default="cpu", help="where the 'device' tensors live in the self-test")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not args.self_test:
        parser.error("nothing to do: the loop is a module (bench/streamed_optim_bench.py runs it); try --self-test")
    sys.exit(0 if self_test(args.device, args.steps) else 1)
