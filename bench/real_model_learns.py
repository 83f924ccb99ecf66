"""Does a real model learn on real questions? SmolLM2 + GRPO on NQ, held-out NQ and TriviaQA.

Usage: .venv/bin/python bench/real_model_learns.py --data DIR [--out runs/real_nq] [--config CONFIG]
       [--seed 0] [--nq-test 500] [--triviaqa-test 300] [--train-triviaqa] [--rl-unsolved]
       [--run-name grpo] [--sft-equal [--sft-equal-steps N]] [--skip-train] [--second-search [--rl-second-only]]
       [--rl-override key=value ...] [key=value ...]

DIR is a folder in FlashRAG layout: `corpus.jsonl` (`id`, `contents` = "Title\\ntext"), `nq_1000.jsonl`
and `triviaqa_1000.jsonl` (`id`, `question`, `golden_answers`), e.g. ../shared/data/wiki18_nq_triviaqa.
Nothing is copied from it but the derived prompt files. One command runs every phase of
`configs/smollm2_nq_grpo.yaml` (key=value overrides go to every `agent-rl` command):

1. data: a seeded split of the NQ questions into held-out (--nq-test) and training questions, and a
   seeded sample of --triviaqa-test TriviaQA questions as an out-of-domain held-out set, written as
   prompt parquet files under OUT/data (the demonstrations' query is the question itself:
   `read_qa_rows`); with --train-triviaqa the other TriviaQA questions join the training ones (about
   twice the training questions; TriviaQA is then held out but no longer out of domain);
2. index: MiniLM flat over the corpus (OUT/index), then how often the top-k passages of each set hold
   a gold answer (the ceiling of a one-search policy; for the training questions, how often a scripted
   demonstration's observation holds the answer it is taught to give);
3. sft: `agent-rl sft`, the warm start, on the training questions only (OUT/sft);
4. train: `agent-rl train`: greedy evaluation of the warm start on both held-out sets (step 0), GRPO,
   greedy evaluation after (OUT/grpo, per-question scores in eval/step_N.jsonl);
5. with --sft-equal, the same compute spent on SFT: a fresh LoRA on the warm start trained on the same
   demonstrations for as many seconds as the RL steps took (N more SFT steps at the warm start's own seconds
   per step, or --sft-equal-steps N), evaluated greedily on both held-out sets by `agent-rl eval`
   (OUT/sft_equal, OUT/sft_equal_eval); the report pairs it with the warm start and with RL;
6. report: EM per set before and after with a 95% paired bootstrap interval of the difference,
   searches per trajectory, the reward curve, engine-trainer log-prob difference, wall time per phase,
   peak RSS per phase against `agent-rl plan`, and `agent-rl view` reports of a few held-out
   trajectories before and after: OUT/results.json and OUT/results.md (OUT/results_NAME.* and OUT/view_NAME for
   --run-name NAME).

A phase whose output exists is reused (data with the same split, index, warm start); training
starts afresh in OUT/grpo (OUT/NAME with --run-name NAME), or with --resume continues its last checkpoint up to
run.max_steps, or with --skip-train is taken as it is (to add --sft-equal to a finished run). Runs of several
estimators from one warm start: `--run-name rloo algo.advantage=rloo` and so on, in the same OUT; the later ones
reuse the first one's evaluation of the warm start (the same greedy answers, so every run pairs with them).
(e.g. `--resume run.max_steps=60` after a 30-step run: with a constant learning rate and exact resume,
the same weights a 60-step run reaches; the held-out comparison is still step 0 against the last step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# For every process of the run, this one's retriever and index build included: no hub, and OpenMP
# threads that sleep instead of spinning while they wait (on a shared 2-core machine spinning burns
# the other process's core).
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
for _key, _value in ENV.items():
    os.environ.setdefault(_key, _value)
sys.path.insert(0, str(ROOT))  # agent_rl where it is not installed (a lent GPU machine)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import paired_interval  # noqa: E402

SETS = ("nq", "triviaqa")


def _log(msg: str) -> None:
    print(f"[real_model_learns] {time.strftime('%H:%M:%S')} {msg}", flush=True)


def split_questions(
    data: Path, seed: int, nq_test: int, triviaqa_test: int, train_size: int = 0, train_triviaqa: bool = False
) -> dict:
    """Seeded split: {"train": NQ rows, "nq": held-out NQ rows, "triviaqa": held-out TriviaQA rows}.
    With `train_triviaqa` the TriviaQA questions not held out train too (after the NQ ones): TriviaQA is
    then a held-out set of a trained-on dataset, no longer an out-of-domain one. Each row carries its
    dataset under "source"."""
    from agent_rl.bootstrap.prepare import read_qa_rows

    nq = read_qa_rows(data / "nq_1000.jsonl")
    tqa = read_qa_rows(data / "triviaqa_1000.jsonl")
    random.Random(seed).shuffle(nq)
    random.Random(seed + 1).shuffle(tqa)
    if nq_test >= len(nq) or triviaqa_test > len(tqa):
        raise SystemExit(
            f"--nq-test {nq_test} / --triviaqa-test {triviaqa_test}: the files hold {len(nq)} / {len(tqa)}"
        )
    for rows, source in ((nq, "nq"), (tqa, "triviaqa")):
        for row in rows:
            row["source"] = source
    train = nq[nq_test:]
    train = train[:train_size] if train_size else train
    if train_triviaqa:
        train = train + tqa[triviaqa_test:]
    return {"train": train, "nq": nq[:nq_test], "triviaqa": tqa[:triviaqa_test]}


def write_rows(rows: list[dict], path: Path, part: str, template: str, tokenizer) -> None:
    """Rows of one or more datasets (each row's "source") as one prompt parquet file."""
    from datasets import Dataset

    from data_prep.qa import build_rows, write_parquet

    cols: dict[str, list] = {}
    for source in dict.fromkeys(r["source"] for r in rows):
        part_rows = [{k: v for k, v in r.items() if k != "source"} for r in rows if r["source"] == source]
        built, _ = build_rows(Dataset.from_list(part_rows), source, part, template, tokenizer)
        for name, values in built.items():
            cols.setdefault(name, []).extend(values)
    write_parquet(cols, path)


def write_data(cfg, out: Path, split: dict, key: dict) -> None:
    """The split as prompt parquet files (the model's template), and split.json naming its ids."""
    from agent_rl.rollout.prompts import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    for name, rows in split.items():
        path = out / f"{name if name == 'train' else name + '_test'}.parquet"
        write_rows(rows, path, "train" if name == "train" else "test", cfg.data.template, tokenizer)
    ids = {name: [r["id"] for r in rows] for name, rows in split.items()}
    (out / "split.json").write_text(json.dumps({**key, "ids": ids}, indent=1))


def answer_hits(cfg, split: dict) -> dict[str, list[bool]]:
    """Per set, per question: do its top-k passages (searched with the question, as the
    demonstrations search) hold a gold answer."""
    from agent_rl.bootstrap.prepare import local_retriever
    from retriever_server.answers import contains_answer
    from retriever_server.client import RetrieverClient

    out = {}
    with local_retriever(cfg.retriever) as url:
        client = RetrieverClient.from_config(cfg.retriever, url)
        for name, rows in split.items():
            docs = client.retrieve([r["question"] for r in rows], cfg.retriever.topk)
            out[name] = [
                any(contains_answer(d["contents"], r["golden_answers"]) for d in ds) for r, ds in zip(rows, docs)
            ]
        client.close()
    return out


def second_queries(cfg, rows: list[dict], hits: list[bool], depth: int = 10) -> dict[str, str]:
    """The scripted second search of the training questions whose first search (the question) misses: with
    retriever.new_passages, the question again where its next top-k passages hold a gold answer; otherwise the title
    of the best-ranked passage of the question's top `depth` that holds a gold answer, kept where searching that
    title puts a passage holding a gold answer in the top-k the policy reads. Row id -> the query. The
    demonstrations then search twice where the first passage does not answer (a title is what a model can recall
    or guess of the page it needs) and once where it does."""
    from agent_rl.bootstrap.prepare import local_retriever
    from retriever_server.answers import contains_answer
    from retriever_server.client import RetrieverClient

    missed = [r for r, hit in zip(rows, hits) if not hit]
    titles: dict[str, str] = {}
    topk = cfg.retriever.topk
    again: dict[str, str] = {}  # retriever.new_passages: the question again, where its next passages hold an answer
    with local_retriever(cfg.retriever) as url:
        client = RetrieverClient.from_config(cfg.retriever, url)
        for r, docs in zip(missed, client.retrieve([r["question"] for r in missed], depth)):
            if cfg.retriever.new_passages and any(
                contains_answer(d["contents"], r["golden_answers"]) for d in docs[topk : 2 * topk]
            ):
                again[r["id"]] = r["question"]
                continue
            for d in docs:
                if contains_answer(d["contents"], r["golden_answers"]):
                    titles[r["id"]] = d["contents"].partition("\n")[0].strip().strip('"')
                    break
        ids = sorted(titles)
        found = client.retrieve([titles[i] for i in ids], cfg.retriever.topk)
        client.close()
    answers = {r["id"]: r["golden_answers"] for r in missed}
    found_titles = {
        i: titles[i] for i, docs in zip(ids, found) if any(contains_answer(d["contents"], answers[i]) for d in docs)
    }
    return {**found_titles, **again}


def write_rl_train(
    cfg,
    out: Path,
    rows: list[dict],
    keep: list[bool],
    name: str = "train_rl",
    flag: str = "--rl-answerable (--no-rl-answerable)",
) -> int:
    """The GRPO training prompts, OUT/data/NAME.parquet: by default (--rl-answerable) the training questions whose
    search finds a passage holding a gold answer (the ones the warm start's demonstrations were kept for; a question
    whose passage never holds its answer earns every sample the same reward and teaches nothing but costs a
    rollout); with --rl-second-only those with a scripted second search. `flag` is the option that chose them, named
    when none is kept."""
    from agent_rl.rollout.prompts import load_tokenizer

    kept = [r for r, k in zip(rows, keep) if k]
    if not kept:
        raise SystemExit(f"{name}: no training question is kept for GRPO; drop {flag}")
    write_rows(kept, out / f"{name}.parquet", "train", cfg.data.template, load_tokenizer(cfg.model.path))
    return len(kept)


def second_balanced(rows: list[dict], hits: list[bool], second: dict, seed: int) -> list[bool]:
    """--rl-second-balanced's pool over `rows`: every question with a scripted second search (`second`: its first
    search misses and a second finds) and as many of those whose first search finds the answer, drawn with `seed`.
    In the first half a second search is what scores, in the other it costs (two passages read worse than the one
    that holds the answer), so the reward pays for searching again only where the first passage lacks the answer."""
    found = [r["id"] for r, hit in zip(rows, hits) if hit and r["id"] not in second]
    if len(found) < len(second):
        raise SystemExit(
            f"--rl-second-balanced: {len(second)} questions with a second search but only {len(found)} whose first "
            "search finds the answer; drop --rl-second-balanced"
        )
    drawn = set(random.Random(seed).sample(found, len(second)))
    return [r["id"] in second or r["id"] in drawn for r in rows]


def write_rl_unsolved(agent_rl: list[str], config: str, overrides: list[str], out: Path) -> int:
    """--rl-unsolved: the GRPO prompts narrowed to the questions the warm start answers wrong greedily.

    A greedy evaluation of the warm start on OUT/data/train_rl.parquet (its per-question scores in
    OUT/data/warm_start_train_rl_questions), then OUT/data/train_rl_unsolved.parquet with the questions of EM 0
    (reused when it exists, as the warm start is). On a question greedy decoding already answers, a group with
    differing rewards mostly sharpens the samples toward that answer (bench/temperature_probe.py); on one it gets
    wrong, such a group is the signal that can change the greedy answer. Returns how many it keeps."""
    import pyarrow.parquet as pq
    from temperature_probe import per_question

    pool, target = out / "train_rl.parquet", out / "train_rl_unsolved.parquet"
    table_out = out / "warm_start_train_rl.md"
    if target.exists():  # the warm start in OUT/sft is reused too
        _log(f"probe: reusing {target}")
        return pq.read_metadata(target).num_rows
    cmd = [*agent_rl, "eval", config, *overrides, "--checkpoint", str(out.parent / "sft"), "--data", str(pool)]
    run_phase("probe", [*cmd, "--out", str(table_out)], out.parent / "logs" / "probe_train_rl.log")
    greedy = {qid: ems[0] for qid, ems in per_question(table_out).items()}
    table = pq.read_table(pool)
    wrong = [greedy[qid] == 0.0 for qid in table.column("id").to_pylist()]
    if not any(wrong):
        raise SystemExit("--rl-unsolved: the warm start answers every GRPO training question; drop --rl-unsolved")
    pq.write_table(table.filter(wrong), target)
    return sum(wrong)


def run_phase(name: str, cmd: list[str], log: Path) -> dict:
    """Run one `agent-rl` command, output to `log`: its wall seconds and its peak RSS (the child's
    own, from wait4, which counts the processes it waited for)."""
    _log(f"{name}: {' '.join(cmd[2:])} (log: {log})")
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log}:\n{log.read_text()[-3000:]}")
    _log(f"{name}: done in {wall:.0f} s")
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20}  # ru_maxrss is in KiB


def reuse_start_eval(out: Path, run_name: str) -> Path | None:
    """Another RL run in OUT (a sibling folder of `run_name`) that evaluated this warm start at step 0, or None.
    Each run records the warm start it started from (a fingerprint of OUT/sft's files); only a match counts."""
    from agent_rl.evaluation import files_fingerprint

    want = files_fingerprint(out / "sft")
    for run in sorted(p for p in out.iterdir() if p.is_dir() and p.name != run_name):
        marker = run / "warm_start.json"
        if (
            (run / "eval" / "step_0.jsonl").exists()
            and (run / "eval_trajectories" / "step_0.jsonl").exists()
            and marker.exists()
            and json.loads(marker.read_text()).get("fingerprint") == want
        ):
            return run
    return None


def sft_progress(log: Path) -> tuple[int, int] | None:
    """(step, seconds) of an `agent-rl sft` log's last `[sft] step N/M loss L (Ts)` line: the training loop's own
    time (start-up and saving excluded, as the RL steps' `timing/step_s` exclude them); None without one."""
    found = re.findall(r"\[sft\] step (\d+)/\d+ loss \S+ \((\d+)s\)", log.read_text() if log.exists() else "")
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def sft_seconds_per_step(log: Path) -> float:
    """The warm start's seconds per SFT step, from its log (`sft_progress`)."""
    if (last := sft_progress(log)) is None:
        raise SystemExit(f"--sft-equal: no `[sft] step` line in {log}; give --sft-equal-steps N")
    step, seconds = last
    return max(seconds, 1) / step


def sft_equal(agent_rl: list[str], config: str, overrides: list[str], out: Path, steps: int) -> dict:
    """The same compute spent on SFT: a fresh LoRA on the warm start (OUT/sft, the weights RL starts from),
    `steps` more steps of the warm start's recipe on the same demonstrations, saved merged to OUT/sft_equal;
    then `agent-rl eval` of both held-out sets, greedy, as the trainer evaluates them. Returns the two phases'
    wall time and peak RSS, the SFT loop's own seconds and the per-question score rows."""
    model = out / "sft_equal"
    sft_cmd = [*agent_rl, "sft", config, *overrides, f"model.path={out / 'sft'}", f"model.warm_start={model}"]
    phases = {"sft_equal": run_phase("sft_equal", [*sft_cmd, f"sft.steps={steps}"], out / "logs" / "sft_equal.log")}
    report = out / "sft_equal_eval" / "eval.json"
    eval_cmd = [*agent_rl, "eval", config, *overrides, "--checkpoint", str(model), "--out", str(report), "--fresh"]
    phases["sft_equal_eval"] = run_phase("sft_equal_eval", eval_cmd, out / "logs" / "sft_equal_eval.log")
    folder = report.with_name(report.stem + "_questions")
    rows = [json.loads(line) for part in sorted(folder.glob("part-*.jsonl")) for line in part.read_text().splitlines()]
    last = sft_progress(out / "logs" / "sft_equal.log")
    return {"phases": phases, "sft_loop_s": float(last[1]) if last else 0.0, "rows": rows}


def compare(before: list[dict], after: list[dict], found: dict[str, bool] | None = None) -> dict:
    """Greedy EM, F1 and searches per data source before and after, with the 95% paired bootstrap
    interval of the EM difference over the same questions. With `found` (prompt id -> does the
    question's own search find a gold answer), also the EM change on the questions where it does
    (what reading can gain) and where it does not (only a better query or memory can)."""
    out = {}
    for source in sorted({r["data_source"] for r in before}):
        b = {r["prompt_id"]: r for r in before if r["eval"] == "eval" and r["data_source"] == source}
        a = {r["prompt_id"]: r for r in after if r["eval"] == "eval" and r["data_source"] == source}
        ids = sorted(b.keys() & a.keys())
        row: dict = {"n": len(ids)}
        for key in ("em", "f1", "searches"):
            row[f"{key}_before"] = sum(b[i][key] for i in ids) / max(1, len(ids))
            row[f"{key}_after"] = sum(a[i][key] for i in ids) / max(1, len(ids))
        row["em_diff"] = row["em_after"] - row["em_before"]
        row["em_diff_ci95"] = paired_interval([b[i]["em"] for i in ids], [a[i]["em"] for i in ids])
        row["changed"] = {
            "right_to_wrong": sum(b[i]["em"] > a[i]["em"] for i in ids),
            "wrong_to_right": sum(b[i]["em"] < a[i]["em"] for i in ids),
        }
        if found is not None:
            row["by_search"] = {}
            for name, want in (("finds", True), ("misses", False)):
                sub = [i for i in ids if found.get(i) is want]
                eb, ea = [b[i]["em"] for i in sub], [a[i]["em"] for i in sub]
                row["by_search"][name] = {
                    "n": len(sub),
                    "em_before": _mean(eb),
                    "em_after": _mean(ea),
                    "em_diff": _mean(ea) - _mean(eb),
                    "em_diff_ci95": paired_interval(eb, ea) if sub else (0.0, 0.0),
                    "searches_before": _mean([b[i]["searches"] for i in sub]),
                    "searches_after": _mean([a[i]["searches"] for i in sub]),
                }
        out[source] = row
    return out


SECOND_SEARCH_COUNTS = (
    "n",
    "first_misses",
    "first_misses_right",
    "twice",
    "twice_first_holds",
    "second_holds",
    "twice_right",
)


def second_searches(run_dir: Path, step: int) -> dict[str, dict]:
    """Per data source, from the evaluation's trajectories at `step`: the questions whose first search's passages
    hold no gold answer (`first_misses`) and of them how many end right; the questions that search twice or more
    (`twice`), how many of those first searches already held a gold answer (`twice_first_holds`), how many second
    searches' passages hold one (`second_holds`), and how many of those questions end right (`twice_right`). What
    a second search is for is the first kind; what RL can learn from it shows in the rest."""
    from retriever_server.answers import contains_answer

    out: dict[str, dict] = {}
    path = run_dir / "eval_trajectories" / f"step_{step}.jsonl"
    for rec in map(json.loads, path.read_text().splitlines()):
        c = out.setdefault(rec["data_source"], dict.fromkeys(SECOND_SEARCH_COUNTS, 0))
        holds = [
            any(contains_answer(f"{d['title']}\n{d['text']}", rec["golden_answers"]) for d in t["docs"] or [])
            for t in rec["turns"]
            if t["action"] == "search" and t["obs_tokens"]
        ]
        right = int(bool(rec["em"]))
        c["n"] += 1
        if holds and not holds[0]:
            c["first_misses"] += 1
            c["first_misses_right"] += right
        if len(holds) >= 2:
            c["twice"] += 1
            c["twice_first_holds"] += holds[0]
            c["second_holds"] += holds[1]
            c["twice_right"] += right
    return out


def write_views(run_dir: Path, last: int, out: Path, per_set: int, after: str = "after_grpo") -> dict[str, str]:
    """`agent-rl view` reports of the same few held-out questions before (step 0) and after: per data
    source, questions whose EM changed first, then the first others; `after` names the second report."""
    from agent_rl.reports.view import write_report

    recs = {}
    for step in (0, last):
        path = run_dir / "eval_trajectories" / f"step_{step}.jsonl"
        recs[step] = {r["prompt_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    picked = []
    for source in SETS:
        ids = [i for i, r in recs[0].items() if r["data_source"] == source and i in recs[last]]
        ids.sort(key=lambda i: recs[0][i]["em"] == recs[last][i]["em"])  # changed ones first, order kept
        picked += ids[:per_set]
    reports = {}
    out.mkdir(parents=True, exist_ok=True)
    for name, step in (("warm_start", 0), (after, last)):
        lines = out / f"{name}.jsonl"
        lines.write_text("".join(json.dumps(recs[step][i]) + "\n" for i in picked))
        reports[name] = str(write_report([lines], out / name))
    return reports


def plot_curve(steps: list[dict], path: Path, reward_fn: str = "em") -> None:
    """Training reward (mean of the step's samples, and a moving average) and searches per trajectory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [m["step"] for m in steps]
    reward = [m["reward/mean"] for m in steps]
    w = max(1, len(reward) // 10)
    smooth = [sum(reward[max(0, i - w + 1) : i + 1]) / len(reward[max(0, i - w + 1) : i + 1]) for i in range(len(x))]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(x, reward, alpha=0.4, label=f"reward/mean ({reward_fn} of the step's samples)")
    ax1.plot(x, smooth, label=f"moving average over {w} steps")
    ax1.set_xlabel("GRPO step")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.plot(x, [m["rollout/searches_mean"] for m in steps], label="searches per trajectory")
    ax2.set_xlabel("GRPO step")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def summarise(
    out: Path,
    phases: dict,
    plan: dict,
    recall: dict,
    split_sizes: dict,
    reward_fn: str = "em",
    found: dict[str, bool] | None = None,
    sft_more: dict | None = None,
    run_name: str = "grpo",
) -> dict:
    run_dir = out / run_name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward/mean" in m]
    evals = [m for m in metrics if "eval/em" in m]
    last = max(int(p.stem.split("_")[1]) for p in (run_dir / "eval").glob("step_*.jsonl"))
    load = lambda s: [json.loads(x) for x in (run_dir / "eval" / f"step_{s}.jsonl").read_text().splitlines()]  # noqa: E731
    em = compare(load(0), load(last), found)
    equal = None
    if sft_more is not None:
        equal = {
            "steps": sft_more["steps"],
            "sft_loop_s": sft_more["sft_loop_s"],
            "warm_start_s_per_step": sft_more["per_step"],
            "vs_warm_start": compare(load(0), sft_more["rows"], found),
            "rl_vs_sft": compare(sft_more["rows"], load(last), found),
        }
    plot_curve(steps, out / "reward_curve.png", reward_fn)
    k = max(1, len(steps) // 4)
    eval_s = [m["timing/eval_s"] for m in evals if "timing/eval_s" in m and m["step"] > 0]
    start_s = [m["timing/eval_s"] for m in evals if "timing/eval_s" in m and m["step"] == 0]  # none when reused
    n_eval = sum(split_sizes[s] for s in SETS)
    step_s = [m["timing/step_s"] for m in steps]
    train_rss = max([m["memory/peak_rss_gib"] for m in steps], default=0.0)
    return {
        "held_out": em,
        "retrieval_answer_recall_at_topk": recall,
        "split": split_sizes,
        "training": {
            "steps": len(steps),
            "trajectories_per_step": _mean([m["rollout/trajectories"] for m in steps]),
            "reward_fn": reward_fn,
            "reward_first_quarter": _mean([m["reward/mean"] for m in steps[:k]]),
            "reward_last_quarter": _mean([m["reward/mean"] for m in steps[-k:]]),
            "reward_curve": [[m["step"], m["reward/mean"]] for m in steps],
            # the samples' EM, whatever reward.fn adds to it (logged since reward/em was added)
            "em_first_quarter": _mean([m["reward/em"] for m in steps[:k] if "reward/em" in m]),
            "em_last_quarter": _mean([m["reward/em"] for m in steps[-k:] if "reward/em" in m]),
            "searches_per_trajectory_first_quarter": _mean([m["rollout/searches_mean"] for m in steps[:k]]),
            "searches_per_trajectory_last_quarter": _mean([m["rollout/searches_mean"] for m in steps[-k:]]),
            # over the steps that trained a row (the difference is taken at the update's rows)
            "logprob_diff_mean": _mean(
                [m["rollout/logprob_diff_mean"] for m in steps if m.get("rollout/logprob_diff_max")]
            ),
            "logprob_diff_max": max([m.get("rollout/logprob_diff_max", 0.0) for m in steps], default=0.0),
            # dynamic sampling (algo.filter_groups): rollout batches per step, groups with differing rewards kept
            "gen_batches_mean": _mean([m.get("rollout/gen_batches", 1.0) for m in steps]),
            "kept_groups_mean": _mean([m["rollout/kept_groups"] for m in steps if "rollout/kept_groups" in m]),
            "skipped_rows_mean": _mean([m.get("train/skipped_zero_advantage_rows", 0.0) for m in steps]),
            "step_s_mean": _mean(step_s),
            "rollout_s_mean": _mean([m["timing/rollout_s"] for m in steps]),
            "update_s_mean": _mean([m["timing/update_s"] for m in steps]),
            "weight_sync_s_mean": _mean([m["timing/weight_sync"] for m in steps]),
        },
        "time_s": {
            **{name: p["wall_s"] for name, p in phases.items()},
            "eval_warm_start": start_s[0] if start_s else None,
            "eval_after": eval_s[-1] if eval_s else None,
            "eval_per_question": _mean(start_s + eval_s) / max(1, n_eval),
            "grpo_steps": sum(step_s),
            "total": sum(p["wall_s"] for p in phases.values()),
        },
        "memory_gib": {
            **{name: p["peak_rss_gib"] for name, p in phases.items()},
            "train_peak_rss_logged": train_rss,
            "plan_host_peak": plan.get("host_peak_bytes", 0) / 2**30,
            "plan_fits": plan.get("fits"),
        },
        "views": write_views(
            run_dir, last, out / ("view" if run_name == "grpo" else f"view_{run_name}"), 4, f"after_{run_name}"
        ),
        "last_step": last,
        "second_searches": {"warm_start": second_searches(run_dir, 0), "after": second_searches(run_dir, last)},
        **({"sft_equal": equal} if equal is not None else {}),
    }


def rl_pool_line(res: dict) -> str:
    """The report's sentence on which training questions GRPO sampled from: the script's pools, or the
    data.train_files given as an override."""
    files = [Path(f).name for f in res.get("rl_train_files", [])]
    if second := res["split"].get("train_rl_second"):
        return f" RL samples from the {second} of them with a scripted second search (--rl-second-only)."
    if balanced := res["split"].get("train_rl_balanced"):
        return (
            f" RL samples from {balanced} of them: those with a scripted second search and as many whose first "
            "search finds the answer (--rl-second-balanced)."
        )
    if rl_pool := res["split"].get("train_rl"):
        return f" RL samples from those {rl_pool} (--rl-answerable)."
    if files and files != ["train.parquet"]:
        return f" RL samples from {', '.join(files)} (data.train_files)."
    return " RL samples from all of them."


def render(res: dict, header: str) -> str:
    t, mem, tr = res["time_s"], res["memory_gib"], res["training"]
    # algo.advantage and algo.policy_loss: the section names say which RL ran
    estimator, loss = res.get("estimator", "grpo"), res.get("policy_loss", "ppo_clip")
    named = estimator if loss == "ppo_clip" else f"{estimator}, {loss}"
    rl = "GRPO" if named == "grpo" else f"RL ({named})"
    lines = [header, "", f"## Greedy EM on the held-out sets: warm start -> after {rl}", ""]
    lines += [
        f"| set | n | EM warm start | EM after {rl} | difference [95% paired bootstrap] | "
        "right->wrong / wrong->right | F1 before -> after | searches per trajectory before -> after | "
        "top-k answer recall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for source, r in res["held_out"].items():
        lo, hi = r["em_diff_ci95"]
        lines.append(
            f"| {source} | {r['n']} | {r['em_before']:.3f} | {r['em_after']:.3f} | {r['em_diff']:+.3f} "
            f"[{lo:+.3f}, {hi:+.3f}] | {r['changed']['right_to_wrong']} / {r['changed']['wrong_to_right']} | "
            f"{r['f1_before']:.3f} -> {r['f1_after']:.3f} | {r['searches_before']:.2f} -> {r['searches_after']:.2f} "
            f"| {res['retrieval_answer_recall_at_topk'].get(source, float('nan')):.3f} |"
        )
    split_rows = [(s, r["by_search"]) for s, r in res["held_out"].items() if "by_search" in r]
    if split_rows:
        lines += [
            "",
            "By whether the question's own search (top-k, the question as the query) finds a gold answer: where it "
            "does, a gain is better reading; where it does not, only a better query or the model's memory can gain.",
            "",
            f"| set | search | n | EM warm start -> after {rl} | difference [95% paired bootstrap] | "
            "searches per question |",
            "|---|---|---|---|---|---|",
        ]
        for source, parts in split_rows:
            for name, r in parts.items():
                lo, hi = r["em_diff_ci95"]
                lines.append(
                    f"| {source} | {name} the answer | {r['n']} | {r['em_before']:.3f} -> {r['em_after']:.3f} | "
                    f"{r['em_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                    f"{r['searches_before']:.2f} -> {r['searches_after']:.2f} |"
                )
    twice = res.get("second_searches", {})
    if any(c["twice"] for part in twice.values() for c in part.values()):
        lines += [
            "",
            "Second searches of the held-out questions (greedy), by the passages each search returned: questions "
            "whose first search reads no gold answer (right after), questions that search twice (of them: the first "
            "search already read one; the second reads one; right after).",
            "",
            "| set | model | first search misses (right) | search twice | of them: first reads one / second "
            "reads one / right |",
            "|---|---|---|---|---|",
        ]
        for model, part in twice.items():
            for source, c in part.items():
                lines.append(
                    f"| {source} | {model} | {c['first_misses']} ({c['first_misses_right']}) | {c['twice']} of "
                    f"{c['n']} | {c['twice_first_holds']} / {c['second_holds']} / {c['twice_right']} |"
                )
    recall_train = res["retrieval_answer_recall_at_topk"].get("train", float("nan"))
    lines += [
        "",
        f"Training questions: {res['split']['train']}"
        + (
            f" ({res['split']['train_triviaqa']} of them TriviaQA: TriviaQA is held out, not out of domain)"
            if res["split"].get("train_triviaqa")
            else ""
        )
        + f"; a scripted demonstration's observation holds a gold answer "
        f"for {recall_train:.3f} of them (with sft.answer_in_observation, the warm start learns from those only; "
        "otherwise the rest teach answering from memory)."
        + rl_pool_line(res)
        + (
            f" Of those, the {unsolved} the warm start answers wrong greedily (--rl-unsolved)."
            if (unsolved := res["split"].get("train_rl_unsolved"))
            else ""
        ),
        "",
        f"## {rl}",
        "",
        f"- steps: {tr['steps']} of {tr['trajectories_per_step']:.0f} trajectories; reward "
        f"({tr.get('reward_fn', 'em')} of the samples) "
        f"{tr['reward_first_quarter']:.3f} over the first quarter -> {tr['reward_last_quarter']:.3f} over the last "
        f"(curve: reward_curve.png); the samples' EM {tr.get('em_first_quarter', 0.0):.3f} -> "
        f"{tr.get('em_last_quarter', 0.0):.3f}",
        f"- rollout batches per step {tr['gen_batches_mean']:.2f}, groups with differing rewards trained on per "
        f"step {tr['kept_groups_mean']:.2f}, rows of zero advantage per step {tr['skipped_rows_mean']:.1f}",
        f"- searches per trajectory (training samples): {tr['searches_per_trajectory_first_quarter']:.2f} -> "
        f"{tr['searches_per_trajectory_last_quarter']:.2f}",
        f"- engine-trainer log-prob difference at sampled tokens (rollout/logprob_diff_mean, _max): mean "
        f"{tr['logprob_diff_mean']:.2e}, max {tr['logprob_diff_max']:.2e}",
        f"- seconds per step: {tr['step_s_mean']:.1f} (rollout {tr['rollout_s_mean']:.1f}, update "
        f"{tr['update_s_mean']:.1f}, weight sync {tr['weight_sync_s_mean']:.2f})",
        "",
    ]
    if eq := res.get("sft_equal"):
        lines += [
            "## The same compute spent on SFT",
            "",
            f"The warm start trained on for {eq['steps']} more SFT steps (a fresh LoRA, its own recipe and "
            f"demonstrations): {eq['sft_loop_s']:.0f} s of SFT steps against {t['grpo_steps']:.0f} s of RL steps "
            f"(the warm start's {eq['warm_start_s_per_step']:.1f} s per SFT step). Greedy EM, 95% paired bootstrap "
            "intervals over the same questions.",
            "",
            "| set | n | warm start | SFT + more steps | after RL | SFT - warm start | RL - SFT |",
            "|---|---|---|---|---|---|---|",
        ]
        for source, r in eq["vs_warm_start"].items():
            q = eq["rl_vs_sft"][source]
            (lo, hi), (lo2, hi2) = r["em_diff_ci95"], q["em_diff_ci95"]
            lines.append(
                f"| {source} | {r['n']} | {r['em_before']:.3f} | {r['em_after']:.3f} | {q['em_after']:.3f} | "
                f"{r['em_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {q['em_diff']:+.3f} [{lo2:+.3f}, {hi2:+.3f}] |"
            )
        lines.append("")
    lines += [
        "## Wall time and memory",
        "",
        "| phase | wall s | peak RSS GiB |",
        "|---|---|---|",
    ]
    for name in ("data", "index", "sft", "train", "sft_equal", "sft_equal_eval"):
        if name in t:
            lines.append(f"| {name} | {t[name]:.0f} | {mem.get(name, float('nan')):.2f} |")
    lines += [
        f"| total | {t['total']:.0f} | |",
        "",
        f"Inside train: evaluation of the warm start {t['eval_warm_start'] or 0:.0f} s, {rl} steps "
        f"{t['grpo_steps']:.0f} s, evaluation after {t['eval_after'] or 0:.0f} s "
        f"({t['eval_per_question']:.3f} s per held-out question); the rest is start-up and checkpoints.",
        f"Peak RSS of training (memory/peak_rss_gib) {mem['train_peak_rss_logged']:.2f} GiB; `agent-rl plan` "
        f"predicted {mem['plan_host_peak']:.2f} GiB (fits: {mem['plan_fits']}).",
        "",
        "Trajectories (`agent-rl view`): "
        + ", ".join(f"[{k}]({Path(v).relative_to(Path(v).parents[2])})" for k, v in res["views"].items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with corpus.jsonl, nq_1000.jsonl, triviaqa_1000.jsonl")
    parser.add_argument("--out", default="runs/real_nq")
    parser.add_argument("--config", default="configs/smollm2_nq_grpo.yaml")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (the runs use run.seed)")
    parser.add_argument("--nq-test", type=int, default=500, help="held-out NQ questions")
    parser.add_argument("--triviaqa-test", type=int, default=300, help="held-out TriviaQA questions")
    parser.add_argument("--train-size", type=int, default=0, help="training questions (0 = every other NQ one)")
    parser.add_argument(
        "--train-triviaqa",
        action="store_true",
        help="the TriviaQA questions not held out train too (warm start and GRPO): about twice the training "
        "questions, but TriviaQA is then no longer out of domain",
    )
    parser.add_argument(
        "--second-search",
        action="store_true",
        help="with budget.max_turns=2: the warm start's demonstrations search a second time where the question's "
        "own search misses (with retriever.new_passages=true the question again where its next passages hold the "
        "answer; else the title of a passage in its top 10 that holds the answer, where searching it finds one), and "
        "GRPO trains on those questions too",
    )
    parser.add_argument(
        "--rl-answerable",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GRPO on the training questions whose top-k passages hold a gold answer only (default; SFT reads "
        "every training question and keeps those by sft.answer_in_observation)",
    )
    parser.add_argument(
        "--rl-second-only",
        action="store_true",
        help="with --second-search: GRPO on the training questions with a scripted second search only (their first "
        "search misses and a second finds; OUT/data/train_rl_second.parquet), so that every rollout has a reason "
        "to search twice",
    )
    parser.add_argument(
        "--rl-second-balanced",
        action="store_true",
        help="with --second-search: GRPO on the training questions with a scripted second search and as many "
        "(drawn with --seed) whose first search finds the answer (OUT/data/train_rl_balanced.parquet): a second "
        "search pays in one half and costs in the other, so that RL can learn when to search again",
    )
    parser.add_argument(
        "--rl-unsolved",
        action="store_true",
        help="GRPO on those of --rl-answerable's questions that the warm start gets wrong greedily (one greedy "
        "evaluation of the pool after the warm start)",
    )
    parser.add_argument(
        "--index",
        help="the corpus's MiniLM index, built there if missing (default OUT/index); give another run's to reuse it",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue OUT/grpo from its last checkpoint (to run.max_steps) instead of starting afresh",
    )
    parser.add_argument(
        "--run-name",
        default="grpo",
        help="the RL run's folder in OUT: runs of several estimators (algo.advantage=...) share OUT's data, index "
        "and warm start, and a later one reuses an earlier one's evaluation of the warm start "
        "(run.eval_at_start=false), so that all are paired with the same warm-start answers",
    )
    parser.add_argument(
        "--skip-train",
        action="store_true",
        help="take OUT/NAME (--run-name) as it is (a finished run) instead of training: to add --sft-equal to it",
    )
    parser.add_argument(
        "--sft-equal",
        action="store_true",
        help="then the same compute spent on SFT: the warm start trained on for as many seconds as the RL steps "
        "took (OUT/sft_equal), evaluated on both held-out sets and paired with the warm start and with RL",
    )
    parser.add_argument(
        "--sft-equal-steps",
        type=int,
        default=0,
        help="--sft-equal's SFT steps (0 = the RL steps' seconds over the warm start's seconds per SFT step)",
    )
    parser.add_argument(
        "--rl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the RL run (its plan, training and evaluations) only, not the warm start or "
        "--sft-equal, e.g. model.lora.enabled=false to train every weight of the LoRA-built warm start; repeatable",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for every agent-rl command (key=value)")
    args = parser.parse_args(argv)
    if args.rl_second_only and not args.second_search:
        raise SystemExit("--rl-second-only trains on --second-search's two-search questions: add --second-search")
    if args.rl_second_balanced and not args.second_search:
        raise SystemExit("--rl-second-balanced mixes --second-search's two-search questions in: add --second-search")
    if args.rl_second_balanced and args.rl_second_only:
        raise SystemExit("--rl-second-only and --rl-second-balanced choose different pools: drop one")
    if (args.rl_second_only or args.rl_second_balanced) and args.rl_unsolved:
        raise SystemExit("--rl-unsolved narrows --rl-answerable's pool, not a --second-search one: drop one")
    from agent_rl.bootstrap.prepare import ensure_index, ensure_model
    from agent_rl.config import load_config

    data, out = Path(args.data).resolve(), Path(args.out).resolve()
    config = str((ROOT / args.config) if not Path(args.config).is_absolute() else args.config)
    (out / "data").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    tests = [out / "data" / f"{s}_test.parquet" for s in SETS]
    run_dir = out / args.run_name
    overrides = [
        f"run.output_dir={run_dir}",
        f"model.warm_start={out / 'sft'}",
        f"data.train_files=[{out / 'data' / 'train.parquet'}]",
        f"data.test_files=[{', '.join(map(str, tests))}]",
        f"retriever.corpus={data / 'corpus.jsonl'}",
        f"retriever.index_dir={Path(args.index).resolve() if args.index else out / 'index'}",
        *args.overrides,
    ]
    cfg = load_config(config, overrides)
    if not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(ROOT / cfg.model.path)
    phases: dict[str, dict] = {}

    start = time.perf_counter()
    ensure_model(cfg)
    key = {"seed": args.seed, "nq_test": args.nq_test, "triviaqa_test": args.triviaqa_test, "train": args.train_size}
    if args.train_triviaqa:
        key["train_triviaqa"] = True
    if args.second_search:
        if cfg.budget.max_turns < 2:
            raise SystemExit(
                "--second-search demonstrates two searches: add budget.max_turns=2 (and room in "
                "budget.max_total_tokens for a second search and observation)"
            )
        key["second_search"] = True
    split = split_questions(data, args.seed, args.nq_test, args.triviaqa_test, args.train_size, args.train_triviaqa)
    marker = out / "data" / "split.json"
    if marker.exists() and {k: v for k, v in json.loads(marker.read_text()).items() if k != "ids"} != key:
        raise SystemExit(f"{out} holds another split ({marker}); use a fresh --out")
    phases["data"] = {"wall_s": time.perf_counter() - start, "peak_rss_gib": 0.0}
    sizes = {name: len(rows) for name, rows in split.items()}
    if args.train_triviaqa:
        sizes["train_triviaqa"] = sum(r["source"] == "triviaqa" for r in split["train"])

    start = time.perf_counter()
    ensure_index(cfg.retriever)
    hits = answer_hits(cfg, split)
    recall = {name: sum(h) / max(1, len(h)) for name, h in hits.items()}
    phases["index"] = {"wall_s": time.perf_counter() - start, "peak_rss_gib": 0.0}
    _log(f"index: top-{cfg.retriever.topk} answer recall {json.dumps({k: round(v, 3) for k, v in recall.items()})}")
    answerable, second = hits["train"], {}
    if args.second_search:
        second = second_queries(cfg, split["train"], hits["train"])
        for row in split["train"]:
            if row["id"] in second:
                row["metadata"] = {**row["metadata"], "queries": [row["question"], second[row["id"]]]}
        answerable = [hit or r["id"] in second for r, hit in zip(split["train"], hits["train"])]
        sizes["train_second_search"] = len(second)
        _log(f"data: {len(second)} training questions whose first search misses get a second search that finds")
    if not marker.exists():
        write_data(cfg, out / "data", split, key)
    _log(f"data: {sizes} (seed {args.seed}) in {out / 'data'}")
    train_overrides = [*overrides, *args.rl_override]
    if args.rl_second_only:
        keep = [r["id"] in second for r in split["train"]]
        sizes["train_rl_second"] = write_rl_train(
            cfg, out / "data", split["train"], keep, "train_rl_second", "--rl-second-only"
        )
        train_overrides = [*train_overrides, f"data.train_files=[{out / 'data' / 'train_rl_second.parquet'}]"]
        _log(f"data: RL trains on the {sizes['train_rl_second']} training questions with a second search")
    elif args.rl_second_balanced:
        keep = second_balanced(split["train"], hits["train"], second, args.seed)
        sizes["train_rl_balanced"] = write_rl_train(
            cfg, out / "data", split["train"], keep, "train_rl_balanced", "--rl-second-balanced"
        )
        train_overrides = [*train_overrides, f"data.train_files=[{out / 'data' / 'train_rl_balanced.parquet'}]"]
        _log(
            f"data: RL trains on {sizes['train_rl_balanced']} training questions: the {len(second)} with a second "
            "search and as many whose first search finds the answer"
        )
    elif args.rl_answerable:
        sizes["train_rl"] = write_rl_train(cfg, out / "data", split["train"], answerable)
        train_overrides = [*train_overrides, f"data.train_files=[{out / 'data' / 'train_rl.parquet'}]"]
        _log(f"data: RL trains on the {sizes['train_rl']} training questions whose search finds an answer")

    agent_rl = [sys.executable, "-m", "agent_rl"]
    plan = json.loads(
        subprocess.run(
            [*agent_rl, "plan", config, *overrides, *args.rl_override, "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout
        or "{}"
    )
    if not (out / "sft" / "config.json").exists():
        phases["sft"] = run_phase("sft", [*agent_rl, "sft", config, *overrides], out / "logs" / "sft.log")
    else:
        _log(f"sft: reusing the warm start in {out / 'sft'}")
    if args.rl_unsolved:
        if not args.rl_answerable:
            raise SystemExit("--rl-unsolved narrows --rl-answerable's pool: drop --no-rl-answerable")
        sizes["train_rl_unsolved"] = write_rl_unsolved(agent_rl, config, overrides, out / "data")
        train_overrides = [*train_overrides, f"data.train_files=[{out / 'data' / 'train_rl_unsolved.parquet'}]"]
        _log(f"data: RL trains on the {sizes['train_rl_unsolved']} of them the warm start answers wrong greedily")
    train_cmd = [*agent_rl, "train", config, *train_overrides]
    reused = None
    if args.skip_train:
        if not (run_dir / "metrics.jsonl").exists():
            raise SystemExit(f"--skip-train: no finished run in {run_dir} (no metrics.jsonl)")
        _log(f"train: taking {run_dir} as it is (--skip-train)")
    elif args.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise SystemExit(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
        train_cmd.append("--resume")
        log = out / "logs" / f"train_resume_{time.strftime('%H%M%S')}.log"
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        log = out / "logs" / ("train.log" if args.run_name == "grpo" else f"train_{args.run_name}.log")
        if reused := reuse_start_eval(out, args.run_name):
            train_cmd.append("run.eval_at_start=false")
            _log(f"train: the warm start's evaluation (step 0) is {reused.name}'s, not redone")
    if not args.skip_train:
        from agent_rl.evaluation import files_fingerprint

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "warm_start.json").write_text(json.dumps({"fingerprint": files_fingerprint(out / "sft")}))
        phases["train"] = run_phase("train", train_cmd, log)
    if reused is not None:
        for name in ("eval", "eval_trajectories"):
            shutil.copyfile(reused / name / "step_0.jsonl", run_dir / name / "step_0.jsonl")
    sft_more = None
    if args.sft_equal:
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rl_s = sum(m["timing/step_s"] for m in metrics if "reward/mean" in m)
        per_step = sft_seconds_per_step(out / "logs" / "sft.log")
        steps = args.sft_equal_steps or max(1, round(rl_s / per_step))
        _log(f"sft_equal: {steps} SFT steps for the RL steps' {rl_s:.0f} s (the warm start: {per_step:.1f} s a step)")
        sft_more = {**sft_equal(agent_rl, config, overrides, out, steps), "steps": steps, "per_step": per_step}
        phases.update(sft_more.pop("phases"))

    found = {f"{r['source']}_{r['id']}": hit for name in SETS for r, hit in zip(split[name], hits[name])}
    res = summarise(out, phases, plan, recall, sizes, str(cfg.reward.fn), found, sft_more, args.run_name)
    res.update(estimator=cfg.algo.resolved_advantage(), policy_loss=cfg.algo.policy_loss)
    res.update(config=args.config, overrides=args.overrides, rl_overrides=args.rl_override)
    res.update(rl_train_files=[str(f) for f in load_config(config, train_overrides).data.train_files])
    res.update(split_seed=args.seed, data=str(data))
    results = out / ("results" if args.run_name == "grpo" else f"results_{args.run_name}")
    results.with_suffix(".json").write_text(json.dumps(res, indent=1))
    header = (
        f"# A real model learns on real questions ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
        f"{os.cpu_count()} CPUs)\n\n`bench/real_model_learns.py --data {data} "
        f"{''.join(f'--rl-override {o} ' for o in args.rl_override)}{' '.join(args.overrides)}` "
        f"on {args.config}, split seed {args.seed}."
    )
    results.with_suffix(".md").write_text(render(res, header))
    print(results.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
