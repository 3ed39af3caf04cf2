# SPDX-License-Identifier: Apache-2.0
"""On a GPU, under `tmsctl run`: what the moments' dtype of tmsdisk.optim.StreamedAdamW does to training.

A GPT-2-shaped language model (Hugging Face's GPT2LMHeadModel from a config when transformers is
installed, else a GPT-2 written here: pre-norm blocks, causal attention, 4x GELU MLP, tied embeddings) is
trained from the same initial weights, at the character (byte) level, on a corpus made of the standard
library's own .py files (no network, no downloads: the same bytes on every node with the same Python),
with its optimizer state in the daemon's store. Four runs:

    fp32-a   fp32 moments, data order seed 1        the reference
    fp32-b   fp32 moments, data order seed 2        the noise floor: what another data order alone does
    bf16     bf16 moments, data order seed 1
    fp8      float8_e4m3fn moments with a scale per 128 elements, data order seed 1 (torch 2.1 or later)

Every run draws the same batches as fp32-a but fp32-b, so their training losses differ by what the
moments do alone; fp32-b's also differ by its batches. The held-out loss (the same fixed batches for
every run, every --eval-every steps and at the end) compares all four on equal terms.

Writes a CSV (run, step, loss, eval_loss, lr, step_s) and prints, per run: the final training loss (mean of
the last 10), the mean |loss - fp32-a's| over the last 50 steps, the final held-out loss and its distance
from fp32-a's, beside fp32-b's (the noise floor); the bytes the store moves per step (every bucket read
and written back) and the median step time. JSON on the last line.

    tmsctl run -- python3 moment_dtype_study.py [--steps 200] [--layers 8] [--width 512] [--heads 8]
        [--context 256] [--batch 32] [--lr 1e-3] [--beta2 0.999] [--bucket-m 4] [--runs fp32-a,fp32-b,bf16,fp8]
        [--model auto|hf|own] [--device cuda] [--csv PATH]

The defaults (an 8-layer, 512-wide GPT-2, 25.5 M parameters, 200 steps of 32 x 256 bytes) are meant to
take 2 to 3 minutes for the four runs on one H200 (6 layers of 384 took 1 minute, 0.03 s a step, with
the state in the daemon's store); --layers 12 --width 768 --heads 12 is GPT-2 small's shape (124 M with
GPT-2's vocabulary, 85 M with bytes), 3.3 times the optimizer bytes of the default.

The attention's backward on CUDA (cuDNN, flash) is not deterministic: two runs of the same settings differ
a little too. What the moments do shows against the fp32-b noise floor, which is far larger.
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import stdlib_corpus  # beside this script (the scripts run as files)

# cuBLAS picks reproducible kernels only with a fixed workspace (node.sh sets it too); before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tmsdisk.optim import StreamedAdamW  # noqa: E402

RUNS = {  # name -> (moment dtype name, data order seed)
    "fp32-a": ("float32", 1),
    "fp32-b": ("float32", 2),
    "bf16": ("bfloat16", 1),
    "fp8": ("float8_e4m3fn", 1),
}
VOCAB = 256  # bytes
MODEL_SEED = 0
EVAL_SEED = 12345
EVAL_BATCHES = 8
WARMUP = 20


def options():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta2", type=float, default=0.999, help="torch's default; GPT recipes often use 0.95")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bucket-m", type=float, default=4.0, help="bucket_elements, in millions")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--model", choices=("auto", "hf", "own"), default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--corpus-mb", type=float, default=16.0)
    parser.add_argument("--csv", default="moment_dtype_study.csv")
    return parser.parse_args()


# --- data ------------------------------------------------------------------------------------------


class Batches:
    """Random windows of the corpus: the training part (the first 95%) by (seed, step), the held-out
    part by a fixed seed."""

    def __init__(self, data, context, batch, device):
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.long)
        split = len(data) * 95 // 100
        self.train, self.held_out = tokens[:split], tokens[split:]
        self.context, self.batch, self.device = context, batch, device
        self.offsets = torch.arange(context + 1, device=device)

    def _draw(self, tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, tokens.numel() - self.context - 1, (self.batch,), generator=gen).to(self.device)
        windows = tokens[starts[:, None] + self.offsets]
        return windows[:, :-1], windows[:, 1:]

    def train_batch(self, seed, step):
        return self._draw(self.train, seed * 1_000_003 + step)

    def eval_batches(self):
        return [self._draw(self.held_out, EVAL_SEED + i) for i in range(EVAL_BATCHES)]


# --- the model -------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, width, heads, layers):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        for layer in (self.qkv, self.proj, self.fc, self.out):
            torch.nn.init.normal_(layer.weight, std=0.02)
            torch.nn.init.zeros_(layer.bias)
        for layer in (self.proj, self.out):  # GPT-2's scaling of the residual projections
            torch.nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * layers))

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch before 2.0
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class OwnGPT2(torch.nn.Module):
    def __init__(self, layers, width, heads, context):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, width), torch.nn.Embedding(context, width)
        torch.nn.init.normal_(self.wte.weight, std=0.02)
        torch.nn.init.normal_(self.wpe.weight, std=0.01)
        self.blocks = torch.nn.ModuleList(Block(width, heads, layers) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head tied to the embedding, as GPT-2's


def make_model(args, device):
    """(model, logits function, what it is): the same initial weights on every call."""
    torch.manual_seed(MODEL_SEED)
    use_hf = args.model == "hf" or (args.model == "auto" and importlib.util.find_spec("transformers") is not None)
    if use_hf:
        from transformers import GPT2Config, GPT2LMHeadModel  # pylint: disable=import-outside-toplevel

        config = GPT2Config(vocab_size=VOCAB, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
                            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is no byte; never used here
        model = GPT2LMHeadModel(config).to(device)
        return model, (lambda x: model(input_ids=x).logits), "transformers GPT2LMHeadModel"
    model = OwnGPT2(args.layers, args.width, args.heads, args.context).to(device)
    return model, model, "own GPT-2"


# --- a run -----------------------------------------------------------------------------------------


def lr_at(args, step):
    return args.lr * min(1.0, (step + 1) / WARMUP)


def evaluate(logits_of, batches, autocast):
    with torch.no_grad(), autocast():
        losses = [F.cross_entropy(logits_of(x).float().reshape(-1, VOCAB), y.reshape(-1)).item() for x, y in batches]
    return sum(losses) / len(losses)


def train(args, name, moment_dtype, seed, batches, held_out, rows):
    device = torch.device(args.device)
    model, logits_of, kind = make_model(args, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = StreamedAdamW(params, lr=args.lr, betas=(0.9, args.beta2), weight_decay=args.weight_decay,
                        bucket_elements=int(args.bucket_m * 1e6), depth=args.depth, moment_dtype=moment_dtype,
                        name="study-" + name)
    state_bytes = sum(b.nbytes for buckets in opt._buckets for b in buckets)  # what each step reads and writes

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses, times, evals = [], [], {}
    for step in range(args.steps):
        sync()
        started = time.perf_counter()
        x, y = batches.train_batch(seed, step)
        with autocast():
            loss = F.cross_entropy(logits_of(x).float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the step's device work; the write-backs may still be in flight
        sync()
        times.append(time.perf_counter() - started)
        losses.append(value)
        eval_loss = None
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_loss = evals[step] = evaluate(logits_of, held_out, autocast)
        if not math.isfinite(value):
            print("%s: the loss is %r at step %d; stopping this run" % (name, value, step), flush=True)
            break
        rows.append({"run": name, "step": step, "loss": "%.6f" % value,
                     "eval_loss": "" if eval_loss is None else "%.6f" % eval_loss,
                     "lr": "%.3e" % lr_at(args, step), "step_s": "%.4f" % times[-1]})
        if step % 25 == 0:
            print("  %-7s step %4d  loss %.4f  %.3f s" % (name, step, value, times[-1]), flush=True)
    opt.flush()
    opt.close()  # its objects leave the store before the next run
    n_params = sum(p.numel() for p in params)
    del opt, model, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "evals": evals, "times": times, "state_bytes": state_bytes, "params": n_params,
            "model": kind}


def main():
    args = options()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or "fp32-a" not in names:
        sys.exit("--runs: %s; choose among %s, fp32-a included (the reference)" % (
            ", ".join(unknown) or "fp32-a missing", ", ".join(RUNS)))
    if torch.device(args.device).type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # the runs differ by what they are asked to
    data, root = stdlib_corpus.corpus(int(args.corpus_mb * (1 << 20))), stdlib_corpus.ROOT
    batches = Batches(data, args.context, args.batch, torch.device(args.device))
    held_out = batches.eval_batches()
    print("corpus: %.1f MB of %s's .py files; torch %s on %s" % (len(data) / 1e6, root, torch.__version__,
                                                                  args.device), flush=True)
    results, rows = {}, []
    for name in names:
        dtype_name, seed = RUNS[name]
        moment_dtype = getattr(torch, dtype_name, None)
        if moment_dtype is None:
            print("%s: skipped, this torch (%s) has no torch.%s" % (name, torch.__version__, dtype_name), flush=True)
            continue
        print("%s: moments %s, data order seed %d" % (name, dtype_name, seed), flush=True)
        results[name] = train(args, name, moment_dtype, seed, batches, held_out, rows)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", "step", "loss", "eval_loss", "lr", "step_s"])
        writer.writeheader()
        writer.writerows(rows)

    reference = results["fp32-a"]
    tail = min(50, args.steps)
    first = next(iter(results.values()))
    print("\nmodel: %s, %d layers x %d wide, %.2f M parameters; %d steps of %d x %d bytes; lr %g, betas (0.9, %g)"
          % (first["model"], args.layers, args.width, first["params"] / 1e6, args.steps, args.batch, args.context,
             args.lr, args.beta2))
    print("%-7s %10s %14s %10s %12s %12s %10s" % ("run", "final loss", "|dloss| last%d" % tail, "held-out",
                                                 "|d held-out|", "MB/step", "step s"))
    summary = {}
    for name, r in results.items():
        n = min(len(r["losses"]), len(reference["losses"]))
        window = range(max(0, n - tail), n)
        delta = sum(abs(r["losses"][i] - reference["losses"][i]) for i in window) / max(1, len(window))
        last_eval = r["evals"][max(r["evals"])] if r["evals"] else float("nan")
        ref_eval = reference["evals"][max(reference["evals"])] if reference["evals"] else float("nan")
        later = r["times"][3:] or r["times"]
        summary[name] = {
            "final_loss": statistics.fmean(r["losses"][-10:]),
            "mean_abs_dloss_last%d" % tail: delta,
            "held_out_loss": last_eval,
            "abs_d_held_out": abs(last_eval - ref_eval),
            "state_bytes": r["state_bytes"],
            "bytes_moved_per_step": 2 * r["state_bytes"],
            "median_step_s": statistics.median(later),
            "steps_run": len(r["losses"]),
        }
        s = summary[name]
        print("%-7s %10.4f %14.4f %10.4f %12.4f %12.1f %10.3f%s" % (
            name, s["final_loss"], delta, last_eval, s["abs_d_held_out"], s["bytes_moved_per_step"] / 1e6,
            s["median_step_s"], "   <- the noise floor (another data order)" if name == "fp32-b" else ""))
    print("CSV: %s" % os.path.abspath(args.csv))
    print(json.dumps({"args": vars(args), "runs": summary}))


if __name__ == "__main__":
    main()
