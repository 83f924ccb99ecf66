"""The update moves a real tiny Qwen2 the right way on a fixed batch: one GRPO step raises the
log-probs of positive-advantage responses and lowers those of negative ones, the entropy bonus
raises the entropy, the KL term pulls the policy back to the reference. Around it: k micro-batches
give the one-pass gradient for every `algo.loss_agg` (with an excluded all-zero-mask row),
`algo.mini_batch_size` takes one optimizer step per mini-batch, truncated-IS weights, gradient
checkpointing and the learning-rate schedule against hand-computed values."""

import copy
import math
import random

import pytest
import torch

from agent_rl.config import load_config
from agent_rl.learn import losses
from agent_rl.learn.batch import RolloutBatch, collate
from agent_rl.learn.policy import ValueModel, forward_logprobs, frozen_copy, load_policy
from agent_rl.learn.update import adamw, prepare_batch, update
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.train import make_scheduler


def _cfg(model_dir, *extra):
    """Short trajectories (so a small micro-batch cap splits the batch), no gradient clipping (the
    raw gradient is what the tests compare)."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "budget.max_prompt_tokens=16",
            "budget.max_tokens_per_turn=16",
            "budget.max_total_tokens=64",
            "algo.group_size=4",
            "train.max_grad_norm=0",
            *extra,
        ],
    )


def _trajs(vocab: int, rewards: list[float], excluded: int | None = None) -> list[Trajectory]:
    """Groups of 4 (prompt lengths 9, 10, ...): a sampled turn, an observation (mask 0), a second
    sampled turn of growing length. `excluded` is a row whose search failed: its mask is all 0."""
    g = torch.Generator().manual_seed(0)
    trajs = []
    for gi in range(len(rewards) // 4):
        prompt = torch.randint(10, vocab, (9 + gi,), generator=g).tolist()
        for j in range(4):
            t = Trajectory(f"toy-{gi}", "toy", prompt, ["x"], sample_idx=j)
            t.append(torch.randint(10, vocab, (5 + j,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * (5 + j))
            t.append(torch.randint(10, vocab, (7,), generator=g).tolist(), sampled=False)
            n = 4 + 2 * j
            t.append(torch.randint(10, vocab, (n,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * n)
            t.reward = rewards[4 * gi + j]
            trajs.append(t)
    if excluded is not None:
        t = trajs[excluded]
        t.excluded, t.loss_mask = True, [0] * len(t.loss_mask)
    return trajs


def _response_stats(policy, trajs: list[Trajectory]) -> tuple[torch.Tensor, float]:
    """Per-row mean log-prob of the sampled tokens (N,), and the mean entropy over them."""
    mb = collate(trajs, list(range(len(trajs))), 0)
    with torch.no_grad():
        lp, ent = forward_logprobs(policy, mb, 1.0, with_entropy=True)
    m = mb.loss_mask
    return (lp * m).sum(-1) / m.sum(-1), float((ent * m).sum() / m.sum())


def _kl_to_ref(policy, ref, trajs: list[Trajectory]) -> float:
    """Mean k3 estimate of KL(policy || ref) over the sampled tokens (what the KL term minimises)."""
    mb = collate(trajs, list(range(len(trajs))), 0)
    with torch.no_grad():
        lp, _ = forward_logprobs(policy, mb, 1.0)
        ref_lp, _ = forward_logprobs(ref, mb, 1.0)
    return float(losses.masked_mean(losses.kl_penalty(lp, ref_lp, "low_var_kl"), mb.loss_mask))


def _drift(policy, scale: float = 0.05) -> None:
    """Move the policy away from where it started (and from a reference copied before)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------- direction of one step


def test_grpo_step_raises_positive_and_lowers_negative_advantage_responses(tiny_model_dir):
    """One GRPO update (the trainer's AdamW): every group has rewards 1, 0, 1, 0, so two rows per group
    get a positive advantage and two a negative one; the mean log-prob of the positive rows rises
    and that of the negative rows falls (on average by more than float noise, and row by row)."""
    cfg = _cfg(tiny_model_dir, "train.lr=1e-3")
    torch.manual_seed(0)
    policy = load_policy(cfg, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
    batch = prepare_batch(cfg, policy, None, None, trajs, 0, need_old=False)
    adv = batch.advantages.sum(-1)
    pos, neg = adv > 0, adv < 0
    assert int(pos.sum()) == 4 and int(neg.sum()) == 4
    before, _ = _response_stats(policy, trajs)
    update(cfg, policy, None, adamw(policy.parameters(), cfg.train.lr), None, batch, random.Random(0))
    after, _ = _response_stats(policy, trajs)
    delta = after - before
    assert float(delta[pos].mean()) > 1e-2 and float(delta[neg].mean()) < -1e-2, delta
    assert bool((delta[pos] > 0).all()) and bool((delta[neg] < 0).all()), delta  # row by row, too


def test_entropy_bonus_raises_entropy_with_zero_advantages(tiny_model_dir):
    """Equal rewards in every group (advantage 0: the policy term has no gradient) and
    algo.entropy_coef > 0: one update raises the mean entropy over the response positions."""
    cfg = _cfg(tiny_model_dir, "train.lr=1e-3", "algo.entropy_coef=0.1")
    torch.manual_seed(0)
    policy = load_policy(cfg, str(tiny_model_dir), "cpu")
    _drift(policy)  # a sharper start than the near-uniform random init, so entropy has room to rise
    trajs = _trajs(policy.config.vocab_size, [1.0] * 4 + [0.0] * 4)
    batch = prepare_batch(cfg, policy, None, None, trajs, 0, need_old=False)
    assert float(batch.advantages.abs().sum()) == 0.0
    _, before = _response_stats(policy, trajs)
    stats = update(cfg, policy, None, adamw(policy.parameters(), cfg.train.lr), None, batch, random.Random(0))
    _, after = _response_stats(policy, trajs)
    assert stats["actor/entropy"] == pytest.approx(before, rel=1e-4)  # the update read the same entropy
    assert after > before + 1e-3, (before, after)


def test_kl_term_pulls_the_policy_back_to_the_reference(tiny_model_dir):
    """Zero advantages, algo.kl_coef > 0 (low_var_kl as a loss term), the policy moved away from its
    frozen reference: one update lowers the KL to the reference over the sampled tokens."""
    cfg = _cfg(tiny_model_dir, "train.lr=1e-3", "algo.kl_coef=0.5")
    torch.manual_seed(0)
    policy = load_policy(cfg, str(tiny_model_dir), "cpu")
    ref = frozen_copy(policy, "cpu")
    _drift(policy)
    trajs = _trajs(policy.config.vocab_size, [1.0] * 4 + [0.0] * 4)
    batch = prepare_batch(cfg, policy, ref, None, trajs, 0, need_old=False)
    assert float(batch.advantages.abs().sum()) == 0.0
    before = _kl_to_ref(policy, ref, trajs)
    stats = update(cfg, policy, None, adamw(policy.parameters(), cfg.train.lr), None, batch, random.Random(0))
    after = _kl_to_ref(policy, ref, trajs)
    assert stats["actor/kl"] == pytest.approx(before, rel=1e-4)
    assert before > 0.01 and after < before - 1e-3, (before, after)


# ---------------------------------------------------------------- micro-batches, mini-batches


def _grads(cfg, trajs, optimizer_lr: float = 0.0):
    """One `update` of a fresh tiny policy on `trajs` (SGD at lr 0: the parameters stay, the
    gradients are left in .grad); a KL reference is a copy the policy has drifted from, a critic
    (PPO) starts from the policy with a nonzero value head. Returns (policy and critic gradients,
    the update's metrics)."""
    torch.manual_seed(0)
    policy = load_policy(cfg, cfg.model.path, "cpu")
    ref = None
    if cfg.algo.kl_coef > 0:
        ref = frozen_copy(policy, "cpu")
        _drift(policy, 0.02)
    critic = None
    if cfg.algo.name == "ppo":
        critic = ValueModel(frozen_copy(policy, "cpu"))
        for p in critic.parameters():
            p.requires_grad_(True)
        with torch.no_grad():
            critic.head.bias.fill_(0.3)
    batch = prepare_batch(cfg, policy, ref, critic, trajs, 0, need_old=False)
    opt = torch.optim.SGD(policy.parameters(), lr=optimizer_lr)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=optimizer_lr) if critic is not None else None
    stats = update(cfg, policy, critic, opt, critic_opt, batch, random.Random(0))
    params = list(policy.parameters()) + (list(critic.parameters()) if critic is not None else [])
    return [p.grad.clone() for p in params], stats


def _assert_same_gradient(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal up to float rounding (the passes differ in how rows are packed and summed)."""
    a, b = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in want])
    assert float(b.norm()) > 0
    assert float((a - b).norm()) <= 1e-5 * float(b.norm()), float((a - b).norm() / b.norm())
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


TERMS = {
    "policy": [],  # GRPO, zero-advantage rows (the excluded one too) skipped by train.skip_zero_advantage
    "policy+kl+entropy": ["algo.kl_coef=0.1", "algo.entropy_coef=0.01"],  # every row runs
    "ppo policy+value": ["algo.name=ppo"],  # critic gradient compared too
}


@pytest.mark.parametrize("terms", list(TERMS))
@pytest.mark.parametrize("loss_agg", losses.AGG_MODES)
def test_k_microbatches_give_the_one_pass_gradient(tiny_model_dir, loss_agg, terms):
    """The batch in one micro-batch, without skipping zero-advantage rows, against the same batch
    split into 2..6 micro-batches by train.max_tokens_per_microbatch: the same policy (and critic)
    gradient for every algo.loss_agg, with a row whose loss mask is all 0 (excluded after a failed
    search) in the batch. seq-mean-token-mean averages over rows with a trained token, wherever the
    excluded row and the skipped rows land."""
    extra = [f"algo.loss_agg={loss_agg}", *TERMS[terms]]
    rewards = [1.0, 0.0, 1.0, 0.0] + [0.0, 1.0, 1.0, 0.0] + [1.0] * 4  # the last group: advantage 0
    one, one_stats = _grads(
        _cfg(tiny_model_dir, *extra, "train.max_tokens_per_microbatch=4096", "train.skip_zero_advantage=false"),
        _trajs(1536, rewards, excluded=2),
    )
    assert one_stats["train/microbatches"] == 1
    counts = set()
    for cap in (64, 100, 160):
        got, stats = _grads(
            _cfg(tiny_model_dir, *extra, f"train.max_tokens_per_microbatch={cap}"), _trajs(1536, rewards, excluded=2)
        )
        counts.add(stats["train/microbatches"])
        _assert_same_gradient(got, one)
    assert len(counts) == 3 and min(counts) >= 2  # three different splits
