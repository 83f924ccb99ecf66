"""`agent-rl plan`'s GPU components against torch's allocator, part by part, on one CUDA device.

Usage: python bench/plan_vs_measured_gpu.py [--device cuda:0] [--model DIR] [--out FILE.json]

For SmolLM2-135M's shape (the config.json of `--model`, default .cache/smollm2-135m; weights are
drawn at random when the directory holds no weights: memory does not depend on their values) and
`configs/smollm2_hotpotqa_grpo.yaml` with train.bf16 and model.dtype=bfloat16 on the device, in
two cases (LoRA as shipped; full weights), it loads the policy as the trainer does, stands in the
AdamW state, runs the trainer's preflight pass (the largest micro-batch, unshared, under the same
autocast), then one real AdamW step on the pass's gradients, and reads torch.cuda.memory_allocated
after each part and max_memory_allocated over each. The pass runs twice: with autocast's weight
cache (torch's default, what the trainer runs) and without it, so the cache's share shows.
Printed beside the plan's components for the same config (`agent_rl.infra.plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30


def _model_dir(src: Path) -> Path:
    """`src` if it holds weights, else a random-init copy of its architecture in a temp dir."""
    if any(src.glob("*.safetensors")):
        return src
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="plan_gpu_model_"))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
    return out


def _config(model_dir: Path, device: str, lora: bool):
    import yaml

    from agent_rl.config import load_config

    data = yaml.safe_load((ROOT / "configs/smollm2_hotpotqa_grpo.yaml").read_text())
    if not lora:
        data["model"].pop("lora")  # full weights: the LoRA keys must go, not only `enabled`
    data["model"].pop("warm_start")
    path = Path(tempfile.mkdtemp(prefix="plan_gpu_cfg_")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    over = [f"model.path={model_dir}", f"train.device={device}", f"rollout.device={device}"]
    return load_config(path, over + ["rollout.engine=hf", "train.bf16=true", "model.dtype=bfloat16"])


def measure_case(model_dir: Path, device: str, lora: bool) -> dict:
    import torch

    from agent_rl.infra.plan import plan
    from agent_rl.learn.batch import MicroBatch
    from agent_rl.learn.policy import load_policy, update_logprobs

    cfg = _config(model_dir, device, lora)
    planned = plan(cfg, gpus=1)
    comp = planned.phases["update"]["components"]
    gpu_plan = {k.split("/", 1)[1]: v / GIB for k, v in comp.items() if k.startswith("gpu/")}

    def now() -> float:
        return torch.cuda.memory_allocated(device) / GIB

    def peak() -> float:
        return torch.cuda.max_memory_allocated(device) / GIB

    torch.cuda.empty_cache()
    start = now()
    model = load_policy(cfg, str(model_dir), device)
    model.train()
    params = now() - start
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6)
    held = [torch.zeros_like(p) for p in trained for _ in range(2)]  # the preflight's stand-in
    optimizer = now() - start - params
    rows = max(1, cfg.train.max_tokens_per_microbatch // cfg.budget.max_total_tokens)
    length = cfg.budget.max_total_tokens
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=gen).to(device)
    n_trained = min(length - 1, (cfg.budget.max_turns + 1) * cfg.budget.max_tokens_per_turn)
    mask = torch.zeros(ids.shape, dtype=torch.float32, device=device)
    mask[:, length - n_trained :] = 1.0
    mb = MicroBatch(index=list(range(rows)), input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
    out: dict = {"lora": cfg.model.lora.enabled, "rows": rows, "length": length, "plan_gib": gpu_plan}
    out["plan_update_gib"] = planned.phases["update"]["gpu_bytes_per_device"] / GIB
    resting = now()
    for cache in (True, False):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, cache_enabled=cache):
            lp, _ = update_logprobs(cfg, model, mb)
            after_forward = now() - resting
        after_autocast_exit = now() - resting
        lp.sum().backward()
        torch.cuda.synchronize(device)
        key = "cache" if cache else "no_cache"
        out[key] = {
            "forward_held_gib": after_forward,
            "forward_held_after_autocast_exit_gib": after_autocast_exit,
            "pass_peak_over_resting_gib": peak() - resting,
            "grads_gib": now() - resting,
            "pass_peak_gib": peak(),
        }
        del lp
    del held  # the real AdamW state replaces the stand-in at the step
    torch.cuda.reset_peak_memory_stats(device)
    before_step = now()
    opt.step()
    torch.cuda.synchronize(device)
    out["adamw_step"] = {"state_gib": now() - before_step, "transient_gib": peak() - now(), "peak_gib": peak()}
    out.update(params_gib=params, optimizer_stand_in_gib=optimizer)
    del model, opt
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("plan_vs_measured_gpu: no CUDA device here", file=sys.stderr)
        return 2
    model_dir = _model_dir(Path(args.model))
    results = {
        "gpu": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "lora": measure_case(model_dir, args.device, True),
        "full": measure_case(model_dir, args.device, False),
    }
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
