"""`agent-rl plot RUN_DIR`: PNG curves of reward, EM, response length and budget hits."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", ["reward/mean"]),
    ("eval_em", ["eval/em"]),
    ("response_length", ["rollout/response_length_mean", "rollout/generated_tokens_mean"]),
    (
        "budget_hits",
        [
            "budget/end_budget_total_frac",
            "budget/end_max_turns_frac",
            "budget/end_invalid_frac",
            "budget/end_answer_frac",
        ],
    ),
)


def plot_run(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass a run's output directory (run.output_dir)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, keys in PANELS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 20 else None, label=key)
                drawn = True
        if drawn:
            ax.set_xlabel("step")
            ax.set_title(name)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            target = out_dir / f"{name}.png"
            fig.savefig(target, dpi=100)
            written.append(target)
        plt.close(fig)
    return written
