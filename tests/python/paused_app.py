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
        return e
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
    zero, zero_at = view_of(ptr + CHUNK, 4096)
    last, _ = view_of(ptr + 4 * CHUNK, 4096)
    assert zero == 0 and ctypes.string_at(zero_at, 4096) == bytes(4096), "a zero chunk shows zero pages: %d" % zero
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
    torch_memory_saver.preload("weights")  # read ahead into the tier where there is one; the resume uses it
    torch_memory_saver.resume("weights")
    assert drv.read(ptr, SIZE) == data, "resumed after a preload"
    assert torch_memory_saver.get_cpu_backup(Device(ptr, SIZE)) is None, "resumed"
    say("OK tms-get-cpu-backup")


def scenario_tms_backup_dir():
    """torch_memory_saver's set_disk_backup_dir as TMS's disk_backup example uses it: a directory made
    for the purpose, where the paused tag's files are listed (data, owner, manifest...) while paused;
    moving elsewhere refused while paused and done once resumed; a directory others may write refused,
    and one in memory (tmpfs) too. BACKUP_PARENT: a directory on a disk for it to make them in."""
    import tempfile

    from torch_memory_saver import torch_memory_saver

    parent = os.environ["BACKUP_PARENT"]
    first = tempfile.mkdtemp(prefix="tms_disk_backup_", dir=parent)
    torch_memory_saver.set_disk_backup_dir(first)
    drv = Driver()
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        ptr, data = allocate(drv)
    torch_memory_saver.pause("weights")
    names = sorted(os.listdir(first))
    total = sum(os.path.getsize(os.path.join(first, n)) for n in names)
    assert len(names) >= 2 and all(n.startswith("tmsdisk-optim-tms-backup-dir-") for n in names), names
    assert total >= 4 * CHUNK, "the paused tag's bytes are in %s: %d bytes in %s" % (first, total, names)
    second = os.path.join(parent, "second")  # made by the call, 0700
    e = expect_error(errno.EBUSY, torch_memory_saver.set_disk_backup_dir, second)  # paused: not moved
    assert "set_disk_backup_dir" in str(e), e
    assert sorted(os.listdir(first)) == names, "refused: the files stay"
    torch_memory_saver.resume("weights")
    assert drv.read(ptr, SIZE) == data, "resumed from the directory of its choosing"

    torch_memory_saver.set_disk_backup_dir(second)
    assert os.listdir(first) == [], os.listdir(first)
    assert os.stat(second).st_mode & 0o777 == 0o700
    torch_memory_saver.pause("weights")
    assert any(n.endswith(".data") for n in os.listdir(second)), os.listdir(second)
    torch_memory_saver.resume("weights")
    assert drv.read(ptr, SIZE) == data, "resumed from the second directory"

    shared = tempfile.mkdtemp(dir=parent)
    os.chmod(shared, 0o775)
    expect_error(errno.EACCES, torch_memory_saver.set_disk_backup_dir, shared)  # its group may write it
    if os.path.isdir("/dev/shm") and _on_tmpfs("/dev/shm"):
        ram = tempfile.mkdtemp(dir="/dev/shm")
        try:
            expect_error(errno.EINVAL, torch_memory_saver.set_disk_backup_dir, ram)  # in memory
        finally:
            os.rmdir(ram)
    assert sorted(os.listdir(second)) and all(n.startswith("tmsdisk-") for n in os.listdir(second))
    say("OK tms-backup-dir")


def _on_tmpfs(path):
    with open("/proc/self/mounts") as mounts:
        best, kind = "", ""
        for line in mounts:
            fields = line.split()
            where = fields[1]
            if (path == where or path.startswith(where.rstrip("/") + "/")) and len(where) >= len(best):
                best, kind = where, fields[2]
    return kind in ("tmpfs", "ramfs")


def scenario_prefetch_command():
    """A tag paused to disk, prefetched by `tmsctl prefetch` (the test runs it between READY and
    "prefetched"), then resumed intact."""
    drv = Driver()
    with tmsdisk.region("first"):
        first = drv.alloc(2 * CHUNK)
    drv.write(first, bytes([3]) * (2 * CHUNK))  # data, not zero chunks: the first pause takes the tier
    with tmsdisk.region("second"):
        second, data = allocate(drv)
    tmsdisk.pause("first")
    tmsdisk.pause("second")  # to disk: the tier memory holds the first tag's chunks
    tmsdisk.resume("first")
    say("READY")
    expect("prefetched")
    # The command's reads run in the shim's turns after its answer: the first chunk lands in the tier
    # (its memory kept in use meanwhile, even where the daemon gives memory back at each resume).
    import time

    deadline = time.monotonic() + 30
    while view_of(second + 100, 4096)[0] != 0:
        assert time.monotonic() < deadline, "the first chunk never reached the tier after tmsctl prefetch"
        time.sleep(0.01)
    # The command's reads ran in the shim's turn after its answer. A tier that held it all: nothing is
    # left on disk (True, nothing to do); a full one of four chunks: no room for the fifth (False).
    assert tmsdisk.prefetch("second", wait=True) is (os.environ["EXPECT_TIER"] == "all")
    rc, at = view_of(second + 100, CHUNK - 100)
    assert rc == 0 and ctypes.string_at(at, CHUNK - 100) == data[100:CHUNK], "the first chunk in the tier"
    tmsdisk.resume("second")
    assert drv.read(second, SIZE) == data, "resumed after tmsctl prefetch"
    say("OK prefetch-command")


def host_registered(address):
    """Whether CUDA knows `address` as pinned host memory (what TMS's test asks cudaHostGetFlags)."""
    flags = ctypes.c_uint()
    return Driver().cuda.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address)) == 0


def scenario_retain():
    """tmsdisk.retain_host_copy(True): a resume leaves the host copy readable, as it was when paused; a
    view of it (TMS's get_cpu_backup(zero_copy=True)) stays at one address, pinned, while paused, after
    a retaining resume and across the next pauses, its bytes kept when the host-tier memory under it is
    used again; it goes when the memory is resumed without retaining or freed. Run with a tier that
    holds all of it."""
    drv = Driver()
    with tmsdisk.region("weights"):
        ptr, data = allocate(drv)
    assert tmsdisk.retain_host_copy(True) is False, "off by default"
    tmsdisk.pause("weights")
    rc, view = view_of(ptr + 100, CHUNK - 100)
    assert rc == 0 and ctypes.string_at(view, CHUNK - 100) == data[100:CHUNK], "the view while paused"
    assert host_registered(view), "pinned, as TMS's backup is"
    zero_rc, zero_at = view_of(ptr + CHUNK, 4096)
    assert zero_rc == 0 and zero_at == view - 100 + CHUNK and ctypes.string_at(zero_at, 4096) == bytes(4096), \
        "a zero chunk shows zero pages, in its place in the view"
    tmsdisk.resume("weights")
    got = tmsdisk.read_paused(Device(ptr, SIZE))
    assert got is not None and got.numpy().tobytes() == data, "the retained copy of resumed memory"
    assert view_of(ptr + 100, CHUNK - 100) == (0, view), "the same view after a retaining resume"
    # The device changes; the copy stays what it was when paused (as TMS's retained backup).
    drv.write(ptr, bytes([1]) * 4096)
    assert tmsdisk.read_paused(Device(ptr, 4096)).numpy().tobytes() == data[:4096], "the copy as paused"
    # The next pause puts the new bytes in the host tier: the view shows them, at the same address.
    newer = bytes([1]) * 4096 + data[4096:]
    tmsdisk.pause("weights")
    assert view_of(ptr, CHUNK) == (0, view - 100), "the same view in the next pause"
    assert ctypes.string_at(view - 100, CHUNK) == newer[:CHUNK] and host_registered(view)
    tmsdisk.resume("weights")
    assert tmsdisk.read_paused(Device(ptr, SIZE)).numpy().tobytes() == newer, "retained from the second pause"
    assert drv.read(ptr, SIZE) == newer
    # Another tag's pause takes the host-tier memory the retained copy lay in: the view keeps its bytes.
    with tmsdisk.region("other"):
        other, other_data = allocate(drv)
    tmsdisk.pause("other")
    rc, other_view = view_of(other, CHUNK)
    assert rc == 0 and ctypes.string_at(other_view, CHUNK) == other_data[:CHUNK], "the other tag's view"
    assert ctypes.string_at(view - 100, SIZE) == newer and host_registered(view), "the retained view kept"
    assert tmsdisk.read_paused(Device(ptr, SIZE)).numpy().tobytes() == newer, "the retained copy kept"
    # Freed while paused: the view goes with it.
    assert host_registered(other_view)
    drv.free(other)
    assert not host_registered(other_view), "the view of freed memory is gone"
    assert tmsdisk.retain_host_copy(False) is True
    tmsdisk.pause("weights")
    tmsdisk.resume("weights")
    assert tmsdisk.read_paused(Device(ptr, SIZE)) is None, "not retained: resident memory has nothing to read"
    assert view_of(ptr, CHUNK)[0] == -errno.ENODATA and not host_registered(view), "nor a view"
    say("OK retain")


def rss_shmem():
    """What the process's RSS holds of the host tier's memory (the daemon's memfds it maps), bytes. (Not
    RssShmem: simcuda's device memory is shared memory too.)"""
    total, tier = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                tier = "memfd:tmsdisk-host-tier" in line
            elif tier and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def scenario_not_kept():
    """With host-tier-keep = false, resume() returns once the host copy's memory is unmapped (RSS shows
    it), as TMS frees its copy; a retained copy's view outlives that memory with its bytes."""
    drv = Driver()
    with tmsdisk.region("weights"):
        ptr, data = allocate(drv)
    data_bytes = 4 * CHUNK + 3 * 4096  # the data chunks (the zero one takes no memory)
    before = rss_shmem()
    tmsdisk.pause("weights")
    paused = rss_shmem()
    assert paused - before >= data_bytes, "the host copy in the process while paused: %d" % (paused - before)
    tmsdisk.resume("weights")
    resumed = rss_shmem()
    assert paused - resumed >= data_bytes, "gone when resume() returned: %d" % (paused - resumed)
    assert drv.read(ptr, SIZE) == data
    tmsdisk.retain_host_copy(True)
    tmsdisk.pause("weights")
    rc, view = view_of(ptr, CHUNK)
    assert rc == 0
    tmsdisk.resume("weights")
    assert rss_shmem() - resumed < data_bytes, "the tier's memory unmapped though retained"
    assert view_of(ptr, CHUNK) == (0, view) and ctypes.string_at(view, SIZE) == data, "the view kept its bytes"
    say("OK not-kept")


def scenario_tms_entry_points():
    """torch_memory_saver's C functions, looked up in the process as its tests do (ctypes.CDLL(None)),
    with its signatures: the thread's region state tags allocations, tms_pause/tms_resume act on the
    regions' tags (memory outside them stays), tms_get_cpu_backup_pointer shows paused bytes in the
    host tier. Run with a tier that holds them."""
    api = ctypes.CDLL(None)
    c_bool, c_char_p, u8p = ctypes.c_bool, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint8)

    def bind(name, argtypes, restype):
        fn = getattr(api, name)
        fn.argtypes, fn.restype = argtypes, restype
        return fn

    set_region = bind("tms_set_interesting_region", [c_bool], None)
    get_region = bind("tms_get_interesting_region", [], c_bool)
    set_tag = bind("tms_set_current_tag", [c_char_p], None)
    get_tag = bind("tms_get_current_tag", [], c_char_p)
    set_cpu = bind("tms_set_enable_cpu_backup", [c_bool], None)
    get_cpu = bind("tms_get_enable_cpu_backup", [], c_bool)
    set_backend = bind("tms_set_cpu_backup_backend", [c_char_p], None)
    get_backend = bind("tms_get_cpu_backup_backend", [], c_char_p)
    set_disk = bind("tms_set_enable_disk_backup", [c_bool], None)
    get_disk = bind("tms_get_enable_disk_backup", [], c_bool)
    set_dir = bind("tms_set_disk_backup_dir", [c_char_p], None)
    set_margin = bind("set_memory_margin_bytes", [ctypes.c_uint64], None)
    set_retain = bind("tms_set_retain_cpu_backup", [c_bool], None)
    get_retain = bind("tms_get_retain_cpu_backup", [], c_bool)
    pause = bind("tms_pause", [c_char_p], ctypes.c_int)
    resume = bind("tms_resume", [c_char_p], ctypes.c_int)
    backup_pointer = bind("tms_get_cpu_backup_pointer", [u8p, ctypes.c_uint64], u8p)

    assert (get_region(), get_tag(), get_cpu(), get_backend(), get_disk(), get_retain()) == (
        False, b"default", False, b"pinned", False, False), "TMS's defaults"
    drv = Driver()
    set_tag(b"weights")
    set_cpu(True)
    set_region(True)
    weights, data = allocate(drv)
    set_region(False)
    outside = drv.alloc(2 * CHUNK)
    drv.write(outside, bytes([5]) * (2 * CHUNK))
    set_tag(b"scratch")
    set_cpu(False)
    set_region(True)
    scratch = drv.alloc(2 * CHUNK)
    set_region(False)
    drv.write(scratch, bytes([9]) * (2 * CHUNK))
    set_backend(b"mmap")
    set_disk(True)
    assert (get_tag(), get_backend(), get_disk()) == (b"scratch", b"mmap", True), "what was set"
    set_disk(False)

    assert pause(None) == 0
    status = tmsdisk.status()
    assert status.tag("weights").paused_bytes == SIZE, status.tag("weights")
    assert status.tag("scratch").paused_bytes == 2 * CHUNK, status.tag("scratch")
    assert status.tag(tmsdisk.UNTAGGED).paused_bytes == 0, "memory outside TMS regions stays resident"
    at = backup_pointer(ctypes.cast(weights + 100, u8p), CHUNK - 100)
    assert at and ctypes.string_at(at, CHUNK - 100) == data[100:CHUNK], "the host copy of paused weights"
    assert not backup_pointer(ctypes.cast(outside, u8p), 4096), "resident memory has no host copy"
    assert resume(None) == 0
    assert drv.read(weights, SIZE) == data, "backed up: intact"
    assert drv.read(scratch, 2 * CHUNK) == bytes(2 * CHUNK), "without a backup: zero-filled, as TMS discards it"
    assert drv.read(outside, 2 * CHUNK) == bytes([5]) * (2 * CHUNK)
    assert pause(b"weights") == 0 and tmsdisk.status().tag("scratch").paused_bytes == 0, "one tag"
    assert resume(b"weights") == 0 and drv.read(weights, SIZE) == data
    # Retaining the host copy is tmsdisk_retain_host_copy; what tmsdisk does not do is logged and
    # ignored (TMS's own functions return nothing to say so).
    set_retain(True)
    assert get_retain() is True and tmsdisk.retain_host_copy(False) is True
    assert get_retain() is False
    set_dir(b"/somewhere/else")
    set_margin(1 << 30)
    say("OK tms-entry-points")


def scenario_prefetch():
    """A tag paused to disk (the tier held another tag's chunks), then read into the tier ahead of its
    resume: its chunks lie in memory after, as far as the tier goes (EXPECT_TIER all or part), and the
    resume brings everything back intact. A resume that comes while a prefetch runs goes first."""
    tier = os.environ["EXPECT_TIER"]
    drv = Driver()
    with tmsdisk.region("first"):
        first = drv.alloc(2 * CHUNK)
    drv.write(first, bytes([3]) * (2 * CHUNK))
    with tmsdisk.region("second"):
        second, data = allocate(drv)
    tmsdisk.pause("first")  # to the tier
    tmsdisk.pause("second")  # to disk: the tier memory holds the first tag's chunks
    assert view_of(second, 4096)[0] == -errno.ENODATA, "the second tag is on disk"
    assert tmsdisk.prefetch("second", wait=True) is False, "no room after the first tag's chunks"
    tmsdisk.resume("first")  # its memory is kept, empty
    assert tmsdisk.prefetch("second", wait=True) is True
    rc, at = view_of(second + 100, CHUNK - 100)
    assert rc == 0 and ctypes.string_at(at, CHUNK - 100) == data[100:CHUNK], "the first chunk prefetched"
    # Five data chunks (chunk 1 is zero and takes no memory): four fit the partial tier, the short last one not.
    last, _ = view_of(second + 5 * CHUNK, 4096)
    assert last == (0 if tier == "all" else -errno.ENODATA), "the last chunk with tier %s: %d" % (tier, last)
    check_reads(second, data)
    tmsdisk.resume("second")
    assert drv.read(second, SIZE) == data, "resumed from the tier and the disk"
    assert drv.read(first, 2 * CHUNK) == bytes([3]) * (2 * CHUNK)
    assert tmsdisk.prefetch(wait=True) is True  # nothing paused: nothing to do
    expect_error(errno.EINVAL, tmsdisk.prefetch, "bad/tag")
    # Two tags paused one after the other share the memory kept since (it holds more than the first
    # tag): the second takes what is free after the first's chunks, the rest of it goes to disk. A
    # daemon that takes the memory back at each resume (EXPECT_KEEP=0) grants the first pause its size.
    tmsdisk.pause("first")
    tmsdisk.pause("second")
    kept = os.environ.get("EXPECT_KEEP", "1") == "1"
    assert view_of(second + 100, 4096)[0] == (0 if kept else -errno.ENODATA), "the second tag's first chunk"
    assert view_of(second + 5 * CHUNK, 4096)[0] == -errno.ENODATA, "its last chunk on disk"
    check_reads(second, data)
    tmsdisk.resume("first")
    # A resume right after a prefetch started (where one could) goes first, with whatever was read by
    # then: everything comes back whole however far the prefetch got.
    tmsdisk.prefetch("second")
    tmsdisk.resume("second")
    assert drv.read(second, SIZE) == data, "a resume that met a running prefetch"
    assert drv.read(first, 2 * CHUNK) == bytes([3]) * (2 * CHUNK)
    say("OK prefetch")


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1].replace("-", "_")]()
