"""`bench/real_model_learns.py` end to end in two GRPO steps, on a tiny FlashRAG-layout folder made
from the HotpotQA fixture (the real run reads ../shared/data/wiki18_nq_triviaqa; this test does not).

The split is seeded, disjoint and the same for the same seed; every phase runs on the real model
(SmolLM2, vLLM where installed) and the report holds what the real run is judged on: EM per held-out
set before and after with a paired interval, the reward curve, wall time and peak RSS per phase
against the plan, and `agent-rl view` reports of the same questions before and after.
"""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(ROOT / "bench"))


def flashrag_folder(out: Path) -> Path:
    """corpus.jsonl (200 HotpotQA paragraphs), nq_1000.jsonl and triviaqa_1000.jsonl (HotpotQA
    questions without their metadata, so the demonstrations search the question, as for NQ)."""
    out.mkdir()
    corpus = (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()[:200]
    (out / "corpus.jsonl").write_text("\n".join(corpus) + "\n")
    rows = [json.loads(line) for line in (FIXTURES / "hotpotqa100" / "questions.jsonl").read_text().splitlines()]
    plain = [{k: r[k] for k in ("id", "question", "golden_answers")} for r in rows]
    (out / "nq_1000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain[:30]))
    (out / "triviaqa_1000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain[30:50]))
    return out


def test_split_is_seeded_and_disjoint(tmp_path):
    """Held-out NQ and training questions never overlap; the same seed gives the same split, another
    seed another; the demonstrations' query is the question itself."""
    from real_model_learns import split_questions

    data = flashrag_folder(tmp_path / "data")
    a, b = split_questions(data, 0, 10, 5), split_questions(data, 0, 10, 5)
    ids = {k: [r["id"] for r in v] for k, v in a.items()}
    assert ids == {k: [r["id"] for r in v] for k, v in b.items()}
    assert len(ids["nq"]) == 10 and len(ids["triviaqa"]) == 5 and len(ids["train"]) == 20
    assert not set(ids["nq"]) & set(ids["train"])
    assert [r["id"] for r in split_questions(data, 1, 10, 5)["nq"]] != ids["nq"]
    assert all(r["metadata"]["queries"] == [r["question"]] for r in a["train"])
    # --train-triviaqa: the TriviaQA questions not held out train too, after the same NQ ones.
    both = split_questions(data, 0, 10, 5, train_triviaqa=True)
    assert [r["id"] for r in both["train"][:20]] == ids["train"] and len(both["train"]) == 35
    assert {r["source"] for r in both["train"][20:]} == {"triviaqa"}
    assert not {r["id"] for r in both["train"][20:]} & set(ids["triviaqa"])


def test_second_search_is_a_title_that_finds_what_the_question_missed(tmp_path, smollm2_dir, hotpot_index_dir):
    """--second-search's scripted second query: only for training questions whose own search misses; the title of a
    corpus passage that holds a gold answer (and the fixture has such questions). --rl-second-only's GRPO prompts are
    exactly those questions."""
    from real_model_learns import (
        answer_hits,
        main,
        second_balanced,
        second_queries,
        split_questions,
        write_rl_train,
    )

    from agent_rl.config import load_config
    from retriever_server.answers import contains_answer

    data = flashrag_folder(tmp_path / "data")
    base = [f"retriever.index_dir={hotpot_index_dir}", f"retriever.corpus={data / 'corpus.jsonl'}", "retriever.topk=1"]
    cfg = load_config(None, base)
    train = split_questions(data, 0, 10, 5)["train"]
    hits = answer_hits(cfg, {"train": train})["train"]
    second = second_queries(cfg, train, hits)
    assert second and set(second) <= {r["id"] for r, hit in zip(train, hits) if not hit}
    passages = [json.loads(line)["contents"] for line in (data / "corpus.jsonl").read_text().splitlines()]
    answers = {r["id"]: r["golden_answers"] for r in train}
    for qid, title in second.items():
        holding = [p for p in passages if p.partition("\n")[0].strip().strip('"') == title]
        assert any(contains_answer(p, answers[qid]) for p in holding), (qid, title)
    keep = [r["id"] in second for r in train]
    assert write_rl_train(
        load_config(None, [*base, f"model.path={smollm2_dir}"]), tmp_path, train, keep, "pool"
    ) == len(second)
    pool = pq.read_table(tmp_path / "pool.parquet").column("id").to_pylist()  # a row's id: source_id
    assert sorted(pool) == sorted(f"{r['source']}_{r['id']}" for r in train if r["id"] in second)
    with pytest.raises(SystemExit, match="add --second-search"):
        main(["--data", str(data), "--out", str(tmp_path / "run"), "--rl-second-only"])
    # --rl-second-balanced: every two-search question and as many first-search hits, the same draw for a seed
    balanced = second_balanced(train, hits, second, 0)
    chosen = {r["id"] for r, k in zip(train, balanced) if k}
    found = chosen - set(second)
    assert set(second) <= chosen and len(found) == len(second)
    assert found <= {r["id"] for r, hit in zip(train, hits) if hit}
    assert second_balanced(train, hits, second, 0) == balanced
    assert any(second_balanced(train, hits, second, s) != balanced for s in range(1, 6))
    with pytest.raises(SystemExit, match="only 0 whose first search finds"):
        second_balanced(train, [False] * len(train), second, 0)
    with pytest.raises(SystemExit, match="add --second-search"):
        main(["--data", str(data), "--out", str(tmp_path / "run"), "--rl-second-balanced"])
    with pytest.raises(SystemExit, match="drop one"):
        main(
            [
                "--data",
                str(data),
                "--out",
                str(tmp_path / "run"),
                "--second-search",
                "--rl-second-only",
                "--rl-second-balanced",
            ]
        )
    # retriever.new_passages: a repeated search shows the next passage, so the question itself is the second query
    # wherever its second passage holds the answer
    from agent_rl.bootstrap.prepare import local_retriever, read_qa_rows
    from retriever_server.client import RetrieverClient

    fresh = load_config(None, [*base, "retriever.new_passages=true"])
    every = read_qa_rows(FIXTURES / "hotpotqa100" / "questions.jsonl")  # all 100: some miss at 1 and find at 2
    hits = answer_hits(cfg, {"train": every})["train"]
    again = second_queries(fresh, every, hits)
    with local_retriever(fresh.retriever) as url:
        client = RetrieverClient.from_config(fresh.retriever, url)
        top2 = dict(zip([r["id"] for r in every], client.retrieve([r["question"] for r in every], 2)))
        client.close()
    questions, answers = {r["id"]: r["question"] for r in every}, {r["id"]: r["golden_answers"] for r in every}
    repeated = {i for i, q in again.items() if q == questions[i]}
    want = {i for i, hit in zip(questions, hits) if not hit and contains_answer(top2[i][1]["contents"], answers[i])}
    assert want and repeated == want and set(again) - repeated <= set(second_queries(cfg, every, hits))


def test_second_searches_are_tallied_by_what_each_search_read(tmp_path):
    """The report's second-search tally from an evaluation's trajectories: a first miss is a first search whose
    passages hold no gold answer; a second search is counted by what its own passages hold, not the first's."""
    from real_model_learns import second_searches

    def search(text: str) -> dict:
        return {"action": "search", "obs_tokens": 9, "docs": [{"title": '"Page"', "text": text}]}

    answer = {"action": "answer", "obs_tokens": 0, "docs": None}
    recs = [  # (first search reads the answer?, second?, right?)
        {"turns": [search("nothing here"), search("Paris is the capital"), answer], "em": 1.0},  # miss, then finds
        {"turns": [search("Paris again"), search("nothing"), answer], "em": 0.0},  # finds, then a needless search
        {"turns": [search("nothing"), answer], "em": 0.0},  # misses once
        {"turns": [search("paris, lower case"), answer], "em": 1.0},  # finds once
        {"turns": [answer], "em": 0.0},  # no search at all: neither a first miss nor a second search
    ]
    path = tmp_path / "eval_trajectories" / "step_3.jsonl"
    path.parent.mkdir()
    lines = [json.dumps({**r, "data_source": "nq", "golden_answers": ["Paris"]}) for r in recs]
    path.write_text("\n".join([*lines, json.dumps({**recs[2], "data_source": "tq", "golden_answers": ["x"]})]) + "\n")
    tally = second_searches(tmp_path, 3)
    assert tally["nq"] == {
        "n": 5,
        "first_misses": 2,
        "first_misses_right": 1,
        "twice": 2,
        "twice_first_holds": 1,
        "second_holds": 1,
        "twice_right": 1,
    }
    assert tally["tq"]["n"] == 1 and tally["tq"]["first_misses"] == 1 and tally["tq"]["twice"] == 0


def test_one_step_run_writes_the_report_and_resumes(tmp_path, capsys, smollm2_dir, hotpot_index_dir):
    """Data, index (the session's index of the same 200 paragraphs, as `--index` reuses another run's),
    warm start, evaluation of both held-out sets, one GRPO step (on the questions the warm start gets wrong greedily,
    --rl-unsolved), evaluation after:
    results.json and results.md hold EM per set with a paired interval, the reward curve, wall time
    and peak RSS per phase with the plan's prediction, and view reports of the same questions. Then
    `--resume run.max_steps=2` continues from step 1's checkpoint (LoRA adapters and AdamW state) and the report
    covers both steps; engine and trainer log-probs agree within 1e-3 on average at every step (fp32 on CPU). The
    runs generate with the HF engine: the script only passes rollout.engine on, and the trainer's resume with
    vLLM is tests/test_vllm_engine.py's (a vLLM engine would add its start to each of the five runs that generate)."""
    from real_model_learns import main
    from temperature_probe import per_question

    data = flashrag_folder(tmp_path / "data")
    out = tmp_path / "run"
    overrides = [
        f"model.path={smollm2_dir}",
        "rollout.engine=hf",
        "run.max_steps=1",
        "rollout.prompts_per_step=2",
        "algo.group_size=2",
        "algo.max_gen_batches=1",  # the warm start of two SFT steps earns no reward: no batch to redraw for
        "sft.steps=2",
        "sft.batch_size=2",
        "run.preflight=false",
        # The warm start of two SFT steps writes to the end of every turn: shorter turns keep its evaluations and
        # rollouts (most of this test's time) short; the report does not depend on their length.
        "budget.max_tokens_per_turn=12",
    ]
    args = ["--data", str(data), "--out", str(out), "--nq-test", "4", "--triviaqa-test", "3", "--train-size", "26"]
    args += ["--index", str(hotpot_index_dir), "--rl-unsolved"]
    assert main([*args, *overrides]) == 0
    res = json.loads((out / "results.json").read_text())
    # every training question of the fixture (26): some demonstrations read their answer (sft.answer_in_observation)
    rl = res["split"].pop("train_rl")  # GRPO's prompts: the training questions whose search finds the answer
    unsolved = res["split"].pop("train_rl_unsolved")  # and, of them, those the warm start gets wrong greedily
    assert res["split"] == {"train": 26, "nq": 4, "triviaqa": 3} and 0 < rl < 26 and 0 < unsolved <= rl
    probe = per_question(out / "data" / "warm_start_train_rl.md")  # the greedy pass's EM per question
    wrong = {qid for qid, ems in probe.items() if ems == [0.0]}
    assert len(probe) == rl and len(wrong) == unsolved
    assert set(pq.read_table(out / "data" / "train_rl_unsolved.parquet").column("id").to_pylist()) == wrong
    assert {s: r["n"] for s, r in res["held_out"].items()} == {"nq": 4, "triviaqa": 3}
    for r in res["held_out"].values():
        lo, hi = r["em_diff_ci95"]
        assert lo <= r["em_diff"] <= hi and 0 <= r["em_before"] <= 1 and 0 <= r["em_after"] <= 1
        parts = r["by_search"].values()  # where the question's own search finds / misses: together, every question
        assert sum(part["n"] for part in parts) == r["n"]
        for when in ("before", "after"):  # searches per question in the two parts average to the set's
            together = sum(part["n"] * part[f"searches_{when}"] for part in parts) / r["n"]
            assert together == pytest.approx(r[f"searches_{when}"])
    for model in ("warm_start", "after"):  # one turn: no second search, each first miss counted once
        tally = res["second_searches"][model]
        assert {s: c["n"] for s, c in tally.items()} == {"nq": 4, "triviaqa": 3}
        assert all(c["twice"] == 0 and c["first_misses_right"] <= c["first_misses"] <= c["n"] for c in tally.values())
    assert res["training"]["steps"] == 1 and len(res["training"]["reward_curve"]) == 1
    assert set(res["time_s"]) >= {"data", "index", "sft", "train", "eval_warm_start", "eval_after", "total"}
    assert res["memory_gib"]["train"] > 0.5 and res["memory_gib"]["plan_host_peak"] > 0
    assert (out / "reward_curve.png").stat().st_size > 0
    before, after = (out / "view" / f"{name}.jsonl" for name in ("warm_start", "after_grpo"))
    ids = lambda p: [json.loads(line)["prompt_id"] for line in p.read_text().splitlines()]  # noqa: E731
    assert ids(before) == ids(after) and len(ids(before)) == 7
    assert all(Path(p).exists() for p in res["views"].values())
    md = (out / "results.md").read_text()
    assert "| nq | 4 |" in md and "| triviaqa | 3 |" in md and "predicted" in md

    capsys.readouterr()
    assert main([*args, "--resume", *overrides, "run.max_steps=2"]) == 0
    assert "probe: reusing" in capsys.readouterr().out  # the warm start's greedy answers are not redone
    (log,) = (out / "logs").glob("train_resume_*.log")
    assert "resumed from" in log.read_text() and "step_1" in log.read_text()
    res = json.loads((out / "results.json").read_text())
    assert res["training"]["steps"] == 2 and res["last_step"] == 2
    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/logprob_diff_mean"] < 1e-3, m["rollout/logprob_diff_mean"]

    # --skip-train --sft-equal on the finished run: the warm start trained on for more SFT steps (a fresh LoRA on
    # it, saved merged), evaluated by `agent-rl eval` on both held-out sets, and paired with the warm start and RL.
    from real_model_learns import sft_seconds_per_step

    from agent_rl.evaluation import files_fingerprint

    assert sft_seconds_per_step(out / "logs" / "sft.log") > 0  # what N is derived from when not given
    trained = (out / "grpo" / "metrics.jsonl").read_text()
    assert main([*args, "--skip-train", "--sft-equal", "--sft-equal-steps", "2", *overrides, "run.max_steps=2"]) == 0
    assert (out / "grpo" / "metrics.jsonl").read_text() == trained  # the RL run is taken as it is
    assert "; 2 steps of batch" in (out / "logs" / "sft_equal.log").read_text()
    assert (out / "sft_equal" / "config.json").exists()  # merged: vLLM serves it as it is
    res = json.loads((out / "results.json").read_text())
    eq = res["sft_equal"]
    assert eq["steps"] == 2 and set(res["time_s"]) >= {"sft_equal", "sft_equal_eval"}
    assert {s: r["n"] for s, r in eq["vs_warm_start"].items()} == {"nq": 4, "triviaqa": 3}
    for source, r in eq["vs_warm_start"].items():
        q, held = eq["rl_vs_sft"][source], res["held_out"][source]
        assert r["em_before"] == held["em_before"] and q["em_after"] == held["em_after"]  # the same two ends
        assert r["em_after"] == q["em_before"]  # SFT's EM, the middle of both comparisons
    assert "## The same compute spent on SFT" in (out / "results.md").read_text()

    # Another estimator from the same warm start (--run-name): the first run's evaluation of the warm start is reused,
    # not redone, so both pair with the same warm-start answers. --rl-override goes to this RL run only: every weight
    # of the (LoRA-built, merged) warm start trains, and the warm start is not rebuilt with full weights.
    capsys.readouterr()
    warm = files_fingerprint(out / "sft")
    full = ["--rl-override", "model.lora.enabled=false", "--rl-override", "train.lr=1e-5"]
    assert main([*args, "--run-name", "rloo", *full, *overrides, "algo.advantage=rloo", "algo.policy_loss=cispo"]) == 0
    assert "is grpo's, not redone" in capsys.readouterr().out
    assert files_fingerprint(out / "sft") == warm
    (saved,) = (out / "rloo" / "checkpoints").glob("*/model")
    assert (saved / "model.safetensors").exists() and not (saved / "adapter_config.json").exists()
    rloo = json.loads((out / "results_rloo.json").read_text())  # the default run's results.json is kept
    assert rloo["estimator"] == "rloo" and rloo["time_s"]["eval_warm_start"] is None
    assert rloo["rl_overrides"] == ["model.lora.enabled=false", "train.lr=1e-5"]
    assert "--rl-override model.lora.enabled=false" in (out / "results_rloo.md").read_text()
    lines = (out / "rloo" / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines if "eval/em" in line]
    assert [e["step"] for e in evals] == [1]  # the trainer evaluated only after its step
    for source, r in rloo["held_out"].items():
        assert r["em_before"] == res["held_out"][source]["em_before"]
    assert rloo["policy_loss"] == "cispo" and "after RL (rloo, cispo)" in (out / "results_rloo.md").read_text()
    assert json.loads((out / "results.json").read_text())["estimator"] == "grpo"
