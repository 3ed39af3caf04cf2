# SPDX-License-Identifier: Apache-2.0
# The host tier's size for a PyTorch rank whose caching allocator holds more than its tensors. Run
# under tmsctl with a daemon whose tier (host-tier-mb) is larger than the rank's device memory:
#   TMSCTL=/path/to/tmsctl tmsctl run --job tiersize -- python3 torch_tier_size.py [--tensors-gib 16] [--cache-gib 4]
#
# TENSORS_GIB of tensors (256 MiB each, every one filled with its own value) stay; CACHE_GIB more are
# made and dropped, so PyTorch's cache holds them. The rank asks for host-tier memory ahead of its
# first pause, sized by its device memory: tensors and cache. The pause empties the cache (tmsctl's
# start-up module) and places only the tensors in the tier; after the resume, the memory the rank
# keeps must be sized by what the pause placed (at most an eighth and 64 MiB more), not by what was
# asked ahead; and the second pause must only copy (no new memory made: as fast as the kept one).
#
# stdout: progress lines, then "PASS torch_tier_size ..." or "FAIL torch_tier_size: ...". Exit
# status 0 on PASS, 1 on FAIL. Waits poll `tmsctl --json status` (this is a GPU check, not a test).
import argparse
import json
import os
import subprocess
import sys
import time

import torch

import tmsdisk

GiB = 1 << 30
MiB = 1 << 20
PIECE = 256 * MiB


def this_rank(tmsctl):
    out = subprocess.run([tmsctl, "--json", "status"], capture_output=True, text=True, check=True).stdout
    for r in json.loads(out):
        if r.get("pid") == os.getpid():
            return r
    return None


def wait_for(tmsctl, what, cond, limit_s=180):
    start = time.time()
    while time.time() - start < limit_s:
        r = this_rank(tmsctl)
        if r and cond(r):
            return r
        time.sleep(0.25)
    raise RuntimeError(f"timed out after {limit_s} s waiting for {what}: {this_rank(tmsctl)}")


def cycle(kept, which):
    """Pauses and resumes the whole process, checks every tensor; returns the pause's wall time."""
    t0 = time.time()
    tmsdisk.pause()
    took = time.time() - t0
    tmsdisk.resume()
    for i, t in enumerate(kept):
        if not torch.all(t == float(i + 1)).item():
            fail(f"tensor {i} differs after the {which} resume")
    return took


def fail(why):
    print(f"FAIL torch_tier_size: {why}", flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors-gib", type=int, default=16)
    ap.add_argument("--cache-gib", type=int, default=4)
    args = ap.parse_args()
    tmsctl = os.environ.get("TMSCTL")
    if not tmsctl:
        fail("TMSCTL must name tmsctl")
    n = args.tensors_gib * GiB // PIECE
    kept = [torch.full((PIECE // 4,), float(i + 1), device="cuda", dtype=torch.float32) for i in range(n)]
    dropped = [torch.ones(PIECE // 4, device="cuda") for _ in range(args.cache_gib * GiB // PIECE)]
    del dropped
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    print(f"tensors {args.tensors_gib} GiB, PyTorch reserves {reserved / GiB:.1f} GiB", flush=True)

    ahead = wait_for(tmsctl, "host-tier memory ahead of the first pause", lambda r: r.get("host_tier_bytes", 0) > 0)
    ahead_bytes = ahead["host_tier_bytes"]
    print(f"ahead of the first pause: {ahead_bytes / GiB:.2f} GiB of host-tier memory", flush=True)

    first_pause = cycle(kept, "first")
    placed = args.tensors_gib * GiB
    limit = placed + placed // 8 + 64 * MiB
    settled = wait_for(
        tmsctl,
        "the kept memory to be sized by what the pause placed",
        lambda r: r.get("host_tier_kept") and 0 < r.get("host_tier_bytes", 0) <= limit,
    )
    kept_bytes = settled["host_tier_bytes"]
    print(f"after the first pause: {kept_bytes / GiB:.2f} GiB kept (placed {placed / GiB:.2f} GiB)", flush=True)

    second_pause = cycle(kept, "second")
    after = this_rank(tmsctl)
    print(
        f"pauses: first {first_pause:.2f} s (memory asked ahead), second {second_pause:.2f} s (memory kept); "
        f"held after: {after.get('host_tier_bytes', 0) / GiB:.2f} GiB",
        flush=True,
    )
    print(
        f"PASS torch_tier_size ahead {ahead_bytes / GiB:.2f} GiB, kept {kept_bytes / GiB:.2f} GiB for "
        f"{placed / GiB:.2f} GiB placed ({kept_bytes / placed:.3f}x), second pause {second_pause:.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a GPU check: report, do not hide
        fail(f"{type(e).__name__}: {e}")
