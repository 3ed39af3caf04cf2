# SPDX-License-Identifier: Apache-2.0
"""On a GPU, under `tmsctl run`: a trainer whose Adam state streams through the daemon's store is paused
between steps. The pause must move what is resident (parameters and gradients: the optimizer drops its
buckets first) and not the state, and training must go on bit-identical to torch.optim.AdamW.

The reference runs first, alone (its parameters kept on the host), so that nothing of it is resident
when the streamed trainer pauses. Prints PASS/FAIL lines and JSON on the last line.
    tmsctl run -- python3 torch_streamed_pause.py [PARAMS_M [STEPS [PAUSE_AFTER]]]
"""
import json
import sys
import time

import torch

import tmsdisk
from tmsdisk.optim import StreamedAdamW

params_m = int(sys.argv[1]) if len(sys.argv) > 1 else 256
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
pause_after = int(sys.argv[3]) if len(sys.argv) > 3 else 3
dev = torch.device("cuda")
width = 4096
layers = max(1, params_m * 1_000_000 // (width * width))


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)


def set_grads(m, step):
    torch.manual_seed(100 + step)
    for p in m.parameters():
        p.grad = torch.randn_like(p) * 1e-2


ref = model()
opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
for step in range(steps):
    set_grads(ref, step)
    opt_ref.step()
expected = [p.detach().cpu() for p in ref.parameters()]
del ref, opt_ref
torch.cuda.synchronize()
torch.cuda.empty_cache()

m = model()
n_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
opt = StreamedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1, bucket_elements=20_000_000, depth=3)
result = {"params_bytes": n_bytes, "grads_bytes": n_bytes, "state_bytes": 2 * n_bytes}
ok = True
for step in range(steps):
    set_grads(m, step)
    opt.step()
    if step + 1 == pause_after:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tmsdisk.pause()
        paused = tmsdisk.status()
        t1 = time.perf_counter()
        tmsdisk.resume()
        t2 = time.perf_counter()
        result.update(paused_bytes=paused.paused_bytes, last_pause_bytes=paused.last_pause_bytes,
                      pause_s=round(t1 - t0, 3), resume_s=round(t2 - t1, 3))
        limit = 2 * n_bytes * 1.01
        moved = paused.last_pause_bytes
        good = moved <= limit
        ok &= good
        print(f"{'PASS' if good else 'FAIL'}: the pause moved {moved} bytes; parameters + gradients "
              f"{2 * n_bytes} (+1 % = {int(limit)}); the state ({2 * n_bytes} bytes) stayed in the store")
same = all(torch.equal(p.detach().cpu(), e) for p, e in zip(m.parameters(), expected))
ok &= same
print("PASS: parameters bit-identical to torch.optim.AdamW after the pause" if same else
      "FAIL: parameters differ from torch.optim.AdamW after the pause")
result["bit_identical"] = same
print(json.dumps(result))
opt.close()
sys.exit(0 if ok else 1)
