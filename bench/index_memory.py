"""The index memory plan (`retriever-build --plan`) against what a built index takes: its files on
disk and the RSS of a `retriever-server` process that serves it, by kind and size.

Usage: .venv/bin/python bench/index_memory.py [--sizes 20000,100000] [--kinds flat,hnsw_sq8,ivf_pq]
       [--dim 384] [--work DIR] [--mmap] [--out FILE]
       .venv/bin/python bench/index_memory.py --recall FLAT_INDEX_DIR --data ../shared/data/wiki18_nq_triviaqa

Each index is built as `retriever-build` builds it (the same `faiss_index`, store and encoder files),
over synthetic data: random unit vectors (the layout does not depend on the values) and a corpus of
random ~100-word passages. The plan is made from the corpus file alone, before the index exists
(`plan_build`), and compared with the index directory's files and with the server's VmRSS once it is
ready and has answered a batch of 32 queries (two servers with `--mmap`: the second's Pss and
private bytes, from /proc/PID/smaps_rollup).

With `--recall`: each compressed kind built from a flat index's own vectors (as retriever-build builds
it, at its default search settings), and for the questions of --data's nq_1000.jsonl and
triviaqa_1000.jsonl: recall@10 against the flat index's top-10, the share with the same top-1, and
answer recall@1/3/10 (a gold answer in one of the top k passages, as retriever-eval counts it) beside
flat's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import faiss
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the of and in to a was is for on as by with he at from his an were are which".split() + [
    f"w{i}" for i in range(3000)
]


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choices(WORDS, k=rng.randint(80, 120)))
            f.write(json.dumps({"id": str(i), "contents": f"Title {i}\n{text}"}) + "\n")


def build(work: Path, n: int, kind: str, dim: int, train_size: int) -> Path:
    """An index directory as retriever-build writes it, over random unit vectors."""
    from retriever_server.build import faiss_index
    from retriever_server.encoders import Encoder
    from retriever_server.plan import factory_string
    from retriever_server.store import file_sha256, write_store

    corpus = work / f"corpus{n}.jsonl"
    if not corpus.exists():
        write_corpus(corpus, n)
    out = work / f"{kind}{n}"
    if (out / "manifest.json").exists():
        return out
    write_store(corpus, out)
    enc = Encoder(None, "mean", "", "", cache_dir=out)  # copies the exported encoder.onnx beside the index
    vectors = np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32)
    faiss.normalize_L2(vectors)
    spec = factory_string(kind, dim, n)
    index, params = faiss_index(spec, vectors, train_size=train_size)
    faiss.write_index(index, str(out / "index.faiss"))
    params["factory"] = spec
    manifest = {
        "kind": kind,
        "count": n,
        "corpus": str(corpus.resolve()),
        "corpus_sha256": file_sha256(corpus),
        "encoder": enc.path,
        "pooling": "mean",
        "query_prefix": "",
        "passage_prefix": "",
        "dim": dim,
        "metric": "inner_product",
        "build": params | ({"ef_search": 128} if "ef_construction" in params else {}),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's Rss, Pss and private bytes."""
    got = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        got[key.rstrip(":")] = int(value) * 1024
    return {
        "rss": got["Rss"],
        "pss": got["Pss"],
        "private": got.get("Private_Clean", 0) + got.get("Private_Dirty", 0),
    }


def serve(index_dir: Path, extra: list[str], tmp: Path, name: str) -> subprocess.Popen:
    ready = tmp / f"{name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retriever_server.app", "--index", str(index_dir), "--port", "0", "--ready-file",
         str(ready), *extra],
        stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    t = time.time()
    while not ready.exists():
        if proc.poll() is not None or time.time() - t > 300:
            raise RuntimeError((tmp / f"{name}.log").read_text())
        time.sleep(0.2)
    # a warmed-up server: one batch of 32 queries encoded and searched (ONNX Runtime's arena grows on first use)
    url = json.loads(ready.read_text())["url"]
    queries = [f"warm up query number {i} about {WORDS[i]}" for i in range(32)]
    urllib.request.urlopen(
        urllib.request.Request(
            f"{url}/retrieve",
            json.dumps({"queries": queries, "topk": 10}).encode(),
            {"Content-Type": "application/json"},
        ),
        timeout=120,
    ).read()
    return proc


def recall(flat_dir: Path, data: Path, kinds: list[str]) -> list[dict]:
    """Recall of each kind against flat over the flat index's vectors (see the module docstring)."""
    from retriever_server.answers import contains_answer
    from retriever_server.build import faiss_index
    from retriever_server.evaluate import load_questions
    from retriever_server.indexes import flat_vectors, hnsw_of, open_index
    from retriever_server.plan import DEFAULT_NPROBE, factory_string

    _, store, flat = open_index(flat_dir, check_memory=False)
    vectors = flat_vectors(flat.index)
    n, d = vectors.shape
    sets = {name: load_questions(data / f"{name}_1000.jsonl", name) for name in ("nq", "triviaqa")}
    encoded = {name: flat.encoder.encode_queries([q.question for q in qs]) for name, qs in sets.items()}
    _, truth = flat.index.search(np.concatenate(list(encoded.values())), 10)

    def answer_recall(rows: np.ndarray, qs) -> dict[str, float]:
        hits = [[contains_answer(doc["contents"], q.golden_answers) for doc in store.get(r)] for r, q in zip(rows, qs)]
        return {f"@{k}": round(float(np.mean([any(h[:k]) for h in hits])), 4) for k in (1, 3, 10)}

    out = []
    for kind in ["flat", *kinds]:
        t = time.time()
        if kind == "flat":
            index, spec = flat.index, "Flat"
        else:
            spec = factory_string(kind, d, n)
            index, _ = faiss_index(spec, vectors)
            if (h := hnsw_of(index)) is not None:
                h.efSearch = 128
            try:
                ivf = faiss.extract_index_ivf(index)
                ivf.nprobe = min(DEFAULT_NPROBE, ivf.nlist)
            except RuntimeError:
                pass
        build_s = time.time() - t
        got = np.concatenate([index.search(q, 10)[1] for q in encoded.values()])
        row = {
            "kind": kind,
            "factory": spec,
            "n": n,
            "build_s": round(build_s, 1),
            "recall@10_vs_flat": round(float(np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth)])), 4),
            "same_top1": round(float(np.mean(got[:, 0] == truth[:, 0])), 4),
        }
        lo = 0
        for name, qs in sets.items():
            row[f"{name}_answer_recall"] = answer_recall(got[lo : lo + len(qs)], qs)
            lo += len(qs)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="20000,100000")
    p.add_argument("--kinds", default="flat,hnsw_sq8,ivf_pq")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "agent-rl-bench-index-memory")
    p.add_argument("--mmap", action="store_true", help="also two --mmap servers: the second's added memory")
    p.add_argument("--train-size", type=int, default=20_000, help="training sample (the layout does not depend on it)")
    p.add_argument("--out", type=Path)
    p.add_argument("--recall", type=Path, help="a flat index directory: recall of --kinds against it")
    p.add_argument("--data", type=Path, help="with --recall: a directory with nq_1000.jsonl and triviaqa_1000.jsonl")
    a = p.parse_args()
    if a.recall:
        rows = recall(a.recall, a.data, [k for k in a.kinds.split(",") if k != "flat"])
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
        return 0
    from retriever_server.plan import plan_build

    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        for kind in a.kinds.split(","):
            corpus = a.work / f"corpus{n}.jsonl"
            if not corpus.exists():
                write_corpus(corpus, n)
            plan = plan_build(corpus, kind, dim=a.dim)
            t = time.time()
            out = build(a.work, n, kind, a.dim, a.train_size)
            built_s = time.time() - t
            disk = {
                f.name: f.stat().st_size
                for f in out.iterdir()
                if f.name in ("index.faiss", "docs.arrow", "encoder.onnx")
            }
            row = {
                "n": n,
                "kind": kind,
                "factory": plan.factory,
                "build_s": round(built_s, 1),
                "index_file": disk["index.faiss"],
                "index_plan": plan.index_bytes,
                "store_file": disk["docs.arrow"],
                "store_plan": plan.store_bytes,
                "disk": sum(disk.values()),
                "disk_plan": plan.disk_bytes,
                "rss_plan": plan.server_rss_start_bytes,
            }
            with tempfile.TemporaryDirectory() as tmp:
                proc = serve(out, [], Path(tmp), "one")
                try:
                    row["rss"] = rollup(proc.pid)["rss"]
                finally:
                    proc.terminate()
                    proc.wait(30)
                if a.mmap:
                    first = serve(out, ["--mmap"], Path(tmp), "first")
                    second = serve(out, ["--mmap"], Path(tmp), "second")
                    try:
                        row["mmap_first"] = rollup(first.pid)
                        row["mmap_second"] = rollup(second.pid)
                    finally:
                        for proc in (first, second):
                            proc.terminate()
                            proc.wait(30)
            for key in ("index", "store"):
                row[f"{key}_err"] = round(row[f"{key}_plan"] / row[f"{key}_file"] - 1, 4)
            row["disk_err"] = round(row["disk_plan"] / row["disk"] - 1, 4)
            row["rss_err"] = round(row["rss_plan"] / row["rss"] - 1, 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
