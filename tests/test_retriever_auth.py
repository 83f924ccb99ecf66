"""The retriever's API key on every path to `/retrieve` and `/read`, with real parts: the app over the
HotpotQA fixture index served by uvicorn on 127.0.0.1, mounted at /search in another FastAPI app, and
behind a proxy's root path /search. The guard's fast path and FastAPI's routes each enforce the key
on their own, with one 401 answer; both read a repeated header the same way; an empty key is refused
at start-up instead of serving with none."""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import requests
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from retriever_server.app import KEYED_ROUTES, Guard, Settings, create_app, parse_args

API_KEY = "k3y-for-tests"
GOOD = [{"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"bearer {API_KEY}"}]  # the scheme is caseless
WRONG = [
    None,
    {"Authorization": "Bearer wrong"},
    {"Authorization": API_KEY},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": "Bearer"},
]
QUERY = {"queries": ["Who founded the Demon Dice game?"], "topk": 2}
# a JSON body the guard answers itself, and one it leaves to FastAPI's route
CONTENT_TYPES = ("application/json", "application/vnd.api+json")


@contextmanager
def serving(app: FastAPI, root_path: str = "") -> Iterator[str]:
    """`app` served by uvicorn (its lifespan run) in a thread, on an ephemeral 127.0.0.1 port; yields the URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, root_path=root_path))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def mounted(app: FastAPI) -> FastAPI:
    """`app` mounted at /search in another app whose lifespan enters `app`'s, as `create_app` says."""

    @asynccontextmanager
    async def lifespan(outer: FastAPI):
        async with app.router.lifespan_context(app):
            yield

    outer = FastAPI(lifespan=lifespan)
    outer.mount("/search", app)
    return outer


@pytest.fixture(scope="module", params=["mounted", "root_path"])
def prefixed(request, hotpot_index_dir):
    """A server with an API key reached under the prefix /search on a real uvicorn server: mounted
    at /search in another app, or served with uvicorn's root path /search (what a proxy that strips
    the prefix sets), so the client sends the bare path. Yields (base URL, the retriever app)."""
    app = create_app(hotpot_index_dir, Settings(api_key=API_KEY))
    if request.param == "mounted":
        with serving(mounted(app)) as url:
            yield f"{url}/search", app
    else:
        with serving(app, root_path="/search") as url:
            yield url, app


def _refused(resp) -> bool:
    """The one 401 (a requests or httpx response): the guard's body, naming the header to send, and
    the Bearer challenge."""
    return (
        resp.status_code == 401
        and resp.json() == {"detail": "missing or wrong API key: send 'Authorization: Bearer KEY'"}
        and resp.headers.get("www-authenticate") == "Bearer"
    )


def test_keyed_routes_refuse_a_missing_or_wrong_key_under_a_prefix(prefixed):
    """Under a mount and under a root path, /retrieve and /read answer 401 (the guard's body and
    `WWW-Authenticate: Bearer`) to no key, a wrong key, a prefix of the key, the bare key and another
    scheme, whichever content type the body has; the key answers 200 with documents, the batcher
    runs (the sub-app's lifespan was entered), and a malformed body is the 422 it is at the root."""
    base, app = prefixed
    assert app.state.retriever.batcher is not None
    for headers in GOOD:
        for ct in CONTENT_TYPES:
            got = requests.post(f"{base}/retrieve", json=QUERY, headers={**headers, "content-type": ct}, timeout=60)
            assert got.status_code == 200 and len(got.json()["result"][0]) == 2, got.text
    docs = got.json()["result"][0]
    read = requests.post(f"{base}/read", json={"ids": [d["id"] for d in docs]}, headers=GOOD[0], timeout=60)
    assert read.status_code == 200 and read.json()["result"] == docs
    for headers in WRONG:
        for ct in CONTENT_TYPES:
            sent = {**(headers or {}), "content-type": ct}
            assert _refused(requests.post(f"{base}/retrieve", json=QUERY, headers=sent, timeout=60)), headers
        assert _refused(requests.post(f"{base}/read", json={"ids": ["hp-1"]}, headers=headers, timeout=60)), headers
    bad = requests.post(
        f"{base}/retrieve",
        data=b'{"queries": ["\xff"]}',
        headers={**GOOD[0], "content-type": "application/json"},
        timeout=60,
    )
    assert bad.status_code == 422 and "malformed" in bad.json()["detail"], bad.text


def test_health_metrics_and_the_schema_stay_open_and_the_schema_states_the_key(prefixed):
    """Under either prefix /health, /metrics and /openapi.json answer 200 with no key, as at the
    root; the document lists the bearer scheme in components.securitySchemes and on /retrieve and
    /read only."""
    base, _ = prefixed
    assert requests.get(f"{base}/health", timeout=30).json()["status"] == "ok"
    assert requests.get(f"{base}/metrics", timeout=30).status_code == 200
    doc = requests.get(f"{base}/openapi.json", timeout=30).json()
    scheme = doc["components"]["securitySchemes"]["HTTPBearer"]
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer" and "--api-key" in scheme["description"]
    for path in KEYED_ROUTES:
        assert doc["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]
    for path in ("/health", "/metrics"):
        assert "security" not in doc["paths"][path]["get"]


def test_the_guard_and_the_routes_each_enforce_the_key_alone(hotpot_index_dir):
    """Mounted at /search: with the guard taken out, FastAPI's routes still refuse every wrong key
    with the guard's own 401 and serve the key; with the routes taken out, the guard refuses the
    same way and its fast path serves the key. Neither layer relies on the other."""
    routes_only = create_app(hotpot_index_dir, Settings(api_key=API_KEY))
    routes_only.user_middleware = [m for m in routes_only.user_middleware if m.cls is not Guard]
    guard_only = create_app(hotpot_index_dir, Settings(api_key=API_KEY))
    guard_only.router.routes = [r for r in guard_only.router.routes if getattr(r, "path", "") not in KEYED_ROUTES]
    with TestClient(mounted(routes_only)) as by_routes, TestClient(mounted(guard_only)) as by_guard:
        for headers in WRONG:
            for path, body in (("/search/retrieve", QUERY), ("/search/read", {"ids": ["hp-1"]})):
                assert _refused(by_routes.post(path, json=body, headers=headers)), (path, headers)
                assert _refused(by_guard.post(path, json=body, headers=headers)), (path, headers)
        for headers in GOOD:
            answers = [client.post("/search/retrieve", json=QUERY, headers=headers) for client in (by_routes, by_guard)]
            assert [a.status_code for a in answers] == [200, 200] and answers[0].content == answers[1].content
            assert by_routes.post("/search/read", json={"ids": ["hp-1"]}, headers=headers).status_code == 200
            assert by_guard.post("/search/read", json={"ids": ["hp-1"]}, headers=headers).status_code == 404


def test_a_repeated_content_type_gets_one_answer_from_the_guard_and_from_fastapi(hotpot_index_dir):
    """A /retrieve body sent with two Content-Type lines gets the same status and bytes from the
    app (whose guard may answer it) as from FastAPI's route alone: both read the first line, so
    text/plain first is FastAPI's 422 and application/json first is the 200 answer. The same
    holds for a repeated Authorization header: the first line is the one that counts."""
    keyed = Settings(api_key=API_KEY, cache_size=0)
    full = create_app(hotpot_index_dir, keyed)
    routes_only = create_app(hotpot_index_dir, keyed)
    routes_only.user_middleware = [m for m in routes_only.user_middleware if m.cls is not Guard]
    body = b'{"queries": ["Who founded the Demon Dice game?"], "topk": 2}'
    key, wrong = ("authorization", f"Bearer {API_KEY}"), ("authorization", "Bearer wrong")
    text, json_ = ("content-type", "text/plain"), ("content-type", "application/json")
    cases = {
        (key, text, json_): 422,
        (key, json_, text): 200,
        (key, wrong, json_): 200,
        (wrong, key, json_): 401,
    }
    with TestClient(full) as by_app, TestClient(routes_only) as by_routes:
        for headers, status in cases.items():
            answers = [client.post("/retrieve", content=body, headers=list(headers)) for client in (by_app, by_routes)]
            assert [a.status_code for a in answers] == [status, status], (headers, [a.text for a in answers])
            assert answers[0].content == answers[1].content, headers


def test_an_empty_or_unsendable_key_is_refused_at_start_up(monkeypatch, capsys):
    """An empty key (`--api-key ""`, or a blank RETRIEVER_API_KEY) is an error naming the flag, not a
    server with no key; so is one no client can send as a bearer token (spaces at its ends, a control
    character, non-ASCII). The message never repeats the key."""
    monkeypatch.delenv("RETRIEVER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key .* is empty"):
        Settings(api_key="")
    for key in (" hunter2", "hunter2 ", "hunter2\n", "hunter\t2", "hünter2"):
        with pytest.raises(ValueError, match="printable ASCII") as err:
            Settings(api_key=key)
        assert "hunter" not in str(err.value) and "hünter" not in str(err.value)
    assert Settings(api_key="hunter2").api_key == "hunter2"
    for argv, env in ((["--api-key", ""], None), ([], "")):
        if env is not None:
            monkeypatch.setenv("RETRIEVER_API_KEY", env)
        with pytest.raises(SystemExit) as exited:
            parse_args(["--index", "x", *argv])
        assert exited.value.code == 2 and "--api-key" in capsys.readouterr().err
