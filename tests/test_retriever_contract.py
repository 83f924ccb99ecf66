"""The retriever's HTTP contract as clients see it, against a real server on 127.0.0.1.

A schema-driven fuzzer (schemathesis, all checks) finds nothing the OpenAPI document does not
say: the limits (`topk` range, `maxItems`, `maxLength`) are in the document with the numbers the
server enforces, every 4xx has the one documented `{"detail": str}` shape, `/metrics` is text.
Clients that send a whole over-limit body before reading (urllib, requests) get the 413 and its
message every time, and the server goes on answering.
"""

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests
from agent_fixtures import FIXTURES, start_server


@pytest.fixture(scope="module")
def server(hotpot_index_dir):
    with start_server(hotpot_index_dir, "--max-queries", "64", "--max-topk", "20", "--max-query-chars", "512") as (
        _,
        url,
    ):
        yield url


def test_openapi_states_the_enforced_limits_and_error_model(server):
    """The document's limits equal /health's, the 200 model is RetrieveResponse, the 4xx model is
    ErrorResponse, /metrics is text."""
    doc = requests.get(f"{server}/openapi.json", timeout=30).json()
    limits = requests.get(f"{server}/health", timeout=30).json()["limits"]
    props = doc["components"]["schemas"]["RetrieveRequest"]["properties"]
    assert props["queries"]["maxItems"] == limits["max_queries"] == 64
    assert props["queries"]["items"]["maxLength"] == limits["max_query_chars"] == 512
    topk = next(s for s in props["topk"]["anyOf"] if s.get("type") == "integer")
    assert topk["minimum"] == 1 and topk["maximum"] == limits["max_topk"] == 20
    responses = doc["paths"]["/retrieve"]["post"]["responses"]
    assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/RetrieveResponse")
    for status in ("401", "413", "422", "503"):
        assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in json.dumps(doc)
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    bad = requests.post(f"{server}/retrieve", json={"queries": "not a list"}, timeout=30)
    assert bad.status_code == 422 and isinstance(bad.json()["detail"], str) and "queries" in bad.json()["detail"]


def test_schemathesis_finds_no_contract_fault(server, tmp_path):
    """schemathesis with all checks and a bounded number of examples: no failure."""
    exe = shutil.which("schemathesis") or str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "schemathesis")
    config = FIXTURES / "schemathesis" / "schemathesis.toml"
    cmd = [
        exe,
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{server}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "60",
        "--workers",
        "1",
        "--seed",
        "1",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "generated" in res.stdout


def _oversized() -> bytes:
    return json.dumps({"queries": ["x"] * 1_000_000}).encode()  # ~5 MB, over the 1 MB default


def test_over_limit_body_gets_413_with_urllib_and_requests(server):
    """20 tries each with urllib and requests (both send the whole body before reading): every one
    gets the 413 naming --max-body-bytes, with Connection: close; then a normal request works."""
    body = _oversized()
    for _ in range(20):
        req = urllib.request.Request(
            f"{server}/retrieve", data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 413 and "--max-body-bytes" in err.value.read().decode()
        assert err.value.headers.get("connection", "").lower() == "close"
    for _ in range(20):
        resp = requests.post(f"{server}/retrieve", data=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert resp.status_code == 413 and "--max-body-bytes" in resp.json()["detail"]
    ok = requests.post(
        f"{server}/retrieve", json={"queries": ["Who founded the Demon Dice game?"], "topk": 2}, timeout=60
    )
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 2
