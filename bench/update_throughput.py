"""The update's forward and backward per micro-batch, at several `train.max_tokens_per_microbatch` caps.

Usage: python bench/update_throughput.py [--config configs/smollm2_nq_grpo.yaml] [--model DIR] [--device cuda:0]
       [--caps 2560 8192 32768] [--repeats 5] [key=value ...]

For the config's model as the trainer loads it (`learn.policy.load_policy`: LoRA as the config says; weights drawn
at random when `--model` holds only a config.json: time does not depend on their values), one micro-batch of
`cap // budget.max_total_tokens` rows of `budget.max_total_tokens` random tokens, the last
`(max_turns + 1) * max_tokens_per_turn` of each row trained: the trainer's `update_logprobs` forward under its
autocast (`train.bf16`), the backward of the masked log-prob sum, and zero_grad, synchronised. One warm-up, then
the median of `--repeats`. Prints seconds per micro-batch, tokens/s and, on CUDA, the peak allocated memory: how
the update's cost depends on the cap on this device (the padded-token cap decides how many micro-batches a step
runs).
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smollm2_nq_grpo.yaml")
    ap.add_argument("--model", default=str(ROOT / ".cache/smollm2-135m"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--caps", type=int, nargs="+", default=[2560, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args(argv)

    import torch
    import yaml
    from plan_vs_measured_gpu import _model_dir  # a random-init copy of the architecture when DIR has no weights

    from agent_rl.config import load_config
    from agent_rl.learn.batch import MicroBatch
    from agent_rl.learn.policy import compute_autocast, load_policy, update_logprobs

    data = yaml.safe_load((ROOT / args.config).read_text())
    data["model"].pop("warm_start", None)  # the architecture is what is timed, not a checkpoint
    path = Path(tempfile.mkdtemp(prefix="update_tput_cfg_")) / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    model_dir = _model_dir(Path(args.model))
    over = [f"model.path={model_dir}", f"train.device={args.device}", f"rollout.device={args.device}"]
    cfg = load_config(path, over + args.overrides)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(args.device)

    model = load_policy(cfg, str(model_dir), args.device)
    model.train()
    length = cfg.budget.max_total_tokens
    n_trained = min(length - 1, (cfg.budget.max_turns + 1) * cfg.budget.max_tokens_per_turn)
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(args.device) if cuda else "cpu", "torch": torch.__version__}
    results.update(config=args.config, lora=cfg.model.lora.enabled, bf16=cfg.train.bf16, length=length, caps={})
    for cap in args.caps:
        rows = max(1, cap // length)
        ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=gen).to(args.device)
        mask = torch.zeros(ids.shape, dtype=torch.float32, device=args.device)
        mask[:, length - n_trained :] = 1.0
        mb = MicroBatch(index=list(range(rows)), input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        if cuda:
            torch.cuda.reset_peak_memory_stats(args.device)
        times = []
        for _ in range(args.repeats + 1):
            sync()
            start = time.perf_counter()
            with compute_autocast(cfg, args.device):
                lp, _ = update_logprobs(cfg, model, mb)
            (lp * mb.loss_mask).sum().backward()
            model.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        row = {
            "rows": rows,
            "tokens": rows * length,
            "s_per_microbatch": seconds,
            "tokens_per_s": rows * length / seconds,
        }
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated(args.device) / 2**30
        results["caps"][cap] = row
        print(f"cap {cap}: {json.dumps(row)}", flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
