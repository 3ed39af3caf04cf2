# SPDX-License-Identifier: Apache-2.0
"""A program for test_read_paused.py: /usr/bin/python3 paused_app.py SCENARIO, under libtmsdisk.so on
simcuda (the test starts it). It allocates device memory through the driver (cudadriver.py), pauses
it with tmsdisk.pause(), and reads it back with tmsdisk.read_paused() while it stays paused. It prints
"OK SCENARIO" last, or fails with a traceback. EXPECT_TIER says where the test's daemon puts the data
chunks: "none" (no host tier: all on disk), "all" (a tier that holds them), "part" (the first two).
"""

import ctypes
import errno
import os
import sys

import torch

import tmsdisk
from cudadriver import Driver

MiB = 1 << 20
CHUNK = 4 * MiB  # the test's daemon runs with --chunk-mb 4
SIZE = 5 * CHUNK + 3 * 4096  # five data chunks (the last one short) and a zero one


def say(line):
    print(line, flush=True)


def expect(line):
    got = sys.stdin.readline().strip()
    assert got == line, "expected %r from the test, got %r" % (line, got)


class Device:
    """A range of device memory as read_paused() takes a tensor: address, bytes, dtype, shape."""

    def __init__(self, ptr, nbytes, dtype=torch.uint8):
        self.ptr, self.dtype = ptr, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.shape = torch.Size([nbytes // self.itemsize])

    def is_contiguous(self):
        return True

    def numel(self):
        return self.shape[0]

    def element_size(self):
        return self.itemsize

    def data_ptr(self):
        return self.ptr


def view_of(ptr, nbytes):
    """tmsdisk_paused_view's answer: (rc, address)."""
    view = ctypes.c_void_p()
    rc = tmsdisk._function("paused_app", "tmsdisk_paused_view")(ptr, nbytes, ctypes.byref(view))
    return rc, view.value


def expect_error(err, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except tmsdisk.Error as e:
        assert e.errno == err, "expected %s, got %s" % (errno.errorcode[err], e)
        return
    raise AssertionError("expected %s" % errno.errorcode[err])


def allocate(drv):
    """SIZE bytes of device memory holding random bytes, its second chunk all zero; (address, bytes)."""
    ptr = drv.alloc(SIZE)
    data = bytearray(os.urandom(SIZE))
    data[CHUNK : 2 * CHUNK] = bytes(CHUNK)
    drv.write(ptr, bytes(data))
    return ptr, bytes(data)


def check_reads(ptr, data):
    whole = tmsdisk.read_paused(Device(ptr, SIZE))
    assert whole is not None and whole.numpy().tobytes() == data, "the whole allocation read back"
    # Ranges that start or end inside a chunk (read through a buffer of its own), across the zero chunk,
    # within one chunk, and the short last chunk.
    for start, length in ((1000, 3 * CHUNK), (CHUNK - 4096, 8192), (2 * CHUNK + 12, CHUNK), (SIZE - 5000, 5000),
                          (3 * CHUNK, CHUNK)):
        got = tmsdisk.read_paused(Device(ptr + start, length))
        assert got.numpy().tobytes() == data[start : start + length], "bytes [%d, %d)" % (start, start + length)
    floats = tmsdisk.read_paused(Device(ptr, 4 * CHUNK, torch.float32))
    assert floats.dtype == torch.float32 and tuple(floats.shape) == (CHUNK,), (floats.dtype, floats.shape)
    assert floats.numpy().tobytes() == data[: 4 * CHUNK], "as float32"


def check_views(ptr, data, tier):
    first, at = view_of(ptr + 100, CHUNK - 100)
    zero, _ = view_of(ptr + CHUNK, 4096)
    last, _ = view_of(ptr + 4 * CHUNK, 4096)
    assert zero == -errno.ENODATA, "a zero chunk lies in no memory: %d" % zero
    if tier == "none":
        assert first == -errno.ENODATA and last == -errno.ENODATA, (first, last)
    else:
        assert first == 0 and ctypes.string_at(at, CHUNK - 100) == data[100:CHUNK], "the view of chunk 0"
        assert last == (0 if tier == "all" else -errno.ENODATA), "chunk 4: %d with tier %s" % (last, tier)
    # zero_copy gives the bytes either way: the memory itself where it can, else a copy.
    for start, length in ((0, CHUNK), (0, 3 * CHUNK)):
        got = tmsdisk.read_paused(Device(ptr + start, length), zero_copy=True)
        assert got.numpy().tobytes() == data[start : start + length], "zero_copy [%d, %d)" % (start, start + length)


def scenario_read():
    tier = os.environ["EXPECT_TIER"]
    drv = Driver()
    ptr, data = allocate(drv)
    assert tmsdisk.read_paused(Device(ptr, SIZE)) is None, "resident memory: the device holds it"
    tmsdisk.pause()
    check_reads(ptr, data)
    check_views(ptr, data, tier)
    host = ctypes.create_string_buffer(8192)
    expect_error(errno.EINVAL, tmsdisk.read_paused, Device(ctypes.addressof(host), 4096))
    expect_error(errno.EINVAL, tmsdisk.read_paused, Device(ptr + SIZE - 4096, 8192))
    tmsdisk.resume()
    assert tmsdisk.read_paused(Device(ptr, SIZE)) is None, "resumed: resident again"
    assert drv.read(ptr, SIZE) == data, "the reads changed nothing of what the resume brings back"
    # Paused without a backup: nothing to read.
    with tmsdisk.region("scratch", tmsdisk.DISCARD):
        scratch = drv.alloc(2 * CHUNK)
    drv.write(scratch, bytes([7]) * (2 * CHUNK))
    tmsdisk.pause("scratch")
    assert tmsdisk.read_paused(Device(scratch, 2 * CHUNK)) is None, "a discarded range has no bytes"
    tmsdisk.resume("scratch")
    say("OK read")


def scenario_restart():
    """Paused, then the test kills and restarts the daemon: the reads go on from what the new daemon
    adopted (the rank's manifest, its host-tier memory handed back)."""
    tier = os.environ["EXPECT_TIER"]
    drv = Driver()
    ptr, data = allocate(drv)
    tmsdisk.pause()
    say("PAUSED")
    expect("restarted")
    check_reads(ptr, data)
    check_views(ptr, data, tier)
    tmsdisk.resume()
    assert drv.read(ptr, SIZE) == data, "resumed through the new daemon"
    say("OK restart")


def scenario_tms_get_cpu_backup():
    """torch_memory_saver's get_cpu_backup (the compatibility module on PYTHONPATH): the paused bytes of
    a tensor-like range, None while it is resident, as TMS answers."""
    from torch_memory_saver import torch_memory_saver

    drv = Driver()
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        ptr, data = allocate(drv)
    assert torch_memory_saver.get_cpu_backup(Device(ptr, SIZE)) is None, "resident"
    torch_memory_saver.pause("weights")
    for zero_copy in (False, True):
        got = torch_memory_saver.get_cpu_backup(Device(ptr + 4096, 2 * CHUNK), zero_copy=zero_copy)
        assert got.numpy().tobytes() == data[4096 : 4096 + 2 * CHUNK], "zero_copy=%s" % zero_copy
    try:
        torch_memory_saver.get_cpu_backup(Device(ptr + SIZE - 4096, 8192))
    except OSError as e:
        assert e.errno == errno.EINVAL and "get_cpu_backup" in str(e), e
    else:
        raise AssertionError("a range past the allocation's end was read")
    torch_memory_saver.resume("weights")
    assert torch_memory_saver.get_cpu_backup(Device(ptr, SIZE)) is None, "resumed"
    say("OK tms-get-cpu-backup")


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1].replace("-", "_")]()
