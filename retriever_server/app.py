"""`retriever-server`: Search-R1's `/retrieve` API over a flat, HNSW or BM25 index.

Departures from Search-R1's server (a synchronous handler that encodes one request at a time):
concurrent requests are coalesced into one encode + search batch (a max batch, and a window that
only a batch smaller than the previous one waits) run in a worker thread, so the event loop and
`/health` stay responsive under load; an LRU cache keyed by (normalised query, topk) answers
GRPO's repeated queries; every input is validated (limits on queries, query length, topk and
body size answer 4xx naming the limit); an optional bearer API key; 127.0.0.1 by default.
Queries are whitespace-normalised before encoding, so a cached answer is always the answer the
index would give.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from retriever_server.schema import RetrieveRequest, RetrieveResponse


@dataclass
class Settings:
    topk: int = 3
    max_topk: int = 100
    max_queries: int = 256
    max_query_chars: int = 2048
    max_body_bytes: int = 1_000_000
    batching: bool = True
    max_batch: int = 64
    batch_window_ms: float = 20.0
    cache_size: int = 10_000
    api_key: str | None = None
    max_drain_bytes: int = 64_000_000
    delay_ms: float = 0.0  # added to every /retrieve answer: a remote or loaded retriever, for benchmarks


def normalize_query(q: str) -> str:
    return " ".join(q.split())


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Metrics:
    requests: dict = field(default_factory=lambda: {})
    queries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    batch_sizes: list = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))
    batch_sum: int = 0
    batch_count: int = 0
    latency: list = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    latency_count: int = 0

    def observe_latency(self, s: float) -> None:
        self.latency[next((i for i, b in enumerate(LATENCY_BUCKETS) if s <= b), len(LATENCY_BUCKETS))] += 1
        self.latency_sum += s
        self.latency_count += 1

    def observe_batch(self, n: int) -> None:
        self.batch_sizes[next((i for i, b in enumerate(BATCH_BUCKETS) if n <= b), len(BATCH_BUCKETS))] += 1
        self.batch_sum += n
        self.batch_count += 1

    def render(self) -> str:
        lines = ["# TYPE retriever_requests_total counter"]
        for code, n in sorted(self.requests.items()):
            lines.append(f'retriever_requests_total{{code="{code}"}} {n}')
        lines += ["# TYPE retriever_queries_total counter", f"retriever_queries_total {self.queries}"]
        lines += ["# TYPE retriever_cache_hits_total counter", f"retriever_cache_hits_total {self.cache_hits}"]
        lines += ["# TYPE retriever_cache_misses_total counter", f"retriever_cache_misses_total {self.cache_misses}"]
        for name, buckets, counts, total, count in (
            ("retriever_batch_size", BATCH_BUCKETS, self.batch_sizes, self.batch_sum, self.batch_count),
            ("retriever_request_latency_seconds", LATENCY_BUCKETS, self.latency, self.latency_sum, self.latency_count),
        ):
            lines.append(f"# TYPE {name} histogram")
            acc = 0
            for b, c in zip(buckets, counts):
                acc += c
                lines.append(f'{name}_bucket{{le="{b}"}} {acc}')
            lines.append(f'{name}_bucket{{le="+Inf"}} {acc + counts[-1]}')
            lines.append(f"{name}_sum {total}")
            lines.append(f"{name}_count {count}")
        return "\n".join(lines) + "\n"


class Retriever:
    """Index + store + cache + cross-request batcher."""

    def __init__(self, index, store, settings: Settings):
        self.index, self.store, self.s = index, store, settings
        self.cache: OrderedDict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.cache_lock = threading.Lock()
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search")
        self.queue: asyncio.Queue | None = None
        self.serial = asyncio.Lock()

    def search_now(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """The one place the index is searched (runs in the worker thread)."""
        self.metrics.observe_batch(len(queries))
        return self.index.search(queries, k)

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        asyncio.get_running_loop().create_task(self._batch_loop())

    async def _batch_loop(self) -> None:
        """Coalesce queued requests into one search. A batch takes every request already waiting;
        then it waits, at most the window, only while it holds fewer requests than the previous
        batch did: clients that wait for their answer (a rollout, a load test) come back together,
        so their batch stays whole instead of splitting at a fixed deadline, and a lone client
        never waits at all."""
        loop = asyncio.get_running_loop()
        queue = self.queue
        assert queue is not None, "start() creates the queue before the batch loop runs"
        expect = 1
        while True:
            first = await queue.get()
            items = [first]
            n = len(first[0])
            deadline = loop.time() + self.s.batch_window_ms / 1000.0
            while n < self.s.max_batch:
                try:  # requests already waiting always join, whatever the window (even 0 ms)
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    if len(items) >= expect:
                        break
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout)
                    except asyncio.TimeoutError:
                        break
                items.append(item)
                n += len(item[0])
            expect = len(items)
            queries = [q for it in items for q in it[0]]
            k = max(it[1] for it in items)
            try:
                scores, rows = await loop.run_in_executor(self.executor, self.search_now, queries, k)
            except Exception as err:  # the index failed: every waiting request gets the error
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(err)
                continue
            lo = 0
            for qs, kk, fut in items:
                if not fut.done():
                    fut.set_result((scores[lo : lo + len(qs), :kk], rows[lo : lo + len(qs), :kk]))
                lo += len(qs)

    async def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Cache first; the misses go through the batcher (or one at a time without it)."""
        n = len(queries)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        rows = np.full((n, k), -1, dtype=np.int64)
        misses: list[int] = []
        if self.s.cache_size > 0:
            with self.cache_lock:
                for i, q in enumerate(queries):
                    hit = self.cache.get((q, k))
                    if hit is None:
                        misses.append(i)
                    else:
                        self.cache.move_to_end((q, k))
                        scores[i], rows[i] = hit
            self.metrics.cache_hits += n - len(misses)
            self.metrics.cache_misses += len(misses)
        else:
            misses = list(range(n))
        if misses:
            miss_q = [queries[i] for i in misses]
            if self.s.batching:
                fut = asyncio.get_running_loop().create_future()
                assert self.queue is not None, "batching servers start their queue at startup"
                await self.queue.put((miss_q, k, fut))
                s, r = await fut
            else:
                async with self.serial:  # Search-R1's behaviour: one request at a time
                    s, r = await asyncio.get_running_loop().run_in_executor(self.executor, self.search_now, miss_q, k)
            scores[misses], rows[misses] = s, r
            if self.s.cache_size > 0:
                with self.cache_lock:
                    for j, i in enumerate(misses):
                        self.cache[(queries[i], k)] = (s[j].copy(), r[j].copy())
                    while len(self.cache) > self.s.cache_size:
                        self.cache.popitem(last=False)
        return scores, rows


def create_app(
    index_dir: Path,
    settings: Settings,
    device: str = "cpu",
    fp16: bool = False,
    ef_search: int | None = None,
    ready_file: Path | None = None,
    url: str = "",
    encoder_device: str | None = None,
    packed: bool = True,
):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from retriever_server.indexes import open_index

    manifest, store, index = open_index(
        index_dir, device=device, fp16=fp16, ef_search=ef_search, encoder_device=encoder_device, packed=packed
    )
    retriever = Retriever(index, store, settings)
    started = time.time()

    @asynccontextmanager
    async def lifespan(app):
        await retriever.start()
        if ready_file is not None:
            tmp = Path(str(ready_file) + ".tmp")
            tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
            os.replace(tmp, ready_file)
        yield
        retriever.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="agent-rl retriever",
        description="Search-R1 compatible retrieval over a FAISS or BM25 index.",
        lifespan=lifespan,
    )
    app.state.retriever = retriever

    def error(status: int, message: str, close: bool = False) -> JSONResponse:
        retriever.metrics.requests[status] = retriever.metrics.requests.get(status, 0) + 1
        return JSONResponse(
            status_code=status, content={"detail": message}, headers={"connection": "close"} if close else None
        )

    async def drain(receive, already: int, more: bool) -> bool:
        """Read and discard the rest of an over-limit body (up to --max-drain-bytes), so a client
        that sends its whole body before reading (urllib, requests) receives the 413 instead of a
        connection reset. False when the client left or the body passed the drain cap."""
        size = already
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > settings.max_drain_bytes:
                return False
        return True

    class Guard:
        """API key and body size, checked before FastAPI reads the request. A plain ASGI
        middleware: Starlette's `@app.middleware("http")` runs every request through an extra task
        and stream, about a third of this server's per-request CPU on a cache hit. A body is read
        here (so a chunked body with no Content-Length is bounded too) and replayed to the app."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            headers = dict(scope["headers"])
            if settings.api_key and scope["path"] == "/retrieve":
                if headers.get(b"authorization", b"") != f"Bearer {settings.api_key}".encode():
                    return await error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")(
                        scope, receive, send
                    )
            if scope["method"] != "POST":
                return await self.app(scope, receive, send)
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > settings.max_body_bytes:
                message = (
                    f"request body of {length.decode()} bytes exceeds the limit of {settings.max_body_bytes} bytes "
                    "(--max-body-bytes)"
                )
                if int(length) <= settings.max_drain_bytes:
                    await drain(receive, 0, True)
                return await error(413, message, close=True)(scope, receive, send)
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > settings.max_body_bytes:
                    await drain(receive, size, more)
                    return await error(
                        413,
                        f"request body exceeds the limit of {settings.max_body_bytes} bytes (--max-body-bytes)",
                        close=True,
                    )(scope, receive, send)
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replayed():
                return replay.pop() if replay else await receive()

            return await self.app(scope, replayed, send)

    app.add_middleware(Guard)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI answers 400 when the body is not decodable JSON at all (invalid UTF-8, nesting
        # past the recursion limit); the contract says malformed JSON is a 422.
        if exc.status_code == 400 and request.url.path == "/retrieve":
            return error(422, f"malformed request body: {exc.detail} (send UTF-8 JSON)")
        retriever.metrics.requests[exc.status_code] = retriever.metrics.requests.get(exc.status_code, 0) + 1
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # One error shape for every 4xx (ErrorResponse): the detail is a sentence naming the field.
        parts = [
            f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body') or 'body'}: {e.get('msg', '')} "
            f"({e.get('type', '')})"
            for e in exc.errors()
        ]
        return error(422, "invalid request: " + "; ".join(parts))

    class ErrorResponse(BaseModel):
        """Every 4xx and 5xx answer: one sentence naming the field or the limit (and its flag)."""

        detail: str

    errors: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": text}
        for status, text in (
            (401, "missing or wrong API key"),
            (413, "too many queries, a query too long, or a body over --max-body-bytes"),
            (422, "malformed JSON, a wrong type, or topk out of range"),
            (503, "the index failed"),
        )
    }

    @app.post("/retrieve", response_model=RetrieveResponse, responses=errors)
    async def retrieve(req: RetrieveRequest):
        start = time.perf_counter()
        k = settings.topk if req.topk is None else int(req.topk)  # integral: the validator refused 2.5
        if k < 1:
            return error(422, f"topk must be >= 1, got {k}")
        if k > settings.max_topk:
            return error(422, f"topk {k} exceeds the limit of {settings.max_topk} (--max-topk)")
        if len(req.queries) > settings.max_queries:
            return error(
                413,
                f"{len(req.queries)} queries exceed the limit of {settings.max_queries} per request (--max-queries)",
            )
        for i, q in enumerate(req.queries):
            if len(q) > settings.max_query_chars:
                return error(
                    413,
                    f"query {i} has {len(q)} characters, over the limit of {settings.max_query_chars} "
                    "(--max-query-chars)",
                )
            # a lone surrogate ("\ud800") is valid JSON but breaks the tokenizer and its whole batch
            try:
                q.encode("utf-8")
            except UnicodeEncodeError as err:
                return error(422, f"query {i} is not valid Unicode text: {err.reason} at character {err.start}")
        if not req.queries:
            retriever.metrics.requests[200] = retriever.metrics.requests.get(200, 0) + 1
            return {"result": []}
        queries = [normalize_query(q) for q in req.queries]
        if settings.delay_ms > 0:
            await asyncio.sleep(settings.delay_ms / 1000.0)
        try:
            scores, rows = await retriever.search(queries, k)
        except Exception as err:  # the index itself failed: say so, stay up
            return error(503, f"search failed: {type(err).__name__}: {err}")
        docs = store.get(rows)
        result, pos = [], 0
        for i in range(len(queries)):
            items = []
            for j in range(k):
                if rows[i, j] < 0:
                    continue
                doc = docs[pos]
                pos += 1
                items.append({"document": doc, "score": float(scores[i, j])} if req.return_scores else doc)
            result.append(items)
        retriever.metrics.queries += len(queries)
        retriever.metrics.requests[200] = retriever.metrics.requests.get(200, 0) + 1
        retriever.metrics.observe_latency(time.perf_counter() - start)
        return JSONResponse({"result": result})  # already plain JSON types: skips FastAPI's jsonable_encoder walk

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "kind": manifest["kind"],
            "count": manifest["count"],
            "encoder": manifest.get("encoder"),
            "uptime_s": round(time.time() - started, 1),
            "limits": {
                "max_queries": settings.max_queries,
                "max_query_chars": settings.max_query_chars,
                "max_topk": settings.max_topk,
                "default_topk": settings.topk,
                "max_body_bytes": settings.max_body_bytes,
            },
        }

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text format 0.0.4",
            }
        },
    )
    async def metrics():
        return PlainTextResponse(retriever.metrics.render(), media_type="text/plain; version=0.0.4")

    def openapi() -> dict:
        """FastAPI's document plus the limits this server enforces, so schema-driven clients and
        fuzzers generate only requests it can accept (the numbers /health reports too)."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            props = doc["components"]["schemas"]["RetrieveRequest"]["properties"]
            props["queries"]["maxItems"] = settings.max_queries
            props["queries"]["items"]["maxLength"] = settings.max_query_chars
            props["topk"] = {
                "anyOf": [{"type": "integer", "minimum": 1, "maximum": settings.max_topk}, {"type": "null"}],
                "title": "Topk",
                "description": f"documents per query (default {settings.topk})",
            }
            doc["components"]["schemas"].pop("HTTPValidationError", None)
            doc["components"]["schemas"].pop("ValidationError", None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="retriever-server", description="Serve an index built by retriever-build with Search-R1's /retrieve API."
    )
    p.add_argument("--index", required=True, help="index directory written by retriever-build")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = an ephemeral port)")
    p.add_argument("--topk", type=int, default=3, help="documents per query when a request gives no topk")
    p.add_argument("--max-topk", type=int, default=100)
    p.add_argument("--max-queries", type=int, default=256, help="most queries in one request")
    p.add_argument("--max-query-chars", type=int, default=2048)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1_000_000,
        help="largest request body; a larger one gets 413 after its body is read and discarded, "
        "up to --max-drain-bytes",
    )
    p.add_argument(
        "--max-drain-bytes",
        type=int,
        default=64_000_000,
        help="an over-limit body up to this size is read to the end before the 413 (so clients that send "
        "the whole body first see the answer); past it the connection is closed",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("RETRIEVER_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or env RETRIEVER_API_KEY)",
    )
    p.add_argument("--max-batch", type=int, default=64, help="most queries coalesced into one encode + search")
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=20.0,
        help="the most a batch waits for more requests; it waits only while it holds fewer requests "
        "than the previous batch",
    )
    p.add_argument("--no-batching", action="store_true", help="one request at a time (Search-R1's behaviour)")
    p.add_argument("--cache-size", type=int, default=10_000, help="LRU entries keyed by (query, topk)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu, or cuda to serve a flat index on the GPU(s)")
    p.add_argument(
        "--encoder-device",
        help="device of the query encoder (default: cuda with --device cuda, else cpu); "
        "an HNSW index on CPU can take a GPU encoder",
    )
    p.add_argument("--fp16", action="store_true", help="fp16 vectors and encoder on the GPU")
    p.add_argument(
        "--padded-encoder",
        action="store_true",
        help="encode with transformers' padded forward instead of the packed one (BERT-family encoders on CPU)",
    )
    p.add_argument("--ef-search", type=int, help="HNSW efSearch (default: the manifest's)")
    p.add_argument("--threads", type=int, default=0, help="torch/faiss threads (0 = all cores)")
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="hold every /retrieve answer this long: emulates a remote or loaded retriever (benchmarks)",
    )
    p.add_argument("--ready-file", help="write {url, pid} here once listening")
    a = p.parse_args(argv)
    import torch
    import uvicorn

    if a.threads:
        torch.set_num_threads(a.threads)
    settings = Settings(
        a.topk,
        a.max_topk,
        a.max_queries,
        a.max_query_chars,
        a.max_body_bytes,
        not a.no_batching,
        a.max_batch,
        a.batch_window_ms,
        0 if a.no_cache else a.cache_size,
        a.api_key,
        a.max_drain_bytes,
        a.delay_ms,
    )
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
    port = sock.getsockname()[1]
    url = f"http://{a.host}:{port}"
    try:
        app = create_app(
            Path(a.index),
            settings,
            a.device,
            a.fp16,
            a.ef_search,
            Path(a.ready_file) if a.ready_file else None,
            url,
            a.encoder_device,
            not a.padded_encoder,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"retriever-server: error: {err}", file=sys.stderr)
        return 2
    print(f"retriever-server listening on {url}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
