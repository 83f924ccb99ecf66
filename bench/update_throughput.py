"""The update's forward and backward per micro-batch, at several `train.max_tokens_per_microbatch` caps.

Usage: python bench/update_throughput.py [--config configs/smollm2_nq_grpo.yaml] [--model DIR] [--shape NAME]
       [--full-weights] [--device cuda:0] [--caps 2560 8192 32768] [--repeats 5] [--json FILE] [key=value ...]
e.g. SmolLM2-1.7B's shape, full weights, gradient checkpointing, bf16:
       python bench/update_throughput.py --shape smollm2-1.7b --full-weights --device cuda:0 \
           model.gradient_checkpointing=true train.bf16=true model.dtype=bfloat16

For the config's model as the trainer loads it (`learn.policy.load_policy`: LoRA as the config says, or full
weights with `--full-weights`, which drops the config's `model.lora` block; weights drawn at random when `--model`
holds only a config.json, or for `--shape`, an architecture of bench/plan_vs_measured_gpu.py's SHAPES: time does
not depend on their values), one micro-batch of `cap // budget.max_total_tokens` rows of `budget.max_total_tokens`
random tokens, the last `(max_turns + 1) * max_tokens_per_turn` of each row trained: the trainer's `update_logprobs`
forward under its autocast (`train.bf16`), the backward of the masked log-prob sum, and zero_grad, synchronised.
One warm-up, then the median of `--repeats`. Prints seconds per micro-batch, tokens/s, the model FLOPs a second
and, on CUDA, the peak allocated memory and the model FLOP utilisation (MFU) against the device's dense bf16 peak
(bench/gpu_session.py's DEVICES; none on a CPU).

Model FLOPs (`model_flops`), the 6 x parameters x tokens convention made exact for this trainer: the transformer
blocks' parameters (everything but the embedding and the head) count at every token, the LM head (vocab x hidden)
at the trained positions only (the trainer computes logits only there), the input embedding (a lookup) not at all.
Full weights: 6 per parameter and token (forward 2, backward 4: activation and weight gradients). LoRA: the frozen
base costs 4 (forward 2, activation gradients 2; no weight gradients), the adapters 6. Not counted: attention's
score and value products (at 512 tokens about 2% of a 1.7B model's FLOPs, 7% of SmolLM2-135M's) and the second
forward of gradient checkpointing (a hardware cost, not a model one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def model_flops(body: int, head: int, adapters: int, tokens: int, trained: int, lora: bool) -> float:
    """Model FLOPs of one forward and backward: `body` block parameters at all `tokens`, the `head` (vocab x hidden)
    at the `trained` positions; full weights 6 per parameter and token, LoRA 4 for the frozen base and 6 for the
    `adapters` (see the module's docstring)."""
    base = 4 if lora else 6
    return base * (body * tokens + head * trained) + (6 * adapters * tokens if lora else 0)


def parameter_counts(model) -> dict[str, int]:
    """{"body", "head", "embedding", "adapters"}: unique parameters of `model` (a causal LM or its peft wrapper)
    by role; a tied head is the embedding matrix, counted in both roles."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = adapters = 0
    for name, p in model.named_parameters():  # each shared tensor once
        if p is embedding or p is head:
            continue
        if "lora_" in name:
            adapters += p.numel()
        else:
            body += p.numel()
    return {"body": body, "head": head.numel(), "embedding": embedding.numel(), "adapters": adapters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2_nq_grpo.yaml")
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m"))
    ap.add_argument("--shape", help="a random-weight architecture of bench/plan_vs_measured_gpu.py's SHAPES")
    ap.add_argument("--full-weights", action="store_true", help="train every weight (drop the config's LoRA)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--caps", type=int, nargs="+", default=[2560, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results here (after each cap)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)

    import torch
    import yaml
    from gpu_session import device_specs
    from plan_vs_measured_gpu import model_dir as make_model_dir

    from agent_rl.config import load_config
    from agent_rl.learn.batch import MicroBatch
    from agent_rl.learn.policy import compute_autocast, load_policy, update_logprobs

    data = yaml.safe_load((ROOT / args.config).read_text())
    data["model"].pop("warm_start", None)  # the architecture is what is timed, not a checkpoint
    if args.full_weights:
        data["model"].pop("lora", None)  # the LoRA keys must go, not only `enabled`
    path = Path(tempfile.mkdtemp(prefix="update_tput_cfg_")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    model_dir = make_model_dir(Path(args.model), args.shape)
    over = [f"model.path={model_dir}", f"train.device={args.device}", f"rollout.device={args.device}"]
    cfg = load_config(path, over + args.overrides)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(args.device)

    model = load_policy(cfg.model, str(model_dir), args.device)
    model.train()
    counts = parameter_counts(model)
    length = cfg.budget.max_total_tokens
    n_trained = min(length - 1, (cfg.budget.max_turns + 1) * cfg.budget.max_tokens_per_turn)
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    peak = (device_specs(device_name) or {}).get("bf16_flops")
    results = {"device": device_name, "torch": torch.__version__, "config": args.config, "shape": args.shape}
    results.update(model=str(args.model), lora=cfg.model.lora.enabled, bf16=cfg.train.bf16, length=length)
    results.update(
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        trained_per_row=n_trained,
        parameters=counts,
        peak_bf16_flops=peak,
        overrides=args.overrides,
        caps={},
    )
    for cap in args.caps:
        rows = max(1, cap // length)
        ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=gen).to(args.device)
        mask = torch.zeros(ids.shape, dtype=torch.float32, device=args.device)
        mask[:, length - n_trained :] = 1.0
        mb = MicroBatch(index=list(range(rows)), input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        if cuda:
            torch.cuda.reset_peak_memory_stats(args.device)
        times = []
        try:
            for _ in range(args.repeats + 1):
                sync()
                start = time.perf_counter()
                with compute_autocast(cfg.train, args.device):
                    lp, _ = update_logprobs(cfg.algo, cfg.train, model, mb, cfg.rollout.temperature)
                (lp * mb.loss_mask).sum().backward()
                model.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError:  # a larger cap would not fit either
            del ids, mask, mb
            model.zero_grad(set_to_none=True)
            results["caps"][cap] = {"rows": rows, "tokens": rows * length, "oom": True}
            print(f"cap {cap}: out of memory at {rows} rows", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
            break
        seconds = statistics.median(times[1:])
        flops = model_flops(
            counts["body"], counts["head"], counts["adapters"], rows * length, rows * n_trained, cfg.model.lora.enabled
        )
        row = {
            "rows": rows,
            "tokens": rows * length,
            "s_per_microbatch": seconds,
            "tokens_per_s": rows * length / seconds,
            "model_flops": flops,
            "model_tflops_per_s": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None,
        }
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated(args.device) / 2**30
        results["caps"][cap] = row
        print(f"cap {cap}: {json.dumps(row)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
