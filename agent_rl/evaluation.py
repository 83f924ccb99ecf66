"""`agent-rl eval` at scale: the test questions in fixed chunks, scored by shards, resumable.

The evaluated questions (a seeded subset of the test files, recorded by id) are cut into chunks of
`chunk_size` consecutive questions; chunk c belongs to shard c mod n (a torchrun rank, or a process
started with `--shard i/n`). A shard appends each chunk's per-question records to its own
`DIR/part-<i>.jsonl` in one write, fsync'd, so a kill loses at most the chunk in flight; a restart
keeps the complete chunks of every part file and scores the rest. A chunk is the batch handed to the
rollout loop: the same questions in the same order whether the evaluation ran whole, resumed or
sharded, and the engine is reseeded per chunk, so greedy decoding (and sampled pass@k, seeded)
scores every question as one uninterrupted process would. `merge` builds the table
(`agent_rl.reports.eval_report`) once every chunk is in.

`DIR/spec.json` records what the scores depend on (checkpoint files, data, subset ids, retriever
index fingerprint and topk, decoding, budget, chunk size); a restart that differs in any of them is
refused rather than mixed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from agent_rl.config import BudgetConfig, RetrieverConfig, RolloutConfig, RunConfig
from agent_rl.reports.eval_report import summarise
from agent_rl.rollout.loop import AgentLoop
from agent_rl.rollout.prompts import PromptSet
from agent_rl.rollout.protocol import extract_answer, policy_text
from agent_rl.rollout.rewards import answer_scores
from agent_rl.rollout.trajectory import Trajectory, write_trajectories
from agent_rl.runtime import distributed as dist_lib
from agent_rl.runtime.logger import MetricsLogger
from agent_rl.world import LOCAL, World
from retriever_server.client import RetrieverClient

SPEC = "spec.json"


class EvalMismatch(ValueError):
    """The questions folder holds scores of another evaluation."""


def questions_dir(out: Path) -> Path:
    """Where the per-question records of the evaluation whose table goes to `out` live."""
    return out.with_name(out.stem + "_questions")


def join_ranks(retriever: RetrieverConfig, rollout: RolloutConfig) -> World:
    """Under torchrun, a gloo group for the start (rank 0 prepares, shares the retriever URL) and the
    final merge; each rank's rollout device becomes `cuda:LOCAL_RANK` when it names a GPU. One
    process: the world of one."""
    if not dist_lib.launched_by_torchrun():
        return LOCAL
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if not retriever.url and not retriever.replay and world != int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        raise ValueError(
            "retriever.url is unset on a multi-node evaluation: start retriever-server --host 0.0.0.0 "
            "and set retriever.url=http://HOST:PORT"
        )
    # Ranks finish their shares at different times; the merge waits for the slowest.
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(hours=24))
    if rollout.device.startswith("cuda"):
        rollout.device = f"cuda:{local}"
    return dist_lib.DistInfo(rank=rank, world_size=world, local_rank=local, device=torch.device("cpu"), backend="gloo")


def parse_shard(text: str | None) -> tuple[int, int]:
    """`--shard i/n` -> (i, n); None -> (0, 1)."""
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: write it as i/n, e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: i must be in 0..n-1")
    return i, n


def select(prompts: PromptSet, per_source: int, seed: int) -> PromptSet:
    """At most `per_source` questions of each data_source, a sample seeded by `seed` kept in file
    order (0: all of them)."""
    if not per_source:
        return prompts
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(prompts.items):
        by_source[item.data_source].append(i)
    keep: set[int] = set()
    for source, idx in by_source.items():
        keep.update(random.Random(f"{seed}/{source}").sample(idx, min(per_source, len(idx))))
    order = sorted(keep)
    return PromptSet(
        [prompts.items[i] for i in order],
        [prompts.metadata[i] for i in order],
        [prompts.questions[i] for i in order],
        prompts.dropped,
    )


def files_fingerprint(model_dir: str | Path) -> str:
    """A cheap fingerprint of a model directory: every file's name, size and modification time."""
    h = hashlib.sha256()
    root = Path(model_dir)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def describe_retriever(client: RetrieverClient, retriever: RetrieverConfig) -> dict:
    """The retrieval the scores depend on: the index fingerprint `/health` serves (or the replayed
    record's), what it said of the index, the URL or replay folder, and topk."""
    out: dict = {
        "index_fingerprint": None,
        "topk": retriever.topk,
        "url": client.url,
        "replay": retriever.replay or None,
    }
    try:
        out["index_fingerprint"] = client.fingerprint()
    except Exception as err:  # noqa: BLE001  # an unreadable /health only leaves the fingerprint unknown
        print(f"[eval] no index fingerprint from the retriever ({err}); results record none", file=sys.stderr)
    out["index"] = client.index_info
    about = Path(retriever.replay or ".") / str(out["index_fingerprint"]) / "index.json"
    if out["index"] is None and retriever.replay and about.exists():  # replayed with no server: the record's
        out["index"] = json.loads(about.read_text())
    return out


def make_spec(
    rollout: RolloutConfig,
    budget: BudgetConfig,
    seed: int,
    checkpoint: str,
    model_dir: str,
    data: list[str],
    prompts: PromptSet,
    retriever: dict,
    *,
    max_samples: int,
    per_source: int,
    pass_k: int,
    chunk_size: int,
) -> dict:
    """Everything the scores depend on, with the exact questions (ids in order); `seed` is run.seed."""
    ids = [item.prompt_id for item in prompts.items]
    dupes = len(ids) - len(set(ids))
    if dupes:
        raise ValueError(f"{dupes} question ids appear twice in {data}: is a test file listed twice?")
    sampled = pass_k > 1
    return {
        "checkpoint": str(Path(checkpoint).resolve()),
        "model_fingerprint": files_fingerprint(model_dir),
        "data": [str(d) for d in data],
        "subset": {
            "max_samples": max_samples,
            "per_source": per_source,
            "seed": seed,
            "n": len(ids),
            "ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest(),
            "dropped": dict(prompts.dropped),
            "ids": ids,
        },
        "retriever": retriever,
        "decoding": {
            "pass_k": pass_k,
            "temperature": rollout.temperature if sampled else rollout.eval_temperature,
            "top_p": rollout.top_p if sampled else 1.0,
            "seed": seed,
            "engine": rollout.resolved_engine(),
            "mode": rollout.mode,
        },
        "budget": dataclasses.asdict(budget),
        "chunk_size": chunk_size,
    }


def _identity(spec: dict) -> dict:
    """The parts of a spec that decide the scores (not where the checkpoint or server happen to be)."""
    out = {k: v for k, v in spec.items() if k not in ("checkpoint", "retriever")}
    out["retriever"] = {k: spec["retriever"].get(k) for k in ("index_fingerprint", "topk")}
    return out


def open_folder(folder: Path, spec: dict, fresh: bool = False) -> None:
    """Start or continue the evaluation in `folder`: write its spec, or check the one there.
    `fresh` discards what the folder holds."""
    if fresh and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SPEC
    if path.exists():
        old, new = _identity(json.loads(path.read_text())), _identity(spec)
        differ = sorted(k for k in new if old.get(k) != new[k])
        if differ:
            raise EvalMismatch(
                f"{folder} holds scores of another evaluation ({', '.join(differ)} differ); pass --fresh to discard "
                "them, or --out elsewhere"
            )
        return
    tmp = folder / f".{SPEC}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(spec, indent=1) + "\n")
    os.replace(tmp, path)


def chunks(n: int, chunk_size: int) -> list[range]:
    """The fixed chunks of n questions: consecutive runs of `chunk_size`."""
    return [range(lo, min(n, lo + chunk_size)) for lo in range(0, n, chunk_size)]


def _complete(rows: list[dict], spec: dict) -> dict[int, list[dict]]:
    """The chunks all of whose (question, sample) records are among `rows`, each in subset order."""
    ids, k = spec["subset"]["ids"], spec["decoding"]["pass_k"]
    plan = chunks(len(ids), spec["chunk_size"])
    by_chunk: dict[int, dict[tuple[str, int], dict]] = defaultdict(dict)
    for r in rows:
        by_chunk[r["chunk"]][(r["id"], r["sample"])] = r
    out = {}
    for c, got in by_chunk.items():
        want = [(ids[i], s) for i in plan[c] for s in range(k)] if 0 <= c < len(plan) else None
        if want is not None and set(got) == set(want):
            out[c] = [got[key] for key in want]
    return out


def _read_rows(path: Path) -> list[dict]:
    """The whole JSON lines of a part file (a line cut by a kill is skipped)."""
    rows = []
    for line in path.read_bytes().split(b"\n"):
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def complete_chunks(folder: Path, spec: dict) -> dict[int, list[dict]]:
    """Every complete chunk in the folder's part files, whichever shard wrote it."""
    done: dict[int, list[dict]] = {}
    for path in sorted(folder.glob("part-*.jsonl")):
        for c, rows in _complete(_read_rows(path), spec).items():
            done.setdefault(c, rows)
    return done


def _keep_complete(path: Path, spec: dict) -> None:
    """Rewrite this shard's own part file with its complete chunks only (a kill mid-write leaves a
    cut line or part of a chunk, which the rerun of that chunk would otherwise duplicate)."""
    if not path.exists():
        return
    done = _complete(_read_rows(path), spec)
    text = "".join(json.dumps(r) + "\n" for c in sorted(done) for r in done[c])
    if text.encode() == path.read_bytes():
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def trajectory_record(chunk: int, t: Trajectory, meta: dict, prefix: str = "eval") -> dict:
    """One trajectory's scores: what the table and a paired comparison of two evaluations need; the same
    row for `agent-rl eval` and the trainer's evaluations (`prefix`: eval, or eval_sampled; `prompt_id`
    repeats `id` under the name the trainer's score files have always used)."""
    answer = extract_answer(policy_text(t.response_text))
    return {
        "eval": prefix,
        "chunk": chunk,
        "id": t.prompt_id,
        "prompt_id": t.prompt_id,
        "data_source": t.data_source,
        "type": meta.get("type", ""),
        "sample": t.sample_idx,
        **answer_scores(t.response_text, t.golden_answers),
        "searches": sum(1 for x in t.turns if x.action == "search" and x.obs_tokens),  # searches run
        "response_tokens": t.response_tokens,
        "turns": len(t.turns),
        "end_reason": t.end_reason,
        "answer": answer,
    }


def evaluate(
    loop: AgentLoop,
    prompts: PromptSet,
    rollout: RolloutConfig,
    temperature: float | None = None,
    prefix: str = "eval",
    keep: list[Trajectory] | None = None,
    scores: list[dict] | None = None,
) -> dict[str, float]:
    """Rollouts over the test prompts (greedy by default: rollout.eval_temperature): EM, F1 and
    searches run per trajectory overall and per data_source (`prefix/<source>/em`), and per question type
    where the rows' `metadata.type` names one (`prefix/type/<type>/em`: the toy world's single-hop and
    two-hop). The trajectories are appended to `keep` if given, and one record per question (id, data
    source, type, EM, F1, searches: `trajectory_record`, as `agent-rl eval` writes) to `scores`."""
    temperature = rollout.eval_temperature if temperature is None else temperature
    trajs = loop.run(prompts.items, group_size=1, temperature=temperature)
    if keep is not None:
        keep.extend(trajs)
    rows = [trajectory_record(0, t, meta, prefix) for t, meta in zip(trajs, prompts.metadata)]
    if scores is not None:
        scores.extend(rows)
    return score_metrics(rows)


def score_metrics(rows: list[dict]) -> dict[str, float]:
    """EM, F1 and searches run per trajectory from per-question score rows (`evaluate`'s), under each
    row's prefix (`eval`, `eval_sampled`): overall, per data source and per question type, with n."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["eval"], []).append(r)
        groups.setdefault(f"{r['eval']}/{r['data_source']}", []).append(r)
        if r["type"]:
            groups.setdefault(f"{r['eval']}/type/{r['type']}", []).append(r)
    out: dict[str, float] = {}
    for key, rs in groups.items():
        for name, field_ in (("em", "em"), ("f1", "f1"), ("searches_mean", "searches")):
            out[f"{key}/{name}"] = sum(r[field_] for r in rs) / len(rs)
    for prefix in dict.fromkeys(r["eval"] for r in rows):
        out[f"{prefix}/n"] = float(len(groups[prefix]))
    return out


def evaluate_all(
    loop: AgentLoop,
    prompts: PromptSet,
    rollout: RolloutConfig,
    run: RunConfig,
    scores: list[dict] | None = None,
    keep: list[Trajectory] | None = None,
) -> dict[str, float]:
    """Greedy EM/F1 under eval/, plus, with run.eval_sampled, EM/F1 of one sample at
    rollout.temperature under eval_sampled/ (what GRPO optimises; greedy EM can sit still while
    the sampled policy sharpens). The greedy trajectories are appended to `keep` if given."""
    out = evaluate(loop, prompts, rollout, scores=scores, keep=keep)
    if run.eval_sampled:
        gen = loop.engine.generator  # vLLM draws each request's seed from it too
        state = gen.get_state()
        gen.manual_seed(run.seed)  # the same draws at every evaluation
        try:
            out.update(evaluate(loop, prompts, rollout, rollout.temperature, "eval_sampled", scores=scores))
        finally:
            gen.set_state(state)  # training rollouts (and --resume) never see the eval's draws
    return out


def evaluate_step(
    loop: AgentLoop,
    test_set: PromptSet,
    rollout: RolloutConfig,
    run: RunConfig,
    world: World,
    out_dir: Path,
    step: int,
    tokenizer,
    logger: MetricsLogger,
) -> dict[str, float]:
    """The trainer's evaluation at `step`: every rank evaluates its contiguous share of the test set with its
    own rollout engine (no collectives inside); rank 0 gathers the per-question scores and trajectories, in the
    test set's order, and computes the metrics (empty on the other ranks). Each question's scores go to
    `out_dir`/eval/step_N.jsonl (for paired comparisons between steps, with the rank that ran it), the greedy
    trajectories to `out_dir`/eval_trajectories/step_N.jsonl (for `agent-rl view`), and the evaluation's
    seconds to `timing/eval_s`."""
    result: dict[str, float] = {}
    ts = test_set
    lo, hi = (len(ts.items) * r // world.world_size for r in (world.rank, world.rank + 1))
    share = PromptSet(ts.items[lo:hi], ts.metadata[lo:hi], ts.questions[lo:hi])
    scores: list[dict] = []
    trajs: list[Trajectory] = []
    start = time.perf_counter()
    if share.items:
        evaluate_all(loop, share, rollout, run, scores, keep=trajs)
    for r in scores:
        r["rank"] = world.rank
    parts, traj_parts = world.gather_object(scores), world.gather_object(trajs)
    if world.is_main:
        prefixes = dict.fromkeys(r["eval"] for part in parts for r in part)
        scores = [r for prefix in prefixes for part in parts for r in part if r["eval"] == prefix]
        trajs = [t for part in traj_parts for t in part]
        result = score_metrics(scores)
        result["timing/eval_s"] = time.perf_counter() - start
        path = out_dir / "eval" / f"step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in scores))
        traj_path = out_dir / "eval_trajectories" / f"step_{step}.jsonl"
        write_trajectories(traj_path, trajs, tokenizer)
        logger.log_trajectories(step, "eval/trajectories", traj_path)
    world.barrier()
    return result


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def score_shard(
    loop: AgentLoop,
    prompts: PromptSet,
    spec: dict,
    folder: Path,
    shard: int = 0,
    shards: int = 1,
    on_trajectories: Callable[[list[Trajectory]], None] | None = None,
) -> int:
    """Score this shard's chunks that no part file holds complete yet; returns how many it scored.
    A progress line per chunk goes to stderr."""
    dec = spec["decoding"]
    plan = chunks(len(prompts.items), spec["chunk_size"])
    path = folder / f"part-{shard}.jsonl"
    _keep_complete(path, spec)
    done = complete_chunks(folder, spec)
    mine = [c for c in range(len(plan)) if c % shards == shard]
    todo = [c for c in mine if c not in done]
    total = sum(len(plan[c]) for c in mine)
    finished = total - sum(len(plan[c]) for c in todo)
    who = f"shard {shard}/{shards}: " if shards > 1 else ""
    if finished:
        print(f"[eval] {who}resuming: {finished} of {total} questions already scored in {folder}", file=sys.stderr)
    start, scored = time.perf_counter(), 0
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for c in todo:
            rows = plan[c]
            items = [prompts.items[i] for i in rows]
            meta = {prompts.items[i].prompt_id: prompts.metadata[i] for i in rows}
            loop.engine.generator.manual_seed(dec["seed"] * 1_000_003 + c)  # this chunk's draws, however it is run
            trajs = loop.run(items, group_size=dec["pass_k"], temperature=dec["temperature"], top_p=dec["top_p"])
            records = sorted(
                (trajectory_record(c, t, meta[t.prompt_id]) for t in trajs), key=lambda r: (r["id"], r["sample"])
            )
            _write_all(fd, "".join(json.dumps(r) + "\n" for r in records).encode())
            if on_trajectories is not None:
                on_trajectories(trajs)
            finished += len(rows)
            scored += len(rows)
            rate = scored / max(1e-9, time.perf_counter() - start)
            print(
                f"[eval] {who}{finished}/{total} questions ({100 * finished / max(1, total):.0f}%), "
                f"{rate:.2f} questions/s, about {(total - finished) / max(rate, 1e-9):.0f} s left",
                file=sys.stderr,
                flush=True,
            )
    finally:
        os.close(fd)
    return scored


def merge(folder: Path) -> dict:
    """The report of the evaluation in `folder`: its spec (what was evaluated, on which questions
    and retriever) and the table. Raises EvalMismatch naming the chunks no part file holds yet."""
    spec = json.loads((folder / SPEC).read_text())
    done = complete_chunks(folder, spec)
    plan = chunks(spec["subset"]["n"], spec["chunk_size"])
    missing = [c for c in range(len(plan)) if c not in done]
    if missing:
        raise EvalMismatch(
            f"{folder}: {len(missing)} of {len(plan)} chunks are not scored yet (chunks {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}); run the shards that own them (chunk c: shard c mod n)"
        )
    records = [r for c in range(len(plan)) for r in done[c]]
    table = summarise(records, spec["decoding"]["pass_k"])
    flat = {"eval/n": float(table["all"]["n"]), "eval/em": table["all"]["em"], "eval/f1": table["all"]["f1"]}
    for source, row in table["sources"].items():
        flat |= {f"eval/{source}/em": row["em"], f"eval/{source}/f1": row["f1"]}
    return {**spec, "table": table, **flat}
