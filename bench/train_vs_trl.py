"""agent-rl vs TRL's GRPOTrainer: tokens/s per update and peak RSS, same everything.

Usage: .venv/bin/python bench/train_vs_trl.py [--steps 8] [--prompts 8] [--group 8] [--max-new 48] [--repeats 3]
(needs the `bench` extra: pip install 'agent-rl[bench]').

Same tiny model, same toy-world prompts, same batch (prompts x group), same completion length,
single turn (no retrieval: TRL has no multi-turn search loop), GRPO, lr, temperature 1, no KL,
CPU. Each side runs in its own fresh subprocess (a process pair) so peak RSS is its own. The
first step is a warm-up and is left out of the timing. Printed as ratios agent-rl / TRL; on a
shared 2-core machine one pair can swing by 20%, so the pairs alternate and the median counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_rl.infra.preflight import peak_rss_bytes  # noqa: E402


def _prompts(cfg, n: int) -> tuple[list[str], list[list[str]]]:
    import pyarrow.parquet as pq

    rows = pq.read_table(cfg.data.train_files[0]).to_pylist()[:n]
    return [r["prompt"] for r in rows], [list(r["golden_answers"]) for r in rows]


def _cfg(args):
    from agent_rl.config import load_config
    from agent_rl.infra.prepare import prepare

    cfg = load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [
            f"rollout.prompts_per_step={args.prompts}",
            f"algo.group_size={args.group}",
            "budget.max_turns=0",
            f"budget.max_tokens_per_turn={args.max_new}",
            f"budget.max_total_tokens={200 + args.max_new}",
            "train.lr=1e-5",
        ],
    )
    prepare(cfg, need_index=False)
    return cfg


def run_ours(args) -> dict:
    import random

    import torch

    from agent_rl.learn.policy import load_policy, load_tokenizer
    from agent_rl.learn.update import prepare_batch, update
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import HFEngine
    from agent_rl.rollout.loop import AgentLoop
    from agent_rl.rollout.prompts import load_prompts
    from agent_rl.rollout.rewards import compute_reward

    cfg = _cfg(args)
    tok = load_tokenizer(cfg.model.path)
    policy = load_policy(cfg, cfg.model.path, "cpu")
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
    budget = TokenBudget.from_config(cfg.budget)
    prompts = load_prompts(cfg.data.train_files, tok, budget, args.prompts)
    loop = AgentLoop(HFEngine(policy, tok, "cpu", 256, 0, cfg.rollout.fast_decode), tok, None, budget)
    times, tokens = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        trajs = loop.run(prompts.items, args.group, 1.0)
        for t in trajs:
            t.reward = compute_reward("em", t.response_text, t.golden_answers)
        batch = prepare_batch(cfg, policy, None, None, trajs, tok.pad_token_id, need_old=False)
        update(cfg, policy, None, opt, None, batch, random.Random(0))
        if step:
            times.append(time.perf_counter() - start)
            tokens.append(sum(t.total_tokens for t in trajs))
    return {
        "side": "agent-rl",
        "tokens_per_s": sum(tokens) / sum(times),
        "step_s": sum(times) / len(times),
        "completion_tokens_mean": sum(t.response_tokens for t in trajs) / len(trajs),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
    }


def run_trl(args) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_rl.learn.policy import load_tokenizer
    from agent_rl.rollout.rewards import compute_reward

    cfg = _cfg(args)
    tok = load_tokenizer(cfg.model.path)
    tok.padding_side = "left"
    prompts, golds = _prompts(cfg, args.prompts)
    data = Dataset.from_dict({"prompt": prompts, "golden": golds})

    def em(completions, golden, **_):
        return [compute_reward("em", c, g) for c, g in zip(completions, golden)]

    stamps: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

    conf = GRPOConfig(
        output_dir=str(Path("/tmp") / "trl_bench"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_new,
        learning_rate=cfg.train.lr,
        max_steps=args.steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        temperature=1.0,
        beta=0.0,
        bf16=False,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    trainer = GRPOTrainer(
        model=model, reward_funcs=em, args=conf, train_dataset=data, processing_class=tok, callbacks=[Timer()]
    )
    start = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    comp = sum(h["completions/mean_length"] for h in logs[1:]) / max(1, len(logs) - 1)
    prompt_len = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) / len(prompts)
    per_step_tokens = (prompt_len + comp) * args.prompts * args.group
    step_s = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {
        "side": "trl",
        "tokens_per_s": per_step_tokens / step_s,
        "step_s": step_s,
        "completion_tokens_mean": comp,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument(
        "--repeats", type=int, default=3, help="process pairs, run alternately; the median ratio is the result"
    )
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_ours(args) if args.side == "ours" else run_trl(args)))
        return
    print(f"{'pair':<5} {'side':<10} {'tokens/s':>10} {'s/step':>8} {'compl. len':>10} {'peak RSS MiB':>13}")
    speed, memory = [], []
    for pair in range(args.repeats):
        results = {}
        for side in ("ours", "trl"):
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--steps",
                str(args.steps),
                "--prompts",
                str(args.prompts),
                "--group",
                str(args.group),
                "--max-new",
                str(args.max_new),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(res.stderr[-3000:])
                raise SystemExit(f"{side} failed")
            results[side] = r = json.loads(res.stdout.strip().splitlines()[-1])
            print(
                f"{pair:<5} {r['side']:<10} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.2f} "
                f"{r['completion_tokens_mean']:>10.1f} {r['peak_rss_mib']:>13.0f}"
            )
        o, t = results["ours"], results["trl"]
        speed.append(o["tokens_per_s"] / t["tokens_per_s"])
        memory.append(o["peak_rss_mib"] / t["peak_rss_mib"])
    print("throughput ratio agent-rl/TRL per pair: " + " ".join(f"{x:.2f}x" for x in speed))
    print(
        f"median throughput ratio agent-rl/TRL: {statistics.median(speed):.2f}x   median peak RSS ratio: "
        f"{statistics.median(memory):.2f}x"
    )


if __name__ == "__main__":
    main()
