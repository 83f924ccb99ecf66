"""`retriever-eval` against a real retriever-server on 127.0.0.1 over a flat MiniLM index of
200 HotpotQA fixture paragraphs, plus the answer-matching and metric logic on hand-made cases."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_fixtures import free_port, start_servers

from agent_rl.bootstrap.prepare import stop_process
from retriever_server.answers import contains_answer, normalize_answer
from retriever_server.evaluate import Passage, Question, load_questions, main, score_question

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "tests" / "fixtures" / "hotpotqa100" / "questions.jsonl"
TOPKS = (1, 3, 5, 10)
API_KEY = "test-key"


@pytest.fixture(scope="module")
def servers(hotpot_index_dir):  # noqa: F811
    """Two real retriever-server subprocesses, started together to overlap their start-up:
    "main" requires an API key and lives for the module; "spare" is there to be killed."""
    with start_servers({"main": (hotpot_index_dir, "--api-key", API_KEY), "spare": (hotpot_index_dir,)}) as servers:
        yield servers


@pytest.fixture(scope="module")
def server(servers) -> str:
    return servers["main"][1]


@pytest.fixture(scope="module")
def in_process(hotpot_index_dir):  # noqa: F811
    """Metrics computed directly from open_index + index.search, with no HTTP and no evaluate code."""
    from retriever_server.indexes import open_index

    rows_q = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    _, store, index = open_index(hotpot_index_dir)
    _, rows = index.search([" ".join(r["question"].split()) for r in rows_q], max(TOPKS))
    sums: dict[str, float] = {}
    for r, row in zip(rows_q, rows):
        docs = store.get(row)
        hits = [contains_answer(d["contents"], r["golden_answers"]) for d in docs]
        titles = [d["contents"].split("\n", 1)[0] for d in docs]
        want = set(r["metadata"]["supporting_titles"])
        for k in TOPKS:
            sums[f"answer_recall@{k}"] = sums.get(f"answer_recall@{k}", 0.0) + float(any(hits[:k]))
            sums[f"title_recall@{k}"] = sums.get(f"title_recall@{k}", 0.0) + len(want & set(titles[:k])) / len(want)
        first = next((i for i, h in enumerate(hits, 1) if h), None)
        sums["mrr"] = sums.get("mrr", 0.0) + (1.0 / first if first else 0.0)
    return {key: v / len(rows_q) for key, v in sums.items()}, len(rows_q)


def test_answer_normalisation_hand_cases():
    """Whole-token span matching after SQuAD normalisation: articles, punctuation and case are
    ignored; partial tokens ("1" in "1984", "art" in "party") and reordered spans never match."""
    assert normalize_answer("The  Quick, Brown fox!") == "quick brown fox"
    assert not contains_answer("George Orwell wrote 1984 in 1948.", ["1"])
    assert contains_answer("It ran for 1 season.", ["1"])
    assert not contains_answer("a party in town", ["art"])
    assert contains_answer("They are THE Beatles, from Liverpool.", ["Beatles"])
    assert contains_answer("Beatles", ["The Beatles"])
    assert contains_answer("born in the U.S.A. in 1950", ["USA"])
    assert contains_answer("Moved to New York City.", ["new york"])
    assert not contains_answer("York, New Jersey", ["New York"])
    assert not contains_answer("anything", ["", "the"])  # an answer that normalises to nothing matches nothing
    assert contains_answer("Title\nThe answer is yes.", ["no", "Yes"])


def test_score_question_hand_cases():
    """recall@k, title / gold-id recall@k and MRR on a hand-made ranking."""
    q = Question("q", "s", "?", ["Paris"], supporting_titles=["France", "Seine"], gold_ids=["d3"])
    ps = [
        Passage("d1", "France", "France\nA country.", 1.0),
        Passage("d2", "Lyon", "Lyon\nNot the capital.", 0.9),
        Passage("d3", "Seine", "Seine\nFlows through Paris.", 0.8),
    ]
    s = score_question(q, ps, [1, 2, 3])
    assert [s[f"answer_recall@{k}"] for k in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert [s[f"title_recall@{k}"] for k in (1, 2, 3)] == [0.5, 0.5, 1.0]
    assert [s[f"gold_recall@{k}"] for k in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert s["mrr"] == pytest.approx(1 / 3) and s["first_hit_rank"] == 3
    assert score_question(Question("q", "s", "?", ["Rome"]), ps, [3])["mrr"] == 0.0


def test_load_questions_parquet_and_flashrag_jsonl(tmp_path):
    """The data-prep parquet (metadata as a JSON string, data_source column) and FlashRAG JSONL
    (supporting_facts titles, gold passage ids, no data_source: the file's stem) both load."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "data_source": ["nq", "hotpotqa"],
                "question": ["q1", "q2"],
                "golden_answers": [["x"], ["y", "z"]],
                "metadata": [json.dumps({"supporting_titles": ["T1", "T2"]}), None],
            }
        ),
        tmp_path / "test.parquet",
    )
    qs = load_questions(tmp_path / "test.parquet")
    assert [(q.id, q.data_source, q.golden_answers, q.supporting_titles) for q in qs] == [
        ("a", "nq", ["x"], ["T1", "T2"]),
        ("b", "hotpotqa", ["y", "z"], None),
    ]
    (tmp_path / "dev.jsonl").write_text(
        json.dumps(
            {
                "id": "1",
                "question": "q",
                "golden_answers": ["a"],
                "metadata": {"supporting_facts": {"title": ["A", "B", "A"], "sent_id": [0, 1, 2]}},
            }
        )
        + "\n"
        + json.dumps({"id": "2", "question": "q", "golden_answers": "b", "gold_ids": [7]})
        + "\n"
    )
    qs = load_questions(tmp_path / "dev.jsonl")
    assert qs[0].data_source == "dev" and qs[0].supporting_titles == ["A", "B"]
    assert qs[1].golden_answers == ["b"] and qs[1].gold_ids == ["7"] and qs[1].supporting_titles is None
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "question": "q"}\n')
    assert main(["--url", "http://127.0.0.1:9", "--data", str(tmp_path / "bad.jsonl")]) == 2


def test_recall_over_http_equals_in_process_search(server, in_process, tmp_path):
    """Answer recall@k, supporting-title recall@k and MRR from the CLI over HTTP equal a direct
    in-process computation (open_index + index.search) on the same index; the JSON report and
    the per-question dump are written; the evaluator never imports agent_rl."""
    expected, n = in_process
    out, dump = tmp_path / "r.json", tmp_path / "d.jsonl"
    code = (
        "import sys, retriever_server.evaluate as e; "
        "assert not any(m.startswith('agent_rl') for m in sys.modules); sys.exit(e.main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--url",
            server,
            "--data",
            str(QUESTIONS),
            "--topk",
            "1,3,5,10",
            "--batch-size",
            "8",
            "--concurrency",
            "4",
            "--api-key",
            API_KEY,
            "--out",
            str(out),
            "--dump",
            str(dump),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    m = report["overall"]
    assert m["n"] == n and m["answered"] == n and m["failed"] == 0 and report["failed_queries"] == 0
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-9), key
    assert m["answer_recall@10"] > 0 and m["title_recall@10"] > 0
    assert report["queries_per_s"] > 0 and report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
    assert "R@1" in proc.stdout and "T@10" in proc.stdout and "queries/s" in proc.stdout
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(lines) == n and all(len(r["topk"]) == 10 for r in lines)
    print(
        f"\nretriever-eval: {report['queries_per_s']:.1f} q/s, p50 {report['latency_ms']['p50']:.1f} ms, "
        f"R@5 {m['answer_recall@5']:.3f}, T@5 {m['title_recall@5']:.3f}, MRR {m['mrr']:.3f}"
    )


def test_compare_same_server_gives_zero_deltas(server, tmp_path, capsys):
    """--compare against the same server: every quality delta is exactly zero."""
    out = tmp_path / "c.json"
    rc = main(
        [
            "--url",
            server,
            "--compare",
            server,
            "--data",
            str(QUESTIONS),
            "--limit",
            "40",
            "--topk",
            "1,5",
            "--api-key",
            API_KEY,
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    delta = result["delta"]["overall"]
    quality = [k for k in delta if "recall" in k or k in ("mrr", "failed", "answered")]
    assert len(quality) >= 6 and all(delta[k] == 0 for k in quality)
    assert result["a"]["overall"]["answered"] == result["b"]["overall"]["answered"] == 40
    assert "overall b-a" in capsys.readouterr().out


def test_compare_with_dead_server_reports_failures(server, tmp_path, capsys):
    """A compare URL where nothing listens: its queries are all counted as failed with the
    reason, the first server's numbers still come out, no traceback, exit code 1."""
    out = tmp_path / "c.json"
    dead = f"http://127.0.0.1:{free_port()}"
    rc = main(
        [
            "--url",
            server,
            "--compare",
            dead,
            "--data",
            str(QUESTIONS),
            "--limit",
            "20",
            "--api-key",
            API_KEY,
            "--retries",
            "1",
            "--backoff",
            "0.01",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    result = json.loads(out.read_text())
    assert result["a"]["failed_queries"] == 0 and result["b"]["failed_queries"] == 20
    assert "20 of 20 queries failed" in err and "ConnectError" in err and "every query failed" in err
    assert "Traceback" not in err


def test_wrong_api_key_is_reported_not_retried(server, tmp_path, capsys):
    """A 401 is a failure with the server's message, counted per query, and exits 1."""
    rc = main(
        [
            "--url",
            server,
            "--data",
            str(QUESTIONS),
            "--limit",
            "10",
            "--batch-size",
            "5",
            "--api-key",
            "wrong",
            "--retries",
            "3",
            "--backoff",
            "5",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "10 of 10 queries failed (2 requests)" in err and "HTTP 401" in err and "Traceback" not in err


def test_server_killed_mid_run_counts_failures(servers, tmp_path, capsys):
    """The server dies while the evaluation runs: the answered queries are scored, the rest are
    counted as failed with a clear reason, the run finishes with exit code 0, no traceback."""
    import httpx

    proc, url = servers["spare"]
    out = tmp_path / "k.json"
    result: dict = {}
    args = [
        "--url",
        url,
        "--data",
        str(QUESTIONS),
        "--batch-size",
        "1",
        "--concurrency",
        "1",
        "--retries",
        "1",
        "--backoff",
        "0.01",
        "--timeout",
        "5",
        "--out",
        str(out),
        "--no-progress",
    ]
    worker = threading.Thread(target=lambda: result.setdefault("rc", main(args)))
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(url + "/metrics").text
            served = next(
                float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("retriever_queries_total")
            )
            if served >= 10:
                break
            time.sleep(0.01)
        proc.kill()
        worker.join(timeout=120)
    finally:
        stop_process(proc, 10)
    assert not worker.is_alive() and result["rc"] == 0
    report = json.loads(out.read_text())
    m = report["overall"]
    assert m["answered"] >= 5 and m["failed"] > 0 and m["answered"] + m["failed"] == m["n"] == 100
    err = capsys.readouterr().err
    assert f"{m['failed']} of 100 queries failed" in err and "Traceback" not in err
