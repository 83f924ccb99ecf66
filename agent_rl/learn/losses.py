"""Loss math as small pure functions (shapes in docstrings; names as in the PPO/GRPO papers).

Three policy losses (`algo.policy_loss`): PPO's clipped surrogate (`policy_loss`), GSPO's sequence-level
ratio (`gspo_loss`) and CISPO's clipped, detached importance weight (`cispo_loss`); each reports the same
metrics (clipfrac, approx_kl, ratio_mean). Every term is multiplied by `loss_mask`, so inserted observation
tokens get exactly zero gradient from the policy, KL, entropy and value terms. The KL estimators follow verl's
`core_algos.kl_penalty` (k1 and the low-variance k3, clamped to [-10, 10]). Metrics come back as
0-dim tensors on the inputs' device: the update reads them on the host once, not once a micro-batch.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over mask==1 entries (over all, or along `dim`)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, norm_tokens: float = 0.0) -> torch.Tensor:
    """loss_mat, loss_mask: (B, T) -> scalar.

    token-mean: sum over masked tokens / number of masked tokens (long answers weigh more).
    seq-mean-token-mean: mean over tokens per sequence, then mean over sequences with tokens.
    seq-mean-token-sum-norm: sum over tokens per sequence / the constant `norm_tokens`, then mean over
    sequences with tokens: Dr. GRPO's (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective") constant normaliser, so every trained token weighs the same whatever its sequence's length,
    where dividing by the length favours short right answers and long wrong ones (verl's mode of that name).
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        if mode == "seq-mean-token-mean":
            per_seq = masked_mean(loss_mat, loss_mask, dim=-1)
        elif norm_tokens > 0:
            per_seq = (loss_mat * loss_mask).sum(-1) / norm_tokens
        else:
            raise ValueError(f"loss aggregation {mode} needs norm_tokens > 0 (algo.loss_agg_tokens), got {norm_tokens}")
        has = (loss_mask.sum(-1) > 0).float()
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {AGG_MODES}")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """logits: (B, T, V), labels: (B, T) -> log p(labels) (B, T), chunked over T to bound memory."""
    out = []
    for lo in range(0, logits.shape[1], chunk):
        lg = logits[:, lo : lo + chunk].float()
        lp = torch.log_softmax(lg, dim=-1)
        out.append(lp.gather(-1, labels[:, lo : lo + chunk, None]).squeeze(-1))
    return torch.cat(out, dim=1) if out else logits.new_zeros(labels.shape, dtype=torch.float32)


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """logits: (B, T, V) -> entropy of the softmax (B, T), chunked over T."""
    out = []
    for lo in range(0, logits.shape[1], chunk):
        lg = logits[:, lo : lo + chunk].float()
        logp = torch.log_softmax(lg, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out, dim=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    agg_tokens: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with separate low/high clip (DAPO's clip-higher when high > low).

    logprobs, old_logprobs, loss_mask: (B, T); advantages: (B, T) or (B,) (broadcast over T).
    loss = agg(w * max(-A * r, -A * clip(r, 1 - low, 1 + high))), r = exp(logprobs - old_logprobs);
    `is_weights` w (B, T), detached, defaults to 1 (see `tis_weights`). Returns the loss and its metrics
    (clipfrac, approx_kl, ratio_mean), each a detached 0-dim tensor.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs) * loss_mask
    ratio = torch.exp(log_ratio)
    return _clipped_surrogate(
        ratio, log_ratio, advantages, loss_mask, clip_ratio_low, clip_ratio_high, agg, is_weights, agg_tokens
    )


def _clipped_surrogate(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    agg: str,
    is_weights: torch.Tensor | None,
    agg_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's pessimistic clipped surrogate over per-token `ratio` (B, T), aggregated by `agg`, with the metrics
    `policy_loss` and `gspo_loss` share (`log_ratio`: the per-token log-ratio, for approx_kl)."""
    surr1 = -advantages * ratio
    surr2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(surr1, surr2) * loss_mask
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, loss_mask, agg, agg_tokens)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((surr2 > surr1).float(), loss_mask),
            "approx_kl": masked_mean(-log_ratio, loss_mask),
            "ratio_mean": masked_mean(ratio, loss_mask),
        }
    return loss, stats


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    agg_tokens: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), in its GSPO-token form.

    logprobs, old_logprobs, loss_mask: (B, T); advantages: (B, T) or (B,). One ratio per sequence,
    s_i = exp(mean over i's mask-1 tokens of (logprobs - old_logprobs)) (the length-normalised likelihood
    ratio), carried to each token as s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)): its value is s_i and its gradient
    s_i * grad log pi(y_t). Then PPO's pessimistic clip with [1 - low, 1 + high], so a sequence whose ratio
    leaves the range loses every token's gradient at once. The log-ratio is capped at 10 before exp, as verl
    does. `is_weights` w (B, T), detached, multiply each token's term (see `tis_weights`). Metrics as
    `policy_loss`: clipfrac and ratio_mean over trained tokens (each token carrying its sequence's ratio),
    approx_kl per token.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs) * loss_mask
    seq_log_ratio = masked_mean(log_ratio, loss_mask, dim=-1).detach()  # (B,); 0 for a row with no token
    log_seq_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]
    ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    return _clipped_surrogate(
        ratio, log_ratio, advantages, loss_mask, clip_ratio_low, clip_ratio_high, agg, is_weights, agg_tokens
    )


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_high: float,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    agg_tokens: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention").

    logprobs, old_logprobs, loss_mask: (B, T); advantages: (B, T) or (B,).
    loss = agg(-sg(min(r, 1 + high)) * A * logprobs * w), r = exp(logprobs - old_logprobs): the importance
    weight is clipped and detached, never the token's gradient, so every trained token keeps a gradient
    A * weight * grad log pi (PPO's clip zeroes it for tokens past the range, often the rare ones). No lower
    bound, as MiniMax ran it. `is_weights` w (B, T) as in `policy_loss`. Metrics: clipfrac = the share of
    trained tokens whose weight was capped; approx_kl and ratio_mean (the unclipped r) as `policy_loss`.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = (logprobs - old_logprobs) * loss_mask
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0 + clip_ratio_high).detach()
    loss_mat = -advantages * weight * logprobs * loss_mask
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate(loss_mat, loss_mask, agg, agg_tokens)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((ratio > 1.0 + clip_ratio_high).float(), loss_mask),
            "approx_kl": masked_mean(-log_ratio, loss_mask),
            "ratio_mean": masked_mean(ratio, loss_mask),
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the policy from the reference.

    k1: logp - ref_logp.  low_var_kl / k3: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind in ("low_var_kl", "k3"):
        d = ref_logprobs - logprobs
        return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; use k1 or low_var_kl")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_range: float | None,
    agg: str = "token-mean",
    agg_tokens: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2); all (B, T). Returns the loss
    and its metrics (value_mean, return_mean), each a detached 0-dim tensor."""
    err = (values - returns) ** 2
    if clip_range:
        clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        err = torch.maximum(err, (clipped - returns) ** 2)
    loss = 0.5 * aggregate(err * loss_mask, loss_mask, agg, agg_tokens)
    with torch.no_grad():
        stats = {
            "value_mean": masked_mean(values, loss_mask),
            "return_mean": masked_mean(returns, loss_mask),
        }
    return loss, stats


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, as verl and OpenRLHF apply it).

    The rollout engine samples from pi_engine, which differs from the trainer's pi_old by kernels
    and precision; the surrogate is reweighted by min(pi_old / pi_engine, cap) per token.
    old_logprobs, rollout_logprobs, loss_mask: (B, T) -> weights (B, T), 1 where the mask is 0.
    """
    ratio = torch.exp((old_logprobs - rollout_logprobs) * loss_mask)
    return ratio.clamp(max=cap).detach()


def logprob_diff(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """|trainer - engine| log-prob over sampled tokens, for the agreement metrics: (3,) = sum, max, count
    (all (B, T) in; max 0 over no tokens)."""
    diff = (trainer_logprobs.detach().float() - rollout_logprobs.float()).abs() * loss_mask
    worst = diff.max() if diff.numel() else diff.new_zeros(())
    return torch.stack([diff.sum(), worst, loss_mask.sum().float()])
