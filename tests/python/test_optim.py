# SPDX-License-Identifier: Apache-2.0
"""Tests of tmsdisk.optim (StreamedAdamW, StreamedAdam) against torch.optim's own AdamW and Adam.

On an in-memory store (FakeStore) that performs each read and write only when its ticket is waited
for, so an optimizer that touches a buffer before the store is done with it gets wrong numbers. The
store the cases use is make_store: swapping it for the real one (tmsdisk.store, under `tmsctl run` on
simcuda) is that one line. Recording wraps any store to log the order of operations.

    /usr/bin/python3 test_optim.py          (needs torch: Debian's python3-torch; exit 77 without it)

CTest passes PYTHON_DIR, the build's copy of the tmsdisk package; run by hand, the source tree's is used.
TEST_OPTIM_DEVICE=cuda puts the parameters on the GPU (default: cpu).
"""

import errno
import inspect
import os
import shutil
import sys
import tempfile
import unittest
import weakref

try:
    import torch
except ImportError:
    print("SKIPPED: %s has no torch (Debian's python3-torch provides it)" % sys.executable)
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("PYTHON_DIR") or os.path.join(HERE, "..", "..", "python"))

import tmsdisk  # noqa: E402  (after the path is set)
from tmsdisk import optim  # noqa: E402
from tmsdisk.optim import StreamedAdam, StreamedAdamW  # noqa: E402

STEPS = 20
DEVICE = torch.device(os.environ.get("TEST_OPTIM_DEVICE", "cpu"))


class FakeTicket:
    def __init__(self, store, op):
        self.store, self.op = store, op
        self.rc = None

    @property
    def done(self):
        return self.rc is not None

    def wait(self):
        if self.rc is None:
            self.store.perform_through(self.op)
        if self.rc:
            raise tmsdisk.Error(self.rc, "fake wait(%s %s)" % (self.op["kind"], self.op["name"]))


class FakeStore:
    """tmsdisk.store's API in memory. Operations queue in order and are performed, in that order, up to
    the one whose ticket is waited for (flush: all of them): a read sees every write queued before it,
    and the bytes move only at wait time, as late as the real store may move them."""

    CHUNK = 4096

    def __init__(self):
        self.objects = {}  # name -> uint8 tensor
        self.written = {}  # name -> bool tensor: which bytes were ever written
        self.names = {}  # handle -> name
        self.queue = []
        self.next_handle = 1

    def chunk_bytes(self):
        return self.CHUNK

    def open(self, name, nbytes):
        if not isinstance(name, str) or not 1 <= len(name) <= 127 or not optim._NAME_CHARS.fullmatch(name):
            raise tmsdisk.Error(errno.EINVAL, "fake open(%r)" % (name,))
        if name in self.objects:
            if self.objects[name].numel() != nbytes:
                raise tmsdisk.Error(errno.EEXIST, "fake open(%r, %d)" % (name, nbytes))
        else:
            self.objects[name] = torch.zeros(nbytes, dtype=torch.uint8)
            self.written[name] = torch.zeros(nbytes, dtype=torch.bool)
        for handle, known in self.names.items():
            if known == name:
                return handle
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.names[handle] = name
        return handle

    def remove(self, name):
        if name not in self.objects:
            raise tmsdisk.Error(errno.ENOENT, "fake remove(%r)" % (name,))
        assert not any(op["name"] == name for op in self.queue), "removed %s with operations queued" % name
        del self.objects[name], self.written[name]
        self.names = {h: n for h, n in self.names.items() if n != name}

    def _queue(self, kind, handle, offset, memory, nbytes):
        name = self.names[handle]
        if nbytes is None:
            nbytes = memory.numel() * memory.element_size()
        assert memory.is_contiguous()
        if offset % self.CHUNK or offset + nbytes > self.objects[name].numel():
            raise tmsdisk.Error(errno.EINVAL, "fake %s(%s, %d, %d)" % (kind, name, offset, nbytes))
        op = dict(kind=kind, name=name, offset=offset, memory=memory, nbytes=nbytes)
        op["ticket"] = FakeTicket(self, op)
        self.queue.append(op)
        return op["ticket"]

    def write(self, handle, offset, src, nbytes=None, *, stream=None):
        return self._queue("write", handle, offset, src, nbytes)

    def read(self, handle, offset, dst, nbytes=None, *, stream=None):
        return self._queue("read", handle, offset, dst, nbytes)

    def prefetch(self, handle, offset, nbytes):
        assert offset + nbytes <= self.objects[self.names[handle]].numel()

    def perform_through(self, target):
        while target["ticket"].rc is None:
            op = self.queue.pop(0)
            data = self.objects[op["name"]]
            at, n = op["offset"], op["nbytes"]
            memory = op["memory"].view(-1).view(torch.uint8)[:n]
            if op["kind"] == "write":
                data[at : at + n].copy_(memory)
                self.written[op["name"]][at : at + n] = True
                op["ticket"].rc = 0
            elif not bool(self.written[op["name"]][at : at + n].all()):
                op["ticket"].rc = errno.ENODATA
            else:
                memory.copy_(data[at : at + n])
                op["ticket"].rc = 0
            op["memory"] = None  # the real store lets go of the memory once done too

    def flush(self):
        if self.queue:
            self.perform_through(self.queue[-1])

    def stored_bytes(self):
        return sum(t.numel() for t in self.objects.values())


# The store every case runs on: the one line to change for a run on the real store.
make_store = FakeStore


class Recording:
    """Any store, with the order of its operations logged in `events` (shared with the optimizer's own
    entries, see watch())."""

    def __init__(self, inner):
        self.inner = inner
        self.events = []
        self.names = {}

    def chunk_bytes(self):
        return self.inner.chunk_bytes()

    def open(self, name, nbytes):
        handle = self.inner.open(name, nbytes)
        self.names[handle] = name
        return handle

    def remove(self, name):
        self.events.append(("remove", name))
        self.inner.remove(name)

    def _ticket(self, kind, handle, ticket):
        name = self.names[handle]
        self.events.append((kind, name))
        events, inner_wait = self.events, ticket.wait

        class Ticket:
            def wait(self):
                events.append(("wait-" + kind, name))
                inner_wait()

        return Ticket()

    def write(self, handle, offset, src, nbytes=None, *, stream=None):
        return self._ticket("write", handle, self.inner.write(handle, offset, src, nbytes, stream=stream))

    def read(self, handle, offset, dst, nbytes=None, *, stream=None):
        return self._ticket("read", handle, self.inner.read(handle, offset, dst, nbytes, stream=stream))

    def prefetch(self, handle, offset, nbytes):
        self.events.append(("prefetch", self.names[handle]))
        self.inner.prefetch(handle, offset, nbytes)

    def flush(self):
        self.inner.flush()


def watch(opt, store):
    """Logs each bucket's update in store.events and counts the bucket buffers alive (store.live, the
    most at once in store.most_live, checked at each buffer made and each update)."""
    store.live, store.most_live = 0, 0
    new_buffer, update = opt._pipeline.new_buffer, opt._update

    def gone():
        store.live -= 1

    def counted_buffer(bucket):
        buffer = new_buffer(bucket)
        store.live += 1
        store.most_live = max(store.most_live, store.live)
        weakref.finalize(buffer, gone)
        return buffer

    def logged_update(bucket, buffer, before, after):
        store.events.append(("update", bucket.name))
        store.most_live = max(store.most_live, store.live)
        update(bucket, buffer, before, after)

    opt._pipeline.new_buffer = counted_buffer
    opt._update = logged_update


SHAPES = [(33, 17), (7,), (5, 4, 3), (1,), (257,), (16, 16)]


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=DEVICE, dtype=dtype).requires_grad_() for s in shapes]


def clones(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def groups_of(params, split=None):
    """Two param groups with their own lr and weight decay (split: where the second begins)."""
    split = len(params) // 2 if split is None else split
    return [{"params": params[:split]}, {"params": params[split:], "lr": 3e-3, "weight_decay": 0.2}]


class Trainer:
    """Gives both optimizers the same gradients, skips some parameters now and then (no gradient, so no
    update and no step count), and changes lr and weight decay midway."""

    def __init__(self, seed=1):
        self.gen = torch.Generator().manual_seed(seed)
        self.t = 0

    def step(self, pairs, grad_dtype=None):
        """pairs: [(optimizer, params)]; every optimizer gets the same gradients."""
        self.t += 1
        shapes = [p.shape for p in pairs[0][1]]
        grads = [torch.randn(s, generator=self.gen) * (1 + i) for i, s in enumerate(shapes)]
        if grad_dtype is not None:
            grads = [g.to(grad_dtype) for g in grads]
        skipped = {self.t % len(shapes)} if self.t % 4 == 0 else set()
        for opt, params in pairs:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i in skipped else g.to(device=p.device, dtype=p.dtype).clone()
            if self.t == STEPS // 2:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
                    group["weight_decay"] = group["weight_decay"] + 0.05
            opt.step()


class OptimTestCase(unittest.TestCase):
    def assertBitEqual(self, ours, theirs, what):
        self.assertEqual(ours.dtype, theirs.dtype, what)
        self.assertEqual(ours.shape, theirs.shape, what)
        if not torch.equal(ours, theirs):
            self.fail("%s differs: max |diff| %g" % (what, (ours.double() - theirs.double()).abs().max().item()))

    def assertSameState(self, ours, theirs, master_of=None):
        """The state dicts of two optimizers hold the same numbers for the same parameters."""
        self.assertEqual(sorted(ours["state"]), sorted(theirs["state"]))
        for index, entry in theirs["state"].items():
            mine = ours["state"][index]
            self.assertBitEqual(mine["step"], entry["step"], "step of %d" % index)
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertBitEqual(mine[key], entry[key], "%s of %d" % (key, index))
        self.assertEqual([{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]],
                         [{k: v for k, v in g.items() if k != "params"} for g in theirs["param_groups"]])


    def run_pair(self, ours_class, torch_class, bucket_elements, depth=3, foreach=None, **options):
        """Both classes over the same parameters and gradients for STEPS steps: bit-identical parameters
        and state. Options torch's class does not take (fused=False in torch 1.13's AdamW), and None (torch's
        default, which ours stands for by it), go to ours only."""
        params, reference = make_params(), make_params()
        store = make_store()
        ours = ours_class(groups_of(params), lr=1e-2, bucket_elements=bucket_elements, depth=depth, store=store,
                          foreach=foreach, **options)
        accepted = inspect.signature(torch_class.__init__).parameters
        theirs = torch_class(groups_of(reference), lr=1e-2, foreach=foreach,
                             **{k: v for k, v in options.items() if k in accepted and v is not None})
        trainer = Trainer()
        for _ in range(STEPS):
            trainer.step([(ours, params), (theirs, reference)])
        what = "%s bucket_elements=%d depth=%d foreach=%s %s" % (ours_class.__name__, bucket_elements, depth, foreach,
                                                               options)
        for i, (p, r) in enumerate(zip(params, reference)):
            self.assertBitEqual(p.detach(), r.detach(), "%s: param %d" % (what, i))
        self.assertSameState(ours.state_dict(), theirs.state_dict())
        return ours, store


class MatchesTorch(OptimTestCase):

    def test_adamw_bit_identical(self):
        # 10: smaller than most tensors (they span buckets); 300: slices of several; 10**6: one bucket.
        for bucket_elements in (10, 300, 10**6):
            for depth in (1, 2, 3, 5):
                with self.subTest(bucket_elements=bucket_elements, depth=depth):
                    self.run_pair(StreamedAdamW, torch.optim.AdamW, bucket_elements, depth, weight_decay=0.1)

    def test_adamw_foreach_and_maximize(self):
        for foreach in (False, True):
            with self.subTest(foreach=foreach):
                self.run_pair(StreamedAdamW, torch.optim.AdamW, 100, foreach=foreach, maximize=True)

    def test_with_an_lr_scheduler(self):
        # torch's schedulers before 2.2 (Debian's 1.13 among them) set an attribute _step_count on the
        # optimizer: nothing of ours may be called that, and the schedule must reach both alike.
        params, reference = make_params(), make_params()
        ours = StreamedAdamW(params, lr=1e-2, bucket_elements=100, store=make_store())
        theirs = torch.optim.AdamW(reference, lr=1e-2)
        schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (ours, theirs)]
        trainer = Trainer()
        for _ in range(STEPS):
            trainer.step([(ours, params), (theirs, reference)])
            for schedule in schedules:
                schedule.step()
        for i, (p, r) in enumerate(zip(params, reference)):
            self.assertBitEqual(p.detach(), r.detach(), "parameter %d under StepLR" % i)

    def test_adam_bit_identical(self):
        for bucket_elements in (10, 300, 10**6):
            for foreach in (False, True):
                with self.subTest(bucket_elements=bucket_elements, foreach=foreach):
                    self.run_pair(StreamedAdam, torch.optim.Adam, bucket_elements, foreach=foreach,
                                  weight_decay=0.01)

    def test_step_counts_counted_in_place_never_in_the_callers_tensors(self):
        # No count tensor is made per slice or per step (with fused=True they are device memory, and a
        # step's device memory is its buckets'); one loaded from a state_dict is a copy of the caller's.
        params = make_params()
        ours = StreamedAdamW(params, lr=1e-2, bucket_elements=10, store=make_store())  # tensors span buckets
        counts = []
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            ours.step()
            counts.append([ours.state[p]["step"] for p in params])
        for i in range(len(params)):
            self.assertIs(counts[2][i], counts[0][i])
            self.assertEqual(float(counts[2][i]), 3.0)
        saved = ours.state_dict()
        ours.load_state_dict(saved)
        ours.step()
        for entry in saved["state"].values():
            self.assertEqual(float(entry["step"]), 3.0)
        self.assertEqual([float(ours.state[p]["step"]) for p in params], [4.0] * len(params))

    def test_buckets_cut_as_asked(self):
        _, store = self.run_pair(StreamedAdamW, torch.optim.AdamW, 10)
        first_group = sum(-(-p.numel() // 10) for p in make_params()[:3])  # no bucket spans two groups
        self.assertGreaterEqual(len(store.objects), first_group)
        _, store = self.run_pair(StreamedAdamW, torch.optim.AdamW, 10**6)
        self.assertEqual(len(store.objects), 2)  # one per group

    def test_low_precision_params_against_fp32_masters(self):
        """bf16 and fp16 parameters are updated through fp32 masters: the reference is torch's AdamW
        on fp32 copies given the same (low-precision) gradients."""
        for dtype in (torch.bfloat16, torch.float16):
            for bucket_elements in (10, 10**6):
                with self.subTest(dtype=dtype, bucket_elements=bucket_elements):
                    params = make_params(dtype=dtype)
                    params[1] = params[1].detach().float().requires_grad_()  # a mixed bucket
                    masters = clones(params, torch.float32)
                    ours = StreamedAdamW(groups_of(params), lr=1e-2, bucket_elements=bucket_elements,
                                         store=make_store())
                    theirs = torch.optim.AdamW(groups_of(masters), lr=1e-2)
                    trainer = Trainer()
                    for _ in range(STEPS):
                        trainer.step([(ours, params), (theirs, masters)], grad_dtype=dtype)
                    mine, ref = ours.state_dict(), theirs.state_dict()
                    self.assertSameState(mine, ref)
                    for i, (p, m) in enumerate(zip(params, masters)):
                        self.assertBitEqual(p.detach(), m.detach().to(p.dtype), "param %d" % i)
                        if p.dtype != torch.float32:
                            self.assertBitEqual(mine["state"][i][optim.MASTER_KEY], m.detach(), "master %d" % i)
                        else:
                            self.assertNotIn(optim.MASTER_KEY, mine["state"][i])


class StateDicts(OptimTestCase):
    def continue_both(self, first, first_params, second, second_params, steps=STEPS // 2, seed=5):
        trainer = Trainer(seed)
        trainer.t = STEPS  # past the midway change
        for _ in range(steps):
            trainer.step([(first, first_params), (second, second_params)])
        for i, (a, b) in enumerate(zip(first_params, second_params)):
            self.assertBitEqual(a.detach(), b.detach(), "param %d after continuing" % i)

    def test_ours_into_torch_and_back(self):
        params = make_params()
        ours = StreamedAdamW(groups_of(params), lr=1e-2, bucket_elements=50, store=make_store())
        trainer = Trainer()
        for _ in range(STEPS // 2):
            trainer.step([(ours, params)])
        saved = ours.state_dict()
        self.assertEqual(saved[optim.MOMENT_DTYPE_KEY], "torch.float32")
        torch_params = clones(params)
        theirs = torch.optim.AdamW(groups_of(torch_params), lr=1e-2)
        theirs.load_state_dict(saved)
        self.assertSameState(saved, theirs.state_dict())
        self.continue_both(ours, params, theirs, torch_params)
        # and back: torch's state into a new streamed optimizer, both continued again
        back_params = clones(torch_params)
        back = StreamedAdamW(groups_of(back_params), lr=1e-2, bucket_elements=7, store=make_store())
        back.load_state_dict(theirs.state_dict())
        self.assertSameState(back.state_dict(), theirs.state_dict())
        self.continue_both(back, back_params, theirs, torch_params, seed=6)

    def test_torch_into_ours(self):
        torch_params = make_params()
        theirs = torch.optim.Adam(groups_of(torch_params), lr=1e-2, weight_decay=0.01)
        trainer = Trainer()
        for _ in range(STEPS // 2):
            trainer.step([(theirs, torch_params)])
        params = clones(torch_params)
        ours = StreamedAdam(groups_of(params), lr=1e-2, bucket_elements=64, store=make_store())
        ours.load_state_dict(theirs.state_dict())
        self.continue_both(theirs, torch_params, ours, params)
        self.assertSameState(ours.state_dict(), theirs.state_dict())

    def test_ours_into_ours(self):
        params = make_params(dtype=torch.bfloat16)
        ours = StreamedAdamW(groups_of(params), bucket_elements=40, store=make_store())
        trainer = Trainer()
        for _ in range(STEPS // 2):
            trainer.step([(ours, params)], grad_dtype=torch.bfloat16)
        copy = clones(params)
        other = StreamedAdamW(groups_of(copy), bucket_elements=1000, depth=2, store=make_store())
        other.load_state_dict(ours.state_dict())  # masters included: bit-identical from here on
        trainer = Trainer(9)
        for _ in range(STEPS // 2):
            trainer.step([(ours, params), (other, copy)], grad_dtype=torch.bfloat16)
        for i, (a, b) in enumerate(zip(params, copy)):
            self.assertBitEqual(a.detach(), b.detach(), "param %d" % i)
        mine, theirs = ours.state_dict(), other.state_dict()
        self.assertSameState(mine, theirs)
        for index, entry in mine["state"].items():
            self.assertBitEqual(entry[optim.MASTER_KEY], theirs["state"][index][optim.MASTER_KEY], "master")

    def test_dtype_mismatch_refused(self):
        params = make_params()
        ours = StreamedAdamW(params, bucket_elements=100, store=make_store())
        trainer = Trainer()
        trainer.step([(ours, params)])
        saved = ours.state_dict()
        # it says bf16 but holds fp32: reading those bytes as bf16 is what must never happen
        lying = dict(saved, **{optim.MOMENT_DTYPE_KEY: "torch.bfloat16"})
        with self.assertRaisesRegex(ValueError, r"torch\.bfloat16.*torch\.float32"):
            ours.load_state_dict(lying)
        narrow = StreamedAdamW(clones(params), bucket_elements=100, moment_dtype=torch.bfloat16, store=make_store())
        half = dict(saved, state={i: dict(e, exp_avg=e["exp_avg"].half(), exp_avg_sq=e["exp_avg_sq"].half())
                                  for i, e in saved["state"].items()})
        del half[optim.MOMENT_DTYPE_KEY]
        with self.assertRaisesRegex(ValueError, r"torch\.float16.*torch\.bfloat16"):
            narrow.load_state_dict(half)
        double = dict(saved, state={i: dict(e, exp_avg=e["exp_avg"].double()) for i, e in saved["state"].items()})
        del double[optim.MOMENT_DTYPE_KEY]
        with self.assertRaisesRegex(ValueError, r"torch\.float64.*torch\.float32"):
            ours.load_state_dict(double)
        # the refusals changed nothing
        self.assertSameState(ours.state_dict(), saved)

    def test_fp32_state_into_bf16_moments_is_rounded(self):
        params = make_params()
        ours = StreamedAdamW(params, bucket_elements=100, store=make_store())
        trainer = Trainer()
        for _ in range(3):
            trainer.step([(ours, params)])
        saved = ours.state_dict()
        narrow = StreamedAdamW(clones(params), bucket_elements=100, moment_dtype=torch.bfloat16, store=make_store())
        narrow.load_state_dict(saved)
        got = narrow.state_dict()
        self.assertEqual(got[optim.MOMENT_DTYPE_KEY], "torch.bfloat16")
        for index, entry in saved["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertBitEqual(got["state"][index][key], entry[key].to(torch.bfloat16), key)


class Checkpoints(OptimTestCase):
    """save(directory) and load(directory): bucket by bucket through the store, checked on load."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optim-ckpt-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def trained(self, bucket_elements=40, steps=STEPS // 2, dtype=torch.float32, **options):
        params, reference = make_params(dtype=dtype), make_params(dtype=dtype)
        ours = StreamedAdamW(groups_of(params), lr=1e-2, bucket_elements=bucket_elements, store=make_store(),
                             **options)
        theirs = torch.optim.AdamW(groups_of(reference), lr=1e-2)
        trainer = Trainer()
        for _ in range(steps):
            trainer.step([(ours, params), (theirs, reference)] if dtype == torch.float32 else [(ours, params)],
                         grad_dtype=None if dtype == torch.float32 else dtype)
        return ours, params, theirs, reference, trainer

    def test_save_load_continue_bit_identical(self):
        for bucket_elements, depth in ((40, 3), (10, 1), (10**6, 2)):
            with self.subTest(bucket_elements=bucket_elements, depth=depth):
                ours, params, theirs, reference, trainer = self.trained(bucket_elements)
                ours.save(self.dir)
                copy = clones(params)
                other = StreamedAdamW(groups_of(copy), lr=5.0, bucket_elements=bucket_elements, depth=depth,
                                      store=make_store())
                other.load(self.dir)
                for _ in range(STEPS // 2):
                    trainer.step([(ours, params), (other, copy), (theirs, reference)])
                for i, (a, b, r) in enumerate(zip(params, copy, reference)):
                    self.assertBitEqual(b.detach(), a.detach(), "param %d against the uninterrupted" % i)
                    self.assertBitEqual(b.detach(), r.detach(), "param %d against torch" % i)
                self.assertSameState(other.state_dict(), ours.state_dict())
                self.assertSameState(other.state_dict(), theirs.state_dict())

    def test_bf16_params_with_masters_and_resave(self):
        ours, params, _, _, trainer = self.trained(dtype=torch.bfloat16, moment_dtype=torch.bfloat16)
        ours.save(self.dir)
        ours.save(self.dir)  # again over the first: the first's files go
        names = sorted(os.listdir(self.dir))
        self.assertEqual(len([n for n in names if n.endswith(".bucket")]),
                         sum(len(b) for b in ours._buckets), names)
        self.assertFalse([n for n in names if n.endswith(".tmp")], names)
        copy = clones(params)
        other = StreamedAdamW(groups_of(copy), lr=1e-2, bucket_elements=40, moment_dtype=torch.bfloat16,
                              store=make_store())
        other.load(self.dir)
        for _ in range(STEPS // 2):
            trainer.step([(ours, params), (other, copy)], grad_dtype=torch.bfloat16)
        for i, (a, b) in enumerate(zip(params, copy)):
            self.assertBitEqual(b.detach(), a.detach(), "param %d" % i)
        mine, theirs = other.state_dict(), ours.state_dict()
        self.assertSameState(mine, theirs)
        for index, entry in mine["state"].items():
            self.assertBitEqual(entry[optim.MASTER_KEY], theirs["state"][index][optim.MASTER_KEY], "master")

    def test_refusals(self):
        ours, params, _, _, _ = self.trained()
        ours.save(self.dir)

        def fresh(**options):
            kw = dict(lr=1e-2, bucket_elements=40, store=make_store())
            kw.update(options)
            return StreamedAdamW(groups_of(clones(params)), **kw)

        with self.assertRaisesRegex(ValueError, "bucket_elements 40, this optimizer's 50"):
            fresh(bucket_elements=50).load(self.dir)
        with self.assertRaisesRegex(ValueError, "bfloat16 moments|float32 moments"):
            fresh(moment_dtype=torch.bfloat16).load(self.dir)
        with self.assertRaisesRegex(ValueError, "parameters of group 1"):
            StreamedAdamW(groups_of(make_params(shapes=SHAPES[:-1] + [(15, 16)])), bucket_elements=40,
                          store=make_store()).load(self.dir)
        with self.assertRaisesRegex(ValueError, "is of StreamedAdamW"):
            StreamedAdam(groups_of(clones(params)), bucket_elements=40, store=make_store()).load(self.dir)
        files = sorted(n for n in os.listdir(self.dir) if n.endswith(".bucket"))
        victim = os.path.join(self.dir, files[1])
        with open(victim, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 1]))
        untouched = fresh()
        with self.assertRaisesRegex(ValueError, "fails its check: SHA-256"):
            untouched.load(self.dir)
        self.assertEqual(len(untouched.state), 0, "nothing restored")
        os.unlink(victim)
        with self.assertRaisesRegex(ValueError, "is missing"):
            fresh().load(self.dir)
        os.unlink(os.path.join(self.dir, optim.CHECKPOINT_MANIFEST))
        with self.assertRaisesRegex(ValueError, "manifest.json is missing"):
            fresh().load(self.dir)


class Options(OptimTestCase):
    def test_unsupported_flags_refused_by_name(self):
        for cls in (StreamedAdamW, StreamedAdam):
            for flag in ("amsgrad", "capturable", "differentiable"):
                with self.subTest(cls=cls.__name__, flag=flag):
                    with self.assertRaisesRegex(ValueError, flag + "=True"):
                        cls(make_params(), store=make_store(), **{flag: True})
            with self.assertRaisesRegex(ValueError, "amsgrad=True"):
                cls([{"params": make_params()[:1]}, {"params": make_params()[1:], "amsgrad": True}],
                    store=make_store())

    def test_bad_arguments_refused(self):
        for kwargs, pattern in (({"lr": -1.0}, "learning rate"), ({"betas": (1.0, 0.9)}, "beta"),
                                ({"depth": 0}, "depth"), ({"bucket_elements": 0}, "bucket_elements"),
                                ({"moment_dtype": torch.float16}, "moment_dtype"), ({"name": "a b"}, "name")):
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, pattern):
                    StreamedAdamW(make_params(), store=make_store(), **kwargs)
        with self.assertRaisesRegex(ValueError, "float64"):
            StreamedAdamW([torch.zeros(3, dtype=torch.float64, requires_grad=True)], store=make_store())

    def test_names_do_not_collide_and_close_removes(self):
        store = make_store()
        params_a, params_b = make_params(), make_params()
        a = StreamedAdamW(params_a, store=store)
        b = StreamedAdamW(params_b, store=store)
        trainer = Trainer()
        trainer.step([(a, params_a), (b, params_b)])
        a.flush()
        b.flush()
        self.assertEqual(len(store.objects), 2)
        with self.assertRaisesRegex(ValueError, "used by another"):
            StreamedAdamW(make_params(), store=store, name=a._name)
        a.close()
        self.assertEqual(len(store.objects), 1)
        with self.assertRaisesRegex(RuntimeError, "closed"):
            a.step()

    def test_bf16_moments_close_in_half_the_bytes(self):
        # sizes in multiples of 32 elements: bf16 sections then fill their 64-byte alignment exactly
        shapes = [(64, 32), (96,), (32, 3, 2)]
        wide_params, narrow_params = make_params(shapes), make_params(shapes)
        wide_store, narrow_store = make_store(), make_store()
        wide = StreamedAdamW(wide_params, bucket_elements=1024, store=wide_store)
        narrow = StreamedAdamW(narrow_params, bucket_elements=1024, moment_dtype=torch.bfloat16, store=narrow_store)
        trainer = Trainer()
        for _ in range(STEPS):
            trainer.step([(wide, wide_params), (narrow, narrow_params)])
        wide.flush()
        narrow.flush()
        self.assertEqual(narrow_store.stored_bytes() * 2, wide_store.stored_bytes())
        for a, b in zip(wide_params, narrow_params):
            self.assertFalse(torch.equal(a, b))  # bf16 moments do differ...
            torch.testing.assert_close(b, a, rtol=0, atol=2e-3)  # ...by little after 20 steps of lr 1e-3
        for index, entry in wide.state_dict()["state"].items():
            got = narrow.state_dict()["state"][index]
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(got[key].dtype, torch.bfloat16)
                # bf16 keeps 8 significant bits: each step rounds by 2**-9 of the value
                scale = entry[key].abs().max().item()
                torch.testing.assert_close(got[key].float(), entry[key], rtol=2e-2, atol=1e-2 * scale)


# --- fused=True ----------------------------------------------------------------------------------------


def torch_fused_refusal(torch_class):
    """What torch's own class says to fused=True over parameters like the tests' (on DEVICE): None when it
    constructs and steps, else the exception it raises, at construction or at the first step (torch 2.4
    and later check the device there)."""
    params = make_params()
    try:
        opt = torch_class(params, fused=True)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    except (TypeError, RuntimeError) as e:
        return e
    return None


FUSED_PAIRS = ((StreamedAdamW, torch.optim.AdamW), (StreamedAdam, torch.optim.Adam))


class Fused(OptimTestCase):
    """fused=True runs the bucket update through torch's fused kernel where torch's class has one for the
    device (AdamW and Adam from PyTorch 2.0 on CUDA, 2.4 on the CPU too); where it has none, it is refused
    at construction with the exception torch's class raises."""

    def test_refused_as_torch_refuses(self):
        refused = 0
        for ours_class, torch_class in FUSED_PAIRS:
            theirs = torch_fused_refusal(torch_class)
            if theirs is None:
                continue
            refused += 1
            with self.subTest(cls=ours_class.__name__, torch_says=str(theirs)):
                with self.assertRaises(type(theirs)) as caught:
                    ours_class(make_params(), store=make_store(), fused=True)
                if isinstance(theirs, TypeError):  # an argument this torch's class does not take
                    self.assertIn("fused=True", str(caught.exception))
                    self.assertIn("this torch (%s)" % torch.__version__, str(caught.exception))
                else:  # torch's own check, with its message
                    self.assertEqual(str(caught.exception), str(theirs))
                with self.assertRaises(type(theirs)):  # a group asking for it, too
                    ours_class([{"params": make_params()[:2]}, {"params": make_params()[2:], "fused": True}],
                               store=make_store())
        if not refused:
            self.skipTest("this torch (%s) has fused AdamW and Adam on %s: test_bit_identical_to_torch_fused runs "
                          "them" % (torch.__version__, DEVICE))

    def test_bit_identical_to_torch_fused(self):
        for ours_class, torch_class in FUSED_PAIRS:
            with self.subTest(cls=ours_class.__name__):
                refusal = torch_fused_refusal(torch_class)
                if refusal is not None:
                    self.skipTest("torch %s's %s has no fused kernel on %s: %s: %s" % (
                        torch.__version__, torch_class.__name__, DEVICE, type(refusal).__name__, refusal))
                for bucket_elements in (10, 10**6):
                    ours, _ = self.run_pair(ours_class, torch_class, bucket_elements, fused=True, weight_decay=0.1)
                    for entry in ours.state_dict()["state"].values():  # where torch's fused kernel keeps it
                        self.assertEqual(entry["step"].device, make_params()[0].device)

    def test_fused_false_and_none_take_the_default_kernel(self):
        for ours_class, torch_class in FUSED_PAIRS:
            for fused in (False, None):
                with self.subTest(cls=ours_class.__name__, fused=fused):
                    self.run_pair(ours_class, torch_class, 100, fused=fused, weight_decay=0.1)


# --- sharded parameters (DTensor, FSDP2) -----------------------------------------------------------------


class RowShard(torch.Tensor):
    """Stands in for a DTensor where this torch has none: a tensor of the whole parameter's shape whose
    to_local() is its rows [start, stop), this "rank's" shard, a plain tensor sharing its storage;
    from_local() builds one around a shard, as DTensor's does (the rows outside it NaN, which nothing may
    read). tmsdisk.optim finds DTensor's class in sys.modules; block_dtensor() puts this one there."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of torch's functions: plain tensors

    @staticmethod
    def __new__(cls, full, rows, requires_grad=False):
        t = torch.Tensor._make_subclass(cls, full.detach(), requires_grad)
        t.placements, t.device_mesh = ("rows",) + tuple(rows), "one rank"
        return t

    def to_local(self):
        start, stop = self.placements[1:]
        return self.as_subclass(torch.Tensor)[start:stop]

    @classmethod
    def from_local(cls, local, device_mesh, placements, *, run_check=False, shape=None, stride=None):
        full = torch.full(shape, float("nan"), dtype=local.dtype, device=local.device)
        start, stop = placements[1:]
        full[start:stop] = local
        t = cls(full, (start, stop))
        t.device_mesh = device_mesh
        return t


def row_shards():
    """sys.modules with RowShard as torch.distributed.tensor.DTensor (a context manager)."""
    import types
    from unittest import mock

    module = types.ModuleType("torch.distributed.tensor")
    module.DTensor = RowShard
    return mock.patch.dict(sys.modules, {"torch.distributed.tensor": module})


SHARD_SHAPES = [(9, 5), (6,), (4, 3, 2), (7, 3)]
SHARD_ROWS = [(3, 7), (2, 5), (1, 3), (0, 7)]  # a middle slice of each, all of the last


class ShardedParams(OptimTestCase):
    """Parameters that are shards (to_local()) of larger tensors, as FSDP2's DTensors are: only this rank's
    rows are streamed and updated, bit-identical to torch.optim.AdamW on plain copies of those rows; the
    other rows are never read or written. RowShard stands in for DTensor (this torch may have none);
    DTensorParams runs torch's own."""

    def sharded(self, seed=0):
        return [RowShard(p, rows, requires_grad=True)
                for p, rows in zip(make_params(SHARD_SHAPES, seed=seed), SHARD_ROWS)]

    def test_local_rows_only_bit_identical_to_adamw_on_the_shards(self):
        with row_shards():
            params = self.sharded()
            untouched = [p.as_subclass(torch.Tensor).detach().clone() for p in params]
            shards = [p.to_local().detach().clone().requires_grad_() for p in params]
            store = make_store()
            ours = StreamedAdamW(groups_of(params), lr=1e-2, weight_decay=0.1, bucket_elements=7, store=store)
            theirs = torch.optim.AdamW(groups_of(shards), lr=1e-2, weight_decay=0.1)
            gen = torch.Generator().manual_seed(1)
            for _ in range(STEPS):
                for p, s in zip(params, shards):
                    g = torch.randn(p.shape, generator=gen)
                    p.grad = RowShard(g, p.placements[1:])
                    s.grad = p.grad.to_local().clone()
                ours.step()
                theirs.step()
            for i, (p, s, before) in enumerate(zip(params, shards, untouched)):
                start, stop = p.placements[1:]
                whole = p.as_subclass(torch.Tensor).detach()
                self.assertBitEqual(whole[start:stop], s.detach(), "the shard of parameter %d" % i)
                self.assertBitEqual(whole[:start], before[:start], "the rows before the shard of %d" % i)
                self.assertBitEqual(whole[stop:], before[stop:], "the rows after the shard of %d" % i)
            ours.flush()
            self.assertEqual(sum(b.numel for buckets in ours._buckets for b in buckets),
                             sum(s.numel() for s in shards), "the buckets hold the shards' elements, no more")
            mine, ref = ours.state_dict(), theirs.state_dict()
            for index, entry in ref["state"].items():
                got = mine["state"][index]
                self.assertBitEqual(got["step"], entry["step"], "step of %d" % index)
                for key in ("exp_avg", "exp_avg_sq"):
                    self.assertIsInstance(got[key], RowShard, "%s of %d: placed as its parameter" % (key, index))
                    self.assertEqual(got[key].placements, params[index].placements)
                    self.assertEqual(got[key].shape, params[index].shape)
                    self.assertBitEqual(got[key].to_local(), entry[key], "%s of %d" % (key, index))

    def test_state_dict_loads_back_and_plain_tensors_are_refused(self):
        with row_shards():
            params, copy = self.sharded(), self.sharded()
            first = StreamedAdamW(params, lr=1e-2, bucket_elements=7, store=make_store())
            gen = torch.Generator().manual_seed(2)

            def step(pairs):
                grads = [torch.randn(p.shape, generator=gen) for p in params]
                for opt, ps in pairs:
                    for p, g in zip(ps, grads):
                        p.grad = RowShard(g, p.placements[1:])
                    opt.step()

            for _ in range(STEPS // 2):
                step([(first, params)])
            with torch.no_grad():
                for p, c in zip(params, copy):
                    c.copy_(p)
            second = StreamedAdamW(copy, lr=1e-2, bucket_elements=5, depth=2, store=make_store())
            second.load_state_dict(first.state_dict())
            for _ in range(STEPS // 2):
                step([(first, params), (second, copy)])
            for i, (p, c) in enumerate(zip(params, copy)):
                self.assertBitEqual(c.to_local().detach(), p.to_local().detach(), "shard %d after the load" % i)
            plain = first.state_dict()
            plain["state"][0]["exp_avg"] = plain["state"][0]["exp_avg"].to_local().clone()
            with self.assertRaisesRegex(ValueError, "exp_avg of parameter 0 is a plain tensor and the parameter a "
                                                    "DTensor"):
                second.load_state_dict(plain)


def dtensor_api():
    """torch's DTensor, Shard, distribute_tensor and init_device_mesh, or the reason this torch lacks them."""
    import importlib

    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            found = importlib.import_module(module)
            mesh = getattr(found, "init_device_mesh", None)
            if mesh is None:
                mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh
            return found.DTensor, found.Shard, found.distribute_tensor, mesh
        except (ImportError, AttributeError):
            continue
    return "this torch (%s) has no DTensor (torch.distributed.tensor, PyTorch 2.2 or later)" % torch.__version__


class DTensorParams(OptimTestCase):
    """torch's own DTensors, sharded over a mesh of this one process (gloo, on the CPU or DEVICE): the
    streamed optimizer against torch.optim.AdamW on the same DTensor parameters; its state_dict holds
    DTensors placed as torch's. tests/gpu/torch_streamed_fsdp2.py does the same under FSDP2 on 2 GPUs."""

    def setUp(self):
        api = dtensor_api()
        if isinstance(api, str):
            self.skipTest(api)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("this torch (%s) has no gloo backend" % torch.__version__)
        self.DTensor, self.Shard, self.distribute, init_mesh = api
        directory = tempfile.mkdtemp(prefix="optim-dtensor-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        dist.init_process_group("gloo", init_method="file://" + os.path.join(directory, "rendezvous"), rank=0,
                                world_size=1)
        self.addCleanup(dist.destroy_process_group)
        self.mesh = init_mesh(DEVICE.type, (1,))

    def dtensors(self):
        return [torch.nn.Parameter(self.distribute(p.detach(), self.mesh, [self.Shard(0)])) for p in make_params()]

    def test_bit_identical_to_adamw_on_dtensors_with_dtensor_state(self):
        params, reference = self.dtensors(), self.dtensors()
        ours = StreamedAdamW(groups_of(params), lr=1e-2, weight_decay=0.1, bucket_elements=50, store=make_store())
        theirs = torch.optim.AdamW(groups_of(reference), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            for p, r in zip(params, reference):
                g = self.distribute(torch.randn(p.shape, generator=gen).to(DEVICE), self.mesh, [self.Shard(0)])
                p.grad, r.grad = g, g.clone()
            ours.step()
            theirs.step()
        for i, (p, r) in enumerate(zip(params, reference)):
            self.assertIsInstance(p, self.DTensor)
            self.assertBitEqual(p.to_local().detach(), r.to_local().detach(), "parameter %d" % i)
        mine, ref = ours.state_dict(), theirs.state_dict()
        self.assertEqual(sorted(mine["state"]), sorted(ref["state"]))
        for index, entry in ref["state"].items():
            got = mine["state"][index]
            self.assertBitEqual(got["step"], entry["step"], "step of %d" % index)
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertIs(type(got[key]), type(entry[key]), "%s of %d" % (key, index))
                self.assertEqual(got[key].placements, entry[key].placements)
                self.assertEqual(got[key].device_mesh, entry[key].device_mesh)
                self.assertEqual(got[key].shape, entry[key].shape)
                self.assertBitEqual(got[key].to_local(), entry[key].to_local(), "%s of %d" % (key, index))
        again = StreamedAdamW(groups_of(self.dtensors()), lr=1e-2, weight_decay=0.1, store=make_store())
        again.load_state_dict(theirs.state_dict())  # torch's DTensor state loads, shard by shard
        for index, entry in again.state_dict()["state"].items():
            self.assertBitEqual(entry["exp_avg"].to_local(), ref["state"][index]["exp_avg"].to_local(), "loaded")


FP8 = getattr(torch, "float8_e4m3fn", None)
NO_FP8 = "this torch (%s) has no torch.float8_e4m3fn (PyTorch 2.1 or later has it)" % torch.__version__


def block_scaled(dtype):
    """optim's table of block-scaled moment dtypes with `dtype` in it: float16 drives the same codec, layout
    and state handling as fp8 where torch has no fp8 (a context manager)."""
    from unittest import mock

    return mock.patch.dict(optim._SCALED_MOMENTS, {dtype: optim.BlockScaledMoments(dtype)})


class BlockScaledCodec(OptimTestCase):
    """tmsdisk._moments' block scaling, on float16 (every torch); FP8Codec runs the same on e4m3."""

    dtype = torch.float16

    def setUp(self):
        self.fmt = optim.BlockScaledMoments(self.dtype)
        info = torch.finfo(self.dtype)
        self.bits = round(-__import__("math").log2(info.eps))  # mantissa bits
        self.max = info.max

    def moments(self, seed=0):
        """Blocks of different magnitudes (1e-20 to 1e5), each spanning four decades inside, a zero block,
        a block with one non-zero element, and a partial last block."""
        gen = torch.Generator().manual_seed(seed)
        b = optim.MOMENT_BLOCK
        rows = []
        for exponent in (-20, -8, -3, 0, 2, 5):
            magnitudes = 10.0 ** (exponent - 4 * torch.rand(b, generator=gen, dtype=torch.float64))
            signs = torch.randint(0, 2, (b,), generator=gen) * 2 - 1
            rows.append((magnitudes * signs).float())
        rows.append(torch.zeros(b))
        lone = torch.zeros(b)
        lone[17] = -3.5
        rows.append(lone)
        rows.append(torch.randn(b // 3, generator=gen))
        return torch.cat(rows)

    def steps(self, x, scales):
        """The grid's step at each element of x (unscaled units): 2^(floor(log2|x/scale|) - bits), no
        finer than the subnormals'."""
        scale = scales.repeat_interleave(optim.MOMENT_BLOCK)[: x.numel()]
        y = (x / scale).abs().double()
        exponent = torch.floor(torch.log2(y.clamp(min=self.fmt.smallest)))
        exponent = exponent.clamp(min=self.fmt.min_exponent)
        return torch.pow(2.0, exponent - self.bits) * scale.double()

    def roundtrip(self, x, generator=None, root=False):
        q = torch.empty(x.numel(), dtype=self.dtype)
        scales = torch.empty(self.fmt.blocks(x.numel()))
        self.fmt.quantize(x, q, scales, generator, root=root)
        back = torch.empty_like(x)
        self.fmt.dequantize(q, scales, back, square=root)
        return q, scales, back

    def test_round_to_nearest_within_half_a_step_per_block(self):
        x = self.moments()
        q, scales, back = self.roundtrip(x)
        b = optim.MOMENT_BLOCK
        self.assertEqual(scales.numel(), -(-x.numel() // b))
        self.assertFalse(torch.isnan(back).any() or torch.isnan(scales).any())
        absmax = torch.nn.functional.pad(x, (0, scales.numel() * b - x.numel())).view(-1, b).abs().amax(1)
        expected = torch.where(absmax > 0, absmax / self.max, torch.ones_like(absmax))
        self.assertBitEqual(scales, expected, "scales: absmax / max, 1 for the zero block")
        self.assertEqual(back[6 * b : 7 * b].abs().max().item(), 0.0, "the zero block")
        self.assertEqual(back[7 * b + 17].item(), -3.5, "a lone value is its block's largest: exact")
        error = (back.double() - x.double()).abs()
        bound = self.steps(x, scales) / 2 + x.double().abs() * 2.0 ** -22  # + fp32's rounding of q * scale
        worst = (error / bound).max().item()
        self.assertLessEqual(worst, 1.0, "an error of %.3f half-steps" % worst)
        # rounding again what is on the grid changes nothing
        q2, scales2, _ = self.roundtrip(back)
        self.assertBitEqual(q2.float(), q.float(), "q rounded again")

    def test_stochastic_rounding_within_a_step_and_unbiased(self):
        x = self.moments()[: 6 * optim.MOMENT_BLOCK]  # the six random blocks
        gen = torch.Generator().manual_seed(3)
        draws = 400
        total = torch.zeros(x.numel(), dtype=torch.float64)
        for _ in range(draws):
            _, scales, back = self.roundtrip(x, gen)
            step = self.steps(x, scales)
            error = (back.double() - x.double()).abs()
            self.assertLessEqual((error / (step + x.double().abs() * 2.0 ** -22)).max().item(), 1.0)
            total += back.double()
        # Each draw's error is within a step, with mean 0 and deviation at most half a step: the mean of
        # 400 is within 5 deviations of it, 2.5 steps / sqrt(400), at every element.
        bias = ((total / draws - x.double()).abs() / step).max().item()
        self.assertLess(bias, 2.5 / draws ** 0.5, "a mean off by %.3f steps" % bias)
        # and a value on the grid is never moved
        q, scales, back = self.roundtrip(x)
        q2, _, _ = self.roundtrip(back, gen)
        self.assertBitEqual(q2.float(), q.float(), "on-grid values under stochastic rounding")

    def test_square_roots_kept_and_never_rounded_to_zero(self):
        b = optim.MOMENT_BLOCK
        v = torch.zeros(2 * b)
        v[0] = 1.0e4
        v[1:20] = torch.logspace(-40, -1, 19)  # far below 1e4's block resolution, yet positive
        v[b:] = torch.rand(b, generator=torch.Generator().manual_seed(1)) * 1e-6
        v[b + 5] = 0.0
        for generator in (None, torch.Generator().manual_seed(4)):
            with self.subTest(stochastic=generator is not None):
                _, scales, back = self.roundtrip(v, generator, root=True)
                self.assertTrue(bool((back[v > 0] > 0).all()), "a positive exp_avg_sq became 0")
                self.assertEqual(back[v == 0].abs().max().item(), 0.0)
                # Where the root is in the dtype's normal range, it is within a step: 2^-bits relative.
                scale = scales.repeat_interleave(b).double()
                root = v.double().sqrt()
                normal = root >= scale * 2.0 ** self.fmt.min_exponent
                self.assertGreater(int(normal.sum()), b // 2)
                rel = ((back.double().sqrt() - root).abs() / root)[normal].max().item()
                self.assertLessEqual(rel, 2.0 ** -self.bits * 1.001, "a root off by %g relative" % rel)


@unittest.skipUnless(FP8, NO_FP8)
class FP8Codec(BlockScaledCodec):
    dtype = FP8


class BlockScaledOptimizer(OptimTestCase):
    """StreamedAdamW with block-scaled moments (float16 here, fp8 in FP8Optimizer): bytes, steps against
    torch's AdamW, state dicts, checkpoints."""

    dtype = torch.float16
    # After 20 steps of lr 1e-2: each step's update is m/sqrt(v) rounded by at most a step of the grid
    # (2^-10 relative for float16, 2^-3 for e4m3), so a parameter drifts by at most 20 * lr * that.
    tolerance = 20 * 1e-2 * 2.0 ** -10

    def setUp(self):
        patch = block_scaled(self.dtype)
        patch.start()
        self.addCleanup(patch.stop)

    def make(self, params, **options):
        kw = dict(lr=1e-2, bucket_elements=300, moment_dtype=self.dtype, store=make_store())
        kw.update(options)
        return StreamedAdamW(groups_of(params), **kw)

    def test_bytes_are_the_layout(self):
        params = make_params()
        store = make_store()
        opt = self.make(params, store=store, bucket_elements=300)
        Trainer().step([(opt, params)])
        opt.flush()
        size = torch.empty((), dtype=self.dtype).element_size()

        def up(n):
            return -(-n // 64) * 64

        for bucket in (b for buckets in opt._buckets for b in buckets):
            n = bucket.numel
            blocks = -(-n // 128)
            expected = up(up(n * size) * 2 + blocks * 4) + blocks * 4
            self.assertEqual(store.objects[bucket.name].numel(), expected, bucket.name)
            for at in (bucket.exp_avg_at, bucket.exp_avg_sq_at, bucket.scales_at, bucket.exp_avg_sq_scales_at):
                self.assertEqual(at % 64, 0)
        per = store.stored_bytes() / sum(p.numel() for p in params)
        self.assertLess(per, 2 * size + 1.5, "%.2f bytes per parameter" % per)  # + scales and alignment

    def test_steps_close_to_adamw(self):
        params, reference = make_params(), make_params()
        ours = self.make(params, weight_decay=0.1)
        theirs = torch.optim.AdamW(groups_of(reference), lr=1e-2, weight_decay=0.1)
        trainer = Trainer()
        for _ in range(STEPS):
            trainer.step([(ours, params), (theirs, reference)])
        worst = max((p - r).abs().max().item() for p, r in zip(params, reference))
        self.assertLessEqual(worst, self.tolerance, "a parameter %g from torch's" % worst)
        self.assertGreater(worst, 0.0)  # the moments were rounded: not a copy of the fp32 path
        mine, ref = ours.state_dict(), theirs.state_dict()
        self.assertEqual(mine[optim.MOMENT_DTYPE_KEY], "torch.float32")
        self.assertEqual(mine[optim.MOMENT_STORAGE_KEY], {"dtype": str(self.dtype), "moment_block": 128,
                                                          "exp_avg_sq_stored_as": "sqrt"})
        for index, entry in ref["state"].items():
            self.assertBitEqual(mine["state"][index]["step"], entry["step"], "step")
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(mine["state"][index][key].dtype, torch.float32)
        # Per block, as the moments were kept: exp_avg within 8 grid steps of its block's largest, and
        # exp_avg_sq's root of its root's. 20 stochastic roundings add errors of at most a step each, of
        # mean 0, that the moments' decay shrinks: their sum stays within a few steps.
        for bucket in (b for buckets in ours._buckets for b in buckets):
            for key, transform in (("exp_avg", lambda t: t), ("exp_avg_sq", torch.sqrt)):
                got, want = (transform(self.bucket_flat(ours, state, bucket, key)) for state in (mine, ref))
                blocks = -(-want.numel() // optim.MOMENT_BLOCK)
                pad = blocks * optim.MOMENT_BLOCK - want.numel()
                largest = torch.nn.functional.pad(want.abs(), (0, pad)).view(blocks, -1).amax(1)
                bound = (largest * 8 * 2.0 ** -self.bits_of()).repeat_interleave(optim.MOMENT_BLOCK)[: want.numel()]
                worst = ((got - want).abs() / bound).max().item()
                self.assertLessEqual(worst, 1.0, "%s of %s: %.2f of the bound" % (key, bucket.name, worst))

    @staticmethod
    def bucket_flat(opt, state, bucket, key):
        """The bucket's elements of moment `key`, in its order, from a state_dict's tensors."""
        first = sum(len(g["params"]) for g in opt.param_groups[: bucket.group])
        return torch.cat([state["state"][first + seg.param][key].reshape(-1)[seg.start : seg.stop].float().cpu()
                          for seg in bucket.segments])

    def bits_of(self):
        return round(-__import__("math").log2(torch.finfo(self.dtype).eps))

    def test_state_dict_round_trips_and_converts(self):
        params = make_params()
        ours = self.make(params)
        trainer = Trainer()
        for _ in range(STEPS // 2):
            trainer.step([(ours, params)])
        saved = ours.state_dict()
        # The same buckets, so the same blocks: values on the grid, rounded to nearest, back to themselves
        # (but for fp32's rounding of q * scale, and of its square).
        again = self.make(clones(params))
        again.load_state_dict(saved)
        got = again.state_dict()
        for index, entry in saved["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][index][key], entry[key], rtol=2.0 ** -20, atol=0)
        # Other buckets group other elements into blocks: rounded again, within half a step of the grid.
        regrouped = self.make(clones(params), bucket_elements=77)
        regrouped.load_state_dict(saved)
        got = regrouped.state_dict()
        for index, entry in saved["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                scale = entry[key].abs().max().item()
                torch.testing.assert_close(got["state"][index][key], entry[key], rtol=0,
                                           atol=scale * 2.0 ** -self.bits_of())
        # into fp32 moments: the values as they are (an explicit fp32 state dict)
        wide = StreamedAdamW(groups_of(clones(params)), lr=1e-2, bucket_elements=50, store=make_store())
        wide.load_state_dict(saved)
        self.assertSameState(wide.state_dict(), dict(saved, **{optim.MOMENT_DTYPE_KEY: "torch.float32"}))
        # torch's fp32 state into block-scaled moments: rounded to nearest, within half a step of the grid
        torch_params = make_params()
        theirs = torch.optim.AdamW(groups_of(torch_params), lr=1e-2)
        for _ in range(3):
            trainer.step([(theirs, torch_params)])
        narrow = self.make(clones(torch_params))
        narrow.load_state_dict(theirs.state_dict())
        for index, entry in theirs.state_dict()["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                scale = entry[key].abs().max().item()
                torch.testing.assert_close(narrow.state_dict()["state"][index][key], entry[key], rtol=0,
                                           atol=scale * 2.0 ** -self.bits_of())
        # a declared dtype its tensors contradict is refused, as for fp32 and bf16
        lying = dict(saved, **{optim.MOMENT_DTYPE_KEY: str(self.dtype)})
        with self.assertRaisesRegex(ValueError, "declares %s moments" % str(self.dtype).replace(".", r"\.")):
            again.load_state_dict(lying)

    def test_checkpoint_continues_bit_identical_and_other_dtypes_refused(self):
        directory = tempfile.mkdtemp(prefix="optim-ckpt-")
        self.addCleanup(shutil.rmtree, directory, True)
        params = make_params()
        ours = self.make(params, bucket_elements=40)
        trainer = Trainer()
        for _ in range(STEPS // 2):
            trainer.step([(ours, params)])
        ours.save(directory)
        import json

        with open(os.path.join(directory, optim.CHECKPOINT_MANIFEST)) as f:
            manifest = json.load(f)
        self.assertEqual((manifest["moment_dtype"], manifest["moment_block"], manifest["exp_avg_sq_stored_as"]),
                         (str(self.dtype), 128, "sqrt"))
        copy = clones(params)
        other = self.make(copy, bucket_elements=40, depth=2)
        other.load(directory)
        for _ in range(STEPS // 2):  # the stochastic rounding is seeded by step and bucket: the same draws
            trainer.step([(ours, params), (other, copy)])
        for i, (a, b) in enumerate(zip(params, copy)):
            self.assertBitEqual(b.detach(), a.detach(), "param %d" % i)
        with self.assertRaisesRegex(ValueError, r"keeps %s moments and this optimizer torch\.float32.*"
                                    r"state_dict\(\), which converts" % str(self.dtype).replace(".", r"\.")):
            StreamedAdamW(groups_of(clones(params)), lr=1e-2, bucket_elements=40, store=make_store()).load(directory)
        manifest["moment_block"] = 64
        with open(os.path.join(directory, optim.CHECKPOINT_MANIFEST), "w") as f:
            json.dump(manifest, f)
        with self.assertRaisesRegex(ValueError, "moment_block is 64, this optimizer's 128"):
            self.make(clones(params), bucket_elements=40).load(directory)


@unittest.skipUnless(FP8, NO_FP8)
class FP8Optimizer(BlockScaledOptimizer):
    dtype = FP8
    tolerance = 20 * 1e-2 * 2.0 ** -3

    def test_by_name(self):
        opt = StreamedAdamW(make_params(), moment_dtype="fp8", store=make_store())
        self.assertEqual(opt._moment_dtype, FP8)


class FP8Refused(OptimTestCase):
    @unittest.skipIf(FP8, "this torch has torch.float8_e4m3fn")
    def test_fp8_without_float8_refused_saying_why(self):
        for name in ("fp8", "float8_e4m3fn", "torch.float8_e4m3fn"):
            with self.subTest(name=name):
                with self.assertRaisesRegex(ValueError, r"has no torch\.float8_e4m3fn; fp8 moments need PyTorch 2\.1"):
                    StreamedAdamW(make_params(), moment_dtype=name, store=make_store())

    def test_unknown_names_refused(self):
        with self.assertRaisesRegex(ValueError, "moment_dtype must be torch.float32, torch.bfloat16 or"):
            StreamedAdamW(make_params(), moment_dtype="fp4", store=make_store())


class Pipeline(OptimTestCase):
    def trained(self, depth, shapes=((60,), (40,), (50,), (30,)), bucket_elements=25, **options):
        store = Recording(make_store())
        params = make_params(shapes)
        opt = StreamedAdamW(params, bucket_elements=bucket_elements, depth=depth, store=store, **options)
        watch(opt, store)
        return opt, params, store

    def bucket_names(self, opt):
        return [b.name for buckets in opt._buckets for b in buckets]

    def test_first_step_reads_nothing(self):
        opt, params, store = self.trained(3)
        Trainer().step([(opt, params)])
        self.assertFalse([e for e in store.events if e[0] == "read"])
        self.assertEqual([e[1] for e in store.events if e[0] == "write"], self.bucket_names(opt))

    def test_reads_ahead_and_writes_behind_within_depth(self):
        for depth in (1, 2, 3, 4):
            with self.subTest(depth=depth):
                opt, params, store = self.trained(depth)
                trainer = Trainer()
                trainer.step([(opt, params)])
                self.assertLessEqual(store.most_live, depth)
                store.events.clear()
                trainer.t = 1  # step 2 updates every parameter
                trainer.step([(opt, params)])
                self.assertLessEqual(store.most_live, depth)
                names = self.bucket_names(opt)
                self.assertEqual(len(names), 8)
                events = store.events
                for k, name in enumerate(names):
                    update = events.index(("update", name))
                    self.assertLess(update, events.index(("write", name)))
                    if name in [e[1] for e in events if e[0] == "read"]:
                        self.assertLess(events.index(("wait-read", name)), update)
                    if depth >= 2 and k + 1 < len(names):
                        self.assertLess(events.index(("read", names[k + 1])), update,
                                        "the read of bucket %d is issued before bucket %d is updated" % (k + 1, k))
                    if depth >= 4 and k + 2 < len(names):
                        self.assertLess(events.index(("read", names[k + 2])), update)
                # the last write-backs are left in flight; flush waits for them
                def unwaited():
                    return [n for n in names if ("wait-write", n) not in events[events.index(("write", n)):]]

                self.assertTrue(unwaited())
                opt.flush()
                self.assertFalse(unwaited())
                self.assertEqual(store.live, 0)

    def test_bucket_still_in_memory_is_not_read_again(self):
        opt, params, store = self.trained(3, shapes=((20,), (20,)), bucket_elements=20)
        trainer = Trainer()
        trainer.step([(opt, params)])
        trainer.step([(opt, params)])
        self.assertFalse([e for e in store.events if e[0] == "read"])

    def test_prefetch_reads_the_first_buckets(self):
        opt, params, store = self.trained(3)
        trainer = Trainer()
        trainer.step([(opt, params)])
        opt.flush()
        store.events.clear()
        opt.prefetch()
        names = self.bucket_names(opt)
        self.assertEqual([e for e in store.events if e[0] == "read"], [("read", names[0]), ("read", names[1])])
        trainer.t = 1
        trainer.step([(opt, params)])
        self.assertEqual(sum(1 for e in store.events if e == ("read", names[0])), 1)

    def test_prefetch_on_backward(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(DEVICE)
        store = Recording(make_store())
        opt = StreamedAdamW(model.parameters(), bucket_elements=50, store=store, prefetch_on_backward=True)
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(DEVICE)
        reference.load_state_dict(model.state_dict())
        theirs = torch.optim.AdamW(reference.parameters())
        x = torch.randn(32, 8, device=DEVICE)
        for step in range(3):
            for m, o in ((model, opt), (reference, theirs)):
                o.zero_grad()
                m(x).square().mean().backward()
                if m is model and step > 0:
                    self.assertIn("read", [e[0] for e in store.events])  # during backward, before step()
                o.step()
            store.events.clear()
        for a, b in zip(model.parameters(), reference.parameters()):
            self.assertBitEqual(a.detach(), b.detach(), "param")

    def test_exit_waits_for_write_backs(self):
        store = make_store()
        params = make_params()
        opt = StreamedAdamW(params, bucket_elements=50, store=store)
        Trainer().step([(opt, params)])
        self.assertTrue(store.queue)
        optim._flush_live()  # what atexit runs
        self.assertFalse(store.queue)

    def test_store_errors_surface(self):
        store = make_store()
        params = make_params()
        opt = StreamedAdamW(params, bucket_elements=50, store=store)
        trainer = Trainer()
        trainer.step([(opt, params)])
        opt.flush()
        for name in store.written:
            store.written[name][:] = False  # as if never written: the next reads fail with ENODATA
        with self.assertRaises(tmsdisk.Error) as caught:
            trainer.step([(opt, params)])
        self.assertEqual(caught.exception.errno, errno.ENODATA)
        self.assertFalse(store.queue)  # nothing left in flight on the optimizer's buffers

    def test_refused_open_fails_the_step_before_any_update(self):
        store = make_store()
        params = make_params()
        before = clones(params)
        opt = StreamedAdamW(params, bucket_elements=100, store=store)
        opens = []

        def over_quota(name, nbytes):
            opens.append(name)
            if len(opens) > 2:
                raise tmsdisk.Error(errno.EDQUOT, "fake open(%r)" % name)
            return FakeStore.open(store, name, nbytes)

        store.open = over_quota
        with self.assertRaises(tmsdisk.Error) as caught:
            Trainer().step([(opt, params)])
        self.assertEqual(caught.exception.errno, errno.EDQUOT)
        for p, b in zip(params, before):
            self.assertBitEqual(p.detach(), b.detach(), "a parameter after the refused step")
        self.assertFalse(store.queue)
        self.assertEqual(opt.state_dict()["state"], {})


class PauseRelease(OptimTestCase):
    """What a pause's callback (optim._release_for_pause) does to the optimizers of the process."""

    def test_buckets_dropped_after_their_writes_and_read_back_next_step(self):
        params, reference = make_params(), make_params()
        store = Recording(make_store())
        ours = StreamedAdamW(groups_of(params), bucket_elements=100, store=store)
        theirs = torch.optim.AdamW(groups_of(reference))
        watch(ours, store)
        trainer = Trainer()
        for step in range(STEPS):
            trainer.step([(ours, params), (theirs, reference)])
            if step % 3 == 1:
                self.assertTrue(ours._pipeline.resident)
                store.events.clear()
                optim._release_for_pause()
                self.assertEqual(store.live, 0, "bucket buffers alive after the release")
                self.assertFalse(store.inner.queue, "operations left in flight")
                waits = [e for e in store.events if e[0] == "wait-write"]
                self.assertEqual(len(waits), len([e for e in store.events if e[0].startswith("wait")]))
                self.assertTrue(waits)
        for a, b in zip(params, reference):
            self.assertBitEqual(a.detach(), b.detach(), "param")
        self.assertSameState(ours.state_dict(), theirs.state_dict())

    def test_a_write_error_met_by_the_release_is_raised_by_the_next_step(self):
        store = make_store()
        params = make_params()
        opt = StreamedAdamW(params, bucket_elements=100, store=store)
        trainer = Trainer()
        trainer.step([(opt, params)])
        failing = store.queue[0]["ticket"]
        failing.rc = errno.EIO  # done, and failed
        store.queue.pop(0)
        optim._release_for_pause()  # quiet: it runs on the shim's thread
        self.assertFalse(opt._pipeline.resident)
        with self.assertRaises(tmsdisk.Error) as caught:
            trainer.step([(opt, params)])
        self.assertEqual(caught.exception.errno, errno.EIO)
        opt.flush()  # raised once

    def test_an_optimizer_in_a_step_on_another_thread_is_left_alone(self):
        import threading

        store = make_store()
        params = make_params()
        opt = StreamedAdamW(params, bucket_elements=100, store=store)
        Trainer().step([(opt, params)])
        held, go = threading.Event(), threading.Event()

        def in_step():
            with opt._lock:
                held.set()
                go.wait(30)

        thread = threading.Thread(target=in_step)
        thread.start()
        try:
            held.wait(30)
            optim._release_for_pause()  # must not wait for the lock
            self.assertTrue(opt._pipeline.resident)
        finally:
            go.set()
            thread.join()


class FakeCLibrary:
    """The C functions tmsdisk.store calls, as C-callable functions over Python, so that the calls go
    through ctypes' marshalling as they do into libtmsdisk.so. `calls` logs them; `rc` maps a function
    name to the -errno it returns instead of working."""

    def __init__(self, chunk=4096):
        from ctypes import CFUNCTYPE, POINTER, c_char_p, c_int, c_uint64, c_void_p

        self.calls, self.rc, self.chunk = [], {}, chunk
        u64p = POINTER(c_uint64)

        def fn(restype, *argtypes):
            return lambda body: CFUNCTYPE(restype, *argtypes)(body)

        def logged(name, result):
            def call(*args):
                self.calls.append((name,) + tuple(a.decode() if isinstance(a, bytes) else a for a in args
                                                  if not hasattr(a, "contents")))
                rc = self.rc.get(name, 0)
                return rc if rc else result(*args)
            return call

        def set_out(value):
            def body(*args):
                args[-1][0] = value
                return 0
            return body

        self.tmsdisk_version = fn(c_char_p)(lambda: b"tmsdisk 0.0-fake")
        self.tmsdisk_store_chunk_bytes = fn(c_uint64)(lambda: self.chunk)
        self.tmsdisk_store_open = fn(c_int, c_char_p, c_uint64, u64p)(logged("open", set_out(7)))
        self.tmsdisk_store_remove = fn(c_int, c_char_p)(logged("remove", lambda *a: 0))
        self.tmsdisk_store_write = fn(c_int, c_uint64, c_uint64, c_void_p, c_uint64, c_void_p, u64p)(
            logged("write", set_out(11)))
        self.tmsdisk_store_read = fn(c_int, c_uint64, c_uint64, c_void_p, c_uint64, c_void_p, u64p)(
            logged("read", set_out(12)))
        self.tmsdisk_store_prefetch = fn(c_int, c_uint64, c_uint64, c_uint64)(logged("prefetch", lambda *a: 0))
        self.tmsdisk_store_wait = fn(c_int, c_uint64)(logged("wait", lambda *a: 0))
        self.tmsdisk_store_flush = fn(c_int)(logged("flush", lambda *a: 0))


class StoreBindings(OptimTestCase):
    """tmsdisk.store's calls into the C API (through ctypes, over FakeCLibrary) and its errors."""

    def setUp(self):
        import tmsdisk
        from tmsdisk import store

        # The store's functions come through the package's lookup, which loads the library.
        self.package, self.store, self.lib = tmsdisk, store, FakeCLibrary()
        self.saved = tmsdisk._load
        tmsdisk._load = lambda call: self.lib

    def tearDown(self):
        self.package._load = self.saved

    def test_calls_pass_through(self):
        store, lib = self.store, self.lib
        self.assertEqual(store.chunk_bytes(), 4096)
        handle = store.open("opt.0.0", 1 << 20)
        self.assertEqual(handle, 7)
        cpu = torch.arange(8, dtype=torch.float32)
        ticket = store.write(handle, 4096, cpu)
        ticket.wait()
        ticket.wait()  # the C API refuses a second wait: the outcome is kept instead
        store.read(handle, 0, cpu, 16).wait()
        store.write(handle, 0, 12345, 64, stream=99).wait()
        store.prefetch(handle, 0, 4096)
        store.flush()
        store.remove("opt.0.0")
        self.assertEqual(lib.calls, [
            ("open", "opt.0.0", 1 << 20), ("write", 7, 4096, cpu.data_ptr(), 32, None), ("wait", 11),
            ("read", 7, 0, cpu.data_ptr(), 16, None), ("wait", 12), ("write", 7, 0, 12345, 64, 99), ("wait", 11),
            ("prefetch", 7, 0, 4096), ("flush",), ("remove", "opt.0.0")])

    def test_errors_say_what_to_do(self):
        store, lib = self.store, self.lib
        lib.rc["open"] = -errno.EEXIST
        with self.assertRaisesRegex(tmsdisk.Error, "remove it") as caught:
            store.open("x", 10)
        self.assertEqual(caught.exception.errno, errno.EEXIST)
        lib.rc["wait"] = -errno.ENODATA
        ticket = store.read(7, 0, torch.zeros(4))
        with self.assertRaisesRegex(tmsdisk.Error, "never written"):
            ticket.wait()
        with self.assertRaisesRegex(tmsdisk.Error, "never written"):
            ticket.wait()
        self.assertEqual(sum(1 for c in lib.calls if c[0] == "wait"), 1)
        lib.chunk = 0
        with self.assertRaisesRegex(tmsdisk.Error, "tmsctl run") as caught:
            store.chunk_bytes()
        self.assertEqual(caught.exception.errno, errno.ENOTCONN)
        calls = len(lib.calls)
        with self.assertRaises(tmsdisk.Error) as caught:
            store.open("caf\u00e9", 10)  # not ASCII: refused before C sees it
        self.assertEqual(caught.exception.errno, errno.EINVAL)
        with self.assertRaisesRegex(ValueError, "contiguous"):
            store.write(7, 0, torch.zeros(4, 4).t())
        self.assertEqual(len(lib.calls), calls)

    def test_older_library_named(self):
        del self.lib.tmsdisk_store_open
        with self.assertRaisesRegex(tmsdisk.Error, "API version 6") as caught:
            self.store.open("x", 10)
        self.assertEqual(caught.exception.errno, errno.ENOSYS)


# --- the real store --------------------------------------------------------------------------------
# The cases below run optim_app.py under libtmsdisk.so (LD_PRELOAD) with simcuda as libcuda, against a
# tmsdiskd of their own on temp roots. CTest passes the programs' paths as the `python` test's are:
# TMSDISKD, SHIM, SIMCUDA_DIR (PYTHON_DIR and TEST_TMPDIR as above); without them they are skipped.

STORE_NEEDED = ("TMSDISKD", "SHIM", "SIMCUDA_DIR")
CHILD_TIMEOUT_S = 180  # torch's import takes seconds on a loaded machine; a hang fails instead of blocking
NOBODY = 65534


def python_path():
    """The start-up module's directory and the package's: the build's (PYTHON_DIR holds both, as
    `tmsctl run` puts it on the path), or the source tree's."""
    built = os.environ.get("PYTHON_DIR")
    if built:
        return [built]
    source = os.path.join(HERE, "..", "..", "python")
    return [os.path.join(source, "startup"), source]


class RealStoreCase(OptimTestCase):
    """A tmsdiskd per test (some kill or restart it), with a 4 MiB chunk; a fresh simcuda device per child."""

    daemon_args = ()
    app = "optim_app.py"  # the program whose scenarios start() runs (other test files bring their own)

    def setUp(self):
        lacking = [n for n in STORE_NEEDED if not os.environ.get(n) or not os.path.exists(os.environ[n])]
        if lacking:
            self.skipTest("the real store needs %s (CTest passes them)" % ", ".join(lacking))
        import shutil
        import tempfile

        from test_tmsdisk import Daemon

        base = os.environ.get("TEST_TMPDIR") or None
        if base:
            os.makedirs(base, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="optim.", dir=base)
        self.addCleanup(shutil.rmtree, self.work, ignore_errors=True)
        self.daemon = Daemon(self.work, self.daemon_args)
        self.addCleanup(self.daemon.stop)

    def child_env(self, job, extra=None):
        import tempfile

        env = dict(os.environ)
        # The children run on simcuda, whose device memory is host memory (the pause case relies on it):
        # their tensors stay on the CPU whatever TEST_OPTIM_DEVICE says.
        for name in ("LD_PRELOAD", "PYTHONPATH", "TMSDISK_LIBRARY", "TMS_DISK_BACKUP_DIR", "TMSDISK_STREAM_OPTIMIZER",
                     "TEST_OPTIM_DEVICE"):
            env.pop(name, None)
        state = tempfile.NamedTemporaryFile(dir=self.work, prefix="simcuda.", delete=False)
        state.close()
        os.chmod(state.name, 0o666)  # also for a child that runs as another user
        env.update(
            LD_PRELOAD=os.environ["SHIM"],
            LD_LIBRARY_PATH=os.environ["SIMCUDA_DIR"],
            SIMCUDA_STATE=state.name,
            SIMCUDA_DEVICE_MEM_MB="256",
            TMSDISK_SOCKET=self.daemon.socket,
            TMSDISK_JOB=job,
            PYTHONPATH=":".join(python_path()),
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.update(extra or {})
        return env

    def start(self, scenario, extra_env=None, user=None):
        """optim_app.py SCENARIO under the shim, its stdin and stdout pipes to talk to it."""
        import queue
        import subprocess
        import threading

        job = "optim-" + scenario
        child = subprocess.Popen([sys.executable, os.path.join(HERE, self.app), scenario], cwd=HERE,
                                 env=self.child_env(job, extra_env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, user=user, group=user,
                                 extra_groups=[] if user is not None else None)
        child.job, child.lines, child.incoming = job, [], queue.Queue()

        # A thread reads the lines: select() on the pipe beside readline() would miss lines that one read
        # brought into the file object's buffer together, and wait for more that never come.
        def reader():
            for line in child.stdout:
                child.incoming.put(line)
            child.incoming.put(None)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()

        def end():
            if child.poll() is None:
                child.kill()
            child.wait()
            thread.join(CHILD_TIMEOUT_S)
            child.stdin.close()
            child.stdout.close()

        self.addCleanup(end)
        return child

    def read_until(self, child, prefix):
        """The child's next line starting with `prefix` (its other lines kept); fails if it ends first or
        says nothing for CHILD_TIMEOUT_S."""
        import queue

        while True:
            try:
                line = child.incoming.get(timeout=CHILD_TIMEOUT_S)
            except queue.Empty:
                line = None
            if line is None:
                child.kill()
                self.fail("%s: no %r line within %d s; its output:\n%s\ndaemon log:\n%s" % (
                    child.args[2:], prefix, CHILD_TIMEOUT_S, "".join(child.lines), self.daemon.log()))
            child.lines.append(line)
            if line.startswith(prefix):
                return line.rstrip("\n")

    def tell(self, child, line):
        child.stdin.write(line + "\n")
        child.stdin.flush()

    def finish(self, child, scenario):
        self.read_until(child, "OK " + scenario)
        child.wait(timeout=CHILD_TIMEOUT_S)
        while True:
            line = child.incoming.get(timeout=CHILD_TIMEOUT_S)
            if line is None:
                break
            child.lines.append(line)
        out = "".join(child.lines)
        self.assertEqual(child.returncode, 0, "%s exited %d:\n%s\ndaemon log:\n%s" % (
            scenario, child.returncode, out, self.daemon.log()))
        return out

    def run_scenario(self, scenario, extra_env=None):
        return self.finish(self.start(scenario, extra_env), scenario)

    def assertGone(self, directory, since):
        """The rank's directory goes within 30 s (the daemon removes it once the connection ends)."""
        import time

        deadline = time.monotonic() + 30
        while os.path.exists(directory) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertFalse(os.path.exists(directory), "%s is still there 30 s after %s; daemon log:\n%s" % (
            directory, since, self.daemon.log()))

    def rank_dir(self, child, uid=None):
        """The child's rank directory on the daemon's root: <root>/<uid>/<job>/rank<R>-<pid>."""
        import glob

        uid = os.getuid() if uid is None else uid
        found = glob.glob(os.path.join(self.daemon.root, str(uid), child.job, "rank*-%d" % child.pid))
        self.assertEqual(len(found), 1, "the rank directory of pid %d under %s: %s" % (
            child.pid, self.daemon.root, found))
        return found[0]


class RealStore(RealStoreCase):
    def test_adamw_and_adam_bit_identical_to_torch_through_the_daemon(self):
        self.run_scenario("matches-torch")

    def test_checkpoint_saved_and_loaded_through_the_daemon(self):
        self.run_scenario("checkpoint")

    def test_block_scaled_moments_through_the_daemon(self):
        out = self.run_scenario("block-scaled")
        print("\n  " + "\n  ".join(line for line in out.splitlines() if "through the daemon" in line), file=sys.stderr)

    def test_a_bucket_written_reads_back_intact_and_goes_at_exit(self):
        child = self.start("roundtrip")
        self.read_until(child, "WRITTEN")
        directory = self.rank_dir(child)
        self.assertTrue(os.stat(os.path.join(directory, "objects")).st_blocks > 0)
        self.tell(child, "exit")
        self.finish(child, "roundtrip")
        self.assertGone(directory, "its process exited")

    def test_daemon_killed_mid_step_then_restarted_keeps_the_committed_state(self):
        child = self.start("daemon-killed")
        self.read_until(child, "MID-STEP")
        self.daemon.kill()
        self.tell(child, "killed")
        failed = self.read_until(child, "STEP-FAILED")
        self.read_until(child, "WAITING")
        self.daemon.start()  # the same roots and socket
        self.tell(child, "restarted")
        out = self.finish(child, "daemon-killed")
        print("\n  " + failed, file=sys.stderr)
        self.assertIn("OK daemon-killed", out)

    def test_killed_rank_has_its_objects_reclaimed(self):
        import signal

        child = self.start("rank-killed")
        self.read_until(child, "WRITTEN")
        directory = self.rank_dir(child)
        self.assertTrue(os.path.getsize(os.path.join(directory, "objects")) > 0)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        self.assertGone(directory, "its rank was killed")

    def test_a_flipped_byte_fails_the_read_with_ebadmsg(self):
        child = self.start("seal")
        marker = bytes.fromhex(self.read_until(child, "WRITTEN").split()[1])
        path = os.path.join(self.rank_dir(child), "objects")
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(marker)
            self.assertGreaterEqual(at, 0, "the object's bytes are not in %s" % path)
            self.assertEqual(data.find(marker, at + 1), -1)
            f.seek(at + 21)
            f.write(bytes([data[at + 21] ^ 0x10]))
        self.tell(child, "flipped")
        print("\n  " + self.read_until(child, "READ-FAILED"), file=sys.stderr)
        self.finish(child, "seal")


class RealStoreQuota(RealStoreCase):
    daemon_args = ("--max-chunks-per-uid", "3")

    def test_over_the_users_chunks_refused_before_a_byte_moves(self):
        if os.getuid() != 0:
            self.skipTest("max-chunks-per-uid does not limit root, and only root can run the child as user %d"
                          % NOBODY)
        os.chmod(self.work, 0o755)  # the socket and the simcuda ledger, for that user
        child = self.start("over-quota", {"HOME": self.work}, user=NOBODY)
        self.read_until(child, "REFUSED")
        directory = self.rank_dir(child, NOBODY)
        print("\n  rank directory: %s" % sorted(os.listdir(directory)), file=sys.stderr)
        path = os.path.join(directory, "objects")
        self.assertFalse(os.path.exists(path) and os.stat(path).st_blocks, "%s holds bytes" % path)
        self.tell(child, "checked")
        self.finish(child, "over-quota")


class PauseBetweenSteps(RealStoreCase):
    def test_a_pause_moves_parameters_and_gradients_not_buckets(self):
        out = self.run_scenario("pause-between-steps")
        print("\n  " + "\n  ".join(line for line in out.splitlines() if line.startswith("PAUSED")), file=sys.stderr)


class DistributedDataParallelRanks(RealStoreCase):
    def setUp(self):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("this torch (%s) has no torch.distributed with gloo" % torch.__version__)
        super().setUp()

    def tmsctl_sessions(self):
        """`tmsctl status --json`'s sessions, where CTest names tmsctl (TMSCTL), else None."""
        import json
        import subprocess

        tmsctl = os.environ.get("TMSCTL")
        if not tmsctl or not os.path.exists(tmsctl):
            return None
        out = subprocess.run([tmsctl, "--socket", self.daemon.socket, "status", "--json"], capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        return json.loads(out.stdout)

    def test_two_ranks_each_stream_their_own_objects_bit_identical_to_torch(self):
        import socket

        with socket.socket() as s:  # a free port for the rendezvous, on the loopback
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", GLOO_SOCKET_IFNAME="lo")
        children = [self.start("ddp", dict(env, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in range(2)]
        said = [dict(field.split("=", 1) for field in self.read_until(c, "WRITTEN").split()[1:]) for c in children]
        self.assertEqual([int(s["rank"]) for s in said], [0, 1])
        self.assertEqual(said[0]["sha256"], said[1]["sha256"], "the ranks' parameters differ")
        directories = [self.rank_dir(c) for c in children]
        for rank, (child, directory) in enumerate(zip(children, directories)):
            self.assertTrue(os.path.basename(directory).startswith("rank%d-" % rank), directory)
            self.assertGreater(int(said[rank]["objects"]), 1)
            self.assertGreater(os.stat(os.path.join(directory, "objects")).st_blocks, 0,
                               "rank %d's objects are not in its own directory %s" % (rank, directory))
        sessions = self.tmsctl_sessions()
        if sessions is not None:
            for rank, child in enumerate(children):
                mine = [s for s in sessions if s["pid"] == child.pid]
                self.assertEqual(len(mine), 1, "the session of rank %d: %s" % (rank, sessions))
                self.assertEqual(mine[0]["objects"], int(said[rank]["objects"]), mine[0])
        for child in children:
            self.tell(child, "exit")
        for child in children:
            self.finish(child, "ddp")
        for rank, directory in enumerate(directories):
            self.assertGone(directory, "rank %d exited" % rank)
        print("\n  2 ranks, gloo: parameters SHA-256 %s on both; %s objects each; tmsctl status %s" % (
            said[0]["sha256"][:16], said[0]["objects"], "checked" if sessions is not None else "not run (no TMSCTL)"),
            file=sys.stderr)


class StreamOptimizerStartup(RealStoreCase):
    """TMSDISK_STREAM_OPTIMIZER (tmsctl run --stream-optimizer): the start-up module's replacement of
    torch.optim.AdamW and Adam."""

    def test_adamw_is_streamed_with_the_moments_asked(self):
        for setting in ("fp32", "bf16", "fp8") if FP8 else ("fp32", "bf16"):
            with self.subTest(setting=setting):
                self.run_scenario("stream-optimizer", {"TMSDISK_STREAM_OPTIMIZER": setting})

    def test_bucket_size_from_the_environment(self):
        self.run_scenario("stream-optimizer", {"TMSDISK_STREAM_OPTIMIZER": "bf16", "TMSDISK_STREAM_BUCKET_ELEMENTS": "100"})

    def python(self, code, setting):
        import subprocess

        env = self.child_env("optim-startup", {"TMSDISK_STREAM_OPTIMIZER": setting} if setting else None)
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S)

    def test_torch_not_imported_by_the_module(self):
        for setting in (None, "fp32"):
            with self.subTest(setting=setting):
                done = self.python("import sys; print('torch' in sys.modules)", setting)
                self.assertEqual((done.returncode, done.stdout.strip()), (0, "False"), done.stderr)
        done = self.python("import torch; print(torch.optim.AdamW.__module__)", None)
        self.assertEqual(done.stdout.strip(), "torch.optim.adamw", done.stderr)

    def test_unknown_values_refused_at_start(self):
        done = self.python("print('ran')", "fp16")
        self.assertEqual(done.returncode, 2, done.stdout + done.stderr)
        self.assertNotIn("ran", done.stdout)
        self.assertIn("TMSDISK_STREAM_OPTIMIZER=fp16", done.stderr)
        self.assertIn("not one of fp32, bf16, fp8", done.stderr)

    @unittest.skipIf(FP8, "this torch has torch.float8_e4m3fn: test_adamw_is_streamed_with_the_moments_asked runs fp8")
    def test_fp8_without_float8_fails_the_import_saying_so(self):
        done = self.python("import torch; print('ran')", "fp8")
        self.assertNotEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertNotIn("ran", done.stdout)
        self.assertIn("TMSDISK_STREAM_OPTIMIZER=fp8", done.stderr)
        self.assertIn("has no torch.float8_e4m3fn; fp8 moments need PyTorch 2.1 or later", done.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
