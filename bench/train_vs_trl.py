"""agent-rl vs TRL's GRPOTrainer: tokens/s per step, peak RSS and where each step's time goes.

Usage: .venv/bin/python bench/train_vs_trl.py [--model tiny|base|smollm2] [--ckpt off,on] [--dtype fp32|bf16]
       [--entropy off|on] [--reward hash|em] [--allocator mimalloc|glibc]
       [--steps 6] [--prompts 4] [--group 4] [--max-new 64]
       [--repeats 3]
(needs the `bench` extra: pip install 'agent-rl[bench]').

Same work on both sides:
- the same model weights (`tiny` 2M, `base` 32M: hidden 512, 8 layers, 8/4 heads, intermediate 2048,
  tied embeddings; `smollm2`: the real SmolLM2-135M-Instruct), float32 master weights, CPU;
- the same compute dtype: `--dtype fp32`, or `bf16` (autocast over the float32 weights in
  generation and update: our `train.bf16`, TRL's `bf16=True`);
- the same toy-world prompts tokenized the same way, the same batch (prompts x group), single
  turn (TRL has no multi-turn search loop), at most `--max-new` new tokens, temperature 1, GRPO,
  the same lr, no KL, one update per generation;
- gradient checkpointing set the same on both sides, each setting of `--ckpt` reported on its own
  (TRL's default is on);
- entropy computed by both (`--entropy on`: our `algo.log_entropy`, TRL's default) or by neither
  (`off`: TRL's fused LM head asked for log-probs only);
- the reward: `hash` (default) is 0 or 1 from a hash of the completion text, so groups have a
  spread of rewards as in real training (a random model scores 0 EM everywhere, and then every
  group has equal rewards and our update skips every row); `em` is the real exact match;
- the same stopping rule: a completion ends at EOS or at a stop tag that is one token in the
  tokenizer (`</search>`, `</answer>`: our engine's `stop_token_ids`), given to TRL as the model's
  `generation_config.eos_token_id` list, which its generation stops at and its completion mask
  ends at;
- each side runs under the host allocator its own command starts with: ours as `make demo`
  starts `agent-rl` (`--allocator mimalloc`: the wheel's mimalloc preloaded; `glibc`: glibc with
  the trainer's fixed 1 MiB mmap threshold, RSS following what is held at a page fault per fresh page of each
  large tensor), TRL's under glibc's defaults;
- tokens counted the same way: prompt + completion tokens up to and including the stop token, from
  each side's own masks.

Each side runs in its own fresh subprocess so peak RSS is its own; the first step is a warm-up
left out of every number. Pairs alternate (ours, TRL, ours, TRL, ...) and the medians of the
per-pair ratios are the result. The split of a step: generation, scoring (rewards, advantages,
collation, any old/ref passes), forward+backward, optimizer (clipping and the step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_rl.runtime.memory import peak_rss_bytes  # noqa: E402

PHASES = ("generate", "score", "fwd_bwd", "optim")
MODELS = {  # name -> (model directory, overrides)
    "tiny": (".cache/tiny_model", []),
    "base": (".cache/base_model", ["model.init_size=base"]),
    "smollm2": (".cache/smollm2-135m", ["model.init_size=", "model.preset=smollm2-135m"]),
}


def hash_reward(text: str) -> float:
    return float(zlib.crc32(text.encode()) % 2)


def _reward(kind: str, text: str, golden: list[str]) -> float:
    from agent_rl.rollout.rewards import compute_reward

    return hash_reward(text) if kind == "hash" else compute_reward("em", text, golden)


def _cfg(args):
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.config import load_config

    path, extra = MODELS[args.model]
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [
            f"model.path={path}",
            *extra,
            f"model.gradient_checkpointing={str(args.ckpt == 'on').lower()}",
            f"rollout.prompts_per_step={args.prompts}",
            f"algo.group_size={args.group}",
            f"algo.log_entropy={str(args.entropy == 'on').lower()}",
            "budget.max_turns=0",
            f"budget.max_tokens_per_turn={args.max_new}",
            "budget.max_prompt_tokens=256",
            f"budget.max_total_tokens={256 + args.max_new}",
            "train.lr=1e-5",
            "train.max_grad_norm=1.0",
            f"train.bf16={str(args.dtype == 'bf16').lower()}",
        ],
    )
    prepare(cfg, need_index=False)
    return cfg


class Clock:
    """Seconds per phase, summed over the timed steps (step 0, the warm-up, is dropped)."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(PHASES, 0.0)
        self.step = 0
        self._t0: dict[str, float] = {}

    def start(self, phase: str) -> None:
        self._t0[phase] = time.perf_counter()

    def stop(self, phase: str) -> float:
        dt = time.perf_counter() - self._t0.pop(phase)
        if self.step:
            self.total[phase] += dt
        return dt


def _optimizer_clock(clock: Clock) -> None:
    """Time every optimizer step of the process (TRL's and ours alike) with torch's global hooks."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *a: clock.start("optim"))
    register_optimizer_step_post_hook(lambda *a: clock.stop("optim"))


def run_ours(args) -> dict:
    import random

    import torch

    from agent_rl.learn.policy import load_policy
    from agent_rl.learn.update import adamw, prepare_batch, update
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import EngineSpec, build_engine
    from agent_rl.rollout.loop import AgentLoop
    from agent_rl.rollout.prompts import load_prompts, load_tokenizer
    from agent_rl.runtime import allocator

    cfg = _cfg(args)
    host_allocator = allocator.setup(allocator.mmap_threshold_mib(cfg.train, cfg.rollout))  # as `train`
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model.path)
    policy = load_policy(cfg.model, cfg.model.path, "cpu")
    opt = adamw(policy.parameters(), cfg.train.lr)  # the trainer's optimizer
    budget = TokenBudget.from_config(cfg.budget)
    prompts = load_prompts(cfg.data.train_files, tok, budget, args.prompts)
    engine = build_engine(
        EngineSpec.from_config(cfg), policy, tok, seed=0
    )  # the trainer's: the HF engine over the policy module
    loop = AgentLoop(engine, tok, None, budget)
    clock = Clock()
    _optimizer_clock(clock)
    steps, tokens, completion = [], [], []
    stats: dict = {}
    for step in range(args.steps):
        clock.step = step
        start = time.perf_counter()
        clock.start("generate")
        trajs = loop.run(prompts.items, args.group, cfg.rollout.temperature)
        engine.sleep()  # as the trainer does before the update
        allocator.release()
        clock.stop("generate")
        clock.start("score")
        for t in trajs:
            t.reward = _reward(args.reward, t.response_text, t.golden_answers)
        batch = prepare_batch(
            cfg.algo,
            cfg.train,
            policy,
            None,
            None,
            trajs,
            tok.pad_token_id,
            need_old=False,
            temperature=cfg.rollout.temperature,
        )
        clock.stop("score")
        clock.start("fwd_bwd")
        optim_before = clock.total["optim"]
        stats = update(
            cfg.algo,
            cfg.train,
            policy,
            None,
            opt,
            None,
            batch,
            random.Random(step),
            temperature=cfg.rollout.temperature,
        )
        allocator.release()
        clock.stop("fwd_bwd")
        if step:
            clock.total["fwd_bwd"] -= clock.total["optim"] - optim_before
            steps.append(time.perf_counter() - start)
            tokens.append(sum(t.total_tokens for t in trajs))
            completion.append(sum(t.response_tokens for t in trajs))
    return _result(
        "agent-rl",
        steps,
        tokens,
        completion,
        clock,
        skipped=stats.get("train/skipped_zero_advantage_rows"),
        allocator=host_allocator.split(",")[0],
    )


def _result(side: str, steps: list, tokens: list, completion: list, clock: Clock, **extra) -> dict:
    n = len(steps)
    return {
        "side": side,
        "tokens_per_s": sum(tokens) / sum(steps),
        "completion_tokens_per_s": sum(completion) / sum(steps),
        "step_s": sum(steps) / n,
        "completion_tokens_mean": sum(completion) / n,
        "phases_s": {k: v / n for k, v in clock.total.items()},
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        **extra,
    }


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_rl.rollout.engines import stop_token_ids
    from agent_rl.rollout.prompts import load_tokenizer

    cfg = _cfg(args)
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model.path)
    tok.padding_side = "left"
    import pyarrow.parquet as pq

    rows = pq.read_table(cfg.data.train_files[0]).to_pylist()[: args.prompts]
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "golden": [r["golden_answers"] for r in rows]})

    def reward(completions, golden, **_):
        return [_reward(args.reward, c, list(g)) for c, g in zip(completions, golden)]

    clock = Clock()
    _optimizer_clock(clock)
    counts: list[tuple[int, int]] = []  # (all tokens, completion tokens) per step
    stamps: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            clock.start("generate")
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                seconds = clock.stop("generate")
                if clock.step:
                    clock.total["score"] -= seconds

        def _generate_and_score_completions(self, *a, **kw):
            clock.start("score")
            out = super()._generate_and_score_completions(*a, **kw)
            clock.stop("score")
            counts.append(
                (int(out["prompt_mask"].sum() + out["completion_mask"].sum()), int(out["completion_mask"].sum()))
            )
            return out

        def training_step(self, *a, **kw):
            clock.step = self.state.global_step
            clock.start("fwd_bwd")
            score_before = clock.total["score"] + clock.total["generate"]
            out = super().training_step(*a, **kw)
            clock.stop("fwd_bwd")
            if clock.step:
                clock.total["fwd_bwd"] -= clock.total["score"] + clock.total["generate"] - score_before
            return out

        def _get_per_token_logps_and_entropies(self, *a, compute_entropy=False, **kw):
            if args.entropy == "on":
                return super()._get_per_token_logps_and_entropies(*a, compute_entropy=compute_entropy, **kw)
            logps, _, aux = super()._get_per_token_logps_and_entropies(*a, compute_entropy=False, **kw)
            return logps, (torch.zeros_like(logps) if compute_entropy else None), aux

    if args.entropy == "off":  # the fused head computes log-probs only
        import trl.trainer.grpo_trainer as grpo_module

        fused = grpo_module.add_fused_lm_head
        grpo_module.add_fused_lm_head = lambda model, **kw: fused(model, **{**kw, "outputs": ("log_probs",)})

    class Stamp(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_train_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

    conf = GRPOConfig(
        output_dir=str(Path("/tmp") / "trl_bench"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_new,
        learning_rate=cfg.train.lr,
        max_grad_norm=cfg.train.max_grad_norm,
        max_steps=args.steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        temperature=cfg.rollout.temperature,
        beta=0.0,
        bf16=args.dtype == "bf16",
        gradient_checkpointing=args.ckpt == "on",
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    model.generation_config.eos_token_id = stop_token_ids(tok)  # our engine's stopping rule
    trainer = Timed(
        model=model, reward_funcs=reward, args=conf, train_dataset=data, processing_class=tok, callbacks=[Stamp()]
    )
    trainer.train()
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # step 0 is the warm-up
    return _result("trl", steps, [c[0] for c in counts[1:]], [c[1] for c in counts[1:]], clock)


def _run_side(side: str, args, ckpt: str) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--ckpt", ckpt]
    for name in ("model", "dtype", "entropy", "reward", "allocator", "steps", "prompts", "group", "max_new"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = None
    if side == "ours" and args.allocator == "mimalloc":  # started as `make demo` starts it
        from agent_rl.runtime import allocator

        env = {**os.environ, "LD_PRELOAD": allocator.mimalloc_library() or ""}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        print(res.stderr[-3000:])
        raise SystemExit(f"{side} failed")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="base")
    parser.add_argument("--ckpt", default="off,on", help="gradient checkpointing settings to run: off, on or off,on")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype of both sides")
    parser.add_argument("--entropy", choices=["off", "on"], default="off")
    parser.add_argument("--reward", choices=["hash", "em"], default="hash")
    parser.add_argument(
        "--allocator", choices=["mimalloc", "glibc"], default="mimalloc", help="our side's preloaded host allocator"
    )
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is a warm-up")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="process pairs per setting, run alternately")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_ours(args) if args.side == "ours" else run_trl(args)))
        return
    head = f"{'ckpt':<5}{'pair':<5}{'side':<10}{'tok/s':>7}{'compl/s':>8}{'s/step':>7}{'len':>6}"
    print(head + "".join(f"{p:>9}" for p in PHASES) + f"{'RSS MiB':>9}")
    summary = {}
    for ckpt in args.ckpt.split(","):
        speed, memory, peaks = [], [], {"ours": [], "trl": []}
        for pair in range(args.repeats):
            results = {side: _run_side(side, args, ckpt) for side in ("ours", "trl")}
            for side, r in results.items():
                print(
                    f"{ckpt:<5}{pair:<5}{r['side']:<10}{r['tokens_per_s']:>7.0f}{r['completion_tokens_per_s']:>8.1f}"
                    f"{r['step_s']:>7.2f}{r['completion_tokens_mean']:>6.0f}"
                    + "".join(f"{r['phases_s'][p]:>9.2f}" for p in PHASES)
                    + f"{r['peak_rss_mib']:>9.0f}"
                    + (f"  {r['allocator']}" if r.get("allocator") else "")
                    + (f"  skipped rows {r['skipped']:.0f}" if r.get("skipped") else "")
                )
                peaks[side].append(r["peak_rss_mib"])
            speed.append(results["ours"]["tokens_per_s"] / results["trl"]["tokens_per_s"])
            memory.append(results["ours"]["peak_rss_mib"] / results["trl"]["peak_rss_mib"])
        summary[ckpt] = (statistics.median(speed), statistics.median(memory), peaks)
        print(
            f"ckpt {ckpt}: throughput agent-rl/TRL per pair "
            + " ".join(f"{x:.2f}x" for x in speed)
            + f"; median {statistics.median(speed):.2f}x, median peak RSS ratio {statistics.median(memory):.2f}x"
        )
    if "off" in summary and "on" in summary:
        ours_best = min(statistics.median(summary[c][2]["ours"]) for c in summary)
        trl_on = statistics.median(summary["on"][2]["trl"])
        print(
            f"goal check: throughput with checkpointing off {summary['off'][0]:.2f}x TRL (goal >= 1.5x); "
            f"our lowest median peak RSS {ours_best:.0f} MiB vs TRL's with checkpointing on {trl_on:.0f} MiB "
            f"({ours_best / trl_on:.2f}x, goal <= 1.0x)"
        )


if __name__ == "__main__":
    main()
