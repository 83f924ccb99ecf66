"""The document store: the corpus in Arrow, memory-mapped, read by row without copying it.

A 21M-passage corpus must never live in Python objects: `build` converts the JSONL to an Arrow
file once; the server memory-maps it and decodes only the rows a request asks for, straight from
the mapped string buffers. Accepts `{"id", "contents": "Title\\ntext"}` lines, or `title` + `text`.
"""

from __future__ import annotations

import bisect
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
    """Memory-mapped Arrow table of the corpus. `get(rows)` decodes each row's `id` and `contents`
    straight from the mapped offsets and bytes of its record batch: the server calls it once a
    request on its event loop, where `Table.take`'s fixed cost a call was the largest part of a
    cached answer (bench/RESULTS.md)."""

    def __init__(self, index_dir: Path):
        path = Path(index_dir) / "docs.arrow"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: rebuild the index with retriever-build")
        self._source = pa.memory_map(str(path), "r")
        self.table = pa.ipc.open_file(self._source).read_all()
        self._id_keys: np.ndarray | None = None  # row_of's sorted id hashes and their rows
        self._id_rows: np.ndarray | None = None
        # per record batch: (ids' offsets, ids' bytes, contents' offsets, contents' bytes); numpy
        # views and memoryviews over the map, so nothing is read until a row is asked for
        self._batches: list[tuple[np.ndarray, memoryview, np.ndarray, memoryview]] = []
        starts = [0]
        for batch in self.table.to_batches():
            self._batches.append((*_string_buffers(batch.column("id")), *_string_buffers(batch.column("contents"))))
            starts.append(starts[-1] + batch.num_rows)
        self._starts = starts

    def __len__(self) -> int:
        return self.table.num_rows

    def get(self, rows: np.ndarray) -> list[dict]:
        """rows: int array (any shape flattened, -1 = missing -> skipped) -> documents in order."""
        docs, n = [], len(self)
        for row in np.asarray(rows, dtype=np.int64).ravel().tolist():
            if row < 0:
                continue
            if row >= n:
                raise IndexError(f"row {row} is past the store's {n} documents")
            (id_off, id_bytes, off, data), r = self._locate(row)
            docs.append(
                {
                    "id": str(id_bytes[id_off[r] : id_off[r + 1]], "utf-8"),
                    "contents": str(data[off[r] : off[r + 1]], "utf-8"),
                }
            )
        return docs

    def row_of(self, doc_ids: list[str]) -> np.ndarray:
        """Map document ids to rows (for BM25, whose hits are ids); -1 when unknown. The map is the ids' hashes
        sorted, with their rows (12 bytes a passage, not a dict's ~200: 4 GB at wiki-18's 21M), made on first
        use; a hit is the row whose own id equals the one asked for, so a shared hash cannot mislead it."""
        if self._id_keys is None:
            self._index_ids()
        keys, order = self._id_keys, self._id_rows
        assert keys is not None and order is not None
        wanted = np.fromiter((hash(d) for d in doc_ids), dtype=np.int64, count=len(doc_ids))
        out = np.full(len(doc_ids), -1, dtype=np.int64)
        for i, (d, pos) in enumerate(zip(doc_ids, np.searchsorted(keys, wanted).tolist())):
            while pos < len(keys) and keys[pos] == wanted[i]:
                if self._id_at(int(order[pos])) == d:
                    out[i] = order[pos]
                    break
                pos += 1
        return out

    def _index_ids(self) -> None:
        """`row_of`'s map, built batch by batch (one record batch's ids are Python strings at a time)."""
        parts = [
            np.fromiter(map(hash, batch.column("id").to_pylist()), dtype=np.int64, count=batch.num_rows)
            for batch in self.table.to_batches()
        ]
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self._id_keys = keys[order]
        self._id_rows = order.astype(np.int32 if len(keys) < 2**31 else np.int64)

    def _locate(self, row: int) -> tuple[tuple[np.ndarray, memoryview, np.ndarray, memoryview], int]:
        """The buffers of the record batch holding `row`, and its index there."""
        b = bisect.bisect_right(self._starts, row) - 1
        return self._batches[b], row - self._starts[b]

    def _id_at(self, row: int) -> str:
        (id_off, id_bytes, _, _), r = self._locate(row)
        return str(id_bytes[id_off[r] : id_off[r + 1]], "utf-8")


def _string_buffers(column: pa.Array) -> tuple[np.ndarray, memoryview]:
    """A string column's value offsets (numpy, this slice's rows only) and its bytes, both zero-copy."""
    if column.null_count:
        raise ValueError("docs.arrow has a null id or contents: rebuild the index with retriever-build")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"docs.arrow holds {column.type}, not strings: rebuild the index with retriever-build")
    _, offsets, data = column.buffers()
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    offs = np.frombuffer(offsets, dtype=width)[column.offset : column.offset + len(column) + 1]
    return offs, memoryview(data) if data is not None else memoryview(b"")
