"""`agent-rl plan`'s GPU components against torch's allocator, part by part, on one CUDA device.

Usage: python bench/plan_vs_measured_gpu.py [--device cuda:0] [--model DIR] [--shape NAME ...]
       [--config configs/smollm2_hotpotqa_grpo.yaml] [--cases lora full] [--out FILE.json]

For SmolLM2-135M's shape (the config.json of `--model`, default .cache/smollm2-135m; weights are
drawn at random when the directory holds no weights: memory does not depend on their values), or for
each `--shape` (SHAPES: architectures the planner was not fitted on, random weights), and `--config`
with train.bf16 and model.dtype=bfloat16 on the device, in two cases (LoRA: the config's adapters, or
rank 16 / alpha 32 on every projection where it has none; full weights), it loads the policy as the
trainer does, stands in the AdamW state, runs the trainer's preflight pass (the largest micro-batch,
unshared, under the same autocast; with full weights and algo.kl_coef > 0 beside the frozen reference the trainer
holds), then one real AdamW step on the pass's gradients, and reads
torch.cuda.memory_allocated after each part and max_memory_allocated over each. The pass runs twice:
with autocast's weight cache (torch's default, what the trainer runs) and without it, so the cache's
share shows. Printed beside the plan's components for the same config (`agent_rl.planning.plan`), with
the plan's update phase over the measured peak (the larger of the pass's and the AdamW step's).

This file also holds the random-weight model folders the GPU benchmarks share (`model_dir`,
`shape_dir`): bench/update_throughput.py and bench/gpu_session.py take them from here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30


# Architectures measured with random weights: memory and speed do not depend on the values. A shape with a
# "model_type" is a whole config; one without is applied over the base model's config.json (`--model`), whose
# tokenizer then fits it (same vocabulary), as an engine benchmark needs.
SHAPES: dict[str, dict] = {
    # SmolLM2-1.7B's published config: SmolLM2-135M's Llama architecture, wider and deeper, same vocabulary
    "smollm2-1.7b": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    # Qwen2.5-3B's published config (configs/nq_hotpotqa_grpo.yaml's model): grouped-query attention, a large vocabulary
    "qwen2.5-3b": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 11008,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
    },
    # the base's own architecture with random weights: an engine benchmark without the real weights (no early stop:
    # every row decodes its whole allowance)
    "smollm2-135m": {},
    # a few layers of the base's architecture: the CPU smoke run of bench/gpu_session.sh
    "smoke": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}
SHAPES_HOME = ROOT / ".cache" / "shapes"


def shape_config(name: str, base: Path | None):
    """The transformers config of shape `name` (SHAPES), over `base`'s config.json where the shape is partial."""
    from transformers import AutoConfig

    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type", None)
    if model_type is None:
        if base is None or not (base / "config.json").is_file():
            raise SystemExit(f"shape {name} is applied over a model's config.json: give --model DIR")
        config = AutoConfig.from_pretrained(base)
        for key, value in fields.items():
            setattr(config, key, value)
        config.head_dim = config.hidden_size // config.num_attention_heads
        kinds = getattr(config, "layer_types", None)  # one entry a layer where the architecture names them
        if kinds:
            config.layer_types = [kinds[i % len(kinds)] for i in range(config.num_hidden_layers)]
        return config
    return AutoConfig.for_model(model_type, **fields)


def shape_dir(name: str, base: Path | None = None, home: Path = SHAPES_HOME) -> Path:
    """home/NAME: shape `name` with random bf16 weights (drawn on the GPU where there is one: seconds for 3B) and,
    for a shape over `base`, base's tokenizer files. Reused while its shape.json matches."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape_config(name, base)
    out = home / name
    key = {"shape": name, "config": config.to_dict()}
    marker = out / "shape.json"
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(key, default=str)):
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the benchmark's own processes get the memory back
    if "model_type" not in SHAPES[name] and base is not None:
        for f in base.iterdir():
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy2(f, out / f.name)
    marker.write_text(json.dumps(key, default=str))
    return out


def model_dir(src: Path, shape: str | None = None) -> Path:
    """shape_dir(shape, src) for a shape; else `src` if it holds weights, else a random-init copy of its
    architecture in a temp dir."""
    if shape:
        return shape_dir(shape, src)
    if any(src.glob("*.safetensors")):
        return src
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="plan_gpu_model_"))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
    return out


def _config(model_dir: Path, device: str, lora: bool, config: str = "configs/smollm2_hotpotqa_grpo.yaml"):
    import yaml

    from agent_rl.config import load_config

    data = yaml.safe_load((ROOT / config).read_text())
    if not lora:
        data["model"].pop("lora", None)  # full weights: the LoRA keys must go, not only `enabled`
    elif not data["model"].get("lora", {}).get("enabled"):
        data["model"]["lora"] = {"enabled": True, "rank": 16, "alpha": 32}
    data["model"].pop("warm_start", None)
    path = Path(tempfile.mkdtemp(prefix="plan_gpu_cfg_")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    over = [f"model.path={model_dir}", f"train.device={device}", f"rollout.device={device}"]
    return load_config(path, over + ["rollout.engine=hf", "train.bf16=true", "model.dtype=bfloat16"])


def measure_case(model_dir: Path, device: str, lora: bool, config: str = "configs/smollm2_hotpotqa_grpo.yaml") -> dict:
    import torch

    from agent_rl.learn.batch import MicroBatch
    from agent_rl.learn.policy import _DTYPES, frozen_copy, load_policy, update_logprobs
    from agent_rl.planning.plan import largest_microbatch, optimizer_step_rows, plan

    cfg = _config(model_dir, device, lora, config)
    planned = plan(cfg, gpus=1)
    comp = planned.phases["update"]["components"]
    gpu_plan = {k.split("/", 1)[1]: v / GIB for k, v in comp.items() if k.startswith("gpu/")}

    def now() -> float:
        return torch.cuda.memory_allocated(device) / GIB

    def peak() -> float:
        return torch.cuda.max_memory_allocated(device) / GIB

    torch.cuda.empty_cache()
    start = now()
    model = load_policy(cfg.model, str(model_dir), device)
    model.train()
    params = now() - start
    # The frozen KL reference the trainer holds beside full weights (agent_rl.train), which the plan counts too.
    ref = frozen_copy(model, device, _DTYPES[cfg.model.dtype]) if cfg.algo.kl_coef > 0 and not lora else None
    reference = now() - start - params
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6)
    held = [torch.zeros_like(p) for p in trained for _ in range(2)]  # the preflight's stand-in
    optimizer = now() - start - params - reference
    cap, longest = cfg.train.max_tokens_per_microbatch, cfg.budget.max_total_tokens
    rows, length = largest_microbatch(cap, longest, optimizer_step_rows(cfg))
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
            lp, _ = update_logprobs(cfg.algo, cfg.train, model, mb, cfg.rollout.temperature)
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
    out.update(params_gib=params, reference_gib=reference, optimizer_stand_in_gib=optimizer)
    out["measured_peak_gib"] = max(out["cache"]["pass_peak_gib"], out["adamw_step"]["peak_gib"])
    out["plan_over_measured"] = out["plan_update_gib"] / out["measured_peak_gib"]
    del model, opt, ref
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m"))
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES), help="random-weight architectures (SHAPES)")
    ap.add_argument("--config", default="configs/smollm2_hotpotqa_grpo.yaml", help="budgets and micro-batch cap")
    ap.add_argument("--cases", nargs="+", choices=["lora", "full"], default=["lora", "full"])
    ap.add_argument("--out", default=None, help="write the results here as JSON (after each case)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("plan_vs_measured_gpu: no CUDA device here", file=sys.stderr)
        return 2
    results: dict = {"gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__}
    results.update(config=args.config, shapes={})
    for shape in args.shape or [None]:
        name = shape or Path(args.model).name
        folder = model_dir(Path(args.model), shape)
        results["shapes"][name] = {}
        for case in args.cases:
            got = measure_case(folder, args.device, case == "lora", args.config)
            results["shapes"][name][case] = got
            print(
                f"{name} {case}: plan {got['plan_update_gib']:.2f} GiB, measured {got['measured_peak_gib']:.2f} GiB "
                f"(plan/measured {got['plan_over_measured']:.3f})",
                flush=True,
            )
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
