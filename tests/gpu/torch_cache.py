# SPDX-License-Identifier: Apache-2.0
# On a GPU (README.md, "PyTorch's cache"): PyTorch's free cached blocks are handed back before a
# pause, so a pause moves the tensors, not the cache. Run under `tmsctl run` (which puts the
# start-up module on the path); TMSCTL names tmsctl. The program holds GIB GiB of tensors and has
# freed as much again into PyTorch's cache, pauses itself from outside (tmsctl pause --pid), lets
# another process take the memory, resumes, and checks every tensor bit for bit. Prints "PASS ..."
# or "FAIL ...". With `keep` (run under `tmsctl run --keep-torch-cache`) the cache is expected to
# move too.
#   python3 torch_cache.py [GIB] [keep]
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    n = (gib << 30) // 4
    gen = torch.Generator(device="cuda").manual_seed(7)
    kept = [torch.rand(n // 8, device="cuda", generator=gen) for _ in range(8)]
    garbage = [torch.rand(n // 8, device="cuda", generator=gen) for _ in range(8)]
    del garbage  # into PyTorch's cache: reserved, used by no tensor
    digest = [t.sum().item() for t in kept]
    snapshot = [t.clone().cpu() for t in kept]
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    me = ["--pid", str(os.getpid())]
    tmsctl = os.environ["TMSCTL"]
    pause = json.loads(subprocess.run([tmsctl, "--json", "pause", *me], capture_output=True, text=True).stdout)[0]
    took = subprocess.run([sys.executable, os.path.join(HERE, "take_memory.py"), "0.9"], capture_output=True, text=True)
    resume = json.loads(subprocess.run([tmsctl, "--json", "resume", *me], capture_output=True, text=True).stdout)[0]
    same = all(torch.equal(t.cpu(), s) for t, s in zip(kept, snapshot)) and [t.sum().item() for t in kept] == digest
    keep = len(sys.argv) > 2 and sys.argv[2] == "keep"
    covered = pause.get("bytes", 0)
    moved_ok = pause.get("ok") and (covered >= reserved if keep else allocated <= covered < reserved)
    ok = same and moved_ok and resume.get("ok")
    print(f"{'PASS' if ok else 'FAIL'} torch-cache{' (kept)' if keep else ''}: tensors {allocated / 2**30:.2f} GiB, PyTorch reserved "
          f"{reserved / 2**30:.2f} GiB before the pause; the pause covered {pause.get('bytes', 0) / 2**30:.2f} GiB "
          f"({pause.get('moved_bytes', 0) / 2**30:.2f} GiB written, {pause.get('zero_bytes', 0) / 2**30:.2f} GiB zero) "
          f"in {pause.get('ns', 0) / 1e9:.2f} s; resumed in {resume.get('ns', 0) / 1e9:.2f} s; tensors "
          f"{'bit-identical' if same else 'DIFFERENT'}; reserved after {torch.cuda.memory_reserved() / 2**30:.2f} GiB; "
          f"meanwhile another process {took.stdout.strip() or took.stderr.strip()[-200:]}", flush=True)
    if not ok:
        print(f"pause {pause}\nresume {resume}", flush=True)


if __name__ == "__main__":
    main()
