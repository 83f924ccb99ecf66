"""The trainer's side of the retriever's memory: `retriever.kind` takes every kind `retriever-build`
offers (and `retriever.factory` with kind factory), first use builds the configured kind, and
`agent-rl plan` counts the retriever-server a run starts on this machine as a host component,
planned from a built index's manifest or, before first use builds it, from the corpus. And the
build's own peak RAM (`retriever-build --plan`'s `build_rss_bytes`) against real builds in child
processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_fixtures import FIXTURES, ROOT

CORPUS = FIXTURES / "hotpotqa100" / "corpus.jsonl"


def _corpus(tmp_path: Path, lines: int) -> Path:
    out = tmp_path / "corpus.jsonl"
    out.write_text("\n".join(CORPUS.read_text().splitlines()[:lines]) + "\n")
    return out


def test_retriever_kind_takes_every_kind_the_builder_offers():
    """Every kind of `retriever_server.plan.KINDS` loads; kind factory without retriever.factory, and
    retriever.factory with another kind, fail at load naming the key and the fix."""
    from agent_rl.config import ConfigError, load_config
    from retriever_server.plan import KINDS

    for kind in KINDS:
        if kind != "factory":
            assert load_config(None, [f"retriever.kind={kind}"]).retriever.kind == kind
    cfg = load_config(None, ["retriever.kind=factory", "retriever.factory=IVF4,SQ8"])
    assert (cfg.retriever.kind, cfg.retriever.factory) == ("factory", "IVF4,SQ8")
    with pytest.raises(ConfigError, match=r"retriever\.kind=factory needs retriever\.factory"):
        load_config(None, ["retriever.kind=factory"])
    with pytest.raises(ConfigError, match=r"retriever\.factory=.*only read with retriever\.kind=factory"):
        load_config(None, ["retriever.kind=hnsw_sq8", "retriever.factory=IVF4,SQ8"])
    with pytest.raises(ConfigError, match=r"retriever\.kind = 'hnsw32' is not one of .*ivf_pq"):
        load_config(None, ["retriever.kind=hnsw32"])


def test_first_use_builds_the_configured_factory_index(tmp_path, capsys):
    """`ensure_index` passes retriever.kind and retriever.factory to retriever-build: 60 fixture
    passages become an 'IVF2,SQ8' index; a later run configured as flat serves it as built and says so."""
    from agent_rl.bootstrap.prepare import ensure_index
    from agent_rl.config import load_config

    corpus, index = _corpus(tmp_path, 60), tmp_path / "index"
    overrides = [f"retriever.corpus={corpus}", f"retriever.index_dir={index}"]
    ensure_index(load_config(None, [*overrides, "retriever.kind=factory", "retriever.factory=IVF2,SQ8"]).retriever)
    manifest = json.loads((index / "manifest.json").read_text())
    assert (manifest["kind"], manifest["count"], manifest["build"]["factory"]) == ("factory", 60, "IVF2,SQ8")
    capsys.readouterr()
    ensure_index(load_config(None, [*overrides, "retriever.kind=flat"]).retriever)
    assert "holds a factory index, retriever.kind is flat" in capsys.readouterr().err


def test_plan_counts_the_retriever_server_of_a_built_index(hotpot_index_dir, capsys):
    """With retriever.url unset and a built index in retriever.index_dir, `agent-rl plan` adds
    host/retriever_server to both phases: the planned RSS at start of `retriever_server.plan` for
    that index (`plan_served`, which tests/test_retriever_scale.py holds against served processes).
    The text names it and where it was planned from; with retriever.url set it is not counted, and
    the text says why."""
    from agent_rl.cli import main
    from retriever_server.plan import plan_served

    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    expected = plan_served(hotpot_index_dir, manifest).server_rss_start_bytes
    local = ["plan", str(ROOT / "configs" / "tiny_cpu_grpo.yaml"), f"retriever.index_dir={hotpot_index_dir}"]
    main([*local, "--json"])
    res = json.loads(capsys.readouterr().out)
    for phase in res["phases"].values():
        assert phase["components"]["host/retriever_server"] == expected
    assert res["components"]["host/retriever_server"] == expected
    assert res["retriever"]["source"] == "index" and res["retriever"]["count"] == 200
    main(local)
    text = capsys.readouterr().out
    assert "retriever_server" in text and f"planned from its manifest in {hotpot_index_dir}" in text

    main([*local, "retriever.url=http://127.0.0.1:9", "--json"])
    remote = json.loads(capsys.readouterr().out)
    assert "host/retriever_server" not in remote["components"]
    assert res["host_peak_bytes"] - remote["host_peak_bytes"] == expected
    main([*local, "retriever.url=http://127.0.0.1:9"])
    assert "retriever: retriever.url is set" in capsys.readouterr().out


def test_plan_counts_an_index_before_first_use_builds_it(tmp_path, tiny_model_dir):
    """With no index yet, the retriever-server is planned from retriever.corpus (its 300 passages,
    the default encoder's 384 dims) as retriever.kind: `plan_build`'s RSS at start, with nothing
    built; under retriever.replay (misses an error) none starts and none is counted. On a host too small,
    the fixes name a retriever elsewhere and the compressed kind."""
    from agent_rl.config import load_config
    from agent_rl.planning.plan import plan, render
    from retriever_server.plan import plan_build

    corpus, index = _corpus(tmp_path, 300), tmp_path / "index"
    base = [f"model.path={tiny_model_dir}", f"retriever.corpus={corpus}", f"retriever.index_dir={index}"]
    res = plan(load_config(None, [*base, "retriever.kind=hnsw_sq8"]))
    expected = plan_build(corpus, "hnsw_sq8").server_rss_start_bytes
    assert res.components["host/retriever_server"] == expected
    r = res.retriever
    assert (r["source"], r["count"], r["dim"], r["factory"]) == ("corpus", 300, 384, "HNSW32,SQ8")
    assert "planned from retriever.corpus (first use builds" in render(res)
    assert not index.exists()

    res = plan(load_config(None, [*base, "retriever.kind=factory", "retriever.factory=IVF4,PQ8"]))
    assert res.retriever["factory"] == "IVF4,PQ8"
    assert (
        res.components["host/retriever_server"]
        == plan_build(corpus, "factory", factory="IVF4,PQ8").server_rss_start_bytes
    )

    replayed = plan(load_config(None, [*base, f"retriever.replay={tmp_path / 'record'}"]))
    assert "host/retriever_server" not in replayed.components and "retriever.replay" in replayed.retriever["why"]

    small = plan(load_config(None, [*base, "retriever.kind=flat"]), host_mem_gib=0.5)
    assert not small.fits
    fixes = {f["fix"].split(" ")[0]: f for f in small.fixes}
    assert fixes["retriever.url=URL"]["saves_bytes"] == small.components["host/retriever_server"]
    assert fixes["retriever.kind=ivf_pq"]["saves_bytes"] > 0


# In a child process: `faiss_index` (FACTORY, TRAIN_SIZE) over a mapped float32 .npy file (VECTORS), every
# page of it read first (as after retriever-build's encoding wrote it); VmHWM is reset (clear_refs 5) when
# the index phase starts, so its peak anonymous RSS is VmHWM less the mapped pages, which stay put.
_INDEX_PHASE = """
import json, sys
from pathlib import Path
import faiss, numpy as np
from retriever_server.build import faiss_index

def status():
    lines = (line.partition(":") for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(v.split()[0]) * 1024 for k, _, v in lines if v.strip().endswith("kB")}

x = np.load(sys.argv[1], mmap_mode="r")
float(np.asarray(x).sum())
before = status()
Path("/proc/self/clear_refs").write_text("5")
faiss_index(sys.argv[2], x, train_size=int(sys.argv[3]))
after = status()
print(json.dumps({"before": before["RssAnon"], "peak": after["VmHWM"] - after["RssFile"] - after.get("RssShmem", 0)}))
"""

# In a child process: retriever-build's `build_index` (CORPUS, OUT, KIND) with the same marks: the
# anonymous RSS kept once every passage is encoded, and the index phase's peak.
_WHOLE_BUILD = """
import json, sys
from pathlib import Path
import retriever_server.build as rb

def status():
    lines = (line.partition(":") for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(v.split()[0]) * 1024 for k, _, v in lines if v.strip().endswith("kB")}

marks, faiss_index = {}, rb.faiss_index

def index_phase(*args, **kwargs):
    marks["encoded"] = status()["RssAnon"]
    Path("/proc/self/clear_refs").write_text("5")
    got = faiss_index(*args, **kwargs)
    end = status()
    marks["index_peak"] = end["VmHWM"] - end["RssFile"] - end.get("RssShmem", 0)
    return got

rb.faiss_index = index_phase
rb.build_index(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
print(json.dumps(marks))
"""


def _child(code: str, *args: str) -> dict:
    """Run `code` in a fresh Python under glibc's malloc (the plan's constants were measured so; `make
    test` preloads mimalloc) and read the JSON line it prints."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_build_ram_is_planned_by_phase(tmp_path, capsys):
    """`retriever-build --plan` plans the build's peak anonymous RSS: what it keeps through the build
    (baseline, store batch, encoder, arena, chunk tokens) + the larger of the encoding phase's chunk
    and the index phase's training and adding, shown in the table and in --json beside the
    mapped vector file. Hand-computed: a flat index of 100,000 x 384 is added in one call, its codes
    sized once (146.5 MiB, no growth copy beside them); the training terms grow with the sample and
    stop at --train-size; flat trains nothing; bm25 plans no build."""
    from retriever_server.build import main
    from retriever_server.plan import ENCODER_ANON_PER_FILE_BYTE, build_peak, plan_build

    corpus = _corpus(tmp_path, 300)
    plans = {kind: plan_build(corpus, kind, count=100_000) for kind in ("flat", "hnsw_sq8", "ivf_pq")}
    for plan in plans.values():
        p = plan.build_parts
        kept = p["baseline"] + p["store_batch"] + p["encoder"] + p["encoder_arena"] + p["chunk_tokens"]
        assert plan.build_rss_bytes == build_peak(p) == kept + max(p["encode_chunk"], p["index_train"], p["index_add"])
        assert p["encoder"] == int(plan.encoder_bytes * ENCODER_ANON_PER_FILE_BYTE)  # the packed copy
        assert p["encode_chunk"] > 8192 * 384 * 4
        assert plan.build_mapped_bytes == 100_000 * 384 * 4 + 128
    flat = plans["flat"].build_parts
    assert flat["index_train"] == 0 and flat["index_add"] == 100_000 * 1536
    assert plans["hnsw_sq8"].build_parts["index_train"] == 100_000 * 384 * 4  # SQ's min/max: the sample alone
    trained = [plan_build(corpus, "factory", factory="IVF1024,PQ48", count=n).build_parts["index_train"]
               for n in (100_000, 262_144, 400_000, 1_000_000)]  # fmt: skip
    assert trained[0] < trained[1] == trained[2] == trained[3]  # the sample stops at 262,144 rows
    small = plan_build(corpus, "factory", factory="IVF1024,PQ48", count=400_000, train_size=100_000)
    assert small.build_parts["index_train"] == trained[0]
    assert plan_build(corpus, "bm25").build_rss_bytes == 0

    assert main(["--corpus", str(corpus), "--kind", "ivf_pq", "--plan", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["build_rss_bytes"] == plan_build(corpus, "ivf_pq").build_rss_bytes > 0
    assert set(res["build_parts"]) >= {"index_train", "index_add", "encoder_arena"} and res["build_mapped_bytes"]
    assert main(["--corpus", str(corpus), "--kind", "ivf_pq", "--plan"]) == 0
    assert "build RAM, peak anonymous" in capsys.readouterr().out


@pytest.mark.parametrize(("factory", "count"), [("Flat", 70_000), ("IVF16,SQ8", 40_000)])
def test_index_phase_memory_matches_the_plan(tmp_path, factory, count):
    """A real `faiss_index` over a mapped file of synthetic vectors, in a child process: its index
    phase's peak anonymous RSS above where it started is within 15% of the plan's larger of training
    and adding. Flat's peak is its index, added in one call (in batches std::vector's growth copy made
    it 1.9 x the index here); IVF16,SQ8's is training: the sample and its residuals."""
    import numpy as np

    from retriever_server.plan import DEFAULT_TRAIN_SIZE, plan_index

    vectors = tmp_path / "vectors.npy"
    np.save(vectors, np.random.default_rng(0).random((count, 384), dtype=np.float32))
    plan = plan_index(count, 384, "factory", 0, factory=factory)
    planned = max(plan.build_parts["index_train"], plan.build_parts["index_add"])
    got = _child(_INDEX_PHASE, str(vectors), factory, str(DEFAULT_TRAIN_SIZE))
    measured = got["peak"] - got["before"]
    assert abs(planned / measured - 1) < 0.15, (planned, measured)
    if factory == "Flat":  # the codes sized once: no growth copy beside them
        assert measured < 1.1 * plan.index_bytes


def test_whole_build_memory_matches_the_plan(tmp_path):
    """retriever-build over 300 fixture passages (encoder, arena, tokens; a flat index), in a child
    process: its peak anonymous RSS (kept after encoding, or the index phase's peak) is within 30% of
    `plan_build`'s build_rss_bytes (the baseline and the arena are constants measured on one machine)."""
    from retriever_server.plan import plan_build

    corpus = _corpus(tmp_path, 300)
    got = _child(_WHOLE_BUILD, str(corpus), str(tmp_path / "index"), "flat")
    measured = max(got["encoded"], got["index_peak"])
    planned = plan_build(corpus, "flat").build_rss_bytes
    assert abs(planned / measured - 1) < 0.3, (planned, measured, got)
