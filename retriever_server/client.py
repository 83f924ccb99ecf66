"""The one HTTP client for Search-R1's `/retrieve` API (ours, Search-R1's, verl's).

The trainer's rollouts and `retriever-eval` both use it. One batched request per call (split
into requests of at most `max_queries_per_request`, under the server's per-request limit: ours
refuses more than 256 with a 413, the pieces sent concurrently), a pooled connection, a timeout,
retries with exponential backoff on connection errors, 429 and 5xx; a 4xx is not retried. The
answer is read through `retriever_server.schema`. When the server stays down the caller gets a
`RetrievalError`: the rollout turns it into an observation saying retrieval failed, the
evaluation counts the queries as failed; neither crashes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from retriever_server.schema import parse_response


def base_url(url: str) -> str:
    """The server's base URL from either it or its full `/retrieve` endpoint."""
    url = url.rstrip("/")
    return url.removesuffix("/retrieve")


class RetrievalError(RuntimeError):
    """The retriever did not answer after all retries."""


class RetrieverClient:
    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        api_key: str | None = None,
        max_queries_per_request: int = 128,
        max_connections: int = 8,
    ):
        if max_queries_per_request < 1:
            raise ValueError(f"max_queries_per_request must be >= 1, got {max_queries_per_request}")
        self.url = base_url(url)
        self.topk = topk
        self.max_queries_per_request = max_queries_per_request
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=max_connections)
        )
        self.stats = {"requests": 0, "queries": 0, "errors": 0, "retries": 0, "latency_s": 0.0}
        self._lock = threading.Lock()  # split batches run in threads

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self.stats[key] += value

    @classmethod
    def from_config(cls, rc, url: str) -> RetrieverClient:
        """The client a `retriever:` config section describes, for the server at `url`."""
        return cls(url, rc.topk, rc.timeout_s, rc.max_retries, rc.backoff_s, rc.api_key, rc.max_queries_per_request)

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """Documents `{"id", "contents", "score"}` per query, in order (score None from a server
        that answers without scores). Raises RetrievalError at last."""
        chunks = [
            queries[lo : lo + self.max_queries_per_request]
            for lo in range(0, len(queries), self.max_queries_per_request)
        ]
        if len(chunks) <= 1:
            return self._retrieve_chunk(queries, topk) if queries else []
        # The chunks go out concurrently so the server can batch them together; order is kept.
        with ThreadPoolExecutor(max_workers=min(4, len(chunks))) as pool:
            results = list(pool.map(lambda c: self._retrieve_chunk(c, topk), chunks))
        return [docs for result in results for docs in result]

    def _retrieve_chunk(self, queries: list[str], topk: int | None) -> list[list[dict]]:
        payload = {"queries": queries, "topk": topk or self.topk, "return_scores": True}
        last_err: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count("retries", 1)
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            start = time.perf_counter()
            try:
                resp = self._http.post(f"{self.url}/retrieve", json=payload)
                if resp.status_code >= 500 or resp.status_code == 429:
                    raise httpx.HTTPStatusError(
                        f"HTTP {resp.status_code}: {resp.text[:200]}", request=resp.request, response=resp
                    )
                if resp.status_code >= 400:  # our own request is wrong: retrying will not help
                    self._count("errors", 1)
                    raise RetrievalError(f"retriever rejected the request: HTTP {resp.status_code}: {resp.text[:300]}")
                docs = parse_response(resp.json(), len(queries))
                self._count("requests", 1)
                self._count("queries", len(queries))
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
        try:
            self._http.post(f"{self.url}/retrieve", json={"queries": ["warm-up"], "topk": topk or self.topk})
        except httpx.HTTPError:
            pass

    def wait_healthy(self, max_wait_s: float, log=None) -> bool:
        """Poll GET /health with exponential backoff (0.5 s doubling, at most 10 s apart) until it
        answers 200 or `max_wait_s` has passed; returns whether the server is back."""
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
