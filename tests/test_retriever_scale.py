"""Index memory and compressed kinds: the plan (`retriever-build --plan`) against a built index's files
and a serving process's RSS; `hnsw_sq8` and `ivf_pq` built from the HotpotQA fixture index's own
vectors, served, with their search settings in /health and a recall@10 floor against flat; the
refusal of an index too big for the machine (simulated with env RETRIEVER_MEM_AVAILABLE).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
from agent_fixtures import start_server, start_servers

QUESTIONS = Path(__file__).resolve().parent / "fixtures" / "hotpotqa100" / "questions.jsonl"
ROOT = Path(__file__).resolve().parents[1]


def _questions() -> list[str]:
    return [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]


def _derive(flat_dir: Path, out: Path, kind: str, factory: str | None = None) -> Path:
    """An index directory of `kind` over the flat index's own vectors, as retriever-build writes it
    (the same `faiss_index`), so the test encodes the corpus once."""
    import faiss

    from retriever_server.build import faiss_index
    from retriever_server.indexes import flat_vectors
    from retriever_server.plan import factory_string

    out.mkdir(parents=True)
    for path in [flat_dir / "docs.arrow", *flat_dir.glob("encoder.onnx*")]:
        shutil.copy(path, out / path.name)
    flat = faiss.read_index(str(flat_dir / "index.faiss"))
    vectors = flat_vectors(flat)  # a view of flat's storage: flat must outlive it
    spec = factory_string(kind, vectors.shape[1], len(vectors), factory=factory)
    index, build = faiss_index(spec, vectors)
    faiss.write_index(index, str(out / "index.faiss"))
    if "ef_construction" in build:
        build["ef_search"] = 128
    if "nlist" in build:
        build["nprobe"] = 64
    manifest = json.loads((flat_dir / "manifest.json").read_text())
    manifest.update(kind=kind, build={**build, "factory": spec})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


@pytest.fixture(scope="module")
def kinds(hotpot_index_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("kinds")
    dirs = {kind: _derive(hotpot_index_dir, work / kind, kind) for kind in ("hnsw_sq8", "ivf_pq")}
    dirs["factory"] = _derive(hotpot_index_dir, work / "factory", "factory", "IVF4,SQ8")
    return dirs


def test_plan_cli_counts_the_corpus_before_building(hotpot_index_dir, capsys):
    """`retriever-build --plan --json` counts the corpus's lines, reads the encoder's dimension, and
    plans the flat index's bytes as 4 x dim a passage, writing nothing."""
    from retriever_server.build import main

    corpus = Path(json.loads((hotpot_index_dir / "manifest.json").read_text())["corpus"])
    assert main(["--corpus", str(corpus), "--kind", "flat", "--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["count"] == 200 and plan["dim"] == 384
    assert plan["index_bytes"] == 200 * 384 * 4
    assert plan["server_rss_max_bytes"] == plan["server_rss_start_bytes"] + plan["store_bytes"]


@pytest.mark.parametrize("kind", ["flat", "hnsw", "hnsw_sq8", "ivf_pq"])
def test_plan_matches_the_built_index_file(kind, tmp_path):
    """The planned index bytes of each kind are within 3% of the file FAISS writes (3,000 random
    unit vectors of 128 dims, trained and added as retriever-build does)."""
    import faiss

    from retriever_server.build import faiss_index
    from retriever_server.plan import factory_string, plan_index

    n, d = 3000, 128
    x = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
    faiss.normalize_L2(x)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # k-means on a loaded machine: OpenMP threads spin against each other
    try:
        index, _ = faiss_index(factory_string(kind, d, n, hnsw_m=16), x, ef_construction=16)
    finally:
        faiss.omp_set_num_threads(threads)
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    planned = plan_index(n, d, kind, 0, hnsw_m=16).index_bytes
    assert abs(planned / (tmp_path / "index.faiss").stat().st_size - 1) < 0.03


def _scaled(flat_dir: Path, out: Path, count: int) -> Path:
    """A flat index directory of `count` passages, as retriever-build writes it: the fixture's passages
    repeated under new ids (docs.arrow of real text) and random unit vectors of the encoder's width (the
    plan reads the count and the width, not the vectors' values)."""
    import faiss

    from retriever_server.store import file_sha256, write_store

    manifest = json.loads((flat_dir / "manifest.json").read_text())
    texts = [json.loads(line)["contents"] for line in Path(manifest["corpus"]).read_text().splitlines()]
    out.mkdir(parents=True)
    corpus = out.parent / "corpus.jsonl"
    with corpus.open("w") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"p{i}", "contents": texts[i % len(texts)]}) + "\n")
    write_store(corpus, out)
    for path in flat_dir.glob("encoder.onnx*"):
        shutil.copy(path, out / path.name)
    x = np.random.default_rng(0).standard_normal((count, manifest["dim"]), dtype=np.float32)
    faiss.normalize_L2(x)
    index = faiss.IndexFlatIP(manifest["dim"])
    index.add(x)
    faiss.write_index(index, str(out / "index.faiss"))
    manifest.update(count=count, corpus=str(corpus), corpus_sha256=file_sha256(corpus))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def test_plan_matches_a_served_process(hotpot_index_dir, tmp_path):
    """The planned store is the docs.arrow file within 2%; beside the fixture's server, a server of 200,000
    passages (a 293 MiB flat index) holds the planned index's bytes more in anonymous memory, within 3%, and,
    once both have answered a batch of 32 queries, its VmRSS lies between its planned start, less 15%, and its
    planned maximum (start + the mapped store), plus 15%. The absolute RSS of the fixture's small server is
    not checked alone: its mapped pages (shared libraries, the encoder's data file, the store) depend on how
    much of a file the kernel maps at a fault and its heap on the allocator, 268-391 MiB on machines that
    ran this suite against a plan of 315 (bench/RESULTS.md)."""
    from agent_rl.runtime.memory import proc_status_bytes
    from retriever_server.plan import plan_served, store_bytes

    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    assert abs(store_bytes(Path(manifest["corpus"])) / (hotpot_index_dir / "docs.arrow").stat().st_size - 1) < 0.02
    big_dir = _scaled(hotpot_index_dir, tmp_path / "big" / "index", 200_000)
    small = plan_served(hotpot_index_dir, manifest)
    big = plan_served(big_dir, json.loads((big_dir / "manifest.json").read_text()))
    batch = {"queries": _questions()[:32], "topk": 10}
    with start_servers({"small": (hotpot_index_dir,), "big": (big_dir,)}) as servers:
        rss = {}
        for name, (proc, url) in servers.items():
            requests.post(f"{url}/retrieve", json=batch, timeout=60).raise_for_status()
            rss[name] = {key: proc_status_bytes(key, proc.pid) for key in ("VmRSS", "RssAnon")}
    grown = rss["big"]["RssAnon"] - rss["small"]["RssAnon"]
    assert abs(grown / (big.index_bytes - small.index_bytes) - 1) < 0.03, (grown, big.index_bytes, small.index_bytes)
    measured = rss["big"]["VmRSS"]
    assert 0.85 * big.server_rss_start_bytes <= measured <= 1.15 * big.server_rss_max_bytes, (big, rss)


def test_compressed_kinds_serve_with_settings_and_recall(hotpot_index_dir, kinds):
    """hnsw_sq8, ivf_pq and a factory string ('IVF4,SQ8', in a real server with --nprobe and --mmap)
    show their settings in /health and reach a recall@10 floor against flat over the 100 questions:
    0.8 for the SQ8 kinds, 0.3 for ivf_pq, whose PQ codebooks here learn from 200 vectors (its
    recall on 9,648 real passages is in bench/RESULTS.md)."""
    from fastapi.testclient import TestClient

    from retriever_server.app import create_app

    qs = _questions()

    def recall(res: list[list[dict]]) -> float:
        got = [[d["id"] for d in row] for row in res]
        return float(np.mean([len(set(g) & set(f)) / 10 for g, f in zip(got, flat, strict=True)]))

    def served(index_dir: Path, **options) -> tuple[dict, list[list[dict]]]:
        with TestClient(create_app(index_dir, **options)) as c:
            return c.get("/health").json(), c.post("/retrieve", json={"queries": qs, "topk": 10}).json()["result"]

    flat = [[d["id"] for d in row] for row in served(hotpot_index_dir)[1]]
    health, res = served(kinds["hnsw_sq8"], ef_search=64)
    assert (health["kind"], health["ef_search"], health["factory"]) == ("hnsw_sq8", 64, "HNSW32,SQ8")
    assert recall(res) >= 0.8
    health, res = served(kinds["ivf_pq"])
    assert (health["kind"], health["nprobe"], health["ef_search"]) == ("ivf_pq", 4, None)  # nprobe <= nlist
    assert recall(res) >= 0.3
    with start_server(kinds["factory"], "--nprobe", "3", "--mmap") as (_, url):
        health = requests.get(f"{url}/health", timeout=30).json()
        assert (health["kind"], health["factory"], health["nprobe"], health["mmap"]) == ("factory", "IVF4,SQ8", 3, True)
        res = requests.post(f"{url}/retrieve", json={"queries": qs, "topk": 10}, timeout=120).json()["result"]
    assert recall(res) >= 0.8


def test_server_refuses_an_index_too_big_for_the_machine(hotpot_index_dir, kinds):
    """With RETRIEVER_MEM_AVAILABLE below the flat index's planned RSS but above hnsw_sq8's, the
    server exits 2 at start, naming the figure and hnsw_sq8 as a kind that fits."""
    from retriever_server.plan import plan_served

    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    flat = plan_served(hotpot_index_dir, manifest)
    sq8 = plan_served(kinds["hnsw_sq8"], json.loads((kinds["hnsw_sq8"] / "manifest.json").read_text()))
    assert sq8.server_rss_start_bytes < flat.server_rss_start_bytes
    env = os.environ | {"RETRIEVER_MEM_AVAILABLE": str(sq8.server_rss_start_bytes + 1)}
    run = subprocess.run(
        [sys.executable, "-m", "retriever_server.app", "--index", str(hotpot_index_dir), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "needs about" in run.stderr and "hnsw_sq8" in run.stderr and "RETRIEVER_MEM_AVAILABLE" in run.stderr
