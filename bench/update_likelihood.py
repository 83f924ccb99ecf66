"""Does one update lower the likelihood of the responses it rewarded? A candidate early signal, read after a run.

Usage: .venv/bin/python bench/update_likelihood.py RUN_DIR [RUN_DIR ...] [--temperature 1.0]

A run of `agent-rl train` with `run.save_every=1 run.keep_last=1000 run.save_trajectories_every=1
run.save_trajectories_per_step=N` (N = every row of a step: prompts_per_step x group_size) leaves, for each step
t, the policy after update t (`checkpoints/step_t/model`) and the step's rows with the trainer's log-probs under
the policy before it (`trajectories/step_t.jsonl`, `trainer_logprobs`). For the rows with a positive advantage
(rewarded, in a group whose rewards differ), this prints per step the mean change of their log-prob per trained
token across the update: what GRPO's update should raise. In the analysis of Search-R1's collapse by likelihood
displacement the likelihood of correct responses falls long before test EM does; the guard's replay signal reads
it on a fixed set of early responses, this reads it on each step's own. Beside it: greedy test EM and the
guard's replay drop from the run's metrics.

Each row's prompt ids are the run's tokenizer's (its config's `model.path`) encoding of its `prompt_text` (the
record keeps the text); a row whose re-encoding does not have the recorded prompt length is skipped and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # collapse_guard's reading of the fall
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def step_deltas(run_dir: Path, temperature: float) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from agent_rl.guard.signals import update_logprob_change
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.rollout.trajectory import Trajectory

    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics.setdefault(row["step"], {}).update(row)
    out = []
    files = sorted((run_dir / "trajectories").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    tok = None
    for path in files:
        step = int(path.stem.split("_")[1])
        ckpt = run_dir / "checkpoints" / f"step_{step}" / "model"
        if not ckpt.exists():
            continue
        if tok is None:  # the run's tokenizer: its config's model.path (a checkpoint holds the weights only)
            model_path = json.loads((ckpt.parent / "config.json").read_text())["model"]["path"]
            tok = load_tokenizer(str(ROOT / model_path))
        rows, old, skipped = [], [], 0
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec["excluded"] or rec["trainer_logprobs"] is None or max(rec["advantages"]) <= 0:
                continue
            prompt_ids = tok(rec["prompt_text"], add_special_tokens=False)["input_ids"]
            if len(prompt_ids) != rec["prompt_tokens"]:
                skipped += 1
                continue
            t = Trajectory(rec["prompt_id"], "", prompt_ids, [], response_ids=rec["response_ids"])
            t.loss_mask, t.logprobs = rec["loss_mask"], [0.0] * len(rec["response_ids"])
            rows.append(t)
            old.append(rec["trainer_logprobs"])
        entry = {"step": step, "rows": len(rows), "skipped": skipped, **_metric_view(metrics.get(step, {}))}
        if rows:
            model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
            # the guard's own reading; every row kept has a positive advantage, every trained token counts
            width = max(t.total_tokens for t in rows)
            positive = torch.ones(len(rows), width)
            before = {i: torch.tensor(lp) for i, lp in enumerate(old)}
            pad = tok.pad_token_id
            entry["delta"] = update_logprob_change(
                model, rows, before, positive, pad, "cpu", temperature, width * len(rows)
            )
        out.append(entry)
    return out


def _metric_view(m: dict) -> dict:
    return {k: m[key] for k, key in (("em", "eval/em"), ("replay_drop", "guard/replay_drop")) if key in m}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    for run in args.runs:
        entries = step_deltas(Path(run), args.temperature)
        print(f"## {run}\n\n| step | greedy test EM | replay drop | rewarded rows | log-prob change per token |")
        print("|---|---|---|---|---|")
        for e in entries:
            cells = [
                str(e["step"]),
                f"{e['em']:.2f}" if "em" in e else "",
                f"{e['replay_drop']:.3f}" if "replay_drop" in e else "",
                f"{e['rows']}" + (f" ({e['skipped']} skipped)" if e["skipped"] else ""),
                f"{e['delta']:+.4f}" if "delta" in e else "",
            ]
            print("| " + " | ".join(cells) + " |")
        print(summary(entries))
        print()


def summary(entries: list[dict], window: int = 3) -> str:
    """When two candidate rules would first fire (the mean change over the last `window` updates below 0; two
    of the last three updates negative) against when greedy test EM first falls 0.05 below its best (the
    collapse guard bench's measure)."""
    from collapse_guard import collapse_step

    deltas = [(e["step"], e["delta"]) for e in entries if "delta" in e]

    def mean_below_zero(i: int) -> bool:
        return i >= window - 1 and sum(d for _, d in deltas[i - window + 1 : i + 1]) < 0

    mean_rule = next((s for i, (s, _) in enumerate(deltas) if mean_below_zero(i)), None)
    sign_rule = next(
        (s for i, (s, _) in enumerate(deltas) if i >= 2 and sum(d < 0 for _, d in deltas[i - 2 : i + 1]) >= 2), None
    )
    best, fell = collapse_step([(e["step"], e["em"]) for e in entries if "em" in e])
    negative = sum(d < 0 for _, d in deltas)
    return (
        f"best greedy EM {best:.2f}, falls 0.05 below it at step {fell}; updates lowering the rewarded rows: "
        f"{negative} of {len(deltas)}; mean of the last {window} < 0 first at step {mean_rule}; two of the last "
        f"three < 0 first at step {sign_rule}"
    )


if __name__ == "__main__":
    main()
