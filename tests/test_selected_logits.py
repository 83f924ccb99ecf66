"""The LM head only where the loss is computed (`forward_logprobs`, selected positions).

The selected path equals the full-vocabulary path in log-probs, entropy and every parameter
gradient: on the tiny Qwen2 and on the real SmolLM2 (tied embeddings, vocab 49,152), with and
without the shared prompt prefix (a group's prompt, or the span every row opens with), under LoRA,
and in small float32 chunks; and the head sees only the trained positions.
"""

import pytest
import torch
from test_losses import _trajs

from agent_rl.config import load_config
from agent_rl.learn.batch import collate
from agent_rl.learn.policy import forward_logprobs, load_policy
from agent_rl.rollout.trajectory import Trajectory


def _compare(policy, mb, share: bool, chunk: int, rtol: float = 1e-4, common: bool = False):
    weights = torch.rand(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * mb.loss_mask
    out = {}
    for selected in (False, True):
        policy.zero_grad()
        seen = []
        hook = policy.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
        lp, ent = forward_logprobs(
            policy,
            mb,
            0.7,
            with_entropy=True,
            share_prefix=share,
            selected=selected,
            chunk_tokens=chunk,
            common_prefix=common,
        )
        hook.remove()
        ((lp + 0.1 * ent) * weights).sum().backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
        out[selected] = (lp.detach(), ent.detach(), grads, seen)
    (lp0, ent0, g0, _), (lp1, ent1, g1, seen1) = out[False], out[True]
    m = mb.loss_mask.clone()
    m[:, 0] = 0
    assert torch.allclose(lp0 * m, lp1, atol=2e-5) and torch.allclose(ent0 * m, ent1, atol=2e-5)
    assert torch.count_nonzero(lp1 * (1 - m)) == 0
    for a, b in zip(g0, g1):
        assert float((a - b).norm()) <= rtol * float(a.norm()) + 1e-6
    trained = int(m.sum())
    assert sum(s[0] * s[1] for s in seen1) <= trained + len(
        mb.index
    )  # head rows: the trained tokens (+ one per prompt pass)
    return trained


@pytest.mark.parametrize("share", [False, True])
def test_selected_head_equals_full_path_tiny(tiny_model_dir, share):
    """Tiny Qwen2, a 4-token chunk (many chunks): same log-probs, entropy and gradients as the full pass."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000", "algo.group_size=3"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, groups=2, n=3, prompt_len=30)
    _compare(policy, collate(trajs, list(range(len(trajs))), 0), share, chunk=4)


def test_selected_head_equals_full_path_under_lora(tiny_model_dir):
    """A peft policy: the hook finds the output embedding through peft; adapter gradients match."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "budget.max_total_tokens=1000",
            "algo.group_size=3",
            "model.lora.enabled=true",
            "model.lora.rank=4",
        ],
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    trajs = _trajs(policy.config.vocab_size)
    _compare(policy, collate(trajs, list(range(len(trajs))), 0), True, chunk=2048)


@pytest.mark.real_model
def test_selected_head_equals_full_path_smollm2(smollm2_dir):
    """The real SmolLM2 (tied embeddings, vocab 49,152), with the shared prefix (its prompt pass
    keeps one position, its response pass the trained ones); gradients to float32 rounding over
    30 layers (5e-4 relative)."""
    cfg = load_config(None, [f"model.path={smollm2_dir}", "budget.max_total_tokens=1000", "algo.group_size=3"])
    policy = load_policy(cfg.model, str(smollm2_dir), "cpu")
    assert policy.config.tie_word_embeddings
    trajs = _trajs(policy.config.vocab_size, groups=2, n=2, prompt_len=20)
    mb = collate(trajs, list(range(len(trajs))), 0)
    _compare(policy, mb, True, chunk=16, rtol=5e-4)


def _opening_alike(vocab: int, rows: int = 5, opening: int = 40) -> list:
    """SFT-like rows: every prompt its own (a question), all opening with the same `opening` tokens (a system
    prompt); a trained answer after an untrained question part of 3-7 tokens."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(10, vocab, (opening,), generator=g).tolist()
    trajs = []
    for i in range(rows):
        question = torch.randint(10, vocab, (3 + i,), generator=g).tolist()
        t = Trajectory(f"q{i}", "toy", system + question, ["x"])
        t.append(torch.randint(10, vocab, (4 + 2 * i,), generator=g).tolist(), sampled=True)
        t.append(torch.randint(10, vocab, (6,), generator=g).tolist(), sampled=False)  # an observation
        t.append(torch.randint(10, vocab, (3,), generator=g).tolist(), sampled=True)
        trajs.append(t)
    return trajs


def test_common_opening_runs_once_with_the_same_logprobs_and_gradients(tiny_model_dir):
    """Rows with distinct prompts that open alike (SFT's demonstrations: one system prompt, each its own
    question): with `common_prefix` the opening runs once (a one-row prompt pass, then the rows from where
    they differ), with the same log-probs, entropy and gradients as the full pass; without it, or where the
    rows share no opening, no prefix pass runs."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _opening_alike(policy.config.vocab_size)
    mb = collate(trajs, list(range(len(trajs))), 0)
    for common in (False, True):
        seen = []
        hook = policy.get_decoder().register_forward_pre_hook(
            lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        _compare(policy, mb, True, chunk=8, common=common)
        hook.remove()
        selected = seen[2 if common else 1 :]  # the full reference ran first, with the same plan: 2 passes or 1
        if common:
            assert selected[0] == (1, 40)  # the opening, once
            assert sum(r * c for r, c in selected[1:]) <= len(trajs) * (mb.input_ids.shape[1] - 40)
        else:
            assert selected == [tuple(mb.input_ids.shape)]  # no two prompts alike: one plain pass
    # the opening stops at the first trained token of any row: a row trained from column 20 cuts it there
    early = _opening_alike(policy.config.vocab_size)
    early[0] = Trajectory("q0", "toy", early[0].prompt_ids[:20], ["x"])
    early[0].append((trajs[0].prompt_ids + trajs[0].response_ids)[20:60], sampled=True)
    mb = collate(early, list(range(len(early))), 0)
    seen = []
    hook = policy.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    _compare(policy, mb, True, chunk=8, common=True)
    hook.remove()
    assert seen[0] == seen[2] == (1, 20)  # the reference's prompt pass, then the selected path's


def test_observation_weight_trains_observations_at_that_weight(tiny_model_dir):
    """SFT's `sft.observation_loss`: `collate(..., observation_weight=w)` puts w on the response's untrained
    tokens (the observations), 1 on the sampled ones, 0 on the prompt and padding; the selected head then
    scores the observations too, and the weighted loss equals the one a plain full forward gives."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "budget.max_total_tokens=1000"])
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _opening_alike(policy.config.vocab_size)
    index = list(range(len(trajs)))
    plain, weighted = collate(trajs, index, 0), collate(trajs, index, 0, observation_weight=0.25)
    for r, t in enumerate(trajs):
        start, end = t.prompt_tokens, t.total_tokens
        assert weighted.loss_mask[r, :start].sum() == 0 and weighted.loss_mask[r, end:].sum() == 0
        expected = torch.tensor([1.0 if m else 0.25 for m in t.loss_mask])
        assert torch.equal(weighted.loss_mask[r, start:end], expected)
        assert torch.equal(plain.loss_mask[r, start:end], torch.tensor(t.loss_mask, dtype=torch.float32))
    with torch.no_grad():
        logits = policy(input_ids=weighted.input_ids, attention_mask=weighted.attention_mask).logits.float()
        ref = torch.zeros_like(weighted.loss_mask)
        ref[:, 1:] = logits[:, :-1].log_softmax(-1).gather(-1, weighted.input_ids[:, 1:, None])[..., 0]
    losses = {}
    for name, mb in (("plain", plain), ("weighted", weighted)):
        lp, _ = forward_logprobs(policy, mb, 1.0, share_prefix=True, common_prefix=True)
        m = mb.loss_mask.clone()
        m[:, 0] = 0
        assert torch.count_nonzero(lp * (m == 0)) == 0  # nothing outside the trained tokens
        assert torch.allclose(lp, ref * (m > 0), atol=2e-5)
        losses[name] = float(-(lp * mb.loss_mask).sum())
        assert losses[name] == pytest.approx(float(-(ref * m).sum()), rel=1e-5)
    observations = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
    assert observations > 0 and losses["weighted"] > losses["plain"]  # the observations' 0.25 share is in it
