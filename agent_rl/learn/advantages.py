"""Advantage estimators as pure functions: GRPO group normalisation, RLOO, REINFORCE++ and GAE over
policy tokens.

GAE departs from single-turn PPO in one way that matters for search agents: the recursion runs
over the policy's own tokens only (loss_mask 1), so an inserted observation between two turns
is transparent: the "next value" of the last token of a turn is the value of the first token
of the next turn, and observation positions get advantage 0 and return 0 (as verl's multi-turn
GAE does). REINFORCE++'s returns skip observations the same way, where verl's single-turn recursion
restarts the return at every mask-0 position (so a first turn would not see the final reward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def _groups(group_ids: Sequence[str]) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    return list(index.values())


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[str], norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards: (B,) -> advantages (B,): (r - group mean) / (group std + eps).

    Groups are keyed by prompt id (prefixed by data source, so groups never collide across
    datasets). std is torch.std (unbiased), as in verl. A group of size 1 gets advantage 0.
    `norm_by_std=False` is Dr. GRPO (no division by the std).
    """
    out = torch.zeros_like(rewards, dtype=torch.float32)
    for rows in _groups(group_ids):
        if len(rows) < 2:
            continue
        r = rewards[rows].float()
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std() + eps)
        out[rows] = a
    return out


def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence[str]) -> torch.Tensor:
    """rewards: (B,) -> advantages (B,): REINFORCE Leave-One-Out, r_i - mean of r_j over the OTHER rows j of i's group.

    Kool et al. 2019 ("Buy 4 REINFORCE Samples, Get a Baseline for Free!"); Ahmadian et al. 2024 ("Back to
    Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"). The baseline
    leaves the sample out, so it does not depend on the sample and the estimate is unbiased; equal to
    G / (G - 1) x (r_i - group mean) for a group of G. Not divided by a std. A group of size 1 has no other
    sample and gets advantage 0 (config validation refuses algo.group_size 1; this is an excluded row's group).
    """
    out = torch.zeros_like(rewards, dtype=torch.float32)
    for rows in _groups(group_ids):
        g = len(rows)
        if g < 2:
            continue
        r = rewards[rows].float()
        out[rows] = r - (r.sum() - r) / (g - 1)
    return out


def token_level_rewards(
    scores: torch.Tensor, loss_mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """scores: (B,), loss_mask: (B, T) -> (B, T): the score on the last policy token, minus kl_coef * kl
    on policy tokens."""
    B, T = loss_mask.shape
    rewards = torch.zeros((B, T), dtype=torch.float32)
    positions = torch.arange(T).expand(B, T)
    last = torch.where(loss_mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    has = last >= 0
    rewards[has.nonzero().squeeze(-1), last[has]] = scores[has].float()
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float() * loss_mask
    return rewards


def gae_reference(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain loop GAE over mask-1 positions only; (B, T) each -> (advantages, returns)."""
    B, T = rewards.shape
    adv = torch.zeros((B, T))
    ret = torch.zeros((B, T))
    for b in range(B):
        next_value, running = 0.0, 0.0
        for t in reversed(range(T)):
            if loss_mask[b, t] == 0:
                continue
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + float(values[b, t])
            next_value = float(values[b, t])
    return adv, ret


def gae(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE vectorised over the batch: (B, T) each -> (advantages, returns), 0 on mask-0 positions.

    Masked positions carry the running state through unchanged (they are skipped, not zeroed).
    """
    B, T = rewards.shape
    rewards, values, mask = rewards.float(), values.float(), loss_mask.float()
    adv = torch.zeros((B, T))
    next_value = torch.zeros(B)
    running = torch.zeros(B)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = torch.where(m > 0, new_running, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv[:, t] = running * m
    returns = (adv + values) * mask
    return adv, returns


def discounted_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return to go over the policy's tokens: rewards, loss_mask (B, T) -> returns (B, T), 0 on mask-0 positions.

    G_t = r_t + gamma * G_t', t' the row's next mask-1 token: observations are skipped (transparent), as in
    `gae`, which with values 0 and lam 1 gives these same returns.
    """
    B, T = rewards.shape
    rewards, mask = rewards.float(), loss_mask.float()
    out = torch.zeros((B, T))
    running = torch.zeros(B)
    for t in reversed(range(T)):
        m = mask[:, t]
        running = torch.where(m > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float,
    reduce_sum: Callable[[float], float] | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models").

    token_rewards, loss_mask: (B, T) -> advantages (B, T): the return to go of the token rewards
    (`token_level_rewards`: the score on the last policy token, the k1 KL penalty on every policy token),
    whitened over every trained token of the batch (`whiten`; `reduce_sum` takes the statistics over all
    ranks), 0 on mask-0 positions. No critic and no group: the batch's statistics are the baseline.
    """
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    return whiten(returns, loss_mask, reduce_sum=reduce_sum) * loss_mask


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group_ids: Sequence[str],
    token_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float,
    reduce_sum: Callable[[float], float] | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): REINFORCE++ with each group's mean score subtracted before the whitening.

    scores: (B,), token_rewards, loss_mask: (B, T) -> advantages (B, T): (return to go - mean score of the
    row's group) on mask-1 positions, whitened over every trained token of the batch, 0 elsewhere. Without a
    KL penalty and with gamma 1 the return is the score on every token, so this is verl's
    reinforce_plus_plus_baseline: whiten(r - group mean). A group of one is its own baseline.
    """
    baseline = torch.zeros_like(scores, dtype=torch.float32)
    for rows in _groups(group_ids):
        baseline[rows] = scores[rows].float().mean()
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    return whiten((returns - baseline[:, None]) * loss_mask, loss_mask, reduce_sum=reduce_sum) * loss_mask


def whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, reduce_sum: Callable[[float], float] | None = None
) -> torch.Tensor:
    """Masked whitening: (x - mean) / std over mask-1 entries; (B, T) -> (B, T).

    The variance is the unbiased one (divided by n - 1, Bessel's correction), as verl's `masked_whiten` and
    TRL's take it; one masked entry has no spread and is divided by sqrt(eps) from 0, i.e. whitened to 0.
    `reduce_sum` (a `World.all_reduce_sum`) sums each statistic over every rank, so the mean and std are the
    whole batch's when it is split over ranks; it must be called on every rank.
    """
    if reduce_sum is None:
        n = mask.sum()
        mean = (x * mask).sum() / n.clamp(min=1.0)
        var = (((x - mean) ** 2) * mask).sum() / (n - 1.0).clamp(min=1.0)
        return (x - mean) * torch.rsqrt(var + eps)
    count = reduce_sum(float(mask.sum()))
    mean_f = reduce_sum(float((x * mask).sum())) / max(1.0, count)
    var_f = reduce_sum(float((((x - mean_f) ** 2) * mask).sum())) / max(1.0, count - 1.0)
    return (x - mean_f) / math.sqrt(var_f + eps)
