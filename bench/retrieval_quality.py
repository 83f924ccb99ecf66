"""Retrieval quality on the HotpotQA fixture: supporting-title hit rate for flat, HNSW and BM25.

Usage: .venv/bin/python bench/retrieval_quality.py [--work DIR] [--ef-search 128]

For each of the 100 questions (`metadata.supporting_titles`, two gold paragraphs each among the
994), the fraction with at least one supporting title in the top-3 and the top-10, per index kind
(BM25 only when pyserini is importable), and HNSW recall@10 against the flat index (the share of
flat's top-10 that HNSW also returns). Indexes are built with `build_index` into --work and
reused on the next run when their manifest still matches the corpus.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "hotpotqa100"


def get_index(corpus: Path, out: Path, kind: str):
    """open_index on out, building it first when missing or stale (a manifest/corpus mismatch)."""
    from retriever_server.build import build_index
    from retriever_server.indexes import open_index

    if (out / "manifest.json").exists():
        try:
            return open_index(out)
        except (ValueError, FileNotFoundError) as err:
            print(f"rebuilding {out}: {err}", file=sys.stderr)
    t0 = time.time()
    build_index(corpus, out, kind=kind)
    print(f"built {kind} in {time.time() - t0:.0f}s", file=sys.stderr)
    return open_index(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=FIXTURE / "corpus.jsonl")
    p.add_argument("--questions", type=Path, default=FIXTURE / "questions.jsonl")
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "agent-rl-bench-hotpotqa100",
        help="where indexes are built and reused",
    )
    p.add_argument("--kinds", default="flat,hnsw,bm25")
    a = p.parse_args(argv)

    rows = [json.loads(line) for line in a.questions.read_text().splitlines() if line.strip()]
    queries = [" ".join(r["question"].split()) for r in rows]
    gold = [set(r["metadata"]["supporting_titles"]) for r in rows]
    kinds = a.kinds.split(",")
    if "bm25" in kinds and importlib.util.find_spec("pyserini") is None:
        print("pyserini is not importable: skipping bm25 (pip install -e '.[bm25]')", file=sys.stderr)
        kinds.remove("bm25")

    table, top10_ids = {}, {}
    for kind in kinds:
        manifest, store, index = get_index(a.corpus, a.work / kind, kind)
        t0 = time.perf_counter()
        _, hits = index.search(queries, 10)
        ms = (time.perf_counter() - t0) / len(queries) * 1000
        titles = [[d["contents"].split("\n", 1)[0] for d in store.get(h)] for h in hits]
        top10_ids[kind] = [[d["id"] for d in store.get(h)] for h in hits]
        at = {k: sum(bool(g & set(t[:k])) for g, t in zip(gold, titles)) / len(rows) for k in (3, 10)}
        both10 = sum(g <= set(t) for g, t in zip(gold, titles)) / len(rows)
        table[kind] = (at[3], at[10], both10, ms, manifest["count"])

    print(f"\nhotpotqa100: {len(rows)} questions over {next(iter(table.values()))[4]} paragraphs (MiniLM for dense)")
    print(f"{'index':<6} {'>=1 gold @3':>12} {'>=1 gold @10':>13} {'both @10':>9} {'ms/query':>9}")
    for kind, (a3, a10, b10, ms, _) in table.items():
        print(f"{kind:<6} {a3:>12.2f} {a10:>13.2f} {b10:>9.2f} {ms:>9.1f}")
    if "flat" in top10_ids and "hnsw" in top10_ids:
        recall = sum(len(set(h) & set(f)) for h, f in zip(top10_ids["hnsw"], top10_ids["flat"])) / (10 * len(rows))
        print(f"hnsw recall@10 against flat: {recall:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
