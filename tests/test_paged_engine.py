"""`rollout.engine=paged`: transformers' continuous batching behind `PagedEngine`, on the real tiny model
(SmolLM2 where marked `real_model`): the HF engine's greedy ids and trajectories, the trainer's log-probs,
each row's token allowance, draws that replay from the checkpointed generator, the weight sync into its
own copy, what the config refuses, the planner's figures, and a GRPO run resumed after kill -9."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch
from agent_fixtures import start_server, toy_world_overrides

from agent_rl.config import ConfigError, load_config
from agent_rl.learn.policy import load_policy
from agent_rl.rollout.engines import EngineSpec, HFEngine, PagedEngine, build_engine, engine_memory
from agent_rl.rollout.engines.paged import PAGE_TOKENS

ROOT = Path(__file__).resolve().parents[1]


def _cfg(model_dir, *extra):
    return load_config(
        None, [f"model.path={model_dir}", "rollout.engine=paged", "budget.max_total_tokens=1000", *extra]
    )


def _prompts(tok):
    texts = ["Who directed the film", "The capital of", "Question: where was the author born?", "<search>"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _greedy(engine, prompts, n=24):
    return [g.token_ids for g in engine.generate(prompts, [n] * len(prompts), 0.0)]


def _trainer_logprobs(model, prompt, ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def test_paged_engine_greedy_logprobs_allowances_and_draws(tiny_model_dir, tokenizer):
    """fp32, the tiny model: greedy ids equal the HF engine's; sampled tokens' log-probs are the
    post-temperature ones the trainer computes (mean and max difference < 1e-4); each row stops at its
    own allowance (0: nothing generated); the draws replay from the same generator state and leave
    torch's process-wide generator as it was; no paged cache outlives its call; per-row seeds are refused."""
    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tokenizer)
    assert isinstance(engine, PagedEngine) and engine.model is not policy
    assert not any(p.requires_grad for p in engine.model.parameters())
    prompts = _prompts(tokenizer)
    assert _greedy(engine, prompts) == _greedy(HFEngine(policy, tokenizer, "cpu", 16, seed=0), prompts)
    limits = [32, 5, 0, 17] * 4
    state = engine.generator.get_state()
    torch.manual_seed(123)
    gens = engine.generate(prompts * 4, limits, 0.7)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))  # the manager's seeding did not leak into the trainer's draws
    for g, n in zip(gens, limits):
        assert len(g.logprobs) == len(g.token_ids) <= n
        if g.finish_reason == "length":
            assert len(g.token_ids) == n
        else:
            assert g.token_ids[-1] in engine.stop_ids
    assert [g.token_ids for g in gens if g.token_ids == []] == [[]] * 4
    diffs = torch.cat(
        [
            (_trainer_logprobs(policy.eval(), p, g.token_ids, 0.7) - torch.tensor(g.logprobs)).abs()
            for p, g in zip(prompts * 4, gens)
            if g.token_ids
        ]
    )
    assert diffs.mean().item() < 1e-4 and diffs.max().item() < 1e-4, diffs.max().item()
    engine.generator.set_state(state)
    assert [g.token_ids for g in engine.generate(prompts * 4, limits, 0.7)] == [g.token_ids for g in gens]
    assert [g.token_ids for g in engine.generate(prompts * 4, limits, 0.7)] != [g.token_ids for g in gens]
    from transformers.generation.continuous_batching import PagedAttentionCache

    assert not [o for o in gc.get_objects() if type(o) is PagedAttentionCache]  # no cache outlives its call
    with pytest.raises(ValueError, match="rollout.mode=async"):
        engine.generate(prompts, [4] * 4, 1.0, seeds=[1, 2, 3, 4])


def _perturb(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_paged_engine_follows_the_policy_only_through_sync(tiny_model_dir, tokenizer):
    """The engine's copy does not follow an update until `sync_weights(policy)`; after it the greedy ids
    equal the HF engine's on a LoRA policy (its adapters merged into the copy). A plain policy's tensors,
    and a sharded one's (`full_params`), land in the copy exactly."""
    cfg = _cfg(tiny_model_dir, "model.lora.enabled=true", "model.lora.rank=4")
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tokenizer)
    prompts = _prompts(tokenizer)
    before = _greedy(engine, prompts)
    _perturb(policy, 0.5, 0)
    want = _greedy(HFEngine(policy, tokenizer, "cpu", 16, seed=0), prompts)
    assert _greedy(engine, prompts) == before != want
    engine.sync_weights(policy)
    assert _greedy(engine, prompts) == want
    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tokenizer)
    for seed, full in ((1, None), (2, lambda dtype: ((n, t.to(dtype)) for n, t in policy.state_dict().items()))):
        _perturb(policy, 0.05, seed)
        assert not all(torch.equal(t, policy.state_dict()[n]) for n, t in engine.model.state_dict().items())
        engine.sync_weights(policy, full_params=full)
        assert all(torch.equal(t, policy.state_dict()[n]) for n, t in engine.model.state_dict().items())


def test_paged_sync_loop_trajectories_equal_the_hf_engines(toy_warm_start):
    """The warm-started tiny model (it searches and answers in its tags) against a real server, the
    turn-synchronous loop: greedy trajectories on the paged engine equal the HF engine's token for token,
    mask for mask, turn for turn; sampled ones stop at a tag with nothing after it and hold every budget."""
    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.loop import AgentLoop
    from agent_rl.rollout.prompts import load_prompts, load_tokenizer
    from retriever_server.client import RetrieverClient

    cache, sft = toy_warm_start["cache"], toy_warm_start["sft"]
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [*toy_world_overrides(cache), f"model.warm_start={sft}", "rollout.engine=paged", "rollout.prompts_per_step=8"],
    )
    tok = load_tokenizer(str(sft))
    budget = TokenBudget.from_config(cfg.budget)
    items = load_prompts(cfg.data.test_files, tok, budget, max_samples=8).items
    policy = load_policy(cfg.model, str(sft), "cpu")
    paged = build_engine(EngineSpec.from_config(cfg), policy, tok)
    hf = HFEngine(policy, tok, "cpu", 64, seed=0)

    def record(t):
        return (t.response_ids, t.loss_mask, t.end_reason, [(x.action, x.query, x.gen_tokens) for x in t.turns])

    with start_server(cache / "index") as (_, url):
        client = RetrieverClient(url, topk=cfg.retriever.topk)
        runs = {
            name: AgentLoop(e, tok, client, budget).run(items, 1, temperature=0.0)
            for name, e in (("paged", paged), ("hf", hf))
        }
        sampled = AgentLoop(paged, tok, client, budget).run(items, 4, temperature=1.0)
    assert [record(t) for t in runs["paged"]] == [record(t) for t in runs["hf"]]
    for a, b in zip(runs["paged"], runs["hf"]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    actions = {x.action for t in runs["paged"] + sampled for x in t.turns}
    assert {"search", "answer"} <= actions  # the tags were generated and stopped at
    stop = set(paged.stop_ids)
    for t in sampled:
        assert t.total_tokens <= budget.max_total_tokens and t.end_reason is not None
        assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
        assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
        assert all(x.gen_tokens <= budget.max_tokens_per_turn for x in t.turns)
        sampled_ids = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
        ends = [sum(x.gen_tokens for x in t.turns[: k + 1]) for k in range(len(t.turns))]
        assert not [i for k, i in enumerate(sampled_ids) if i in stop and k + 1 not in ends]  # nothing past a tag


def test_paged_config_auto_and_planned_memory(monkeypatch):
    """The config refuses the paged engine with the asynchronous loop (per-row seeds) naming the key, and
    `auto` never chooses it (CUDA without a CUDA vLLM build is the HF engine; test_engines covers the choice); the
    planner gets the engine's own figures: its copy of the weights and its paged cache as configured."""
    with pytest.raises(ConfigError, match="rollout.mode=async"):
        load_config(None, ["rollout.engine=paged", "rollout.mode=async"])
    monkeypatch.setattr(metadata, "version", lambda dist: (_ for _ in ()).throw(metadata.PackageNotFoundError(dist)))
    cfg = load_config(None, ["rollout.engine=auto", "rollout.device=cuda", "rollout.mode=async"])
    assert cfg.rollout.resolved_engine() == "hf"
    from agent_rl.planning.plan import Arch

    arch = Arch(hidden=192, layers=3, heads=3, kv_heads=1, intermediate=512, vocab=1536, tied=True)
    cfg = _cfg("unused", "rollout.prompts_per_step=4", "algo.group_size=2")
    mem = engine_memory(EngineSpec.from_config(cfg), arch, 4)
    blocks = 8 * -(-1000 // PAGE_TOKENS)
    assert mem.on_host and mem.held == {"rollout_copy": arch.params() * 4}
    assert mem.rollout["paged_kv_cache"] == blocks * PAGE_TOKENS * 2 * arch.layers * arch.kv_heads * arch.head_dim * 4
    bf16 = engine_memory(EngineSpec.from_config(_cfg("unused", "train.bf16=true", "rollout.device=cuda")), arch, 4)
    assert not bf16.on_host and bf16.held == {"rollout_copy": arch.params() * 2}


def test_grpo_with_paged_engine_resumes_after_kill_exactly(toy_warm_start, tmp_path):
    """`agent-rl train` with rollout.engine=paged from the warm start (it searches and answers in its tags):
    2 steps straight; and a run killed (kill -9) once its step-1 checkpoint lands, resumed with --resume,
    whose step 2 equals the first run's in every metric (the draws come from the checkpointed generator);
    engine and trainer log-probs agree (fp32, mean < 1e-4); parameters change."""
    from test_train import _metrics, _overrides, _run, _weights

    cache = toy_warm_start["cache"]
    extra = [f"model.warm_start={toy_warm_start['sft']}", "rollout.engine=paged", "rollout.temperature=0.5"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, full, 2, extra)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "agent_rl.cli",
        "train",
        "configs/tiny_cpu_grpo.yaml",
        *_overrides(cache, cut, 2, extra),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (cut / "checkpoints" / "step_1").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before step 1"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, cut, 2, extra), "--resume"], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {cut / 'checkpoints' / 'step_1'} at step 1" in res.stderr
    a, b = _metrics(full), _metrics(cut)
    assert sorted(a) == sorted(b) == [1, 2]
    assert all(a[s]["rollout/action_search"] > 0 and a[s]["rollout/action_answer"] > 0 for s in a)  # stopped at tags
    for key in sorted(a[2]):
        if not key.startswith(("timing/", "memory/", "retriever/total_")):
            assert a[2][key] == b[2][key], key
    for step in (1, 2):
        assert a[step]["rollout/logprob_diff_mean"] < 1e-4
    before, after = _weights(toy_warm_start["sft"]), _weights(full / "checkpoints" / "step_2" / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)
    assert json.loads((full / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


@pytest.mark.real_model
def test_real_model_paged_stops_at_merged_tags_like_hf(smollm2_dir):
    """SmolLM2's tags are 3 tokens and `>` merges with a following `.` or `<`: the paged engine stops on
    the token that completes `</search>` / `</answer>` (kept whole, nothing after it), at eos and at the
    length limit, with the HF engine's greedy ids; its sampled log-probs match the trainer's (fp32, mean
    < 1e-4)."""
    from transformers import AutoModelForCausalLM

    from agent_rl.rollout.prompts import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    engine = build_engine(EngineSpec.from_config(_cfg(smollm2_dir, "budget.max_total_tokens=1024")), model, tok)
    hf = HFEngine(model, tok, "cpu", 16, seed=0)
    assert engine.stop_strings == ["</search>", "</answer>"]
    search = (
        "".join(f"Q: capital of {c}?\n<search>capital of {c}</search>.\n" for c in ("France", "Spain", "Italy"))
        + "Q: capital of Peru?\n"
    )
    answer = (
        "".join(
            f"Q: capital of {c}?\n<answer>{a}</answer><br>\n"
            for c, a in (("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"))
        )
        + "Q: capital of Peru?\n"
    )
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (search, answer, chat, chat)]
    limits = [40, 40, 40, 3]
    outs = {name: e.generate(prompts, limits, 0.0) for name, e in (("paged", engine), ("hf", hf))}
    assert [g.token_ids for g in outs["paged"]] == [g.token_ids for g in outs["hf"]]
    s, a, eos, short = outs["paged"]
    assert s.finish_reason == a.finish_reason == eos.finish_reason == "stop" and short.finish_reason == "length"
    assert tok.decode(s.token_ids).endswith("</search>.") and tok.decode(s.token_ids[-1:]) == ">."
    assert tok.decode(a.token_ids).endswith("</answer><") and tok.decode(a.token_ids[-1:]) == "><"
    assert eos.token_ids[-1] == tok.eos_token_id and len(short.token_ids) == 3
    assert "</search>" not in tok.decode(s.token_ids[:-1])
    sampled = engine.generate(prompts[:3], [24] * 3, 1.0)
    diffs = torch.cat(
        [
            (_trainer_logprobs(model, p, g.token_ids, 1.0) - torch.tensor(g.logprobs)).abs()
            for p, g in zip(prompts[:3], sampled)
        ]
    )
    assert diffs.mean().item() < 1e-4, diffs.mean().item()
