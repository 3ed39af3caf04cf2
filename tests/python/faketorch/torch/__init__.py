# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the few torch calls tmsdisk's torch_memory_saver makes (tms_compat_app.py, scenario
torch-pools): MemPool and use_mem_pool, current_device, graph. It records which pool is in use and which
graph is being captured, so that a test can check what the compatibility module asks of PyTorch.
FAKE_TORCH_NO_MEMPOOL=1 makes it a PyTorch older than MemPool.
"""

import contextlib
import os
import types

__version__ = "0.0+fake"
version = types.SimpleNamespace(cuda="12.8", hip=None)


class MemPool:
    def __init__(self, allocator=None):
        self.allocator = allocator


class _Cuda:
    def __init__(self):
        self.pools = []  # the pools in use, innermost last
        self.capturing = None  # the graph being captured
        self.device = 0

    def is_available(self):
        return True

    def is_initialized(self):
        return False  # nothing for tmsdisk's start-up module to empty

    def current_device(self):
        return self.device

    def set_device(self, device):
        self.device = device

    def active_pool(self):
        return self.pools[-1] if self.pools else None

    @contextlib.contextmanager
    def use_mem_pool(self, pool, device=None):
        self.pools.append(pool)
        try:
            yield
        finally:
            assert self.pools.pop() is pool

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        assert self.capturing is None
        self.capturing = cuda_graph
        try:
            yield
        finally:
            self.capturing = None


if os.environ.get("FAKE_TORCH_NO_MEMPOOL") == "1":
    del _Cuda.use_mem_pool
else:
    _Cuda.MemPool = MemPool
cuda = _Cuda()
