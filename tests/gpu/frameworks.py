# SPDX-License-Identifier: Apache-2.0
# Unmodified framework workloads paused and resumed from outside, each compared bit for bit with the
# same workload run in the same process without a pause:
#   torch-graphs  a PyTorch training step (Linear stack, Adam with capturable=True) captured in a CUDA
#                 graph and replayed: the graph's memory must come back at the same addresses
#   jax           a jitted JAX update loop (XLA's allocator; run with XLA_PYTHON_CLIENT_PREALLOCATE=false
#                 so that it does not reserve most of the GPU up front)
#   cupy          a CuPy update loop (CuPy's memory pool)
# Mid-run, at an idle point, the process has tmsctl (path in TMSCTL) pause it by pid, a second process
# takes 90% of the free GPU memory (take_memory.py), then tmsctl resumes it. Run under `tmsctl run`.
# Prints "PASS KIND ..." or "FAIL KIND ...", or "SKIP KIND: why" when the framework is not usable here.
#   python3 frameworks.py KIND
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, PAUSE_AT = 40, 20


def pause_cycle():
    """Pauses this process from outside, lets another process take the memory, resumes."""
    me = ["--pid", str(os.getpid())]
    tmsctl = os.environ["TMSCTL"]
    pause = json.loads(subprocess.run([tmsctl, "--json", "pause", *me], capture_output=True, text=True).stdout)
    took = subprocess.run([sys.executable, os.path.join(HERE, "take_memory.py"), "0.9"], capture_output=True, text=True)
    resume = json.loads(subprocess.run([tmsctl, "--json", "resume", *me], capture_output=True, text=True).stdout)
    return pause[0], took.stdout.strip() or took.stderr.strip()[-200:], resume[0]


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def torch_graphs(pause_at):
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    width = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, capturable=True)
    data = torch.randn(8, 64, width, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    static_x = data[0].clone()

    def step():
        opt.zero_grad(set_to_none=False)
        loss = model(static_x).square().mean()
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the graph, as PyTorch requires
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    cycle = None
    for i in range(STEPS):
        if i == pause_at:
            torch.cuda.synchronize()
            cycle = pause_cycle()
        static_x.copy_(data[i % 8])
        graph.replay()
    torch.cuda.synchronize()
    return digest(p.detach().cpu().numpy() for p in model.parameters()), cycle


def jax_loop(pause_at):
    import jax
    import jax.numpy as jnp
    import numpy as np

    if jax.default_backend() != "gpu":
        raise RuntimeError("JAX has no GPU backend here (" + jax.default_backend() + ")")
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (4096, 4096), dtype=jnp.float32)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (4096, 4096), dtype=jnp.float32) for i in range(8)]

    @jax.jit
    def update(w, x):
        return w - 1e-3 * jnp.tanh(x @ w)

    cycle = None
    for i in range(STEPS):
        if i == pause_at:
            jax.block_until_ready(w)
            cycle = pause_cycle()
        w = update(w, xs[i % 8])
    return digest([np.asarray(w)]), cycle


def cupy_loop(pause_at):
    import cupy as cp

    rs = cp.random.RandomState(0)
    w = rs.standard_normal((4096, 4096), dtype=cp.float32)
    xs = [rs.standard_normal((4096, 4096), dtype=cp.float32) for _ in range(8)]
    cycle = None
    for i in range(STEPS):
        if i == pause_at:
            cp.cuda.Device().synchronize()
            cycle = pause_cycle()
        w = w - cp.float32(1e-3) * cp.tanh(xs[i % 8] @ w)
    return digest([cp.asnumpy(w)]), cycle


def main():
    kind = sys.argv[1]
    work = {"torch-graphs": torch_graphs, "jax": jax_loop, "cupy": cupy_loop}[kind]
    try:
        reference, _ = work(None)
    except (ImportError, RuntimeError) as e:
        print(f"SKIP {kind}: {e}", flush=True)
        return
    got, (pause, took, resume) = work(PAUSE_AT)
    ok = got == reference and pause.get("ok") and resume.get("ok") and pause.get("bytes", 0) > 0
    print(f"{'PASS' if ok else 'FAIL'} {kind}: digest {got} (unpaused {reference}); "
          f"paused {pause.get('bytes', 0) / 2**30:.2f} GiB at {pause.get('gb_per_s', 0):.2f} GB/s, "
          f"resumed at {resume.get('gb_per_s', 0):.2f} GB/s "
          f"({pause.get('moved_bytes', 0) / 2**30:.2f} GiB written, {pause.get('zero_bytes', 0) / 2**30:.2f} GiB zero, "
          f"{pause.get('unchanged_bytes', 0) / 2**30:.2f} GiB unchanged); meanwhile another process {took}"
          + ("" if pause.get("ok") and resume.get("ok") else f"; pause {pause}, resume {resume}"), flush=True)


if __name__ == "__main__":
    main()
