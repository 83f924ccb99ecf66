"""Advantage estimators as pure functions: GRPO group normalisation and GAE over policy tokens.

GAE departs from single-turn PPO in one way that matters for search agents: the recursion runs
over the policy's own tokens only (loss_mask 1), so an inserted observation between two turns
is transparent: the "next value" of the last token of a turn is the value of the first token
of the next turn, and observation positions get advantage 0 and return 0 (as verl's multi-turn
GAE does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[str], norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards: (B,) -> advantages (B,): (r - group mean) / (group std + eps).

    Groups are keyed by prompt id (prefixed by data source, so groups never collide across
    datasets). std is torch.std (unbiased), as in verl. A group of size 1 gets advantage 0.
    `norm_by_std=False` is Dr. GRPO (no division by the std).
    """
    out = torch.zeros_like(rewards, dtype=torch.float32)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for rows in index.values():
        if len(rows) < 2:
            continue
        r = rewards[rows].float()
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std() + eps)
        out[rows] = a
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


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening: (x - mean) / std over mask-1 entries; (B, T) -> (B, T)."""
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return (x - mean) * torch.rsqrt(var + eps)
