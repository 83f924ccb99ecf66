"""The retriever client under real faults: a loopback HTTP proxy in front of a real server answers
503, 429 with Retry-After, hangs past the client's timeout, or returns a malformed body. Each ends
as the client's docstring says (a counted retry, the server's wait honoured, RetrievalError at
last), and in a rollout a search that finally fails becomes the 'retrieval failed' observation."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from agent_fixtures import ScriptedEngine

from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.loop import AgentLoop, PromptItem
from retriever_server.client import RetrievalError, RetrieverClient, retry_after_s

BUDGET = TokenBudget(
    max_turns=3, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=400, max_total_tokens=64 + 3 * 424 + 24
)


class FaultProxy:
    """Forwards to `upstream`, except that each POST /retrieve first takes the next fault of
    `faults` (then forwards once they are used up): ("status", code[, retry_after]) answers that
    status, ("hang", s) holds the request s seconds and then forwards, ("malformed",) answers 200
    with one result list too few. GET (/health) is always forwarded."""

    def __init__(self, upstream: str):
        self.upstream, self.faults, self.posts = upstream.rstrip("/"), [], 0
        self.released = threading.Event()  # set at exit: hung handlers return at once
        self.http = httpx.Client(timeout=60)

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self, method: str, body: bytes = b"") -> tuple[int, bytes]:
                resp = proxy.http.request(
                    method, proxy.upstream + self.path, content=body, headers={"Content-Type": "application/json"}
                )
                return resp.status_code, resp.content

            def do_GET(self) -> None:
                self._send(*self._forward("GET"))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                proxy.posts += 1
                fault = proxy.faults.pop(0) if proxy.faults else ("pass",)
                try:
                    if fault[0] == "status":
                        headers = {"Retry-After": fault[2]} if len(fault) > 2 else {}
                        self._send(fault[1], json.dumps({"detail": "injected"}).encode(), headers)
                        return
                    if fault[0] == "hang":
                        proxy.released.wait(fault[1])
                    code, content = self._forward("POST", body)
                    if fault[0] == "malformed":
                        payload = json.loads(content)
                        content = json.dumps({"result": payload["result"][:-1]}).encode()
                    self._send(code, content)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a hung request

        return Handler


@contextmanager
def fault_proxy(upstream: str) -> Iterator[tuple[FaultProxy, str]]:
    proxy = FaultProxy(upstream)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), proxy.handler())
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        proxy.released.set()
        server.shutdown()
        server.server_close()
        proxy.http.close()


@pytest.fixture
def proxied(server):
    _, url = server
    with fault_proxy(url) as (proxy, proxy_url):
        yield proxy, proxy_url, url


QUERIES = ["Who directed Inception?", "Which river flows through Paris?"]


def test_a_runaway_query_is_clipped_instead_of_failing_its_batch(server):
    """A query over the server's --max-query-chars (2048) beside a normal one: the client cuts it to 2048
    characters, so both are answered (the long one as its first 2048 characters would be) and the cut is
    counted; sent whole (max_query_chars=0) the server's 413 fails the whole batch, no retry."""
    _, url = server
    runaway = "Which river flows through Paris? " + "and " * 1000
    client = RetrieverClient(url, topk=2)
    docs = client.retrieve([QUERIES[0], runaway])
    assert docs == RetrieverClient(url, topk=2).retrieve([QUERIES[0], runaway[:2048]])
    assert client.stats["clipped"] == 1 and client.stats["errors"] == 0
    whole = RetrieverClient(url, topk=2, max_query_chars=0)
    with pytest.raises(RetrievalError, match="413"):
        whole.retrieve([QUERIES[0], runaway])
    assert whole.stats["retries"] == 0
    with pytest.raises(ValueError, match="max_query_chars"):
        RetrieverClient(url, max_query_chars=-1)


def test_503_then_200_is_one_counted_retry(proxied):
    """A 503 is retried after the backoff; the answer is the server's, and the retry is counted."""
    proxy, url, upstream = proxied
    proxy.faults = [("status", 503)]
    client = RetrieverClient(url, topk=2, backoff_s=0.01)
    docs = client.retrieve(QUERIES)
    assert docs == RetrieverClient(upstream, topk=2).retrieve(QUERIES)
    assert proxy.posts == 2 and client.stats["retries"] == 1 and client.stats["errors"] == 0


def test_429_retry_after_is_honoured(proxied):
    """A 429 with `Retry-After: 1` waits the second the server asked for, not the 10 ms backoff; a
    Retry-After past max_retry_after_s waits only the cap."""
    proxy, url, _ = proxied
    proxy.faults = [("status", 429, "1")]
    client = RetrieverClient(url, topk=2, backoff_s=0.01)
    start = time.perf_counter()
    assert len(client.retrieve(QUERIES)) == 2
    assert time.perf_counter() - start >= 1.0 and client.stats["retries"] == 1
    proxy.faults = [("status", 429, "3600")]
    capped = RetrieverClient(url, topk=2, backoff_s=0.01, max_retry_after_s=0.2)
    start = time.perf_counter()
    assert len(capped.retrieve(QUERIES)) == 2
    assert 0.2 <= time.perf_counter() - start < 5 and capped.stats["retries"] == 1


def test_retry_after_forms():
    """Delta-seconds and an HTTP date are read; absent or unreadable is 0; both are capped."""
    assert retry_after_s("2", 30) == 2.0 and retry_after_s("120", 30) == 30.0
    assert retry_after_s(None, 30) == 0.0 and retry_after_s("soon", 30) == 0.0 and retry_after_s("-5", 30) == 0.0
    from email.utils import formatdate

    assert 3 <= retry_after_s(formatdate(time.time() + 5, usegmt=True), 30) <= 5
    assert retry_after_s(formatdate(time.time() - 60, usegmt=True), 30) == 0.0


def test_a_hang_past_the_timeout_is_retried_then_fails(proxied):
    """A request held past the client's timeout is abandoned and retried (counted); held on every
    attempt, the call ends in RetrievalError naming the timeout after max_retries + 1 attempts."""
    proxy, url, _ = proxied
    proxy.faults = [("hang", 5)]
    client = RetrieverClient(url, topk=2, timeout_s=0.3, backoff_s=0.01)
    assert len(client.retrieve(QUERIES)) == 2 and client.stats["retries"] == 1
    proxy.faults = [("hang", 5)] * 2
    proxy.posts = 0
    failing = RetrieverClient(url, topk=2, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.perf_counter()
    with pytest.raises(RetrievalError, match="after 2 attempts: ReadTimeout"):
        failing.retrieve(QUERIES)
    assert time.perf_counter() - start < 3 and proxy.posts == 2 and failing.stats["errors"] == 1


def test_a_malformed_body_is_retried_then_fails(proxied):
    """An answer with the wrong number of result lists is not passed on: it is retried like a 5xx,
    and ends in RetrievalError saying what was wrong."""
    proxy, url, _ = proxied
    proxy.faults = [("malformed",)]
    client = RetrieverClient(url, topk=2, backoff_s=0.01)
    assert [len(d) for d in client.retrieve(QUERIES)] == [2, 2] and client.stats["retries"] == 1
    proxy.faults = [("malformed",)] * 3
    failing = RetrieverClient(url, topk=2, max_retries=2, backoff_s=0.01)
    with pytest.raises(RetrievalError, match="sent 2 queries, got 1 result lists"):
        failing.retrieve(QUERIES)
    assert failing.stats["retries"] == 2 and failing.stats["errors"] == 1


def _items(tokenizer):
    ids = tokenizer("Question: Who directed Inception?\n", add_special_tokens=False)["input_ids"]
    return [PromptItem(f"toy-{i}", "toy", ids, ["Christopher Nolan"]) for i in range(2)]


def _script(ctx: str) -> str:
    return "<answer> Nolan </answer>" if "<information>" in ctx else "<search> Inception </search>"


@pytest.mark.parametrize(
    "faults, fails",
    [
        ([("status", 503)], False),
        ([("status", 429, "1")], False),
        ([("hang", 5)], False),
        ([("malformed",)], False),
        ([("status", 503)] * 2, True),
        ([("hang", 5)] * 2, True),
        ([("malformed",)] * 2, True),
    ],
    ids=["503-once", "429-once", "hang-once", "malformed-once", "503", "hang", "malformed"],
)
def test_rollout_under_faults(tokenizer, proxied, faults, fails):
    """A fault the retry absorbs leaves the rollout as it would be without it; one that outlasts
    the retries gives every trajectory the 'retrieval failed' observation and a counted error."""
    proxy, url, upstream = proxied
    proxy.faults = list(faults)
    client = RetrieverClient(url, topk=2, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    loop = AgentLoop(ScriptedEngine(tokenizer, _script), tokenizer, client, BUDGET, topk=2)
    trajs = loop.run(_items(tokenizer), group_size=1)
    if not fails:
        clean = AgentLoop(
            ScriptedEngine(tokenizer, _script), tokenizer, RetrieverClient(upstream, topk=2), BUDGET, topk=2
        ).run(_items(tokenizer), group_size=1)
        assert [t.response_ids for t in trajs] == [t.response_ids for t in clean]
        assert all(t.turns[0].retriever_error is None for t in trajs) and client.stats["retries"] == 1
        return
    for t in trajs:
        assert t.turns[0].retriever_error is not None and "Retrieval failed" in t.response_text
    assert loop.counters["retriever/errors"] == 2 and client.stats["errors"] == 1
