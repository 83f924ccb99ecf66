"""Peak memory of training steps under a runaway policy, budgets on vs off, plan vs measured.

Usage: .venv/bin/python bench/memory_runaway.py [--group 8] [--scales 1,4,16] [--model-dir .cache/tiny_model]

The runaway policy is the tiny model sampling with every special token (eos, the agent tags)
masked out of its logits and the engine's stop tags suppressed: every turn runs to its cap,
every action is invalid and gets the corrective message. Its would-be length is L0 x scale
tokens, L0 = 440 (a reference budget: the tiny model with top-3 observations).
- on: the reference budget (2 search turns + an answer turn, prompt <= 64, 24 tokens a turn,
  observations <= 150, total <= 440). Config validation makes the per-turn caps bound the
  total, so here the per-turn cap stops the runaway first: every row has the same length at
  every scale, and never more than 440.
- off: only the engine's per-turn cap, raised so that prompt + 3 turns + 2 corrective messages
  = the would-be length; max_total_tokens is set to exactly that (the least config validation
  accepts), so it never cuts anything.
Both settings put the whole group in one micro-batch (train.max_tokens_per_microbatch = group x
max_total_tokens), so the planner's rows match the rows trained.

Each point runs in a fresh subprocess: a real rollout (HFEngine, no retriever, one prompt x
group), then two training steps (prepare_batch + update, GRPO, rewards 0/1 alternating) on those
trajectories, as the trainer's process does. Peak RSS is VmHWM over the whole process (rollout
peak shown apart). The plan column is `agent_rl.planning.plan.plan(cfg).host_peak_bytes` for the same
config. Torch runs one thread by default: on a shared 2-core machine two OpenMP threads make
the flash-attention backward 10-20x slower.
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

L0 = 440
DEMO_BUDGET = [
    "budget.max_turns=2",
    "budget.max_prompt_tokens=64",
    "budget.max_tokens_per_turn=24",
    "budget.max_obs_tokens=150",
    f"budget.max_total_tokens={L0}",
]
PROMPT = (
    "Search with <search> query </search>, answer with <answer> answer </answer>. "
    "Question: Where was Mira Halder born?\n"
)


def point(setting: str, scale: int, args) -> dict:
    """Rollout + two training steps of the runaway policy in this process; returns its peak RSS."""
    import random
    from collections import Counter

    import torch

    from agent_rl.config import load_config
    from agent_rl.learn.policy import load_policy
    from agent_rl.learn.update import prepare_batch, update
    from agent_rl.planning.plan import plan
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import HFEngine
    from agent_rl.rollout.loop import AgentLoop, PromptItem
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.rollout.protocol import INVALID_MESSAGE

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model_dir)
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    corrective = len(tok(INVALID_MESSAGE, add_special_tokens=False)["input_ids"])
    would_be = L0 * scale
    if setting == "on":
        budget, total = DEMO_BUDGET, L0
    else:
        turn = -(-(would_be - len(prompt) - 2 * corrective) // 3)
        total = len(prompt) + 3 * turn + 2 * corrective
        budget = [
            "budget.max_turns=2",
            f"budget.max_prompt_tokens={len(prompt)}",
            f"budget.max_tokens_per_turn={turn}",
            f"budget.max_obs_tokens={corrective}",
            f"budget.max_total_tokens={total}",
        ]
    cfg = load_config(
        None,
        [
            f"model.path={args.model_dir}",
            *budget,
            f"train.max_tokens_per_microbatch={args.group * total}",
            "rollout.prompts_per_step=1",
            f"algo.group_size={args.group}",
        ],
    )
    predicted = plan(cfg).host_peak_bytes
    start = time.perf_counter()
    policy = load_policy(cfg.model, cfg.model.path, "cpu")
    engine = HFEngine(policy, tok, "cpu", batch_size=cfg.rollout.generation_batch_size, seed=0)
    engine.stop_ids, engine.stop_strings = [], []  # a runaway policy: never emits a stop tag
    banned = torch.tensor(tok.all_special_ids)
    hook = policy.get_output_embeddings().register_forward_hook(
        lambda m, i, out: out.index_fill_(-1, banned, float("-inf"))
    )
    trajs = AgentLoop(engine, tok, None, TokenBudget.from_config(cfg.budget)).run(
        [PromptItem("toy-0", "toy", prompt, ["x"])], args.group
    )
    hook.remove()
    rollout_peak, rollout_s = peak_rss_bytes(), time.perf_counter() - start
    for j, t in enumerate(trajs):
        t.reward = float(j % 2)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    for step in range(2):  # step 2 runs forward/backward with the AdamW states already allocated
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
        update(
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
    return {
        "budget": setting,
        "scale": scale,
        "would_be_tokens": would_be,
        "max_total_tokens": cfg.budget.max_total_tokens,
        "max_tokens_per_turn": cfg.budget.max_tokens_per_turn,
        "tokens_per_row": max(t.total_tokens for t in trajs),
        "end_reasons": dict(Counter(t.end_reason for t in trajs)),
        "rollout_peak_mib": rollout_peak / 2**20,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "plan_mib": predicted / 2**20,
        "ratio": predicted / peak_rss_bytes(),
        "rollout_s": rollout_s,
        "train_s": time.perf_counter() - start - rollout_s,
    }


def ensure_model(model_dir: Path) -> None:
    """Build the tiny model on the hotpotqa fixture text when model_dir holds none."""
    if (model_dir / "config.json").exists():
        return
    from agent_rl.bootstrap.model_init import init_model

    corpus = ROOT / "tests" / "fixtures" / "hotpotqa100" / "corpus.jsonl"
    init_model(
        model_dir, size="tiny", texts=[json.loads(line)["contents"] for line in corpus.read_text().splitlines()], seed=0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8, help="trajectories per GRPO group (one prompt)")
    parser.add_argument("--scales", default="1,4,16", help=f"would-be lengths as multiples of L0 = {L0} tokens")
    parser.add_argument(
        "--model-dir", type=Path, default=ROOT / ".cache" / "tiny_model", help="built (tiny, seed 0) when missing"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each point's process")
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        setting, scale = args.point.split(":")
        print(json.dumps(point(setting, int(scale), args)))
        return
    ensure_model(args.model_dir)
    print(
        f"runaway policy, group of {args.group}, L0 = {L0} tokens, {args.threads} torch thread(s); each point: "
        "rollout + 2 training steps in a fresh process"
    )
    print(
        f"{'budget':>6} {'would-be':>8} {'per-turn cap':>12} {'tokens/row':>10} {'rollout MiB':>11} {'peak MiB':>8} "
        f"{'plan MiB':>8} {'plan/peak':>9} {'rollout s':>9} {'train s':>7}"
    )
    results = []
    for setting in ("on", "off"):
        for scale in (int(s) for s in args.scales.split(",")):
            cmd = [
                sys.executable,
                __file__,
                "--point",
                f"{setting}:{scale}",
                "--group",
                str(args.group),
                "--model-dir",
                str(args.model_dir),
                "--threads",
                str(args.threads),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"point {setting}:{scale} failed:\n{res.stderr[-3000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            results.append(r)
            print(
                f"{r['budget']:>6} {r['would_be_tokens']:>8} {r['max_tokens_per_turn']:>12} "
                f"{r['tokens_per_row']:>10} {r['rollout_peak_mib']:>11.0f} {r['peak_rss_mib']:>8.0f} "
                f"{r['plan_mib']:>8.0f} {r['ratio']:>9.2f} {r['rollout_s']:>9.1f} {r['train_s']:>7.1f}",
                flush=True,
            )
    print(json.dumps({"group": args.group, "L0": L0, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
