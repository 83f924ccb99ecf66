"""`agent-rl eval` as the papers' table: several test sets, per-source rows with bootstrap intervals
and their unweighted mean, the exact questions recorded; a killed evaluation resumes to the same
scores; shards (processes or torchrun ranks) merge to the unsharded table; a LoRA run's checkpoint
evaluates under vLLM (adapters merged into a temporary dir) to the HF engine's scores. Plus the pure
table math on hand-made records."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from agent_fixtures import start_server, torchrun_cmd, toy_world_overrides

from agent_rl.reports.eval_report import macro_interval, paired_interval, summarise, to_markdown

ROOT = Path(__file__).resolve().parents[1]
# One thread everywhere: torchrun's ranks run with one, and greedy scores must match bit for bit.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _overrides(cache: Path, out: Path) -> list[str]:
    return [
        f"run.output_dir={out}",
        "run.tensorboard=false",
        *toy_world_overrides(cache),
        "budget.max_turns=3",
    ]


@pytest.fixture(scope="module")
def world(toy_warm_start, tmp_path_factory):
    """The session's toy world, tiny model and index, and its short SFT warm start (`toy_warm_start`:
    it searches and answers, wrong mostly, so trajectories differ from question to question); two test
    sets cut from the toy test split (`toy_a`, 6 questions; `toy_b`, 5); one retriever server."""
    cache = toy_warm_start["cache"]
    sets = tmp_path_factory.mktemp("eval_sets")
    rows = pq.read_table(cache / "world" / "test.parquet").to_pylist()
    files = []
    for name, part in (("toy_a", rows[:6]), ("toy_b", rows[6:11])):
        for r in part:
            r["uid"] = f"{name}-{r['uid']}"
            r["data_source"] = name
        files.append(sets / f"{name}.parquet")
        pq.write_table(pa.Table.from_pylist(part), files[-1])
    with start_server(cache / "index") as (_, url):
        yield {"cache": cache, "sft": toy_warm_start["sft"], "files": files, "url": url}


def _eval(world, out: Path, *extra: str, env=None, launcher=None, overrides=(), checkpoint=None):
    cmd = [*(launcher or [sys.executable, "-m", "agent_rl.cli"]), "eval", "configs/tiny_cpu_grpo.yaml"]
    cmd += [*_overrides(world["cache"], out.parent), *overrides, "--checkpoint", str(checkpoint or world["sft"])]
    cmd += ["--retriever-url", world["url"], "--data", *map(str, world["files"]), "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=900)


def _records(out: Path) -> list[dict]:
    folder = out.with_name(out.stem + "_questions")
    rows = [json.loads(line) for p in sorted(folder.glob("part-*.jsonl")) for line in p.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["id"], r["sample"]))


@pytest.fixture(scope="module")
def whole(world, tmp_path_factory) -> Path:
    """One uninterrupted, unsharded greedy evaluation of both sets in chunks of 2 questions."""
    out = tmp_path_factory.mktemp("whole") / "eval.json"
    res = _eval(world, out, "--chunk-size", "2")
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def test_two_test_sets_give_per_source_rows_their_mean_and_the_subset(world, whole):
    """Two data sources: a row each (EM, F1, n, searches, response tokens, end-reason shares, 95%
    intervals), the unweighted mean over them, the question ids in order and the retriever's index
    fingerprint, in JSON and in Markdown; a progress line per chunk on stderr."""
    report = json.loads(whole.read_text())
    table = report["table"]
    assert set(table["sources"]) == {"toy_a", "toy_b"}
    a, b = table["sources"]["toy_a"], table["sources"]["toy_b"]
    assert (a["n"], b["n"]) == (6, 5)
    for row in (a, b):
        assert {"em", "f1", "searches_mean", "response_tokens_mean", "end_reasons"} <= set(row)
        for key in ("em", "f1"):
            lo, hi = row[f"{key}_ci95"]
            assert lo <= row[key] <= hi
        assert sum(row["end_reasons"].values()) == pytest.approx(1.0)
    mean = table["mean_over_datasets"]
    assert mean["em"] == pytest.approx((a["em"] + b["em"]) / 2)
    assert mean["response_tokens_mean"] == pytest.approx((a["response_tokens_mean"] + b["response_tokens_mean"]) / 2)
    assert len(mean["em_ci95"]) == 2 and mean["datasets"] == 2
    want = [r["uid"] for f in world["files"] for r in pq.read_table(f).to_pylist()]
    assert report["subset"]["ids"] == want and report["subset"]["n"] == 11
    assert report["retriever"]["index_fingerprint"] and report["retriever"]["topk"] >= 1
    assert report["decoding"]["pass_k"] == 1 and report["decoding"]["temperature"] == 0
    md = whole.with_suffix(".md").read_text()
    assert "| toy_a | 6 |" in md and "| toy_b | 5 |" in md and "mean over datasets" in md
    assert report["retriever"]["index_fingerprint"] in md
    records = _records(whole)
    assert len(records) == 11 and {r["chunk"] for r in records} == set(range(6))


def test_killed_evaluation_resumes_to_the_same_scores(world, whole, tmp_path):
    """SIGKILL after two chunks, a torn write left behind (half a chunk and a cut line); the rerun
    skips the scored chunks, redoes the torn one and gives the uninterrupted run's records and table."""
    out = tmp_path / "eval.json"
    killer = [sys.executable, str(ROOT / "tests" / "kill_after_chunks.py"), "2"]  # SIGKILL after 2 chunks
    res = _eval(world, out, "--chunk-size", "2", launcher=killer)
    assert res.returncode == -9, res.stderr[-4000:]
    part = tmp_path / "eval_questions" / "part-0.jsonl"
    lines = part.read_text().splitlines()
    assert len(lines) == 4 and not out.exists()
    torn = next(r for r in _records(whole) if r["chunk"] == 2)  # half of chunk 2, altered, then a cut line
    with part.open("a") as fh:
        fh.write(json.dumps(torn | {"em": 1.0}) + "\n" + '{"chunk": 3, "id": "toy_a-')
    res = _eval(world, out, "--chunk-size", "2")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resuming: 4 of 11 questions already scored" in res.stderr
    assert _records(out) == _records(whole)
    assert json.loads(out.read_text())["table"] == json.loads(whole.read_text())["table"]
    # Another evaluation into the same folder is refused, not mixed in.
    res = _eval(world, out, "--chunk-size", "3")
    assert res.returncode == 2 and "chunk_size" in res.stderr and "--fresh" in res.stderr


def test_two_shards_merge_to_the_unsharded_table(world, whole, tmp_path):
    """`--shard 0/2` and `--shard 1/2`: each scores its chunks; the first leaves the merge to the
    other, whose table and records equal the unsharded run's; `eval-report` rewrites it."""
    out = tmp_path / "eval.json"
    res = _eval(world, out, "--chunk-size", "2", "--shard", "0/2")
    assert res.returncode == 0 and "eval-report" in res.stderr and not out.exists(), res.stderr[-4000:]
    res = _eval(world, out, "--chunk-size", "2", "--shard", "1/2")
    assert res.returncode == 0, res.stderr[-4000:]
    assert _records(out) == _records(whole)
    assert json.loads(out.read_text())["table"] == json.loads(whole.read_text())["table"]
    out.unlink()
    res = subprocess.run(
        [sys.executable, "-m", "agent_rl.cli", "eval-report", str(tmp_path / "eval_questions")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and json.loads(out.read_text())["table"] == json.loads(whole.read_text())["table"]


def test_torchrun_two_ranks_merge_to_the_unsharded_table(world, whole, tmp_path):
    """`torchrun --nproc-per-node 2 -m agent_rl eval`: gloo ranks score alternate chunks into their own
    part files; rank 0 merges them into the unsharded run's table."""
    out = tmp_path / "eval.json"
    res = _eval(world, out, "--chunk-size", "2", launcher=torchrun_cmd(2, "-m", "agent_rl"))
    assert res.returncode == 0, res.stderr[-4000:]
    folder = tmp_path / "eval_questions"
    assert (folder / "part-0.jsonl").exists() and (folder / "part-1.jsonl").exists()
    assert _records(out) == _records(whole)
    assert json.loads(out.read_text())["table"] == json.loads(whole.read_text())["table"]


def _lora_checkpoint(world, root: Path) -> Path:
    """A LoRA run's checkpoint `root/checkpoints/step_1`, written as the trainer writes one (`load_policy`
    wraps the warm start in peft adapters, `save_checkpoint` saves them). The adapters' B is seeded noise
    (fresh adapters are a no-op), small enough that the policy still searches and answers."""
    import torch

    from agent_rl.config import load_config
    from agent_rl.learn.policy import load_policy
    from agent_rl.runtime.checkpoint import save_checkpoint

    cfg = load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [*_overrides(world["cache"], root), f"model.warm_start={world['sft']}", "model.lora.enabled=true"],
    )
    policy = load_policy(cfg.model, str(world["sft"]), "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return save_checkpoint(root / "checkpoints", 1, policy, None, None, {}, cfg.to_dict(), keep_last=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make setup` on x86-64")
def test_torchrun_ranks_each_run_their_own_vllm_engine_on_a_lora_checkpoint(world, whole, tmp_path):
    """`rollout.engine=vllm` under torchrun on a LoRA run's own `step_N`, one command: rank 0 merges the
    adapters once into a temporary directory beside the output (vLLM serves plain weights), each rank
    builds its own in-process vLLM engine on it (vLLM builds its groups on the trainer's process group),
    scores its chunks and closes the engine before the group is destroyed, and the directory is gone at
    the end. A clean exit (vLLM's shutdown at exit used to fail on the destroyed group), and the EM and
    per-question records of the HF engine's unsharded run of the unmerged peft model (greedy decoding
    agrees), whose answers are not the base model's."""
    step = _lora_checkpoint(world, tmp_path / "run")
    outs = {engine: tmp_path / engine / "eval.json" for engine in ("hf", "vllm")}
    for engine, launcher in (("hf", None), ("vllm", torchrun_cmd(2, "-m", "agent_rl"))):
        res = _eval(
            world,
            outs[engine],
            "--chunk-size",
            "2",
            launcher=launcher,
            overrides=(f"model.warm_start={world['sft']}", f"rollout.engine={engine}", "rollout.cpu_kv_cache_gib=1"),
            checkpoint=step,
        )
        assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr and "Invalid process group" not in res.stderr, res.stderr[-4000:]
    assert (res.stdout + res.stderr).count("Initializing a V1 LLM engine") == 2  # one engine per rank
    assert res.stderr.count("holds LoRA adapters: merged into") == 1  # rank 0 merges, every rank loads it
    assert sorted(p.name for p in outs["vllm"].parent.iterdir()) == ["eval.json", "eval.md", "eval_questions"]
    folder = tmp_path / "vllm" / "eval_questions"
    assert (folder / "part-0.jsonl").exists() and (folder / "part-1.jsonl").exists()
    hf, vllm = (json.loads(outs[engine].read_text()) for engine in ("hf", "vllm"))
    assert vllm["decoding"]["engine"] == "vllm" and vllm["model_fingerprint"] == hf["model_fingerprint"]
    assert vllm["eval/em"] == hf["eval/em"]
    assert _records(outs["vllm"]) == _records(outs["hf"])
    assert hf["model_fingerprint"] != json.loads(whole.read_text())["model_fingerprint"]  # not the base weights
    # The adapters change what the policy writes: an answer, or the length of a query or an answer (a noise this small
    # may leave every greedy answer as it was on one CPU's arithmetic and not on another's).
    written = ("answer", "response_tokens", "searches", "turns")
    outputs = {out: {r["id"]: [r[k] for k in written] for r in _records(out)} for out in (outs["hf"], whole)}
    assert outputs[outs["hf"]] != outputs[whole]


def test_pass_at_k_samples_k_per_question(world, tmp_path):
    """`--pass-k 2`: two sampled trajectories per question at rollout.temperature; pass@2 is reported
    beside the per-sample EM, and is at least it."""
    out = tmp_path / "eval.json"
    res = _eval(world, out, "--pass-k", "2", "--chunk-size", "4", "--per-source", "3")
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(out.read_text())
    row = report["table"]["sources"]["toy_a"]
    assert row["n"] == 3 and row["trajectories"] == 6 and row["pass@2"] >= row["em"]
    assert report["decoding"]["temperature"] > 0 and report["subset"]["n"] == 6
    assert "pass@2" in out.with_suffix(".md").read_text()


def _rec(source, qid, em, sample=0, reason="answer", searches=1, tokens=10):
    return {"id": qid, "data_source": source, "type": "", "sample": sample, "em": em, "f1": em,
            "searches": searches, "response_tokens": tokens, "end_reason": reason}  # fmt: skip


def test_table_math_on_hand_made_records():
    """Per-source means over trajectories, pass@k over questions, end-reason shares, the unweighted
    mean over sources (not the pooled one), intervals that bracket the means."""
    records = [
        _rec("a", "a1", 1.0, 0), _rec("a", "a1", 0.0, 1, reason="max_turns", tokens=30),
        _rec("a", "a2", 0.0, 0), _rec("a", "a2", 0.0, 1),
        _rec("b", "b1", 1.0, 0), _rec("b", "b1", 1.0, 1),
    ]  # fmt: skip
    t = summarise(records, pass_k=2)
    a, b = t["sources"]["a"], t["sources"]["b"]
    assert (a["n"], a["trajectories"], a["em"], a["pass@2"]) == (2, 4, 0.25, 0.5)
    assert a["end_reasons"] == {"answer": 0.75, "max_turns": 0.25} and a["response_tokens_mean"] == 15
    assert (b["em"], b["pass@2"]) == (1.0, 1.0)
    assert t["mean_over_datasets"]["em"] == pytest.approx(0.625)  # (0.25 + 1.0) / 2
    assert t["all"]["em"] == pytest.approx(0.5)  # pooled over 3 questions: (0.5 + 0 + 1) / 3
    lo, hi = t["mean_over_datasets"]["em_ci95"]
    assert 0.5 <= lo <= 0.625 <= hi <= 0.75  # b never varies; a's question means are 0.5 and 0
    assert macro_interval([[1.0] * 5]) == (1.0, 1.0)
    lo, hi = paired_interval([0.0] * 50, [1.0] * 25 + [0.0] * 25)
    assert lo < 0.5 < hi
    subset = {"n": 3, "ids_sha256": "0" * 64, "max_samples": 0, "per_source": 0, "seed": 0, "dropped": {}}
    report = {
        "table": t,
        "decoding": {"pass_k": 2, "temperature": 1.0, "top_p": 1.0},
        "checkpoint": "c",
        "model_fingerprint": "m",
        "data": ["d"],
        "retriever": {"index_fingerprint": "f", "topk": 3, "url": "u"},
        "subset": subset,
    }
    md = to_markdown(report)
    assert "| a | 2 | 0.250 [" in md and "pass@2" in md and "2 sets" in md
