"""The papers' table from per-question evaluation records, as pure functions: per `data_source` EM,
F1, question count, searches and response tokens per trajectory, end reasons (shares), and the
unweighted mean over datasets (Search-R1's "Avg."), each EM / F1 / pass@k with a 95% bootstrap
interval; rendered as JSON for tools and Markdown for people.

A record is one trajectory: `{"id", "data_source", "type", "sample", "em", "f1", "searches",
"response_tokens", "end_reason"}` (what `agent_rl.evaluation` writes). With k samples per question
(`pass_k`), EM and F1 are means over all k·n trajectories, intervals resample whole questions, and
pass@k counts a question when any of its samples is right. Departure from Search-R1: it reports
point estimates only.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

DRAWS = 2000


def paired_interval(before: list[float], after: list[float], draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(after - before) over the same questions."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def macro_interval(groups: Sequence[Sequence[float]], draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the unweighted mean over `groups` of each group's mean,
    every group resampled on its own (its questions with replacement). One group: the interval of
    its mean."""
    rng = np.random.default_rng(seed)
    totals = np.zeros(draws)
    for values in groups:
        v = np.asarray(values, dtype=np.float64)
        for lo in range(0, draws, 256):  # blocks of draws: (256, n) indices at a time, not (draws, n)
            hi = min(draws, lo + 256)
            totals[lo:hi] += v[rng.integers(0, len(v), (hi - lo, len(v)))].mean(axis=1)
    means = np.sort(totals / max(1, len(groups)))
    return float(means[int(0.025 * draws)]), float(means[int(0.975 * draws) - 1])


def _summary(rows: list[dict], pass_k: int, seed: int) -> dict:
    """One row of the table over `rows` (the trajectories of one group of questions)."""
    by_q: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_q[r["id"]].append(r)
    per_q = {
        "em": [sum(r["em"] for r in rs) / len(rs) for rs in by_q.values()],
        "f1": [sum(r["f1"] for r in rs) / len(rs) for rs in by_q.values()],
    }
    if pass_k > 1:
        per_q[f"pass@{pass_k}"] = [float(max(r["em"] for r in rs)) for rs in by_q.values()]
    out: dict = {"n": len(by_q), "trajectories": len(rows)}
    for key, values in per_q.items():
        out[key] = sum(values) / len(values)
        out[f"{key}_ci95"] = list(macro_interval([values], seed=seed))
    out["searches_mean"] = sum(r["searches"] for r in rows) / len(rows)
    out["response_tokens_mean"] = sum(r["response_tokens"] for r in rows) / len(rows)
    reasons = Counter(str(r["end_reason"]) for r in rows)
    out["end_reasons"] = {k: v / len(rows) for k, v in sorted(reasons.items())}
    out["_per_question"] = per_q
    return out


def summarise(records: list[dict], pass_k: int = 1, seed: int = 0) -> dict:
    """The table: `sources` (per data_source, sorted), `mean_over_datasets` (unweighted mean of the
    sources' EM, F1, pass@k, with the bootstrap interval of that mean), `all` (every question
    pooled) and `types` (per `metadata.type` where the rows name one: the toy world's hops)."""
    if not records:
        raise ValueError("no evaluation records to summarise")
    sources = {
        s: _summary([r for r in records if r["data_source"] == s], pass_k, seed)
        for s in sorted({r["data_source"] for r in records})
    }
    types = sorted({r.get("type") or "" for r in records} - {""})
    table: dict = {
        "sources": sources,
        "all": _summary(records, pass_k, seed),
        "types": {t: _summary([r for r in records if r.get("type") == t], pass_k, seed) for t in types},
    }
    keys = ["em", "f1"] + ([f"pass@{pass_k}"] if pass_k > 1 else [])
    mean: dict = {"datasets": len(sources), "n": sum(s["n"] for s in sources.values())}
    for key in keys:
        mean[key] = sum(s[key] for s in sources.values()) / len(sources)
        mean[f"{key}_ci95"] = list(macro_interval([s["_per_question"][key] for s in sources.values()], seed=seed))
    for name in ("searches_mean", "response_tokens_mean"):
        mean[name] = sum(s[name] for s in sources.values()) / len(sources)
    table["mean_over_datasets"] = mean
    for row in [*sources.values(), table["all"], *table["types"].values()]:
        del row["_per_question"]
    return table


def _cell(row: dict, key: str) -> str:
    lo, hi = row[f"{key}_ci95"]
    return f"{row[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def to_markdown(report: dict) -> str:
    """The table and what it was measured on (checkpoint, subset, retriever, decoding), in Markdown."""
    table, pass_k = report["table"], report["decoding"]["pass_k"]
    keys = ["em", "f1"] + ([f"pass@{pass_k}"] if pass_k > 1 else [])
    head = ["data_source", "n"] + [f"{k.upper() if k in ('em', 'f1') else k} [95% CI]" for k in keys]
    head += ["searches", "response tokens", "end reasons"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, r: dict, n: str) -> str:
        reasons = ", ".join(f"{k} {v:.2f}" for k, v in r.get("end_reasons", {}).items())
        cells = [name, n, *(_cell(r, k) for k in keys), f"{r['searches_mean']:.2f}", f"{r['response_tokens_mean']:.1f}"]
        return "| " + " | ".join([*cells, reasons]) + " |"

    for source, r in table["sources"].items():
        lines.append(row(source, r, str(r["n"])))
    mean = table["mean_over_datasets"]
    lines.append(row("**mean over datasets** (unweighted)", mean, f"{mean['datasets']} sets"))
    if len(table["sources"]) > 1:
        lines.append(row("all questions (pooled)", table["all"], str(table["all"]["n"])))
    for t, r in table["types"].items():
        lines.append(row(f"type: {t}", r, str(r["n"])))
    subset, retr, dec = report["subset"], report["retriever"], report["decoding"]
    decoding = (
        "greedy"
        if pass_k == 1 and dec["temperature"] == 0
        else f"{pass_k} sample(s) per question at temperature {dec['temperature']:g}, top_p {dec['top_p']:g}"
    )
    about = [
        f"- checkpoint: `{report['checkpoint']}` (files fingerprint `{report['model_fingerprint']}`)",
        f"- data: {', '.join(f'`{d}`' for d in report['data'])}; {subset['n']} questions "
        f"(ids sha256 `{subset['ids_sha256'][:16]}`, max_samples {subset['max_samples']}, per_source "
        f"{subset['per_source']}, seed {subset['seed']}; over the prompt budget and dropped: {subset['dropped'] or 0})",
        f"- retriever: index `{retr['index_fingerprint']}`, topk {retr['topk']}, "
        + (f"replayed from `{retr['replay']}`" if retr.get("replay") else f"served at {retr.get('url')}"),
        f"- decoding: {decoding}; intervals: 95% percentile bootstrap over questions ({DRAWS} draws)",
    ]
    return "\n".join(lines + [""] + about) + "\n"
