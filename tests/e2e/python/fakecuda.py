# SPDX-License-Identifier: Apache-2.0
"""A stand-in for PyTorch's caching allocator over the CUDA driver (simcuda in CI), through ctypes.

It holds "tensors" (allocations filled with a pattern) and a "cache" (allocations no tensor uses);
empty_cache() frees the cache, as torch.cuda.empty_cache() does, and appends a line to the file
$FAKE_TORCH_MARKER each time it is called, so that a test counts the calls.
"""

import ctypes
import os

_cuda = ctypes.CDLL("libcuda.so.1")  # with the shim preloaded, dlsym hands out its hooks
_ctx = ctypes.c_void_p()
_tensors = []  # (pointer, size)
_cache = []
_initialized = False


def _check(what, rc):
    if rc != 0:
        raise RuntimeError("%s failed: CUresult %d" % (what, rc))


def _make_current():
    # Every thread that calls the driver needs a current context; cudart sets the primary one.
    _check("cuCtxSetCurrent", _cuda.cuCtxSetCurrent(_ctx))


def init():
    global _initialized
    _check("cuInit", _cuda.cuInit(0))
    dev = ctypes.c_int()
    _check("cuDeviceGet", _cuda.cuDeviceGet(ctypes.byref(dev), 0))
    _check("cuDevicePrimaryCtxRetain", _cuda.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), dev))
    _make_current()
    _initialized = True


def is_initialized():
    return _initialized


def _alloc(size):
    ptr = ctypes.c_uint64()
    _check("cuMemAlloc_v2", _cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)))
    return ptr.value


def pattern(size, seed):
    """`size` bytes (a multiple of 4 KiB), never zero, page after page the same: quick in Python."""
    page = bytes(((i * 31 + seed) % 255) + 1 for i in range(4096))
    return page * (size // 4096)


def allocate(tensor_bytes, cache_bytes, seed=7):
    """Tensors filled with pattern(); the cache as the allocator leaves it (any bytes)."""
    ptr = _alloc(tensor_bytes)
    data = pattern(tensor_bytes, seed)
    _check("cuMemcpyHtoD_v2", _cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data, ctypes.c_size_t(tensor_bytes)))
    _tensors.append((ptr, tensor_bytes, seed))
    if cache_bytes:
        cptr = _alloc(cache_bytes)
        junk = pattern(cache_bytes, seed + 1)  # not zero: a pause would have to write it
        _check("cuMemcpyHtoD_v2", _cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(cptr), junk, ctypes.c_size_t(cache_bytes)))
        _cache.append((cptr, cache_bytes))


def tensors_intact():
    _make_current()
    for ptr, size, seed in _tensors:
        buf = ctypes.create_string_buffer(size)
        _check("cuMemcpyDtoH_v2", _cuda.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr), ctypes.c_size_t(size)))
        if buf.raw != pattern(size, seed):
            return False
    return True


def reserved():
    return sum(s for _, s, _ in _tensors) + sum(s for _, s in _cache)


def empty_cache():
    marker = os.environ.get("FAKE_TORCH_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write("empty_cache pid=%d cached=%d\n" % (os.getpid(), sum(s for _, s in _cache)))
    _make_current()  # the shim runs this on a thread of its own
    while _cache:
        ptr, _ = _cache.pop()
        _check("cuMemFree_v2", _cuda.cuMemFree_v2(ctypes.c_uint64(ptr)))
