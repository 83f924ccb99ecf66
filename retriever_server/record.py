"""A record of `/retrieve` and `/read` answers on disk, so rollouts and evaluations can be replayed
without a server.

An answer is keyed by what determines it: the index's fingerprint (`/health`'s
`index_fingerprint`), the query as sent, and topk; a `/read` answer by the document id and k = 0 (a
search's topk is at least 1), its docs `[the document]`, or `[]` for an id not in the corpus. Layout:

    DIR/<fingerprint>/index.json                       what /health said of the index (for people)
    DIR/<fingerprint>/<host>-<pid>-<time>-<rand>.jsonl one segment per writing process

A segment line is `{"q": query, "k": topk, "docs": [...]}`, the documents as the client parsed
them. Why this design: each process appends only to its own segment, so ranks of one torchrun job
(or runs on several machines sharing DIR) never interleave or lock; a batch of answers goes out as
one `write` of complete lines followed by `fsync`, so after a kill (or a power cut) at most the
last line of the dead process's segment is torn; no process ever appends to another's segment, so
a torn tail stays the last line of its file, and the reader skips it, losing only that entry. One
file per answer (tmp + rename) would be as safe, at a file per query: slow to write and list on
the shared filesystems a multi-node run uses.

Reading takes the first answer of a key; recording writes a key at most once per process.
Standard library only: the trainer imports it through the client.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

Key = tuple[str, int]  # (query as sent, topk)


class ReplayMiss(LookupError):
    """A replayed retrieval has no recorded answer. Not a RetrievalError: a rollout must not turn it
    into a 'retrieval failed' observation, which would silently make the replay differ."""


class RetrievalRecord:
    """The answers under `root`, read per fingerprint and appended to this process's own segment."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._lock = threading.Lock()  # split batches and the async loop call the client from threads
        self._fd: dict[str, int] = {}  # fingerprint -> this process's open segment
        self._written: set[tuple[str, str, int]] = set()
        self.skipped_lines = 0

    def fingerprints(self) -> list[str]:
        """The indexes this record holds answers of."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and any(p.glob("*.jsonl")))

    def load(self, fingerprint: str) -> dict[Key, list[dict]]:
        """Every complete answer recorded for `fingerprint`, the first one of a key kept. A line that
        does not end in a newline, or is not a whole entry, was torn by a kill: skipped and counted."""
        answers: dict[Key, list[dict]] = {}
        skipped = 0
        for segment in sorted((self.root / fingerprint).glob("*.jsonl")):
            with segment.open("rb") as fh:
                for raw in fh:
                    entry = _entry(raw)
                    if entry is None:
                        skipped += 1
                        continue
                    answers.setdefault((entry["q"], entry["k"]), entry["docs"])
        self.skipped_lines += skipped
        if skipped:
            print(
                f"[retrieval record] {self.root / fingerprint}: skipped {skipped} torn or unreadable "
                "line(s) (a process killed while writing); those queries are missing from the record",
                file=sys.stderr,
            )
        return answers

    def append(self, fingerprint: str, answers: list[tuple[str, int, list[dict]]], index: dict | None = None) -> int:
        """Write the answers not yet written by this process as whole lines, one write and one fsync;
        returns how many were written. `index` (what /health said) goes to index.json the first time."""
        with self._lock:
            lines = []
            for query, topk, docs in answers:
                if (fingerprint, query, topk) in self._written:
                    continue
                self._written.add((fingerprint, query, topk))
                lines.append(json.dumps({"q": query, "k": topk, "docs": docs}) + "\n")
            if not lines:
                return 0
            fd = self._fd.get(fingerprint)
            if fd is None:
                fd = self._fd[fingerprint] = self._open_segment(fingerprint, index)
            data = "".join(lines).encode()
            view = memoryview(data)
            while view:  # a regular file takes it in one write; a short write is finished, never re-sent
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            return len(lines)

    def _open_segment(self, fingerprint: str, index: dict | None) -> int:
        folder = self.root / fingerprint
        folder.mkdir(parents=True, exist_ok=True)
        about = folder / "index.json"
        if index is not None and not about.exists():
            tmp = folder / f".index.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, about)
        name = f"{socket.gethostname()}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}.jsonl"
        return os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)

    def close(self) -> None:
        with self._lock:
            for fd in self._fd.values():
                os.close(fd)
            self._fd.clear()


def _entry(raw: bytes) -> dict | None:
    """A segment line as an entry, or None when it is torn (no newline) or not a whole entry."""
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("q"), str) or not isinstance(entry.get("k"), int):
        return None
    if not isinstance(entry.get("docs"), list):
        return None
    return entry
