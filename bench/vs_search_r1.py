"""`retriever-server` against Search-R1's `retrieval_server.py` as written: same index, same encoder.

Usage: .venv/bin/python bench/vs_search_r1.py --search-r1 PATH/TO/Search-R1/search_r1/search/retrieval_server.py
       [--corpus C.jsonl] [--questions Q.jsonl] [--work DIR] [--rounds 2] [--duration 10] [--server-args '--int8']

1. A flat MiniLM index of --corpus (default: the HotpotQA fixture's 994 paragraphs) built by
   retriever-build into --work, reused. Search-R1's server loads that index's `index.faiss` and the
   corpus JSONL, with the same MiniLM and mean pooling (`--retriever_name minilm`: no e5/bge prefix).
2. Search-R1's file is copied into --work with only what it needs to run on a CPU (printed as a
   diff): `model.cuda()` and the inputs' `.cuda()` go, `retrieval_use_fp16` is off (fp16 is its GPU
   setting; a CPU without fp16 units emulates it), and it binds 127.0.0.1 on a free port instead of
   0.0.0.0:8000.
3. Both servers run side by side (one at a time is driven); for concurrency 1 and 32, each round
   drives ours then theirs, the next round theirs then ours, --duration seconds a cell, one distinct
   query per request (so no cache answers), topk 3, `return_scores` true (Search-R1's endpoint
   answers 500 without it: it unpacks two values from a call that then returns one): queries/s, p50
   and p99.
4. The top-3 lists of --agree questions asked one at a time of both, compared by passage text.
5. The in-process ceiling (our open_index(...).search at batch 32, no HTTP, int8 as the server) and
   our server's share of it.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
from agent_fixtures import start_server  # noqa: E402
from retriever_load import FIXTURE, Ceiling, Queries, drive, ensure_index  # noqa: E402

from agent_rl.bootstrap.prepare import stop_process  # noqa: E402
from retriever_server.encoders import default_encoder_path  # noqa: E402

EDITS = [
    ("    model.cuda()\n", ""),
    ("        inputs = {k: v.cuda() for k, v in inputs.items()}\n", ""),
    ("        retrieval_use_fp16=True,", "        retrieval_use_fp16=False,"),
    (
        '    uvicorn.run(app, host="0.0.0.0", port=8000)',
        '    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]))',
    ),
]


def cpu_copy(original: Path, out: Path) -> Path:
    text = original.read_text()
    patched = text
    for old, new in EDITS:
        if old not in patched:
            raise SystemExit(f"{original} has changed: {old.strip()!r} not found; update EDITS")
        patched = patched.replace(old, new)
    out.write_text(patched)
    diff = difflib.unified_diff(text.splitlines(), patched.splitlines(), str(original), str(out), lineterm="", n=0)
    print("\n".join(diff))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_search_r1(script: Path, index_dir: Path, corpus: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        str(script),
        "--index_path",
        str(index_dir / "index.faiss"),
        "--corpus_path",
        str(corpus),
        "--topk",
        "3",
        "--retriever_name",
        "minilm",
        "--retriever_model",
        default_encoder_path(),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PORT": str(port)}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"Search-R1's server exited with {proc.returncode}; see {log}")
        try:
            if (
                httpx.post(
                    f"{url}/retrieve", json={"queries": ["warm up"], "topk": 3, "return_scores": True}, timeout=60
                ).status_code
                == 200
            ):
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    raise SystemExit(f"Search-R1's server did not answer within 600 s; see {log}")


def top_texts(url: str, queries: list[str]) -> list[list[str]]:
    import httpx

    out = []
    for q in queries:
        result = httpx.post(
            f"{url}/retrieve", json={"queries": [q], "topk": 3, "return_scores": True}, timeout=60
        ).json()["result"][0]
        out.append([(doc.get("document") or doc)["contents"] for doc in result])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--search-r1", type=Path, required=True, help="Search-R1's search_r1/search/retrieval_server.py")
    p.add_argument("--corpus", type=Path, default=FIXTURE / "corpus.jsonl")
    p.add_argument("--questions", type=Path, default=FIXTURE / "questions.jsonl")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "agent-rl-bench-hotpotqa100")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per cell")
    p.add_argument("--agree", type=int, default=200, help="questions whose top-3 lists are compared")
    p.add_argument("--server-args", default="", help="extra flags for retriever-server, e.g. '--int8'")
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    a.index, a.topk, a.max_requests = None, 3, 100000
    index_dir = ensure_index(a)
    script = cpu_copy(a.search_r1, a.work / "search_r1_retrieval_server_cpu.py")
    queries = Queries(a.questions, a.corpus)
    results: dict[tuple[str, int], list[dict]] = {}
    with start_server(index_dir, *a.server_args.split(), ready_timeout=300) as (_, ours):
        theirs_proc, theirs = start_search_r1(script, index_dir, a.corpus, a.work / "search_r1.log")
        try:
            urls = {"agent-rl": ours, "Search-R1": theirs}
            for url in urls.values():
                asyncio.run(drive(url, lambda: queries.take(1), 8, 2.0, 32, 3, return_scores=True))  # warm-up
            probe = Queries(a.questions, a.corpus).take(a.agree)
            lists = {name: top_texts(url, probe) for name, url in urls.items()}
            same = np.mean([x == y for x, y in zip(lists["agent-rl"], lists["Search-R1"], strict=True)])
            same_sets = np.mean([set(x) == set(y) for x, y in zip(lists["agent-rl"], lists["Search-R1"], strict=True)])
            print(
                f"top-3 lists identical for {same:.1%} of {a.agree} questions (same set: {same_sets:.1%})", flush=True
            )
            for r in range(a.rounds):
                order = list(urls) if r % 2 == 0 else list(urls)[::-1]
                for c in (1, 32):
                    for name in order:
                        res = asyncio.run(
                            drive(
                                urls[name],
                                lambda: queries.take(1),
                                c,
                                a.duration,
                                a.max_requests,
                                3,
                                return_scores=True,
                            )
                        )
                        res["qps"] = res["requests"] / res["wall"]
                        results.setdefault((name, c), []).append(res)
                        print(
                            f"round {r} {name:<10} concurrency {c:>2}: {res['qps']:7.1f} q/s  "
                            f"p50 {res['p50']:7.1f} ms  p99 {res['p99']:7.1f} ms  failures {res['failures']}",
                            flush=True,
                        )
        finally:
            stop_process(theirs_proc, 10)
    ceiling = Ceiling(index_dir, queries, 3, int8="--int8" in a.server_args.split())
    ceil = ceiling.measure(32, a.duration)
    print(f"\nmedians over {a.rounds} rounds; index {index_dir} ({os.cpu_count()} CPUs)")
    summary = {}
    for c in (1, 32):
        ours_c, theirs_c = results[("agent-rl", c)], results[("Search-R1", c)]
        q_ours, q_theirs = (float(np.median([x["qps"] for x in rs])) for rs in (ours_c, theirs_c))
        p99_ours, p99_theirs = (float(np.median([x["p99"] for x in rs])) for rs in (ours_c, theirs_c))
        summary[c] = {"qps": (q_ours, q_theirs), "p99": (p99_ours, p99_theirs)}
        print(
            f"  concurrency {c:>2}: agent-rl {q_ours:7.1f} q/s, Search-R1 {q_theirs:7.1f} q/s = "
            f"{q_ours / q_theirs:.2f}x "
            f"(goal {'>= 8x' if c == 32 else '>= 3x'}); p99 {p99_ours:.1f} vs {p99_theirs:.1f} ms = "
            f"{p99_ours / p99_theirs:.2f}x" + (" (goal <= 0.25x)" if c == 32 else "")
        )
    print(
        f"  in-process ceiling (encode + search, batch 32, no HTTP): {ceil:.1f} q/s; our server at concurrency 32 is "
        f"{summary[32]['qps'][0] / ceil:.0%} of it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
