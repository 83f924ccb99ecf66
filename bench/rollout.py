"""Rollout throughput, wasted tokens after stop tags, and peak RSS of a runaway rollout.

Usage: .venv/bin/python bench/rollout.py [--prompts 32] [--group 4]

1. Trajectories/s and generated tokens/s of the HFEngine with the tiny model on the toy world,
   against a real retriever on 127.0.0.1.
2. The share of generated tokens that come after a stop tag in the same turn (Search-R1 lets
   each turn run to its limit: >20% waste; the goal here is 0).
3. Peak RSS of a runaway policy (stop tags suppressed, so it never stops) as the length it
   would generate grows 1x, 4x, 16x: with budgets on (the per-turn and total caps hold) and off
   (only the engine's per-turn cap, raised with the would-be length). Each point runs in a
   fresh subprocess so its peak RSS (VmHWM) is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_rl.runtime.memory import peak_rss_bytes  # noqa: E402


def _setup(cfg_overrides: list[str]):
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", cfg_overrides)
    prepare(cfg)
    return cfg


def throughput(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agent_rl.bootstrap.prepare import local_retriever
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import HFEngine
    from agent_rl.rollout.loop import AgentLoop
    from agent_rl.rollout.prompts import load_prompts, load_tokenizer
    from retriever_server.client import RetrieverClient

    cfg = _setup([])
    path = cfg.model.warm_start if Path(cfg.model.warm_start).exists() else cfg.model.path
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    budget = TokenBudget.from_config(cfg.budget)
    prompts = load_prompts(cfg.data.train_files, tok, budget, args.prompts)
    torch.set_num_threads(os.cpu_count() or 1)
    with local_retriever(cfg.retriever) as url:
        engine = HFEngine(model, tok, "cpu", batch_size=256, seed=0)
        loop = AgentLoop(engine, tok, RetrieverClient(url), budget)
        loop.run(prompts.items[:4], 1)  # warm-up
        engine.stats["generated_tokens"] = 0
        start = time.perf_counter()
        trajs = loop.run(prompts.items, args.group, temperature=1.0)
        wall = time.perf_counter() - start
    stop_ids = set(engine.stop_ids)
    generated = wasted = 0
    for t in trajs:
        turn = []
        for i, m in zip(t.response_ids + [None], t.loss_mask + [0]):
            if m:
                turn.append(i)
                continue
            if turn:
                generated += len(turn)
                first = next((k for k, x in enumerate(turn) if x in stop_ids), None)
                wasted += 0 if first is None else len(turn) - first - 1
                turn = []
    print(
        f"model: {path}  ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), {len(trajs)} trajectories "
        f"({args.prompts} prompts x {args.group})"
    )
    print(f"trajectories/s:        {len(trajs) / wall:8.2f}")
    print(
        f"generated tokens/s:    {generated / wall:8.1f}   "
        f"(generation only: {engine.stats['generated_tokens'] / max(1e-9, engine.stats['generate_s']):.1f})"
    )
    print(f"mean turns:            {sum(len(t.turns) for t in trajs) / len(trajs):8.2f}")
    print(
        f"tokens after a stop:   {wasted} of {generated} generated = {100.0 * wasted / max(1, generated):.2f}%  "
        "(Search-R1: >20%)"
    )


def runaway_point(mult: int, budget_on: bool) -> dict:
    """One runaway rollout in this process; returns its peak RSS."""
    from transformers import AutoModelForCausalLM

    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import HFEngine
    from agent_rl.rollout.loop import AgentLoop, PromptItem
    from agent_rl.rollout.prompts import load_tokenizer

    cfg = _setup([])
    tok = load_tokenizer(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    base_turn = 64
    would_be = base_turn * mult
    if budget_on:
        budget = TokenBudget(
            max_turns=2,
            max_prompt_tokens=200,
            max_tokens_per_turn=base_turn,
            max_obs_tokens=150,
            max_total_tokens=200 + 2 * (base_turn + 150) + base_turn,
        )
    else:
        budget = TokenBudget(
            max_turns=2,
            max_prompt_tokens=200,
            max_tokens_per_turn=would_be,
            max_obs_tokens=10**9,
            max_total_tokens=10**9,
        )
    engine = HFEngine(model, tok, "cpu", batch_size=64, seed=0)
    engine.stop_ids = []  # a runaway policy: never emits a stop tag
    engine.stop_strings = []
    loop = AgentLoop(engine, tok, None, budget)
    prompt = tok("Answer the given question. Question: where was Doran Velk born?\n", add_special_tokens=False)[
        "input_ids"
    ]
    items = [PromptItem(f"toy-{i}", "toy", prompt, ["x"]) for i in range(16)]
    rss0 = peak_rss_bytes()
    start = time.perf_counter()
    trajs = loop.run(items, 4, temperature=1.0)
    return {
        "mult": mult,
        "budget": "on" if budget_on else "off",
        "would_be_tokens_per_turn": would_be,
        "max_total_tokens_seen": max(t.total_tokens for t in trajs),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "rss_growth_mib": (peak_rss_bytes() - rss0) / 2**20,
        "seconds": time.perf_counter() - start,
    }


def runaway(args) -> None:
    print(
        f"\n{'budget':>6} {'x':>3} {'would-be/turn':>13} {'longest traj':>12} {'peak RSS MiB':>12} "
        f"{'growth MiB':>10} {'s':>6}"
    )
    for budget_on in (True, False):
        for mult in (1, 4, 16):
            res = subprocess.run(
                [sys.executable, __file__, "--point", str(mult), "--budget", "on" if budget_on else "off"],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(
                f"{r['budget']:>6} {r['mult']:>3} {r['would_be_tokens_per_turn']:>13} "
                f"{r['max_total_tokens_seen']:>12} {r['peak_rss_mib']:>12.0f} {r['rss_growth_mib']:>10.0f} "
                f"{r['seconds']:>6.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--point", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="on", help=argparse.SUPPRESS)
    parser.add_argument("--skip-runaway", action="store_true")
    args = parser.parse_args()
    if args.point:
        print(json.dumps(runaway_point(args.point, args.budget == "on")))
        return
    throughput(args)
    if not args.skip_runaway:
        runaway(args)


if __name__ == "__main__":
    main()
