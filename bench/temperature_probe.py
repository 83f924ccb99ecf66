"""Where would GRPO's signal land at each rollout temperature? A probe to run before a long run.

Usage: .venv/bin/python bench/temperature_probe.py CONFIG --checkpoint DIR --data FILE.parquet
       [--questions 48] [--k 8] [--temperatures 1.0 0.6 0.3] [--out runs/temperature_probe] [key=value ...]

Greedy evaluation scores a policy by its argmax answers; GRPO learns from groups of samples at
`rollout.temperature`, and only from groups that hold both a right and a wrong answer. On a question the
greedy policy already answers, such a group mostly sharpens the sampled distribution toward the answer
greedy decoding gives anyway; on a question it gets wrong, it is the signal that can change the greedy
answer. This script evaluates CHECKPOINT on the first N questions of FILE greedily and with K samples at
each temperature (`agent-rl eval --pass-k K`), and prints per temperature: the EM of one sample, the share
of groups with differing rewards, and how many of those sit on questions greedy decoding gets wrong and
right. Tables go to OUT/results.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from agent_rl.evaluation import SPEC, complete_chunks, questions_dir

ROOT = Path(__file__).resolve().parents[1]


def per_question(out: Path) -> dict[str, list[float]]:
    """EM of every sample of every question from an evaluation's per-question files."""
    folder = questions_dir(out)
    scores: dict[str, list[float]] = defaultdict(list)
    for rows in complete_chunks(folder, json.loads((folder / SPEC).read_text())).values():
        for row in rows:
            scores[row["id"]].append(float(row["em"]))
    return dict(scores)


def summarise(greedy: dict[str, list[float]], sampled: dict[str, list[float]]) -> dict:
    """One temperature's samples against the greedy answers of the same questions."""
    mixed = {q for q, ems in sampled.items() if 0 < sum(ems) < len(ems)}
    wrong = {q for q in sampled if greedy[q][0] == 0}
    n_samples = sum(len(ems) for ems in sampled.values())
    return {
        "questions": len(sampled),
        "sample_em": sum(sum(ems) for ems in sampled.values()) / n_samples,
        "pass_at_k": sum(any(ems) for ems in sampled.values()) / len(sampled),
        "mixed_groups": len(mixed),
        "greedy_wrong": len(wrong),
        "mixed_on_greedy_wrong": len(mixed & wrong),
        "mixed_on_greedy_right": len(mixed - wrong),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--checkpoint", required=True, help="the policy to probe (a warm start or a step_N)")
    parser.add_argument("--data", required=True, help="parquet of questions, e.g. the GRPO training file")
    parser.add_argument("--questions", type=int, default=48, help="the first N questions of --data")
    parser.add_argument("--k", type=int, default=8, help="samples a question (the GRPO group size)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.6, 0.3])
    parser.add_argument("--out", default="runs/temperature_probe")
    parser.add_argument("overrides", nargs="*", help="config overrides for every evaluation (key=value)")
    args = parser.parse_intermixed_args()  # key=value overrides may follow the options
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def evaluate(name: str, extra: list[str]) -> dict[str, list[float]]:
        target = out / name
        cmd = [sys.executable, "-m", "agent_rl", "eval", args.config, "--checkpoint", args.checkpoint]
        cmd += ["--data", args.data, "--max-samples", str(args.questions), "--out", str(target), "--fresh"]
        with open(out / f"{name}.log", "w") as log:
            subprocess.run([*cmd, *extra, *args.overrides], cwd=ROOT, env=env, check=True, stdout=log, stderr=log)
        return per_question(target)

    greedy = evaluate("greedy", [])
    results = {"greedy_em": sum(ems[0] for ems in greedy.values()) / len(greedy), "by_temperature": {}}
    for temp in args.temperatures:
        # no dot in the name: the evaluation's per-question folder is named after the stem of --out
        name = f"t{temp:g}".replace(".", "_")
        sampled = evaluate(name, ["--pass-k", str(args.k), f"rollout.temperature={temp:g}"])
        results["by_temperature"][f"{temp:g}"] = summarise(greedy, sampled)
        print(f"T={temp:g}: {json.dumps(results['by_temperature'][f'{temp:g}'])}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Greedy EM on these {len(greedy)} questions: {results['greedy_em']:.3f}",
        "",
        f"| temperature | EM of one sample | pass@{args.k} | groups with differing rewards | on questions greedy "
        "gets wrong | on questions greedy gets right |",
        "|---|---|---|---|---|---|",
    ]
    for temp, r in results["by_temperature"].items():
        lines.append(
            f"| {temp} | {r['sample_em']:.3f} | {r['pass_at_k']:.3f} | {r['mixed_groups']} / {r['questions']} | "
            f"{r['mixed_on_greedy_wrong']} / {r['greedy_wrong']} | "
            f"{r['mixed_on_greedy_right']} / {r['questions'] - r['greedy_wrong']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
