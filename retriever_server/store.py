"""The document store: the corpus in Arrow, memory-mapped, fetched by row indices vectorised.

A 21M-passage corpus must never live in Python objects: `build` converts the JSONL to an Arrow
dataset (`datasets.save_to_disk`) once; the server memory-maps it and gathers rows with one
`take` per batch. Accepts `{"id", "contents": "Title\\ntext"}` lines, or `title` + `text`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa

from retriever_server.jsonl import iter_corpus


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_store(corpus: Path, out_dir: Path, batch: int = 50_000) -> int:
    """Convert the corpus to an Arrow file under out_dir/docs; returns the row count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.string()), ("contents", pa.string())])
    n = 0
    with pa.OSFile(str(out_dir / "docs.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        ids, contents = [], []
        for rec in iter_corpus(corpus):
            ids.append(rec["id"])
            contents.append(rec["contents"])
            if len(ids) >= batch:
                writer.write_batch(pa.record_batch([ids, contents], schema=schema))
                n += len(ids)
                ids, contents = [], []
        if ids:
            writer.write_batch(pa.record_batch([ids, contents], schema=schema))
            n += len(ids)
    return n


class DocStore:
    """Memory-mapped Arrow table of the corpus; `get(rows)` gathers documents in one call."""

    def __init__(self, index_dir: Path):
        path = Path(index_dir) / "docs.arrow"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: rebuild the index with retriever-build")
        self._source = pa.memory_map(str(path), "r")
        self.table = pa.ipc.open_file(self._source).read_all()
        self._id_to_row: dict[str, int] | None = None

    def __len__(self) -> int:
        return self.table.num_rows

    def get(self, rows: np.ndarray) -> list[dict]:
        """rows: int array (any shape flattened, -1 = missing -> skipped) -> documents in order."""
        flat = np.asarray(rows, dtype=np.int64).ravel()
        valid = flat[flat >= 0]
        taken = self.table.take(pa.array(valid))
        ids = taken.column("id").to_pylist()
        contents = taken.column("contents").to_pylist()
        return [{"id": i, "contents": c} for i, c in zip(ids, contents)]

    def row_of(self, doc_ids: list[str]) -> np.ndarray:
        """Map document ids to rows (for BM25, whose hits are ids); -1 when unknown."""
        if self._id_to_row is None:
            self._id_to_row = {d: r for r, d in enumerate(self.table.column("id").to_pylist())}
        return np.array([self._id_to_row.get(d, -1) for d in doc_ids], dtype=np.int64)
