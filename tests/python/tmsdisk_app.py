# SPDX-License-Identifier: Apache-2.0
"""A program for test_tmsdisk.py, run under `tmsctl run` on simcuda: python3 tmsdisk_app.py SCENARIO.

Each scenario uses the `tmsdisk` package over device memory it allocates through ctypes (cudadriver.py)
and asserts what it sees; it prints "OK SCENARIO" last, or fails with a traceback (exit status 1).
"""

import errno
import os
import sys
import threading

from cudadriver import CUDA_ERROR_NOT_PERMITTED, CudaError, Driver, pattern

MiB = 1 << 20


def expect_error(exc_type, fn, *args):
    try:
        fn(*args)
    except exc_type as e:
        return e
    raise AssertionError("%s%r raised nothing, %s expected" % (getattr(fn, "__name__", fn), args, exc_type.__name__))


def tag_row(st, tag, policy):
    rows = [t for t in st.tags if t.tag == tag and t.policy == policy]
    assert len(rows) == 1, "expected one row for (%s, %s) in %r" % (tag, policy, st.tags)
    return rows[0]


def package_from_expected_dir(tmsdisk):
    """The package is the one `tmsctl run` put on the path (the build tree's or the install's)."""
    expected = os.environ.get("TEST_PYTHON_DIR")
    if expected:
        got = os.path.realpath(os.path.dirname(os.path.dirname(tmsdisk.__file__)))
        assert got == os.path.realpath(expected), "tmsdisk imported from %s, not %s" % (got, expected)


def scenario_tags():
    """Tags and policies: pause by tag, the figures, the weights' bytes back, the cache zero-filled."""
    import tmsdisk

    package_from_expected_dir(tmsdisk)
    assert tmsdisk.loaded()
    cuda = Driver()
    weights_data, cache_data, free_data = pattern(8 * MiB, 1), pattern(4 * MiB, 2), pattern(4 * MiB, 3)
    with tmsdisk.region("weights"):
        weights = cuda.alloc(len(weights_data))
    with tmsdisk.region("kv_cache", "discard"):
        cache = cuda.alloc(len(cache_data))
    untagged = cuda.alloc(len(free_data))
    for ptr, data in ((weights, weights_data), (cache, cache_data), (untagged, free_data)):
        cuda.write(ptr, data)

    st = tmsdisk.status()
    assert st.enabled and st.state == "running", st
    assert st.managed_allocations == 3 and st.resident_bytes == 16 * MiB, st
    w, k, u = tag_row(st, "weights", "backup"), tag_row(st, "kv_cache", "discard"), tag_row(st, "untagged", "backup")
    assert (w.allocations, w.resident_bytes, w.paused_bytes) == (1, 8 * MiB, 0), w
    assert (k.allocations, k.resident_bytes, k.paused_bytes) == (1, 4 * MiB, 0), k
    assert (u.allocations, u.resident_bytes, u.paused_bytes) == (1, 4 * MiB, 0), u
    assert st.tag("weights") == w and st.tag("nothing") is None

    tmsdisk.pause("kv_cache")
    st = tmsdisk.status()
    k = tag_row(st, "kv_cache", "discard")
    assert (k.paused_allocations, k.resident_bytes, k.paused_bytes) == (1, 0, 4 * MiB), k
    assert tag_row(st, "weights", "backup").resident_bytes == 8 * MiB, st
    assert st.paused_bytes == 4 * MiB and st.resident_bytes == 12 * MiB, st
    # The rest of the program runs: memory that is not paused is read as usual (TMSDISK_ON_TOUCH=fail
    # makes a call held by mistake fail here instead of hanging), paused memory is not.
    assert cuda.read(untagged, len(free_data)) == free_data
    e = expect_error(CudaError, cuda.read, cache, 4096)
    assert e.code == CUDA_ERROR_NOT_PERMITTED, e

    tmsdisk.pause("weights")
    st = tmsdisk.status()
    w = tag_row(st, "weights", "backup")
    assert (w.paused_allocations, w.resident_bytes, w.paused_bytes) == (1, 0, 8 * MiB), w
    assert tag_row(st, "untagged", "backup").resident_bytes == 4 * MiB, st
    assert st.paused_bytes == 12 * MiB and st.resident_bytes == 4 * MiB, st
    tmsdisk.pause("kv_cache")  # already paused: nothing to do
    tmsdisk.pause("never-used")  # a tag nothing carries: nothing to do

    # accept_loss with a tag, as `tmsctl resume --tag weights --accept-loss` (it used to be refused):
    # nothing is damaged, so the weights come back verified, byte for byte.
    tmsdisk.resume("weights", accept_loss=True)
    assert cuda.read(weights, len(weights_data)) == weights_data, "the weights came back changed"
    tmsdisk.resume("kv_cache")
    assert cuda.read(cache, len(cache_data)) == bytes(len(cache_data)), "the discarded cache is not zero-filled"
    st = tmsdisk.status()
    assert st.state == "running" and st.paused_bytes == 0 and st.resident_bytes == 16 * MiB, st

    # The whole process, tags and untagged memory together.
    cuda.write(cache, cache_data)
    tmsdisk.pause()
    st = tmsdisk.status()
    assert st.state == "paused" and st.paused_bytes == 16 * MiB, st
    tmsdisk.resume()
    assert cuda.read(weights, len(weights_data)) == weights_data
    assert cuda.read(untagged, len(free_data)) == free_data
    assert cuda.read(cache, len(cache_data)) == bytes(len(cache_data))

    # Backed-up tags pause one after another, then the whole process over them (they are carried).
    with tmsdisk.region("optimizer"):
        optimizer = cuda.alloc(4 * MiB)
    cuda.write(optimizer, pattern(4 * MiB, 4))
    tmsdisk.pause("weights")
    tmsdisk.pause("optimizer")
    assert tag_row(tmsdisk.status(), "optimizer", "backup").paused_bytes == 4 * MiB
    tmsdisk.pause()
    assert tag_row(tmsdisk.status(), "untagged", "backup").paused_bytes == len(free_data)
    tmsdisk.resume("weights")
    # The untagged memory the whole pause took stays paused, and any kernel may reach it: every call
    # is held (under --on-touch fail: refused) until it is back, here by its own tag.
    e = expect_error(CudaError, cuda.read, weights, len(weights_data))
    assert e.code == CUDA_ERROR_NOT_PERMITTED, e
    tmsdisk.resume("untagged")
    assert cuda.read(weights, len(weights_data)) == weights_data
    assert tag_row(tmsdisk.status(), "optimizer", "backup").paused_bytes == 4 * MiB
    tmsdisk.resume()
    assert cuda.read(optimizer, 4 * MiB) == pattern(4 * MiB, 4)
    assert cuda.read(untagged, len(free_data)) == free_data
    print("OK tags", flush=True)


def scenario_regions():
    """Regions nest, are per thread, end on exceptions; disabled() memory stays resident; bad input."""
    import tmsdisk

    cuda = Driver()
    with tmsdisk.region("outer"):
        with tmsdisk.region("inner", tmsdisk.DISCARD):
            inner = cuda.alloc(2 * MiB)
        outer = cuda.alloc(2 * MiB)
        with tmsdisk.disabled():
            pinned = cuda.alloc(4 * MiB)
    st = tmsdisk.status()
    assert tag_row(st, "inner", "discard").allocations == 1, st
    assert tag_row(st, "outer", "backup").allocations == 1, st
    assert st.unmanaged_bytes["resident-by-request"] == 4 * MiB, st
    assert st.managed_allocations == 2, st

    # An exception inside a region ends it: the next allocation is untagged.
    try:
        with tmsdisk.region("failing"):
            raise KeyError("inside")
    except KeyError:
        pass
    after = cuda.alloc(2 * MiB)
    st = tmsdisk.status()
    assert tag_row(st, "untagged", "backup").allocations == 1 and st.tag("failing") is None, st

    # Another thread's allocation made while this one is inside a region is not tagged.
    inside, done = threading.Event(), threading.Event()
    other = {}

    def allocate_elsewhere():
        inside.wait()
        cuda.make_current()
        other["ptr"] = cuda.alloc(2 * MiB)
        done.set()

    thread = threading.Thread(target=allocate_elsewhere)
    thread.start()
    with tmsdisk.region("mine", "discard"):
        inside.set()
        done.wait()
    thread.join()
    st = tmsdisk.status()
    assert tag_row(st, "untagged", "backup").allocations == 2, st
    assert st.tag("mine") is None, st

    # Bad names and policies: refused before anything is pushed, with the rule.
    for bad in ("", "has space", "x" * 64, "slash/", "ünïcode", None, 7):
        e = expect_error(tmsdisk.Error, lambda t: tmsdisk.region(t).__enter__(), bad)
        assert e.errno == errno.EINVAL and "A-Z a-z 0-9" in str(e) and isinstance(e, ValueError), e
    e = expect_error(tmsdisk.Error, tmsdisk.pause, "bad tag")
    assert e.errno == errno.EINVAL and "bad tag" in str(e), e
    e = expect_error(tmsdisk.Error, tmsdisk.resume, "bad/tag")
    assert e.errno == errno.EINVAL, e
    for bad in ("", "bad/tag"):  # an empty tag is no tag: never the whole process
        e = expect_error(tmsdisk.TagError, tmsdisk.resume, bad, True)
        assert e.errno == errno.EINVAL and "A-Z a-z 0-9" in str(e), e
    e = expect_error(tmsdisk.Error, lambda: tmsdisk.region("ok", "sometimes").__enter__())
    assert e.errno == errno.EINVAL and "'discard'" in str(e), e
    tmsdisk.region("x" * 63, "resident")  # the longest name is fine

    # Deeper than the shim's 32: ENOSPC, and what was opened closes in order.
    opened = []
    try:
        for depth in range(40):
            r = tmsdisk.region("deep%d" % depth)
            r.__enter__()
            opened.append(r)
        raise AssertionError("40 nested regions were all accepted")
    except tmsdisk.Error as e:
        assert e.errno == errno.ENOSPC and "32" in str(e), e
    assert len(opened) == 32, len(opened)
    for r in reversed(opened):
        r.__exit__(None, None, None)
    last = cuda.alloc(2 * MiB)
    assert tag_row(tmsdisk.status(), "untagged", "backup").allocations == 3
    for ptr in (inner, outer, pinned, after, other["ptr"], last):
        cuda.free(ptr)
    print("OK regions", flush=True)


def scenario_no_daemon():
    """The shim is loaded but no daemon answers: pause raises with the shim's message."""
    import tmsdisk

    cuda = Driver()
    with tmsdisk.region("weights"):
        ptr = cuda.alloc(4 * MiB)
    cuda.write(ptr, pattern(4 * MiB, 5))
    e = expect_error(tmsdisk.Error, tmsdisk.pause)
    assert e.errno in (errno.ENOENT, errno.ECONNREFUSED), e
    assert "tmsdiskd" in e.message and e.message in str(e), e
    e = expect_error(tmsdisk.Error, tmsdisk.pause, "weights")
    assert e.errno in (errno.ENOENT, errno.ECONNREFUSED) and "tmsdiskd" in e.message, e
    assert cuda.read(ptr, 4 * MiB) == pattern(4 * MiB, 5), "a failed pause changed the memory"
    assert tmsdisk.status().state == "running"
    print("OK no-daemon", flush=True)


def scenario_not_loaded():
    """No libtmsdisk.so in the process: every call says how to get it."""
    import tmsdisk

    assert not tmsdisk.loaded()
    for call in (tmsdisk.pause, tmsdisk.resume, tmsdisk.status, tmsdisk.version, lambda: tmsdisk.region("w").__enter__()):
        e = expect_error(tmsdisk.NotLoadedError, call)
        assert isinstance(e, tmsdisk.Error) and isinstance(e, OSError) and e.errno == errno.ELIBACC, e
        assert "tmsctl run" in str(e) and "LD_PRELOAD" in str(e), e
    if os.environ.get("TMSDISK_LIBRARY"):
        assert "TMSDISK_LIBRARY" in str(expect_error(tmsdisk.NotLoadedError, tmsdisk.pause))
    print("OK not-loaded", flush=True)


def scenario_actor():
    """A Ray actor's stand-in, started with nothing but the environment `tmsctl env --json` printed (what
    Ray's runtime_env={"env_vars": ...} gives an actor): each line on stdin is a method call, answered on
    stdout. sleep/wake_up are the README's recipe (tmsdisk.pause()/resume() from inside); check verifies
    the memory; `tmsctl pause --job` from outside must find the actor too."""
    import tmsdisk

    package_from_expected_dir(tmsdisk)
    cuda = Driver()
    weights_data = pattern(12 * MiB, 7)
    weights = cuda.alloc(len(weights_data))
    cuda.write(weights, weights_data)
    methods = {
        "sleep": tmsdisk.pause,
        "wake_up": tmsdisk.resume,
        "state": lambda: tmsdisk.status().state,
        "check": lambda: "intact" if cuda.read(weights, len(weights_data)) == weights_data else "CHANGED",
    }
    print("ready", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "exit":
            break
        print("%s: %s" % (name, methods[name]()), flush=True)
    print("OK actor", flush=True)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1].replace("-", "_")]()
