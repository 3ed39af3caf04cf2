# SPDX-License-Identifier: Apache-2.0
"""On a GPU, under `tmsctl run` (with or without --stream-optimizer): an unmodified Hugging Face Trainer
training a GPT-2-shaped model, writing its per-step losses and the SHA-256 of its final parameters (issue
25: streamed, the losses and the digest must be those of the run without streaming).

    tmsctl run -- python3 hf_trainer_stream.py --out plain.json
    tmsctl run --stream-optimizer -- python3 hf_trainer_stream.py --out streamed.json
    (run_gpu_optim_extra.sh runs both and compares them)

The program is the same both times; only `tmsctl run --stream-optimizer` makes the torch.optim.AdamW that
Trainer builds (its optim "adamw_torch_fused", the default with PyTorch 2.8 or later, or "adamw_torch")
tmsdisk.optim.StreamedAdamW, with the same arguments: fused=True stays fused, foreach stays foreach (and
where accelerate turns fused on in the param groups of a torch.optim.AdamW that left it unset, as recent
accelerate does when it wraps the optimizer, it does so in both runs: the JSON records the groups' flags
after training). The streamed class's bucket_elements, which `--stream-optimizer` does not set, defaults
here to --stream-bucket-elements (4 M: this model's state in 6 buckets, more than the depth of 3, so that
every step reads its state back from the store); Trainer is not touched.

The model: transformers' GPT2LMHeadModel from a GPT2Config (no pretrained weights), 6 layers x 512 wide, 8
heads, a byte vocabulary (256), context 256, GPT-2's dropout, eager attention (its backward is
deterministic, unlike flash or cuDNN attention's), fp32 weights with bf16 autocast (Trainer's bf16=True);
100 steps of 16 windows of the Python standard library's .py files (the bytes of moment_dtype_study.py's
corpus: no network, no datasets), a fixed seed, one process, dataloader_num_workers=0,
torch.use_deterministic_algorithms (warn_only: an op without a deterministic kernel is named in the JSON
rather than stopping the run). Trainer's own loop, optimizer, scheduler (cosine, 10 warm-up steps),
gradient clipping and weight decay groups; a forward hook and a callback only record.

The JSON (--out): the transformers, accelerate and torch versions, Trainer's optim and the optimizer class
it built (with fused and foreach as its param groups hold them, and for the streamed class its buckets),
the model's loss at every step (float and float.hex()), the SHA-256 of the parameters and of the
optimizer's state (step, exp_avg, exp_avg_sq of every parameter, from state_dict()) after the last step,
Trainer's log history, the run's time, and the warnings that name a nondeterministic op.

Exit 77 with the reason when transformers or accelerate is not installed, or there is no CUDA device
(--cpu runs on the host instead, in fp32: a dry run).
"""

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time

import stdlib_corpus  # beside this script (the scripts run as files)
import warnings

# cuBLAS picks reproducible kernels only with a fixed workspace (node.sh sets it too); before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

SKIP = 77
VOCAB = 256  # bytes


def options():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's")
    parser.add_argument("--attn", default="eager", help="attn_implementation (eager: a deterministic backward)")
    parser.add_argument("--optim", default=None,
                        help="TrainingArguments.optim (default: Trainer's own default, adamw_torch_fused with "
                             "PyTorch 2.8 or later; adamw_torch takes the foreach kernel)")
    parser.add_argument("--stream-bucket-elements", type=int, default=4_000_000,
                        help="streamed runs only: the streamed class's bucket_elements (0: its default, 200 M, "
                             "which puts this model's state in 2 buckets, both kept in memory between steps "
                             "at depth 3, so that nothing would be read back)")
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--cpu", action="store_true", help="a dry run on the host, fp32")
    return parser.parse_args()


def skip(reason):
    print("SKIP: %s" % reason, flush=True)
    sys.exit(SKIP)


# --- data ------------------------------------------------------------------------------------------


def windows_dataset(torch, data, context, count, seed):
    """`count` windows of `context` bytes at starts drawn from `seed`: input_ids and labels (the model
    shifts them)."""

    class Windows(torch.utils.data.Dataset):
        def __init__(self):
            self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            gen = torch.Generator().manual_seed(seed)
            self.starts = torch.randint(0, len(data) - context - 1, (count,), generator=gen).tolist()

        def __len__(self):
            return len(self.starts)

        def __getitem__(self, i):
            s = self.starts[i]
            ids = self.tokens[s : s + context].long()
            return {"input_ids": ids, "labels": ids.clone()}

    return Windows()


# --- digests ---------------------------------------------------------------------------------------


def tensor_bytes(torch, t):
    t = t.detach()
    if hasattr(t, "full_tensor"):  # a DTensor (not expected on one GPU)
        t = t.full_tensor()
    return t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def parameters_digest(torch, model):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(("%s %s %s\n" % (name, p.dtype, tuple(p.shape))).encode())
        h.update(tensor_bytes(torch, p))
    return h.hexdigest()


def optimizer_state_digest(torch, optimizer):
    """step, exp_avg and exp_avg_sq of every parameter in state_dict() (torch's keys; the streamed class
    gives them materialized, as torch's class has them), in index order, each with its dtype and shape."""
    state = optimizer.state_dict()["state"]
    h = hashlib.sha256()
    for index in sorted(state):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = state[index].get(key)
            if not torch.is_tensor(t):
                t = torch.tensor(float(t), dtype=torch.float32)
            h.update(("%s %s %s %s\n" % (index, key, t.dtype, tuple(t.shape))).encode())
            h.update(tensor_bytes(torch, t))
    return h.hexdigest(), len(state)


# --- the run ---------------------------------------------------------------------------------------


def main():
    args = options()
    for module, why in (("transformers", "Hugging Face transformers is not installed"),
                        ("accelerate", "accelerate, which transformers' Trainer needs, is not installed")):
        if importlib.util.find_spec(module) is None:
            skip("%s for %s (pip install transformers accelerate)" % (why, sys.executable))
    import torch  # pylint: disable=import-outside-toplevel

    if not args.cpu and not torch.cuda.is_available():
        skip("no CUDA device (--cpu for a dry run on the host)")
    try:
        import accelerate  # pylint: disable=import-outside-toplevel
        import transformers  # pylint: disable=import-outside-toplevel
        from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # pylint: disable=import-outside-toplevel
                                  TrainingArguments, default_data_collator)
    except ImportError as e:
        skip("transformers' Trainer cannot be imported: %s" % e)

    streaming = os.environ.get("TMSDISK_STREAM_OPTIMIZER", "").strip() or None
    if streaming:
        streamed_class = torch.optim.AdamW  # the start-up module made it tmsdisk.optim's at `import torch`
        if not streamed_class.__module__.startswith("tmsdisk."):
            print("FAIL: TMSDISK_STREAM_OPTIMIZER=%s but torch.optim.AdamW is %s.%s: the start-up module did not "
                  "run (is this under `tmsctl run`?)" % (streaming, streamed_class.__module__,
                                                         streamed_class.__qualname__), flush=True)
            sys.exit(1)
        if args.stream_bucket_elements > 0:
            # `tmsctl run --stream-optimizer` has no bucket size of its own: the class Trainer will find under
            # torch.optim.AdamW gets this default (what an explicit bucket_elements= would override); Trainer
            # itself is untouched, and the run without streaming skips this.
            torch.optim.AdamW = type(streamed_class.__name__, (streamed_class,), {
                "__init__": functools.partialmethod(streamed_class.__init__,
                                                    bucket_elements=args.stream_bucket_elements),
                "__module__": streamed_class.__module__, "__qualname__": streamed_class.__qualname__,
                "__doc__": streamed_class.__doc__})
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    transformers.set_seed(args.seed)

    data = stdlib_corpus.corpus(int(args.corpus_mb * (1 << 20)))
    dataset = windows_dataset(torch, data, args.context, args.steps * args.batch, args.seed + 1)

    config = GPT2Config(vocab_size=VOCAB, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                        attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is no byte
    try:  # the setter transformers 4.36 and later have; the model's constructor keeps what is asked
        config._attn_implementation = args.attn  # pylint: disable=protected-access
    except AttributeError:
        config._attn_implementation_internal = args.attn  # pylint: disable=protected-access
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)  # on the host, from the seed: the same weights in both runs
    attn = getattr(model.config, "_attn_implementation", None)

    losses = []  # the model's loss of each forward, kept on the device until the end

    def keep_loss(_module, _inputs, output):
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)):
            loss = output[0]
        if loss is not None:
            losses.append(loss.detach().float().clone())

    model.register_forward_hook(keep_loss)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.forwards_at_step_end, self.times, self.started = [], [], None

        def on_step_begin(self, _args, state, control, **kwargs):  # pylint: disable=unused-argument
            self.started = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):  # pylint: disable=unused-argument
            self.forwards_at_step_end.append(len(losses))
            self.times.append(time.perf_counter() - self.started)

    callback = StepTimes()
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    wanted = dict(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-stream."),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        max_grad_norm=1.0,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        bf16=not args.cpu,
    )
    if args.optim:
        wanted["optim"] = args.optim
    if args.cpu:
        wanted["use_cpu" if "use_cpu" in fields else "no_cuda"] = True
    dropped = sorted(k for k in wanted if k not in fields)
    training_args = TrainingArguments(**{k: v for k, v in wanted.items() if k in fields})

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=default_data_collator,
                      callbacks=[callback])
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = trainer.train()
    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - started
    nondeterministic = sorted({str(w.message)[:400] for w in caught if "determinis" in str(w.message).lower()})

    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
    cls = type(inner)
    group = inner.param_groups[0]
    info = {
        "class": "%s.%s" % (cls.__module__, cls.__qualname__),
        "streamed": cls.__module__.startswith("tmsdisk."),
        "groups": len(inner.param_groups),
        "fused": [g.get("fused") for g in inner.param_groups],
        "foreach": [g.get("foreach") for g in inner.param_groups],
        "lr_final": group.get("lr"),
        "betas": list(group.get("betas", ())),
        "eps": group.get("eps"),
        "weight_decay": [g.get("weight_decay") for g in inner.param_groups],
    }
    if info["streamed"]:
        buckets = [b for g in inner._buckets for b in g]  # pylint: disable=protected-access
        info.update(buckets=len(buckets), bucket_elements=inner._bucket_elements,  # pylint: disable=protected-access
                    state_bytes=sum(b.nbytes for b in buckets),
                    moment_dtype=str(inner._moment_dtype))  # pylint: disable=protected-access
    state_digest, state_params = optimizer_state_digest(torch, inner)

    # One forward a step (gradient_accumulation_steps=1): the loss of step i is the last forward before
    # the callback's on_step_end of step i.
    marks = callback.forwards_at_step_end
    step_losses = [float(losses[m - 1].item()) for m in marks if m > 0]
    result = {
        "mode": "streamed" if streaming else "plain",
        "TMSDISK_STREAM_OPTIMIZER": streaming,
        "versions": {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
                     "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "args": vars(args),
        "trainer_optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "training_arguments_not_in_this_transformers": dropped,
        "attn_implementation": attn,
        "params": sum(p.numel() for p in model.parameters()),
        "optimizer": info,
        "steps": trainer.state.global_step,
        "forwards": len(losses),
        "losses": step_losses,
        "losses_hex": [v.hex() for v in step_losses],
        "param_sha256": parameters_digest(torch, model),
        "optimizer_state_sha256": state_digest,
        "optimizer_state_params": state_params,
        "train_loss": getattr(output, "training_loss", None),
        "train_s": round(train_s, 3),
        "step_s": [round(t, 4) for t in callback.times],
        "log_history": trainer.state.log_history,
        "nondeterministic_warnings": nondeterministic,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("%s: %s (optim %s, fused %s, foreach %s%s), %d steps in %.1f s, final loss %.6f, parameters SHA-256 %s" % (
        result["mode"], info["class"], result["trainer_optim"], info["fused"], info["foreach"],
        ", %d buckets, %.1f MB of state" % (info["buckets"], info["state_bytes"] / 1e6) if info["streamed"] else "",
        result["steps"], train_s, step_losses[-1] if step_losses else float("nan"), result["param_sha256"][:16]),
        flush=True)
    if nondeterministic:
        print("warning: ops without a deterministic kernel ran: %s" % "; ".join(nondeterministic), flush=True)


if __name__ == "__main__":
    main()
