"""`retriever-server`: Search-R1's `/retrieve` API over a flat, HNSW or BM25 index.

Departures from Search-R1's server (a synchronous handler that encodes one request at a time):
concurrent requests are coalesced into one encode + search batch (a max batch, and a window that
only a batch smaller than the previous one waits) run in a worker thread, so the event loop and
`/health` stay responsive under load; an LRU cache keyed by (normalised query, topk) answers
GRPO's repeated queries; every input is validated (limits on queries, query length, topk and
body size answer 4xx naming the limit); an optional bearer API key, a dependency of the keyed routes
(so a mount's prefix or a proxy's root path cannot route around it); 127.0.0.1 by default.
Queries are whitespace-normalised before encoding, so a cached answer is always the answer the
index would give. `/metrics` is Prometheus text (prometheus_client), from a registry per app.
`/read` returns whole documents by id (the ids `/retrieve` answered with), under the same limits
and API key: the agent's `read` tool.

The parts, top to bottom: `Settings` (every limit and its default, which the CLI reads),
`Metrics`, `ResultCache`, `Batcher`, `Retriever` (validation, cache, search, answer), the API key
check, `Guard` (API key and body size before FastAPI reads a request; a valid `/retrieve` answered
there), the routes, `create_app`, `main`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import hashlib
import hmac
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pydantic_core
from cachetools import LRUCache
from fastapi import APIRouter, FastAPI, HTTPException, Request, Security
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from retriever_server import workers
from retriever_server.schema import ReadRequest, ReadResponse, RetrieveRequest, RetrieveResponse

Hits = tuple[np.ndarray, np.ndarray]  # (scores (n, k) float32, rows (n, k) int64; -1 = no document)


@dataclass
class Settings:
    """What one server enforces and how it batches and caches; the flags (`parse_args`) take their
    defaults from here. A default topk outside 1..max_topk is refused at start-up."""

    topk: int = 3
    """documents per query when a request gives no topk (--topk)"""
    max_topk: int = 100
    """largest topk a request may ask for (--max-topk)"""
    max_queries: int = 256
    """most queries in one request (--max-queries)"""
    max_query_chars: int = 2048
    """longest query, in characters (--max-query-chars)"""
    max_body_bytes: int = 1_000_000
    """largest request body; a larger one gets 413 after it is read and discarded (--max-body-bytes)"""
    batching: bool = True
    """coalesce concurrent requests into one search; False is Search-R1's one at a time (--no-batching)"""
    max_batch: int = 64
    """most queries coalesced into one encode + search (--max-batch)"""
    batch_window_ms: float = 20.0
    """the most a batch waits for more requests, only while it holds fewer than the previous batch
    (--batch-window-ms)"""
    cache_size: int = 10_000
    """LRU entries keyed by (normalised query, topk); 0 turns the cache off (--cache-size, --no-cache)"""
    api_key: str | None = None
    """require 'Authorization: Bearer KEY' on /retrieve and /read (--api-key, env RETRIEVER_API_KEY); an empty
    key is refused at start-up, not taken for no key"""
    max_drain_bytes: int = 64_000_000
    """an over-limit body up to this size is read to the end before the 413; past it the connection
    is closed (--max-drain-bytes)"""
    delay_ms: float = 0.0
    """held before every /retrieve answer: a remote or loaded retriever, for benchmarks (--delay-ms)"""

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.max_topk:
            raise ValueError(f"--topk {self.topk} must be between 1 and --max-topk ({self.max_topk})")
        # A blank RETRIEVER_API_KEY (a deployment's unset variable) would otherwise serve with no key at all.
        # The key itself is never put in a message: it would end up in logs.
        key = self.api_key
        if key is not None and not key:
            raise ValueError(
                "--api-key (or env RETRIEVER_API_KEY) is empty: give a key, or leave both unset to serve without one"
            )
        if key is not None and not (key.isascii() and key.isprintable() and key == key.strip()):
            raise ValueError(
                "--api-key (or env RETRIEVER_API_KEY) must be printable ASCII with no spaces at its ends, "
                "as a client sends it in 'Authorization: Bearer KEY'"
            )


def normalize_query(q: str) -> str:
    return " ".join(q.split())


# Where and when an index was built: not what it answers.
NOT_DETERMINING = ("corpus", "created", "build_seconds")


def index_fingerprint(manifest: dict, index_options: dict[str, Any]) -> str:
    """sha256 of what determines this server's answers: the manifest (corpus sha256, kind, count,
    encoder, pooling, prefixes, build parameters) less where and when it was built, and the options
    it is served with (device, fp16, ef_search, ...). `/health` serves it; a client keys recorded
    answers by it."""
    what = {k: v for k, v in manifest.items() if k not in NOT_DETERMINING}
    what["serving"] = {k: v for k, v in index_options.items() if k not in ("threads", "mmap")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The server's Prometheus metrics in a registry of their own (not prometheus_client's global
    one), so several apps in one process count apart. Counters render with a `_total` suffix."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("retriever_requests", "answers by HTTP status", ["code"], registry=self.registry)
        self._by_status: dict[int, Counter] = {}  # labels() looks its child up under a lock each call
        self.queries = Counter("retriever_queries", "queries answered", registry=self.registry)
        self.cache_hits = Counter("retriever_cache_hits", "queries answered from the cache", registry=self.registry)
        self.cache_misses = Counter("retriever_cache_misses", "queries the cache lacked", registry=self.registry)
        self.batch_size = Histogram(
            "retriever_batch_size", "queries per index search", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.latency = Histogram(
            "retriever_request_latency_seconds",
            "time to answer a valid /retrieve",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.encode_time = Histogram(
            "retriever_encode_seconds",
            "query encoding time per index search (dense indexes)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.search_time = Histogram(
            "retriever_search_seconds",
            "index search time per batch of encoded queries (BM25: the whole search)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def count(self, status: int) -> None:
        child = self._by_status.get(status)
        if child is None:
            child = self._by_status[status] = self.requests.labels(code=str(status))
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ResultCache:
    """One query's hits keyed by (normalised query, topk), least recently used evicted first.
    cachetools' caches are not thread-safe, hence the lock."""

    def __init__(self, maxsize: int):
        self._lru: LRUCache[tuple[str, int], Hits] = LRUCache(maxsize)
        self._lock = threading.Lock()

    def get_many(self, queries: list[str], k: int) -> list[Hits | None]:
        with self._lock:
            return [self._lru.get((q, k)) for q in queries]

    def put_many(self, queries: list[str], k: int, scores: np.ndarray, rows: np.ndarray) -> None:
        with self._lock:
            for q, s, r in zip(queries, scores, rows):
                self._lru[(q, k)] = (s.copy(), r.copy())


class Batcher:
    """Coalesces queued requests into one search run in `executor`. A batch takes every request
    already waiting; then it waits, at most the window, only while it holds fewer requests than
    the previous batch did: clients that wait for their answer (a rollout, a load test) come back
    together, so their batch stays whole instead of splitting at a fixed deadline, and a lone
    client never waits at all."""

    def __init__(
        self,
        search: Callable[[list[str], int], Hits],
        executor: ThreadPoolExecutor,
        max_batch: int,
        window_ms: float,
    ):
        self.search, self.executor = search, executor
        self.max_batch, self.window_s = max_batch, window_ms / 1000.0
        self.queue: asyncio.Queue[tuple[list[str], int, asyncio.Future[Hits]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, queries: list[str], k: int) -> Hits:
        fut: asyncio.Future[Hits] = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, k, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        expect = 1
        while True:
            first = await self.queue.get()
            items = [first]
            n = len(first[0])
            deadline = loop.time() + self.window_s
            while n < self.max_batch:
                try:  # requests already waiting always join, whatever the window (even 0 ms)
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    if len(items) >= expect:
                        break
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), timeout)
                    except asyncio.TimeoutError:
                        break
                items.append(item)
                n += len(item[0])
            expect = len(items)
            queries = [q for qs, _, _ in items for q in qs]
            k = max(kk for _, kk, _ in items)
            try:
                scores, rows = await loop.run_in_executor(self.executor, self.search, queries, k)
            except Exception as err:  # the index failed: every waiting request gets the error
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            lo = 0
            for qs, kk, fut in items:
                if not fut.done():
                    fut.set_result((scores[lo : lo + len(qs), :kk], rows[lo : lo + len(qs), :kk]))
                lo += len(qs)


class Answer(JSONResponse):
    """A 200's body (already plain JSON types) written by pydantic-core's serialiser, which writes
    a result list in a fraction of the json module's time. It writes a non-finite float as
    `Infinity` or `NaN`, which JSON has not: `/retrieve` refuses non-finite scores before this."""

    def render(self, content: Any) -> bytes:
        return pydantic_core.to_json(content)


def format_result(
    docs: list[dict], scores: np.ndarray, rows: np.ndarray, return_scores: bool
) -> list[list[dict[str, Any]]]:
    """Search-R1's `result`: one list per query of documents (with scores if asked), skipping -1
    rows. `docs` are the store's documents for the non-negative `rows`, in row-major order."""
    result, pos = [], 0
    for i in range(rows.shape[0]):
        items = []
        for j in range(rows.shape[1]):
            if rows[i, j] < 0:
                continue
            doc = docs[pos]
            pos += 1
            items.append({"document": doc, "score": float(scores[i, j])} if return_scores else doc)
        result.append(items)
    return result


class Retriever:
    """One server's index, store, limits, cache, batcher and metrics: validates a request, answers
    it from the cache or the index, and counts every answer by status."""

    def __init__(self, manifest: dict, index: Any, store: Any, settings: Settings, fingerprint: str = ""):
        self.manifest, self.index, self.store, self.s = manifest, index, store, settings
        self.fingerprint = fingerprint or index_fingerprint(manifest, {})
        self.metrics = Metrics()
        self.cache = ResultCache(settings.cache_size) if settings.cache_size > 0 else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self.closed = False  # the executor shut down by `close`
        self.batcher: Batcher | None = None
        self.serial = asyncio.Lock()
        self.started = time.time()
        self.workers = 1  # server processes on this index (retriever_server.workers); each counts its own

    def search_now(self, queries: list[str], k: int) -> Hits:
        """The one place the index is searched (runs in the worker thread)."""
        self.metrics.batch_size.observe(len(queries))
        encoder = getattr(self.index, "encoder", None)
        if encoder is None:
            with self.metrics.search_time.time():
                return self.index.search(queries, k)
        with self.metrics.encode_time.time():
            q = encoder.encode_queries(queries)
        with self.metrics.search_time.time():
            return self.index.search_vectors(q, k)

    def start(self) -> None:
        """Starts the batcher on the running event loop (the app's startup); after a `close` (a lifespan
        entered again: a second TestClient, an outer app restarted) on a new search thread."""
        if self.closed:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
            self.closed = False
        if self.s.batching:
            self.batcher = Batcher(self.search_now, self.executor, self.s.max_batch, self.s.batch_window_ms)
            self.batcher.start()

    def close(self) -> None:
        if self.batcher is not None and self.batcher.task is not None:
            self.batcher.task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.closed = True

    def error(self, status: int, message: str, close: bool = False) -> JSONResponse:
        """The one error shape, `{"detail": sentence}`, counted by status."""
        self.metrics.count(status)
        return JSONResponse(
            status_code=status, content={"detail": message}, headers={"connection": "close"} if close else None
        )

    def refusal(self, req: RetrieveRequest, k: int) -> JSONResponse | None:
        """The 4xx for a request past a limit, naming the limit and its flag; None when it is within."""
        s = self.s
        if k < 1:
            return self.error(422, f"topk must be >= 1, got {k}")
        if k > s.max_topk:
            return self.error(422, f"topk {k} exceeds the limit of {s.max_topk} (--max-topk)")
        if len(req.queries) > s.max_queries:
            return self.error(
                413, f"{len(req.queries)} queries exceed the limit of {s.max_queries} per request (--max-queries)"
            )
        for i, q in enumerate(req.queries):
            if len(q) > s.max_query_chars:
                return self.error(
                    413,
                    f"query {i} has {len(q)} characters, over the limit of {s.max_query_chars} (--max-query-chars)",
                )
            # a lone surrogate ("\ud800") is valid JSON but breaks the tokenizer and its whole batch
            try:
                q.encode("utf-8")
            except UnicodeEncodeError as err:
                return self.error(422, f"query {i} is not valid Unicode text: {err.reason} at character {err.start}")
        return None

    async def search(self, queries: list[str], k: int) -> Hits:
        """Cache first; the misses go through the batcher (or one at a time without it)."""
        n = len(queries)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        rows = np.full((n, k), -1, dtype=np.int64)
        misses = list(range(n))
        if self.cache is not None:
            hits = self.cache.get_many(queries, k)
            misses = [i for i, hit in enumerate(hits) if hit is None]
            for i, hit in enumerate(hits):
                if hit is not None:
                    scores[i], rows[i] = hit
            self.metrics.cache_hits.inc(n - len(misses))
            self.metrics.cache_misses.inc(len(misses))
        if misses:
            miss_q = [queries[i] for i in misses]
            if self.batcher is not None:
                s, r = await self.batcher.submit(miss_q, k)
            else:
                async with self.serial:  # Search-R1's behaviour: one request at a time
                    s, r = await asyncio.get_running_loop().run_in_executor(self.executor, self.search_now, miss_q, k)
            scores[misses], rows[misses] = s, r
            if self.cache is not None:
                self.cache.put_many(miss_q, k, s, r)
        return scores, rows

    async def retrieve(self, req: RetrieveRequest) -> JSONResponse:
        start = time.perf_counter()
        k = self.s.topk if req.topk is None else int(req.topk)  # integral: the validator refused 2.5
        refused = self.refusal(req, k)
        if refused is not None:
            return refused
        if not req.queries:
            self.metrics.count(200)
            return Answer({"result": []})
        queries = [normalize_query(q) for q in req.queries]
        if self.s.delay_ms > 0:
            await asyncio.sleep(self.s.delay_ms / 1000.0)
        try:
            scores, rows = await self.search(queries, k)
        except Exception as err:  # the index itself failed: say so, stay up
            return self.error(503, f"search failed: {type(err).__name__}: {err}")
        if not np.isfinite(scores[rows >= 0]).all():
            return self.error(503, "search failed: the index gave a score that is not a finite number")
        result = format_result(self.store.get(rows), scores, rows, req.return_scores)
        self.metrics.queries.inc(len(queries))
        self.metrics.count(200)
        self.metrics.latency.observe(time.perf_counter() - start)
        return Answer({"result": result})

    async def read(self, req: ReadRequest) -> JSONResponse:
        """The full documents of `req.ids` (null for an unknown id), under `/retrieve`'s per-request limits."""
        s = self.s
        if len(req.ids) > s.max_queries:
            return self.error(
                413, f"{len(req.ids)} ids exceed the limit of {s.max_queries} per request (--max-queries)"
            )
        for i, doc_id in enumerate(req.ids):
            if len(doc_id) > s.max_query_chars:
                return self.error(
                    413,
                    f"id {i} has {len(doc_id)} characters, over the limit of {s.max_query_chars} (--max-query-chars)",
                )
        try:
            # On the search thread, not the event loop: the first read builds the store's id map (seconds at
            # wiki-18's 21M ids), and BM25's searches build and read the same map there
            result = await asyncio.get_running_loop().run_in_executor(self.executor, self._read_now, list(req.ids))
        except Exception as err:  # the store itself failed: say so, stay up
            return self.error(503, f"read failed: {type(err).__name__}: {err}")
        self.metrics.count(200)
        return Answer({"result": result})

    def _read_now(self, ids: list[str]) -> list[dict | None]:
        rows = self.store.row_of(ids)
        found = iter(self.store.get(rows))
        return [next(found) if row >= 0 else None for row in rows.tolist()]

    def health(self) -> dict[str, Any]:
        s = self.s
        return {
            "status": "ok",
            "kind": self.manifest["kind"],
            "count": self.manifest["count"],
            "encoder": self.manifest.get("encoder"),
            "encoder_runtime": getattr(getattr(self.index, "encoder", None), "runtime", None),
            "int8": getattr(getattr(self.index, "encoder", None), "int8", None),
            "ef_search": getattr(self.index, "ef_search", None),
            "nprobe": getattr(self.index, "nprobe", None),
            "mmap": getattr(self.index, "mmap", None),
            "factory": self.manifest.get("build", {}).get("factory"),
            "corpus_sha256": self.manifest.get("corpus_sha256"),
            "index_fingerprint": self.fingerprint,
            "uptime_s": round(time.time() - self.started, 1),
            "pid": os.getpid(),
            "workers": self.workers,
            "limits": {
                "max_queries": s.max_queries,
                "max_query_chars": s.max_query_chars,
                "max_topk": s.max_topk,
                "default_topk": s.topk,
                "max_body_bytes": s.max_body_bytes,
            },
        }


async def drain(receive: Callable, already: int, more: bool, cap: int) -> bool:
    """Read and discard the rest of an over-limit body (up to `cap` bytes), so a client that sends
    its whole body before reading (urllib, requests) receives the 413 instead of a connection
    reset. False when the client left or the body passed the cap."""
    size = already
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
        if size > cap:
            return False
    return True


def is_plain_json(content_type: bytes | None) -> bool:
    """A body FastAPI would read as JSON: no content type, or application/json (any parameters)."""
    return content_type is None or content_type.split(b";", 1)[0].strip().lower() == b"application/json"


def first_values(raw_headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Each header's first value, as Starlette's `Headers.get` (hence FastAPI) reads a repeated header."""
    headers: dict[bytes, bytes] = {}
    for name, value in raw_headers:
        headers.setdefault(name, value)
    return headers


def route_path(scope: Mapping[str, Any]) -> str:
    """The path Starlette routes on: `path` less `root_path` (a mount's prefix, or a proxy's root path
    that uvicorn prepends), the same rule as Starlette's own."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root) :]
    return path


KEYED_ROUTES = ("/retrieve", "/read")
"""The routes that take a JSON body and, when the server has one, the API key."""
BEARER = HTTPBearer(
    auto_error=False, description="the key the server was started with (--api-key, env RETRIEVER_API_KEY)"
)
KEY_REFUSAL = "missing or wrong API key: send 'Authorization: Bearer KEY'"
KEY_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def key_matches(credentials: HTTPAuthorizationCredentials | None, key: str) -> bool:
    """Whether `credentials` (`BEARER`'s reading of the Authorization header) carry `key`, compared in
    constant time. Starlette decodes header bytes as latin-1, so encoding back gives the bytes sent;
    `Settings` holds the key to printable ASCII, so its bytes are unambiguous."""
    return credentials is not None and hmac.compare_digest(credentials.credentials.encode("latin-1"), key.encode())


class Guard:
    """API key and body size, checked before FastAPI reads the request, on the path Starlette routes
    on (the key is a dependency of the keyed routes too, so what passes here still needs it there).
    A plain ASGI middleware: Starlette's `@app.middleware("http")` runs every request through an
    extra task and stream, about a third of this server's per-request CPU on a cache hit. A body is
    read here (so a chunked body with no Content-Length is bounded too) and replayed to the app.

    A `/retrieve` body that pydantic's JSON parser reads as a valid `RetrieveRequest` is answered
    here, by the route's own `Retriever.retrieve`: at high concurrency the encoder waits on the
    event loop between batches, and FastAPI's routing, dependency solving and middleware were
    the larger part of that loop's work a request (bench/RESULTS.md). Every other body (malformed
    JSON, a wrong type, another content type) goes on to FastAPI, which answers it as before."""

    def __init__(self, app: Any, retriever: Retriever):
        self.app, self.retriever = app, retriever

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s, error = self.retriever.s, self.retriever.error
        headers = first_values(scope["headers"])
        path = route_path(scope)
        if s.api_key and path in KEYED_ROUTES and not key_matches(await BEARER(Request(scope)), s.api_key):
            refusal = error(401, KEY_REFUSAL)
            refusal.headers.update(KEY_CHALLENGE)
            return await refusal(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > s.max_body_bytes:
            message = (
                f"request body of {length.decode()} bytes exceeds the limit of {s.max_body_bytes} bytes "
                "(--max-body-bytes)"
            )
            if int(length) <= s.max_drain_bytes:
                await drain(receive, 0, True, s.max_drain_bytes)
            return await error(413, message, close=True)(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > s.max_body_bytes:
                await drain(receive, size, more, s.max_drain_bytes)
                refusal = error(
                    413, f"request body exceeds the limit of {s.max_body_bytes} bytes (--max-body-bytes)", close=True
                )
                return await refusal(scope, receive, send)
        body = b"".join(chunks)
        if path == "/retrieve" and is_plain_json(headers.get(b"content-type")):
            try:
                req = RetrieveRequest.model_validate_json(body)
            except ValidationError:
                pass  # FastAPI gives the error its usual answer
            else:
                response = await self.retriever.retrieve(req)
                return await response(scope, receive, send)
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return await self.app(scope, replayed, send)


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer: one sentence naming the field or the limit (and its flag)."""

    detail: str


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (401, "missing or wrong API key"),
        (413, "too many queries, a query too long, or a body over --max-body-bytes"),
        (422, "malformed JSON, a wrong type, or topk out of range"),
        (503, "the index failed"),
    )
}
METRICS_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format 0.0.4"}
}

keyed = APIRouter()  # KEYED_ROUTES; `create_app` puts `require_key` on each when the server has a key
router = APIRouter()  # open to all: /health, /metrics


def retriever_of(app: Any) -> Retriever:
    """The app's `Retriever` (FastAPI's app state, set by `create_app`)."""
    return app.state.retriever


async def require_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]
) -> None:
    """401 (with the guard's body and `WWW-Authenticate: Bearer`) unless the request carries the API key."""
    key = retriever_of(request.app).s.api_key
    if key and not key_matches(credentials, key):
        raise HTTPException(401, KEY_REFUSAL, headers=KEY_CHALLENGE)


@keyed.post("/retrieve", response_model=RetrieveResponse, responses=ERROR_RESPONSES)
async def retrieve(req: RetrieveRequest, request: Request) -> Response:
    return await retriever_of(request.app).retrieve(req)


@keyed.post("/read", response_model=ReadResponse, responses=ERROR_RESPONSES)
async def read(req: ReadRequest, request: Request) -> Response:
    return await retriever_of(request.app).read(req)


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, Any]:
    return retriever_of(request.app).health()


@router.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSE)
async def metrics(request: Request) -> Response:
    return Response(retriever_of(request.app).metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # FastAPI answers 400 when the body is not decodable JSON at all (invalid UTF-8, nesting
    # past the recursion limit); the contract says malformed JSON is a 422.
    if exc.status_code == 400 and route_path(request.scope) in KEYED_ROUTES:
        return retriever_of(request.app).error(422, f"malformed request body: {exc.detail} (send UTF-8 JSON)")
    retriever_of(request.app).metrics.count(exc.status_code)
    return await http_exception_handler(request, exc)


async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """One error shape for every 4xx (ErrorResponse): the detail is a sentence naming the field."""
    parts = [
        f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body') or 'body'}: {e.get('msg', '')} "
        f"({e.get('type', '')})"
        for e in exc.errors()
    ]
    return retriever_of(request.app).error(422, "invalid request: " + "; ".join(parts))


def openapi_with_limits(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the limits this server enforces, so schema-driven clients and
    fuzzers generate only requests it can accept (the numbers /health reports too)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        s = retriever_of(app).s
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        props = doc["components"]["schemas"]["RetrieveRequest"]["properties"]
        props["queries"]["maxItems"] = s.max_queries
        props["queries"]["items"]["maxLength"] = s.max_query_chars
        props["topk"] = {
            "anyOf": [{"type": "integer", "minimum": 1, "maximum": s.max_topk}, {"type": "null"}],
            "title": "Topk",
            "description": f"documents per query (default {s.topk})",
        }
        ids = doc["components"]["schemas"]["ReadRequest"]["properties"]["ids"]
        ids["maxItems"] = s.max_queries
        ids["items"]["maxLength"] = s.max_query_chars
        doc["components"]["schemas"].pop("HTTPValidationError", None)
        doc["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = doc
    return app.openapi_schema


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the batcher; then write the ready file ({url, pid}) atomically, so whoever waits on
    it finds a server that answers."""
    retriever = retriever_of(app)
    retriever.start()
    if app.state.on_ready is not None:  # a forked worker tells its parent (retriever_server.workers)
        app.state.on_ready()
    workers.write_ready(app.state.ready_file, app.state.url)
    yield
    retriever.close()


def create_app(
    index_dir: Path,
    settings: Settings | None = None,
    ready_file: Path | None = None,
    url: str = "",
    **index_options: Any,
) -> FastAPI:
    """The app over the index in `index_dir`; `index_options` go to `open_index` (device, fp16,
    ef_search, nprobe, mmap, encoder_device, encoder_runtime, int8, threads, check_memory), whose
    signature holds their defaults.

    Mounted in another app (`outer.mount("/search", app)`) it keeps its API key, limits and answers,
    but the outer app does not run its lifespan (which starts the batcher and writes the ready file):
    enter it from the outer app's own, or requests are answered one at a time::

        @asynccontextmanager
        async def outer_lifespan(outer: FastAPI) -> AsyncIterator[None]:
            async with app.router.lifespan_context(app):
                yield
    """
    from retriever_server.indexes import open_index  # faiss and torch: not imported for `--help`

    manifest, store, index = open_index(index_dir, **index_options)
    app = FastAPI(
        title="agent-rl retriever",
        description="Search-R1 compatible retrieval over a FAISS or BM25 index.",
        lifespan=lifespan,
        exception_handlers={StarletteHTTPException: http_error, RequestValidationError: invalid_request},
    )
    fingerprint = index_fingerprint(manifest, index_options)
    app.state.retriever = Retriever(manifest, index, store, settings or Settings(), fingerprint)
    app.state.ready_file, app.state.url, app.state.on_ready = ready_file, url, None
    app.add_middleware(Guard, retriever=app.state.retriever)
    # The key as a dependency of the keyed routes, not only the guard's: no path to them skips it, and
    # the OpenAPI document states it (only where there is a key to send).
    app.include_router(keyed, dependencies=[Security(require_key)] if app.state.retriever.s.api_key else [])
    app.include_router(router)
    app.openapi = functools.partial(openapi_with_limits, app)  # type: ignore[method-assign]  # FastAPI's documented way
    return app


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings, dict[str, Any]]:
    """(flags, settings, index options). Each limit's default is `Settings`'; each index option's
    is `open_index`'s (a flag not given is not passed on)."""
    d = Settings()
    p = argparse.ArgumentParser(
        prog="retriever-server", description="Serve an index built by retriever-build with Search-R1's /retrieve API."
    )
    p.add_argument("--index", required=True, help="index directory written by retriever-build")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = an ephemeral port; default %(default)s)")
    p.add_argument(
        "--topk", type=int, default=d.topk, help="documents per query when a request gives no topk (%(default)s)"
    )
    p.add_argument("--max-topk", type=int, default=d.max_topk, help="largest topk a request may ask (%(default)s)")
    p.add_argument("--max-queries", type=int, default=d.max_queries, help="most queries in one request (%(default)s)")
    p.add_argument("--max-query-chars", type=int, default=d.max_query_chars, help="longest query (%(default)s)")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body (%(default)s); a larger one gets 413 after its body is read and discarded, "
        "up to --max-drain-bytes",
    )
    p.add_argument(
        "--max-drain-bytes",
        type=int,
        default=d.max_drain_bytes,
        help="an over-limit body up to this size (%(default)s) is read to the end before the 413 (so clients that "
        "send the whole body first see the answer); past it the connection is closed",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RETRIEVER_API_KEY", d.api_key),
        help="require 'Authorization: Bearer KEY' on /retrieve and /read (or env RETRIEVER_API_KEY; an empty "
        "key is an error, not 'no key')",
    )
    p.add_argument(
        "--max-batch", type=int, default=d.max_batch, help="most queries in one encode + search (%(default)s)"
    )
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=d.batch_window_ms,
        help="the most a batch waits for more requests (%(default)s); it waits only while it holds fewer "
        "requests than the previous batch",
    )
    p.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        default=d.batching,
        help="one request at a time (Search-R1's behaviour)",
    )
    p.add_argument(
        "--cache-size", type=int, default=d.cache_size, help="LRU entries keyed by (query, topk) (%(default)s)"
    )
    p.add_argument("--no-cache", action="store_true", help="no result cache (--cache-size 0)")
    p.add_argument(
        "--delay-ms",
        type=float,
        default=d.delay_ms,
        help="hold every /retrieve answer this long: emulates a remote or loaded retriever (benchmarks)",
    )
    index = p.add_argument_group("index options", argument_default=argparse.SUPPRESS)
    index.add_argument("--device", help="cpu (default), or cuda to serve a flat index on the GPU(s)")
    index.add_argument(
        "--encoder-device",
        help="device of the query encoder (default: cuda with --device cuda, else cpu); "
        "an HNSW index on CPU can take a GPU encoder",
    )
    index.add_argument("--fp16", action="store_true", help="fp16 vectors and encoder on the GPU")
    index.add_argument(
        "--encoder-runtime",
        choices=["auto", "onnx", "torch"],
        help="query encoder runtime: onnx (ONNX Runtime, exported once and kept in the index directory), torch "
        "(transformers' forward), or auto (default: onnx on CPU where onnxruntime is installed, else torch)",
    )
    index.add_argument(
        "--int8",
        action="store_true",
        help="dynamic int8 query encoder (onnx runtime); check answer recall with retriever-eval before serving it",
    )
    index.add_argument("--ef-search", type=int, help="HNSW efSearch (default: the manifest's)")
    index.add_argument("--nprobe", type=int, help="IVF lists searched a query (default: the manifest's)")
    index.add_argument(
        "--mmap",
        action="store_true",
        help="map the index file instead of reading it, so servers of one index on a machine share its pages "
        "(flat, HNSW and IVF kinds)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch, faiss and ONNX Runtime threads (0 = all cores)")
    p.add_argument("--ready-file", help="write {url, pid} here once listening (with --workers: and the workers' pids)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="server processes forked from one that opened the index, sharing its memory and port (Linux, dense "
        "CPU indexes; each with --threads threads, default the cores shared out; default %(default)s)",
    )
    a = p.parse_args(argv)
    if a.no_cache:
        a.cache_size = 0
    try:
        settings = Settings(**{f.name: getattr(a, f.name) for f in fields(Settings)})
    except ValueError as err:
        p.error(str(err))
    index_options = {
        k: getattr(a, k)
        for k in ("device", "encoder_device", "fp16", "encoder_runtime", "int8", "ef_search", "nprobe", "mmap")
        if k in a
    }
    if a.threads:
        index_options["threads"] = a.threads
    return a, settings, index_options


def main(argv: list[str] | None = None) -> int:
    a, settings, index_options = parse_args(argv)
    import uvicorn

    try:
        kind = json.loads((Path(a.index) / "manifest.json").read_text())["kind"]
    except (OSError, ValueError, KeyError):
        kind = ""  # open_index says what is wrong with the directory
    why = workers.refusal(a.workers, kind, index_options.get("device"), index_options.get("encoder_runtime"))
    if why:
        print(f"retriever-server: error: {why}", file=sys.stderr)
        return 2
    forked = a.workers > 1
    if forked:
        gc.disable()  # no collection leaves holes in the pages the workers will share (gc.freeze at fork)
        threads = workers.worker_threads(a.threads, a.workers)
        index_options["threads"] = 1  # the parent's encoder session starts no thread pool: fork copies none

    if a.threads:  # torch only for this: an ONNX encoder's server does not import it otherwise
        import torch

        torch.set_num_threads(a.threads)
    # proto=IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket says TCP, and without it Nagle + delayed ACK add ~40 ms per request.
    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as err:
        print(f"retriever-server: error: cannot bind {a.host}:{a.port}: {err}", file=sys.stderr)
        return 2
    sock.listen(2048)
    url = f"http://{a.host}:{sock.getsockname()[1]}"
    ready_file = Path(a.ready_file) if a.ready_file else None
    try:
        app = create_app(Path(a.index), settings, None if forked else ready_file, url, **index_options)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"retriever-server: error: {err}", file=sys.stderr)
        return 2
    # proxy_headers off: nothing here reads the client's address, so X-Forwarded-* need no parsing
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30, proxy_headers=False)
    if forked:
        return workers.serve_workers(app, config, sock, a.workers, threads, url, ready_file)
    print(f"retriever-server listening on {url}", flush=True)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
