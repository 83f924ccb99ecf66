"""The compressed kinds on ~100k real wiki-18 passages: recall@10 and same top-1 against exact search.

Usage: .venv/bin/python bench/compressed_recall.py --data ../shared/data/wiki18_nq_triviaqa
       [--work DIR] [--kinds hnsw_sq8,ivf_pq] [--out FILE]

The corpus is bench/hnsw_scale.py's: every passage of --data/corpus.jsonl cut into windows of 50 words every 5
(~106k real, overlapping passages: denser neighbourhoods than wiki-18's). `retriever-build --kind flat` encodes it
once (the exact answer, kept in --work); each compressed kind is then built from the same vectors the way
`retriever-build --kind KIND` builds it (`factory_string`, `faiss_index`: the same factory string, training sample
and seed) and searched at its default settings (efSearch 128, nprobe 64). The 2,000 NQ and TriviaQA questions are
the queries: recall@10 (the share of the exact top-10 returned) and the share whose top-1 is exact's, with build
seconds and index bytes.
"""

from __future__ import annotations

import argparse
import json
import os
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
sys.path.insert(0, str(ROOT / "bench"))

from hnsw_scale import write_windows  # noqa: E402

from retriever_server.jsonl import iter_jsonl  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", type=Path, required=True, help="directory with corpus.jsonl, nq_1000.jsonl, triviaqa_1000.jsonl"
    )
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "agent-rl-bench-compressed")
    p.add_argument("--kinds", default="hnsw_sq8,ivf_pq")
    p.add_argument("--out", type=Path, help="write the numbers here as JSON")
    a = p.parse_args()
    import faiss

    from retriever_server.build import build_index, faiss_index
    from retriever_server.indexes import hnsw_of, open_index
    from retriever_server.plan import factory_string

    a.work.mkdir(parents=True, exist_ok=True)
    corpus, flat_dir = a.work / "corpus.jsonl", a.work / "flat"
    if not corpus.exists():
        write_windows(a.data / "corpus.jsonl", corpus, 50, 5)
    if not (flat_dir / "manifest.json").exists():
        t = time.perf_counter()
        build_index(corpus, flat_dir, kind="flat")
        print(f"flat built (encoded) in {time.perf_counter() - t:.0f} s", flush=True)
    manifest, _, dense = open_index(flat_dir)
    flat = faiss.downcast_index(dense.index)
    vectors = flat.reconstruct_n(0, flat.ntotal)
    n, d = vectors.shape
    questions = [r["question"] for name in ("nq", "triviaqa") for _, r in iter_jsonl(a.data / f"{name}_1000.jsonl")]
    q = dense.encoder.encode_queries(questions)
    _, truth = flat.search(q, 10)
    report: dict = {"passages": n, "dim": d, "queries": len(q), "kinds": {}}
    print(f"{n} passages, {d}-d, {len(q)} queries", flush=True)
    for kind in a.kinds.split(","):
        spec = factory_string(kind, d, n)
        t = time.perf_counter()
        index, build = faiss_index(spec, vectors)
        seconds = time.perf_counter() - t
        hnsw = hnsw_of(index)
        if hnsw is not None:
            hnsw.efSearch = 128
        try:
            ivf = faiss.extract_index_ivf(index)
            ivf.nprobe = min(64, ivf.nlist)
        except RuntimeError:
            ivf = None
        _, got = index.search(q, 10)
        r10 = float(np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth, strict=True)]))
        top1 = float(np.mean(got[:, 0] == truth[:, 0]))
        size = faiss.serialize_index(index).nbytes
        report["kinds"][kind] = {
            "factory": spec,
            "recall@10": round(r10, 4),
            "top1_same": round(top1, 4),
            "build_seconds": round(seconds, 1),
            "index_bytes": int(size),
            "search": {"efSearch": 128} if hnsw is not None else {"nprobe": ivf.nprobe if ivf else None},
            **build,
        }
        print(
            f"{kind} ({spec}): recall@10 {r10:.4f}, same top-1 {top1:.4f}, built in {seconds:.0f} s, "
            f"{size / 2**20:.1f} MiB (flat {n * d * 4 / 2**20:.1f} MiB)",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
