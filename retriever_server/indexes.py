"""Search indexes behind one interface: `search(queries, k) -> (scores (n,k), rows (n,k))`.

rows index the document store; -1 marks a missing hit (fewer than k documents). Kinds:
- `flat`: exact inner product (faiss IndexFlatIP); with `device="cuda"` it is served on the
  GPU(s): faiss-gpu when importable, else exact search in torch, fp16 optional, sharded across
  the visible GPUs (Search-R1's flat wiki-18 index needs ~65 GB; shard it or use HNSW on CPU).
- `hnsw`: faiss IndexHNSWFlat (M=64 default, efConstruction/efSearch recorded): the CPU default.
- `hnsw_sq8`, `ivf_pq`, `factory`: any FAISS factory string (`retriever_server.plan`), searched with
  `ef_search` (HNSW) and `nprobe` (IVF), the manifest's unless the server overrides them.
- `bm25`: Lucene through pyserini (`retriever_server.bm25`).
With `mmap=True` the index file is mapped, not read (`faiss.IO_FLAG_MMAP_IFC`: flat codes, HNSW
storage; `IO_FLAG_MMAP`: IVF lists), so servers over one index share its pages in the page cache.
Before opening, the server's planned RSS is compared with MemAvailable (`plan.check_fits`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from retriever_server.encoders import Encoder
from retriever_server.plan import ivf_of
from retriever_server.store import DocStore


class TorchExactIndex:
    """Exact inner-product search with torch, sharded row-wise across devices (GPU or CPU)."""

    def __init__(self, vectors: np.ndarray, devices: list[str], fp16: bool = False):
        import torch

        self.torch = torch
        dtype = torch.float16 if fp16 else torch.float32
        # Contiguous row ranges sliced from `vectors` (a view of the index's own storage): only one
        # shard at a time is ever copied on the host, on its way to its device.
        bounds = np.linspace(0, len(vectors), len(devices) + 1).astype(np.int64)
        self.shards = [
            (int(lo), torch.from_numpy(np.ascontiguousarray(vectors[lo:hi])).to(d, dtype=dtype))
            for lo, hi, d in zip(bounds[:-1], bounds[1:], devices)
        ]
        self.ntotal = len(vectors)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        torch = self.torch
        all_s, all_i = [], []
        for offset, shard in self.shards:
            if shard.shape[0] == 0:
                continue
            qs = torch.from_numpy(q).to(shard.device, dtype=shard.dtype)
            s = (qs @ shard.T).float()
            kk = min(k, shard.shape[0])
            top_s, top_i = s.topk(kk, dim=1)
            all_s.append(top_s.cpu())
            all_i.append(top_i.cpu() + offset)
        s = torch.cat(all_s, 1)
        i = torch.cat(all_i, 1)
        kk = min(k, s.shape[1])
        top_s, pos = s.topk(kk, dim=1)
        rows = i.gather(1, pos)
        return _pad(top_s.numpy().astype(np.float32), rows.numpy().astype(np.int64), k)


def _pad(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if scores.shape[1] >= k:
        return scores, rows
    n, have = scores.shape
    s = np.full((n, k), -np.inf, dtype=np.float32)
    r = np.full((n, k), -1, dtype=np.int64)
    s[:, :have], r[:, :have] = scores, rows
    return s, r


class DenseIndex:
    def __init__(
        self,
        index_dir: Path,
        manifest: dict,
        device: str = "cpu",
        fp16: bool = False,
        ef_search: int | None = None,
        encoder_device: str | None = None,
        encoder_runtime: str = "auto",
        int8: bool = False,
        threads: int = 0,
        nprobe: int | None = None,
        mmap: bool = False,
    ):
        import faiss

        self.kind = manifest["kind"]
        encoder_device = encoder_device or ("cuda" if device.startswith("cuda") else "cpu")
        if encoder_device.startswith("cuda"):
            _need_cuda("--encoder-device cuda")
        self.encoder = Encoder(
            manifest["encoder"],
            manifest["pooling"],
            manifest["query_prefix"],
            manifest["passage_prefix"],
            device=encoder_device,
            fp16=fp16,
            runtime=encoder_runtime,
            int8=int8,
            cache_dir=Path(index_dir),
            threads=threads,
        )
        path = str(Path(index_dir) / "index.faiss")
        self.mmap = mmap and not device.startswith("cuda")
        index = faiss.read_index(path, mmap_flags(index_type(path)) if self.mmap else 0)
        build = manifest.get("build", {})
        self.ef_search: int | None = None
        self.nprobe: int | None = None
        hnsw = hnsw_of(index)
        if hnsw is not None:
            self.ef_search = ef_search or build.get("ef_search", 128)
            hnsw.efSearch = self.ef_search
        ivf = ivf_of(index)
        if ivf is not None:
            self.nprobe = min(nprobe or build.get("nprobe", 64), ivf.nlist)
            ivf.nprobe = self.nprobe
        self.index = index
        self.ntotal = index.ntotal
        if device.startswith("cuda"):
            if self.kind != "flat":
                raise ValueError("--device cuda serves the flat index only; HNSW runs on the CPU")
            self.index = _gpu_flat(index, fp16)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.search_vectors(self.encoder.encode_queries(queries), k)

    def search_vectors(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, rows = self.index.search(q, k)
        return scores.astype(np.float32), rows.astype(np.int64)


def index_type(path: str) -> str:
    """The FAISS type tag of an index file's outermost index (its first 4 bytes, e.g. 'IHNf', 'IwPQ')."""
    with open(path, "rb") as fh:
        return fh.read(4).decode("ascii", "replace")


def mmap_flags(tag: str) -> int:
    """read_index flags that map the file instead of reading it: MMAP_IFC maps flat codes (a flat
    index, an HNSW's storage); IVF lists are mapped by MMAP (as OnDiskInvertedLists)."""
    import faiss

    return faiss.IO_FLAG_MMAP if tag.startswith("Iw") else faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


def hnsw_of(index):
    import faiss

    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        return hnsw_of(index.index)
    return index.hnsw if isinstance(index, faiss.IndexHNSW) else None


def _need_cuda(flag: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{flag} but no CUDA device is visible; serve with --device cpu --encoder-device cpu")


def _gpu_flat(index, fp16: bool):
    """faiss-gpu when installed (all GPUs, sharded), else torch exact search over the GPUs."""
    import torch

    _need_cuda("--device cuda")
    try:
        import faiss

        if hasattr(faiss, "index_cpu_to_all_gpus"):
            co = faiss.GpuMultipleClonerOptions()
            co.shard = True
            co.useFloat16 = fp16
            return faiss.index_cpu_to_all_gpus(index, co=co)
    except (ImportError, AttributeError, RuntimeError):
        pass
    return TorchExactIndex(flat_vectors(index), [f"cuda:{i}" for i in range(torch.cuda.device_count())], fp16=fp16)


def flat_vectors(index) -> np.ndarray:
    """The (ntotal, d) float32 vectors of a FAISS flat index as a view of its own storage, not a
    copy (`reconstruct_n` would double the host RAM: ~65 GB more for wiki-18)."""
    import faiss

    flat = faiss.downcast_index(index)
    if hasattr(flat, "get_xb"):
        return faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
    return index.reconstruct_n(0, index.ntotal)  # not a plain flat index: a copy is the only way


class BM25Index:
    def __init__(self, index_dir: Path, manifest: dict, store: DocStore):
        from retriever_server.bm25 import BM25Searcher

        b = manifest["build"]
        self.searcher = BM25Searcher(Path(index_dir), k1=b.get("k1", 0.9), b=b.get("b", 0.4))
        self.store = store
        self.ntotal = len(store)
        self.encoder = None

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, doc_ids = self.searcher.search(queries, k)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        for i, ids in enumerate(doc_ids):
            rows[i, : len(ids)] = self.store.row_of(ids)
        return np.asarray(scores, dtype=np.float32), rows


def load_manifest(index_dir: Path) -> dict:
    path = Path(index_dir) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {index_dir} is not an index built by retriever-build")
    return json.loads(path.read_text())


def open_index(
    index_dir: Path,
    device: str = "cpu",
    fp16: bool = False,
    ef_search: int | None = None,
    verify: bool = True,
    encoder_device: str | None = None,
    encoder_runtime: str = "auto",
    int8: bool = False,
    threads: int = 0,
    nprobe: int | None = None,
    mmap: bool = False,
    check_memory: bool = True,
):
    """(manifest, store, index) for an index dir; refuses a manifest that does not match its data,
    and (`check_memory`) an index whose planned server RSS exceeds MemAvailable (`plan.check_fits`).
    The query encoder runs on `encoder_device` (default: cuda when the index is on cuda, else cpu);
    `encoder_runtime` (auto, onnx, torch), `int8` (dynamic int8 query encoder, ONNX Runtime only) and
    `threads` (the encoder's intra-op threads, 0: one per core) are the Encoder's; `nprobe` (IVF)
    and `ef_search` (HNSW) override the manifest's; `mmap` maps the index file instead of reading it."""
    from retriever_server.plan import check_fits
    from retriever_server.store import file_sha256

    index_dir = Path(index_dir)
    manifest = load_manifest(index_dir)
    if check_memory and not device.startswith("cuda"):
        check_fits(index_dir, manifest, int8)
    store = DocStore(index_dir)
    if len(store) != manifest["count"]:
        raise ValueError(
            f"index {index_dir}: manifest says {manifest['count']} documents but the store holds {len(store)}; "
            "rebuild with retriever-build"
        )
    corpus = Path(manifest.get("corpus", ""))
    if (
        verify
        and corpus.is_file()
        and manifest.get("corpus_sha256")
        and file_sha256(corpus) != manifest["corpus_sha256"]
    ):
        raise ValueError(
            f"index {index_dir} was built from {corpus}, which has changed since (checksum differs); rebuild the "
            "index with retriever-build"
        )
    index: BM25Index | DenseIndex
    if manifest["kind"] == "bm25":
        index = BM25Index(index_dir, manifest, store)
    else:
        index = DenseIndex(
            index_dir,
            manifest,
            device,
            fp16,
            ef_search,
            encoder_device,
            encoder_runtime,
            int8,
            threads,
            nprobe,
            mmap,
        )
        if index.ntotal != manifest["count"]:
            raise ValueError(
                f"index {index_dir}: the FAISS index holds {index.ntotal} vectors but the manifest says "
                f"{manifest['count']}; rebuild it"
            )
    return manifest, store, index
