"""The one HTTP client for Search-R1's `/retrieve` API (ours, Search-R1's, verl's).

The trainer's rollouts and `retriever-eval` both use it. One batched request per call (split
into requests of at most `max_queries_per_request`, under the server's per-request limit: ours
refuses more than 256 with a 413, the pieces sent concurrently), a pooled connection, a timeout,
retries with exponential backoff on connection errors, timeouts, 429, 5xx and a malformed answer
(not JSON, or not one result list per query); a 429 or 5xx's `Retry-After` (seconds or an HTTP
date, at most `max_retry_after_s`) is waited instead when it is longer; every retry is counted in
`stats["retries"]`. A 4xx is not retried. The answer is read through `retriever_server.schema`.
When the server stays down the caller gets a `RetrievalError`: the rollout turns it into an
observation saying retrieval failed, the evaluation counts the queries as failed; neither crashes.

Record and replay (`retriever_server.record`): with a `record`, every answer is also written there,
keyed by the index's fingerprint (from `/health`), the query and topk; with `replay`, answers come
from the record with no server, a miss raising `ReplayMiss` (`replay_miss="error"`) or going to the
live server and being recorded (`"live"`).
"""

from __future__ import annotations

import copy
import email.utils
import functools
import hashlib
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from retriever_server.record import ReplayMiss, RetrievalRecord
from retriever_server.schema import parse_read_response, parse_response

READ_K = 0  # the record's key of a /read answer: (document id, 0); a search's topk is at least 1


def _as_docs(doc: dict | None) -> list[dict]:
    """A read's answer as the record keeps it: [the document], or [] when the id is not in the corpus."""
    return [doc] if doc is not None else []


def base_url(url: str) -> str:
    """The server's base URL from either it or its full `/retrieve` endpoint."""
    url = url.rstrip("/")
    return url.removesuffix("/retrieve")


class RetrievalError(RuntimeError):
    """The retriever did not answer after all retries."""


def retry_after_s(value: str | None, cap_s: float) -> float:
    """A `Retry-After` header in seconds (delta-seconds or an HTTP date), at most `cap_s`; 0 when
    absent or unreadable."""
    if not value:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return 0.0
    return min(max(0.0, seconds), cap_s)


class RetrieverClient:
    def __init__(
        self,
        url: str | None,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
        max_queries_per_request: int = 128,
        max_connections: int = 8,
        max_retry_after_s: float = 30.0,
        record: RetrievalRecord | None = None,
        replay: bool = False,
        replay_miss: str = "error",
        max_query_chars: int = 2048,
    ):
        """`url` may be None only when replaying. `record`: where answers are written (and, with
        `replay`, read from). `replay_miss`: error | live (see the module docstring). `max_query_chars`:
        a longer query is cut to its first `max_query_chars` characters before it is searched, recorded or
        replayed (counted in `stats["clipped"]`), so that one runaway query a policy wrote does not fail its
        whole batch (our server refuses a request holding a query over its --max-query-chars, 2048 by default,
        with a 413); 0 sends every query whole."""
        if max_query_chars < 0:
            raise ValueError(f"max_query_chars must be >= 0 (0: no limit), got {max_query_chars}")
        if max_queries_per_request < 1:
            raise ValueError(f"max_queries_per_request must be >= 1, got {max_queries_per_request}")
        if replay_miss not in ("error", "live"):
            raise ValueError(f"replay_miss must be error or live, got {replay_miss!r}")
        if replay and record is None:
            raise ValueError("replay needs a record to read the answers from")
        if url is None and not replay:
            raise ValueError("a retriever URL is needed unless replaying a record")
        self.url = base_url(url) if url else None
        self.topk = topk
        self.max_queries_per_request = max_queries_per_request
        self.max_query_chars = max_query_chars
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.record, self.replay, self.replay_miss = record, replay, replay_miss
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=max_connections)
        )
        self.stats = {
            "requests": 0,
            "queries": 0,
            "errors": 0,
            "retries": 0,
            "latency_s": 0.0,
            "replayed": 0,
            "recorded": 0,
            "clipped": 0,
        }
        self._lock = threading.Lock()  # split batches run in threads
        self._record_lock = threading.Lock()  # the fingerprint and the replayed answers load once
        self._fingerprint: str | None = None
        self._index: dict | None = None  # what /health said of the index, kept beside the record
        self._answers: dict[tuple[str, int], list[dict]] | None = None

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self.stats[key] += value

    @classmethod
    def from_config(cls, rc, url: str | None) -> RetrieverClient:
        """The client a `retriever:` config section describes, for the server at `url` (None when
        `retriever.replay` answers every search from its record)."""
        folder = rc.replay or rc.record
        if rc.replay and rc.replay_miss == "error" and not RetrievalRecord(rc.replay).fingerprints():
            raise FileNotFoundError(
                f"retriever.replay={rc.replay} holds no recorded answers; record them first with "
                f"retriever.record={rc.replay} against a live retriever"
            )
        return cls(
            url,
            rc.topk,
            rc.timeout_s,
            rc.max_retries,
            rc.backoff_s,
            rc.api_key,
            rc.max_queries_per_request,
            record=RetrievalRecord(Path(folder)) if folder else None,
            replay=bool(rc.replay),
            replay_miss=rc.replay_miss,
            max_query_chars=rc.max_query_chars,
        )

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Documents `{"id", "contents", "score"}` per query, in order (score None from a server
        that answers without scores). Raises RetrievalError at last; ReplayMiss when replaying a
        record that lacks a query (and misses may not go to a live server)."""
        if not queries:
            return []
        topk = topk or self.topk
        if self.max_query_chars:
            limit = self.max_query_chars
            if any(len(q) > limit for q in queries):
                self._count("clipped", sum(len(q) > limit for q in queries))
                queries = [q[:limit] for q in queries]
        if self.replay:
            return self._replayed(queries, topk)
        if self.record is None:
            return self._live(queries, topk)
        fingerprint = self.fingerprint()  # before the search: an answer is never recorded unkeyed
        docs = self._live(queries, topk)
        written = self.record.append(fingerprint, [(q, topk, d) for q, d in zip(queries, docs)], self._index)
        self._count("recorded", written)
        return docs

    def fingerprint(self) -> str:
        """The key of the index answering: `/health`'s `index_fingerprint` from a live server (a
        server that serves none is keyed by its URL, with a warning); replaying with no server, the
        one index the record holds. Raises RetrievalError when /health does not answer."""
        with self._record_lock:
            if self._fingerprint is not None:
                return self._fingerprint
            if self.url is None:
                assert self.record is not None
                found = self.record.fingerprints()
                if len(found) != 1:
                    raise ReplayMiss(
                        f"the record {self.record.root} holds answers of {len(found)} indexes ({', '.join(found)}); "
                        "with no live retriever, replay reads a record of exactly one: record each index into a "
                        "folder of its own"
                    )
                self._fingerprint = found[0]
                return self._fingerprint
            try:
                resp = self._http.get(f"{self.url}/health")
            except httpx.HTTPError as err:
                raise RetrievalError(f"cannot read the index fingerprint from {self.url}/health: {err}") from err
            health = resp.json() if resp.status_code == 200 else {}
            fingerprint = health.get("index_fingerprint") if isinstance(health, dict) else None
            if not fingerprint:
                fingerprint = "url-" + hashlib.sha256(self.url.encode()).hexdigest()[:16]
                print(
                    f"[retriever client] {self.url}/health serves no index_fingerprint; recorded answers are "
                    f"keyed by the URL ({fingerprint}), so a changed index behind it goes unnoticed",
                    file=sys.stderr,
                )
            self._index = {k: health.get(k) for k in ("kind", "count", "encoder", "corpus_sha256")} | {"url": self.url}
            self._fingerprint = fingerprint
            return fingerprint

    @property
    def index_info(self) -> dict | None:
        """What `/health` said of the index (kind, count, encoder, corpus_sha256) and the URL, once
        `fingerprint()` has asked; None before, or when replaying with no server."""
        return self._index

    def _replayed(self, queries: list[str], topk: int, live: Callable | None = None) -> list[list[dict]]:
        """The recorded answers of `queries` at `topk`; a miss raises, or (replay_miss=live) goes to
        `live` (default: a search at `topk`) and joins the record."""
        assert self.record is not None
        fingerprint = self.fingerprint()
        with self._record_lock:
            if self._answers is None:
                self._answers = self.record.load(fingerprint)
        answers = self._answers
        missing = list(dict.fromkeys(q for q in queries if (q, topk) not in answers))
        if missing:
            if self.replay_miss == "error" or self.url is None:
                others = f" (and {len(missing) - 1} more of this batch)" if len(missing) > 1 else ""
                what = f"the query {missing[0]!r}{others} at topk {topk}"
                if topk == READ_K:
                    what = f"the read of document {missing[0]!r}{others}"
                raise ReplayMiss(
                    f"no recorded answer for {what} in "
                    f"{self.record.root / fingerprint}; record it first (retriever.record) against a live "
                    "retriever, or send misses to one (retriever.replay_miss=live)"
                )
            fresh = live(missing) if live is not None else self._live(missing, topk)
            written = self.record.append(fingerprint, [(q, topk, d) for q, d in zip(missing, fresh)], self._index)
            self._count("recorded", written)
            for q, docs in zip(missing, fresh):
                answers[(q, topk)] = docs
        self._count("replayed", len(queries) - len(missing))
        # copies: a caller that edits its documents must not edit the record
        return [copy.deepcopy(answers[(q, topk)]) for q in queries]

    def _live(self, queries: list[str], topk: int) -> list[list[dict]]:
        if self.url is None:
            raise RetrievalError("no retriever URL (replaying with no live server)")
        chunks = [
            queries[lo : lo + self.max_queries_per_request]
            for lo in range(0, len(queries), self.max_queries_per_request)
        ]
        if len(chunks) <= 1:
            return self._retrieve_chunk(queries, topk)
        # The chunks go out concurrently so the server can batch them together; order is kept.
        with ThreadPoolExecutor(max_workers=min(4, len(chunks))) as pool:
            results = list(pool.map(lambda c: self._retrieve_chunk(c, topk), chunks))
        return [docs for result in results for docs in result]

    def _retrieve_chunk(self, queries: list[str], topk: int) -> list[list[dict]]:
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        return self._post("/retrieve", payload, lambda body: parse_response(body, len(queries)), len(queries))

    def read(self, ids: list[str]) -> list[dict | None]:
        """The full documents of `ids` from `/read` (None: not in the corpus), with `/retrieve`'s
        retries and errors; split into requests of at most `max_queries_per_request` ids. Recorded and
        replayed as searches are (`retriever_server.record`: a read is kept under k = 0)."""
        if not ids:
            return []
        if self.replay:
            answers = self._replayed(ids, READ_K, lambda missing: [_as_docs(d) for d in self._read_live(missing)])
        elif self.record is not None:
            fingerprint = self.fingerprint()
            answers = [_as_docs(d) for d in self._read_live(ids)]
            written = self.record.append(fingerprint, list(zip(ids, [READ_K] * len(ids), answers)), self._index)
            self._count("recorded", written)
        else:
            return self._read_live(ids)
        return [docs[0] if docs else None for docs in answers]

    def _read_live(self, ids: list[str]) -> list[dict | None]:
        if self.url is None:
            raise RetrievalError("no retriever URL to read documents from (replaying with no live server)")
        out: list[dict | None] = []
        for lo in range(0, len(ids), self.max_queries_per_request):
            chunk = ids[lo : lo + self.max_queries_per_request]
            out += self._post("/read", {"ids": chunk}, functools.partial(parse_read_response, n_ids=len(chunk)), 0)
        return out

    def _post(self, path: str, payload: dict, parse: Callable[[Any], Any], queries: int) -> Any:
        """POST with retries (see the module docstring); `queries` is what `stats["queries"]` counts."""
        last_err: Exception | None = None
        server_wait = 0.0  # the last answer's Retry-After
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries", 1)
                time.sleep(max(self.backoff_s * 2 ** (attempt - 1), server_wait))
            server_wait = 0.0
            start = time.perf_counter()
            try:
                resp = self._http.post(f"{self.url}{path}", json=payload)
                if resp.status_code >= 500 or resp.status_code == 429:
                    server_wait = retry_after_s(resp.headers.get("retry-after"), self.max_retry_after_s)
                    raise httpx.HTTPStatusError(
                        f"HTTP {resp.status_code}: {resp.text[:200]}", request=resp.request, response=resp
                    )
                if resp.status_code >= 400:  # our own request is wrong: retrying will not help
                    self._count("errors", 1)
                    raise RetrievalError(f"retriever rejected the request: HTTP {resp.status_code}: {resp.text[:300]}")
                docs = parse(resp.json())
                self._count("requests", 1)
                self._count("queries", queries)
                self._count("latency_s", time.perf_counter() - start)
                return docs
            except RetrievalError:
                raise
            except (httpx.HTTPError, ValueError) as err:  # ResponseError and a body that is not JSON are ValueErrors
                last_err = err
        self._count("errors", 1)
        why = f"{type(last_err).__name__}: {last_err}" if last_err is not None else "no attempt"
        raise RetrievalError(f"retriever at {self.url} failed after {self.max_retries + 1} attempts: {why}")

    def warm_up(self, topk: int | None = None) -> None:
        """One untimed request, so a server's lazy start-up work is not billed to the first timed
        ones (a fixed query: a caching server never sees it again). Errors are left to the run."""
        if self.url is None:
            return
        try:
            self._http.post(f"{self.url}/retrieve", json={"queries": ["warm-up"], "topk": topk or self.topk})
        except httpx.HTTPError:
            pass

    def wait_healthy(self, max_wait_s: float, log=None) -> bool:
        """Poll GET /health with exponential backoff (0.5 s doubling, at most 10 s apart) until it
        answers 200 or `max_wait_s` has passed; returns whether the server is back (False at once
        with no server)."""
        if self.url is None:
            return False
        deadline = time.monotonic() + max_wait_s
        delay = 0.5
        while True:
            try:
                if self._http.get(f"{self.url}/health", timeout=min(5.0, max(0.5, max_wait_s))).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if log is not None:
                log(
                    f"retriever at {self.url} is not answering /health; next try in {min(delay, left):.1f} s "
                    f"({left:.0f} s left)"
                )
            time.sleep(min(delay, left))
            delay = min(10.0, delay * 2)

    def close(self) -> None:
        self._http.close()
        if self.record is not None:
            self.record.close()
