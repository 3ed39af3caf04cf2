# SPDX-License-Identifier: Apache-2.0
"""On a GPU, under `tmsctl run`: how much of tmsdisk.optim.StreamedAdamW's step a prefetch during backward
hides (issue 25), and that it changes no bit of the training.

One model (LAYERS square fp32 linear layers of WIDTH, GELU between them, bf16 autocast, an MSE loss on
TOKENS random rows a step) is trained WARMUP + STEPS steps from the same initial weights on the same
batches, once per variant, one after another in this process:

    compute    forward and backward only, no optimizer            (the compute; forward and backward timed apart)
    resident   torch.optim.AdamW, state in device memory           (the reference and the floor)
    streamed   StreamedAdamW, no prefetch: the step reads every bucket itself
    hook       StreamedAdamW(prefetch_on_backward=True): the first gradient hook of the backward starts
               reading the first depth-1 buckets
    explicit   StreamedAdamW, opt.prefetch() once the loss is computed, right before loss.backward()

Every streamed variant has the same bucket_elements and depth. A step's time is the whole iteration
(forward, backward, step, zero_grad, then a synchronize), so that what the step overlaps with the compute
is not counted and what it leaves in the background (its last write-backs) is counted by the next step
waiting for it. Exposed optimizer time = iteration - resident's iteration (medians over the timed
steps). With the daemon's host tier off (run_gpu_optim_extra.sh starts it so) every bucket comes from
the disk. The best a prefetch during backward can hide is min(backward, the prefetched buckets' read
time); the read rate is estimated from the streamed variant's iteration less the compute's.

PASS: the parameters after the last step are bit-identical (SHA-256) to resident's for every streamed
variant, and every variant's losses equal resident's step for step. Exit 1 otherwise. JSON on the last
line (and in --json).

    tmsctl run -- python3 torch_optim_overlap.py [--width 4096] [--layers 16] [--tokens 131072]
        [--bucket-elements 33554432] [--depth 3] [--steps 8] [--warmup 2] [--rounds 1]
        [--variants compute,resident,streamed,hook,explicit] [--fused] [--device cuda] [--json PATH]

The defaults: 268 M parameters (2.15 GB of fp32 moments, 8 buckets of 256 MiB), 131072 rows a step
(about 0.4 s of forward and backward on an H200): about 2 minutes on an H200 with a 1.7 GB/s disk, each
streamed step reading and writing 2.15 GB. --device cpu runs the same on the host (a dry run: small
sizes, e.g. --width 256 --layers 4 --tokens 512 --bucket-elements 100000).
"""

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time

# cuBLAS picks reproducible kernels only with a fixed workspace (node.sh sets it too); before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tmsdisk.optim import StreamedAdamW  # noqa: E402

VARIANTS = ("compute", "resident", "streamed", "hook", "explicit")
STREAMED = ("streamed", "hook", "explicit")
MODEL_SEED = 0
DATA_SEED = 1000


def options():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=131072, help="rows of a step's batch")
    parser.add_argument("--bucket-elements", type=int, default=33554432)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (a streamed first step only writes)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of the streamed variants, in turn forward and backward order (a slow disk "
                             "phase then weighs on each)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--fused", action="store_true", help="fused=True for AdamW and StreamedAdamW (else foreach)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "resident" not in args.variants:
        parser.error("--variants: %s; choose among %s, resident included (the reference)" % (
            ", ".join(unknown) or "resident missing", ", ".join(VARIANTS)))
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return args


class Run:
    """One variant's model and optimizer, built from the same seed as every other."""

    def __init__(self, args, variant, serial):
        self.args, self.variant = args, variant
        self.device = torch.device(args.device)
        torch.manual_seed(MODEL_SEED)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width, bias=False, device=self.device), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.params = list(self.model.parameters())
        options = dict(lr=args.lr, weight_decay=args.weight_decay)
        if args.fused:
            options["fused"] = True
        self.opt = None
        self.prefetches = 0
        if variant == "resident":
            self.opt = torch.optim.AdamW(self.params, **options)
        elif variant in STREAMED:
            self.opt = StreamedAdamW(self.params, bucket_elements=args.bucket_elements, depth=args.depth,
                                     prefetch_on_backward=(variant == "hook"), name="overlap-%s-%d" % (variant, serial),
                                     **options)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def batch(self, step):
        gen = torch.Generator(device=self.device).manual_seed(DATA_SEED + step)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return torch.randn(self.args.tokens, self.args.width, generator=gen, device=self.device, dtype=dtype)

    def iteration(self, step):
        """One step; (loss, seconds of the whole iteration, seconds in opt.step(), forward s, backward s).
        Forward and backward are timed apart (with a synchronize between) only for `compute`, which has
        no optimizer whose overlap a synchronize would change."""
        x = self.batch(step)
        self.sync()
        started = time.perf_counter()
        with self.autocast():
            y = self.model(x)
        loss = F.mse_loss(y.float(), x.float())
        forward_s = backward_s = None
        if self.variant == "compute":
            self.sync()
            forward_s = time.perf_counter() - started
        if self.variant == "explicit":
            self.opt.prefetch()  # queued after the forward's work: read while the backward runs
        loss.backward()
        if self.variant == "compute":
            self.sync()
            backward_s = time.perf_counter() - started - forward_s
        if self.variant in STREAMED and not self.opt._prefetch_armed:
            self.prefetches += 1  # prefetch() ran during this backward (the hook's, or the explicit call)
        step_s = 0.0
        if self.opt is not None:
            at = time.perf_counter()
            self.opt.step()
            step_s = time.perf_counter() - at
            self.opt.zero_grad(set_to_none=True)
        else:
            for p in self.params:
                p.grad = None
        value = loss.item()
        self.sync()
        return value, time.perf_counter() - started, step_s, forward_s, backward_s

    def state_bytes(self):
        if self.variant not in STREAMED:
            return None
        return sum(b.nbytes for buckets in self.opt._buckets for b in buckets)

    def prefetch_bytes(self):
        """What prefetch() reads: the first depth-1 buckets."""
        if self.variant not in STREAMED:
            return None
        buckets = [b for group in self.opt._buckets for b in group][: self.args.depth - 1]
        return sum(b.nbytes for b in buckets)

    def digest(self):
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    def close(self):
        if self.variant in STREAMED:
            self.opt.flush()
            self.opt.close()  # its objects leave the store before the next run
        del self.opt, self.model, self.params
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def run_variant(args, variant, serial):
    run = Run(args, variant, serial)
    losses, times, step_times, forwards, backwards = [], [], [], [], []
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    for step in range(args.warmup + args.steps):
        loss, total_s, step_s, forward_s, backward_s = run.iteration(step)
        losses.append(loss)
        if step >= args.warmup:
            times.append(total_s)
            step_times.append(step_s)
            if forward_s is not None:
                forwards.append(forward_s)
                backwards.append(backward_s)
    result = {
        "variant": variant,
        "losses": losses,
        "losses_hex": [float(v).hex() for v in losses],
        "iteration_s": [round(t, 4) for t in times],
        "iteration_median_s": statistics.median(times),
        "iteration_min_s": min(times),
        "iteration_max_s": max(times),
        "step_call_median_s": statistics.median(step_times),
        "forward_median_s": statistics.median(forwards) if forwards else None,
        "backward_median_s": statistics.median(backwards) if backwards else None,
        "state_bytes": run.state_bytes(),
        "prefetch_bytes": run.prefetch_bytes(),
        "buckets": sum(len(g) for g in run.opt._buckets) if variant in STREAMED else None,
        "backwards_with_prefetch": run.prefetches if variant in STREAMED else None,
        "peak_device_bytes": torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None,
        "param_sha256": run.digest() if variant != "compute" else None,
        "params": sum(p.numel() for p in run.params),
    }
    run.close()
    print("  %-9s iteration median %.3f s (min %.3f, max %.3f), in step() %.3f s, last loss %.6g%s" % (
        variant, result["iteration_median_s"], result["iteration_min_s"], result["iteration_max_s"],
        result["step_call_median_s"], losses[-1],
        ", prefetch in %d of %d backwards" % (run.prefetches, len(losses)) if variant in STREAMED else ""), flush=True)
    return result


def main():
    args = options()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("SKIP: no CUDA device (run with --device cpu for a dry run)")
            sys.exit(77)
        torch.use_deterministic_algorithms(True)  # resident and streamed runs must see the same gradients
    n_params = args.layers * args.width * args.width
    print("model: %d layers of %d x %d, %.1f M fp32 parameters (%.2f GB of moments); %d rows a step; buckets of %d "
          "elements, depth %d; %d warm-up + %d timed steps; torch %s on %s%s" % (
              args.layers, args.width, args.width, n_params / 1e6, 8 * n_params / 1e9, args.tokens,
              args.bucket_elements, args.depth, args.warmup, args.steps, torch.__version__, device,
              ", fused" if args.fused else ""), flush=True)

    results = {}  # variant -> its runs
    serial = 0
    order = [v for v in VARIANTS if v in args.variants and v not in STREAMED]
    streamed = [v for v in VARIANTS if v in args.variants and v in STREAMED]
    plan = list(order)
    for r in range(args.rounds):
        plan += streamed if r % 2 == 0 else streamed[::-1]
    for variant in plan:
        serial += 1
        results.setdefault(variant, []).append(run_variant(args, variant, serial))

    reference = results["resident"][0]
    ok = True
    checks = []
    for variant, runs in results.items():
        if variant in ("compute", "resident"):
            continue
        for i, r in enumerate(runs):
            same_params = r["param_sha256"] == reference["param_sha256"]
            same_losses = r["losses_hex"] == reference["losses_hex"]
            # the variant measured what it is named for: a prefetch in every backward, or in none
            expected = len(r["losses"]) if variant != "streamed" else 0
            ok = ok and same_params and same_losses and r["backwards_with_prefetch"] == expected
            checks.append({"variant": variant, "round": i, "params_identical": same_params,
                           "losses_identical": same_losses, "backwards_with_prefetch": r["backwards_with_prefetch"],
                           "backwards_with_prefetch_expected": expected})

    def merged(variant, key):
        values = [x for r in results.get(variant, []) for x in r[key]]
        return statistics.median(values) if values else None

    resident_s = merged("resident", "iteration_s")
    summary = {}
    for variant in [v for v in VARIANTS if v in results]:
        runs = results[variant]
        iteration = merged(variant, "iteration_s")
        summary[variant] = {
            "iteration_median_s": round(iteration, 4),
            "exposed_optimizer_s": round(iteration - resident_s, 4) if variant in STREAMED else None,
            "step_call_median_s": round(statistics.median(r["step_call_median_s"] for r in runs), 4),
            "peak_device_gb": round(max(r["peak_device_bytes"] or 0 for r in runs) / 1e9, 2),
        }
    compute = results.get("compute", [None])[0]
    backward_s = compute["backward_median_s"] if compute else None
    forward_s = compute["forward_median_s"] if compute else None
    first_streamed = next((results[v][0] for v in STREAMED if v in results), None)
    estimate = {}
    if first_streamed is not None:
        state_bytes, prefetch_bytes = first_streamed["state_bytes"], first_streamed["prefetch_bytes"]
        estimate = {"state_bytes": state_bytes, "bytes_moved_per_step": 2 * state_bytes,
                    "prefetch_bytes": prefetch_bytes, "buckets": first_streamed["buckets"]}
        if "streamed" in results and compute is not None:
            io_s = summary["streamed"]["iteration_median_s"] - (compute["iteration_median_s"])
            if io_s > 0:
                rate = 2 * state_bytes / io_s  # reads and writes together, as the step does them
                estimate["store_rate_gb_s"] = round(rate / 1e9, 3)
                estimate["best_hidden_s"] = round(min(backward_s, prefetch_bytes / rate), 4)
        for variant in ("hook", "explicit"):
            if variant in summary and "streamed" in summary:
                saved = summary["streamed"]["exposed_optimizer_s"] - summary[variant]["exposed_optimizer_s"]
                summary[variant]["hidden_vs_streamed_s"] = round(saved, 4)
                if estimate.get("best_hidden_s"):
                    summary[variant]["hidden_of_best"] = round(saved / estimate["best_hidden_s"], 3)

    print("\n%-9s %12s %14s %12s %12s %10s" % ("variant", "iteration s", "exposed opt s", "in step() s",
                                              "hidden s", "peak GB"))
    for variant, s in summary.items():
        print("%-9s %12.3f %14s %12.3f %12s %10.2f" % (
            variant, s["iteration_median_s"],
            "%.3f" % s["exposed_optimizer_s"] if s["exposed_optimizer_s"] is not None else "-",
            s["step_call_median_s"],
            "%.3f" % s["hidden_vs_streamed_s"] if "hidden_vs_streamed_s" in s else "-", s["peak_device_gb"]))
    if compute is not None:
        print("compute: forward %.3f s, backward %.3f s (median)" % (forward_s, backward_s))
    if estimate:
        print("store: %.2f GB of state, %.2f GB moved a step; prefetch reads %d of %d buckets, %.2f GB%s" % (
            estimate["state_bytes"] / 1e9, estimate["bytes_moved_per_step"] / 1e9, min(args.depth - 1, estimate["buckets"]),
            estimate["buckets"], estimate["prefetch_bytes"] / 1e9,
            "; %.2f GB/s read+write (estimated), the most a prefetch during backward can hide: %.3f s" % (
                estimate["store_rate_gb_s"], estimate["best_hidden_s"]) if "best_hidden_s" in estimate else ""))
    for c in checks:
        good = (c["params_identical"] and c["losses_identical"]
                and c["backwards_with_prefetch"] == c["backwards_with_prefetch_expected"])
        print("%s: %s round %d: parameters %s, losses %s, a prefetch during %d backwards (%d expected)" % (
            "PASS" if good else "FAIL", c["variant"], c["round"],
            "bit-identical to resident AdamW's" if c["params_identical"] else "DIFFER from resident AdamW's",
            "identical" if c["losses_identical"] else "DIFFER", c["backwards_with_prefetch"],
            c["backwards_with_prefetch_expected"]))
    if not checks:
        print("FAIL: no streamed variant ran")
        ok = False
    out = {"args": vars(args), "torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "pass": ok, "checks": checks, "summary": summary, "estimate": estimate,
           "compute": {"forward_median_s": forward_s, "backward_median_s": backward_s},
           "runs": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("pass", "checks", "summary", "estimate", "compute")}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
