"""The advantage estimators (algo.advantage: rloo, reinforce_pp, reinforce_pp_baseline beside grpo and gae)
and policy losses (algo.policy_loss: gspo, cispo beside ppo_clip): hand-computed values on fixed batches,
one real update of a tiny Qwen2 moving each the right way, k micro-batches giving the one-pass gradient
off-policy (ratios away from 1, so the clips bind), and the config's refusals. Several tests are written
against a named mutation (RLOO counting the sample in its own baseline, a flipped sign, GSPO summing the
log-ratio instead of averaging it, CISPO letting the gradient through its weight): each fails under it."""

import math
import random
import threading

import pytest
import torch
from test_update_direction import _assert_same_gradient, _cfg, _drift, _response_stats, _trajs

from agent_rl.config import ConfigError, load_config
from agent_rl.learn import advantages as adv_lib
from agent_rl.learn import losses
from agent_rl.learn.policy import frozen_copy, load_policy
from agent_rl.learn.update import adamw, prepare_batch, update

# ---------------------------------------------------------------- RLOO


def test_rloo_leaves_the_sample_out_of_its_baseline_hand_computed():
    """r_i minus the mean of the OTHER rewards of i's group, rows of groups interleaved, no std division; a
    group of one gets 0. Fails if the sample is counted in its own baseline (group a would give 2/3, -1/3)
    or the sign is flipped."""
    rewards = torch.tensor([1.0, 2.0, 0.0, 0.5, 0.0, 3.0])
    ids = ["a", "b", "a", "b", "a", "c"]
    adv = adv_lib.rloo_advantages(rewards, ids)
    # a: 1 - (0 + 0) / 2 = 1, 0 - (1 + 0) / 2 = -0.5 (twice); b: 2 - 0.5 = 1.5, 0.5 - 2 = -1.5; c alone: 0
    assert adv.tolist() == [1.0, 1.5, -0.5, -1.5, -0.5, 0.0]
    # the same as G / (G - 1) x (r - group mean): 4 samples, mean 0.5
    four = adv_lib.rloo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), ["g"] * 4)
    torch.testing.assert_close(four, torch.tensor([2 / 3, -2 / 3, 2 / 3, -2 / 3]))


def test_rloo_in_prepare_batch_broadcasts_over_trained_tokens_and_drops_excluded_rows(tiny_model_dir):
    """algo.advantage=rloo through prepare_batch: each row's leave-one-out advantage on its mask-1 tokens, 0
    on the prompt, observations and padding; a row excluded after a failed search (mask all 0) gets 0 and
    leaves its group's baseline (rows 0, 1, 3 of group 0 score 1, 0, 0)."""
    cfg = _cfg(tiny_model_dir, "algo.advantage=rloo")
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0, 2.0, 0.0, 1.0, 0.5], excluded=2)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    want = torch.tensor([1.0, -0.5, 0.0, -0.5, 2.0 - 0.5, -3.5 / 3, 1.0 - 2.5 / 3, 0.5 - 1.0])
    torch.testing.assert_close(batch.advantages, want[:, None] * batch.loss_mask)
    assert float(batch.returns.abs().sum()) == 0.0


# ---------------------------------------------------------------- REINFORCE++


def test_discounted_returns_skip_observations_hand_computed():
    """Return to go over mask-1 tokens with gamma 0.5: an observation span (mask 0, whatever reward sits
    there) is transparent, and mask-0 positions get 0; gamma 1 gives gae's returns with values 0, lam 1."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[-0.25, 7.0, 7.0, -0.5, 2.0, 9.0]])
    ret = adv_lib.discounted_returns(rewards, mask, 0.5)
    # t=4: 2; t=3: -0.5 + 0.5 x 2 = 0.5; t=0: -0.25 + 0.5 x 0.5 = 0
    assert ret.tolist() == [[0.0, 0.0, 0.0, 0.5, 2.0, 0.0]]
    _, gae_returns = adv_lib.gae(rewards * mask, torch.zeros_like(rewards), mask, 1.0, 1.0)
    torch.testing.assert_close(adv_lib.discounted_returns(rewards, mask, 1.0), gae_returns)


def test_reinforce_pp_folds_the_k1_kl_into_the_returns_and_whitens_over_the_batch():
    """REINFORCE++ by hand: token rewards = score on the last trained token - kl_coef x k1 on every trained
    token, returns to go (gamma 1), then (return - mean) / std over the batch's six trained tokens.
    Row 0 (score 1, k1 0.5, 0, 0.5): returns 0, 0.5, 0.5. Row 1 (score 1, k1 2, 1, -, 0, the third token an
    observation): returns -2, 0, 1. Mean 0, unbiased variance 5.5 / 5."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    kl = torch.tensor([[4.0, 0.5, 0.0, 0.5], [2.0, 1.0, 9.0, 0.0]])
    token_rewards = adv_lib.token_level_rewards(torch.tensor([1.0, 1.0]), mask, kl, kl_coef=1.0)
    adv = adv_lib.reinforce_pp_advantages(token_rewards, mask, gamma=1.0)
    std = math.sqrt(5.5 / 5 + 1e-8)
    want = torch.tensor([[0.0, 0.0, 0.5, 0.5], [-2.0, 0.0, 0.0, 1.0]]) / std
    torch.testing.assert_close(adv, want)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_whitening():
    """REINFORCE++-baseline by hand (no KL, gamma 1, so every trained token's return is its row's score):
    scores 1, 0 (group a) and 3, 1 (group b) minus the group means 0.5 and 2 give 0.5, -0.5, 1, -1 on 1, 1, 2,
    2 tokens; whitened over those six tokens (mean 0, unbiased variance 4.5 / 5). Row 0, the better of its
    group, gets a positive advantage only through the baseline: the batch whitening alone puts its score 1
    below the batch's token mean 5 / 3."""
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    token_rewards = adv_lib.token_level_rewards(scores, mask)
    adv = adv_lib.reinforce_pp_baseline_advantages(scores, ["a", "a", "b", "b"], token_rewards, mask, gamma=1.0)
    want = torch.tensor([[0.5, 0.0], [0.0, -0.5], [1.0, 1.0], [-1.0, -1.0]]) / math.sqrt(0.9 + 1e-8)
    torch.testing.assert_close(adv, want)
    plain = adv_lib.reinforce_pp_advantages(token_rewards, mask, gamma=1.0)
    assert float(plain[0, 0]) < 0 and float(adv[0, 0]) > 0


def test_whiten_over_ranks_equals_whiten_of_the_whole_batch():
    """Two ranks (threads) each whiten their rows with `reduce_sum` summing a statistic over both: each gets
    its rows of the whole batch's whitening, as REINFORCE++ normalises under torchrun."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    whole = adv_lib.whiten(x, mask)
    barrier, slots, out = threading.Barrier(2), [0.0, 0.0], [None, None]

    def rank(r: int) -> None:
        def reduce_sum(v: float) -> float:
            slots[r] = v
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before either writes the next statistic
            return total

        rows = slice(0, 2) if r == 0 else slice(2, 6)
        out[r] = adv_lib.whiten(x[rows], mask[rows], reduce_sum=reduce_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out) * mask, whole * mask)


def test_prepare_batch_reinforce_pp_uses_the_k1_kl_of_policy_and_reference(tiny_model_dir):
    """algo.advantage=reinforce_pp with algo.kl_type=k1 and a drifted policy: prepare_batch's advantages are
    the pure function's on the scores and the k1 KL of the batch's old and reference log-probs, on the
    single-pass path too, and the KL changed them; no critic is asked for."""
    cfg = _cfg(tiny_model_dir, "algo.advantage=reinforce_pp", "algo.kl_type=k1", "algo.kl_coef=0.5", "algo.gamma=0.9")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    ref = frozen_copy(policy, "cpu")
    _drift(policy, 0.05)
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    scores, mask = torch.tensor([t.reward for t in trajs]), batch.loss_mask
    kl = losses.kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1")
    want = adv_lib.reinforce_pp_advantages(adv_lib.token_level_rewards(scores, mask, kl, 0.5), mask, 0.9)
    torch.testing.assert_close(batch.advantages, want)
    single = prepare_batch(
        cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    torch.testing.assert_close(single.advantages, want)
    no_kl = adv_lib.reinforce_pp_advantages(adv_lib.token_level_rewards(scores, mask), mask, 0.9)
    assert float((want - no_kl).abs().max()) > 1e-3


def test_auto_advantage_and_ppo_clip_are_the_defaults_bit_for_bit(tiny_model_dir):
    """algo.advantage=auto is grpo under algo.name=grpo and algo.policy_loss=ppo_clip is the default: the
    explicit spelling gives the same advantages and the same gradient, bit for bit."""
    configs = [_cfg(tiny_model_dir), _cfg(tiny_model_dir, "algo.advantage=grpo", "algo.policy_loss=ppo_clip")]
    assert configs[0].algo.advantage == "auto" and configs[0].algo.policy_loss == "ppo_clip"
    results = []
    for cfg in configs:
        torch.manual_seed(0)
        policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
        trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
        batch = prepare_batch(
            cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
        )
        update(
            cfg.algo,
            cfg.train,
            policy,
            None,
            torch.optim.SGD(policy.parameters(), lr=0.0),
            None,
            batch,
            random.Random(0),
            temperature=cfg.rollout.temperature,
        )
        results.append((batch.advantages, [p.grad for p in policy.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


# ---------------------------------------------------------------- GSPO, CISPO by hand


def _gspo_batch():
    """Three rows: log-ratios (0.1, 0.3) with A = 1 (mean 0.2; a sum would be 0.4), (-0.1, 0, -0.2) with
    A = -1 (mean -0.1; sum -0.3), (0.4, 0.6) with A = 1 (mean 0.5, past 1 + high); a mask-0 token with a
    log-ratio of 5 in row 0."""
    log_ratio = torch.tensor([[0.1, 0.3, 5.0], [-0.1, 0.0, -0.2], [0.4, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full_like(log_ratio, -2.0)
    return old, (old + log_ratio).requires_grad_(True), torch.tensor([1.0, -1.0, 1.0]), mask


def test_gspo_sequence_ratio_is_the_length_normalised_mean_hand_computed():
    """GSPO with clip [0.8, 1.25]: row 0's ratio e^0.2 and row 1's e^-0.1 lie inside (a summed log-ratio,
    e^0.4 and e^-0.3, would be clipped), row 2's e^0.5 is clipped at 1.25. Every token of a row carries its
    row's ratio: loss, clipfrac, ratio_mean and each token's gradient -A s_i / n (0 where clipped or
    masked) by hand, for both aggregations."""
    old, logprobs, adv, mask = _gspo_batch()
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    loss, stats = losses.gspo_loss(logprobs, old, adv, mask, 0.2, 0.25, "token-mean")
    assert loss.item() == pytest.approx((-2 * s0 + 3 * s1 - 2 * 1.25) / 7, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(2 / 7)
    assert stats["ratio_mean"].item() == pytest.approx((2 * s0 + 3 * s1 + 2 * math.exp(0.5)) / 7, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(-(0.4 - 0.3 + 1.0) / 7, abs=1e-6)
    loss.backward()
    want = torch.tensor([[-s0, -s0, 0.0], [s1, s1, s1], [0.0, 0.0, 0.0]]) / 7
    torch.testing.assert_close(logprobs.grad, want)

    old, logprobs, adv, mask = _gspo_batch()
    loss, _ = losses.gspo_loss(logprobs, old, adv, mask, 0.2, 0.25, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((-s0 + s1 - 1.25) / 3, abs=1e-6)
    loss.backward()
    want = torch.tensor([[-s0 / 2, -s0 / 2, 0.0], [s1 / 3, s1 / 3, s1 / 3], [0.0, 0.0, 0.0]]) / 3
    torch.testing.assert_close(logprobs.grad, want)


def test_gspo_on_policy_step_is_the_sequence_mean_of_token_gradients():
    """At ratio 1 (old = current), per sequence: GSPO-token's gradient is -A / n on each trained token, the
    gradient of the sequence-level objective -A x s_i with s_i = exp(mean log-ratio) (GSPO's equation 5
    form), and token-wise PPO's too; with (B,) advantages broadcast over T."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -0.2]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, _ = losses.gspo_loss(logprobs, logprobs.detach(), adv, mask, 3e-4, 4e-4, "seq-mean-token-mean")
    (g_token,) = torch.autograd.grad(loss, logprobs)
    seq = losses.masked_mean(logprobs - logprobs.detach(), mask, dim=-1)
    (g_seq,) = torch.autograd.grad((-adv * torch.exp(seq)).mean(), logprobs)
    torch.testing.assert_close(g_token, g_seq)
    torch.testing.assert_close(g_token, torch.tensor([[-2 / 3, -2 / 3, -2 / 3], [0.5, 0.0, 0.5]]) / 2)


def test_cispo_keeps_every_tokens_gradient_through_a_detached_weight_hand_computed():
    """CISPO with high 0.2: weights min(r, 1.2) = 0.5, 1.1, 1.2 (capped), 1 (r = 0.3: no lower bound), and a
    mask-0 token with r = e^5 counts for nothing. d loss / d logp = -A x weight / n exactly: a weight that let
    the gradient through would add -A x logp x r on the uncapped tokens. PPO's clip zeroes the capped token
    (A > 0, r = 2) and the r = 0.3 one (A < 0); CISPO keeps both."""
    ratio = torch.tensor([[0.5, 1.1, 2.0, 0.3, math.exp(5.0)]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0, -0.5, -4.0]])
    logprobs = (old + ratio.log()).detach().requires_grad_(True)
    loss, stats = losses.cispo_loss(logprobs, old, adv, mask, 0.2)
    weight = torch.tensor([[0.5, 1.1, 1.2, 0.3, 0.0]])
    lp = logprobs.detach()
    assert loss.item() == pytest.approx(float((-adv * weight * lp).sum()) / 4, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(1 / 4)
    assert stats["ratio_mean"].item() == pytest.approx((0.5 + 1.1 + 2.0 + 0.3) / 4, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 1.1, -1.2, 0.3, 0.0]]) / 4)
    ppo_lp = logprobs.detach().clone().requires_grad_(True)
    ppo, _ = losses.policy_loss(ppo_lp, old, adv, mask, 0.2, 0.2)
    ppo.backward()
    assert ppo_lp.grad[0, 2] == 0 and ppo_lp.grad[0, 3] == 0
    # with truncated-IS weights each token's term is scaled by its (detached) weight
    w = torch.tensor([[2.0, 1.0, 0.5, 1.0, 3.0]])
    logprobs.grad = None
    weighted, _ = losses.cispo_loss(logprobs, old, adv, mask, 0.2, is_weights=w)
    weighted.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, 1.1, -0.6, 0.3, 0.0]]) / 4)


def test_dr_grpo_sum_norm_weighs_every_token_alike_whatever_its_length_hand_computed():
    """seq-mean-token-sum-norm (Dr. GRPO): each row's token sum over the constant, then the mean over rows with a
    token. Every trained token's gradient is 1 / (constant x rows), for a row of 1 token as for one of 3, where
    seq-mean-token-mean gives the short row's token 3x the long row's; a row with no token counts in neither."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = losses.aggregate(loss_mat, mask, "seq-mean-token-sum-norm", norm_tokens=8.0)
    assert out.item() == pytest.approx(((1 + 2 + 3) / 8 + 4 / 8) / 2)
    out.backward()
    torch.testing.assert_close(loss_mat.grad, mask / 16)
    loss_mat.grad = None
    losses.aggregate(loss_mat, mask, "seq-mean-token-mean").backward()
    torch.testing.assert_close(loss_mat.grad, torch.tensor([[1 / 6] * 3 + [0.0], [0.5, 0, 0, 0], [0.0] * 4]))
    with pytest.raises(ValueError, match="norm_tokens > 0"):
        losses.aggregate(loss_mat, mask, "seq-mean-token-sum-norm")


# ---------------------------------------------------------------- one update on the tiny model


DIRECTION = {  # (algo.advantage, algo.policy_loss, extra keys)
    "rloo/ppo_clip": ("rloo", "ppo_clip", []),
    "reinforce_pp/ppo_clip": ("reinforce_pp", "ppo_clip", []),
    "reinforce_pp_baseline/ppo_clip": ("reinforce_pp_baseline", "ppo_clip", []),
    "grpo/gspo": ("grpo", "gspo", ["algo.clip_ratio_low=3e-4", "algo.clip_ratio_high=4e-4"]),
    "grpo/cispo": ("grpo", "cispo", []),
    "rloo/gspo seq-mean": ("rloo", "gspo", ["algo.loss_agg=seq-mean-token-mean"]),
    "reinforce_pp/cispo": ("reinforce_pp", "cispo", []),
    "dr_grpo": ("grpo", "ppo_clip", ["algo.norm_adv_by_std=false", "algo.loss_agg=seq-mean-token-sum-norm"]),
}


@pytest.mark.parametrize("case", list(DIRECTION))
def test_one_step_raises_positive_and_lowers_negative_advantage_rows(tiny_model_dir, case):
    """One update (the trainer's AdamW) with each new estimator and each new loss: rewards 1, 0, 1, 0 in
    both groups give two positive- and two negative-advantage rows per group; the mean log-prob of each
    positive row rises and of each negative row falls. Fails if an advantage or a loss has its sign flipped."""
    advantage, policy_loss, extra = DIRECTION[case]
    cfg = _cfg(
        tiny_model_dir, "train.lr=1e-3", f"algo.advantage={advantage}", f"algo.policy_loss={policy_loss}", *extra
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    adv = (batch.advantages * batch.loss_mask).sum(-1)
    pos, neg = adv > 0, adv < 0
    assert int(pos.sum()) == 4 and int(neg.sum()) == 4
    assert bool((pos == torch.tensor([t.reward > 0 for t in trajs])).all())
    before, _ = _response_stats(policy, trajs)
    stats = update(
        cfg.algo,
        cfg.train,
        policy,
        None,
        adamw(policy.parameters(), cfg.train.lr),
        None,
        batch,
        random.Random(0),
        temperature=cfg.rollout.temperature,
    )
    after, _ = _response_stats(policy, trajs)
    delta = after - before
    assert float(delta[pos].mean()) > 1e-2 and float(delta[neg].mean()) < -1e-2, delta
    assert bool((delta[pos] > 0).all()) and bool((delta[neg] < 0).all()), delta
    assert stats["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and stats["actor/clipfrac"] == 0.0


# ---------------------------------------------------------------- micro-batches, off-policy


def _off_policy_grads(cfg, trajs, shift: float):
    """One `update` (SGD at lr 0: the gradients stay in .grad) of a fresh tiny policy against old log-probs
    moved by `shift` x a fixed noise on every trained token (so ratios leave 1 and the clips bind), with a
    drifted policy and its reference when algo.kl_coef > 0 and the engine's log-probs near the old ones
    (for algo.tis_cap). Returns (the policy's gradients, the update's metrics)."""
    torch.manual_seed(0)
    policy = load_policy(cfg.model, cfg.model.path, "cpu")
    ref = None
    if cfg.algo.kl_coef > 0:
        ref = frozen_copy(policy, "cpu")
        _drift(policy, 0.02)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(3))
    batch.old_logprobs = batch.old_logprobs + shift * noise * batch.loss_mask
    engine = batch.old_logprobs + 0.5 * torch.randn(noise.shape, generator=torch.Generator().manual_seed(4))
    batch.rows.rollout_logprobs = engine * batch.loss_mask
    stats = update(
        cfg.algo,
        cfg.train,
        policy,
        None,
        torch.optim.SGD(policy.parameters(), lr=0.0),
        None,
        batch,
        random.Random(0),
        temperature=cfg.rollout.temperature,
    )
    return [p.grad.clone() for p in policy.parameters()], stats


GSPO_CLIP = ["algo.clip_ratio_low=0.01", "algo.clip_ratio_high=0.01"]
TERMS = ["algo.kl_coef=0.1", "algo.entropy_coef=0.01", "algo.tis_cap=2.0"]
MICRO = {  # (algo.policy_loss, algo.loss_agg, extra keys, old log-prob shift)
    "gspo token-mean": ("gspo", "token-mean", GSPO_CLIP, 0.1),
    "gspo seq-mean-token-mean": ("gspo", "seq-mean-token-mean", GSPO_CLIP, 0.1),
    "gspo+kl+entropy+tis seq-mean-token-mean": ("gspo", "seq-mean-token-mean", GSPO_CLIP + TERMS, 0.1),
    "cispo token-mean": ("cispo", "token-mean", [], 0.3),
    "cispo seq-mean-token-mean": ("cispo", "seq-mean-token-mean", [], 0.3),
    "cispo+kl+entropy+tis token-mean": ("cispo", "token-mean", TERMS, 0.3),
    "gspo+kl+entropy+tis seq-mean-token-sum-norm": ("gspo", "seq-mean-token-sum-norm", GSPO_CLIP + TERMS, 0.1),
}


@pytest.mark.parametrize("case", list(MICRO))
def test_k_microbatches_give_the_one_pass_gradient_off_policy(tiny_model_dir, case):
    """GSPO and CISPO, old log-probs away from the current ones so some sequences (GSPO) or tokens (CISPO) are
    clipped and others not: the batch in one micro-batch (no zero-advantage rows skipped) and split into 2..6
    by train.max_tokens_per_microbatch give the same gradient, under each algo.loss_agg, with the KL, entropy
    and truncated-IS terms on or off, and a row excluded after a failed search (mask all 0). The guard's
    metrics (actor/clipfrac, actor/approx_kl, actor/ratio_mean, actor/entropy) are there."""
    from transformers import AutoConfig

    policy_loss, loss_agg, extra, shift = MICRO[case]
    extra = [f"algo.loss_agg={loss_agg}", f"algo.policy_loss={policy_loss}", "algo.log_entropy=true", *extra]
    rewards = [1.0, 0.0, 1.0, 0.0] + [0.0, 1.0, 1.0, 0.0] + [1.0] * 4  # the last group: advantage 0 under grpo
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    one, one_stats = _off_policy_grads(
        _cfg(tiny_model_dir, *extra, "train.max_tokens_per_microbatch=4096", "train.skip_zero_advantage=false"),
        _trajs(vocab, rewards, excluded=2),
        shift,
    )
    assert one_stats["train/microbatches"] == 1
    assert 0.0 < one_stats["actor/clipfrac"] < 1.0, one_stats["actor/clipfrac"]  # both branches ran
    assert {"actor/approx_kl", "actor/ratio_mean", "actor/entropy", "loss/policy"} <= set(one_stats)
    counts = set()
    for cap in (64, 100, 160):
        got, stats = _off_policy_grads(
            _cfg(tiny_model_dir, *extra, f"train.max_tokens_per_microbatch={cap}"),
            _trajs(vocab, rewards, excluded=2),
            shift,
        )
        counts.add(stats["train/microbatches"])
        _assert_same_gradient(got, one)
    assert len(counts) == 3 and min(counts) >= 2


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["algo.advantage=rloo", "algo.group_size=1"], r"algo\.group_size=1 with algo\.advantage=rloo"),
        (["algo.advantage=reinforce_pp_baseline", "algo.group_size=1"], r"algo\.group_size"),
        (["algo.name=ppo", "algo.advantage=rloo"], r"algo\.advantage=rloo with algo\.name=ppo.*algo\.name=grpo"),
        (["algo.advantage=gae"], r"algo\.advantage=gae needs a critic.*algo\.name=ppo"),
        (["algo.advantage=rloo", "algo.kl_type=k1", "algo.kl_coef=0.1"], r"algo\.kl_type=k1.*low_var_kl"),
        (["algo.advantage=reinforce"], r"algo\.advantage = 'reinforce' is not one of"),
        (["algo.policy_loss=dapo"], r"algo\.policy_loss = 'dapo' is not one of ppo_clip, gspo, cispo"),
        (["algo.loss_agg_tokens=-1"], r"algo\.loss_agg_tokens must be >= 0"),
    ],
)
def test_config_refuses_what_cannot_work_naming_the_key(overrides, match):
    """Each bad value or combination fails at load with the key and the fix in the message."""
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_config_accepts_the_new_combinations_and_resolves_auto():
    """reinforce_pp needs no group (group_size 1) and reads k1 from the rewards; ppo resolves auto to gae and
    takes gae by name; every loss goes with either algo.name."""
    cfg = load_config(None, ["algo.advantage=reinforce_pp", "algo.group_size=1", "algo.kl_type=k1", "algo.kl_coef=0.1"])
    assert cfg.algo.resolved_advantage() == "reinforce_pp"
    assert load_config(None, []).algo.resolved_advantage() == "grpo"
    assert load_config(None, ["algo.name=ppo"]).algo.resolved_advantage() == "gae"
    assert load_config(None, ["algo.name=ppo", "algo.advantage=gae"]).algo.resolved_advantage() == "gae"
    dr = ["algo.loss_agg=seq-mean-token-sum-norm", "budget.max_turns=2", "budget.max_tokens_per_turn=40"]
    budget = ["budget.max_prompt_tokens=240", "budget.max_obs_tokens=192", "budget.max_total_tokens=1000"]
    # 0 resolves to the most trained tokens a trajectory can hold, so the saved config holds the constant
    assert load_config(None, [*dr, *budget]).algo.loss_agg_tokens == 3 * 40
    assert load_config(None, [*dr, *budget, "budget.max_total_tokens=300"]).algo.loss_agg_tokens == 300 - 240
    assert (
        load_config(None, ["algo.loss_agg=seq-mean-token-sum-norm", "algo.loss_agg_tokens=100"]).algo.loss_agg_tokens
        == 100
    )
    for loss in losses.POLICY_LOSSES:
        for name in ("grpo", "ppo"):
            assert load_config(None, [f"algo.name={name}", f"algo.policy_loss={loss}"]).algo.policy_loss == loss


def test_dynamic_sampling_judges_a_group_by_the_rows_the_update_trains_on():
    """algo.filter_groups keeps a group whose rewards differ; with retriever.exclude_failed the row whose search
    failed leaves the loss and the group's statistics, so it must not make the group count: rewards 1, 1 and a
    failed search's 0 are a group of equal rewards (zero advantage everywhere), dropped; without the exclusion
    the failed row trains and the group is kept."""
    from agent_rl.rollout.trajectory import Trajectory, Turn
    from agent_rl.train import informative

    def traj(reward: float, failed: bool) -> Trajectory:
        t = Trajectory(
            "q",
            "toy",
            [1, 2],
            ["a"],
            turns=[Turn("search", 4, False, query="q", retriever_error="timeout" if failed else None)],
        )
        t.reward = reward
        return t

    group = [traj(1.0, False), traj(1.0, False), traj(0.0, True)]
    assert not informative(group, exclude_failed=True)
    assert informative(group, exclude_failed=False)
    assert informative([traj(1.0, False), traj(0.0, False), traj(0.0, True)], exclude_failed=True)
