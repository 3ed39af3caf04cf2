# SPDX-License-Identifier: Apache-2.0
"""The buckets of tmsdisk.optim: how each parameter group is cut into store objects of at most
`bucket_elements` elements, where each section of a bucket lies in its bytes, and the parameters as
this rank holds them (a DTensor's local shard)."""

import inspect
import sys

import torch

from ._moments import Sections

_ALIGN = 64  # bytes: where each section of a bucket starts, so that vectorized kernels load aligned


def _dtensor_class():
    """torch's DTensor class when this process has imported it, else None. A DTensor parameter's class is
    imported by whoever made it, so looking in sys.modules finds it without importing torch.distributed
    (which torch 1.13 has without DTensor, and a CPU-only build may lack)."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(module), "DTensor", None)
        if cls is not None:
            return cls
    return None


def _is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _local(t):
    """The tensor whose elements this rank holds: a DTensor's local shard (to_local(): the shard, or a view
    of it in older torch, so that in-place updates reach the parameter), any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _placed_like(local, p):
    """`local`, the state of parameter `p` on this rank, as torch.optim keeps it: a DTensor on p's mesh with
    p's placements, shape and stride when p is a DTensor (torch's state is zeros_like(p)), else itself."""
    if not _is_dtensor(p):
        return local
    cls = _dtensor_class()
    shape = {}
    if "shape" in inspect.signature(cls.from_local).parameters:  # uneven shards need the global shape said
        shape = dict(shape=p.shape, stride=p.stride())
    return cls.from_local(local, p.device_mesh, p.placements, run_check=False, **shape)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Segment:
    """Elements [start, stop) of parameter `param` (an index into its group), at element `offset` of
    the bucket's moment sections and `master` of its master section (None: an fp32 parameter, updated
    in place)."""

    __slots__ = ("param", "start", "stop", "offset", "master")

    def __init__(self, param, start, stop, offset, master):
        self.param, self.start, self.stop, self.offset, self.master = param, start, stop, offset, master


class _Bucket:
    """One store object, read and written whole (one range from offset 0), its sections each at an offset
    aligned to _ALIGN bytes: [fp32 masters of the non-fp32 slices] [exp_avg] [exp_avg_sq], and for
    block-scaled moments [exp_avg's fp32 scales] [exp_avg_sq's], one per block of the bucket's elements
    (a block may hold the end of one slice and the start of the next)."""

    def __init__(self, name: str, group: int, index: int, device: torch.device):
        self.name = name
        self.group = group
        self.index = index  # its rank among the optimizer's buckets
        self.device = device
        self.segments = []
        self.numel = 0
        self.master_numel = 0
        self.handle = None  # the store's handle, once opened
        self.written = False  # the store holds this bucket's bytes (a write of it was waited for)
        self.exp_avg_at = self.exp_avg_sq_at = self.scales_at = self.exp_avg_sq_scales_at = self.nbytes = 0
        self.blocks = 0

    def add(self, param: int, start: int, stop: int, needs_master: bool) -> None:
        master = None
        if needs_master:
            master = self.master_numel
            self.master_numel += stop - start
        self.segments.append(_Segment(param, start, stop, self.numel, master))
        self.numel += stop - start

    def seal(self, moments) -> None:
        moment_bytes = self.numel * moments.element_size
        self.exp_avg_at = _round_up(self.master_numel * 4, _ALIGN)
        self.exp_avg_sq_at = self.exp_avg_at + _round_up(moment_bytes, _ALIGN)
        self.nbytes = self.exp_avg_sq_at + moment_bytes
        if moments.block is not None:
            self.blocks = moments.blocks(self.numel)
            self.scales_at = _round_up(self.nbytes, _ALIGN)
            self.exp_avg_sq_scales_at = self.scales_at + _round_up(self.blocks * 4, _ALIGN)
            self.nbytes = self.exp_avg_sq_scales_at + self.blocks * 4

    def views(self, buffer, moments) -> Sections:
        """The sections: 1-D views into the bucket's bytes (scales None for moments kept as they are)."""
        master = buffer[: self.master_numel * 4].view(torch.float32)
        moment_bytes = self.numel * moments.element_size
        exp_avg = buffer[self.exp_avg_at : self.exp_avg_at + moment_bytes].view(moments.dtype)
        exp_avg_sq = buffer[self.exp_avg_sq_at : self.exp_avg_sq_at + moment_bytes].view(moments.dtype)
        scales = sq_scales = None
        if moments.block is not None:
            scales = buffer[self.scales_at : self.scales_at + self.blocks * 4].view(torch.float32)
            sq_scales = buffer[self.exp_avg_sq_scales_at : self.nbytes].view(torch.float32)
        return Sections(master, exp_avg, exp_avg_sq, scales, sq_scales)


def _cut(params, cap: int, make_bucket):
    """The group's parameters (their local shards), in order, cut into buckets of at most `cap` elements;
    a bucket holds one device's tensors only."""
    buckets = []
    current = None
    for index, p in enumerate(params):
        start, numel = 0, p.numel()
        while start < numel:
            if current is None or current.numel == cap or current.device != p.device:
                current = make_bucket(len(buckets), p.device)
                buckets.append(current)
            stop = min(numel, start + cap - current.numel)
            current.add(index, start, stop, p.dtype != torch.float32)
            start = stop
    return buckets


def _listed(params):
    """The constructor's params as lists that can be walked twice (torch's Optimizer makes each group's
    params a list too): a generator is read once, here."""
    if torch.is_tensor(params):
        return [params]
    listed = []
    for item in params:
        if isinstance(item, dict) and not torch.is_tensor(item.get("params")):
            item = dict(item, params=list(item["params"]))
        listed.append(item)
    return listed


def _probes(params):
    """One small tensor per device and floating dtype of the parameters (local shards for DTensors), for
    torch's class to judge the options against; [] for no parameters, which torch then refuses as it
    would. Other dtypes are refused by add_param_group, with a message of its own."""
    kinds, seen = {}, False
    for item in params:
        members = item["params"] if isinstance(item, dict) else [item]
        for p in [members] if torch.is_tensor(members) else members:
            p = p[1] if isinstance(p, tuple) else p  # a (name, parameter) pair, which torch 2.6 and later take
            if torch.is_tensor(p):
                seen, local = True, _local(p)
                if local.is_floating_point():
                    kinds.setdefault((local.device, local.dtype), None)
    if seen and not kinds:
        kinds[(torch.device("cpu"), torch.float32)] = None
    return [torch.zeros(1, device=device, dtype=dtype, requires_grad=True) for device, dtype in kinds]


def layout(param_groups, buckets_by_group, bucket_elements: int, moments) -> dict:
    """What a checkpoint's files must fit: the parameters' shapes and dtypes (a DTensor's local shape:
    each rank saves and loads its own shards) and every bucket's segments and sections."""
    groups = []
    for group, buckets in zip(param_groups, buckets_by_group):
        layouts = []
        for b in buckets:
            entry = {
                "numel": b.numel, "master_numel": b.master_numel, "nbytes": b.nbytes,
                "exp_avg_at": b.exp_avg_at, "exp_avg_sq_at": b.exp_avg_sq_at,
                "segments": [[s.param, s.start, s.stop, s.offset, s.master] for s in b.segments],
            }
            if moments.block is not None:  # only then: fp32 and bf16 layouts read as before
                entry.update(blocks=b.blocks, scales_at=b.scales_at, exp_avg_sq_scales_at=b.exp_avg_sq_scales_at)
            layouts.append(entry)
        groups.append({"params": [[list(_local(p).shape), str(p.dtype)] for p in group["params"]],
                       "buckets": layouts})
    return {"bucket_elements": bucket_elements, "groups": groups}
