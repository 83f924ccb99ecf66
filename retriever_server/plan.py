"""The memory of an index, planned before it is built: RAM and disk per component, and the RSS of a
server that serves it.

Every dense kind is a FAISS factory string (`KINDS`); its layout is read from the untrained FAISS
object (`index_factory` costs nothing before training), so a named kind and a user's own
`--factory` string are planned the same way:
- HNSW: per vector its storage's code (4d bytes flat, d bytes SQ8) and the graph: 2M neighbours on
  level 0 and, in expectation, M/(M-1) more on the upper levels (a node reaches level l with
  probability M^-l), 4 bytes each, plus an 8-byte offset and a 4-byte level.
- IVF: per vector its code and its 8-byte id in the inverted lists; fixed: the coarse centroids
  and the PQ codebooks or SQ ranges.
- Flat / SQ / PQ: per vector its code.
The document store is the corpus in Arrow (ids and contents as UTF-8 plus two 4-byte offsets a
row), estimated from the JSONL's size and a sample of its first lines. The encoder is the ONNX
files the server runs (the graph and its weights' data file: their size, or the weights' size before
they are exported). A server's RSS "at start" is the index (read into RAM, or mapped and touched by
searches: the same pages) + the encoder (the pages of its mapped weights and packed copies) + a measured
constant (Python with FAISS, ONNX Runtime, pyarrow, FastAPI, uvicorn); "max"
adds the store, whose mapped pages the kernel reads ahead, so they approach the whole file soon
after start. Store pages are clean page cache the kernel can drop, so the fit check
(`check_fits`) asks MemAvailable for "at start" only. `python -m retriever_server.plan --index DIR
[--json]` prints the plan of serving a built index (the trainer's `agent-rl plan` asks it so).

The build (`retriever-build`, one process) is planned too: its peak anonymous RSS, the larger of
its two phases, over what it keeps from start to end. Kept through both phases:
- baseline: Python, NumPy, pyarrow, FAISS, ONNX Runtime and tokenizers loaded (a measured constant);
- store: what writing docs.arrow leaves on the heap, a batch of `STORE_BATCH` passages as Python
  strings and an Arrow batch (per docs.arrow byte, measured);
- encoder: the ONNX session's own memory and its tokenizer's (a measured share of the files' bytes:
  the weights and their packed copies are mapped from the machine model's data file, page cache);
- encoder arena: ONNX Runtime's arena once batches of 16 passages up to 256 tokens have run (measured
  with the shipped encoder; a corpus of short passages only holds less);
- chunk tokens: the heap a chunk of `ENCODE_CHUNK` tokenised passages leaves (per token, measured;
  tokens from docs.arrow's bytes a passage), reused by the next chunk, not returned.
Encoding phase: + what a chunk holds while it is encoded: its float32 vectors (written to the mapped
file after), its texts and its token types (an 8-byte list slot a token).
Index phase (`build.faiss_index` over the mapped float32 file, in the same process), the larger of:
- training (kinds that train: IVF centroids, PQ codebooks, SQ ranges): the sample `faiss_index`
  copies out of the file (min(count, train_size) rows) + what FAISS copies from it: IVF k-means's
  own subsample above 256 rows a list, the encoder's training subsample
  (`train_encoder_num_vectors`, 65,536 rows for 8-bit PQ) and its residuals, one inner-product
  block (4,096 x min(nlist, 1,024) floats) and BLAS's buffers (measured);
- adding: a flat or HNSW index in one call, each contiguous array (flat codes, an HNSW's storage
  codes and neighbour lists) sized once to its final size, plus HNSW's per-vector work arrays (the
  insertion order, a lock and a visited mark a thread); an IVF index `ADD_BATCH` rows at a time, its
  lists growing a little at a time, beside the batch's buffers (list assignments; IVF-PQ's residuals
  and codes, 32,768 rows at a time). (Added in batches, a flat or HNSW index's arrays would grow as
  std::vector does, the old array resident beside its copy: up to twice the index.)
The mapped float32 file (`build_mapped_bytes`) is page cache, not anonymous memory: resident while
the build reads it, dropped by the kernel under pressure. BM25 builds are not planned (Lucene's JVM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

# Measured (bench/index_memory.py, bench/RESULTS.md): the RSS of a retriever-server that has answered a
# batch of 32 queries, less its index, its encoder's files and the store's mapped pages (ONNX Runtime's
# arena, tokenizer, Python, FAISS, pyarrow, FastAPI), and ONNX Runtime's RSS per byte of the model file.
# Under a preloaded allocator (mimalloc: `make demo` and `make test` start the trainer so, and the servers it starts
# inherit LD_PRELOAD) the same server keeps more pages resident: calibrated on the servers `make test` starts over
# the HotpotQA fixture (bench/index_memory.py's servers under mimalloc kept ~60 MiB less: bench/RESULTS.md).
SERVER_BASELINE_BYTES = 134 * 2**20
SERVER_BASELINE_PRELOADED_BYTES = 228 * 2**20
PRELOADED_ALLOCATORS = ("mimalloc", "tcmalloc", "jemalloc")


# Measured (bench/index_memory.py --kinds bm25 at 20k, 100k and 1M passages, bench/RESULTS.md): a BM25 server's RSS
# after a batch of 32 queries, less the mapped pages of its store and of Lucene's files (page cache, as the store's):
# Python, pyarrow, FastAPI and the JVM pyserini starts, under glibc's malloc and under a preloaded allocator; per
# passage, `DocStore.row_of`'s id map (12 bytes) and the JVM's share; Lucene's files per byte of docs.arrow (0.90 on
# the synthetic corpus, 0.96 on wiki-18's passages, 0.80-1.03 on CACM and the HotpotQA fixture).
BM25_BASELINE_BYTES = 190 * 2**20
BM25_BASELINE_PRELOADED_BYTES = 245 * 2**20
BM25_BYTES_PER_PASSAGE = 17
LUCENE_PER_STORE_BYTE = 0.93


def server_baseline_bytes(env: dict[str, str] | None = None, bm25: bool = False) -> int:
    """The server's baseline RSS for the allocator a server started from this environment runs (LD_PRELOAD)."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    if any(a in preload for a in PRELOADED_ALLOCATORS):
        return BM25_BASELINE_PRELOADED_BYTES if bm25 else SERVER_BASELINE_PRELOADED_BYTES
    return BM25_BASELINE_BYTES if bm25 else SERVER_BASELINE_BYTES


ENCODER_RSS_PER_FILE_BYTE = 1.0
# Measured (bench/RESULTS.md): the anonymous memory an ONNX Runtime session over the encoder takes per byte of
# its files (MiniLM fp32), its tokenizer's included: the weights, and the copies ONNX Runtime packs for its
# kernels, are mapped from the data files of the model optimised for the machine (encoders.machine_model),
# page cache that processes on one machine share.
ENCODER_ANON_PER_FILE_BYTE = 0.07
# The share of an fp32 encoder's weights a dynamic int8 export keeps (int8 MatMul weights, fp32 rest).
INT8_FILE_SHARE = 0.27

# The build (retriever_server.build reads these): passages encoded a chunk, vectors added to an IVF index a
# call, rows drawn to train, passages written to docs.arrow a batch (retriever_server.store.write_store),
# and the tokens the encoder keeps of a passage (Encoder's max_length).
ENCODE_CHUNK = 8192
ADD_BATCH = 65536
# Bytes a vector of an HNSW add's work arrays: the insertion order (int32), a lock (omp_lock_t, at most 8) and
# each thread's visited mark (1 a thread, counted for 4 threads).
HNSW_ADD_WORK = 4 + 8 + 4
DEFAULT_TRAIN_SIZE = 262_144
STORE_BATCH = 50_000
MAX_TOKENS = 256
# Measured (bench/index_memory.py --build-ram, bench/RESULTS.md), retriever-build's anonymous RSS under
# glibc's malloc: the process with its modules and ONNX Runtime session loaded, less the weights; the
# heap writing docs.arrow leaves per byte of its batch; ONNX Runtime's arena after batches of 16
# passages up to 256 tokens; the heap a tokenised chunk leaves per token; docs.arrow bytes a token.
BUILD_BASELINE_BYTES = 100 * 2**20
STORE_HEAP_PER_BYTE = 4.6
ENCODE_ARENA_BYTES = 197 * 2**20
TOKEN_HEAP_BYTES = 128
STORE_BYTES_PER_TOKEN = 4.4

# Named kinds: factory string (from d and n), one line on memory and recall, default search settings.
KINDS: dict[str, str] = {
    "flat": "exact search; RAM 4 x dim bytes a passage; the recall every other kind is measured against",
    "hnsw": "HNSW64 graph over float vectors; RAM 4 x dim + ~530 bytes a passage; recall near exact",
    "hnsw_sq8": "HNSW32 over 8-bit scalar-quantised vectors; RAM dim + ~275 bytes a passage (a quarter of hnsw's "
    "vectors); recall a little under hnsw's",
    "ivf_pq": "IVF (~4 sqrt(n) lists) + PQ, dim/8 bytes a passage; RAM dim/8 + 8 bytes a passage; the lowest "
    "recall of these; --nprobe trades speed for recall",
    "factory": "any FAISS index_factory string given with --factory (e.g. 'IVF4096,PQ64'), planned the same way",
    "bm25": "Lucene BM25 through pyserini; no vectors, no encoder; RAM ~17 bytes a passage beside a JVM, its files "
    "(~0.9 x the store) mapped",
}
DEFAULT_NPROBE = 64


def ivf_lists(n: int) -> int:
    """IVF list count for n vectors: the power of two at or below 4 sqrt(n), at least 1, and at most
    n / 39 (FAISS's k-means wants 39 training points a centroid)."""
    target = max(1, min(int(4 * n**0.5), n // 39))
    return 1 << (target.bit_length() - 1)


def pq_bytes(d: int) -> int:
    """PQ sub-quantisers for ivf_pq: d/8 (8 dimensions each, one byte each), a divisor of d."""
    m = max(1, d // 8)
    while d % m:
        m -= 1
    return m


def factory_string(kind: str, d: int, n: int, hnsw_m: int = 64, factory: str | None = None) -> str:
    """The FAISS index_factory string a dense kind builds for n vectors of dimension d."""
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return f"HNSW{hnsw_m},Flat"
    if kind == "hnsw_sq8":
        return "HNSW32,SQ8"
    if kind == "ivf_pq":
        # at least 32 training points a codebook centroid: 8-bit codebooks from 8,192 vectors up
        bits = min(8, max(1, (n // 32).bit_length() - 1))
        return f"IVF{ivf_lists(n)},PQ{pq_bytes(d)}" + (f"x{bits}" if bits < 8 else "")
    if kind == "factory":
        if not factory:
            raise ValueError(
                "--kind factory needs --factory STRING (a FAISS index_factory string, e.g. 'IVF4096,PQ64')"
            )
        return factory
    raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")


@dataclass
class Layout:
    """An index's bytes: `per_vector` a vector (codes, ids, graph) and `fixed` (centroids, codebooks)."""

    per_vector: float = 0.0
    fixed: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # per-vector bytes by part: codes, ids, graph

    def add(self, other: Layout) -> Layout:
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Layout(self.per_vector + other.per_vector, self.fixed + other.fixed, parts)


def layout(index) -> Layout:
    """The byte layout of a FAISS index (untrained is fine); ValueError for a type it does not know."""
    import faiss

    owner, index = index, faiss.downcast_index(index)  # the downcast wrapper does not own the object
    d = index.d
    if isinstance(index, faiss.IndexPreTransform):
        fixed, chain = 0.0, cast(Any, index.chain)  # a SWIG vector, not the list the stubs say
        for i in range(chain.size()):
            vt = faiss.downcast_VectorTransform(chain.at(i))
            fixed += 4.0 * vt.d_in * vt.d_out + 4.0 * vt.d_out
        return Layout(fixed=fixed).add(layout(index.index))
    if isinstance(index, faiss.IndexRefine):
        return layout(index.base_index).add(layout(index.refine_index))
    if isinstance(index, faiss.IndexHNSW):
        cum = faiss.vector_to_array(index.hnsw.cum_nneighbor_per_level)  # 0, 2M, 3M, ...
        level0, m = int(cum[1]), int(cum[2] - cum[1])
        graph = 4.0 * (level0 + m / max(1, m - 1)) + 8 + 4
        return Layout(graph, 0.0, {"graph": graph}).add(layout(index.storage))
    if isinstance(index, faiss.IndexIVF):
        nlist = index.nlist
        quantizer = layout(index.quantizer)
        fixed = quantizer.fixed + quantizer.per_vector * nlist + 48.0 * nlist  # + each list's vectors
        fixed += _trained_bytes(index, d)
        code = float(index.code_size)
        return Layout(code + 8, fixed, {"codes": code, "ids": 8.0})
    if isinstance(index, faiss.IndexFlatCodes):
        code = float(index.code_size)
        return Layout(code, _trained_bytes(index, d), {"codes": code})
    raise ValueError(f"no memory model for {type(index).__name__} (in {type(owner).__name__})")


def _trained_bytes(index, d: int) -> float:
    """Codebooks (PQ: M x 256 x dsub floats) or scalar-quantiser ranges (2 x d floats)."""
    if hasattr(index, "pq"):
        pq = index.pq
        return 4.0 * pq.M * pq.ksub * pq.dsub
    if hasattr(index, "sq"):
        return 4.0 * 2 * d
    return 0.0


# FAISS's inner-product blocks (distance_compute_blas_query_bs x _database_bs floats): one is live in a
# k-means step or a list assignment, and the heap keeps it.
BLAS_BLOCK_ROWS, BLAS_BLOCK_COLS = 4096, 1024
# IndexIVFPQ adds in blocks of this many rows (index_ivfpq_add_core_o_bs): residuals and codes a block.
IVFPQ_ADD_BLOCK = 32768
# Measured (bench/RESULTS.md): what IVF training holds beyond its arrays (BLAS's and k-means's buffers).
IVF_TRAIN_BUFFERS_BYTES = 4 * 2**20


def ivf_of(index):
    """The IVF index inside `index` (for its nlist / nprobe), or None when it is not an IVF index."""
    import faiss

    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:  # not an IVF index
        return None


def _block_bytes(nlist: int) -> int:
    return 4 * BLAS_BLOCK_ROWS * min(nlist, BLAS_BLOCK_COLS)


def train_bytes(index, count: int, train_size: int = DEFAULT_TRAIN_SIZE) -> int:
    """Peak bytes of training the untrained FAISS `index` as `faiss_index` does: the sample it copies
    out of the mapped file (min(count, train_size) rows of 4 d bytes) and, on top, for IVF its
    centroids, `IVF_TRAIN_BUFFERS_BYTES` and the larger of its k-means step (its own subsample above
    `max_points_per_centroid` rows a list, an assignment and a distance a row, one inner-product
    block) and its encoder's training (the `train_encoder_num_vectors` subsample, copied where
    smaller than the sample, the residuals and assignments of it, one block); for a PQ outside IVF
    the sub-vectors of the sample and of its k-means subsample. 0 for an index that needs no
    training (flat, HNSW over flat vectors)."""
    import faiss

    if index.is_trained:
        return 0
    d = index.d
    rows = min(count, train_size)
    sample = 4 * d * rows
    ivf = ivf_of(index)
    if ivf is not None:
        block = _block_bytes(ivf.nlist)
        k_rows = min(rows, ivf.nlist * ivf.cp.max_points_per_centroid)
        kmeans = (4 * d * k_rows if k_rows < rows else 0) + 12 * k_rows + block
        e_rows = min(rows, ivf.train_encoder_num_vectors() or rows)
        encoder = (4 * d * e_rows if e_rows < rows else 0) + block
        if ivf.by_residual:
            encoder += (4 * d + 8) * e_rows
        return sample + 4 * ivf.nlist * d + max(kmeans, encoder) + IVF_TRAIN_BUFFERS_BYTES
    inner = faiss.downcast_index(index)
    storage = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
    if hasattr(storage, "pq"):
        pq = storage.pq
        return sample + 4 * pq.dsub * (rows + min(rows, pq.cp.max_points_per_centroid * pq.ksub))
    return sample


def add_bytes(index, lay: Layout, count: int) -> int:
    """Peak bytes of adding `count` vectors to the trained `index` as `build.faiss_index` does. A flat
    or HNSW index in one call: its fixed part and `lay.per_vector` bytes a vector, each contiguous
    array sized once, plus for HNSW `HNSW_ADD_WORK` bytes a vector (the insertion order, the locks,
    the threads' visited marks). An IVF index `ADD_BATCH` rows at a time: the lists grow a little at a
    time (no copy counted), beside the call's list assignments and, for IVF-PQ, a block's residuals
    and codes, and one inner-product block."""
    import faiss

    ivf = ivf_of(index)
    if ivf is None:
        work = HNSW_ADD_WORK * count if isinstance(faiss.downcast_index(index), faiss.IndexHNSW) else 0
        return int(lay.fixed + lay.per_vector * count + work)
    rows = min(count, ADD_BATCH)
    buffers = 8 * rows + _block_bytes(ivf.nlist)
    if isinstance(faiss.downcast_index(ivf), faiss.IndexIVFPQ) and ivf.by_residual:
        buffers += (4 * ivf.d + ivf.code_size) * min(rows, IVFPQ_ADD_BLOCK)
    return int(lay.fixed + lay.per_vector * count + buffers)


def build_parts(
    index,
    lay: Layout,
    count: int,
    dim: int,
    store: int,
    encoder_bytes: int,
    train_size: int = DEFAULT_TRAIN_SIZE,
) -> dict[str, int]:
    """retriever-build's anonymous memory by term (see the module docstring): the five kept through
    the build, `encode_chunk` (encoding phase only), `index_train` and `index_add` (index
    phase: the larger counts)."""
    per_passage = store / max(1, count)
    tokens = min(float(MAX_TOKENS), per_passage / STORE_BYTES_PER_TOKEN)
    chunk = min(count, ENCODE_CHUNK)
    return {
        "baseline": BUILD_BASELINE_BYTES,
        "store_batch": int(STORE_HEAP_PER_BYTE * per_passage * min(count, STORE_BATCH)),
        "encoder": int(encoder_bytes * ENCODER_ANON_PER_FILE_BYTE),
        "encoder_arena": ENCODE_ARENA_BYTES,
        "chunk_tokens": int(TOKEN_HEAP_BYTES * tokens * chunk),
        "encode_chunk": int(chunk * (4 * dim + per_passage + 8 * tokens)),
        "index_train": train_bytes(index, count, train_size),
        "index_add": add_bytes(index, lay, count),
    }


def build_peak(parts: dict[str, int]) -> int:
    """The build's peak anonymous RSS: what it keeps + the larger phase (encoding's chunk, or the index
    phase's larger of training and adding)."""
    kept = sum(v for k, v in parts.items() if k not in ("encode_chunk", "index_train", "index_add"))
    return kept + max(parts["encode_chunk"], parts["index_train"], parts["index_add"])


def count_lines(path: Path, chunk: int = 1 << 24) -> int:
    """Lines in a file (newlines, plus a last line without one), read in 16 MiB blocks."""
    n, last = 0, b"\n"
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def store_bytes(corpus: Path, sample: int = 2000) -> int:
    """docs.arrow's size for a corpus JSONL: the first `sample` lines' id + contents bytes and two
    4-byte offsets a row, per byte of JSONL, times the file's size (exact when the sample is all)."""
    line_bytes = arrow = 0
    whole = True
    with open(corpus, "rb") as fh:
        for n, line in enumerate(fh):
            if n >= sample:
                whole = False
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            contents = rec["contents"] if "contents" in rec else f"{rec.get('title', '')}\n{rec.get('text', '')}"
            line_bytes += len(line)
            arrow += len(str(rec.get("id", n)).encode()) + len(contents.encode()) + 8
    if not line_bytes:
        return 0
    overhead = 2048  # the Arrow file's schema, footer and per-batch headers
    return (arrow if whole else int(arrow * corpus.stat().st_size / line_bytes)) + overhead


def encoder_file_bytes(encoder: str | None, index_dir: Path | None = None, int8: bool = False) -> tuple[int, str]:
    """(bytes of the ONNX file the server will run, where the figure comes from): the exported file
    in the index directory when it is there, else the encoder's weights (an fp32 export is their
    size; an int8 one about INT8_FILE_SHARE of it)."""
    from retriever_server.encoders import default_encoder_path, onnx_bytes

    name = "encoder.int8.onnx" if int8 else "encoder.onnx"
    if index_dir is not None and (Path(index_dir) / name).is_file():
        return onnx_bytes(Path(index_dir) / name), str(Path(index_dir) / name)
    model_dir = Path(encoder or default_encoder_path())
    weights = [p for p in model_dir.glob("*") if p.suffix in (".safetensors", ".bin") and p.is_file()]
    if not weights:
        raise ValueError(f"no weights (*.safetensors, *.bin) in {model_dir}: give the encoder as a local directory")
    size = sum(p.stat().st_size for p in weights)
    return int(size * INT8_FILE_SHARE) if int8 else size, str(model_dir)


def encoder_dim(encoder: str | None) -> int:
    """The encoder's output dimension from its config.json (hidden_size), without loading it."""
    from retriever_server.encoders import default_encoder_path

    config = Path(encoder or default_encoder_path()) / "config.json"
    if not config.is_file():
        raise ValueError(f"{config} is missing: give the encoder as a local directory")
    c = json.loads(config.read_text())
    dim = c.get("hidden_size") or c.get("d_model") or c.get("dim")
    if not dim:
        raise ValueError(f"{config} names no hidden_size")
    return int(dim)


@dataclass
class Plan:
    """Planned bytes of one index; `--plan --json` prints `asdict` of it."""

    kind: str
    factory: str | None
    count: int
    dim: int | None
    index_bytes: int  # the index file, and its RAM once read (or mapped and touched)
    index_parts: dict[str, int]  # codes / vectors, ids, graph, fixed (centroids, codebooks)
    store_bytes: int  # docs.arrow
    encoder_bytes: int  # the ONNX file the server runs
    encoder_source: str
    build_scratch_bytes: int  # the float32 vectors written during the build, deleted after it
    disk_bytes: int  # the index directory: index + store + encoder
    server_rss_start_bytes: int  # a started server: baseline + encoder + index
    server_rss_max_bytes: int  # ... once every store page has been read
    baseline_bytes: int = field(default_factory=server_baseline_bytes)
    build_rss_bytes: int = 0  # retriever-build's peak anonymous RSS (`build_peak` of build_parts; 0: bm25)
    build_parts: dict[str, int] = field(default_factory=dict)  # its terms by phase (`build_parts`)
    build_mapped_bytes: int = 0  # the mapped float32 vectors' pages it reads meanwhile (page cache)

    def table(self) -> str:
        rows = [
            (f"index ({self.factory or self.kind})", self.index_bytes),
            *[(f"  {k}", v) for k, v in self.index_parts.items()],
            ("document store (docs.arrow)", self.store_bytes),
            (f"encoder ({Path(self.encoder_source).name or '-'})", self.encoder_bytes),
            ("disk: index directory", self.disk_bytes),
            ("disk: build scratch (float32 vectors)", self.build_scratch_bytes),
            (
                f"server RSS at start (+ {'Python/JVM' if self.kind == 'bm25' else 'Python/FAISS/ORT'} baseline)",
                self.server_rss_start_bytes,
            ),  # fmt: skip
            ("server RSS, every store page read", self.server_rss_max_bytes),
        ]
        if self.build_rss_bytes:
            p = self.build_parts
            kept = self.build_rss_bytes - max(p["encode_chunk"], p["index_train"], p["index_add"])
            rows += [
                ("build RAM, peak anonymous (the larger phase)", self.build_rss_bytes),
                ("  kept (baseline, store, encoder, arena, tokens)", kept),
                ("  encoding phase: + a chunk's vectors, texts, tokens", p["encode_chunk"]),
                ("  index phase: + training sample and copies", p["index_train"]),
                ("  index phase: + index while adding", p["index_add"]),
                ("build RAM: mapped vectors (page cache, reclaimable)", self.build_mapped_bytes),
            ]
        head = f"{self.count:,} passages" + (f" x {self.dim} dims" if self.dim else "")
        return "\n".join([head] + [f"{name:<52} {human(v):>11}" for name, v in rows])


def human(n: float) -> str:
    """Bytes as MiB below a GiB, else GiB."""
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def plan_index(
    count: int,
    dim: int | None,
    kind: str,
    store: int,
    encoder_bytes: int = 0,
    encoder_source: str = "",
    hnsw_m: int = 64,
    factory: str | None = None,
    train_size: int = DEFAULT_TRAIN_SIZE,
) -> Plan:
    """Plan for `count` passages of dimension `dim` (None for bm25), `store` bytes of docs.arrow;
    `train_size` is the build's (`retriever-build --train-size`)."""
    if kind == "bm25":  # Lucene's files are mapped: page cache on top of the start, as the store is
        base = server_baseline_bytes(bm25=True)
        lucene = int(LUCENE_PER_STORE_BYTE * store)
        start = base + BM25_BYTES_PER_PASSAGE * count
        parts = {"lucene files (mapped)": lucene}
        disk, top = store + lucene, start + store + lucene
        return Plan(kind, None, count, None, lucene, parts, store, 0, "", 0, disk, start, top, base)  # fmt: skip
    import faiss

    assert dim is not None
    spec = factory_string(kind, dim, count, hnsw_m, factory)
    try:
        untrained = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ValueError(f"FAISS does not read the factory string {spec!r}: {err}") from err
    lay = layout(untrained)
    parts = {k: int(v * count) for k, v in lay.parts.items()}
    parts["fixed"] = int(lay.fixed)
    index = int(lay.per_vector * count + lay.fixed)
    encoder_rss = int(encoder_bytes * ENCODER_RSS_PER_FILE_BYTE)
    start = server_baseline_bytes() + encoder_rss + index
    build = build_parts(untrained, lay, count, dim, store, encoder_bytes, train_size)
    return Plan(
        kind=kind,
        factory=spec,
        count=count,
        dim=dim,
        index_bytes=index,
        index_parts=parts,
        store_bytes=store,
        encoder_bytes=encoder_bytes,
        encoder_source=encoder_source,
        build_scratch_bytes=4 * dim * count + 128,
        disk_bytes=index + store + encoder_bytes,
        server_rss_start_bytes=start,
        server_rss_max_bytes=start + store,
        build_rss_bytes=build_peak(build),
        build_parts=build,
        build_mapped_bytes=4 * dim * count + 128,
    )


def plan_build(
    corpus: Path,
    kind: str,
    encoder: str | None = None,
    hnsw_m: int = 64,
    factory: str | None = None,
    int8: bool = False,
    count: int | None = None,
    dim: int | None = None,
    train_size: int = DEFAULT_TRAIN_SIZE,
) -> Plan:
    """The plan of `retriever-build --corpus corpus --kind kind`, from the corpus's line count and
    size and the encoder's config, before anything is encoded. `count` and `dim` project it to
    another corpus size (the store scaled by passages) or encoder width."""
    lines = count_lines(corpus)
    store = store_bytes(corpus)
    if count is not None:
        store = int(store * count / max(1, lines))
    count = count or lines
    if kind == "bm25":
        return plan_index(count, None, kind, store)
    enc, source = encoder_file_bytes(encoder, None, int8)
    return plan_index(count, dim or encoder_dim(encoder), kind, store, enc, source, hnsw_m, factory, train_size)


def plan_served(index_dir: Path, manifest: dict, int8: bool = False) -> Plan:
    """The plan of serving a built index directory (its manifest, its store's and encoder's files)."""
    index_dir = Path(index_dir)
    store = (index_dir / "docs.arrow").stat().st_size
    kind = manifest["kind"]
    if kind == "bm25":
        return plan_index(manifest["count"], None, kind, store)
    build = manifest.get("build", {})
    enc, source = encoder_file_bytes(manifest.get("encoder"), index_dir, int8)
    return plan_index(
        manifest["count"],
        manifest["dim"],
        kind,
        store,
        enc,
        source,
        build.get("hnsw_m", 64),
        build.get("factory"),
        build.get("train_size", DEFAULT_TRAIN_SIZE),
    )


def mem_available() -> int | None:
    """Bytes the kernel says a new process can take without swapping: /proc/meminfo's MemAvailable,
    or env RETRIEVER_MEM_AVAILABLE (bytes) when set (tests simulate a small machine with it)."""
    override = os.environ.get("RETRIEVER_MEM_AVAILABLE")
    if override:
        return int(override)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(index_dir: Path, manifest: dict, int8: bool = False) -> Plan | None:
    """Refuse (ValueError) to open an index whose planned server RSS at start exceeds MemAvailable,
    naming the figure and the kinds that would fit, rather than be killed by the kernel halfway
    through reading it; the plan otherwise (None when it cannot be made). A mapped index counts
    in full too: searches touch its pages, and a server thrashing the page cache is no better."""
    try:
        plan = plan_served(index_dir, manifest, int8)
    except (ValueError, OSError, KeyError):
        return None
    available = mem_available()
    if available is None:
        return plan
    need = plan.server_rss_start_bytes
    if need <= available:
        return plan
    source = "env RETRIEVER_MEM_AVAILABLE" if os.environ.get("RETRIEVER_MEM_AVAILABLE") else "MemAvailable"
    fits = []
    if plan.dim:
        for kind in ("hnsw", "hnsw_sq8", "ivf_pq"):
            if kind == plan.kind:
                continue
            other = plan_index(plan.count, plan.dim, kind, plan.store_bytes, plan.encoder_bytes, plan.encoder_source)
            if other.server_rss_start_bytes <= available:
                fits.append(f"{kind} ({human(other.server_rss_start_bytes)})")
    raise ValueError(
        f"index {index_dir} ({plan.kind}, {plan.count:,} passages) needs about {human(need)} to serve "
        f"(index {human(plan.index_bytes)} + encoder {human(plan.encoder_bytes)} + baseline "
        f"{human(plan.baseline_bytes)}) but only {human(available)} is available "
        f"({source}); "
        + (
            f"kinds that would fit: {', '.join(fits)} (rebuild with retriever-build --kind ...)"
            if fits
            else "no dense kind would fit: free memory or serve on a larger machine"
        )
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m retriever_server.plan --index DIR`: the plan of serving a built index."""
    p = argparse.ArgumentParser(
        prog="python -m retriever_server.plan",
        description="The RAM and disk of serving a built index directory: index, document store, encoder and the "
        "RSS of `retriever-server --index DIR` (what `retriever-build --plan` gives before the build).",
    )
    p.add_argument("--index", required=True, help="index directory written by retriever-build")
    p.add_argument("--int8", action="store_true", help="planned for the server's --int8 query encoder")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = p.parse_args(argv)
    try:
        plan = plan_served(Path(a.index), json.loads((Path(a.index) / "manifest.json").read_text()), a.int8)
    except (OSError, ValueError, KeyError) as err:
        print(f"retriever_server.plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=1) if a.json else plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
