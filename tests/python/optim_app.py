# SPDX-License-Identifier: Apache-2.0
"""A program for test_optim.py's real-store cases: /usr/bin/python3 optim_app.py SCENARIO, run with
libtmsdisk.so preloaded, simcuda as libcuda and tmsdiskd at TMSDISK_SOCKET.

Each scenario uses tmsdisk.store and tmsdisk.optim against the real daemon and asserts what it sees; it
prints "OK SCENARIO" last, or fails with a traceback (exit status 1). Scenarios that need the test to
act midway (kill the daemon, flip a byte) print a line saying so and wait for a line on stdin.
"""

import ctypes
import errno
import os
import sys
import weakref

import torch

import tmsdisk
from tmsdisk import optim, store
from tmsdisk.optim import StreamedAdam, StreamedAdamW

from cudadriver import Driver
from test_optim import FP8, STEPS, BlockScaledOptimizer, FP8Optimizer, Trainer, block_scaled, groups_of, make_params

MiB = 1 << 20


def say(line):
    print(line, flush=True)


def expect(line):
    got = sys.stdin.readline().strip()
    assert got == line, "the test said %r, not %r" % (got, line)


def expect_error(err, fn, *args):
    try:
        fn(*args)
    except tmsdisk.Error as e:
        assert e.errno == err, "%s raised errno %s (%s), %s expected" % (fn, e.errno, e, errno.errorcode[err])
        return e
    raise AssertionError("%s raised nothing, %s expected" % (fn, errno.errorcode[err]))


def bit_equal(ours, theirs, what):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, "%s: %s %s against %s %s" % (
        what, ours.dtype, tuple(ours.shape), theirs.dtype, tuple(theirs.shape))
    assert torch.equal(ours, theirs), "%s differs: max |diff| %g" % (
        what, (ours.double() - theirs.double()).abs().max().item())


def same_state(ours, theirs):
    assert sorted(ours["state"]) == sorted(theirs["state"]), (sorted(ours["state"]), sorted(theirs["state"]))
    for index, entry in theirs["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            bit_equal(ours["state"][index][key], entry[key], "%s of parameter %d" % (key, index))


def snapshot(opt):
    """The optimizer's state_dict, its tensors cloned (a later step must not change them)."""
    state = opt.state_dict()
    state["state"] = {i: {k: v.clone() for k, v in e.items()} for i, e in state["state"].items()}
    return state


def pattern_tensor(nbytes, seed):
    """nbytes of float32 values that no other seed gives, none of them zero."""
    return torch.arange(nbytes // 4, dtype=torch.float32) * 1.25 + 1000.0 * seed + 0.5


def scenario_matches_torch():
    """StreamedAdamW (and StreamedAdam) with fp32 moments against torch's own, 20 steps, through the
    daemon: buckets smaller than one tensor, two param groups, and a single group at depth 2."""
    cases = (
        (StreamedAdamW, torch.optim.AdamW, dict(bucket_elements=100, depth=3), True, {"weight_decay": 0.1}),
        (StreamedAdamW, torch.optim.AdamW, dict(bucket_elements=256, depth=2), False, {}),
        (StreamedAdam, torch.optim.Adam, dict(bucket_elements=100, depth=3), True, {"weight_decay": 0.01}),
    )
    for ours_class, torch_class, streaming, grouped, options in cases:
        params, reference = make_params(), make_params()
        arrange = groups_of if grouped else (lambda ps: ps)
        ours = ours_class(arrange(params), lr=1e-2, **streaming, **options)
        theirs = torch_class(arrange(reference), lr=1e-2, **options)
        biggest = max(p.numel() for p in params)
        assert streaming["bucket_elements"] < biggest, "a tensor must span buckets"
        trainer = Trainer()
        for _ in range(STEPS):
            trainer.step([(ours, params), (theirs, reference)])
        what = "%s %s" % (ours_class.__name__, streaming)
        for i, (p, r) in enumerate(zip(params, reference)):
            bit_equal(p.detach(), r.detach(), "%s: parameter %d" % (what, i))
        same_state(ours.state_dict(), theirs.state_dict())
        ours.close()  # its objects go
        for bucket in (b for buckets in ours._buckets for b in buckets):
            expect_error(errno.ENOENT, store.remove, bucket.name)
    say("OK matches-torch")


def scenario_objects_first():
    """Device memory a pause would back up, and host-tier memory asked for it ahead of a pause (the
    daemon's host-tier-ahead): the test waits for that grant, then the objects opened here get the
    rank's share first: the shim gives the idle grant back before asking for their memory."""
    chunk = store.chunk_bytes()  # the session opens: only then does the shim ask ahead of a pause
    drv = Driver()
    ptr = drv.alloc(24 * MiB)
    drv.write(ptr, bytes([3]) * (24 * MiB))
    say("ALLOCATED")
    expect("open")
    handles = [store.open("first.%d" % i, chunk) for i in range(4)]
    written = [pattern_tensor(chunk, 20 + i) for i in range(4)]  # alive until the flush: the writes read them
    for h, t in zip(handles, written):
        store.write(h, 0, t)
    store.flush()
    for i, (h, t) in enumerate(zip(handles, written)):
        got = torch.zeros_like(t)
        store.read(h, 0, got).wait()
        bit_equal(got, t, "object %d" % i)
    say("OPENED")
    expect("exit")
    assert drv.read(ptr, 24 * MiB) == bytes([3]) * (24 * MiB)
    say("OK objects-first")


def scenario_checkpoint():
    """save() after 10 steps, load() into a fresh optimizer over fresh identical parameters, 10 more
    steps: bit-identical to the uninterrupted one and to torch's; a tampered file refused."""
    import tempfile
    directory = tempfile.mkdtemp(prefix="optim-ckpt-")
    params, reference = make_params(), make_params()
    ours = StreamedAdamW(groups_of(params), lr=1e-2, bucket_elements=100, weight_decay=0.1)
    theirs = torch.optim.AdamW(groups_of(reference), lr=1e-2, weight_decay=0.1)
    trainer = Trainer()
    for _ in range(STEPS // 2):
        trainer.step([(ours, params), (theirs, reference)])
    ours.save(directory)
    copy = [p.detach().clone().requires_grad_() for p in params]
    other = StreamedAdamW(groups_of(copy), lr=1e-2, bucket_elements=100, depth=2)
    other.load(directory)
    for _ in range(STEPS - STEPS // 2):
        trainer.step([(ours, params), (other, copy), (theirs, reference)])
    for i, (a, b, r) in enumerate(zip(params, copy, reference)):
        bit_equal(b.detach(), a.detach(), "parameter %d against the uninterrupted" % i)
        bit_equal(b.detach(), r.detach(), "parameter %d against torch" % i)
    same_state(other.state_dict(), ours.state_dict())
    same_state(other.state_dict(), theirs.state_dict())
    victim = os.path.join(directory, sorted(n for n in os.listdir(directory) if n.endswith(".bucket"))[0])
    with open(victim, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    try:
        StreamedAdamW(groups_of([p.detach().clone().requires_grad_() for p in params]), bucket_elements=100).load(
            directory)
    except ValueError as e:
        assert "SHA-256" in str(e), e
    else:
        raise AssertionError("a tampered file was loaded")
    import shutil
    shutil.rmtree(directory)
    say("OK checkpoint")


def scenario_roundtrip():
    """A bucket's bytes written and read back, over several chunks and a partial last one; a range
    rewritten; reads of what was never written refused."""
    chunk = store.chunk_bytes()
    size = 2 * chunk + chunk // 2 + 4096
    handle = store.open("roundtrip.bucket", size)
    assert store.open("roundtrip.bucket", size) == handle, "the same object, the same handle"
    expect_error(errno.EEXIST, store.open, "roundtrip.bucket", size + 4096)
    expect_error(errno.ENODATA, lambda: store.read(handle, 0, torch.empty(size, dtype=torch.uint8)).wait())
    written = pattern_tensor(size, 1)
    store.write(handle, 0, written).wait()
    back = torch.zeros_like(written)
    store.read(handle, 0, back).wait()
    bit_equal(back, written, "the object read back")
    # The second chunk again, then the whole: the new bytes there, the old ones around them.
    second = pattern_tensor(chunk, 2)
    store.write(handle, chunk, second).wait()
    expected = written.clone()
    expected[chunk // 4 : 2 * chunk // 4] = second
    back.zero_()
    store.read(handle, 0, back).wait()
    bit_equal(back, expected, "the object after a range was rewritten")
    # Many queued at once, then a flush: every one done.
    others = [pattern_tensor(chunk, 10 + i) for i in range(4)]
    handles = [store.open("roundtrip.%d" % i, chunk) for i in range(4)]
    for h, t in zip(handles, others):
        store.write(h, 0, t)
    store.flush()
    for h, t in zip(handles, others):
        got = torch.zeros_like(t)
        store.read(h, 0, got).wait()
        bit_equal(got, t, "object %d after a flush" % h)
    expect_error(errno.EINVAL, store.write, handle, 4096, written[: 1024])  # not at a chunk boundary
    store.remove("roundtrip.bucket")
    expect_error(errno.ENOENT, store.remove, "roundtrip.bucket")
    say("WRITTEN")  # the test looks at the rank's files, then at their absence once this process exits
    expect("exit")
    say("OK roundtrip")


def scenario_daemon_killed():
    """The daemon is killed in the middle of a step: the step raises tmsdisk.Error; once it is back (the
    test restarts it on the same roots and socket) the state committed before that step reads back intact,
    and training goes on."""
    params = make_params()
    opt = StreamedAdamW(groups_of(params), lr=1e-2, bucket_elements=100, depth=3)
    trainer = Trainer()
    for _ in range(3):
        trainer.step([(opt, params)])
    opt.flush()
    committed = snapshot(opt)
    update, stopped = opt._update, []

    def stop_midway(bucket, buffer, before, after):
        if not stopped:
            stopped.append(bucket.name)
            say("MID-STEP")  # the test kills the daemon now
            expect("killed")
        update(bucket, buffer, before, after)

    opt._update = stop_midway
    try:
        trainer.step([(opt, params)])
    except tmsdisk.Error as e:
        say("STEP-FAILED errno=%s %s" % (errno.errorcode.get(e.errno, e.errno), e))
    else:
        raise AssertionError("the step went through with the daemon killed in its middle")
    opt._update = update
    say("WAITING")  # for the daemon's restart
    expect("restarted")
    same_state(snapshot(opt), committed)
    trainer.step([(opt, params)])  # the store works again
    opt.flush()
    steps = {int(e["step"]) for e in opt.state_dict()["state"].values()}
    assert steps and max(steps) <= 4, steps
    say("OK daemon-killed")


def scenario_rank_killed():
    """Objects written, then the process waits to be killed: the test checks that its rank directory goes."""
    params = make_params()
    opt = StreamedAdamW(params, bucket_elements=100)
    Trainer().step([(opt, params)])
    opt.flush()
    say("WRITTEN")
    sys.stdin.readline()  # killed before anything comes


def scenario_over_quota():
    """Over the user's max-chunks-per-uid: refused before any byte moves (the test checks the files)."""
    chunk = store.chunk_bytes()
    expect_error(errno.EDQUOT, store.open, "too.big", 64 * chunk)
    # The optimizer: the step opens every object it will write before it updates a parameter.
    # One bucket of 2 x 2 chunks of fp32 moments: more than the 3 chunks the test allows.
    params = [torch.randn(2 * chunk // 4, generator=torch.Generator().manual_seed(3)).requires_grad_()]
    before = params[0].detach().clone()
    opt = StreamedAdamW(params, bucket_elements=params[0].numel())
    params[0].grad = torch.ones_like(params[0])
    expect_error(errno.EDQUOT, opt.step)
    bit_equal(params[0].detach(), before, "the parameter after the refused step")
    assert opt.state_dict()["state"] == {}
    say("REFUSED")
    expect("checked")
    say("OK over-quota")


def scenario_seal():
    """A byte flipped in the objects file: the read raises EBADMSG instead of handing the bytes over."""
    chunk = store.chunk_bytes()
    handle = store.open("sealed", chunk)
    data = pattern_tensor(chunk, 7)
    store.write(handle, 0, data).wait()
    store.flush()
    say("WRITTEN %s" % ctypes.string_at(data.data_ptr(), 64).hex())  # what the test looks for in the file
    expect("flipped")
    back = torch.zeros_like(data)
    e = expect_error(errno.EBADMSG, lambda: store.read(handle, 0, back).wait())
    say("READ-FAILED %s" % e)
    say("OK seal")


class DeviceAllocator:
    """PyTorch's CUDA caching allocator, as far as this test needs it, over simcuda's memory through the
    shim: blocks that the shim manages (and a pause moves) seen as CPU tensors (simcuda's device memory is
    host memory), returned to a cache when their tensor goes, released by empty_cache()."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.cache = {}  # size -> [addresses]
        self.live = {}  # id -> (size, address)
        self.freed = 0

    def tensor(self, nbytes, dtype=torch.uint8):
        size = (nbytes + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)  # the shim manages 2 MiB and more
        free = self.cache.get(size)
        address = free.pop() if free else self.cuda.alloc(size)
        raw = (ctypes.c_char * nbytes).from_address(address)
        t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
        weakref.finalize(t, self.cache.setdefault(size, []).append, address)
        return t

    def empty_cache(self):
        self.cuda.make_current()  # the shim's thread calls it too
        for size, addresses in self.cache.items():
            while addresses:
                self.cuda.free(addresses.pop())
                self.freed += size


def scenario_pause_between_steps():
    """A model on the device, StreamedAdamW, a pause between steps: only parameters and gradients move, the
    buckets in memory are let go before (and read back by the next step), which stays bit-identical."""
    cuda = Driver()
    device = DeviceAllocator(cuda)
    torch.cuda.is_initialized = lambda: True  # PyTorch's CUDA, as this test has it
    torch.cuda.empty_cache = device.empty_cache
    optim._Pipeline.new_buffer = lambda self, bucket: device.tensor(bucket.nbytes)

    shapes = [(512, 1024), (256, 1024), (256, 1024)]  # 4 MiB of fp32 in all: two managed blocks
    numel = sum(a * b for a, b in shapes)
    params_arena = device.tensor(numel * 4, torch.float32)
    grads_arena = device.tensor(numel * 4, torch.float32)
    reference = make_params(shapes)
    params, at = [], 0
    for r in reference:
        p = params_arena[at : at + r.numel()].view(r.shape)
        p.copy_(r.detach())
        params.append(p.requires_grad_())
        at += r.numel()
    resident_model = 2 * numel * 4

    def set_grads(grads):
        at = 0
        for p, r, g in zip(params, reference, grads):
            slot = grads_arena[at : at + p.numel()].view(p.shape)
            slot.copy_(g)
            p.grad = slot
            r.grad = g.clone()
            at += p.numel()

    # 2 MiB buckets (fp32 moments of 256 Ki elements): 4 of them, 3 in memory at once.
    ours = StreamedAdamW(params, lr=1e-2, weight_decay=0.1, bucket_elements=256 * 1024, depth=3)
    theirs = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        set_grads([torch.randn(s, generator=gen) for s in shapes])
        ours.step()
        theirs.step()
        if step in (4, 11):
            before = tmsdisk.status().resident_bytes
            assert before >= resident_model + 3 * 2 * MiB, "buckets in memory before the pause: %d bytes" % before
            freed = device.freed
            tmsdisk.pause()
            st = tmsdisk.status()
            assert st.state == "paused", st
            assert st.paused_bytes <= resident_model * 1.01, "paused %d bytes, the model's %d" % (
                st.paused_bytes, resident_model)
            assert st.paused_bytes >= resident_model, st
            assert device.freed - freed >= 3 * 2 * MiB, "the buckets' memory went back to the driver"
            tmsdisk.resume()
            say("PAUSED %d bytes; %d were resident before the pause; parameters and gradients %d" % (
                st.paused_bytes, before, resident_model))
    for i, (p, r) in enumerate(zip(params, reference)):
        bit_equal(p.detach(), r.detach(), "parameter %d" % i)
    same_state(ours.state_dict(), theirs.state_dict())
    say("OK pause-between-steps")


def scenario_stream_optimizer():
    """Under the start-up module with TMSDISK_STREAM_OPTIMIZER set: torch.optim.AdamW is StreamedAdamW."""
    setting = os.environ["TMSDISK_STREAM_OPTIMIZER"]
    moment_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8}[setting]
    params, reference = make_params(), make_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    assert isinstance(opt, StreamedAdamW), type(opt)
    assert opt._moment_dtype == moment_dtype, opt._moment_dtype
    asked = os.environ.get("TMSDISK_STREAM_BUCKET_ELEMENTS")
    assert opt._bucket_elements == (int(asked) if asked else 200_000_000), opt._bucket_elements
    assert isinstance(torch.optim.Adam(make_params()), StreamedAdam)
    from torch.optim import AdamW  # pylint: disable=import-outside-toplevel

    assert AdamW is torch.optim.AdamW
    theirs = StreamedAdamW._torch_class(reference, lr=1e-2)  # torch's own, kept by tmsdisk.optim
    assert not isinstance(theirs, StreamedAdamW)
    trainer = Trainer()
    for _ in range(5):
        trainer.step([(opt, params), (theirs, reference)])
    for i, (p, r) in enumerate(zip(params, reference)):
        if moment_dtype == torch.float32:
            bit_equal(p.detach(), r.detach(), "parameter %d" % i)
        else:  # 5 steps of lr 1e-2, each off by at most a step of the moments' grid (bf16 2^-8, e4m3 2^-3)
            atol = 5 * 1e-2 * (2.0 ** -3 if moment_dtype == FP8 else 2.0 ** -8)
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=atol)
    say("OK stream-optimizer")


def scenario_block_scaled():
    """Block-scaled moments through the daemon: float16 (the codec that every torch runs) and fp8 where
    torch has it. 20 steps against torch's AdamW within the tests' tolerance, with buckets smaller than a
    tensor; each object of the layout's size; a checkpoint saved and loaded continuing bit-identical."""
    import tempfile
    import shutil

    cases = [(torch.float16, BlockScaledOptimizer.tolerance)]
    if FP8 is not None:
        cases.append((FP8, FP8Optimizer.tolerance))
    for dtype, tolerance in cases:
        with block_scaled(dtype):
            params, reference = make_params(), make_params()
            ours = StreamedAdamW(groups_of(params), lr=1e-2, weight_decay=0.1, bucket_elements=100, moment_dtype=dtype)
            theirs = torch.optim.AdamW(groups_of(reference), lr=1e-2, weight_decay=0.1)
            trainer = Trainer()
            for _ in range(STEPS // 2):
                trainer.step([(ours, params), (theirs, reference)])
            directory = tempfile.mkdtemp(prefix="optim-ckpt-")
            ours.save(directory)
            copy = [p.detach().clone().requires_grad_() for p in params]
            other = StreamedAdamW(groups_of(copy), lr=1e-2, weight_decay=0.1, bucket_elements=100, moment_dtype=dtype,
                                  depth=2)
            other.load(directory)
            shutil.rmtree(directory)
            for _ in range(STEPS - STEPS // 2):
                trainer.step([(ours, params), (other, copy), (theirs, reference)])
            worst = max((p - r).abs().max().item() for p, r in zip(params, reference))
            assert 0 < worst <= tolerance, "%s: a parameter %g from torch's (tolerance %g)" % (dtype, worst, tolerance)
            for i, (a, b) in enumerate(zip(params, copy)):
                bit_equal(b.detach(), a.detach(), "%s: parameter %d after the checkpoint" % (dtype, i))
            ours.flush()
            size = torch.empty((), dtype=dtype).element_size()
            for bucket in (b for buckets in ours._buckets for b in buckets):
                blocks = -(-bucket.numel // 128)
                up = -(-bucket.numel * size // 64) * 64
                expected = 2 * up + -(-blocks * 4 // 64) * 64 + blocks * 4
                assert bucket.nbytes == expected, (bucket.name, bucket.nbytes, expected)
                store.open(bucket.name, expected)  # the daemon's object has that size...
                expect_error(errno.EEXIST, store.open, bucket.name, expected + 64)  # ...and no other
            say("%s: 20 steps through the daemon, at most %.2e from torch's AdamW (tolerance %.2e)" % (
                dtype, worst, tolerance))
            ours.close()
            other.close()
    say("OK block-scaled")


def scenario_ddp():
    """One rank of two (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the test): a model in
    DistributedDataParallel over gloo on the CPU, each rank with data of its own, StreamedAdamW through
    this rank's store; beside it torch.optim.AdamW on a copy of the model given the same averaged
    gradients. After STEPS steps: bit-identical to it, and the same on both ranks (all_gather). Prints the
    parameters' SHA-256 and its objects, then waits while the test looks at each rank's directory."""
    import copy
    import hashlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env://: MASTER_ADDR, MASTER_PORT
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    ours = StreamedAdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, bucket_elements=100)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(10 + rank)  # the ranks' gradients differ until DDP averages them
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        ours.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            r.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for i, (p, r) in enumerate(zip(model.parameters(), reference.parameters())):
        bit_equal(p.detach(), r.detach(), "rank %d: parameter %d" % (rank, i))
    same_state(ours.state_dict(), theirs.state_dict())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    for other, theirs_flat in enumerate(gathered):
        bit_equal(theirs_flat, flat, "rank %d's parameters on rank %d" % (other, rank))
    ours.flush()
    buckets = [b for group in ours._buckets for b in group]
    say("WRITTEN rank=%d objects=%d bytes=%d sha256=%s" % (
        rank, len(buckets), sum(b.nbytes for b in buckets), hashlib.sha256(flat.numpy().tobytes()).hexdigest()))
    expect("exit")
    dist.destroy_process_group()
    say("OK ddp")


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1].replace("-", "_")]()
