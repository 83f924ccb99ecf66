"""HNSW64 over ~100k real wiki-18 passages: recall@10 against exact search, and queries/s, by efSearch.

Usage: .venv/bin/python bench/hnsw_scale.py --data ../shared/data/wiki18_nq_triviaqa
       [--work DIR] [--words 50] [--stride 5] [--ef 16,32,64,128,256] [--out FILE]

The corpus: every passage of --data/corpus.jsonl (9,648 DPR 100-word passages) cut into windows of
--words words every --stride words (50 and 5: 11 windows a passage, ~106k passages, each under its
article's title). These are real Wikipedia text, but overlapping: near neighbours are denser than
in wiki-18, which makes the graph search's job harder, not easier.

1. `retriever-build --kind hnsw` as a user runs it (defaults: M 64, efConstruction 200, efSearch
   128, the default encoder and runtime), timed; the index is kept in --work and reused.
2. The exact answer: IndexFlatIP over the same vectors (read back from the HNSW index's storage).
3. The 2,000 NQ and TriviaQA questions encoded once; for each efSearch: recall@10 against the
   exact top-10 (the share of the exact top-10 that HNSW returns) and recall@1, and search
   queries/s in batches of 32 (the server's batch at concurrency 32) and one at a time, medians of
   3 alternated rounds; the exact index timed the same way.
4. In-process end to end at the default efSearch: encode + search, batches of 32 and one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retriever_server.jsonl import iter_corpus, iter_jsonl  # noqa: E402


def write_windows(corpus: Path, out: Path, words: int, stride: int) -> int:
    """Each passage's text in windows of `words` words every `stride` words, under its title."""
    count = 0
    with out.open("w") as f:
        for rec in iter_corpus(corpus):
            title, _, text = rec["contents"].partition("\n")
            tokens = text.split()
            for lo in range(0, max(1, len(tokens) - words + 1), stride):
                window = " ".join(tokens[lo : lo + words])
                f.write(json.dumps({"id": f"{rec['id']}-{lo}", "contents": f"{title}\n{window}"}) + "\n")
                count += 1
    return count


def timed_search(index, q: np.ndarray, batch: int, k: int = 10) -> float:
    """Queries/s of index.search over q in batches of `batch`."""
    t = time.perf_counter()
    for lo in range(0, len(q), batch):
        index.search(q[lo : lo + batch], k)
    return len(q) / (time.perf_counter() - t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", type=Path, required=True, help="directory with corpus.jsonl, nq_1000.jsonl, triviaqa_1000.jsonl"
    )
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "agent-rl-bench-hnsw-scale")
    p.add_argument("--words", type=int, default=50)
    p.add_argument("--stride", type=int, default=5)
    p.add_argument("--ef", default="16,32,64,128,256", help="efSearch values to measure")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the numbers here as JSON")
    a = p.parse_args()
    import faiss

    from retriever_server.build import build_index
    from retriever_server.indexes import open_index

    a.work.mkdir(parents=True, exist_ok=True)
    corpus, index_dir = a.work / "corpus.jsonl", a.work / "hnsw"
    report: dict = {"words": a.words, "stride": a.stride}
    if not corpus.exists():
        write_windows(a.data / "corpus.jsonl", corpus, a.words, a.stride)
    if not (index_dir / "manifest.json").exists():
        t = time.perf_counter()
        build_index(corpus, index_dir, kind="hnsw")
        print(f"built in {time.perf_counter() - t:.0f} s", flush=True)
    manifest, _, dense = open_index(index_dir)
    report["passages"] = manifest["count"]
    report["build_seconds"] = manifest["build_seconds"]
    report["build"] = manifest["build"]
    hnsw = faiss.downcast_index(dense.index)
    vectors = hnsw.storage.reconstruct_n(0, hnsw.ntotal)
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    questions = [r["question"] for name in ("nq", "triviaqa") for _, r in iter_jsonl(a.data / f"{name}_1000.jsonl")]
    q = dense.encoder.encode_queries(questions)
    _, truth = exact.search(q, 10)
    efs = [int(x) for x in a.ef.split(",")]
    quality = {}
    for ef in efs:
        hnsw.hnsw.efSearch = ef
        _, got = hnsw.search(q, 10)
        r10 = np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth, strict=True)])
        r1 = np.mean(got[:, 0] == truth[:, 0])
        quality[ef] = {"recall@10": round(float(r10), 4), "top1_same": round(float(r1), 4)}
        print(f"efSearch {ef:>4}: recall@10 against exact {r10:.4f}, same top-1 {r1:.4f}", flush=True)
    # speed: every setting once a round, the order rotating between rounds
    settings = [("exact", None)] + [(f"hnsw{ef}", ef) for ef in efs]
    runs: dict[str, dict[str, list[float]]] = {key: {"b32": [], "b1": []} for key, _ in settings}
    one = q[:400]  # one at a time: 400 queries a round
    for r in range(a.rounds):
        for key, ef in settings[r % len(settings) :] + settings[: r % len(settings)]:
            if ef is not None:
                hnsw.hnsw.efSearch = ef
            index = exact if ef is None else hnsw
            runs[key]["b32"].append(timed_search(index, q, 32))
            runs[key]["b1"].append(timed_search(index, one, 1))
    speed = {key: {b: round(statistics.median(v), 1) for b, v in row.items()} for key, row in runs.items()}
    for key, row in speed.items():
        print(f"{key:<8} search queries/s: batches of 32 {row['b32']:9.1f}, one at a time {row['b1']:9.1f}")
    hnsw.hnsw.efSearch = dense.ef_search
    end_to_end = {}
    for batch, n in ((32, len(questions)), (1, 200)):
        t = time.perf_counter()
        for lo in range(0, n, batch):
            dense.search(questions[lo : lo + batch], 10)
        end_to_end[f"b{batch}"] = round(n / (time.perf_counter() - t), 1)
    print(f"in process, encode + search at efSearch {dense.ef_search}: {end_to_end} queries/s")
    report.update(
        {"recall": quality, "search_qps": speed, "end_to_end_qps": end_to_end, "threads": faiss.omp_get_max_threads()}
    )
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
