# SPDX-License-Identifier: Apache-2.0
# An unmodified PyTorch training loop that never stops on its own to be paused: it trains STEPS steps,
# printing "step N" after each, then prints "final <digest>" of every parameter and optimizer state.
# Deterministic, so a run that was paused and resumed from outside mid-loop must end with the same
# digest as one that was not.
#   python3 torch_continuous.py STEPS [LAYERS]
import hashlib
import sys

import torch

steps = int(sys.argv[1])
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
width = 8192
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
data = torch.randn(16, 64, width, device="cuda")
for i in range(steps):
    loss = model(data[i % 16]).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    print(f"step {i} {loss.item():.6f}", flush=True)
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().cpu().numpy().tobytes())
    for value in opt.state[p].values():
        if torch.is_tensor(value):
            digest.update(value.detach().cpu().numpy().tobytes())
print("final", digest.hexdigest(), flush=True)
