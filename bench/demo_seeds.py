"""Does GRPO beat its warm start on the embedded default? `make demo`'s job over several seeds.

Usage: .venv/bin/python bench/demo_seeds.py [--seeds 0 1 2 3] [--out runs/demo_seeds] [--config C] [key=value ...]

For each seed: the SFT warm start (its own, `model.warm_start=OUT/sft_seed_S`) and the GRPO run
(`run.seed=S`, `run.output_dir=OUT/seed_S`) of `configs/tiny_cpu_grpo.yaml` (or `--config`); the toy world, the
tiny model and the index are shared (the world's seed is fixed, so every seed is scored on the
same held-out questions). From each run's per-question scores (`OUTPUT_DIR/eval/step_N.jsonl`) it
prints greedy and sampled test EM after SFT and after GRPO, overall and per question type, the
searches per trajectory, and a 95% paired bootstrap interval of the greedy difference. A table in
Markdown goes to OUT/results.md and the numbers to OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from agent_rl.reports.eval_report import paired_interval

ROOT = Path(__file__).resolve().parents[1]


def _scores(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "eval" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def summarise(run_dir: Path, last_step: int) -> dict:
    """SFT (step 0) against GRPO (the last step): EM and searches per group, paired intervals."""
    sft, grpo = _scores(run_dir, 0), _scores(run_dir, last_step)
    out: dict = {}
    types = sorted({r["type"] for r in sft if r["type"]})
    for group in ["all", *types]:
        row: dict = {}
        for name, rows in (("sft", sft), ("grpo", grpo)):
            for kind in ("eval", "eval_sampled"):
                picked = [r for r in rows if r["eval"] == kind and group in ("all", r["type"])]
                if picked:
                    tag = "greedy" if kind == "eval" else "sampled"
                    row[f"{name}_{tag}_em"] = sum(r["em"] for r in picked) / len(picked)
                    row[f"{name}_{tag}_searches"] = sum(r["searches"] for r in picked) / len(picked)
                    row["n"] = len(picked)
        b = {r["prompt_id"]: r["em"] for r in sft if r["eval"] == "eval" and group in ("all", r["type"])}
        a = {r["prompt_id"]: r["em"] for r in grpo if r["eval"] == "eval" and group in ("all", r["type"])}
        ids = sorted(b)
        row["greedy_diff"] = row["grpo_greedy_em"] - row["sft_greedy_em"]
        row["greedy_diff_ci95"] = paired_interval([b[i] for i in ids], [a[i] for i in ids])
        out[group] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--out", default="runs/demo_seeds")
    parser.add_argument("--config", default="configs/tiny_cpu_grpo.yaml", help="the demo's config, or another")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    results = {}
    for seed in args.seeds:
        run_dir = out / f"seed_{seed}"
        cmd = [
            str(ROOT / ".venv" / "bin" / "agent-rl"),
            "train",
            args.config,
            f"run.seed={seed}",
            f"run.output_dir={run_dir}",
            f"model.warm_start={out / f'sft_seed_{seed}'}",
            *args.overrides,
        ]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        steps = sorted(int(p.stem.split("_")[1]) for p in (run_dir / "eval").glob("step_*.jsonl"))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        alarms = [  # the collapse guard's signals (guard.action=warn): a healthy run raises none
            f"step {r['step']}: {k.split('/')[-1]}" for r in rows for k in r if k.startswith("guard/fired/")
        ]
        results[seed] = {"wall_s": wall, "steps": steps[-1], "guard_alarms": alarms, **summarise(run_dir, steps[-1])}
        print(f"seed {seed}: {json.dumps(results[seed]['all'])} ({wall:.0f} s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| seed | type | n | greedy EM SFT -> GRPO | diff [95% paired CI] | sampled EM SFT -> GRPO | "
        "searches (greedy) SFT -> GRPO |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed, res in results.items():
        for group, r in res.items():
            if not isinstance(r, dict):
                continue
            lo, hi = r["greedy_diff_ci95"]
            lines.append(
                f"| {seed} | {group} | {r['n']} | {r['sft_greedy_em']:.3f} -> {r['grpo_greedy_em']:.3f} | "
                f"{r['greedy_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                f"{r.get('sft_sampled_em', float('nan')):.3f} -> {r.get('grpo_sampled_em', float('nan')):.3f} | "
                f"{r['sft_greedy_searches']:.2f} -> {r['grpo_greedy_searches']:.2f} |"
            )
    lines += [
        "",
        "Collapse guard alarms (guard.action=warn): "
        + "; ".join(f"seed {seed}: {', '.join(res['guard_alarms']) or 'none'}" for seed, res in results.items()),
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
