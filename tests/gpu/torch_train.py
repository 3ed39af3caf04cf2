# SPDX-License-Identifier: Apache-2.0
# An unmodified PyTorch training script (nothing here knows about tmsdisk): a stack of linear layers
# trained with Adam. It keeps a host copy of every parameter, gradient and optimizer state so that a
# driver can ask it, on stdin, whether GPU memory is bit-identical to what it was:
#   check  -> "ok N" (N tensors compared) or "bad NAME"
#   step   -> one more training step, new host copies, "loss X"
#   exit
import sys

import torch

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 6
width = 8192
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)


def step():
    x = torch.randn(64, width, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def tensors():
    for name, p in model.named_parameters():
        yield name, p.data
        yield name + ".grad", p.grad
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.is_cuda:
                yield name + "." + key, value


def snapshot():
    torch.cuda.synchronize()
    return {name: t.detach().cpu().clone() for name, t in tensors()}


for _ in range(2):
    step()
saved = snapshot()
print("ready", torch.cuda.memory_allocated(), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "check":
        torch.cuda.synchronize()
        bad = [name for name, t in tensors() if not torch.equal(t.cpu().view(torch.int32), saved[name].view(torch.int32))]
        print(f"bad {bad[0]}" if bad else f"ok {len(saved)}", flush=True)
    elif cmd == "step":
        loss = step()
        saved = snapshot()
        print(f"loss {loss}", flush=True)
    elif cmd == "exit":
        break
