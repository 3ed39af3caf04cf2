# SPDX-License-Identifier: Apache-2.0
"""On a GPU, under `tmsctl run`: tmsdisk.optim.StreamedAdamW against torch.optim.AdamW on the same model.

Two copies of one model (fp32, PARAMS million parameters in square linear layers) take the same
gradients for STEPS steps: one with torch.optim.AdamW (its default kernel on CUDA, foreach; with
STREAM_FUSED=1 both take fused=True), one with StreamedAdamW whose state streams through the daemon's
store in buckets of BUCKET million elements. Prints PASS/FAIL for bit-identical parameters and for the
optimizer state's peak device memory (at most DEPTH buckets: DEPTH x BUCKET x 8 bytes of moments; on the
first step with fused=True the parameters' new step counts beside them, as torch's class makes them), the
peak of both, and the streamed step's wall time beside the bytes it moved (read + written), as JSON on
the last line.
    tmsctl run -- python3 torch_streamed_optim.py [PARAMS_M [STEPS [BUCKET_M [DEPTH]]]]
"""
import json
import os
import sys
import time

import torch

from tmsdisk.optim import StreamedAdamW

params_m = int(sys.argv[1]) if len(sys.argv) > 1 else 512
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
bucket_m = int(sys.argv[3]) if len(sys.argv) > 3 else 20
depth = int(sys.argv[4]) if len(sys.argv) > 4 else 3

dev = torch.device("cuda")
width = 4096
layers = max(1, params_m * 1_000_000 // (width * width))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)


ref, streamed = model(), model()
n_params = sum(p.numel() for p in ref.parameters())
fused = {"fused": True} if os.environ.get("STREAM_FUSED") == "1" else {}
opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, **fused)
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
opt = StreamedAdamW(streamed.parameters(), lr=1e-3, weight_decay=0.1, bucket_elements=bucket_m * 1_000_000,
                    depth=depth, **fused)

ref_peak = streamed_peak = later_peak = counts_bytes = 0
times = []
for step in range(steps):
    torch.manual_seed(100 + step)
    for pr, ps in zip(ref.parameters(), streamed.parameters()):
        g = torch.randn_like(pr) * 1e-2
        pr.grad = g
        ps.grad = g.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt_ref.step()
    torch.cuda.synchronize()
    ref_peak = max(ref_peak, torch.cuda.max_memory_allocated() - before + 8 * n_params)  # + its moments
    # A parameter's first step makes its step count, on the device with fused=True (as torch's class
    # does): one 512-byte block of the caching allocator each, state kept beside the buckets.
    new_counts = sum(1 for p in streamed.parameters() if "step" not in opt.state.get(p, {})) if fused else 0
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    opt.step()
    opt.flush()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before
    counts_bytes = max(counts_bytes, 512 * new_counts)
    streamed_peak = max(streamed_peak, peak - 512 * new_counts)
    later_peak = max(later_peak, peak) if step > 0 else later_peak

same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), streamed.parameters()))
state_bytes = 8 * n_params
moved = 2 * state_bytes  # each step reads and writes every bucket (the first step only writes)
later = times[1:] or times
result = {
    "params": n_params,
    "steps": steps,
    "bucket_elements": bucket_m * 1_000_000,
    "depth": depth,
    "fused": bool(fused),
    "bit_identical": same,
    "state_bytes": state_bytes,
    "resident_adamw_state_peak_bytes": ref_peak,
    "streamed_peak_bytes": streamed_peak,
    "first_step_count_bytes": counts_bytes,
    "later_steps_peak_bytes": later_peak,
    "depth_x_bucket_bytes": depth * bucket_m * 1_000_000 * 8,
    "step_s": [round(t, 3) for t in times],
    "later_step_mean_s": round(sum(later) / len(later), 3),
    "later_step_gb_s": round(moved / (sum(later) / len(later)) / 1e9, 2),
}
print("PASS: parameters bit-identical to torch.optim.AdamW" if same else "FAIL: parameters differ from torch.optim.AdamW")
within = streamed_peak <= result["depth_x_bucket_bytes"] and later_peak <= result["depth_x_bucket_bytes"]
print(f"{'PASS' if within else 'FAIL'}: the streamed state's peak device memory {streamed_peak} bytes (the first "
      f"step's new step counts, {counts_bytes} bytes, beside it; after the first step {later_peak} bytes), depth x "
      f"bucket {result['depth_x_bucket_bytes']} (resident AdamW's {ref_peak})")
print(json.dumps(result))
opt.close()
sys.exit(0 if same and within else 1)
