"""SFT's step on the demo's own demonstrations: the padded pass against the shared opening and packed rows.

Usage: .venv/bin/python bench/sft_step.py [--config configs/tiny_cpu_tool_calls.yaml] [--batches 20]
       [--pairs 3] [overrides ...]

`agent-rl sft` builds its scripted demonstrations (the config's model, toy world and retriever, started on
127.0.0.1 as `agent-rl sft` starts it) and draws `--batches` batches as its steps draw them. Each batch's
forward and backward run two ways on the same model: `padded` (rows right-padded to the longest, the path
before SFT took `train.share_prompt_prefix` and `train.pack_rows`) and `shared` (`forward_logprobs` with
`common_prefix`: the span every demonstration opens with, the system prompt and the tools' schemas, runs once,
or the rows run packed, whichever runs fewer positions). The two alternate batch by batch, `--pairs` rounds
over the batches; printed: the token positions each way runs through the model, the plan each batch took,
the median seconds a step each way and the median of the per-batch ratios. No optimizer step: both ways see
the same weights.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs/tiny_cpu_tool_calls.yaml"))
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.config import load_config
    from agent_rl.learn.batch import collate, pack_microbatches
    from agent_rl.learn.policy import _prefix_cells, _prefix_plan, forward_logprobs, load_policy, pack_plan
    from agent_rl.rollout.engines import Engine
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.run import open_loop
    from agent_rl.sft import build_demonstrations

    cfg = load_config(args.config, args.overrides)
    prepare(cfg)
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_policy(cfg.model, cfg.model.path, cfg.train.device)
    model.train()
    with open_loop(cfg, cast(Engine, None), tokenizer) as loop:
        demos = build_demonstrations(cfg, loop)
    batches = []
    for _ in range(args.batches):
        batch = [
            demos.draw(rng.randrange(len(demos)), cfg.sft.wrong_fraction, rng, cfg.sft.second_hop_fraction)
            for _ in range(cfg.sft.batch_size)
        ]
        mbs = [
            collate(batch, index, tokenizer.pad_token_id, cfg.train.device)
            for index in pack_microbatches([t.total_tokens for t in batch], cfg.train.max_tokens_per_microbatch)
        ]
        batches.append((mbs, sum(sum(t.loss_mask) for t in batch)))

    positions = {"padded": 0, "shared": 0}
    plans = {"opening": 0, "prompt": 0, "packed": 0, "padded": 0}
    opening = []
    for mbs, _ in batches:
        for mb in mbs:
            positions["padded"] += mb.num_tokens
            plan, packed = _prefix_plan(mb, common=True), pack_plan(mb)
            cells = {"packed": packed.input_ids.numel()} if packed is not None else {}
            if plan is not None:
                cells["opening" if len(plan.prompts) == 1 else "prompt"] = _prefix_cells(mb, plan)
            kind = min(cells, key=lambda k: cells[k]) if cells else "padded"
            plans[kind] += 1
            positions["shared"] += cells.get(kind, mb.num_tokens)
            if plan is not None and len(plan.prompts) == 1:
                opening.append(plan.starts[0])

    def step(mbs, mask_tokens: int, shared: bool) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for mb in mbs:
            logprobs, _ = forward_logprobs(
                model, mb, 1.0, share_prefix=shared, common_prefix=shared, pack=shared and cfg.train.pack_rows
            )
            (-logprobs.sum() / max(1, mask_tokens)).backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"padded": [], "shared": []}
    ratios = []
    step(*batches[0], True)  # warm-up, both ways
    step(*batches[0], False)
    for r in range(args.pairs):
        for i, (mbs, n) in enumerate(batches):
            order = (False, True) if (r + i) % 2 == 0 else (True, False)
            got = {shared: step(mbs, n, shared) for shared in order}
            times["padded"].append(got[False])
            times["shared"].append(got[True])
            ratios.append(got[False] / got[True])
    rows = sum(len(mb.index) for mbs, _ in batches for mb in mbs)
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(
        f"{args.batches} batches of {cfg.sft.batch_size} demonstrations ({rows} rows, "
        f"{sum(len(m) for m, _ in batches)} micro-batches); torch threads {torch.get_num_threads()}"
    )
    print(f"plans taken: {plans}; opening length {statistics.median(opening) if opening else 0} tokens (median)")
    print(
        f"positions through the model: padded {positions['padded']:,}, shared {positions['shared']:,} "
        f"({positions['shared'] / positions['padded']:.3f})"
    )
    print(
        f"seconds a step, median of {len(ratios)}: padded {statistics.median(times['padded']):.3f}, shared "
        f"{statistics.median(times['shared']):.3f}; padded / shared per batch: median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
