#!/usr/bin/env bash
# bench/gpu_first_run.sh: the first run of the real path on one GPU, in one command.
#
# Run once, on 2026-11-27, on one H100 with ENGINE=hf (that machine had no vLLM): the numbers are in
# bench/RESULTS.md, "The first GPU run". The vLLM path (ENGINE=vllm, the default) has not met a GPU yet:
# expect to fix it on first contact, and record what it prints (date, GPU, command) in bench/RESULTS.md.
#
# On a machine with one NVIDIA GPU and the CUDA install (README's install table: vLLM 0.32, torch
# 2.13 with CUDA), it runs configs/smollm2_hotpotqa_grpo.yaml (SmolLM2-135M-Instruct + LoRA, GRPO
# on the shipped HotpotQA fixture; SFT warm start, model and index built on first use) for a few
# steps with rollout.engine=vllm on cuda:0, bf16, and prints per step:
#   - engine-trainer log-prob agreement: rollout/logprob_diff_mean and rollout/logprob_diff_max
#     (|trainer - vLLM| over sampled tokens, from the update's first pass);
#   - step time: timing/step_s (and its rollout / update / weight-sync parts);
#   - memory: `agent-rl plan`'s GPU prediction per phase against torch.cuda.max_memory_allocated
#     (memory/gpu_peak_gib: the trainer's and anything else allocated through torch's caching
#     allocator in this process) and against nvidia-smi's peak memory.used (the whole device,
#     vLLM's own pool included).
#
# Usage: bench/gpu_first_run.sh [STEPS]   (default 3; OUT=runs/gpu_first_run, VENV=.venv)
# ENGINE=hf rolls out with transformers' generate instead of vLLM (for a machine without vLLM);
# PY names the Python that holds the project (default $VENV/bin/python); EXTRA holds more
# overrides, space-separated (e.g. EXTRA="retriever.url=http://127.0.0.1:8000").
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${1:-3}
OUT=${OUT:-runs/gpu_first_run}
VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
ENGINE=${ENGINE:-vllm}
CONFIG=configs/smollm2_hotpotqa_grpo.yaml

command -v nvidia-smi >/dev/null || { echo "gpu_first_run: no nvidia-smi here; this needs a CUDA machine" >&2; exit 2; }
"$PY" -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else
  f"gpu_first_run: torch {torch.__version__} sees no CUDA device (a CPU-only torch? see the README install table)")'
[ "$ENGINE" != vllm ] || "$PY" -c 'import sys; from vllm.platforms import current_platform as p; sys.exit(None if p.device_type == "cuda" else
  f"gpu_first_run: the installed vLLM is built for {p.device_type}: install the gpu extra in a fresh venv")'

OVERRIDES=(
  "rollout.engine=$ENGINE"
  rollout.device=cuda:0
  train.device=cuda:0
  train.bf16=true
  model.dtype=bfloat16
  rollout.gpu_memory_utilization=0.3
  "run.max_steps=$STEPS"
  "run.save_every=$STEPS"
  "run.output_dir=$OUT"
  run.eval_every=0
)
# shellcheck disable=SC2206
OVERRIDES+=(${EXTRA:-})
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
mkdir -p "$OUT"
rm -f "$OUT/metrics.jsonl"

echo "== plan (1 GPU, ${GPU_MIB} MiB)"
"$PY" -m agent_rl plan "$CONFIG" "${OVERRIDES[@]}" --gpus 1 --gpu-mem "$(( GPU_MIB / 1024 ))" --json \
  > "$OUT/plan.json" || echo "plan says it does not fit; running anyway"

# The whole device's memory, sampled every 200 ms while training runs.
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 200 > "$OUT/nvidia_smi_used_mib.txt" &
SMI=$!
trap 'kill "$SMI" 2>/dev/null || true' EXIT

echo "== train $STEPS steps: $CONFIG ${OVERRIDES[*]}"
start=$(date +%s)
"$PY" -m agent_rl train "$CONFIG" "${OVERRIDES[@]}" 2>&1 | tee "$OUT/train.log"
echo "wall ${SECONDS}s total, $(( $(date +%s) - start ))s in agent-rl train"
kill "$SMI" 2>/dev/null || true

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
rows = [r for r in rows if "timing/step_s" in r]
keys = ["rollout/logprob_diff_mean", "rollout/logprob_diff_max", "timing/step_s", "timing/rollout_s",
        "timing/update_s", "timing/weight_sync", "memory/gpu_peak_gib", "reward/mean"]
print("step " + " ".join(f"{k.split('/')[1]:>18}" for k in keys))
for r in rows:
    print(f"{r['step']:>4} " + " ".join(f"{r.get(k, float('nan')):>18.4f}" for k in keys))
GIB = 2**30
plan = json.loads((out / "plan.json").read_text())
used = [int(x) for x in (out / "nvidia_smi_used_mib.txt").read_text().split() if x.strip().isdigit()]
torch_peak = max((r.get("memory/gpu_peak_gib", 0.0) for r in rows), default=0.0)
print(f"plan: fits={plan['fits']} peak {plan['gpu_peak_bytes_per_device'] / GIB:.2f} GiB ({plan['peak_phase']})")
for name, ph in plan["phases"].items():
    print(f"  plan {name:<8} {ph['gpu_bytes_per_device'] / GIB:8.2f} GiB")
print(f"measured: torch.cuda.max_memory_allocated {torch_peak:.2f} GiB (compare with the plan's update phase)")
print(f"measured: nvidia-smi peak memory.used {max(used, default=0) / 1024:.2f} GiB (compare with the plan's peak)")
EOF
