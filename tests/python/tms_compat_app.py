# SPDX-License-Identifier: Apache-2.0
"""A program for test_tmsdisk.py, run under `tmsctl run --tms-compat` on simcuda: what can be checked of
tmsdisk's torch_memory_saver without torch (regions, pause/resume by the compatibility names, over
allocations made through ctypes, and the refusals). python3 tms_compat_app.py SCENARIO; it prints
"OK SCENARIO" last, or fails with a traceback.
"""

import ctypes
import errno
import os
import subprocess
import tempfile
import sys
import threading

from cudadriver import Driver, pattern

MiB = 1 << 20


def expect(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return e
    raise AssertionError("%r raised nothing, %s expected" % (fn, exc_type.__name__))


def enter(cm):
    """Enters a context manager made by a generator (region(), disable()) and returns it, to exit later."""
    cm.__enter__()
    return cm


def imported_from_compat_dir(module):
    expected = os.environ.get("TEST_COMPAT_DIR")
    if expected:
        got = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
        assert os.path.realpath(got) == os.path.realpath(expected), "%s is not from %s" % (module.__file__, expected)


def row(tag, policy=None):
    import tmsdisk

    rows = [t for t in tmsdisk.tags() if t.tag == tag and (policy is None or t.policy == policy)]
    assert len(rows) == 1, "one row expected for %s/%s: %r" % (tag, policy, tmsdisk.tags())
    return rows[0]


def scenario_regions():
    """region(), pause(tag), resume(tag), pause()/resume() of the regions only; discard is zero-filled."""
    import torch_memory_saver as tms_module
    from torch_memory_saver import torch_memory_saver

    import tmsdisk

    imported_from_compat_dir(tms_module)
    assert isinstance(torch_memory_saver, tms_module.TorchMemorySaver) and torch_memory_saver.enabled
    torch_memory_saver.hook_mode = "preload"
    assert torch_memory_saver.hook_mode == "preload"
    cuda = Driver()
    weights_data, cache_data, outside_data = pattern(8 * MiB, 11), pattern(4 * MiB, 12), pattern(4 * MiB, 13)
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        cdll = torch_memory_saver._impl._binary_wrapper.cdll
        assert (cdll.tms_get_interesting_region(), cdll.tms_get_current_tag()) == (1, b"weights")
        weights = cuda.alloc(len(weights_data))
    with torch_memory_saver.region(tag="kv_cache"):  # no backup: discarded
        cache = cuda.alloc(len(cache_data))
    # Outside regions without TMS_INIT_ENABLE: not TMS's memory.
    assert (cdll.tms_get_interesting_region(), cdll.tms_get_enable_cpu_backup()) == (0, 0)
    outside = cuda.alloc(len(outside_data))  # outside regions: TMS leaves it alone
    for ptr, data in ((weights, weights_data), (cache, cache_data), (outside, outside_data)):
        cuda.write(ptr, data)
    assert row("weights").policy == "backup" and row("kv_cache").policy == "discard"

    torch_memory_saver.pause("kv_cache")
    assert row("kv_cache").paused_bytes == 4 * MiB and row("weights").resident_bytes == 8 * MiB
    torch_memory_saver.pause("weights")
    assert row("weights").paused_bytes == 8 * MiB and row("untagged").resident_bytes == 4 * MiB
    torch_memory_saver.resume("weights")
    torch_memory_saver.resume("kv_cache")
    assert cuda.read(weights, len(weights_data)) == weights_data
    assert cuda.read(cache, len(cache_data)) == bytes(len(cache_data))

    # Without a tag: every region's tag, memory outside regions untouched and usable meanwhile.
    cuda.write(cache, cache_data)
    torch_memory_saver.pause()
    assert row("weights").paused_bytes == 8 * MiB and row("kv_cache").paused_bytes == 4 * MiB
    assert row("untagged").resident_bytes == 4 * MiB and row("untagged").paused_bytes == 0
    assert cuda.read(outside, len(outside_data)) == outside_data
    torch_memory_saver.resume()
    assert row("weights").resident_bytes == 8 * MiB and row("kv_cache").resident_bytes == 4 * MiB
    assert cuda.read(weights, len(weights_data)) == weights_data
    assert cuda.read(cache, len(cache_data)) == bytes(len(cache_data))

    # Two regions to back up while memory outside regions stays: each tag pauses in turn, the memory
    # outside regions runs on, and both come back.
    with torch_memory_saver.region(tag="optimizer", enable_disk_backup=True):
        optimizer = cuda.alloc(4 * MiB)
    cuda.write(optimizer, pattern(4 * MiB, 14))
    torch_memory_saver.pause()
    assert row("weights").paused_bytes == 8 * MiB and row("optimizer").paused_bytes == 4 * MiB
    assert cuda.read(outside, len(outside_data)) == outside_data
    # One of them comes back alone; the other stays paused.
    torch_memory_saver.resume("optimizer")
    assert row("optimizer").resident_bytes == 4 * MiB and row("weights").paused_bytes == 8 * MiB
    assert cuda.read(optimizer, 4 * MiB) == pattern(4 * MiB, 14)
    torch_memory_saver.resume()
    cuda.free(outside)
    assert cuda.read(weights, len(weights_data)) == weights_data
    assert cuda.read(optimizer, 4 * MiB) == pattern(4 * MiB, 14)

    # Nested regions: the innermost counts, the outer one again after it.
    with torch_memory_saver.region(tag="outer", enable_cpu_backup=True):
        with torch_memory_saver.region(tag="inner"):
            inner = cuda.alloc(2 * MiB)
        outer = cuda.alloc(2 * MiB)
    assert row("inner").policy == "discard" and row("outer").policy == "backup"

    # disable(): never paused.
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        with torch_memory_saver.disable():
            kept = cuda.alloc(4 * MiB)
    assert tmsdisk.status().unmanaged_bytes["resident-by-request"] == 4 * MiB
    for ptr in (inner, outer, kept):
        cuda.free(ptr)
    print("OK regions", flush=True)


def scenario_init_enable():
    """TMS_INIT_ENABLE=1 with CPU backup: memory outside regions is TMS's "default" tag, backed up."""
    from torch_memory_saver import torch_memory_saver

    assert os.environ["TMS_INIT_ENABLE"] == "1" and os.environ["TMS_INIT_ENABLE_CPU_BACKUP"] == "1"
    # TMS's view of this thread's region state, as its nested_region example reads it.
    torch_memory_saver._ensure_initialized()
    cdll = torch_memory_saver._impl._binary_wrapper.cdll

    def state():
        return (cdll.tms_get_interesting_region(), cdll.tms_get_enable_cpu_backup(), cdll.tms_get_current_tag(),
                cdll.tms_get_cpu_backup_backend())

    assert state() == (1, 1, b"default", b"pinned"), state()
    cuda = Driver()
    weights = cuda.alloc(8 * MiB)
    cuda.write(weights, pattern(8 * MiB, 21))
    with torch_memory_saver.region(tag="grad_buffer", enable_cpu_backup=False):
        assert state() == (1, 0, b"grad_buffer", b"pinned"), state()
        with torch_memory_saver.region(tag="inner", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            assert state() == (1, 1, b"inner", b"mmap"), state()
            seen = []
            other = threading.Thread(target=lambda: seen.append(state()))
            other.start()
            other.join()
            assert seen == [(1, 1, b"default", b"pinned")], seen  # another thread is outside regions
        assert state() == (1, 0, b"grad_buffer", b"pinned"), state()
        grad = cuda.alloc(4 * MiB)
    assert state() == (1, 1, b"default", b"pinned"), state()
    cuda.write(grad, pattern(4 * MiB, 22))
    with torch_memory_saver.region():  # tag "default": the same memory as outside regions
        more = cuda.alloc(2 * MiB)
    assert row("untagged", "discard").allocations == 1 and row("untagged", "backup").allocations == 1

    torch_memory_saver.pause("default")
    assert row("untagged", "backup").paused_bytes == 8 * MiB and row("grad_buffer").resident_bytes == 4 * MiB
    torch_memory_saver.resume("default")
    torch_memory_saver.pause()
    assert row("grad_buffer").paused_bytes == 4 * MiB and row("untagged", "backup").paused_bytes == 8 * MiB
    # As TMS's training_engine example: work in disable() while paused (TMSDISK_ON_TOUCH=fail: a call
    # held back by mistake fails instead of hanging).
    with torch_memory_saver.disable():
        scratch = cuda.alloc(4 * MiB)
        cuda.write(scratch, pattern(4 * MiB, 23))
        assert cuda.read(scratch, 4 * MiB) == pattern(4 * MiB, 23)
    cuda.free(scratch)
    torch_memory_saver.resume()
    assert cuda.read(weights, 8 * MiB) == pattern(8 * MiB, 21)
    assert cuda.read(grad, 4 * MiB) == bytes(4 * MiB)
    cuda.free(more)
    print("OK init-enable", flush=True)


def scenario_refusals():
    """What tmsdisk cannot honour is refused with the call's name; what it can is accepted."""
    from torch_memory_saver import configure_subprocess, torch_memory_saver

    cuda = Driver()
    assert torch_memory_saver.retain_cpu_backup is False
    torch_memory_saver.retain_cpu_backup = True  # tmsdisk.retain_host_copy
    assert torch_memory_saver.retain_cpu_backup is True
    torch_memory_saver.retain_cpu_backup = False
    assert torch_memory_saver.retain_cpu_backup is False
    torch_memory_saver.memory_margin_bytes = 0
    e = expect(NotImplementedError, setattr, torch_memory_saver, "memory_margin_bytes", 1 << 30)
    assert "memory_margin_bytes" in str(e), e
    expect(NotImplementedError, getattr, torch_memory_saver, "memory_margin_bytes")
    # A directory its group may write: refused by the daemon, the rank's files staying where they are.
    shared = tempfile.mkdtemp()
    os.chmod(shared, 0o775)
    e = expect(OSError, torch_memory_saver.set_disk_backup_dir, shared)
    assert e.errno == errno.EACCES and "set_disk_backup_dir(%r)" % shared in str(e), e
    os.rmdir(shared)
    torch_memory_saver.set_disk_backup_dir(os.environ["TMS_DISK_BACKUP_DIR"])  # the daemon's root: fine
    e = expect(ValueError, enter, torch_memory_saver.region(tag="has space"))
    assert "region(tag='has space'" in str(e) and "A-Z a-z 0-9" in str(e), e
    e = expect(ValueError, enter, torch_memory_saver.region(cpu_backup_backend="mmap"))
    assert "requires enable_cpu_backup" in str(e), e
    with torch_memory_saver.region(tag="pinned_or_not", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        ptr = cuda.alloc(2 * MiB)
    assert row("pinned_or_not").policy == "backup"
    expect(AssertionError, enter, torch_memory_saver.region(enable_cpu_backup=True, enable_disk_backup=True))
    e = expect(ValueError, setattr, torch_memory_saver, "hook_mode", "magic")
    e = expect(RuntimeError, setattr, torch_memory_saver, "hook_mode", "torch")  # after initialization
    e = expect(NotImplementedError, enter, torch_memory_saver.cuda_graph(object()))
    assert "cuda_graph" in str(e) and "torch" in str(e), e
    e = expect(OSError, torch_memory_saver.pause, "bad/tag")
    assert "pause(tag='bad/tag')" in str(e), e

    # configure_subprocess(): a child started inside has the shim preloaded (inherited anyway here).
    shim = os.environ["SHIM"]
    with configure_subprocess():
        assert shim in os.environ["LD_PRELOAD"].split(":")
        out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['LD_PRELOAD'])"],
                             stdout=subprocess.PIPE, check=True).stdout.decode()
        assert os.path.realpath(shim) in [os.path.realpath(p) for p in out.strip().split(":")], out
    cuda.free(ptr)
    print("OK refusals", flush=True)


def scenario_retain_env():
    """TMS_RETAIN_CPU_BACKUP=1 turns retaining on at the first call, as retain_cpu_backup = True."""
    from torch_memory_saver import torch_memory_saver

    # Read first, as TMS's run_retain_from_env does: the read is the first call.
    assert torch_memory_saver.retain_cpu_backup is True
    torch_memory_saver.pause()  # nothing in regions: nothing to do
    assert torch_memory_saver.retain_cpu_backup is True
    print("OK retain-env", flush=True)


def scenario_torch_pools():
    """With torch (a fake one here): a region's tensors come from a private pool per tag, backup and
    device, used while the tag is active; disable() takes a fresh pool each time; cuda_graph() captures
    with the tag active."""
    import torch
    from torch_memory_saver import torch_memory_saver

    assert torch.__version__ == "0.0+fake", "not the test's fake torch: %s" % torch.__file__
    cuda = Driver()

    def in_region(**kwargs):
        with torch_memory_saver.region(**kwargs):
            pool = torch.cuda.active_pool()
            ptr = cuda.alloc(2 * MiB)  # what the pool would obtain from the driver, under the tag
        assert torch.cuda.active_pool() is None, "the region left its pool in use"
        return pool, ptr

    kv1, a = in_region(tag="kv_cache")
    kv2, b = in_region(tag="kv_cache")
    kv_backed, c = in_region(tag="kv_cache", enable_cpu_backup=True)
    weights, d = in_region(tag="weights", enable_disk_backup=True)
    assert kv1 is not None and kv1 is kv2, "the same region got another pool"
    assert len({id(kv1), id(kv_backed), id(weights)}) == 3, "different regions share a pool"
    assert row("kv_cache", "discard").allocations == 2 and row("kv_cache", "backup").allocations == 1
    assert row("weights", "backup").allocations == 1
    torch.cuda.set_device(1)
    kv_dev1, e = in_region(tag="kv_cache")
    torch.cuda.set_device(0)
    assert kv_dev1 is not kv1, "a pool of device 0 served device 1"

    pools = []
    for _ in range(2):
        with torch_memory_saver.disable():
            pools.append(torch.cuda.active_pool())
            kept = cuda.alloc(2 * MiB)
        cuda.free(kept)
    assert None not in pools and pools[0] is not pools[1] and kv1 not in pools

    # TMS's private names, which its tests use: the pools by (tag, cpu, disk, backend, device), a region's
    # state without its pool, and the CUDA runtime's pinned-memory query through its binary.
    impl = torch_memory_saver._impl
    assert impl._mem_pools[("kv_cache", True, False, "pinned", 0)] is kv_backed, "TMS's key for a region's pool"
    with impl._with_region_config(tag="weights", enable_cpu_backup=True):
        assert torch.cuda.active_pool() is None, "a region's state without its pool"
        f = cuda.alloc(2 * MiB)
    assert row("weights", "backup").allocations == 2, "allocated in the region's state"
    cdll = impl._binary_wrapper.cdll
    host_get_flags = cdll.cudaHostGetFlags
    host_get_flags.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
    host_get_flags.restype = ctypes.c_int
    get_last_error = cdll.cudaGetLastError
    get_last_error.argtypes, get_last_error.restype = [], ctypes.c_int
    pinned, flags = ctypes.c_void_p(), ctypes.c_uint()
    assert cuda.cuda.cuMemAllocHost_v2(ctypes.byref(pinned), ctypes.c_size_t(4096)) == 0
    assert host_get_flags(ctypes.byref(flags), pinned) == 0, "pinned host memory"
    plain = ctypes.create_string_buffer(4096)
    assert host_get_flags(ctypes.byref(flags), ctypes.c_void_p(ctypes.addressof(plain))) != 0, "pageable memory"
    assert get_last_error() == 0
    assert cuda.cuda.cuMemFreeHost(pinned) == 0
    cuda.free(f)

    graph = object()
    with torch_memory_saver.cuda_graph(graph, tag="graph"):
        assert torch.cuda.capturing is graph
        g = cuda.alloc(2 * MiB)
    assert torch.cuda.capturing is None
    assert row("graph").policy == "discard" and row("graph").allocations == 1
    for ptr in (a, b, c, d, e, g):
        cuda.free(ptr)
    print("OK torch-pools", flush=True)


def scenario_torch_without_mempool():
    """A PyTorch without MemPool cannot keep a region's tensors apart: refused, naming the call."""
    from torch_memory_saver import torch_memory_saver

    e = expect(NotImplementedError, enter, torch_memory_saver.region(tag="kv_cache"))
    assert "region(tag='kv_cache'" in str(e) and "MemPool" in str(e), e
    print("OK torch-without-mempool", flush=True)


def scenario_not_loaded():
    """Imported without the shim: importing works, the first call says how to launch."""
    import torch_memory_saver
    import tmsdisk

    e = expect(tmsdisk.NotLoadedError, enter, torch_memory_saver.torch_memory_saver.region())
    assert "tmsctl run --tms-compat" in str(e) and "region(" in str(e), e
    print("OK not-loaded", flush=True)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1].replace("-", "_")]()
