"""Fused RMSNorm and SwiGLU (`train.fused_ops`) against transformers' modules: the update's
forward+backward on the same batch, in one process, the two variants interleaved call by call.

Usage: .venv/bin/python bench/fused_ops.py [--model base|tiny|smollm2] [--prompts 4] [--group 4] [--max-new 64]
       [--repeats 7]

One rollout of the model (the bench's prompts, single turn, as bench/train_vs_trl.py) makes the
batch; then `update`'s forward+backward runs on it alternately with the fused model and the plain
one (the same weights, gradients dropped after each call, no optimizer step), so both see the
same machine state. Prints the median seconds of each, their ratio, the page faults of each
call, and the bytes each forward keeps for its backward.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _saved_bytes(policy, cfg, mb, share: bool) -> int:
    import torch

    from agent_rl.learn.policy import update_logprobs

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        update_logprobs(cfg, policy, mb, share)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "base", "smollm2"], default="base")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="calls of each variant, interleaved")
    args = parser.parse_args()

    import torch
    import train_vs_trl

    from agent_rl.infra import allocator
    from agent_rl.infra.world import LOCAL
    from agent_rl.learn.fused import fuse_modules
    from agent_rl.learn.policy import load_policy, load_tokenizer, update_logprobs
    from agent_rl.learn.update import prepare_batch, share_prefix
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.engines import HFEngine
    from agent_rl.rollout.loop import AgentLoop
    from agent_rl.rollout.prompts import load_prompts

    bench_args = argparse.Namespace(
        model=args.model,
        ckpt="off",
        dtype="fp32",
        entropy="off",
        fused="off",
        allocator="auto",
        prompts=args.prompts,
        group=args.group,
        max_new=args.max_new,
    )
    cfg = train_vs_trl._cfg(bench_args)
    allocator.setup(cfg.train.host_allocator, cfg.train.host_mmap_threshold_mib)  # as `train` does
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model.path)
    plain = load_policy(cfg, cfg.model.path, "cpu")
    fused = load_policy(cfg, cfg.model.path, "cpu")
    modules = fuse_modules(fused)
    budget = TokenBudget.from_config(cfg.budget)
    prompts = load_prompts(cfg.data.train_files, tok, budget, args.prompts)
    engine = HFEngine(plain, tok, "cpu", cfg.rollout.generation_batch_size, 0, cfg.rollout.fast_decode)
    trajs = AgentLoop(engine, tok, None, budget).run(prompts.items, args.group, cfg.rollout.temperature)
    engine.sleep()
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)  # every row trains: no group has equal rewards
    batch = prepare_batch(cfg, plain, None, None, trajs, tok.pad_token_id, need_old=False)
    mb = batch.micro(list(range(len(batch))), "cpu")
    share = share_prefix(cfg, LOCAL)

    def step(policy) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        logprobs, _ = update_logprobs(cfg, policy, mb, share)
        (logprobs * mb.loss_mask).sum().backward()
        seconds = time.perf_counter() - start
        policy.zero_grad(set_to_none=True)
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    for policy in (plain, fused):  # warm-up
        step(policy)
    runs: dict[str, list[tuple[float, int]]] = {"transformers": [], "fused": []}
    for _ in range(args.repeats):
        runs["transformers"].append(step(plain))
        runs["fused"].append(step(fused))
    saved = {"transformers": _saved_bytes(plain, cfg, mb, share), "fused": _saved_bytes(fused, cfg, mb, share)}
    print(
        f"{args.model}: {len(batch)} rows, {int(mb.attention_mask.sum())} tokens, {int(mb.loss_mask.sum())} trained; "
        f"{modules} modules fused; shared prompt pass: {share}"
    )
    median = {}
    for name, values in runs.items():
        median[name] = statistics.median(s for s, _ in values)
        print(
            f"{name:<13} forward+backward median {median[name]:.3f} s "
            f"(min {min(s for s, _ in values):.3f}, max {max(s for s, _ in values):.3f}); "
            f"page faults {statistics.median(f for _, f in values):.0f}; "
            f"saved for backward {saved[name] / 2**20:.1f} MiB"
        )
    print(
        f"fused / transformers: time {median['fused'] / median['transformers']:.3f}, "
        f"saved bytes {saved['fused'] / saved['transformers']:.3f}"
    )


if __name__ == "__main__":
    main()
