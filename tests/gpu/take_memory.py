# SPDX-License-Identifier: Apache-2.0
# A second process that takes GPU memory: allocates FRACTION of what is free now, writes it, frees it,
# and prints how much it got. Run while another process is paused to show its memory really left.
import sys

import torch

fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 0.9
free, total = torch.cuda.mem_get_info()
n = int(free * fraction) // 4
x = torch.full((n,), 3.0, dtype=torch.float32, device="cuda")
assert x.min().item() == 3.0 and x.max().item() == 3.0  # reductions: no second full-size tensor
del x
print(f"took {n * 4 / 2**30:.2f} GiB of {free / 2**30:.2f} GiB free ({total / 2**30:.1f} GiB total)", flush=True)
