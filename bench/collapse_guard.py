"""A run that collapses, with the collapse guard off and with it rolling back: both curves, and when the guard fired.

Usage: .venv/bin/python bench/collapse_guard.py [--seeds 0] [--out runs/collapse_guard] [key=value ...]

For each seed, `configs/tiny_cpu_collapse.yaml` (the embedded default's toy world and warm start, an entropy
bonus far too large, no KL, greedy test EM every step) runs twice: `guard.action=off` (the collapse as it
happens; every signal is still a metric) and `guard.action=rollback`. From the off run it reports the best
test EM, the step at which test EM first falls 0.05 below the best reached so far (the collapse), and the step
at which the guard's rule, applied to that run's own metrics, first fires; the lead is the difference. From
the rollback run: when it fired, what it did, and its final test EM against the best test EM reached before
its first signal. OUT/results.md, OUT/results.json, OUT/collapse_guard.png (test EM, reward and the early
signals of both runs per update).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu_collapse.yaml"
FALL = 0.05  # test EM this far below its best so far: collapsed


def _rows(run_dir: Path) -> list[dict]:
    """The metric rows of the run's updates, in the order they ran (a rollback repeats steps), each with its test
    EM (logged in the same row with run.eval_every=1; the step-0 evaluation is its own row)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def collapse_step(ems: list[tuple[int, float]]) -> tuple[float, int | None]:
    """(best test EM, first step whose EM is FALL below the best before it) over (step, EM) in run order."""
    best, fell = -1.0, None
    for step, em in ems:
        if fell is None and best >= 0 and em <= best - FALL:
            fell = step
        best = max(best, em)
    return best, fell


def replay_guard(rows: list[dict], overrides: list[str]) -> tuple[int | None, str]:
    """The step and the signal at which the configured guard (as `warn`) first fires on these metrics."""
    from agent_rl.config import load_config
    from agent_rl.guard.collapse import CollapseGuard

    cfg = load_config(str(ROOT / CONFIG), [*overrides, "guard.action=warn"])
    guard = CollapseGuard(cfg.guard)
    for r in rows:
        if "reward/mean" in r:
            decision, _ = guard.observe(r["step"], r)
            if decision.action != "none":
                return r["step"], decision.message
    return None, ""


def run(out: Path, mode: str, seed: int, overrides: list[str]) -> tuple[Path, float]:
    run_dir = out / f"{mode}_seed_{seed}"
    cmd = [
        sys.executable,
        "-m",
        "agent_rl",
        "train",
        CONFIG,
        f"run.seed={seed}",
        f"run.output_dir={run_dir}",
        f"guard.action={mode}",
        "run.overwrite=true",  # a rerun of the bench starts each run afresh
        *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.perf_counter()
    with (out / f"{mode}_seed_{seed}.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode not in (0, 1):  # 1: the guard stopped the run after guard.max_rollbacks
        raise SystemExit(f"{mode} seed {seed} failed (exit {proc.returncode}); see {log.name}")
    return run_dir, time.perf_counter() - start


def summarise(off_dir: Path, rb_dir: Path, overrides: list[str]) -> dict:
    off, rb = _rows(off_dir), _rows(rb_dir)
    off_em = [(r["step"], r["eval/em"]) for r in off if "eval/em" in r]
    best, fell = collapse_step(off_em)
    fired, message = replay_guard(off, overrides)
    rb_em = [(r["step"], r["eval/em"]) for r in rb if "eval/em" in r]
    fired_at = [i for i, r in enumerate(rb) if any(k.startswith("guard/fired/") for k in r)]
    first = rb[fired_at[0]]["step"] if fired_at else None
    before = [r["eval/em"] for r in rb[: fired_at[0] if fired_at else len(rb)] if "eval/em" in r]
    rollbacks = [r["step"] for r in rb if r.get("guard/rollback")]
    return {
        "off": {
            "best_em": best,
            "final_em": off_em[-1][1],
            "collapse_step": fell,
            "first_signal_step": fired,
            "first_signal": message,
            "lead_steps": (fell - fired) if fell is not None and fired is not None else None,
        },
        "rollback": {
            "first_signal_step": first,
            "rollbacks_at": rollbacks,
            "stopped": bool([r for r in rb if r.get("guard/stop")]),
            "best_em_before_signal": max(before, default=float("nan")),
            "final_em": rb_em[-1][1],
            "updates": sum(1 for r in rb if "reward/mean" in r),
        },
    }


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("test EM (greedy)", "eval/em"),
        ("reward", "reward/mean"),
        ("update: log-prob change of its rewarded rows", "guard/update_logprob_change"),
        ("policy entropy", "actor/entropy"),
        ("replay log-prob per token", "guard/replay_logprob"),
        ("grad norm (3-step median / window median)", "guard/grad_norm_ratio"),
        ("malformed responses", "rollout/format_error_frac"),
        ("responses looping on an n-gram", "rollout/repeat_frac"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(17, 6.5))
    for ax, (title, key) in zip(axes.flat, panels):
        for name, rows in runs.items():
            xs, ys, update = [], [], 0
            for r in rows:
                update += "reward/mean" in r
                if key in r:
                    xs.append(update)
                    ys.append(r[key])
            ax.plot(xs, ys, label=name, marker=".", linewidth=1)
            for i, r in enumerate(rows):
                if r.get("guard/rollback"):
                    ax.axvline(sum("reward/mean" in x for x in rows[: i + 1]), color="red", alpha=0.3, linewidth=1)
        if key == "guard/update_logprob_change":
            ax.axhline(0.0, color="grey", linewidth=0.8)  # the update should raise its rewarded rows: above this
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{CONFIG}: guard off vs guard.action=rollback (red lines: rollbacks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="runs/collapse_guard")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["off", "rollback"],
        default=["off", "rollback"],
        help="runs to make; one left out is read from an earlier run in --out (rollback only: after a rule change)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs (key=value)")
    args = parser.parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        off_dir, off_s = (
            run(out, "off", seed, args.overrides) if "off" in args.modes else (out / f"off_seed_{seed}", 0.0)
        )
        rb_dir, rb_s = (
            run(out, "rollback", seed, args.overrides)
            if "rollback" in args.modes
            else (out / f"rollback_seed_{seed}", 0.0)
        )
        res = summarise(off_dir, rb_dir, args.overrides)
        res["wall_s"] = {"off": off_s, "rollback": rb_s}
        results[seed] = res
        print(f"seed {seed}: {json.dumps(res)}", flush=True)
        if seed == args.seeds[0]:
            plot({"guard off": _rows(off_dir), "guard rollback": _rows(rb_dir)}, out / "collapse_guard.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| seed | off: best EM -> final | off: EM falls 0.05 at step | off: guard would fire at step (signal) | "
        "lead (steps) | rollback: fired at | rollbacks at | rollback: best EM before signal -> final |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, r in results.items():
        o, b = r["off"], r["rollback"]
        lines.append(
            f"| {seed} | {o['best_em']:.3f} -> {o['final_em']:.3f} | {o['collapse_step']} | "
            f"{o['first_signal_step']} ({o['first_signal'].split(': ')[1] if o['first_signal'] else '-'}) | "
            f"{o['lead_steps']} | {b['first_signal_step']} | {b['rollbacks_at']}{' then stop' if b['stopped'] else ''}"
            f" | {b['best_em_before_signal']:.3f} -> {b['final_em']:.3f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
