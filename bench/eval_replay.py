"""Wall time of one `agent-rl eval` over N questions, live (a retriever started for the index) against
replayed from a record (`retriever.replay`, no retriever), in alternated pairs; the two give the same scores.

Usage: .venv/bin/python bench/eval_replay.py --checkpoint runs/demo/checkpoints/step_40
       [--config configs/tiny_cpu_grpo.yaml] [--questions 1000] [--pairs 3] [--out DIR] [overrides ...]

The questions are the first N over the config's test files, then its training files (the toy world's
test set alone has 510). A first live run writes the record (`retriever.record`), untimed; then each
pair runs live and replayed, the order alternating between pairs. Every run's per-question scores
(answer, EM, F1, searches, end reason) must equal the first run's, or the script stops. Prints the
medians, the record's size per 1,000 questions, and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


KEYS = ("id", "sample", "em", "f1", "searches", "turns", "end_reason", "answer")


def _scores(table: Path) -> list[tuple]:
    """The per-question scores `agent-rl eval --out TABLE` wrote to TABLE_questions/."""
    rows = []
    for path in sorted(table.with_name(table.stem + "_questions").glob("part-*.jsonl")):
        rows += [tuple(json.loads(line).get(k) for k in KEYS) for line in path.read_text().splitlines() if line]
    return sorted(rows, key=str)


def run_eval(cmd: list[str], table: Path, extra: list[str], log: Path) -> float:
    shutil.rmtree(table.with_name(table.stem + "_questions"), ignore_errors=True)
    start = time.perf_counter()
    with log.open("a") as f:
        subprocess.run(
            [*cmd, "--fresh", "--out", str(table), *extra], cwd=ROOT, check=True, stdout=f, stderr=subprocess.STDOUT
        )
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--config", default="configs/tiny_cpu_grpo.yaml")
    p.add_argument("--questions", type=int, default=1000)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/eval_replay"))
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from agent_rl.config import load_config

    cfg = load_config(str(ROOT / a.config), a.overrides)
    files = [*cfg.data.test_files, *cfg.data.train_files]
    out = a.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    record, log = out / "record", out / "eval.log"
    cmd = [
        sys.executable,
        "-m",
        "agent_rl",
        "eval",
        a.config,
        *a.overrides,
        "--checkpoint",
        a.checkpoint,
        "--data",
        *files,
        "--max-samples",
        str(a.questions),
    ]
    first = run_eval(cmd, out / "recording.json", [f"retriever.record={record}"], log)
    want = _scores(out / "recording.json")
    if len(want) != a.questions:
        raise SystemExit(f"the recording run scored {len(want)} questions, not {a.questions} (see {log})")
    print(f"recording run (live, untimed in the pairs): {first:.1f} s for {len(want)} questions", flush=True)
    times: dict[str, list[float]] = {"live": [], "replay": []}
    for i in range(a.pairs):
        for mode in ("live", "replay") if i % 2 == 0 else ("replay", "live"):
            extra = [f"retriever.replay={record}"] if mode == "replay" else []
            seconds = run_eval(cmd, out / f"{mode}.json", extra, log)
            if _scores(out / f"{mode}.json") != want:
                raise SystemExit(f"pair {i}: the {mode} evaluation's scores differ from the recording run's")
            times[mode].append(seconds)
            print(f"pair {i}  {mode:<6} {seconds:7.1f} s", flush=True)
    size = sum(f.stat().st_size for f in record.rglob("*") if f.is_file())
    res = {
        "questions": a.questions,
        "checkpoint": a.checkpoint,
        "config": a.config,
        "overrides": a.overrides,
        "seconds": times,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "record_bytes": size,
        "record_mb_per_1000": size / 1e6 * 1000 / a.questions,
        "cpus": os.cpu_count(),
    }
    (out / "results.json").write_text(json.dumps(res, indent=1))
    m = res["median_s"]
    print(
        f"medians over {a.pairs} pairs: live {m['live']:.1f} s, replayed {m['replay']:.1f} s "
        f"({m['live'] / m['replay']:.2f}x); scores identical; record {size:,} bytes "
        f"({res['record_mb_per_1000']:.2f} MB per 1,000 questions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
