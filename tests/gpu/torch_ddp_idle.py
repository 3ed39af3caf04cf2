# SPDX-License-Identifier: Apache-2.0
# An unmodified DDP training script (torchrun, NCCL) with the phase structure of colocated RL: train,
# go idle while something else uses the GPUs, train again. It never calls tmsdisk; the idle phase is
# where an outside `tmsctl pause --job` / `tmsctl resume --job` happens. Rank 0 prints "idle" when every
# rank has reached the idle point (no collective in flight), waits for the file GO to exist, trains on
# and prints "final <digest>" of its parameters and optimizer state.
#   torchrun --nproc-per-node 2 torch_ddp_idle.py STEPS GO_FILE
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

steps, go = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
width = 4096
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
gen = torch.Generator(device="cuda").manual_seed(1 + rank)
data = torch.randn(8, 32, width, device="cuda", generator=gen)


def train(n):
    for i in range(n):
        loss = ddp(data[i % 8]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)


train(steps)
torch.cuda.synchronize()
dist.barrier()
torch.cuda.synchronize()
if rank == 0:
    print("idle", flush=True)
while not os.path.exists(go):  # the workload's own idle phase, not a test's synchronization
    time.sleep(0.05)
train(steps)
torch.cuda.synchronize()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().cpu().numpy().tobytes())
    for value in opt.state[p].values():
        if torch.is_tensor(value):
            digest.update(value.detach().cpu().numpy().tobytes())
if rank == 0:
    print("final", digest.hexdigest(), flush=True)
dist.destroy_process_group()
