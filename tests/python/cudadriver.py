# SPDX-License-Identifier: Apache-2.0
"""The few CUDA driver calls the Python tests make, through ctypes (simcuda in CI, the real driver on a
GPU node): a context, allocations, copies. With the shim preloaded, libcuda's cu* calls reach its hooks.
"""

import ctypes

CUDA_ERROR_NOT_PERMITTED = 800


class CudaError(RuntimeError):
    def __init__(self, what, code):
        super().__init__("%s failed: CUresult %d" % (what, code))
        self.code = code


class Driver:
    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.ctx = ctypes.c_void_p()
        self._check("cuInit", self.cuda.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self.cuda.cuDeviceGet(ctypes.byref(dev), 0))
        self._check("cuDevicePrimaryCtxRetain", self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self.make_current()

    @staticmethod
    def _check(what, rc):
        if rc != 0:
            raise CudaError(what, rc)

    def make_current(self):
        """Every thread that calls the driver needs a current context."""
        self._check("cuCtxSetCurrent", self.cuda.cuCtxSetCurrent(self.ctx))

    def alloc(self, size):
        ptr = ctypes.c_uint64()
        self._check("cuMemAlloc_v2", self.cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)))
        return ptr.value

    def free(self, ptr):
        self._check("cuMemFree_v2", self.cuda.cuMemFree_v2(ctypes.c_uint64(ptr)))

    def write(self, ptr, data):
        self._check(
            "cuMemcpyHtoD_v2", self.cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data, ctypes.c_size_t(len(data)))
        )

    def read(self, ptr, size):
        buf = ctypes.create_string_buffer(size)
        self._check("cuMemcpyDtoH_v2", self.cuda.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr), ctypes.c_size_t(size)))
        return buf.raw


def pattern(size, seed):
    """`size` bytes (a multiple of 4 KiB), never zero, the same page repeated: quick in Python."""
    page = bytes(((i * 31 + seed) % 255) + 1 for i in range(4096))
    return page * (size // 4096)
