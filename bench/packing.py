"""Padded rows vs packed rows through the model: forward+backward time of one micro-batch.

Usage: .venv/bin/python bench/packing.py [--model base] [--rows 16] [--repeats 5]

The update's forward (`agent_rl.learn.policy.forward_logprobs`, the head only at trained tokens)
and its backward on the same micro-batch, two ways: rows right-padded to the longest
(`train.pack_rows=false`), and rows packed first-fit into as few rows of that width as hold them,
each sequence with its own positions and a block-diagonal causal mask (`train.pack_rows=true`).
Two length mixes: `single` (a short prompt and up to 64 new tokens, as bench/train_vs_trl.py) and
`multi` (multi-turn search trajectories, 150 to 700 tokens). Timings alternate padded / packed;
the medians are printed with the share of padding tokens each way runs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _batch(lengths: list[int], vocab: int, prompt: int):
    import torch

    from agent_rl.learn.batch import MicroBatch

    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(lengths), width))
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, vocab, (n,), generator=g)
        attn[r, :n] = 1
        mask[r, prompt:n] = 1.0
    return MicroBatch(index=list(range(len(lengths))), input_ids=ids, attention_mask=attn, loss_mask=mask)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agent_rl.learn.policy import forward_logprobs, pack_plan

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/base_model")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ROOT / args.model, dtype=torch.float32)
    model.train()
    rng = random.Random(0)
    mixes = {
        "single": ([rng.randint(20, 34) + rng.randint(30, 64) for _ in range(args.rows)], 20),
        "multi": ([rng.randint(150, 700) for _ in range(args.rows)], 60),
    }
    print(f"{'mix':<8}{'tokens':>8}{'padded':>9}{'packed':>9}{'pad % padded':>14}{'pad % packed':>14}{'speedup':>9}")
    for name, (lengths, prompt) in mixes.items():
        mb = _batch(lengths, model.config.vocab_size, prompt)
        real = sum(lengths)
        plan = pack_plan(mb)
        packed_cells = plan.input_ids.numel() if plan is not None else mb.num_tokens
        times: dict[bool, list[float]] = {False: [], True: []}
        out = {}
        for rep in range(args.repeats + 1):
            for pack in (False, True):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                lp, _ = forward_logprobs(model, mb, 1.0, pack=pack)
                lp.sum().backward()
                if rep:
                    times[pack].append(time.perf_counter() - start)
                out[pack] = lp.detach()
        diff = float((out[True] - out[False]).abs().max())
        a, b = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"{name:<8}{real:>8}{a:>8.2f}s{b:>8.2f}s{100 * (1 - real / mb.num_tokens):>13.1f}%"
            f"{100 * (1 - real / packed_cells):>13.1f}%{a / b:>8.2f}x   max |logprob diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
