"""JSON lines, read one way: the corpus (`{"id", "contents": "Title\\ntext"}` a line) and any other
JSONL the project reads (raw corpora in data_prep, trajectory dumps in `agent-rl view`).

Standard library only, so the trainer and data_prep can import it without the server's FAISS,
torch or Arrow dependencies. Files are UTF-8 (as JSON requires) and streamed line by line;
blank lines are skipped; a line that is not a JSON object is an error naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path, error: type[ValueError] = ValueError) -> Iterator[tuple[int, dict]]:
    """Yield `(line number, record)` for every non-blank line; `error` is raised for a line that
    is not JSON or not a JSON object (callers pass their own ValueError subclass)."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{n}: not a JSON line ({err.msg} at column {err.colno})") from None
            if not isinstance(rec, dict):
                raise error(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            yield n, rec


def iter_corpus(path: str | Path) -> Iterator[dict]:
    """Stream `{"id", "contents"}` records from a corpus JSONL. A line without `contents` gets
    `title + "\\n" + text`; one with neither is an error; the id defaults to the line number - 1."""
    for n, rec in iter_jsonl(path):
        if "contents" not in rec:
            if "title" in rec and "text" in rec:
                rec["contents"] = f"{rec['title']}\n{rec['text']}"
            else:
                raise ValueError(f"{path}:{n}: a corpus line needs 'contents' (or 'title' and 'text')")
        yield {"id": str(rec.get("id", n - 1)), "contents": rec["contents"]}
