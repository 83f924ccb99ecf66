"""First-use preparation and the local retriever: every command works on a fresh checkout.

When a config names a toy world, a model size to initialise, or an index that does not exist
yet, they are built here (toy world -> tiny model trained on its text -> dense index), each
written to a temporary directory and renamed, so a killed build never leaves a half file.
When `retriever.url` is unset, `local_retriever` starts `retriever-server` on 127.0.0.1 on an
ephemeral port as a subprocess (the trainer only ever talks to it over HTTP) and stops it; under
`retriever.replay` (misses an error) it starts nothing and the client answers from the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from agent_rl.config import Config, RetrieverConfig
from retriever_server.jsonl import iter_corpus


def _log(msg: str) -> None:
    print(f"[prepare] {msg}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the trainer dies, even by SIGKILL (no orphans)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def ensure_toy_world(cfg: Config) -> None:
    if not cfg.data.toy_world:
        return
    from data_prep.toy_world import VERSION, build_toy_world

    out = Path(cfg.data.toy_world)
    if (out / "corpus.jsonl").exists() and (out / "train.parquet").exists():
        manifest = out / "world.json"
        version = json.loads(manifest.read_text()).get("version") if manifest.exists() else 1
        if version != VERSION:
            raise SystemExit(
                f"data.toy_world {out} was written by toy world version {version}, this code writes version {VERSION}: "
                "the model, index and warm start built from it are stale too; delete them (`make clean` removes .cache "
                "and runs) and run again"
            )
        return

    _log(f"building the toy world in {out} (seed {cfg.run.seed}, {cfg.data.toy_entities} entities)")
    tmp = Path(tempfile.mkdtemp(prefix=".toy_", dir=out.parent if out.parent.exists() else None))
    out.parent.mkdir(parents=True, exist_ok=True)
    build_toy_world(tmp, seed=0, num_entities=cfg.data.toy_entities)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _training_texts(cfg: Config) -> Iterator[str]:
    import pyarrow.parquet as pq

    corpus = Path(cfg.retriever.corpus)
    if corpus.exists():
        yield from (rec["contents"] for rec in iter_corpus(corpus))
    for f in cfg.data.train_files:
        if Path(f).exists():
            yield from pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist()


def _chat_texts(cfg: Config) -> tuple[list[str], list[str], str, list[str]]:
    """Under rollout.protocol=tool_calls, what a model built here must tokenize well: each training question's
    prompt as the chat template renders it (system message, tools' schemas), a tool call on it, a tool message
    and an answer; with the template's markers (`<|im_start|>`, `<tool_call>`, ...) as special tokens, the
    template as the tokenizer's own, and (model.init_template_phrases) its fixed texts as whole tokens."""
    import pyarrow.parquet as pq

    from agent_rl.bootstrap.model_init import train_tokenizer
    from agent_rl.rollout.chat_tools import ChatFormat
    from agent_rl.rollout.tools import build_tools

    tools = build_tools(cfg.rollout.tools, None, cfg.retriever.topk)
    fmt = ChatFormat(train_tokenizer([], 300), tools, cfg.rollout.chat_template, cfg.rollout.system_prompt)
    texts = []
    for f in cfg.data.train_files:
        if Path(f).exists():
            for q in pq.read_table(f, columns=["question"]).column("question").to_pylist():
                call = fmt.call_text(tools[0].name, q)
                texts.append(fmt.prompt_text(q) + call + fmt.after_turn(fmt.tool_head, call) + fmt.tool_tail)
    texts.append(fmt.answer_text("x") + fmt.invalid_text(None, "x"))
    phrases = fmt.fixed_texts() if cfg.model.init_template_phrases else []
    return texts, fmt.markers(), fmt.template, phrases


def ensure_model(cfg: Config) -> None:
    path = Path(cfg.model.path)
    if cfg.model.preset:
        if not (path / "config.json").exists():
            from agent_rl.bootstrap.model_init import MissingPackageError, convert_preset

            _log(f"converting the {cfg.model.preset} preset into {path}")
            try:
                convert_preset(cfg.model.preset, path)
            except MissingPackageError as err:
                raise SystemExit(str(err)) from None
        return
    if path.exists() or not cfg.model.init_size:
        if not path.exists() and not ("/" in cfg.model.path and not cfg.model.path.startswith((".", "/"))):
            raise FileNotFoundError(
                f"model.path {path} does not exist; set model.init_size=tiny to build one, or point model.path at a "
                "model"
            )
        return
    from agent_rl.bootstrap.model_init import init_model

    _log(f"initialising a {cfg.model.init_size} model with a locally trained tokenizer in {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model_", dir=path.parent))
    texts, specials, template, phrases = list(_training_texts(cfg)), list[str](), "", list[str]()
    if cfg.rollout.protocol == "tool_calls":
        chat, specials, template, phrases = _chat_texts(cfg)
        texts += chat
    init_model(
        tmp,
        size=cfg.model.init_size,
        texts=texts,
        seed=cfg.run.seed,
        specials=specials,
        chat_template=template,
        pretokenizer=cfg.model.init_pretokenizer,
        phrases=phrases,
    )
    os.replace(tmp, path)


def ensure_index(retriever: RetrieverConfig) -> None:
    """Build `retriever.index_dir` from `retriever.corpus` as `retriever.kind` (and `retriever.factory`)
    when it holds no index; an index already there is served as it was built, whatever its kind."""
    if retriever.url:
        return
    index = Path(retriever.index_dir)
    if (index / "manifest.json").exists():
        built = json.loads((index / "manifest.json").read_text()).get("kind")
        if built != retriever.kind:
            _log(
                f"retriever.index_dir {index} holds a {built} index, retriever.kind is {retriever.kind}: serving "
                "the index as built (delete the directory to rebuild it as retriever.kind)"
            )
        return
    corpus = Path(retriever.corpus)
    if not corpus.exists():
        raise FileNotFoundError(
            f"retriever.corpus {corpus} does not exist and retriever.index_dir {index} has no index; build one with "
            "retriever-build or set retriever.url"
        )
    _log(f"building a {retriever.kind} index of {corpus} in {index}")
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".index_", dir=index.parent))
    cmd = [
        sys.executable,
        "-m",
        "retriever_server.build",
        "--corpus",
        str(corpus),
        "--out",
        str(tmp),
        "--kind",
        retriever.kind,
    ]
    if retriever.factory:  # the config allows it with kind=factory only
        cmd += ["--factory", retriever.factory]
    subprocess.run(cmd, check=True)
    # The manifest records the corpus path, not the index path, so the rename keeps it valid.
    os.replace(tmp, index)


def read_qa_rows(source: Path) -> list[dict]:
    """FlashRAG-layout rows of a questions JSONL, each with `metadata.queries`, the searches of the
    scripted demonstrations `agent-rl sft` trains on: the row's supporting titles (HotpotQA's
    `metadata.supporting_titles`) where it names them, else the question itself (NQ, TriviaQA)."""
    if not source.exists():
        raise FileNotFoundError(f"questions file {source} does not exist")
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    for row in rows:
        meta = dict(row.get("metadata") or {})
        meta.setdefault("queries", list(meta.get("supporting_titles", [])) or [row["question"]])
        row["metadata"] = meta
    return rows


def write_qa_parquet(rows: list[dict], path: Path, dataset: str, split: str, template: str, tokenizer) -> None:
    """Rows from `read_qa_rows` as a `data-prep qa` parquet file, prompts rendered with `template`."""
    from datasets import Dataset

    from data_prep.qa import build_rows, write_parquet

    cols, _ = build_rows(Dataset.from_list(rows), dataset, split, template, tokenizer)
    write_parquet(cols, path)


def ensure_qa(cfg: Config) -> None:
    """Split `data.qa_source` into the train and test parquet files, prompts rendered through the
    model's tokenizer (its chat template with `data.template=auto`), each row with its
    `metadata.queries` (`read_qa_rows`)."""
    if not cfg.data.qa_source:
        return
    train, test = Path(cfg.data.train_files[0]), Path(cfg.data.test_files[0]) if cfg.data.test_files else None
    if train.exists() and (test is None or test.exists()):
        return
    from agent_rl.rollout.prompts import load_tokenizer

    source = Path(cfg.data.qa_source)
    if not source.exists():
        raise FileNotFoundError(f"data.qa_source {source} does not exist")
    rows = read_qa_rows(source)
    tokenizer = load_tokenizer(cfg.model.path)
    _log(
        f"splitting {source} into {train} and {test} ({cfg.data.qa_test_size} test rows, template {cfg.data.template})"
    )
    n_test = cfg.data.qa_test_size if test is not None else 0
    for split, part, path in (("test", rows[:n_test], test), ("train", rows[n_test:], train)):
        if path is not None:
            write_qa_parquet(part, path, cfg.data.qa_dataset, split, cfg.data.template, tokenizer)


def prepare(cfg: Config, need_index: bool = True) -> None:
    """Build whatever the config names and lacks: toy world, model, QA splits, index."""
    ensure_toy_world(cfg)
    ensure_model(cfg)
    ensure_qa(cfg)
    if need_index and not replays_only(cfg.retriever):
        ensure_index(cfg.retriever)


def spawn_retriever(index_dir: str | Path, ready: Path, log: Path, *extra_args: str) -> subprocess.Popen:
    """`python -m retriever_server.app` on an ephemeral 127.0.0.1 port, output to `log`; it writes
    `ready` (atomically) once listening and gets SIGTERM if this process dies."""
    cmd = [
        sys.executable,
        "-m",
        "retriever_server.app",
        "--index",
        str(index_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        *extra_args,
    ]
    with log.open("w") as log_fh:
        return subprocess.Popen(
            cmd,
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout_s: float, name: str = "retriever-server") -> str:
    """The server's URL once its ready file exists; RuntimeError / TimeoutError with the log's tail
    if it exits or is not ready within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not start within {timeout_s:.0f}s; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return json.loads(ready.read_text())["url"]


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def replays_only(retriever: RetrieverConfig) -> bool:
    """Every search is answered from `retriever.replay`'s record: no index or server is needed."""
    return bool(retriever.replay) and retriever.replay_miss == "error"


@contextlib.contextmanager
def local_retriever(retriever: RetrieverConfig, timeout_s: float = 180.0) -> Iterator[str | None]:
    """Yield the retriever URL: `retriever.url` if set, else a server started here and stopped after;
    None when `retriever.replay` answers every search (nothing started)."""
    if replays_only(retriever):
        _log(f"replaying retrieval from {retriever.replay}: no retriever started (a miss stops the run)")
        yield None
        return
    if retriever.url:
        yield retriever.url
        return
    ensure_index(retriever)
    work = Path(tempfile.mkdtemp(prefix="retriever_"))
    ready, log = work / "ready.json", work / "server.log"
    proc = spawn_retriever(retriever.index_dir, ready, log, "--topk", str(retriever.topk))
    try:
        url = wait_ready(proc, ready, log, timeout_s)
        _log(f"retriever listening on {url} (index {retriever.index_dir})")
        yield url
    finally:
        stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)
