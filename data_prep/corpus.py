"""`data-prep corpus`: raw corpora -> the standard JSONL, one `{"id", "contents": "Title\\ntext"}` a line.

Formats: HippoRAG JSON lists of `{title, text[, idx]}`, wiki-18 JSONL (`id` + `contents`, passed
through, or `title` + `text`), BEIR `corpus.jsonl` (`_id`, `title`, `text`), and CACM (a tar of
`CACM-xxxx.html` files whose `<pre>` holds the title, abstract and bibliographic lines, or
Anserini's converted JSONL with `id` + `contents`). Input is streamed record by record (a
HippoRAG list through an incremental `json.JSONDecoder.raw_decode` reader, no third-party
parser, never the whole list in memory). Duplicate ids keep the first record and are counted;
the set of ids seen is the one thing held in memory (roughly 1.5 GB for wiki-18's 21M ids).
CACM from HTML: title lines, then the rest with whitespace collapsed as Anserini's converter
does, so its contents match Anserini's JSONL but for the newline after the title.
"""

from __future__ import annotations

import html
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from retriever_server.jsonl import iter_jsonl

FORMATS = ("hipporag", "wiki18", "beir", "cacm")


class CorpusError(ValueError):
    """A malformed input the user must fix; the message names the file and the record."""


@dataclass
class CorpusStats:
    read: int = 0
    written: int = 0
    duplicates: int = 0
    duplicate_examples: list[str] = field(default_factory=list)


def iter_json_array(fh: IO[str], chunk_size: int = 1 << 20) -> Iterator:
    """Yield the elements of a top-level JSON list, reading `chunk_size` characters at a time."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        data = fh.read(chunk_size)
        if not data:
            eof = True
            return False
        buf, pos = buf[pos:] + data, 0
        return True

    def skip_ws() -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                pos += 1
            if pos < len(buf) or not more():
                return

    skip_ws()
    if pos >= len(buf) or buf[pos] != "[":
        raise CorpusError("expected a JSON list ('[' ...)")
    pos += 1
    skip_ws()
    if pos < len(buf) and buf[pos] == "]":
        return
    index = 0
    while True:
        skip_ws()
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as err:
                # Usually the element runs past the buffer: read on. At the end it is truly bad.
                if not more():
                    raise CorpusError(f"element {index} of the JSON list is not valid JSON ({err.msg})") from err
        yield obj
        index += 1
        pos = end
        skip_ws()
        if pos >= len(buf):
            raise CorpusError(f"the JSON list ends after element {index - 1} without ']'")
        sep = buf[pos]
        pos += 1
        if sep == "]":
            return
        if sep != ",":
            raise CorpusError(f"expected ',' or ']' after element {index - 1} of the JSON list, got {sep!r}")


def _title_text(title, text) -> str:
    return f"{'' if title is None else str(title).strip()}\n{'' if text is None else str(text).strip()}"


def read_hipporag(path: Path) -> Iterator[tuple[str, str]]:
    """HippoRAG `*_corpus.json`: [{title, text, idx?}]; the id is `idx` (or `id`), else the position."""
    with open(path, encoding="utf-8") as fh:
        for i, rec in enumerate(iter_json_array(fh)):
            if not isinstance(rec, dict) or "text" not in rec:
                raise CorpusError(f"{path}: element {i} needs a 'text' field (and a 'title')")
            rid = rec.get("idx", rec.get("id", i))
            yield str(rid), _title_text(rec.get("title", ""), rec["text"])


def read_wiki18(path: Path) -> Iterator[tuple[str, str]]:
    """wiki-18 / FlashRAG JSONL: `contents` passes through unchanged (title line included)."""
    for n, rec in iter_jsonl(path, CorpusError):
        if "id" not in rec:
            raise CorpusError(f"{path}:{n}: a wiki18 line needs an 'id'")
        if isinstance(rec.get("contents"), str):
            yield str(rec["id"]), rec["contents"]
        elif "text" in rec:
            yield str(rec["id"]), _title_text(rec.get("title", ""), rec["text"])
        else:
            raise CorpusError(f"{path}:{n}: a wiki18 line needs 'contents' (or 'title' and 'text')")


def read_beir(path: Path) -> Iterator[tuple[str, str]]:
    """BEIR corpus.jsonl: `_id`, `title`, `text` (`metadata` ignored)."""
    for n, rec in iter_jsonl(path, CorpusError):
        if "_id" not in rec or "text" not in rec:
            raise CorpusError(f"{path}:{n}: a BEIR line needs '_id' and 'text'")
        yield str(rec["_id"]), _title_text(rec.get("title", ""), rec["text"])


_PRE = re.compile(r"<pre>(.*?)</pre>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")


def cacm_html_to_contents(markup: str) -> str:
    """The `<pre>` block: first paragraph is the title, the rest collapsed to single spaces."""
    m = _PRE.search(markup)
    body = html.unescape(_TAG.sub(" ", m.group(1) if m else markup)).strip()
    paragraphs = re.split(r"\n[ \t]*\n", body, maxsplit=1)
    title = " ".join(paragraphs[0].split())
    rest = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""
    return f"{title}\n{rest}"


def read_cacm(path: Path) -> Iterator[tuple[str, str]]:
    """A tar(.gz) of CACM-xxxx.html (id = file stem), or a JSONL with `id` + `contents`."""
    if tarfile.is_tarfile(path):
        with tarfile.open(path, "r:*") as tar:
            for member in tar:  # iterating a tar streams it; getmembers() would index it all first
                name = os.path.basename(member.name)
                if not member.isfile() or not name.lower().endswith(".html"):
                    continue
                fh = tar.extractfile(member)
                if fh is None:  # a regular file always has a reader; None is for links and devices
                    continue
                markup = fh.read().decode("utf-8", errors="replace")
                yield name[: -len(".html")], cacm_html_to_contents(markup)
        return
    for n, rec in iter_jsonl(path, CorpusError):
        if "id" not in rec or not isinstance(rec.get("contents"), str):
            raise CorpusError(f"{path}:{n}: a CACM JSONL line needs 'id' and 'contents' (or pass the HTML tarball)")
        yield str(rec["id"]), rec["contents"]


READERS = {"hipporag": read_hipporag, "wiki18": read_wiki18, "beir": read_beir, "cacm": read_cacm}


def convert_corpus(input_path: Path, fmt: str, out: Path) -> CorpusStats:
    """Stream `input_path` in format `fmt` into `out` (written atomically); duplicates keep the first."""
    input_path, out = Path(input_path), Path(out)
    if fmt not in READERS:
        raise CorpusError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not input_path.is_file():
        raise CorpusError(f"--input {input_path} does not exist or is not a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    stats, seen = CorpusStats(), set()
    try:
        with open(tmp, "w", encoding="utf-8") as sink:
            for rid, contents in READERS[fmt](input_path):
                stats.read += 1
                if rid in seen:
                    stats.duplicates += 1
                    if len(stats.duplicate_examples) < 5:
                        stats.duplicate_examples.append(rid)
                    continue
                seen.add(rid)
                sink.write(json.dumps({"id": rid, "contents": contents}, ensure_ascii=False) + "\n")
                stats.written += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return stats
