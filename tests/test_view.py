"""`agent-rl view`: a static report of real trajectories, read back through headless Chromium's DOM.

The rollouts are real: the agent loop against a real retriever server over a real flat index
whose corpus holds one document with a `<script>` payload, driven by a scripted engine (a known
query) and by the tiny model sampling. The payload and model text must render as text. A
2-step training run writes its trajectories with the trainer's log-probs and advantages
aligned with the response tokens, and `agent-rl rollout` / `agent-rl eval --trajectories` files
feed the same report.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agent_fixtures import FIXTURES, ScriptedEngine, start_server
from test_async_rollout import _items

from agent_rl.reports.view import read_records, script_json, write_report
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.engines import HFEngine
from agent_rl.rollout.loop import AgentLoop
from agent_rl.rollout.rewards import compute_reward
from agent_rl.rollout.trajectory import write_trajectories
from retriever_server.client import RetrieverClient

ROOT = Path(__file__).resolve().parents[1]
# Run, it would mark the page; as text it must not. Chromium serialises attributes as name="value".
PAYLOAD = (
    "<script>document.body.setAttribute('data-pwned','1')</script>"
    "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">"
)
PWNED = re.compile(r"data-pwned=\"")
QUERY = "Inception film directed by Christopher Nolan"
PAYLOAD_TITLE = "Inception (film)"
BUDGET = TokenBudget(
    max_turns=2, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=200, max_total_tokens=64 + 2 * 224 + 24
)


def _search_then_answer(ctx: str) -> str:
    return "<answer> Christopher Nolan </answer>" if "<information>" in ctx else f"<search> {QUERY} </search>"


@pytest.fixture(scope="module")
def payload_index(tmp_path_factory) -> Path:
    """A flat MiniLM index over 30 hotpotqa paragraphs and one about Inception whose text carries
    the payload (what a scraped web page could hold)."""
    from retriever_server.build import build_index

    work = tmp_path_factory.mktemp("payload_index")
    lines = (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()[:30]
    evil = {
        "id": "evil-0",
        "contents": f"{PAYLOAD_TITLE}\n{PAYLOAD} Inception is a 2010 science fiction film directed by Christopher "
        "Nolan.",
    }
    (work / "corpus.jsonl").write_text("\n".join([*lines, json.dumps(evil)]) + "\n")
    build_index(work / "corpus.jsonl", work / "index", kind="flat")
    return work / "index"


@pytest.fixture(scope="module")
def rollout_file(tiny_model_dir, payload_index, tmp_path_factory) -> Path:
    """Trajectories of a real loop over the real server: one scripted (known query, then an
    answer), four sampled by the tiny model; written as `agent-rl rollout` writes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    items = _items(tok, ["Who directed Inception?", "Where is the Eiffel Tower?"])
    for item in items:
        item.golden_answers = ["Christopher Nolan"]
    with start_server(payload_index) as (_, url):
        client = RetrieverClient(url, topk=3)
        trajs = AgentLoop(ScriptedEngine(tok, _search_then_answer), tok, client, BUDGET).run(items[:1], group_size=1)
        trajs += AgentLoop(HFEngine(model, tok, "cpu", 16, seed=0), tok, client, BUDGET).run(
            items, group_size=2, temperature=1.0
        )
        client.close()
    for t in trajs:
        t.reward = compute_reward("em", t.response_text, t.golden_answers)
    out = tmp_path_factory.mktemp("view") / "rollout.jsonl"
    write_trajectories(out, trajs, tok)
    return out


def _record(**changes) -> dict:
    """A hand-made record: two turns (search, answer) with one observation."""
    rec = {
        "prompt_id": "toy-1",
        "sample_idx": 0,
        "data_source": "toy",
        "prompt_tokens": 3,
        "response_tokens": 7,
        "total_tokens": 10,
        "turns": [
            {
                "action": "search",
                "gen_tokens": 2,
                "truncated": False,
                "query": "q",
                "obs_tokens": 3,
                "obs_truncated": True,
                "retrieval_ms": 4.2,
                "retriever_error": None,
                "docs": [{"id": "d", "title": "T", "score": 0.5, "text": "x"}],
            },
            {
                "action": "answer",
                "gen_tokens": 2,
                "truncated": False,
                "query": None,
                "obs_tokens": 0,
                "obs_truncated": False,
                "retrieval_ms": 0.0,
                "retriever_error": None,
                "docs": None,
            },
        ],
        "num_turns": 2,
        "end_reason": "answer",
        "loss_mask": [1, 1, 0, 0, 0, 1, 1],
        "response_ids": [5, 6, 7, 8, 9, 10, 11],
        "logprobs": [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4],
        "response_text": "<answer> Paris </answer>",
        "golden_answers": ["Paris"],
        "reward": 1.0,
        "excluded": False,
        "tokens": ["a", "b", "c", "d", "e", "f", "g"],
        "prompt_text": "Question: q",
    }
    rec.update(changes)
    return rec


def test_untrusted_text_is_escaped_everywhere(tmp_path):
    """A payload in every text a record carries (tokens, prompt, query, document title and text,
    error, ids, gold answers) appears only escaped: each page holds exactly its own two script
    elements (the data block and the page's script), and embedded JSON cannot close its element."""
    evil = _record(
        tokens=[PAYLOAD] * 7,
        prompt_text=PAYLOAD,
        prompt_id=PAYLOAD,
        data_source=PAYLOAD,
        end_reason=PAYLOAD,
        golden_answers=[PAYLOAD],
        response_text=f"<answer> {PAYLOAD} </answer>",
    )
    evil["turns"][0].update(
        query=PAYLOAD, retriever_error=PAYLOAD, docs=[{"id": PAYLOAD, "title": PAYLOAD, "score": 1.0, "text": PAYLOAD}]
    )
    src = tmp_path / "evil.jsonl"
    src.write_text(json.dumps(evil) + "\n")
    index = write_report([src], tmp_path / "report")
    for page in (index, tmp_path / "report" / "t" / "0.html"):
        text = page.read_text()
        assert text.count("<script") == 2 and text.count("</script>") == 2, page
        assert "<img" not in text and "setAttribute('data-pwned','1')</script>" not in text, page
    page = (tmp_path / "report" / "t" / "0.html").read_text()
    assert "&lt;script&gt;document.body.setAttribute(&#x27;data-pwned&#x27;,&#x27;1&#x27;)&lt;/script&gt;" in page
    assert "</script>" not in script_json({"x": "</script><!--"}) and json.loads(script_json({"x": "</script>"})) == {
        "x": "</script>"
    }


def test_bad_inputs_are_named(tmp_path):
    """A malformed line names its file and line; a missing input, an empty folder and a line
    that is no trajectory say what to give instead; the CLI exits 2 with the message."""
    good = json.dumps(_record())
    broken = tmp_path / "broken.jsonl"
    broken.write_text(f"{good}\n\n{{not json\n")
    with pytest.raises(ValueError, match=re.escape(f"{broken}:3: not a JSON line")):
        read_records([broken])
    odd = tmp_path / "odd.jsonl"
    odd.write_text(f"{good}\n{json.dumps({'prompt_id': 'x'})}\n")
    with pytest.raises(ValueError, match=re.escape(f"{odd}:2: not a trajectory record")):
        read_records([odd])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .jsonl"):
        read_records([tmp_path / "empty"])
    res = subprocess.run(
        [sys.executable, "-m", "agent_rl", "view", str(broken), "--out", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and f"{broken}:3" in res.stderr, res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "agent_rl", "view", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "missing.jsonl does not exist" in res.stderr, res.stderr


def test_turns_split_the_response_and_budget_hits_are_listed(tmp_path):
    """Each turn's generated and inserted tokens are its own `gen_tokens` and `obs_tokens`; the
    page names the cut observation, shows the masked count and computes EM/F1 when absent."""
    from agent_rl.reports.view import budget_hits, turn_segments

    rec = _record()
    assert [(len(g), len(o)) for _, g, o in turn_segments(rec)] == [(2, 3), (2, 0)]
    assert budget_hits(rec) == ["turn 1's observation was cut to fit the budget"]
    assert budget_hits(_record(end_reason="budget_total"))[-1] == "ended by the total token budget"
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    [read] = read_records([src])
    assert read["em"] == 1.0 and read["f1"] == 1.0
    write_report([src], tmp_path / "report")
    page = (tmp_path / "report" / "t" / "0.html").read_text()
    assert "<span id='masked-count'>3</span>" in page and "cut to fit the budget" in page and "score 0.5000" in page


def _chromium() -> str:
    """The Chromium executable; without one the browser test skips, except under CI (`CI=true`), where
    a skipped browser test would pass unseen, so it fails with the same message."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        why = (
            "headless Chromium is not installed: run `apt-get install -y chromium` (Debian; `make test` installs it "
            "when run as root)"
        )
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return exe


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), (None, pytest.skip.Exception)])
def test_a_missing_chromium_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    """With no Chromium on the PATH the browser test fails when `CI=true` (a CI run must not pass it
    by skipping) and skips otherwise, with the same message, which says how to install it."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    # Both outcomes caught, so that a skip where a failure is due fails this test rather than skipping it.
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as raised:
        _chromium()
    assert raised.type is outcome
    assert "headless Chromium is not installed: run `apt-get install -y chromium`" in str(raised.value)


def _browser(exe: str, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args],
        capture_output=True,
        text=True,
        timeout=180,
        # Chromium has its own allocator and dies under a preloaded one (`make test` preloads mimalloc).
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_report_renders_real_rollouts_in_headless_chromium(rollout_file, tmp_path):
    """Through the DOM after the pages' scripts ran: the known trajectory's query, a document
    title, end reason and masked-token count; the payload document from the real server shows as
    text and never runs; the index's script builds the table and applies filters from the URL;
    a screenshot is a real PNG."""
    exe = _chromium()
    recs = read_records([rollout_file])
    known = recs[0]
    docs = known["turns"][0]["docs"]
    assert known["turns"][0]["query"] == QUERY and known["end_reason"] == "answer" and known["em"] == 1.0
    assert PAYLOAD_TITLE in [d["title"] for d in docs] and all(d["score"] is not None for d in docs)
    assert all(len(r["tokens"]) == len(r["logprobs"]) == len(r["response_ids"]) for r in recs)
    assert any(
        lp < 0 for r in recs[1:] for lp, m in zip(r["logprobs"], r["loss_mask"]) if m
    )  # the model's sampling log-probs
    index = write_report([rollout_file], tmp_path / "report")

    page = tmp_path / "report" / "t" / "0.html"
    dom = _browser(exe, "--dump-dom", page.as_uri()).stdout
    masked = sum(1 for m in known["loss_mask"] if not m)
    assert masked > 0 and f'<span id="masked-count">{masked}</span>' in dom
    assert f'<b class="query">{QUERY}</b>' in dom and f'<b class="doc-title">{PAYLOAD_TITLE}</b>' in dom
    assert '<b id="end-reason">answer</b>' in dom
    assert "&lt;script&gt;document.body.setAttribute('data-pwned','1')&lt;/script&gt;" in dom
    assert not PWNED.search(dom) and dom.count("<script") == 2 and "<img" not in dom

    listing = _browser(exe, "--dump-dom", index.as_uri()).stdout
    assert (
        listing.count("<tr>") >= 1 + len(recs) and f'href="t/{len(recs) - 1}.html"' in listing
    )  # the table the script built
    assert f"{len(recs)} of {len(recs)} trajectories" in listing
    answered = sum(r["end_reason"] == "answer" for r in recs)
    filtered = _browser(exe, "--dump-dom", index.as_uri() + "?reason=answer&sort=length:desc").stdout
    assert f"{answered} of {len(recs)} trajectories" in filtered

    shot = tmp_path / "shot.png"
    _browser(exe, f"--screenshot={shot}", "--window-size=1280,2000", "--hide-scrollbars", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_training_run_keeps_trajectories_for_the_viewer(toy_warm_start, tmp_path):
    """`run.save_trajectories_every=1` on a real 2-step tiny run: each step's file holds
    `save_trajectories_per_step` records whose trainer log-probs and advantages align with the
    response ids (trained tokens: the trainer's log-prob equals the engine's; masked: 0), and
    `agent-rl rollout` and `agent-rl eval --trajectories` files join them in one report."""
    from test_train import _overrides, _run

    cache, out = toy_warm_start["cache"], tmp_path / "run"  # the session's toy world, tiny model and index
    res = _run(
        [
            "train",
            "configs/tiny_cpu_grpo.yaml",
            *_overrides(cache, out, 2),
            "run.save_trajectories_every=1",
            "run.save_trajectories_per_step=4",
            "run.eval_every=0",
            "data.test_files=[]",
            "run.save_every=2",
            "run.preflight=false",
        ],
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(f.name for f in (out / "trajectories").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    recs = read_records([out / "trajectories"])
    assert [r["step"] for r in recs] == [1] * 4 + [2] * 4
    for r in recs:
        n = len(r["response_ids"])
        assert len(r["trainer_logprobs"]) == len(r["advantages"]) == len(r["tokens"]) == len(r["logprobs"]) == n
        for trainer, engine, m, adv in zip(r["trainer_logprobs"], r["logprobs"], r["loss_mask"], r["advantages"]):
            if m:
                assert trainer < 0 and abs(trainer - engine) < 1e-3
            else:
                assert trainer == 0.0 and adv == 0.0

    common = [
        f"run.output_dir={out}",
        f"model.path={cache}/model",
        f"data.toy_world={cache}/world",
        f"data.train_files=[{cache}/world/train.parquet]",
        f"retriever.index_dir={cache}/index",
        f"retriever.corpus={cache}/world/corpus.jsonl",
        "model.warm_start=",
        "data.toy_entities=200",
    ]
    step_2 = str(out / "checkpoints" / "step_2")
    with start_server(cache / "index") as (_, url):  # one server for both commands
        res = _run(
            [
                "rollout",
                "configs/tiny_cpu_grpo.yaml",
                *common,
                f"retriever.url={url}",
                "--num-prompts",
                "2",
                "--group-size",
                "2",
                "--out",
                str(tmp_path / "rollout.jsonl"),
                "--checkpoint",
                step_2,
            ],
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        res = _run(
            [
                "eval",
                "configs/tiny_cpu_grpo.yaml",
                *common,
                "--retriever-url",
                url,
                "--checkpoint",
                step_2,
                "--data",
                f"{cache}/world/test.parquet",
                "--max-samples",
                "3",
                "--trajectories",
                str(tmp_path / "eval.jsonl"),
            ],
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-4000:]
    evals = read_records([tmp_path / "eval.jsonl"])
    assert len(evals) == 3 and all({"em", "f1", "tokens", "prompt_text"} <= set(r) for r in evals)
    res = _run(
        [
            "view",
            str(out / "trajectories"),
            str(tmp_path / "rollout.jsonl"),
            str(tmp_path / "eval.jsonl"),
            "--out",
            str(tmp_path / "report"),
        ]
    )
    assert res.returncode == 0 and str(tmp_path / "report" / "index.html") in res.stdout, res.stderr
    assert len(list((tmp_path / "report" / "t").glob("*.html"))) == 8 + 4 + 3
    index = (tmp_path / "report" / "index.html").read_text()
    assert "mean response tokens" in index and index.count("<polyline") == 2


def test_trajectory_keys_are_checked_at_load():
    """A negative interval or no trajectories per saved step fails at load, naming the key."""
    from agent_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="run.save_trajectories_every = -1"):
        load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", ["run.save_trajectories_every=-1"])
    with pytest.raises(ConfigError, match="run.save_trajectories_per_step = 0"):
        load_config(
            ROOT / "configs" / "tiny_cpu_grpo.yaml",
            ["run.save_trajectories_every=5", "run.save_trajectories_per_step=0"],
        )
    assert (
        load_config(
            ROOT / "configs" / "tiny_cpu_grpo.yaml", ["run.save_trajectories_per_step=0"]
        ).run.save_trajectories_every
        == 0
    )
