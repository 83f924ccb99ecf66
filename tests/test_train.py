"""`agent-rl train` end to end in subprocesses: parameters change, checkpoints land, kill -9 resumes
bit for bit (run.deterministic is on in every run here)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from agent_fixtures import torchrun_cmd, toy_world_overrides

from agent_rl.runtime import allocator

ROOT = Path(__file__).resolve().parents[1]


def _overrides(cache: Path, out: Path, steps: int, extra=()):
    return [
        f"run.output_dir={out}",
        f"run.max_steps={steps}",
        "run.save_every=1",
        "run.keep_last=5",
        "run.eval_max_samples=8",
        "run.tensorboard=false",
        *toy_world_overrides(cache),
        "rollout.prompts_per_step=4",
        "algo.group_size=2",
        "train.lr=1e-3",
        # A random policy earns no reward, so GRPO/GAE advantages are all zero; the entropy
        # bonus gives every step a real gradient so updates (and their resume) are exercised.
        "algo.entropy_coef=0.01",
        "run.deterministic=true",
        *extra,
    ]


def _run(args, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "agent_rl.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw
    )


@pytest.fixture(scope="module")
def cache(toy_warm_start):
    """Toy world, tiny model and index, prepared once per session (`toy_warm_start`)."""
    return toy_warm_start["cache"]


@pytest.fixture(scope="module")
def warm_start(toy_warm_start) -> Path:
    """The session's short supervised warm start on that world (`toy_warm_start`)."""
    return toy_warm_start["sft"]


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.rglob("*.safetensors"))
    assert files, f"no safetensors under {path}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_train_two_steps_changes_parameters(cache, tmp_path, algo):
    """Two GRPO / PPO steps on the toy world: parameters change and step_2 checkpoint exists."""
    out = tmp_path / "run"
    # PPO: the demo config's REINFORCE++ advantage (algo.advantage) back to auto, GAE over the critic
    ppo = ["algo.name=ppo", "algo.advantage=auto", "algo.kl_coef=0.01", "algo.kl_type=k1"]
    # and under PPO without the evaluation of the starting model (run.eval_at_start)
    extra = [*ppo, "run.eval_at_start=false"] if algo == "ppo" else ["algo.kl_coef=0.01"]
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, out, 2, extra)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    # the launcher's allocator, inherited from this process (`make test` preloads mimalloc where it is installed)
    want = "mimalloc (preloaded)" if allocator.in_use() == "mimalloc" else "glibc, mmap threshold fixed at 1 MiB"
    assert f"host allocator: {want}" in res.stderr
    ckpt = out / "checkpoints" / "step_2"
    assert ckpt.is_dir()
    before, after = _weights(cache / "model"), _weights(ckpt)
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed"
    m = _metrics(out)
    assert set(m) == {1, 2}
    assert m[2]["train/microbatch_tokens_max"] <= 8192
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/em" in line]
    assert evals and "eval/toy/em" in evals[-1]
    assert [e["step"] for e in evals] == ([0, 2] if algo == "grpo" else [2])
    assert (out / "eval" / "step_0.jsonl").exists() is (algo == "grpo")
    # Per question type (the toy world's metadata.type), with searches per trajectory.
    types = {k.split("/")[2] for k in evals[-1] if k.startswith("eval/type/") and k.endswith("/em")}
    assert types and types <= {"single", "two_hop"}
    assert all(0 <= evals[-1][f"eval/type/{t}/searches_mean"] <= 2 for t in types)
    # Each question's scores, for paired comparisons between evaluations.
    rows = [json.loads(line) for line in (out / "eval" / "step_2.jsonl").read_text().splitlines()]
    greedy = [r for r in rows if r["eval"] == "eval"]
    assert len(greedy) == evals[-1]["eval/n"] and {r["type"] for r in greedy} == types
    assert sum(r["em"] for r in greedy) / len(greedy) == pytest.approx(evals[-1]["eval/em"])


def _optimizer_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's AdamW state (moments and step counts), by parameter and name."""
    state = torch.load(checkpoint / "optim.pt", map_location="cpu", weights_only=False)["optimizer"]["state"]
    return {f"{i}/{k}": v for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def test_kill_and_resume_matches_uninterrupted_run(cache, warm_start, tmp_path):
    """From a warm start that earns reward, with dynamic sampling (algo.filter_groups): kill -9 during
    step 3, then --resume from step 2's checkpoint. Every step's metrics (rollouts, rewards, losses,
    gradient norms) equal an uninterrupted run's exactly, and the final weights and AdamW state are the
    same bit for bit. The update trains only on groups whose rewards differ. The replay set
    (guard.replay_every=2) is scored after step 2 only, and the resumed run does the same."""
    # T=0.5: the short warm start's samples earn reward (at T=1 its 96 samples earned none), so the steps update
    extra = [
        f"model.warm_start={warm_start}",
        "rollout.prompts_per_step=8",
        "algo.group_size=4",
        "rollout.temperature=0.5",
        "algo.filter_groups=true",
        "algo.max_gen_batches=2",
        "guard.replay_size=2",  # full after step 1's rewarded responses
        "guard.replay_every=2",  # scored after even steps only
    ]
    full = tmp_path / "full"
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, full, 3, extra)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]

    cut = tmp_path / "cut"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent_rl.cli",
            "train",
            "configs/tiny_cpu_grpo.yaml",
            *_overrides(cache, cut, 3, extra),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while not (cut / "checkpoints" / "step_2").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before step 2"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, cut, 3, extra), "--resume"], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {cut / 'checkpoints' / 'step_2'} at step 2" in res.stderr  # killed within step 3
    a, b = _metrics(full), _metrics(cut)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert sum(a[s]["reward/mean"] for s in a) > 0 and any(a[s]["loss/policy"] != 0 for s in a)  # a real update
    assert [s for s in a if "guard/replay_logprob" in a[s]] == [2]  # the replay set, every second step
    for m in a.values():  # dynamic sampling: a further batch only while fewer than 8 groups are kept
        kept, batches = m["rollout/kept_groups"], m["rollout/gen_batches"]
        assert batches in (1, 2) and kept <= 8 and (kept == 8 or batches == 2), m
        assert m["rollout/trajectories"] == 32 * batches
        if kept:  # only groups with differing rewards, so no row has zero advantage
            assert m["train/skipped_zero_advantage_rows"] == 0, m
    for s in a:
        for key in sorted(a[s]):
            if not key.startswith(("timing/", "memory/", "retriever/total_")):
                assert a[s][key] == b[s][key], (s, key)
    final_a, final_b = full / "checkpoints" / "step_3", cut / "checkpoints" / "step_3"
    wa, wb = _weights(final_a / "model"), _weights(final_b / "model")
    assert set(wa) == set(wb)
    assert not [k for k in wa if not torch.equal(wa[k], wb[k])], "final weights differ"
    start = _weights(warm_start)
    assert [k for k in wa if k in start and not torch.equal(wa[k], start[k])], "training changed no weight"
    oa, ob = _optimizer_state(final_a), _optimizer_state(final_b)
    assert oa and set(oa) == set(ob) and not [k for k in oa if not torch.equal(oa[k], ob[k])]


def test_sigterm_during_async_rollout_saves_and_resumes(cache, tmp_path):
    """SIGTERM while `rollout.mode=async` has trajectories in flight: the step finishes, its
    checkpoint is written, the run exits 0; `--resume` continues from that step."""
    out = tmp_path / "run"
    extra = ["rollout.mode=async", "rollout.max_inflight=4"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent_rl.cli",
            "train",
            "configs/tiny_cpu_grpo.yaml",
            *_overrides(cache, out, 50, extra),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "step_1").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before step 1"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0, stderr[-3000:]
    logged = _metrics(out)
    stopped_at = max(logged)
    assert 1 <= stopped_at < 50 and f"signal received: saving step {stopped_at}" in stderr
    assert (out / "checkpoints" / f"step_{stopped_at}").exists()
    res = _run(
        ["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, out, stopped_at + 1, extra), "--resume"], timeout=900
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped_at}'}" in res.stderr
    assert max(_metrics(out)) == stopped_at + 1


def test_bad_config_key_fails_fast(tmp_path):
    """A typo in a key exits non-zero at once with the key's name."""
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", "algo.grup_size=3"], timeout=120)
    assert res.returncode == 2 and "algo.grup_size" in res.stderr


def test_torchrun_two_ranks_trains_checkpoints_and_resumes(cache, tmp_path):
    """`torchrun --nproc-per-node 2 -m agent_rl train`: gloo ranks each roll out half the groups,
    rank 0 alone writes metrics, the sharded checkpoint exports a loadable model, and --resume
    continues from it on the same world size."""
    out = tmp_path / "ddp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

    def torchrun(steps, *extra):
        cmd = [
            *torchrun_cmd(2, "-m", "agent_rl", "train", "configs/tiny_cpu_grpo.yaml"),
            *_overrides(cache, out, steps),
            "run.save_every=2",
            *extra,
        ]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    res = torchrun(2)
    assert res.returncode == 0, res.stderr[-4000:]
    ckpt = out / "checkpoints" / "step_2"
    assert (ckpt / "dcp").is_dir() and (ckpt / "rank_0.pt").exists() and (ckpt / "rank_1.pt").exists()
    before, after = _weights(cache / "model"), _weights(ckpt / "model")
    assert set(before) <= set(after)  # the export may also write the tied lm_head
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "model")  # `agent-rl eval --checkpoint` can load it
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    m = _metrics(out)
    assert set(m) == {1, 2}
    assert m[1]["rollout/trajectories"] == 4  # each rank: 2 of the 4 prompts x group 2; metrics are rank means
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"step": 1,' in line and "reward/mean" in line]) == 1, (
        "a rank other than 0 wrote metrics"
    )
    # the evaluation is sharded: each rank ran its half of the 8 questions, rank 0 merged them in order
    evals = [json.loads(line) for line in lines if '"eval/em"' in line]
    assert evals and all(e["eval/n"] == 8 for e in evals)
    rows = [json.loads(line) for line in (out / "eval" / "step_2.jsonl").read_text().splitlines()]
    greedy = [r for r in rows if r["eval"] == "eval"]
    assert [r["rank"] for r in greedy] == [0] * 4 + [1] * 4
    assert sum(r["em"] for r in greedy) / 8 == pytest.approx(evals[-1]["eval/em"])

    res = torchrun(3, "--resume")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr
    assert set(_metrics(out)) == {1, 2, 3}
    assert (out / "checkpoints" / "step_3" / "dcp").is_dir()


def test_sft_warm_start_masks_observations_and_redraws_wrong_answers(cache, tmp_path):
    """`agent-rl sft`: scripted demonstrations (search with the row's queries, the real observation
    at loss mask 0, an answer) train the tiny model and save a loadable warm start; a wrong answer
    is drawn afresh on every draw, so it cannot be learnt by memorising the entity."""
    import random

    from agent_rl.rollout.trajectory import Trajectory
    from agent_rl.sft import Demonstrations

    out = tmp_path / "sft"
    res = _run(
        [
            "sft",
            "configs/tiny_cpu_grpo.yaml",
            *_overrides(cache, tmp_path / "run", 1),
            f"model.warm_start={out}",
            "sft.steps=3",
            "sft.batch_size=4",
        ],
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "scripted demonstrations" in res.stderr and "step 3/3" in res.stdout
    before, after = _weights(cache / "model"), _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after), "SFT changed no parameter"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)

    prefix = Trajectory("toy-1", "toy", [1, 2, 3], ["Oslo"])
    prefix.append([4, 5], sampled=True)  # <search> q </search>
    prefix.append([6, 7, 8], sampled=False)  # <information> ... </information>
    pool = ["Oslo", "Lima", "Cairo", "Quito"]
    demos = Demonstrations([prefix], pool, {a: [100 + i, 200] for i, a in enumerate(pool)}, [None])
    rng = random.Random(0)
    drawn = [demos.draw(0, 0.5, rng) for _ in range(400)]
    answers = [tuple(t.response_ids[5:]) for t in drawn]
    assert all(t.loss_mask == [1, 1, 0, 0, 0, 1, 1] for t in drawn)
    assert 0.4 < sum(a == (100, 200) for a in answers) / len(answers) < 0.6  # golden about half the time
    assert {a[0] for a in answers} == {100, 101, 102, 103}  # wrong answers vary between draws
    assert prefix.response_ids == [4, 5, 6, 7, 8]  # the stored prefix is never modified
    assert all(demos.draw(0, 0.0, rng).response_ids[5:] == [100, 200] for _ in range(20))
    # A single-hop prefix ignores second_hop_fraction.
    assert all(demos.draw(0, 0.0, rng, second_hop_fraction=0.0).response_ids[5:] == [100, 200] for _ in range(20))


def test_weaker_demonstrator_stops_two_hop_demonstrations_after_the_first_search():
    """sft.second_hop_fraction: a two-hop demonstration keeps its second search in that share of
    draws; the others end after the first observation and answer with the first hop's finding."""
    import random

    from agent_rl.rollout.trajectory import Trajectory
    from agent_rl.sft import Demonstrations

    prefix = Trajectory("toy-2", "toy", [1, 2, 3], ["Oslo"])
    prefix.append([4, 5], sampled=True)  # <search> Velk Works founder </search>
    prefix.append([6, 7], sampled=False)  # <information> ... founded by Doran Velk </information>
    prefix.append([8, 9], sampled=True)  # <search> Doran Velk born </search>
    prefix.append([10, 11], sampled=False)  # <information> ... born in Oslo </information>
    ids = {"Oslo": [100, 200], "Lima": [101, 200], "Doran Velk": [300, 200]}
    demos = Demonstrations([prefix], ["Oslo", "Lima"], ids, [(4, "Doran Velk")])
    rng = random.Random(0)
    drawn = [demos.draw(0, 0.0, rng, second_hop_fraction=0.25) for _ in range(800)]
    short = [t for t in drawn if len(t.response_ids) == 6]
    assert all(t.response_ids == [4, 5, 6, 7, 300, 200] and t.loss_mask == [1, 1, 0, 0, 1, 1] for t in short)
    full = [t for t in drawn if len(t.response_ids) == 10]
    assert len(short) + len(full) == len(drawn)
    assert all(t.response_ids[8:] == [100, 200] and t.loss_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1] for t in full)
    assert 0.2 < len(full) / len(drawn) < 0.3
    assert all(len(demos.draw(0, 0.0, rng).response_ids) == 10 for _ in range(50))  # default: both hops
    assert prefix.response_ids == [4, 5, 6, 7, 8, 9, 10, 11]


def test_sft_answer_in_observation_keeps_only_demonstrations_that_read_the_answer(cache, tmp_path):
    """sft.answer_in_observation: of the toy world's scripted demonstrations (top-1 search, so some
    observations miss the fact), only those whose observation holds a gold answer are kept, and
    the count is said; off, every demonstration is kept."""
    from agent_rl.bootstrap.prepare import prepare
    from agent_rl.config import load_config
    from agent_rl.rollout.prompts import load_tokenizer
    from agent_rl.run import open_loop
    from agent_rl.sft import build_demonstrations, observed_text
    from retriever_server.answers import contains_answer

    base = _overrides(cache, tmp_path / "run", 1, ["retriever.topk=1"])
    cfgs = {
        flag: load_config("configs/tiny_cpu_grpo.yaml", [*base, f"sft.answer_in_observation={flag}"])
        for flag in (True, False)
    }
    prepare(cfgs[True])
    tok = load_tokenizer(cfgs[True].model.path)
    demos = {}
    for flag, cfg in cfgs.items():
        with open_loop(cfg, None, tok) as loop:
            demos[flag] = build_demonstrations(cfg, loop)
    kept, every = demos[True], demos[False]
    assert 0 < len(kept) < len(every)
    for prefix in kept.prefixes:
        assert contains_answer(observed_text(tok, prefix), prefix.golden_answers), observed_text(tok, prefix)
    missing = [p for p in every.prefixes if not contains_answer(observed_text(tok, p), p.golden_answers)]
    assert len(kept) + len(missing) == len(every)


def test_dead_retriever_stops_with_a_checkpoint_and_resumes(cache, warm_start, tmp_path, hotpot_index_dir):
    """The retriever is SIGKILLed mid-run: no update uses a trajectory whose search failed (every
    failed one is excluded), the run waits for /health, then checkpoints and exits non-zero naming
    the URL; `--resume` against a live server continues from that checkpoint."""
    from agent_fixtures import start_server

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    fast_fail = [
        "retriever.health_wait_s=2",
        "retriever.max_retries=1",
        "retriever.backoff_s=0.05",
        "retriever.timeout_s=5",
        "run.eval_max_samples=4",
        f"model.warm_start={warm_start}",
        "train.lr=1e-5",
    ]  # a warm start and a gentle lr: the policy keeps searching
    with start_server(hotpot_index_dir) as (proc, url):
        args = [
            sys.executable,
            "-m",
            "agent_rl.cli",
            "train",
            "configs/tiny_cpu_grpo.yaml",
            *_overrides(cache, out, 8),
            f"retriever.url={url}",
            *fast_fail,
        ]
        train = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "step_2").exists():
            assert train.poll() is None and time.monotonic() < deadline, "run ended before step 2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stderr = train.communicate(timeout=600)[1]
    assert train.returncode not in (0, None), stderr[-3000:]
    assert url in stderr and "--resume" in stderr and "/health" in stderr
    logged = _metrics(out)
    stopped_at = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert stopped_at >= 2 and max(logged) == stopped_at
    for m in logged.values():
        assert m["train/excluded_trajectories"] == m["retriever/failed_trajectories"]
        assert "retriever/total_requests" in m and "retriever/queries" in m
    with start_server(hotpot_index_dir) as (_, url2):
        res = _run(
            [
                "train",
                "configs/tiny_cpu_grpo.yaml",
                *_overrides(cache, out, stopped_at + 1),
                f"retriever.url={url2}",
                *fast_fail,
                "--resume",
            ],
            timeout=900,
        )
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped_at}'}" in res.stderr
    after = _metrics(out)
    assert max(after) == stopped_at + 1 and after[stopped_at + 1]["retriever/failed_trajectories"] == 0


def test_sft_observation_weight_falls_to_zero_over_its_steps():
    """sft.observation_loss_steps: the observations' weight starts at sft.observation_loss and falls linearly to 0
    over that many steps, then stays 0; 0 steps hold the weight for the whole run; a negative count is refused."""
    from agent_rl.config import ConfigError, load_config
    from agent_rl.sft import observation_weight

    held = load_config(None, ["sft.observation_loss=0.25"]).sft
    assert [observation_weight(held, s) for s in (1, 400, 2000)] == [0.25, 0.25, 0.25]
    decayed = load_config(None, ["sft.observation_loss=0.25", "sft.observation_loss_steps=400"]).sft
    weights = [observation_weight(decayed, s) for s in range(1, 801)]
    assert weights[0] == 0.25 and weights[200] == pytest.approx(0.125) and 0 < weights[399] < 0.001
    assert all(a > b for a, b in zip(weights[:400], weights[1:401])) and set(weights[400:]) == {0.0}
    assert observation_weight(load_config(None, ["sft.observation_loss_steps=400"]).sft, 1) == 0.0  # no weight
    with pytest.raises(ConfigError, match="sft.observation_loss_steps must be >= 0"):
        load_config(None, ["sft.observation_loss_steps=-1"])


def test_sft_opening_free_fraction_cuts_the_opening_every_prompt_shares():
    """sft.opening_free_fraction: `shared_opening` is the longest prefix every prompt shares, less one token (each
    prompt keeps its last), and `without_opening` cuts it from the prompt and leaves the response, its mask and
    log-probs as they were; a share outside [0, 1] is refused."""
    from agent_rl.config import ConfigError, load_config
    from agent_rl.rollout.trajectory import Trajectory
    from agent_rl.sft import shared_opening, without_opening

    assert shared_opening([[1, 2, 3, 7, 8], [1, 2, 3, 9], [1, 2, 3, 7]]) == 3
    assert shared_opening([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter one keeps its last token
    assert shared_opening([[5, 2], [1, 2]]) == 0
    t = Trajectory("toy-1", "toy", [1, 2, 3, 9, 10], ["Oslo"])
    t.append([20, 21], sampled=True)
    t.append([30], sampled=False)
    cut = without_opening(t, 3)
    assert cut.prompt_ids == [9, 10] and t.prompt_ids == [1, 2, 3, 9, 10]
    assert (cut.response_ids, cut.loss_mask, cut.logprobs) == (t.response_ids, t.loss_mask, t.logprobs)
    assert load_config(None, ["sft.opening_free_fraction=1"]).sft.opening_free_fraction == 1.0
    for bad in ("1.5", "-0.1"):
        with pytest.raises(ConfigError, match=r"sft.opening_free_fraction must be within \[0, 1\]"):
            load_config(None, [f"sft.opening_free_fraction={bad}"])
