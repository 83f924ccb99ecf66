"""Session fixtures for the trainer's tests: a tiny model, a small dense index, a tiny toy world;
and `start_servers`, real `retriever-server` subprocesses for the tests and benches."""
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2 with a BPE tokenizer trained on the hotpotqa fixture text."""
    import json

    from agent_rl.model_init import init_model

    texts = [json.loads(line)["contents"] for line in (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()]
    out = tmp_path_factory.mktemp("tiny_model")
    init_model(out, size="tiny", texts=texts, seed=0)
    return out


@pytest.fixture(scope="session")
def hotpot_index_dir(tmp_path_factory) -> Path:
    """A flat MiniLM index over the first 200 hotpotqa fixture paragraphs (fast to encode)."""
    from retriever_server.build import build_index

    work = tmp_path_factory.mktemp("hotpot_flat")
    corpus = work / "corpus.jsonl"
    lines = (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()[:200]
    corpus.write_text("\n".join(lines) + "\n")
    build_index(corpus, work / "index", kind="flat")
    return work / "index"


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate, and kill if it has not exited after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def start_servers(specs: dict[str, tuple], ready_timeout: float = 120) -> Iterator[dict[str, tuple[subprocess.Popen, str]]]:
    """`python -m retriever_server.app` on an ephemeral 127.0.0.1 port for each `name: (index_dir, *extra_args)`,
    all launched before any is waited on so their start-ups overlap. Yields {name: (proc, url)} once each has
    written its ready file (each gets `ready_timeout` seconds), and stops them all on exit."""
    with tempfile.TemporaryDirectory(prefix="retriever-server-") as tmp:
        launched = {}
        try:
            for i, (name, (index_dir, *extra)) in enumerate(specs.items()):
                ready, log_path = Path(tmp) / f"{i}.ready.json", Path(tmp) / f"{i}.log"
                with open(log_path, "w") as log:
                    cmd = [sys.executable, "-m", "retriever_server.app", "--index", str(index_dir), "--port", "0", "--ready-file", str(ready), *extra]
                    launched[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), ready, log_path)
            for name, (proc, ready, log_path) in launched.items():
                deadline = time.monotonic() + ready_timeout
                while not ready.exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        why = f"not ready after {ready_timeout:.0f} s" if proc.returncode is None else f"exited with {proc.returncode}"
                        raise AssertionError(f"retriever-server {name!r} {why}:\n{log_path.read_text()[-3000:]}")
                    time.sleep(0.1)
            yield {name: (proc, json.loads(ready.read_text())["url"]) for name, (proc, ready, _) in launched.items()}
        finally:
            for proc, _, _ in launched.values():
                stop_server(proc)


@contextmanager
def start_server(index_dir: Path, *extra_args: str, ready_timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """One server, as `start_servers`: yields (proc, url)."""
    with start_servers({"server": (index_dir, *extra_args)}, ready_timeout) as servers:
        yield servers["server"]
