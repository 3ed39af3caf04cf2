# SPDX-License-Identifier: Apache-2.0
"""On GPUs, under `tmsctl run` and torchrun: StreamedAdamW on FSDP2 (fully_shard) parameters against
torch.optim.AdamW on the same sharded model.

Two copies of one model, each Linear and the root fully_shard-ed over every rank (one rank: a mesh of
one process). torch.optim.AdamW steps one, StreamedAdamW the other, given the same gradients (the
reference's reduce-scattered DTensor gradients, cloned). Each step checks on every rank:
  - the local shards of the parameters are bit-identical (the update reached FSDP2's sharded storage),
  - both models' forward outputs are bit-identical (what the next all-gather hands out is that storage),
and at the end:
  - the state_dicts: `step` equal, `exp_avg` and `exp_avg_sq` DTensors on the same mesh with the same
    placements and shape as torch's, their local shards bit-identical,
  - the buckets hold this rank's shard only: their elements add up to the local shards' (nothing gathered).
The layer of 1001 rows shards unevenly over 2 ranks. Runs with torch's default kernel (fused unset),
then fused=True where torch.optim.AdamW takes it (PyTorch 2.0 or later; on DTensors as torch supports).
    tmsctl run -- torchrun --nproc-per-node 2 tests/gpu/torch_streamed_fsdp2.py [STEPS [BUCKET_ELEMENTS]]
    tmsctl run -- torchrun --nproc-per-node 1 tests/gpu/torch_streamed_fsdp2.py      (one GPU)
Each rank prints PASS, FAIL or SKIP per variant and a JSON line; exit status 1 on any FAIL, 77 without
FSDP2 or a GPU.
"""
import inspect
import json
import os
import sys

# cuBLAS picks its algorithms deterministically only with a fixed workspace; set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard  # PyTorch 2.6 and later
except ImportError:
    try:
        from torch.distributed._composable.fsdp import fully_shard  # 2.4, 2.5
    except ImportError:
        print("SKIPPED: this torch (%s) has no FSDP2 (fully_shard, PyTorch 2.4 or later)" % torch.__version__)
        sys.exit(77)
try:
    from torch.distributed.tensor import DTensor  # noqa: E402
except ImportError:
    from torch.distributed._tensor import DTensor  # noqa: E402

from tmsdisk.optim import StreamedAdamW  # noqa: E402

if not torch.cuda.is_available():
    print("SKIPPED: no GPU")
    sys.exit(77)

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
bucket_elements = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000  # smaller than a shard: shards span buckets
for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                      ("MASTER_PORT", "29513")):
    os.environ.setdefault(name, default)  # run without torchrun: one rank
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns
device = torch.device("cuda")
WIDTH = 1024


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 1001),
                                torch.nn.GELU(), torch.nn.Linear(1001, 64)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("rank %d: FAIL %s" % (rank, what), flush=True)
    return ok


def run(fused):
    label = "fused=%s" % fused
    ref_model, our_model = build(), build()
    options = dict(lr=1e-3, weight_decay=0.1)
    if fused is not None:
        options["fused"] = fused
    try:
        reference = torch.optim.AdamW(ref_model.parameters(), **options)
    except (TypeError, RuntimeError) as e:
        return {"variant": label, "verdict": "SKIP", "why": "torch.optim.AdamW(%s): %s" % (label, e)}
    ours = StreamedAdamW(our_model.parameters(), bucket_elements=bucket_elements, depth=3, **options)
    ref_params, our_params = list(ref_model.parameters()), list(our_model.parameters())
    check(all(isinstance(p, DTensor) for p in our_params), "%s: FSDP2's parameters are DTensors" % label)
    before = len(failures)
    for step in range(steps):
        torch.manual_seed(1000 + 17 * step + rank)  # each rank its own batch
        x = torch.randn(32, WIDTH, device=device)
        with torch.no_grad():
            ours_out = our_model(x)
        ref_out = ref_model(x)
        check(torch.equal(ours_out, ref_out.detach()), "%s step %d: the forward outputs differ" % (label, step))
        ref_out.square().mean().backward()
        for pr, po in zip(ref_params, our_params):
            po.grad = None if pr.grad is None else pr.grad.clone()
        try:
            reference.step()
        except (TypeError, RuntimeError, NotImplementedError) as e:
            if step == 0 and fused:  # torch's fused kernel on DTensors may be missing in this torch
                ours.close()
                return {"variant": label, "verdict": "SKIP", "why": "torch.optim.AdamW(%s).step() on DTensors: %s"
                        % (label, e)}
            raise
        ours.step()
        reference.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        for i, (pr, po) in enumerate(zip(ref_params, our_params)):
            a, b = po.to_local(), pr.to_local()
            if not check(torch.equal(a, b), "%s step %d: the shard of parameter %d differs (max |diff| %g)" % (
                    label, step, i, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)):
                break
    theirs, mine = reference.state_dict(), ours.state_dict()
    check(sorted(theirs["state"]) == sorted(mine["state"]), "%s: state_dict indexes %s, torch's %s" % (
        label, sorted(mine["state"]), sorted(theirs["state"])))
    for index, entry in theirs["state"].items():
        got = mine["state"].get(index, {})
        step_ok = ("step" in got and got["step"].dtype == entry["step"].dtype
                   and got["step"].device == entry["step"].device
                   and torch.equal(got["step"].cpu(), entry["step"].cpu()))
        check(step_ok, "%s: step of parameter %d: %s, torch's %s" % (label, index, got.get("step"), entry["step"]))
        for key in ("exp_avg", "exp_avg_sq"):
            t, o = entry[key], got.get(key)
            placed = (isinstance(o, DTensor) and o.placements == t.placements and o.device_mesh == t.device_mesh
                      and o.shape == t.shape)
            if check(placed, "%s: %s of parameter %d is %s, torch's a DTensor %s %s" % (
                    label, key, index, type(o).__name__ if not isinstance(o, DTensor) else o.placements,
                    t.placements, tuple(t.shape))):
                check(torch.equal(o.to_local(), t.to_local()), "%s: %s of parameter %d: the local shards differ" % (
                    label, key, index))
    streamed = sum(b.numel for group in ours._buckets for b in group)
    local = sum(p.to_local().numel() for p in our_params)
    check(streamed == local, "%s: the buckets hold %d elements, the local shards %d" % (label, streamed, local))
    ours.close()
    return {"variant": label, "verdict": "PASS" if len(failures) == before else "FAIL", "streamed_elements": streamed,
            "model_elements": sum(p.numel() for p in our_params)}


variants = [None]
if "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters:
    variants.append(True)
results = []
for fused in variants:
    result = run(fused)
    results.append(result)
    print("rank %d: %s %s %s" % (rank, result["verdict"], result["variant"], result.get("why", "")), flush=True)
print(json.dumps({"rank": rank, "world_size": world, "steps": steps, "bucket_elements": bucket_elements,
                  "torch": torch.__version__, "results": results}), flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
