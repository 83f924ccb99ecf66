"""Search-R1's `/retrieve` wire format, owned by the server and read by every client.

Request: `{"queries": [str], "topk": int | null, "return_scores": bool}`. Response:
`{"result": [[item, ...] per query]}`, where an item is `{"document": {"id", "contents", ...},
"score": float}` with `return_scores`, else the document alone. A document's `contents` is
`title\\ntext` (Search-R1's corpora); a `title` field, where a server sends one, wins.

`RetrieveRequest` and `RetrieveResponse` are what this server validates and declares in its
OpenAPI document. `parse_response` reads the same shape from any server (Search-R1's, verl's)
and forgives what they may leave out: a missing `id` or `contents` is read as empty.

`/read` (`ReadRequest`, `ReadResponse`) returns whole documents by id: `{"ids": [str]}` ->
`{"result": [document | null per id]}`.

Only pydantic here: `agent_rl` imports this module, never the server's internals.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator


class RetrieveRequest(BaseModel):
    """Search-R1's request: one result list per query, in order."""

    model_config = ConfigDict(extra="ignore")
    queries: list[StrictStr]
    topk: StrictInt | StrictFloat | None = None
    return_scores: StrictBool = False

    @field_validator("topk")
    @classmethod
    def _integral(cls, v):
        """JSON Schema counts 2.0 as an integer; so does this server (2.5, "3" and true are refused)."""
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError(f"Input should be a valid integer, got {v}")
            return int(v)
        return v


class Document(BaseModel):
    """One passage as this server stores it; `contents` is `title\\ntext`."""

    model_config = ConfigDict(extra="allow")  # other servers add fields (a title, metadata)
    id: str
    contents: str


class ScoredDocument(BaseModel):
    """A result item when the request asked for `return_scores`."""

    document: Document
    score: float


class RetrieveResponse(BaseModel):
    """One result list per query, in the order sent: scored items with `return_scores`, else the
    documents alone. A list may be shorter than `topk` (an index with fewer documents)."""

    result: list[list[ScoredDocument | Document]]


class ReadRequest(BaseModel):
    """`/read`: the full documents of the given ids (ids a `/retrieve` answer carried)."""

    model_config = ConfigDict(extra="ignore")
    ids: list[StrictStr]


class ReadResponse(BaseModel):
    """One item per id, in order: the document, or null for an id the corpus does not hold."""

    result: list[Document | None]


class ResponseError(ValueError):
    """A /retrieve answer that is not Search-R1's format."""


def parse_response(payload: Any, n_queries: int) -> list[list[dict]]:
    """The documents of a /retrieve answer, one list per query: dicts with `id`, `contents`,
    `title` and `score` (None from a server that answers without scores)."""
    if not isinstance(payload, dict) or "result" not in payload:
        raise ResponseError(f"response is not Search-R1's {{'result': [...]}}: got {type(payload).__name__}")
    result = payload["result"]
    if not isinstance(result, list) or len(result) != n_queries:
        n = len(result) if isinstance(result, list) else type(result).__name__
        raise ResponseError(f"sent {n_queries} queries, got {n} result lists")
    return [[_document(item) for item in (items or [])] for items in result]


def parse_read_response(payload: Any, n_ids: int) -> list[dict | None]:
    """The documents of a /read answer, one per id (None: not in the corpus), with `id`, `contents`, `title`."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ResponseError(f"response is not {{'result': [...]}}: got {type(payload).__name__}")
    if len(payload["result"]) != n_ids:
        raise ResponseError(f"sent {n_ids} ids, got {len(payload['result'])} documents")
    return [None if item is None else {**_document(item), "score": None} for item in payload["result"]]


def _document(item: Any) -> dict:
    if not isinstance(item, dict):
        raise ResponseError(f"a result item is {type(item).__name__}, not an object")
    doc = item.get("document", item)
    if not isinstance(doc, dict):
        raise ResponseError("a result item's document is not an object")
    contents = str(doc.get("contents", ""))
    title = doc.get("title")
    if title is None:
        title = contents.split("\n", 1)[0]
    score = item.get("score")
    return {
        **doc,
        "id": str(doc.get("id", "")),
        "contents": contents,
        "title": str(title).strip().strip('"'),  # Search-R1's wiki-18 puts the title in quotes
        "score": None if score is None else float(score),
    }
