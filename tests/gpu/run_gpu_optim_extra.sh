#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On a GPU: two checks of tmsdisk.optim's streamed AdamW for issue 25, each with a daemon of its own on a
# fresh root on $NODE_DISK (default /var/tmp), no host tier (the state on the disk):
#   hf       an unmodified Hugging Face Trainer (hf_trainer_stream.py: GPT-2-shaped, bf16, 100 steps) run
#            twice per optim of HF_OPTIMS, each in its own process: under `tmsctl run`, then under
#            `tmsctl run --stream-optimizer`. PASS: the streamed run built tmsdisk.optim's class and the
#            plain one torch's, with the same fused/foreach choice, and the losses (step by step, bit for
#            bit), the parameters' SHA-256 and the optimizer state's SHA-256 are the plain run's.
#            SKIP (77) where transformers or accelerate is not installed.
#   overlap  torch_optim_overlap.py: exposed optimizer time of StreamedAdamW without and with a prefetch
#            during backward (prefetch_on_backward, or prefetch() before backward) beside resident
#            torch.optim.AdamW; PASS: parameters and losses bit-identical to resident's.
#   tests/gpu/run_gpu_optim_extra.sh BUNDLE_DIR [OUT_DIR]      (OUT_DIR: default ./optim-extra-out)
# Environment:
#   EXTRA_CASES ("hf overlap"): the checks to run.
#   HF_OPTIMS ("default adamw_torch"): TrainingArguments.optim per pair of runs; "default" passes none
#     (Trainer's default: adamw_torch_fused with PyTorch 2.8 or later); HF_STEPS (100); HF_ARGS: more
#     options for hf_trainer_stream.py.
#   OVERLAP_WIDTH (4096), OVERLAP_LAYERS (16), OVERLAP_TOKENS (131072), OVERLAP_BUCKET_ELEMENTS (33554432),
#     OVERLAP_DEPTH (3), OVERLAP_STEPS (8), OVERLAP_WARMUP (2), OVERLAP_ROUNDS (1), OVERLAP_VARIANTS
#     (compute,resident,streamed,hook,explicit), OVERLAP_FUSED (0; 1: fused=True), OVERLAP_TIER_MB (0: the
#     daemon's host tier off; a tier smaller than the state keeps part of it on disk), OVERLAP_DEVICE (cuda; cpu:
#     a dry run on a machine without a GPU, with small sizes).
# Defaults: hf about 2 minutes (four processes), overlap about 2 minutes (268 M parameters, 2.15 GB of
# state, each streamed step reading and writing it on a ~1.7 GB/s disk); within one 600 s call.
# Exit 0 when every check that ran passed, 1 when one failed, 3 when one could not run, 77 when none
# failed but one was skipped.
set -uo pipefail  # not -e: every check runs and reports
bundle_dir=$1
out=${2:-optim-extra-out}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/node.sh"
mkdir -p "$out"
out=$(cd "$out" && pwd)
cases=" ${EXTRA_CASES:-hf overlap} "
summary=$out/extra.txt
: >"$summary"

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
  uname -r
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import transformers, accelerate; print("transformers", transformers.__version__, "accelerate", accelerate.__version__)' 2>&1 | tail -1
  df -h "${NODE_DISK:-/var/tmp}" | tail -1
  grep -h "MemTotal\|MemAvailable" /proc/meminfo
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

failed=0 broken=0 skipped=0
note() { echo "$*" | tee -a "$summary"; }

# --- hf: the Trainer, plain and streamed ----------------------------------------------------------------
hf_pair() {
  local optim=$1 label=hf-$1 args=() mode status
  [ "$optim" = default ] || args=(--optim "$optim")
  # shellcheck disable=SC2206  # HF_ARGS is a list of options
  args+=(--steps "${HF_STEPS:-100}" ${HF_ARGS:-})
  for mode in plain streamed; do
    local flags=()
    [ "$mode" = streamed ] && flags=(--stream-optimizer)
    echo "== $label $mode" | tee -a "$out/hf.txt"
    "$tmsctl" run --job "$label-$mode" "${flags[@]}" -- \
      python3 "$here/hf_trainer_stream.py" --out "$out/$label-$mode.json" "${args[@]}" \
      2>"$out/$label-$mode.log" | tee -a "$out/hf.txt"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 77 ]; then
      note "SKIP hf ($optim): $(sed -n 's/^SKIP: //p' "$out/hf.txt" | tail -1)"
      skipped=1
      return
    elif [ "$status" -ne 0 ]; then
      note "FAIL hf ($optim): the $mode run exited $status (see $label-$mode.log):"
      tail -15 "$out/$label-$mode.log" | tee -a "$summary"
      broken=1
      return
    fi
  done
  python3 - "$out/$label-plain.json" "$out/$label-streamed.json" "$optim" <<'EOF' | tee -a "$summary"
import json, sys
plain, streamed = (json.load(open(p)) for p in sys.argv[1:3])
optim = sys.argv[3]
problems = []
po, so = plain["optimizer"], streamed["optimizer"]
if po["streamed"] or not po["class"].startswith("torch.optim."):
    problems.append("the plain run built %s, not torch's AdamW" % po["class"])
if not so["streamed"]:
    problems.append("the streamed run built %s, not tmsdisk.optim's (did --stream-optimizer reach it?)" % so["class"])
for key in ("fused", "foreach", "groups", "weight_decay", "betas", "eps", "lr_final"):
    if po.get(key) != so.get(key):
        problems.append("%s: plain %r, streamed %r" % (key, po.get(key), so.get(key)))
if plain["trainer_optim"] != streamed["trainer_optim"]:
    problems.append("Trainer's optim: plain %s, streamed %s" % (plain["trainer_optim"], streamed["trainer_optim"]))
a, b = plain["losses_hex"], streamed["losses_hex"]
if len(a) != plain["args"]["steps"] or len(b) != len(a):
    problems.append("losses recorded: plain %d, streamed %d, of %d steps" % (len(a), len(b), plain["args"]["steps"]))
differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
if differ:
    i = differ[0]
    worst = max(abs(plain["losses"][j] - streamed["losses"][j]) for j in differ)
    problems.append("losses differ at %d of %d steps, first at step %d (%r against %r), at most by %.3g" % (
        len(differ), len(a), i + 1, plain["losses"][i], streamed["losses"][i], worst))
for key, what in (("param_sha256", "parameters"), ("optimizer_state_sha256", "optimizer state")):
    if plain[key] != streamed[key]:
        problems.append("%s SHA-256: plain %s, streamed %s" % (what, plain[key][:16], streamed[key][:16]))
for run in (plain, streamed):
    if run["nondeterministic_warnings"]:
        print("note: the %s run used ops without a deterministic kernel: %s" % (
            run["mode"], "; ".join(run["nondeterministic_warnings"])))
speed = "plain %.1f s, streamed %.1f s for the %d steps" % (plain["train_s"], streamed["train_s"], len(a))
detail = "%s (Trainer optim %s, fused %s, foreach %s; %s, %d buckets, %.1f MB of state; transformers %s, torch %s)" % (
    so["class"], streamed["trainer_optim"], so["fused"], so["foreach"], speed, so.get("buckets", 0),
    so.get("state_bytes", 0) / 1e6, streamed["versions"]["transformers"], streamed["versions"]["torch"])
if problems:
    print("FAIL hf (%s): %s; %s" % (optim, "; ".join(problems), detail))
    sys.exit(1)
print("PASS hf (%s): %d losses bit-identical step by step, parameters SHA-256 %s and optimizer state SHA-256 %s "
      "the same streamed and not; %s" % (optim, len(a), plain["param_sha256"][:16],
                                         plain["optimizer_state_sha256"][:16], detail))
EOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}

if [[ $cases == *" hf "* ]]; then
  if NODE_DAEMON_ARGS="" start_node "$bundle_dir" "$out" optim-extra-hf; then
    : >"$out/hf.txt"
    for optim in ${HF_OPTIMS:-default adamw_torch}; do
      hf_pair "$optim"
      [ "$skipped" -eq 1 ] && break  # transformers missing: the next pair would say the same
    done
    stop_node
  else
    note "FAIL hf: the daemon did not start (tmsdiskd-optim-extra-hf.log)"
    broken=1
  fi
fi

# --- overlap: exposed optimizer time with and without a prefetch during backward -------------------------
if [[ $cases == *" overlap "* ]]; then
  daemon_args=""
  [ "${OVERLAP_TIER_MB:-0}" -gt 0 ] && daemon_args="--host-tier-mb $OVERLAP_TIER_MB"
  if NODE_DAEMON_ARGS="$daemon_args" start_node "$bundle_dir" "$out" optim-extra-overlap; then
    fused=()
    [ "${OVERLAP_FUSED:-0}" = 1 ] && fused=(--fused)
    echo "== overlap (daemon host tier ${OVERLAP_TIER_MB:-0} MiB)" | tee "$out/overlap.txt"
    "$tmsctl" run --job overlap -- python3 "$here/torch_optim_overlap.py" --json "$out/overlap.json" \
      --width "${OVERLAP_WIDTH:-4096}" --layers "${OVERLAP_LAYERS:-16}" --tokens "${OVERLAP_TOKENS:-131072}" \
      --bucket-elements "${OVERLAP_BUCKET_ELEMENTS:-33554432}" --depth "${OVERLAP_DEPTH:-3}" \
      --steps "${OVERLAP_STEPS:-8}" --warmup "${OVERLAP_WARMUP:-2}" --rounds "${OVERLAP_ROUNDS:-1}" \
      --variants "${OVERLAP_VARIANTS:-compute,resident,streamed,hook,explicit}" --device "${OVERLAP_DEVICE:-cuda}" \
      "${fused[@]}" \
      2>"$out/overlap.log" | tee -a "$out/overlap.txt"
    status=${PIPESTATUS[0]}
    grep -h "^PASS\|^FAIL\|^SKIP" "$out/overlap.txt" | sed 's/^/overlap: /' >>"$summary"
    grep -hA12 "^variant " "$out/overlap.txt" | grep -v "^PASS\|^FAIL\|^{" >>"$summary"
    case $status in
      0) note "PASS overlap" ;;
      1) note "FAIL overlap: parameters or losses differ from resident AdamW's (overlap.txt)"; failed=1 ;;
      77) note "SKIP overlap: $(sed -n 's/^SKIP: //p' "$out/overlap.txt" | tail -1)"; skipped=1 ;;
      *) note "FAIL overlap: exited $status (see overlap.log):"; tail -15 "$out/overlap.log" | tee -a "$summary"; broken=1 ;;
    esac
    stop_node
  else
    note "FAIL overlap: the daemon did not start (tmsdiskd-optim-extra-overlap.log)"
    broken=1
  fi
fi

echo "== summary ($summary)"
cat "$summary"
[ "$failed" -eq 1 ] && exit 1
[ "$broken" -eq 1 ] && exit 3
[ "$skipped" -eq 1 ] && exit 77
exit 0
