"""The trainer's side of the retriever's memory: `retriever.kind` takes every kind `retriever-build`
offers (and `retriever.factory` with kind factory), first use builds the configured kind, and
`agent-rl plan` counts the retriever-server a run starts on this machine as a host component,
planned from a built index's manifest or, before first use builds it, from the corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from agent_fixtures import FIXTURES, ROOT, start_server

CORPUS = FIXTURES / "hotpotqa100" / "corpus.jsonl"
QUESTIONS = FIXTURES / "hotpotqa100" / "questions.jsonl"


def _corpus(tmp_path: Path, lines: int) -> Path:
    out = tmp_path / "corpus.jsonl"
    out.write_text("\n".join(CORPUS.read_text().splitlines()[:lines]) + "\n")
    return out


def _vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


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
    that index (`plan_served`), which a real server over it, after a batch of 32 queries, matches
    within 15%. The text names it and where it was planned from; with retriever.url set it is not
    counted, and the text says why."""
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

    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    with start_server(hotpot_index_dir) as (proc, url):
        requests.post(f"{url}/retrieve", json={"queries": questions[:32], "topk": 10}, timeout=60).raise_for_status()
        rss = _vm_rss(proc.pid)
    assert abs(expected / rss - 1) < 0.15, (expected, rss)


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
