# SPDX-License-Identifier: Apache-2.0
"""TorchMemorySaver over tmsdisk: torch_memory_saver's public API (commit 4a43c97), backed by libtmsdisk.so.

What maps to what (README.md, "torch_memory_saver compatibility"):
- region(tag, enable_cpu_backup=False, enable_disk_backup=False): a tmsdisk region of that tag, policy
  "backup" when either backup is asked for, else "discard" (TMS throws the content away; tmsdisk gives
  zero-filled memory back). With torch, as TMS does, a private torch.cuda.MemPool per (tag, backup,
  backend, device) is used inside, so that tensors made in the region come from memory allocated while
  the tag is active, never from blocks PyTorch's cache obtained elsewhere.
- pause(tag) / resume(tag): of that tag. Without a tag: every tag used in a region (and, with
  TMS_INIT_ENABLE=1, the memory allocated outside regions too, TMS's "default"); memory outside regions
  is left alone otherwise, as TMS leaves it.
- disable(): tmsdisk's disabled() (never paused), in a MemPool of its own dropped on exit, as TMS does.
- cuda_graph(...): torch.cuda.graph(...) with the tag active during capture.
- _ensure_initialized() and _impl._binary_wrapper.cdll.tms_get_*(): TMS's view of the calling thread's
  region state (in region or not, CPU backup, tag, backend), answered from this module's own state; the
  same object's cudaHostGetFlags (the driver's cuMemHostGetFlags) and cudaGetLastError, which TMS's tests
  reach through its binary, linked with the CUDA runtime. _impl._mem_pools and _impl._with_region_config
  are TMS's names for the regions' MemPools and for a region's state without one (its tests use both).
- get_cpu_backup(x, zero_copy): tmsdisk.read_paused(x, zero_copy): the paused bytes of x from the host
  tier or the disk without resuming it; None while x is resident. zero_copy: a read-only view at an
  address that stays the same while x has a host copy (paused, retained), pinned, gone once x is freed.
- preload(tag) (a fork's addition): tmsdisk.prefetch of that tag, or of every region's tag.
- retain_cpu_backup = True (or TMS_RETAIN_CPU_BACKUP=1): tmsdisk.retain_host_copy(True): a resume leaves
  the host tier's copy readable with get_cpu_backup until that memory is used again (a zero-copy view of
  it keeps its bytes then: until x is freed or resumed without retaining, as TMS's pinned copy).
- set_disk_backup_dir(path): tmsdisk.set_backup_dir: the process's files go in that directory, handed to
  tmsdiskd by descriptor.
What tmsdisk cannot honour is refused with an exception naming the call: a memory_margin_bytes other than 0,
set_disk_backup_dir while anything is paused or to a directory that is not the caller's (or is writable
by others, or on tmpfs), tag names tmsdisk does not accept, ROCm and XPU.
"""

import contextlib
import ctypes
import logging
import os
import sys
import threading
from typing import Optional

from .utils import _import_tmsdisk, bool_env

tmsdisk = _import_tmsdisk()

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
_CPU_BACKUP_BACKENDS = ("mmap", "pinned")
_HOOK_MODES = ("preload", "torch")


def _renamed(e, call):
    """The same tmsdisk error, naming the torch_memory_saver call that failed."""
    if isinstance(e, tmsdisk.NotLoadedError):
        return tmsdisk.NotLoadedError(call, e.message)
    return type(e)(e.errno, call, e.message)


def _refuse(call, why):
    return NotImplementedError("%s is not supported by tmsdisk's torch_memory_saver: %s" % (call, why))


def _call_repr(name, **kwargs):
    return "torch_memory_saver.%s(%s)" % (name, ", ".join("%s=%r" % kv for kv in kwargs.items()))


class TorchMemorySaver:
    def __init__(self):
        self._hook_mode = "preload"
        self._impl = None  # _Impl once initialized (the first region, pause, resume...), as TMS
        self._init_lock = threading.Lock()

    # --- regions -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """Memory allocated inside carries `tag`; backed up on pause if either backup is asked for,
        else discarded (zero-filled on resume)."""
        call = _call_repr("region", tag=tag, enable_cpu_backup=enable_cpu_backup,
                          enable_disk_backup=enable_disk_backup)
        _validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized(call)
        assert not (enable_cpu_backup and enable_disk_backup), \
            "enable_cpu_backup and enable_disk_backup are mutually exclusive"
        backend = cpu_backup_backend or impl.cpu_backup_backend
        with impl.region(call, tag, bool(enable_cpu_backup or enable_disk_backup),
                         pool_key=(tag, bool(enable_cpu_backup), bool(enable_disk_backup),
                                   backend if enable_cpu_backup else ""),
                         state=_RegionState(True, bool(enable_cpu_backup), tag, backend)):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode="global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """torch.cuda.graph(...), whose memory (the graph's pool, grown during capture) carries `tag`."""
        call = _call_repr("cuda_graph", tag=tag, enable_cpu_backup=enable_cpu_backup)
        _validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized(call)
        torch = impl.torch
        if torch is None:
            raise _refuse(call, "it needs torch with CUDA, which this process cannot import")
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with impl.region(call, tag, bool(enable_cpu_backup), pool_key=None,
                             state=_RegionState(True, bool(enable_cpu_backup), tag,
                                                cpu_backup_backend or impl.cpu_backup_backend)):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Memory allocated inside is never paused (tmsdisk policy "resident")."""
        call = "torch_memory_saver.disable()"
        impl = self._ensure_initialized(call)
        with contextlib.ExitStack() as stack:
            torch = impl.torch
            if torch is not None:
                # As TMS: a pool of its own, dropped on exit, so that what is allocated inside is
                # neither served from a region's pool nor left in one.
                pool = torch.cuda.MemPool()
                stack.enter_context(torch.cuda.use_mem_pool(pool))
            try:
                stack.enter_context(tmsdisk.disabled())
            except tmsdisk.Error as e:
                raise _renamed(e, call) from None
            yield

    # --- pause and resume --------------------------------------------------------------------------

    def pause(self, tag: Optional[str] = None):
        """Pauses the memory of `tag`, or of every region's tag when None."""
        call = _call_repr("pause", tag=tag) if tag else "torch_memory_saver.pause()"
        self._ensure_initialized(call).pause(call, tag or None)

    def resume(self, tag: Optional[str] = None):
        """Resumes the memory of `tag`, or every region's tag when None."""
        call = _call_repr("resume", tag=tag) if tag else "torch_memory_saver.resume()"
        self._ensure_initialized(call).resume(call, tag or None)

    def preload(self, tag: Optional[str] = None):
        """Reads the paused memory of `tag` (every region's tag when None) back into the daemon's host
        tier ahead of resume(tag), in the background, as far as this rank's share of the tier goes;
        the resume takes what is there from memory and the rest from disk. (A fork of TMS's.)"""
        call = _call_repr("preload", tag=tag) if tag else "torch_memory_saver.preload()"
        self._ensure_initialized(call).preload(call, tag or None)

    # --- settings ----------------------------------------------------------------------------------

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        # Both of TMS's modes work alike here: the shim sees the driver calls of PyTorch's allocator
        # whichever way TMS would have hooked them, and regions use a MemPool in both.
        if hook_mode not in _HOOK_MODES:
            raise ValueError("hook_mode must be one of %s, not %r" % (", ".join(map(repr, _HOOK_MODES)), hook_mode))
        if self._impl is not None and hook_mode != self._hook_mode:
            raise RuntimeError("Cannot configure after initialization: torch_memory_saver.hook_mode = %r" % hook_mode)
        self._hook_mode = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        if value:
            raise _refuse(
                "torch_memory_saver.memory_margin_bytes = %r" % (value,),
                "a resume takes the memory it needs or fails with the shim's message; it keeps no margin",
            )

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether a resume keeps the host copy (tmsdisk.retain_host_copy: the chunks the host tier held).
        TMS_RETAIN_CPU_BACKUP=1 counts from the first call, this one included."""
        if not tmsdisk.loaded():
            return False
        self._ensure_initialized("torch_memory_saver.retain_cpu_backup")
        return tmsdisk.retain_host_copy()

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        try:
            tmsdisk.retain_host_copy(bool(value))
        except tmsdisk.Error as e:
            raise _renamed(e, "torch_memory_saver.retain_cpu_backup = %r" % (value,)) from None

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """As TMS: a CPU tensor of paused x's bytes, None while x is resident (or was paused without a
        backup; with retain_cpu_backup, a resumed x has its copy). They come from the daemon's host tier
        or its disk, without a resume; with zero_copy, where none of x lies on disk, a read-only tensor
        over the host copy itself, at the same address for as long as x has one (tmsdisk.read_paused)."""
        try:
            return tmsdisk.read_paused(x, zero_copy=zero_copy)
        except tmsdisk.Error as e:
            raise _renamed(e, "torch_memory_saver.get_cpu_backup()") from None

    def set_disk_backup_dir(self, path: str):
        """As TMS: this process's disk backups go in `path` from now on (made when missing, 0700). tmsdisk
        keeps its files there, "tmsdisk-<job>-rank<R>-<pid>.*", and removes them when the process exits.
        Refused while anything is paused (its files stay where they are), and for a directory that is
        not the caller's, is writable by others, or lies in memory (tmpfs)."""
        call = "torch_memory_saver.set_disk_backup_dir(%r)" % (path,)
        try:
            if not os.path.isdir(path):
                os.makedirs(path, mode=0o700, exist_ok=True)
            tmsdisk.set_backup_dir(path)
        except tmsdisk.Error as e:
            raise _renamed(e, call) from None

    # --- initialization ----------------------------------------------------------------------------

    def _ensure_initialized(self, call="torch_memory_saver._ensure_initialized()"):
        if self._impl is None:
            with self._init_lock:
                if self._impl is None:
                    self._impl = _Impl(call, self._hook_mode)
        return self._impl


def _validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend):
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in _CPU_BACKUP_BACKENDS:
        raise ValueError("cpu_backup_backend must be 'mmap' or 'pinned', not %r" % (cpu_backup_backend,))


class _RegionState(tuple):
    """What TMS keeps per thread about the region it is in (its C functions tms_get_*)."""

    def __new__(cls, interesting, cpu_backup, tag, backend):
        return super().__new__(cls, (bool(interesting), bool(cpu_backup), tag, backend))


class _RegionStateView:
    """TMS's introspection of the calling thread's region state, which its examples and tests read as
    torch_memory_saver._impl._binary_wrapper.cdll.tms_get_*(): the same answers, from this module's
    state (the innermost region of this thread, else what TMS_INIT_* set for memory outside regions).
    Tags come back as bytes, as through ctypes."""

    def __init__(self, impl):
        self._impl = impl

    @property
    def cdll(self):
        return self

    def tms_get_interesting_region(self):
        return int(self._impl.region_state()[0])

    def tms_get_enable_cpu_backup(self):
        return int(self._impl.region_state()[1])

    def tms_get_current_tag(self):
        return self._impl.region_state()[2].encode()

    def tms_get_cpu_backup_backend(self):
        return self._impl.region_state()[3].encode()

    @property
    def cudaHostGetFlags(self):  # noqa: N802 (the CUDA runtime's name)
        """cudaHostGetFlags(unsigned int*, void*) -> 0 for pinned host memory: the driver's own
        cuMemHostGetFlags, which takes the same arguments and answers the same."""
        return self._impl.libcuda().cuMemHostGetFlags

    @property
    def cudaGetLastError(self):  # noqa: N802
        """The runtime's sticky error, which the driver call above never sets: always 0."""
        return _NoRuntimeError()


class _NoRuntimeError:
    """A ctypes-like function (callers set argtypes and restype) that returns cudaSuccess."""

    argtypes = []
    restype = None

    def __call__(self, *args):
        return 0


class _Impl:
    """The initialized state: the environment read once, torch if any, the regions' tags and pools."""

    def __init__(self, call, hook_mode):
        self.hook_mode = hook_mode
        self.init_enable = bool_env("TMS_INIT_ENABLE")
        init_cpu = bool_env("TMS_INIT_ENABLE_CPU_BACKUP")
        init_disk = bool_env("TMS_INIT_ENABLE_DISK_BACKUP")
        self.cpu_backup_backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
        if self.cpu_backup_backend not in _CPU_BACKUP_BACKENDS:
            raise ValueError("TMS_INIT_CPU_BACKUP_BACKEND must be mmap or pinned, not %r" % self.cpu_backup_backend)
        if not tmsdisk.loaded():
            raise tmsdisk.NotLoadedError(
                call,
                "libtmsdisk.so is not loaded in this process: run it under `tmsctl run --tms-compat -- CMD` "
                "(this torch_memory_saver is tmsdisk's compatibility module)",
            )
        if bool_env("TMS_RETAIN_CPU_BACKUP"):
            tmsdisk.retain_host_copy(True)  # as retain_cpu_backup = True
        if self.init_enable and not (init_cpu or init_disk):
            # TMS would throw away what is allocated outside regions; memory outside regions is tmsdisk's
            # "untagged", backed up whatever thread allocated it. Its content survives, at the cost of moving.
            logger.warning(
                "TMS_INIT_ENABLE=1 without TMS_INIT_ENABLE_CPU_BACKUP or TMS_INIT_ENABLE_DISK_BACKUP: memory "
                "allocated outside regions is backed up by tmsdisk, not discarded as torch_memory_saver would")
        self.torch = _cuda_torch(call)
        self._lock = threading.Lock()
        self._tags = set()  # tmsdisk tags that regions opened through this module used
        # (tag, cpu, disk, backend, device) -> torch.cuda.MemPool, kept for good as TMS does (its name: its
        # tests take a pool out to free its memory).
        self._mem_pools = {}
        self._libcuda = None
        self._outside = _RegionState(self.init_enable, self.init_enable and init_cpu, _TAG_DEFAULT,
                                     self.cpu_backup_backend)
        self._thread = threading.local()  # .regions: this thread's stack of _RegionState
        self._binary_wrapper = _RegionStateView(self)

    def region_state(self):
        regions = getattr(self._thread, "regions", None)
        return regions[-1] if regions else self._outside

    def tmsdisk_tag(self, tag):
        # With TMS_INIT_ENABLE=1, TMS's "default" tag is also what is allocated outside regions: tmsdisk's
        # untagged memory. Then region(tag="default") adds to it and pause("default") pauses all of it.
        # Any other name goes to tmsdisk as it is: tmsdisk.TagError (a ValueError) for one it does not take.
        return tmsdisk.UNTAGGED if self.init_enable and tag == _TAG_DEFAULT else tag

    @contextlib.contextmanager
    def region(self, call, tag, backup, pool_key, state):
        name = self.tmsdisk_tag(tag)
        with contextlib.ExitStack() as stack:
            if self.torch is not None and pool_key is not None:
                stack.enter_context(self.torch.cuda.use_mem_pool(self._pool(pool_key)))
            try:
                stack.enter_context(tmsdisk.region(name, tmsdisk.BACKUP if backup else tmsdisk.DISCARD))
            except tmsdisk.Error as e:
                raise _renamed(e, call) from None
            with self._lock:
                self._tags.add(name)
            regions = self._thread.__dict__.setdefault("regions", [])
            regions.append(state)
            try:
                yield
            finally:
                regions.pop()

    def _pool(self, key):
        key = key + (self.torch.cuda.current_device(),)  # a MemPool belongs to the device it was made on
        with self._lock:
            pool = self._mem_pools.get(key)
            if pool is None:
                pool = self._mem_pools[key] = self.torch.cuda.MemPool()
        return pool

    @contextlib.contextmanager
    def _with_region_config(self, tag=_TAG_DEFAULT, enable_cpu_backup=False, enable_disk_backup=False,
                            cpu_backup_backend=None):
        """TMS's name: the thread in a region's state (its tag and policy) without the region's MemPool,
        which TMS's tests use to free a pool's memory as its region would."""
        backend = cpu_backup_backend or self.cpu_backup_backend
        with self.region("torch_memory_saver._impl._with_region_config()", tag,
                         bool(enable_cpu_backup or enable_disk_backup), pool_key=None,
                         state=_RegionState(True, bool(enable_cpu_backup), tag, backend)):
            yield

    def libcuda(self):
        """The CUDA driver library this process uses (ctypes), loaded once."""
        if self._libcuda is None:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
        return self._libcuda

    def _ours(self):
        """The tmsdisk tags this module stands for: every region's, and with TMS_INIT_ENABLE=1 the memory
        allocated outside regions (TMS's "default")."""
        with self._lock:
            ours = set(self._tags)
        if self.init_enable:
            ours.add(tmsdisk.UNTAGGED)
        return ours

    def pause(self, call, tag):
        try:
            if tag is not None:
                tmsdisk.pause(self.tmsdisk_tag(tag))
                return
            # Tag by tag, as TMS pauses: the rest of the process runs on (a tag's pause holds back only
            # calls naming its memory), discarded tags first; each backed-up tag's pause keeps the ones
            # paused before it as they are.
            ours = self._ours()
            resident = [r for r in tmsdisk.tags() if r.tag in ours and r.resident_bytes]
            backed = {r.tag for r in resident if r.policy == tmsdisk.BACKUP}
            for name in sorted({r.tag for r in resident}, key=lambda t: (t in backed, t)):
                tmsdisk.pause(name)
        except tmsdisk.Error as e:
            raise _renamed(e, call) from None

    def preload(self, call, tag):
        try:
            if tag is not None:
                tmsdisk.prefetch(self.tmsdisk_tag(tag))
                return
            ours = self._ours()
            for name in sorted({r.tag for r in tmsdisk.tags() if r.paused_allocations} & ours):
                tmsdisk.prefetch(name)
        except tmsdisk.Error as e:
            raise _renamed(e, call) from None

    def resume(self, call, tag):
        try:
            if tag is not None:
                tmsdisk.resume(self.tmsdisk_tag(tag))
                return
            ours = self._ours()
            paused = {r.tag for r in tmsdisk.tags() if r.paused_allocations}
            if paused <= ours:
                tmsdisk.resume()  # all of it at once, also after a whole-process pause
                return
            for name in sorted(paused & ours):
                tmsdisk.resume(name)
        except tmsdisk.Error as e:
            raise _renamed(e, call) from None


def _cuda_torch(call):
    """torch when this process can use it with CUDA (then regions get MemPools), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # as torch_memory_saver does on import
        except ImportError:
            return None
    if getattr(torch.version, "hip", None):
        raise _refuse(call, "ROCm: tmsdisk intercepts the CUDA driver only")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        raise _refuse(call, "Intel XPU: tmsdisk intercepts the CUDA driver only")
    if not torch.cuda.is_available():
        return None
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        raise _refuse(
            call,
            "torch %s has no torch.cuda.MemPool/use_mem_pool, without which tensors made in a region may reuse "
            "memory PyTorch cached outside it, under another tag" % torch.__version__,
        )
    return torch
