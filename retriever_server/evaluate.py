"""`retriever-eval`: how good and how fast is a retriever, measured over its HTTP API.

Sends the questions of a QA file to any server with Search-R1's `/retrieve` API (ours,
Search-R1's, verl's) and reports, per `data_source` and overall: answer recall@k (a
SQuAD-normalised gold answer is a whole-token span of one of the top-k passages, the metric
FlashRAG and Search-R1 use to compare retrievers), supporting-title and gold-passage recall@k
when the data has them, MRR of the first answer-bearing passage, and the client's view of
latency (p50/p95/p99 per request) and throughput. `--compare URL2` runs a second server on the
same questions and prints the deltas.

Departures from the throwaway scripts this replaces: requests run concurrently with a
timeout, retries with exponential backoff on transport errors, 429 and 5xx (never on other
4xx, which a retry cannot fix); a batch that still fails counts its queries as failed, and the
failures are reported with their reasons, never dropped. Recall and MRR are averaged over the
queries that got an answer, so a flaky server shows up in `failed`, not as low recall.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retriever_server.answers import contains_answer
from retriever_server.client import RetrievalError, RetrieverClient, base_url

# Where FlashRAG-style files keep gold passage ids (top level or under `metadata`).
GOLD_ID_KEYS = ("gold_ids", "gold_passage_ids", "gold_doc_ids", "supporting_ids", "positive_ids")


@dataclass
class Question:
    id: str
    data_source: str
    question: str
    golden_answers: list[str]
    supporting_titles: list[str] | None = None
    """Titles of the supporting paragraphs (HotpotQA-style), or None when the data has none."""
    gold_ids: list[str] | None = None
    """Ids of the gold passages in the corpus, or None when the data has none."""


@dataclass
class Passage:
    id: str
    title: str
    contents: str
    score: float | None


@dataclass
class Outcome:
    """What one server answered for one question: passages, or the error that stopped it."""

    passages: list[Passage] | None
    error: str | None = None


@dataclass
class RunResult:
    url: str
    outcomes: list[Outcome]
    latencies_s: list[float]
    """One entry per successful request (a batch of queries), including retries."""
    wall_s: float
    requests_failed: int = 0
    errors: Counter = field(default_factory=Counter)


# ---------------------------------------------------------------------------------------------
# Loading questions


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)  # numpy arrays from parquet, tuples, lists


def _metadata(value) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _titles(rec: dict, meta: dict) -> list[str] | None:
    for src in (meta, rec):
        if src.get("supporting_titles") is not None:
            return [str(t) for t in _as_list(src["supporting_titles"])]
        facts = src.get("supporting_facts")
        if isinstance(facts, dict) and facts.get("title") is not None:  # FlashRAG's HotpotQA layout
            return list(dict.fromkeys(str(t) for t in _as_list(facts["title"])))
    return None


def _gold_ids(rec: dict, meta: dict) -> list[str] | None:
    for src in (meta, rec):
        for key in GOLD_ID_KEYS:
            if src.get(key) is not None:
                return [str(i) for i in _as_list(src[key])]
    return None


def question_from_record(rec: dict, n: int, default_source: str) -> Question:
    meta = _metadata(rec.get("metadata"))
    if not rec.get("question"):
        raise ValueError(f"record {n} has no 'question'")
    answers = [str(a) for a in _as_list(rec.get("golden_answers", rec.get("answers", rec.get("answer"))))]
    if not answers:
        raise ValueError(f"record {n} ({rec.get('id', n)}) has no 'golden_answers'")
    return Question(
        id=str(rec.get("id", n)),
        data_source=str(rec.get("data_source") or default_source),
        question=str(rec["question"]),
        golden_answers=answers,
        supporting_titles=_titles(rec, meta),
        gold_ids=_gold_ids(rec, meta),
    )


def load_questions(path: Path, data_source: str | None = None, limit: int | None = None) -> list[Question]:
    """Questions from a `data-prep qa` parquet or a FlashRAG-layout JSONL.

    Records without a `data_source` column get `data_source` (default: the file's stem).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path} does not exist")
    default_source = data_source or path.stem
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    else:
        records = []
        with open(path) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not JSON ({err}); --data takes a .parquet or a JSONL file") from err
    if limit is not None:
        records = records[:limit]
    questions = [question_from_record(r, n, default_source) for n, r in enumerate(records)]
    if data_source:
        for q in questions:
            q.data_source = data_source
    return questions


# ---------------------------------------------------------------------------------------------
# Talking to a server


def retrieve_url(url: str) -> str:
    """The /retrieve endpoint from a base URL or the endpoint itself (how runs are labelled)."""
    return base_url(url) + "/retrieve"


def _passage(doc: dict) -> Passage:
    """A document as the client parsed it (`retriever_server.schema`), for scoring."""
    return Passage(id=doc["id"], title=doc["title"], contents=doc["contents"], score=doc["score"])


def run_queries(
    url: str,
    questions: Sequence[Question],
    topk: int,
    batch_size: int = 16,
    concurrency: int = 4,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    progress: bool = True,
    desc: str = "",
    warmup: bool = True,
) -> RunResult:
    """Send every question (batch_size per request, `concurrency` requests in flight)."""
    from tqdm import tqdm

    client = RetrieverClient(
        url,
        topk,
        timeout_s,
        max_retries=retries,
        backoff_s=backoff_s,
        api_key=api_key,
        max_queries_per_request=max(1, batch_size),
        max_connections=max(8, concurrency),
    )
    outcomes: list[Outcome | None] = [None] * len(questions)
    latencies: list[float] = []
    errors: Counter = Counter()
    failed_requests = 0
    batches = [list(range(i, min(i + batch_size, len(questions)))) for i in range(0, len(questions), batch_size)]

    def one(idx: list[int]) -> tuple[list[list[Passage]] | None, float, str | None]:
        start = time.perf_counter()
        try:
            docs = client.retrieve([questions[i].question for i in idx], topk)
            res = [[_passage(d) for d in per_query] for per_query in docs]
        except RetrievalError as err:
            return None, time.perf_counter() - start, str(err)
        except Exception as err:  # a bug in a reply we did not foresee must still not lose the run
            return None, time.perf_counter() - start, f"{type(err).__name__}: {err}"
        return res, time.perf_counter() - start, None

    if warmup:
        client.warm_up(topk)
    bar = tqdm(
        total=len(questions),
        desc=desc or retrieve_url(url),
        unit="q",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="retriever-eval") as pool:
            futures = {pool.submit(one, idx): idx for idx in batches}
            for fut in as_completed(futures):
                idx = futures[fut]
                res, latency, err = fut.result()
                if res is not None:
                    latencies.append(latency)
                    for i, passages in zip(idx, res):
                        outcomes[i] = Outcome(passages)
                else:
                    err = err or "no result"
                    failed_requests += 1
                    errors[err] += len(idx)
                    for i in idx:
                        outcomes[i] = Outcome(None, err)
                    bar.set_postfix(failed=sum(errors.values()))
                bar.update(len(idx))
    finally:
        wall = time.perf_counter() - start
        bar.close()
        client.close()
    done = [o if o is not None else Outcome(None, "not run") for o in outcomes]  # every batch ran: none is None
    return RunResult(retrieve_url(url), done, latencies, wall, failed_requests, errors)


# ---------------------------------------------------------------------------------------------
# Metrics (pure)


def score_question(q: Question, passages: list[Passage], topks: Sequence[int]) -> dict:
    """Per-question metrics over a ranked passage list.

    `answer_recall@k`: 1 when a gold answer is a whole-token span of one of the first k passages.
    `title_recall@k`: fraction of the supporting titles among the first k passages' titles.
    `gold_recall@k`: fraction of the gold passage ids among the first k passages' ids.
    `mrr`: 1/rank of the first answer-bearing passage (0 when none is retrieved).
    """
    hits = [contains_answer(p.contents, q.golden_answers) for p in passages]
    first = next((r for r, h in enumerate(hits, 1) if h), None)
    out: dict = {"mrr": 1.0 / first if first else 0.0, "first_hit_rank": first, "hits": hits}
    for k in topks:
        out[f"answer_recall@{k}"] = float(any(hits[:k]))
    if q.supporting_titles:
        want = set(q.supporting_titles)
        for k in topks:
            out[f"title_recall@{k}"] = len(want & {p.title for p in passages[:k]}) / len(want)
    if q.gold_ids:
        want = set(q.gold_ids)
        for k in topks:
            out[f"gold_recall@{k}"] = len(want & {p.id for p in passages[:k]}) / len(want)
    return out


def _percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile (no interpolation: the value some request actually took)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def aggregate(questions: Sequence[Question], outcomes: Sequence[Outcome], topks: Sequence[int]) -> dict:
    """{"overall": metrics, "by_source": {source: metrics}} with metrics averaged over answered queries."""
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        groups.setdefault(q.data_source, []).append(i)

    def summarise(idx: list[int]) -> dict:
        scored = [score_question(questions[i], p, topks) for i in idx if (p := outcomes[i].passages) is not None]
        m: dict = {"n": len(idx), "answered": len(scored), "failed": len(idx) - len(scored)}
        keys = [f"answer_recall@{k}" for k in topks] + ["mrr"]
        keys += [f"{kind}_recall@{k}" for kind in ("title", "gold") for k in topks]
        for key in keys:
            vals = [s[key] for s in scored if key in s]
            if vals:
                m[key] = sum(vals) / len(vals)
            elif not key.startswith(("title", "gold")):
                m[key] = None
        with_titles = sum(1 for s in scored if f"title_recall@{topks[0]}" in s)
        with_gold = sum(1 for s in scored if f"gold_recall@{topks[0]}" in s)
        if with_titles:
            m["n_with_titles"] = with_titles
        if with_gold:
            m["n_with_gold_ids"] = with_gold
        return m

    return {
        "overall": summarise(list(range(len(questions)))),
        "by_source": {s: summarise(idx) for s, idx in sorted(groups.items())},
    }


def build_report(
    run: RunResult, questions: Sequence[Question], topks: Sequence[int], batch_size: int, concurrency: int
) -> dict:
    metrics = aggregate(questions, run.outcomes, topks)
    answered = metrics["overall"]["answered"]
    lat_ms = [s * 1000 for s in run.latencies_s]
    return {
        "url": run.url,
        "topk": list(topks),
        "batch_size": batch_size,
        "concurrency": concurrency,
        **metrics,
        "latency_ms": {
            "requests": len(lat_ms),
            "p50": _percentile(lat_ms, 50),
            "p95": _percentile(lat_ms, 95),
            "p99": _percentile(lat_ms, 99),
            "mean": sum(lat_ms) / len(lat_ms) if lat_ms else None,
        },
        "queries_per_s": answered / run.wall_s if run.wall_s > 0 else None,
        "wall_s": run.wall_s,
        "failed_queries": metrics["overall"]["failed"],
        "failed_requests": run.requests_failed,
        "errors": [{"error": e, "queries": n} for e, n in run.errors.most_common()],
    }


def deltas(a: dict, b: dict) -> dict:
    """b - a for every shared numeric metric, overall, per source, latency and throughput."""

    def diff(x: dict, y: dict) -> dict:
        out = {}
        for key, va in x.items():
            vb = y.get(key)
            if (
                isinstance(va, (int, float))
                and isinstance(vb, (int, float))
                and not isinstance(va, bool)
                and key not in ("n",)
            ):
                out[key] = vb - va
        return out

    return {
        "overall": diff(a["overall"], b["overall"]),
        "by_source": {s: diff(a["by_source"][s], b["by_source"][s]) for s in a["by_source"] if s in b["by_source"]},
        "latency_ms": diff(a["latency_ms"], b["latency_ms"]),
        "queries_per_s": b["queries_per_s"] - a["queries_per_s"]
        if a["queries_per_s"] is not None and b["queries_per_s"] is not None
        else None,
    }


# ---------------------------------------------------------------------------------------------
# Output


def _metric_columns(report: dict) -> list[str]:
    cols = [f"answer_recall@{k}" for k in report["topk"]] + ["mrr"]
    for kind in ("title", "gold"):
        cols += [f"{kind}_recall@{k}" for k in report["topk"] if f"{kind}_recall@{k}" in report["overall"]]
    return cols


def _short(col: str) -> str:
    return (
        col.replace("answer_recall@", "R@")
        .replace("title_recall@", "T@")
        .replace("gold_recall@", "G@")
        .replace("mrr", "MRR")
    )


def _fmt(v, width: int, signed: bool = False) -> str:
    if v is None:
        return "-".rjust(width)
    if isinstance(v, float):
        return (f"{v:+.3f}" if signed else f"{v:.3f}").rjust(width)
    return (f"{v:+d}" if signed else str(v)).rjust(width)


def _header(name_w: int, cols: list[str]) -> list[str]:
    head = "source".ljust(name_w) + "".join(c.rjust(8) for c in ["n", "failed"] + [_short(c) for c in cols])
    return [head, "-" * len(head)]


def _row(name: str, m: dict, name_w: int, cols: list[str], signed: bool = False) -> str:
    return (
        name.ljust(name_w)
        + _fmt(m.get("n"), 8)
        + _fmt(m.get("failed"), 8, signed)
        + "".join(_fmt(m.get(c), 8, signed) for c in cols)
    )


def _sources(report: dict) -> list[tuple[str, dict]]:
    rows = list(report["by_source"].items()) if len(report["by_source"]) > 1 else []
    return rows + [("overall", report["overall"])]


def _speed(report: dict) -> str:
    lat, qps = report["latency_ms"], report["queries_per_s"]
    return (
        f"p50 {_ms(lat['p50'])}  p95 {_ms(lat['p95'])}  p99 {_ms(lat['p99'])} per request   "
        f"{'-' if qps is None else f'{qps:.1f}'} queries/s over {report['wall_s']:.1f}s"
    )


LEGEND = "R@k: answer recall; T@k: supporting-title recall; G@k: gold-passage recall; MRR: first answer-bearing passage"


def format_table(report: dict) -> str:
    """Rows per data source (when there are several) and overall, then latency and throughput."""
    cols = _metric_columns(report)
    name_w = max([len("overall")] + [len(s) for s in report["by_source"]]) + 2
    lines = _header(name_w, cols) + [_row(name, m, name_w, cols) for name, m in _sources(report)]
    lines.append(f"batch {report['batch_size']}, concurrency {report['concurrency']}: {_speed(report)}")
    return "\n".join(lines + [LEGEND])


def format_compare(a: dict, b: dict, delta: dict) -> str:
    """Per data source: a row for each server and their difference (b - a)."""
    cols = [c for c in _metric_columns(a) if c in _metric_columns(b)]
    name_w = max([len("overall")] + [len(s) for s in a["by_source"]]) + 6
    lines = [f"a = {a['url']}", f"b = {b['url']}"] + _header(name_w, cols)
    b_rows = dict(_sources(b))
    for name, m in _sources(a):
        d = delta["overall"] if name == "overall" else delta["by_source"].get(name, {})
        lines += [
            _row(f"{name} a", m, name_w, cols),
            _row(f"{name} b", b_rows.get(name, {}), name_w, cols),
            _row(f"{name} b-a", d, name_w, cols, True),
        ]
    lines += [
        f"a: {_speed(a)}",
        f"b: {_speed(b)}",
        f"batch {a['batch_size']}, concurrency {a['concurrency']}; " + LEGEND,
    ]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def failure_message(report: dict) -> str | None:
    if not report["failed_queries"]:
        return None
    n = report["overall"]["n"]
    lines = [
        f"retriever-eval: {report['failed_queries']} of {n} queries failed ({report['failed_requests']} requests) "
        f"against {report['url']}:"
    ]
    for e in report["errors"][:5]:
        lines.append(f"  {e['queries']} queries: {e['error']}")
    if len(report["errors"]) > 5:
        lines.append(f"  ... and {len(report['errors']) - 5} other errors (see the JSON output)")
    return "\n".join(lines)


def write_dump(
    path: Path, runs: Sequence[tuple[str, RunResult]], questions: Sequence[Question], topks: Sequence[int]
) -> None:
    """One line per (server, question): the ranked passages with their answer hits, for error analysis."""
    with open(path, "w") as fh:
        for label, run in runs:
            for q, o in zip(questions, run.outcomes):
                rec: dict[str, Any] = {
                    "server": label,
                    "url": run.url,
                    "id": q.id,
                    "data_source": q.data_source,
                    "question": q.question,
                    "golden_answers": q.golden_answers,
                }
                if q.supporting_titles is not None:
                    rec["supporting_titles"] = q.supporting_titles
                if q.gold_ids is not None:
                    rec["gold_ids"] = q.gold_ids
                if o.passages is None:
                    rec["error"] = o.error
                else:
                    s = score_question(q, o.passages, topks)
                    rec["first_hit_rank"] = s["first_hit_rank"]
                    rec["topk"] = [
                        {
                            "rank": r,
                            "id": p.id,
                            "title": p.title,
                            "score": p.score,
                            "has_answer": h,
                            "contents": p.contents,
                        }
                        for r, (p, h) in enumerate(zip(o.passages, s["hits"]), 1)
                    ]
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# CLI


def parse_topks(text: str) -> list[int]:
    try:
        topks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--topk takes comma-separated integers such as 1,3,5,10, got {text!r}"
        ) from err
    if not topks or topks[0] < 1:
        raise argparse.ArgumentTypeError(f"--topk values must be >= 1, got {text!r}")
    return topks


def _positive(kind: Callable, name: str, allow_zero: bool = False):
    def check(text: str):
        v = kind(text)
        if v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {text}")
        return v

    return check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="retriever-eval",
        description="Evaluate a retriever over Search-R1's /retrieve HTTP API: answer recall@k, "
        "supporting-title / gold-passage recall@k, MRR per data source, and client-side latency and throughput.",
        epilog="example: retriever-eval --url http://127.0.0.1:8000 --data data/hotpotqa/test.parquet "
        "--topk 1,3,5,10 --out results.json --compare http://127.0.0.1:8001",
    )
    p.add_argument("--url", required=True, help="server base URL (or its /retrieve endpoint)")
    p.add_argument(
        "--data",
        required=True,
        help="questions: a `data-prep qa` parquet, or FlashRAG JSONL (question, golden_answers, metadata)",
    )
    p.add_argument(
        "--topk",
        type=parse_topks,
        default=[1, 3, 5, 10],
        help="cut-offs for recall@k (default 1,3,5,10); the largest is requested",
    )
    p.add_argument(
        "--batch-size", type=_positive(int, "--batch-size"), default=16, help="queries per request (default 16)"
    )
    p.add_argument(
        "--concurrency", type=_positive(int, "--concurrency"), default=4, help="requests in flight (default 4)"
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (or env RETRIEVER_API_KEY)")
    p.add_argument(
        "--timeout", type=_positive(float, "--timeout"), default=30.0, help="seconds per request (default 30)"
    )
    p.add_argument(
        "--retries",
        type=_positive(int, "--retries", allow_zero=True),
        default=2,
        help="retries per request on connection errors, 429 and 5xx (default 2)",
    )
    p.add_argument(
        "--backoff",
        type=_positive(float, "--backoff", allow_zero=True),
        default=0.5,
        help="first retry delay in seconds, doubled each retry (default 0.5)",
    )
    p.add_argument("--limit", type=_positive(int, "--limit"), help="evaluate only the first N questions")
    p.add_argument(
        "--data-source", help="data_source for records that have none (default: the file's stem); overrides the file's"
    )
    p.add_argument("--out", help="write the full report as JSON here")
    p.add_argument("--dump", help="write each question's top-k passages (with answer hits) as JSONL here")
    p.add_argument(
        "--compare",
        metavar="URL2",
        help="evaluate a second server on the same questions and print the deltas (URL2 - URL)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="time the first request too (default: one untimed warm-up request first)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    a = build_parser().parse_args(argv)
    api_key = a.api_key or os.environ.get("RETRIEVER_API_KEY")
    try:
        questions = load_questions(Path(a.data), a.data_source, a.limit)
    except (FileNotFoundError, ValueError) as err:
        print(f"retriever-eval: error: {err}", file=sys.stderr)
        return 2
    if not questions:
        print(f"retriever-eval: error: {a.data} holds no questions", file=sys.stderr)
        return 2
    topk = max(a.topk)
    urls = [("a", a.url)] + ([("b", a.compare)] if a.compare else [])
    runs: list[tuple[str, RunResult]] = []
    reports: list[dict] = []
    for label, url in urls:
        run = run_queries(
            url,
            questions,
            topk,
            a.batch_size,
            a.concurrency,
            api_key,
            a.timeout,
            a.retries,
            a.backoff,
            not a.no_progress,
            desc=f"{label}: {url}" if a.compare else "",
            warmup=not a.no_warmup,
        )
        runs.append((label, run))
        reports.append(build_report(run, questions, a.topk, a.batch_size, a.concurrency))

    if a.compare:
        delta = deltas(reports[0], reports[1])
        result = {"data": str(a.data), "a": reports[0], "b": reports[1], "delta": delta}
        print(format_compare(reports[0], reports[1], delta))
        if reports[0]["failed_queries"] != reports[1]["failed_queries"]:
            print(
                "note: the servers failed on different queries; each one's recall averages over its own answered "
                "queries",
                file=sys.stderr,
            )
    else:
        result = {"data": str(a.data), **reports[0]}
        print(format_table(reports[0]))
    for rep in reports:
        msg = failure_message(rep)
        if msg:
            print(msg, file=sys.stderr)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {a.out}")
    if a.dump:
        Path(a.dump).parent.mkdir(parents=True, exist_ok=True)
        write_dump(Path(a.dump), runs, questions, a.topk)
        print(f"wrote {a.dump}")
    dead = [rep["url"] for rep in reports if rep["overall"]["answered"] == 0]
    if dead:
        print(f"retriever-eval: error: every query failed against {', '.join(dead)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
