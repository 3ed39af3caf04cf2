# SPDX-License-Identifier: Apache-2.0
"""Residency of tmsdisk.optim's buckets: at most `depth` of them in memory at once, read ahead of the
one being worked on and written behind it through the store (tmsdisk.store's API); none before a
pause of the process, and every write-back done at exit (the live optimizers' hooks)."""

import atexit
import os
import sys
import threading
import weakref
from collections import OrderedDict

import torch

from . import Error, _log, loaded, on_pause


class _Slot:
    """A bucket in memory: its buffer, its outstanding read and write, and whether the running pass
    still needs it (pinned: not to be evicted)."""

    __slots__ = ("bucket", "buffer", "read", "write", "pinned")

    def __init__(self, bucket, buffer):
        self.bucket, self.buffer = bucket, buffer
        self.read = self.write = None
        self.pinned = False


_BUCKET_STREAMS = {}


def _bucket_stream(device):
    """The stream whose allocator pool the buckets of `device` are taken from (never run on)."""
    stream = _BUCKET_STREAMS.get(device)
    if stream is None:
        stream = _BUCKET_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


class _Pipeline:
    """At most `depth` buckets in memory, read ahead of the one being worked on, written behind it.

    The only owner of buffers and tickets. A bucket stays in memory after its write-back until its slot
    is needed (its write is waited for then), so a step that finds it still there reads nothing.
    """

    def __init__(self, store, depth: int, open_bucket):
        self.store = store
        self.depth = depth
        # With depth d, buckets k-1 (writing back) and k (updating) leave d-2 for reads ahead; depth 2
        # still reads one ahead, by waiting for the write of k-1 first.
        self.lookahead = 0 if depth == 1 else max(1, depth - 2)
        self._open = open_bucket
        self.resident = OrderedDict()  # bucket -> _Slot, oldest first
        self.deferred = None  # an error release() met, raised by the next run() or drain()

    def new_buffer(self, bucket):
        if bucket.device.type != "cuda":
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=bucket.device)
        # Buckets come from segments of their own: PyTorch's caching allocator keeps a pool per stream,
        # so a gradient never lands in a segment a bucket was cut from (which the freed bucket would
        # then keep alive), and a pause, which moves whole segments, moves none of a dropped bucket.
        # Every use of the buffer is on the caller's stream or ordered after it by the store, so the
        # side stream only chooses the pool.
        with torch.cuda.stream(_bucket_stream(bucket.device)):
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=bucket.device)

    @staticmethod
    def _settle(slot) -> None:
        """Waits for the slot's read and write, if any: after it the buffer is free to change."""
        if slot.read is not None:
            ticket, slot.read = slot.read, None
            ticket.wait()
        if slot.write is not None:
            ticket, slot.write = slot.write, None
            ticket.wait()
            slot.bucket.written = True

    def _evict_one(self) -> None:
        victim = next((b for b, slot in self.resident.items() if not slot.pinned), None)
        if victim is None:
            raise RuntimeError("tmsdisk.optim: every bucket in memory is in use (depth %d)" % self.depth)
        self._settle(self.resident.pop(victim))

    def fetch(self, bucket, read: bool, pin: bool = True) -> None:
        """Starts bringing `bucket` into memory: a read of its bytes when `read` and the store has them,
        zeros otherwise."""
        slot = self.resident.get(bucket)
        if slot is None:
            while len(self.resident) >= self.depth:
                self._evict_one()
            slot = _Slot(bucket, self.new_buffer(bucket))
            if read and bucket.written:
                slot.read = self.store.read(self._open(bucket), 0, slot.buffer)
            else:
                slot.buffer.zero_()
            self.resident[bucket] = slot
        slot.pinned = slot.pinned or pin

    def hint(self, bucket) -> None:
        if bucket.written and bucket not in self.resident:
            self.store.prefetch(self._open(bucket), 0, bucket.nbytes)

    def ready(self, bucket):
        """The bucket's buffer, once its read (or the write of its last pass) is done."""
        slot = self.resident[bucket]
        self._settle(slot)
        return slot.buffer

    def done(self, bucket, write: bool) -> None:
        slot = self.resident.pop(bucket)
        self.resident[bucket] = slot  # the newest now: evicted last
        slot.pinned = False
        if write:
            slot.write = self.store.write(self._open(bucket), 0, slot.buffer)

    def _raise_deferred(self) -> None:
        if self.deferred is not None:
            error, self.deferred = self.deferred, None
            raise error

    def run(self, buckets, action, read: bool, write: bool) -> None:
        """action(bucket, buffer) on each bucket in turn, reading ahead and writing behind. With `write`,
        every bucket's object is opened before the first action."""
        self._raise_deferred()
        if write:
            for bucket in buckets:
                self._open(bucket)
        try:
            hinted = set()
            for k, bucket in enumerate(buckets):
                ahead = buckets[k : k + self.lookahead + 1]
                for other in ahead:
                    self.fetch(other, read)
                nxt = k + len(ahead)
                if read and nxt < len(buckets) and nxt not in hinted:
                    hinted.add(nxt)
                    self.hint(buckets[nxt])
                action(bucket, self.ready(bucket))
                self.done(bucket, write)
        except BaseException:
            self.abandon()
            raise

    def drain(self) -> None:
        """Waits for every read and write and lets go of every buffer; raises the first error (or the
        one release() kept)."""
        first, self.deferred = self.deferred, None
        while self.resident:
            _, slot = self.resident.popitem(last=False)
            try:
                self._settle(slot)
            except Exception as e:  # pylint: disable=broad-except
                first = first or e
        if first is not None:
            raise first

    def release(self) -> bool:
        """drain() before a pause, on the shim's thread: an error is kept for the caller's next run() or
        drain() instead of raised here, where nobody would see it. Whether any buffer was let go."""
        had = bool(self.resident)
        try:
            self.drain()
        except Exception as e:  # pylint: disable=broad-except
            self.deferred = e
        return had

    def abandon(self) -> None:
        """After a failure: waits for what is in flight (the store still uses those buffers), keeping
        quiet about its errors, which the failure being raised outranks."""
        try:
            self.drain()
        except Exception:  # pylint: disable=broad-except
            pass


# --- the live optimizers: before a pause, at exit -------------------------------------------------

_live = weakref.WeakSet()  # optimizers whose write-backs atexit waits for, whose buckets a pause drops


_pause_lock = threading.Lock()
_pause_registered = False


def _release_for_pause() -> None:
    """Before a pause (tmsdisk.on_pause, on the shim's thread): every live optimizer lets go of its bucket
    buffers once their reads and writes are done, and PyTorch's cache hands their memory back.

    Waiting here is safe: the shim runs the store's operations in the order queued, and a pause after
    them, so those queued before the pause are done by now. A step running on another thread holds its
    optimizer's lock and is not waited for (the pause must not wait on a thread it may hold): that
    optimizer keeps its buckets.
    """
    released = False
    for opt in list(_live):
        if not opt._lock.acquire(blocking=False):
            _log("debug", "before pause: %s is in a step on another thread; its buckets are paused with it" % opt._name)
            continue
        try:
            released = opt._pipeline.release() or released
        finally:
            opt._lock.release()
    # The start-up module's callback, which empties the cache too, may have run before this one.
    if released and os.environ.get("TMSDISK_TORCH_EMPTY_CACHE", "1") != "0" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _drop_buckets_before_pauses() -> None:
    """Registers _release_for_pause once, where libtmsdisk.so is loaded (without it nothing pauses)."""
    global _pause_registered
    with _pause_lock:
        if _pause_registered or not loaded():
            return
        try:
            on_pause(_release_for_pause)
        except Error as e:
            _log("warn", "tmsdisk.optim: a pause will move the optimizers' buckets in memory too: %s" % e)
        _pause_registered = True


@atexit.register
def _flush_live() -> None:
    for opt in list(_live):
        try:
            opt.flush()
        except Exception as e:  # pylint: disable=broad-except
            print("tmsdisk.optim: at exit, the last write-backs of %s failed: %s" % (opt._name, e), file=sys.stderr)
