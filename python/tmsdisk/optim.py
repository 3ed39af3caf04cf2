# SPDX-License-Identifier: Apache-2.0
"""tmsdisk.optim: Adam and AdamW whose state lives in tmsdiskd's store and streams through the step.

The optimizer state (exp_avg, exp_avg_sq, and an fp32 master copy of each bf16 or fp16 parameter) is
kept in the rank's store of named objects (tmsdisk.store), not in device memory. Each parameter group
is cut into buckets of at most `bucket_elements` elements (a large tensor spans several buckets, a
bucket may hold slices of several tensors); step() brings them into memory one after another, at most
`depth` at a time: it reads bucket k+1 while it updates bucket k and while bucket k-1 is written back.

    from tmsdisk.optim import StreamedAdamW
    opt = StreamedAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)   # under `tmsctl run`
    loss.backward(); opt.step(); opt.zero_grad()

The update is torch's own: the functional kernel torch.optim.AdamW (Adam) itself calls in the torch
of this process, with the same foreach and fused choices, so fp32 parameters with fp32 moments end
bit-identical to torch.optim.AdamW's. Step counts are kept as torch keeps them, one per parameter: on
the host, or with fused=True on the parameter's device, where the fused kernel reads them.

Parameters that are DTensors (FSDP2's fully_shard, tensor parallelism) are updated shard by shard: each
rank streams the local shard of each parameter (to_local()) with the local shard of its gradient, and
writes the update back into it; nothing is gathered. Its buckets hold its shards only, under names of
its own store (which is the process's). state_dict() gives DTensors placed as the parameters, as
torch.optim.AdamW's state for DTensor parameters is.

The last write-backs of a step may finish after step() returns; the next step(), state_dict(),
flush() (synchronize()) and the interpreter's exit wait for them. prefetch() starts reading the first
buckets early, for use during backward (prefetch_on_backward=True does it from the first gradient
hook of each backward).

moment_dtype=torch.bfloat16 keeps the moments in half the bytes; torch.float8_e4m3fn in a quarter, with an
fp32 scale per MOMENT_BLOCK elements (tmsdisk._moments: the dtype, the square root kept for exp_avg_sq,
the stochastic rounding). Either way they are updated in fp32 by the same kernel.

save(directory) and load(directory) checkpoint the state without materializing it: bucket by bucket,
one host buffer at a time, each bucket's bytes read from the store to a file of its own, beside a
manifest.json (format, class, moment dtype, hyperparameters, bucket layout, step counts, each file's
SHA-256). Files are written under temporary names, fsynced and renamed, the manifest last; load()
refuses (ValueError) another layout or moment dtype, a missing file or a wrong hash before it writes
anything to the store. state_dict() and load_state_dict() are torch's, materialized.

A step opens every object it will write before it updates anything: a store that refuses one (over
the user's quota, EDQUOT) fails the step with the parameters untouched.

Between steps a pause of the process moves what is resident (parameters, gradients), never the
buckets: where libtmsdisk.so is loaded, each pause first waits for the write-backs and reads in
flight and drops every bucket buffer (tmsdisk.on_pause), then empties PyTorch's cache so that their
memory goes back to the driver (unless TMSDISK_TORCH_EMPTY_CACHE=0: the cache, and they with it, is
then paused as asked). The next step reads them back. An optimizer whose step runs on another thread
while the pause begins keeps its buckets, which the pause then moves.
"""

import errno
import inspect
import itertools
import json
import os
import re
import sys
import threading
import weakref
from collections import defaultdict
from itertools import chain

import torch

from . import store as _store_module
from ._buckets import _Bucket, _cut, _is_dtensor, _listed, _local, _placed_like, _probes, layout
from ._checkpoint_files import (CHECKPOINT_FORMAT, CHECKPOINT_MANIFEST, _check_file, _fsync_directory,
                                _layout_difference, _read_file, _read_manifest, _write_file)
from ._moments import (_PLAIN_MOMENTS, _SCALED_MOMENTS, MOMENT_BLOCK, BlockScaledMoments,  # noqa: F401 (tests)
                       _moment_conversion, _moments_of)
# _flush_live (what atexit runs) and _release_for_pause (what a pause runs first) are named here for the tests.
from ._residency import _drop_buckets_before_pauses, _flush_live, _live, _Pipeline, _release_for_pause  # noqa: F401

__all__ = ["MOMENT_BLOCK", "StreamedAdam", "StreamedAdamW"]

# --- the kernels -----------------------------------------------------------------------------------
# The function each torch class's step() calls, found once. torch 1.13 and 2.x keep it beside the class
# (torch.optim.adamw.adamw, torch.optim.adam.adam; torch.optim._functional re-exports them). Later
# torch made AdamW an Adam with decoupled weight decay: its step() calls adam() with that flag set,
# which the class's defaults (and so each param group) carry.
_ADAM = sys.modules[torch.optim.Adam.__module__].adam
_ADAMW = (_ADAM if "decoupled_weight_decay" in inspect.signature(_ADAM).parameters
          else sys.modules[torch.optim.AdamW.__module__].adamw)

# Options torch's classes accept that this module does not implement, with the reason given when one
# is set (to anything but False or None).
_UNSUPPORTED = (
    ("amsgrad", "the streamed state holds exp_avg and exp_avg_sq, not AMSGrad's max_exp_avg_sq"),
    ("capturable", "each step waits on the host for the store, which a CUDA graph cannot capture"),
    ("differentiable", "the state leaves autograd's graph when it is written to the store"),
)

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]+")
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
MASTER_KEY = "tmsdisk_master"  # state_dict: the fp32 master of a bf16 or fp16 parameter
MOMENT_DTYPE_KEY = "tmsdisk_moment_dtype"  # state_dict: the dtype of exp_avg and exp_avg_sq, as str()

MOMENT_STORAGE_KEY = "tmsdisk_moment_storage"  # state_dict: how block-scaled moments were kept (a dict)

_DTYPES_BY_NAME = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


# --- the optimizers --------------------------------------------------------------------------------

_names = weakref.WeakValueDictionary()  # object-name prefix -> the live optimizer using it
_serial = itertools.count()


class _StreamedAdamBase(torch.optim.Optimizer):
    """What StreamedAdam and StreamedAdamW share; they differ in the torch class they mirror."""

    _torch_class = None
    _kernel = None

    def __init__(self, params, torch_options, *, bucket_elements, depth, moment_dtype, store, name,
                 prefetch_on_backward):
        cls = type(self).__name__
        for flag, _ in _UNSUPPORTED:
            self._refuse(flag, torch_options.get(flag))
        self._check_fused_exists(torch_options.get("fused"))
        params = _listed(params)
        if not isinstance(bucket_elements, int) or bucket_elements < 1:
            raise ValueError("%s: bucket_elements must be a positive int, not %r" % (cls, bucket_elements))
        if not isinstance(depth, int) or depth < 1:
            raise ValueError("%s: depth must be a positive int (buckets in memory at once), not %r" % (cls, depth))
        moments = _moments_of(cls, moment_dtype)
        if name is None:
            name = "%s.%d.%d" % (cls, os.getpid(), next(_serial))
        if not isinstance(name, str) or not _NAME_CHARS.fullmatch(name):
            raise ValueError("%s: name %r: %s" % (cls, name, _store_module.NAME_RULE))
        if name in _names:
            raise ValueError("%s: name %r is used by another optimizer of this process" % (cls, name))
        self._name = name
        if store is None:
            store = _store_module
            # No session with the daemon is better said now than after the model is built and trained
            # up to the first step (chunk_bytes() opens the session, or raises saying how to get one).
            store.chunk_bytes()
        self._store = store
        self._moments = moments
        self._moment_dtype = moments.dtype
        self._generators = {}  # device -> the generator of its buckets' stochastic rounding
        self._bucket_elements = bucket_elements
        self._buckets = []  # per param group, its buckets in order
        self._pipeline = _Pipeline(self._store, depth, self._handle)
        self._lock = threading.RLock()  # gradient hooks may prefetch from autograd's threads
        self._prefetch_on_backward = prefetch_on_backward
        self._prefetch_armed = True
        self._hooks = []
        self._closed = False
        # torch's own class judges the numbers (its messages) and gives this torch's defaults: the keys
        # of each param group, so that state_dicts pass both ways. Its probe parameters are of the devices
        # and dtypes of ours, so that what it refuses for them (fused=True on a device without the fused
        # kernel, which torch 2.3 and earlier check here) is refused here, with torch's exception.
        # None stands for torch's default (fused: None in torch 2, False in 1.13's Adam).
        accepted = inspect.signature(self._torch_class.__init__).parameters
        probe = self._torch_class(_probes(params),
                                  **{k: v for k, v in torch_options.items() if k in accepted and v is not None})
        defaults = dict(probe.defaults)
        self._kernel_parameters = frozenset(inspect.signature(type(self)._kernel).parameters)
        super().__init__(params, defaults)
        _names[name] = self
        _live.add(self)
        _drop_buckets_before_pauses()

    # -- construction --------------------------------------------------------------------------------

    def _refuse(self, flag, value) -> None:
        why = dict(_UNSUPPORTED)[flag]
        if value:
            raise ValueError("%s: %s=%r is not implemented (%s); leave %s unset" % (
                type(self).__name__, flag, value, why, flag))

    def _check_fused_exists(self, fused) -> None:
        """fused=True where this torch's class has no fused kernel: TypeError, as torch's own constructor
        raises for an argument it does not take (torch 1.13's AdamW; its Adam has one, for CUDA)."""
        if not fused:
            return
        torch_class = self._torch_class
        if ("fused" not in inspect.signature(torch_class.__init__).parameters
                or "fused" not in inspect.signature(type(self)._kernel).parameters):
            raise TypeError("%s: fused=%r: this torch (%s) has no fused %s kernel: torch.optim.%s takes no fused "
                            "argument (PyTorch 2.0 or later has it); leave fused unset" % (
                                type(self).__name__, fused, torch.__version__, torch_class.__name__,
                                torch_class.__name__))

    def _check_group_options(self, group) -> None:
        """What a param group may not ask for, whether given to the constructor, add_param_group, or a
        loaded state: the unsupported flags, and fused=True where torch has no fused kernel for it."""
        for flag, _ in _UNSUPPORTED:
            self._refuse(flag, group.get(flag))
        fused = group.get("fused")
        self._check_fused_exists(fused)
        if not fused:
            return
        # torch 2.3 and earlier check the devices in the constructor, and only for its own arguments: its
        # class over probes of the group's parameters, with the group's fused and foreach.
        accepted = inspect.signature(self._torch_class.__init__).parameters
        self._torch_class(_probes(group["params"]), **{k: group[k] for k in ("fused", "foreach")
                                                      if k in accepted and group.get(k) is not None})
        # torch 2.4 and later check them at the first step (the CPU has the kernel there too): the same
        # check, with its message, before any state exists.
        check = getattr(sys.modules[torch.optim.Optimizer.__module__], "_device_dtype_check_for_fused", None)
        if check is not None:
            for p in group["params"]:
                check(_local(p))

    def add_param_group(self, param_group) -> None:
        group = param_group if isinstance(param_group, dict) else {"params": param_group}
        for flag, _ in _UNSUPPORTED:
            self._refuse(flag, group.get(flag))
        super().add_param_group(param_group)
        index = len(self._buckets)
        params = self.param_groups[-1]["params"]
        try:
            self._check_group_options(self.param_groups[-1])
            for p in params:
                if p.dtype not in _SUPPORTED_PARAM_DTYPES or p.is_sparse:
                    raise ValueError("%s: a parameter of dtype %s%s: only dense float32, bfloat16 and float16 "
                                     "parameters are supported" % (type(self).__name__, p.dtype,
                                                                   " (sparse)" if p.is_sparse else ""))
            before = sum(len(b) for b in self._buckets)
            buckets = _cut([_local(p) for p in params], self._bucket_elements,
                           lambda i, device: _Bucket("%s.%d.%d" % (self._name, index, i), index, before + i, device))
            for bucket in buckets:
                if len(bucket.name) > _store_module.NAME_MAX:
                    raise ValueError("%s: object name %r is too long: %s; give a shorter name=" % (
                        type(self).__name__, bucket.name, _store_module.NAME_RULE))
                bucket.seal(self._moments)
        except BaseException:
            self.param_groups.pop()
            raise
        self._buckets.append(buckets)
        if self._prefetch_on_backward:
            self._hook(params)

    def _hook(self, params) -> None:
        ref = weakref.ref(self)

        def on_gradient(_grad):
            opt = ref()
            if opt is not None and opt._prefetch_armed:
                opt._prefetch_from_backward()

        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_hook(on_gradient))

    def _handle(self, bucket) -> int:
        """The bucket's store handle, its object created on first use. An object of the same name and
        another size is a leftover of an earlier optimizer of this process that was not closed (no live
        one has this name): it is removed and made again, since this optimizer starts from zero."""
        if bucket.handle is None:
            try:
                bucket.handle = self._store.open(bucket.name, bucket.nbytes)
            except OSError as e:
                if e.errno != errno.EEXIST:
                    raise
                self._store.remove(bucket.name)
                bucket.handle = self._store.open(bucket.name, bucket.nbytes)
        return bucket.handle

    def __getstate__(self):
        raise TypeError("%s cannot be pickled or copied: its state is in the store; use state_dict()"
                        % type(self).__name__)

    # -- the step ------------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("%s %r is closed" % (type(self).__name__, self._name))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure()'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        cls = type(self).__name__
        with self._lock:
            self._check_usable()
            self._prefetch_armed = True
            before = {}  # parameter with a gradient -> (its step count before this step, first step?)
            work = []
            for group, buckets in zip(self.param_groups, self._buckets):
                with_grad = set()
                for index, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("%s does not support sparse gradients" % cls)
                    local = _local(p)
                    if not local.is_contiguous():
                        raise ValueError("%s: a parameter of shape %s is not contiguous: the state is kept in "
                                         "its flat element order" % (cls, tuple(local.shape)))
                    if _local(p.grad).numel() != local.numel():
                        raise ValueError("%s: a DTensor parameter's gradient is placed otherwise (%s, the "
                                         "parameter %s): the step updates this rank's shard from its own "
                                         "elements and gathers nothing" % (
                                             cls, getattr(p.grad, "placements", None), getattr(p, "placements", None)))
                    step = self.state[p].get("step")
                    before[p] = (self._step_tensor(step, local.device, group.get("fused")), step is None)
                    with_grad.add(index)
                work += [b for b in buckets if any(s.param in with_grad for s in b.segments)]
            after = {}  # parameter -> its count, counted up by the kernel (in place: _update)
            try:
                self._pipeline.run(work, lambda b, buffer: self._update(b, buffer, before, after), read=True,
                                   write=True)
            except BaseException:
                for count in after.values():  # a step that failed counts for nothing: the counts as they were
                    count.sub_(1)
                raise
            for p, (step, _) in before.items():
                if p not in after:  # no elements, so in no bucket
                    after[p] = step
                    step += 1
                self.state[p]["step"] = after[p]
        return loss

    @staticmethod
    def _step_tensor(step, device, fused):
        """The step count a parameter on `device` steps with: a new one (None) as torch's class starts it,
        or the one it has, moved to the device for the fused kernel as torch's load_state_dict moves it.

        torch keeps it on the host, except for capturable (refused) and fused, where the kernel reads it on
        the device: a 0-d float32 tensor there (torch 2; 1.13's fused Adam made it of shape (1,))."""
        scalar_dtype = getattr(sys.modules[torch.optim.Optimizer.__module__], "_get_scalar_dtype", None)
        if fused:
            if step is None:
                shape = (1,) if torch.__version__.split(".")[0] == "1" else ()
                return torch.zeros(shape, dtype=torch.float32, device=device)
            return step.to(dtype=torch.float32, device=device)
        if step is not None:
            return step
        return torch.tensor(0.0, dtype=scalar_dtype()) if scalar_dtype else torch.tensor(0.0)

    def _kernel_options(self, group) -> dict:
        options = {k: group[k] for k in self._kernel_parameters if k in group and k != "params"}
        options["beta1"], options["beta2"] = group["betas"]
        if options.get("foreach") is None and not options.get("fused") and any(map(_is_dtensor, group["params"])):
            # The kernel picks foreach or the loop from the tensors it is given, plain shards here; torch's
            # class gives it the DTensors, which torch may judge otherwise: its choice, made for them.
            default = getattr(sys.modules[torch.optim.Optimizer.__module__], "_default_to_fused_or_foreach", None)
            if default is not None and "foreach" in options:
                options["foreach"] = default([p for p in group["params"] if p.grad is not None], False, False)[1]
        for absent in ("grad_scale", "found_inf"):
            if absent in self._kernel_parameters:
                options[absent] = None
        if "has_complex" in self._kernel_parameters:
            options["has_complex"] = False
        return options

    def _update(self, bucket, buffer, before, after) -> None:
        """Bucket `bucket` (in `buffer`) through torch's kernel, for its slices that have gradients.

        Each slice starts from its parameter's step count before the step: the kernel counts it up once
        per slice, and a parameter spanning buckets must end one step further, not several.
        """
        group = self.param_groups[bucket.group]
        sections = bucket.views(buffer, self._moments)
        master = sections.master
        # Narrow moments are updated in fp32, as the kernel needs one dtype for a parameter and its state:
        # bf16 widened, fp8 scaled back (fp32 ones are updated in place).
        exp_avg32, exp_avg_sq32 = self._moments.working(sections)
        params, grads, exp_avgs, exp_avg_sqs, steps, copy_back, counted = [], [], [], [], [], [], []
        for seg in bucket.segments:
            p = group["params"][seg.param]
            entry = before.get(p)
            if entry is None:
                continue
            step, first = entry
            # Counted up in place by the kernel, once per slice, as torch's counts the state's: a later
            # slice of a parameter spanning buckets starts from the count before the step again. No
            # tensor is made per slice (with fused=True they are device memory, and a step's device
            # memory is its buckets'). In `after` while counted up once, for step() to undo on failure.
            if after.pop(p, None) is not None:
                step.sub_(1)
            counted.append((p, step))
            n = seg.stop - seg.start
            flat = _local(p).detach().view(-1)[seg.start : seg.stop]
            grad = _local(p.grad).detach().reshape(-1)[seg.start : seg.stop]
            m = exp_avg32[seg.offset : seg.offset + n]
            v = exp_avg_sq32[seg.offset : seg.offset + n]
            if first:  # torch starts a parameter's moments at zero on its first step
                m.zero_()
                v.zero_()
            if seg.master is not None:
                master_slice = master[seg.master : seg.master + n]
                if first:
                    master_slice.copy_(flat)
                copy_back.append((flat, master_slice))
                flat, grad = master_slice, grad.float()
            params.append(flat)
            grads.append(grad)
            exp_avgs.append(m)
            exp_avg_sqs.append(v)
            steps.append(step)
        type(self)._kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, **self._kernel_options(group))
        after.update(counted)
        for param_slice, master_slice in copy_back:
            param_slice.copy_(master_slice)
        # A block holding slices without gradients is rounded again as well; rounding values that are on
        # the grid already changes them only where the block's scale moved, by less than a step.
        self._moments.store(sections, exp_avg32, exp_avg_sq32,
                            self._rounding(bucket, max(float(s) for s in steps), buffer.device))

    def _rounding(self, bucket, step, device):
        """The generator of the bucket's stochastic rounding at `step`, seeded for it (None: no rounding
        drawn for these moments)."""
        seed = self._moments.seed(bucket.index, step)
        if seed is None:
            return None
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed(seed)
        return generator

    # -- prefetch and flush --------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Starts reading the first buckets of the next step (depth-1 of them), e.g. during backward."""
        with self._lock:
            self._check_usable()
            self._prefetch_armed = False
            first = [b for buckets in self._buckets for b in buckets if b.written][: self._pipeline.depth - 1]
            for bucket in first:
                self._pipeline.fetch(bucket, read=True, pin=False)

    def _prefetch_from_backward(self) -> None:
        with self._lock:
            if self._prefetch_armed and not self._closed:
                self.prefetch()

    def flush(self) -> None:
        """Waits for every write-back (and read) in flight and lets go of the buckets in memory; raises
        the first error among them (tmsdisk.Error), or one met by a pause's release of them."""
        with self._lock:
            self._pipeline.drain()

    synchronize = flush

    def close(self) -> None:
        """Flushes, removes this optimizer's objects from the store and its gradient hooks. The
        optimizer cannot be used after."""
        with self._lock:
            if self._closed:
                return
            self._pipeline.drain()
            for bucket in chain.from_iterable(self._buckets):
                if bucket.handle is not None:
                    self._store.remove(bucket.name)
                    bucket.handle, bucket.written = None, False
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._closed = True
            _live.discard(self)
            if _names.get(self._name) is self:
                del _names[self._name]

    # -- state dicts ---------------------------------------------------------------------------------

    def state_dict(self):
        """torch.optim.AdamW's (Adam's) state_dict, materialized: per parameter index, `step`, `exp_avg`
        and `exp_avg_sq` as full tensors on the parameter's device, and for a bf16 or fp16 parameter its
        fp32 master as `tmsdisk_master`; the moments' dtype under the key `tmsdisk_moment_dtype`. For a
        DTensor parameter (FSDP2) the tensors are what torch's are: DTensors on the parameter's mesh with
        its placements, each holding this rank's shard; `step` is a plain tensor, as torch's.
        Block-scaled (fp8) moments are given as the values they stand for, in fp32 (exp_avg_sq squared
        back), so `tmsdisk_moment_dtype` is torch.float32 and `tmsdisk_moment_storage` says how they were
        kept: {"dtype": "torch.float8_e4m3fn", "moment_block": 128, "exp_avg_sq_stored_as": "sqrt"}.

        It holds all the state in memory at once, which streaming is there to avoid: save(directory) and
        load(directory) stream it bucket by bucket instead. torch's own load_state_dict takes it
        (casting the moments to each parameter's dtype, as it always does).
        """
        with self._lock:
            self._check_usable()
            self._pipeline.drain()
            out = {}
            for group in self.param_groups:
                for p in group["params"]:
                    step = self.state[p].get("step") if p in self.state else None
                    if step is None or p in out:
                        continue
                    local = _local(p)
                    entry = {"step": step.clone()}
                    for key in _MOMENT_KEYS:
                        entry[key] = torch.zeros(local.shape, dtype=self._moments.state_dtype, device=local.device)
                    if p.dtype != torch.float32:
                        entry[MASTER_KEY] = torch.empty(local.shape, dtype=torch.float32, device=local.device)
                    out[p] = entry

            def copy_out(bucket, buffer):
                sections = bucket.views(buffer, self._moments)
                master = sections.master
                exp_avg, exp_avg_sq = self._moments.stored(sections)
                params = self.param_groups[bucket.group]["params"]
                for seg in bucket.segments:
                    entry = out.get(params[seg.param])
                    if entry is None:
                        continue
                    n = seg.stop - seg.start
                    entry["exp_avg"].view(-1)[seg.start : seg.stop].copy_(exp_avg[seg.offset : seg.offset + n])
                    entry["exp_avg_sq"].view(-1)[seg.start : seg.stop].copy_(exp_avg_sq[seg.offset : seg.offset + n])
                    if seg.master is not None:
                        entry[MASTER_KEY].view(-1)[seg.start : seg.stop].copy_(master[seg.master : seg.master + n])

            needed = [b for buckets, group in zip(self._buckets, self.param_groups) for b in buckets
                      if b.written and any(group["params"][s.param] in out for s in b.segments)]
            self._pipeline.run(needed, copy_out, read=True, write=False)
            self._pipeline.drain()  # a state_dict is no step: its buckets need not stay
            # torch's own packing numbers the parameters and copies the groups; its state holds only the
            # step counts, replaced here.
            packed = super().state_dict()
            indexes = {}
            for group, saved in zip(self.param_groups, packed["param_groups"]):
                for p, i in zip(group["params"], saved["params"]):
                    indexes.setdefault(p, i)
            packed["state"] = {indexes[p]: {k: v if k == "step" else _placed_like(v, p) for k, v in entry.items()}
                               for p, entry in out.items()}
            packed[MOMENT_DTYPE_KEY] = str(self._moments.state_dtype)
            if self._moments.block is not None:
                packed[MOMENT_STORAGE_KEY] = dict(self._moments.describe(), dtype=str(self._moment_dtype))
            return packed

    def load_state_dict(self, state_dict) -> None:
        """Takes a state_dict of this class or of torch.optim.AdamW (Adam), and writes it to the store.

        Moments are converted explicitly, never reinterpreted: the same dtype as is; bf16 or fp16
        moments (torch's, for bf16 or fp16 parameters) widened to fp32 exactly; fp32 moments rounded to
        bf16 when this optimizer keeps bf16 moments; fp32, bf16 or fp16 moments rounded to nearest in
        their blocks when it keeps fp8 ones (an fp8 optimizer's state_dict, fp32, comes back as it was
        stored, and goes into an fp32 or bf16 optimizer as fp32 moments would). Any other pair raises
        ValueError naming both dtypes, as does a state_dict whose `tmsdisk_moment_dtype` disagrees with its tensors. Without a
        `tmsdisk_master` (torch's state_dicts) a non-fp32 parameter's master is its current value.
        """
        cls = type(self).__name__
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        declared = state_dict.get(MOMENT_DTYPE_KEY)
        if declared is not None:
            declared = _DTYPES_BY_NAME.get(str(declared), declared)
        id_map = dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            new = dict(saved)
            new["params"] = group["params"]
            for key, value in self.defaults.items():
                new.setdefault(key, value)
            self._check_group_options(new)
            new_groups.append(new)
        fused = {p: new.get("fused") for new in new_groups for p in new["params"]}

        def shard(t, p, key, index):
            """A DTensor parameter's state is a DTensor (torch's, or this class's state_dict): its local shard
            is this rank's, of the parameter's local shape when both are placed alike."""
            if _is_dtensor(p) and not _is_dtensor(t):
                raise ValueError("%s.load_state_dict: %s of parameter %r is a plain tensor and the parameter a "
                                 "DTensor: give the state as torch.optim keeps it for DTensors, DTensors placed as the "
                                 "parameters (a full tensor is not sharded here)" % (cls, key, index))
            return _local(t)

        loaded = {}  # parameter -> (step, {key: tensor}, master or None)
        for index, saved in state_dict["state"].items():
            p = id_map.get(index)
            if p is None:
                continue
            local = _local(p)
            missing = [k for k in ("step",) + _MOMENT_KEYS if k not in saved]
            if missing:
                raise ValueError("%s.load_state_dict: the state of parameter %r has no %s" % (
                    cls, index, ", ".join(missing)))
            moments = {}
            for key in _MOMENT_KEYS:
                t = shard(saved[key], p, key, index)
                if declared is not None and t.dtype != declared:
                    raise ValueError("%s.load_state_dict: the state dict declares %s moments but %s of parameter %r "
                                     "is %s: its bytes are not read as another dtype" % (
                                         cls, declared, key, index, t.dtype))
                if _moment_conversion(t.dtype, self._moment_dtype) is None:
                    raise ValueError("%s.load_state_dict: %s of parameter %r is %s and this optimizer keeps %s "
                                     "moments: no conversion between them is done; construct it with "
                                     "moment_dtype=%s" % (cls, key, index, t.dtype, self._moment_dtype,
                                                          t.dtype if t.dtype in _PLAIN_MOMENTS else "torch.float32"))
                if t.numel() != local.numel():
                    raise ValueError("%s.load_state_dict: %s of parameter %r has %d elements, the parameter %d" % (
                        cls, key, index, t.numel(), local.numel()))
                moments[key] = t
            master = saved.get(MASTER_KEY)
            if p.dtype == torch.float32:
                master = None
            elif master is not None:
                master = shard(master, p, MASTER_KEY, index)
                if master.dtype != torch.float32 or master.numel() != local.numel():
                    raise ValueError("%s.load_state_dict: %s of parameter %r must be float32 with %d elements, not "
                                     "%s with %d" % (cls, MASTER_KEY, index, local.numel(), master.dtype,
                                                     master.numel()))
            step = saved["step"]
            step = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
            loaded[p] = (self._step_tensor(step, local.device, fused[p]), moments, master)

        def fill(bucket, buffer):
            buffer.zero_()
            sections = bucket.views(buffer, self._moments)
            master = sections.master
            exp_avg, exp_avg_sq = self._moments.blank(sections)
            params = self.param_groups[bucket.group]["params"]
            for seg in bucket.segments:
                p = params[seg.param]
                entry = loaded.get(p)
                if entry is None:
                    continue
                _, saved_moments, saved_master = entry
                at, n = seg.offset, seg.stop - seg.start
                exp_avg[at : at + n].copy_(saved_moments["exp_avg"].reshape(-1)[seg.start : seg.stop])
                exp_avg_sq[at : at + n].copy_(saved_moments["exp_avg_sq"].reshape(-1)[seg.start : seg.stop])
                if seg.master is not None:
                    source = _local(p).detach() if saved_master is None else saved_master
                    master[seg.master : seg.master + n].copy_(source.reshape(-1)[seg.start : seg.stop])
            self._moments.store(sections, exp_avg, exp_avg_sq)  # to nearest: no update, nothing to follow

        with self._lock, torch.no_grad():
            self._check_usable()
            self._pipeline.drain()
            work = []
            for group, buckets in zip(groups, self._buckets):
                for bucket in buckets:
                    if any(group["params"][s.param] in loaded for s in bucket.segments):
                        work.append(bucket)
                    else:
                        bucket.written = False  # no state: the next step starts it from zero, unread
            self._pipeline.run(work, fill, read=False, write=True)
            self.param_groups = new_groups
            self.state = defaultdict(dict)
            for p, (step, _, _) in loaded.items():
                self.state[p]["step"] = step


    # -- streaming checkpoints ------------------------------------------------------------------------

    def _layout(self) -> dict:
        """What a checkpoint's files must fit (_buckets.layout)."""
        return layout(self.param_groups, self._buckets, self._bucket_elements, self._moments)

    def save(self, directory) -> None:
        """Writes the state to `directory` (made if absent) bucket by bucket: each bucket's bytes are read
        from the store into one host buffer and written to a file of its own, so no more than one bucket
        is in host memory at once; then a manifest, CHECKPOINT_MANIFEST, with the layout, the moments'
        dtype, each group's hyperparameters, the step counts and each file's SHA-256.

        Waits for the write-backs in flight first. The files are written under temporary names, fsynced
        and renamed, the manifest last: a crash leaves the previous checkpoint in `directory` whole. The
        files of the previous checkpoint go once the new manifest is in place. Parameters are not saved.
        """
        cls = type(self).__name__
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        with self._lock:
            self._check_usable()
            self._pipeline.drain()
            generation = "%d-%d-%s" % (os.getpid(), next(_serial), os.urandom(4).hex())
            written = []
            files = []
            try:
                for g, buckets in enumerate(self._buckets):
                    group_files = []
                    for k, bucket in enumerate(buckets):
                        if not bucket.written:
                            group_files.append(None)  # no state yet: the next step starts it from zero
                            continue
                        host = torch.empty(bucket.nbytes, dtype=torch.uint8)
                        self._store.read(self._handle(bucket), 0, host).wait()
                        name = "%s.%d.%d.bucket" % (generation, g, k)
                        digest = _write_file(directory, name, host.numpy())
                        written.append(name)
                        del host
                        group_files.append({"file": name, "sha256": digest})
                    files.append(group_files)
                steps = []
                for group in self.param_groups:
                    for p in group["params"]:
                        step = self.state[p].get("step") if p in self.state else None
                        steps.append(None if step is None else float(step))
                manifest = {
                    "format": CHECKPOINT_FORMAT,
                    "class": cls,
                    "moment_dtype": str(self._moment_dtype),
                    **self._moments.describe(),  # fp8: the block size, and exp_avg_sq kept as its root
                    "layout": self._layout(),
                    "param_groups": [{k: (list(v) if isinstance(v, tuple) else v)
                                      for k, v in group.items() if k != "params"} for group in self.param_groups],
                    "steps": steps,
                    "files": files,
                }
                text = json.dumps(manifest, indent=1, sort_keys=True).encode()
                _fsync_directory(directory)  # the bucket files' names before the manifest naming them
                _write_file(directory, CHECKPOINT_MANIFEST, memoryview(text))
            except BaseException:
                for name in written:
                    try:
                        os.unlink(os.path.join(directory, name))
                    except OSError:
                        pass
                raise
            keep = set(written) | {CHECKPOINT_MANIFEST}
            for name in os.listdir(directory):  # the previous checkpoint's files, and a crashed save's
                if name not in keep and (name.endswith(".bucket") or name.endswith(".tmp")):
                    try:
                        os.unlink(os.path.join(directory, name))
                    except OSError:
                        pass
            _fsync_directory(directory)

    def load(self, directory) -> None:
        """Restores a checkpoint save() wrote into this optimizer, built over the same parameters (shapes,
        dtypes, groups) with the same bucket_elements and moment_dtype: each file is read into one host
        buffer and written to the store, bucket by bucket. Refuses with ValueError, before anything is
        written to the store, a manifest of another format, class, layout or moment dtype, a missing
        file, or a file whose SHA-256 is not the manifest's (each file is hashed once before and again as
        it is loaded). The hyperparameters and step counts are the checkpoint's; parameters are not in it.
        """
        cls = type(self).__name__
        directory = os.fspath(directory)
        manifest = _read_manifest(cls, directory)
        if manifest.get("moment_dtype") != str(self._moment_dtype):
            theirs = manifest.get("moment_dtype")
            missing = isinstance(theirs, str) and not hasattr(torch, theirs[len("torch."):])
            raise ValueError("%s.load: the checkpoint keeps %s moments and this optimizer %s: no conversion is "
                             "done; %s, or load that optimizer's state_dict(), which converts" % (
                                 cls, theirs, self._moment_dtype,
                                 "this torch (%s) has no %s" % (torch.__version__, theirs) if missing
                                 else "construct it with moment_dtype=%s" % theirs))
        for key, mine in self._moments.describe().items():
            if manifest.get(key) != mine:
                raise ValueError("%s.load: the checkpoint's %s is %r, this optimizer's %r" % (
                    cls, key, manifest.get(key), mine))
        mine, theirs = self._layout(), manifest.get("layout")
        if theirs != mine:
            raise ValueError("%s.load: the checkpoint's layout differs: %s" % (cls, _layout_difference(theirs, mine)))
        files = manifest["files"]
        nparams = sum(len(g["params"]) for g in self.param_groups)
        if (len(files) != len(self._buckets) or any(len(f) != len(b) for f, b in zip(files, self._buckets))
                or len(manifest["steps"]) != nparams or len(manifest["param_groups"]) != len(self.param_groups)):
            raise ValueError("%s.load: the manifest's files, steps or groups do not match its layout" % cls)
        for g, buckets in enumerate(self._buckets):  # everything checked before the store is touched
            for k, bucket in enumerate(buckets):
                entry = files[g][k]
                if entry is not None:
                    _check_file(cls, directory, entry, bucket.nbytes, "bucket %d of group %d" % (k, g))
        new_groups = []
        for group, saved in zip(self.param_groups, manifest["param_groups"]):
            new = dict(group)
            for key, value in saved.items():
                new[key] = tuple(value) if isinstance(value, list) else value
            self._check_group_options(new)
            new_groups.append(new)
        with self._lock, torch.no_grad():
            self._check_usable()
            self._pipeline.drain()  # what is in memory is of the state being replaced
            for g, buckets in enumerate(self._buckets):
                for bucket in buckets:
                    self._handle(bucket)  # every object opened (EDQUOT) before one is written
            for g, buckets in enumerate(self._buckets):
                for k, bucket in enumerate(buckets):
                    entry = files[g][k]
                    if entry is None:
                        bucket.written = False
                        continue
                    host = torch.empty(bucket.nbytes, dtype=torch.uint8)
                    _read_file(cls, directory, entry, host.numpy(), "bucket %d of group %d" % (k, g))
                    bucket.written = False
                    self._store.write(self._handle(bucket), 0, host).wait()
                    bucket.written = True
                    del host
            self.param_groups = new_groups
            self.state = defaultdict(dict)
            params = [(p, g.get("fused")) for g in self.param_groups for p in g["params"]]
            for (p, fused), step in zip(params, manifest["steps"]):
                if step is not None:
                    t = self._step_tensor(None, _local(p).device, fused)
                    t.fill_(step)
                    self.state[p]["step"] = t


class StreamedAdamW(_StreamedAdamBase):
    """torch.optim.AdamW with its state in tmsdiskd's store, streamed through the step (see the module).

    Takes torch.optim.AdamW's arguments; amsgrad, capturable and differentiable are refused when set.
    fused=True takes torch's fused kernel where torch.optim.AdamW has it for the parameters' device (PyTorch
    2.0 on CUDA, 2.4 on the CPU), and is refused where it has not, with the exception torch raises: TypeError
    where this torch's AdamW takes no fused (1.13), else torch's own RuntimeError. Beyond them:
      bucket_elements: the most elements of one bucket (one store object, one read, one write)
      depth: the most buckets in memory at once (>= 3 overlaps a read, an update and a write)
      moment_dtype: torch.float32, or torch.bfloat16 to store the moments in half the bytes, or
          torch.float8_e4m3fn (PyTorch 2.1 or later) in a quarter: one byte per element and one fp32 scale per
          MOMENT_BLOCK elements, exp_avg_sq kept as its square root, rounded stochastically (tmsdisk._moments
          says why). Updated in fp32 all the same; the masters of bf16 and fp16 parameters stay fp32. Also
          by name: "fp32", "bf16", "fp8".
      store: the store (default tmsdisk.store: this process must run under `tmsctl run`)
      name: the prefix of the store objects' names, NAME.GROUP.BUCKET (default: unique in the process)
      prefetch_on_backward: the first gradient hook of each backward calls prefetch()
    Memory beyond the parameters: depth buckets, plus an fp32 copy of a bucket's moments while it is
    updated when they are not fp32 (with fp8, a few 64 MiB temporaries besides), and of a slice's
    gradient when its parameter is not fp32.
    """

    _torch_class = torch.optim.AdamW
    _kernel = staticmethod(_ADAMW)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 bucket_elements=200_000_000, depth=3, moment_dtype=torch.float32, store=None, name=None,
                 prefetch_on_backward=False):
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                 foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused),
            bucket_elements=bucket_elements, depth=depth, moment_dtype=moment_dtype, store=store, name=name,
            prefetch_on_backward=prefetch_on_backward)


class StreamedAdam(_StreamedAdamBase):
    """torch.optim.Adam with its state in tmsdiskd's store, streamed through the step; arguments as
    StreamedAdamW's, weight_decay being Adam's (L2, added to the gradient; default 0)."""

    _torch_class = torch.optim.Adam
    _kernel = staticmethod(_ADAM)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 bucket_elements=200_000_000, depth=3, moment_dtype=torch.float32, store=None, name=None,
                 prefetch_on_backward=False):
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                 foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused),
            bucket_elements=bucket_elements, depth=depth, moment_dtype=moment_dtype, store=store, name=name,
            prefetch_on_backward=prefetch_on_backward)
