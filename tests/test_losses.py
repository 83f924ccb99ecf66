"""Advantages, losses and rewards: hand-computed tensors, loop vs vectorised, and a real tiny
Qwen2 whose inserted observation tokens must get exactly zero gradient in every loss term."""

import math
import random

import pytest
import torch

from agent_rl.config import load_config
from agent_rl.learn import advantages as adv_lib
from agent_rl.learn import losses
from agent_rl.learn.batch import collate
from agent_rl.learn.policy import ValueModel, forward_logprobs, frozen_copy, load_policy
from agent_rl.learn.update import prepare_batch, update
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.engines import Generation
from agent_rl.rollout.loop import AgentLoop, PromptItem
from agent_rl.rollout.protocol import extract_answer, well_formed
from agent_rl.rollout.rewards import compute_reward
from agent_rl.rollout.trajectory import Trajectory

# ---------------------------------------------------------------- GAE


def _random_masks(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """Rows shaped like real trajectories: prompt (0), turns (1) with observations (0) between, padding (0)."""
    mask = torch.zeros(B, T)
    for b in range(B):
        t = int(torch.randint(1, 6, (1,), generator=gen))
        end = T - int(torch.randint(0, 8, (1,), generator=gen))
        while t < end:
            turn = int(torch.randint(1, 7, (1,), generator=gen))
            mask[b, t : min(end, t + turn)] = 1
            t += turn + int(torch.randint(1, 6, (1,), generator=gen))  # an observation span
    return mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_vectorised_equals_loop_reference(gamma, lam):
    """gae (vectorised over the batch) == gae_reference (plain loop) on random rewards/values with
    prompt, mid-sequence observation and padding spans; mask-0 positions get 0 advantage and return."""
    gen = torch.Generator().manual_seed(0)
    B, T = 7, 48
    mask = _random_masks(B, T, gen)
    assert ((mask[:, 1:] - mask[:, :-1]) > 0).sum() > B  # several policy spans per row: there are gaps to skip
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    adv, ret = adv_lib.gae(rewards * mask, values, mask, gamma, lam)
    adv_ref, ret_ref = adv_lib.gae_reference(rewards * mask, values, mask, gamma, lam)
    torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(adv[mask == 0], torch.zeros_like(adv[mask == 0]))
    assert torch.equal(ret[mask == 0], torch.zeros_like(ret[mask == 0]))


def test_gae_skips_observation_spans():
    """An observation span is transparent: GAE over a row with masked spans equals GAE over the
    same row with those spans cut out, whatever rewards and values sit at the masked positions."""
    gen = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0]], dtype=torch.float32)
    rewards = torch.randn(1, 14, generator=gen) * mask
    values = torch.randn(1, 14, generator=gen)
    noisy_values = torch.where(mask > 0, values, torch.full_like(values, 1e3))
    keep = mask[0] > 0
    adv, ret = adv_lib.gae(rewards, noisy_values, mask, 0.97, 0.9)
    adv_c, ret_c = adv_lib.gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), 0.97, 0.9)
    torch.testing.assert_close(adv[:, keep], adv_c)
    torch.testing.assert_close(ret[:, keep], ret_c)


def test_gae_hand_computed():
    """mask [1,0,1,1], reward 1 on the last token, gamma 0.9, lam 0.8, by hand (position 1 is skipped)."""
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.4]])
    adv, ret = adv_lib.gae(rewards, values, mask, 0.9, 0.8)
    # t=3: d=1-0.4=0.6; t=2: d=0.9*0.4-0.2=0.16, A=0.16+0.72*0.6=0.592; t=0: d=0.9*0.2-0.5=-0.32, A=-0.32+0.72*0.592
    expected = torch.tensor([[-0.32 + 0.72 * 0.592, 0.0, 0.592, 0.6]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, (expected + values) * mask)


def test_token_level_rewards_score_on_last_policy_token_and_kl_on_policy_tokens():
    """The score lands on the last mask-1 token (not on trailing observation/padding); k1 KL only on mask-1."""
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    kl = torch.full((2, 7), 2.0)
    r = adv_lib.token_level_rewards(torch.tensor([3.0, 5.0]), mask, kl, kl_coef=0.5)
    assert torch.equal(r[0], torch.tensor([0.0, -1, -1, 0, 2, 0, 0]))
    assert torch.equal(r[1], torch.zeros(7))  # no policy token: no reward anywhere


# ---------------------------------------------------------------- GRPO, whiten


def test_grpo_advantages_by_group_hand_computed():
    """Groups are keyed by id, rows interleaved; unbiased std; Dr. GRPO skips the division;
    a single-sample group and a constant group get exactly 0 (no NaN)."""
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.0, 1.5, 7.0, 2.0, 2.0])
    ids = ["a", "b", "a", "a", "b", "c", "d", "d"]
    adv = adv_lib.grpo_advantages(rewards, ids)
    s = math.sqrt(1 / 3)  # std of [1, 0, 0] with Bessel's correction
    expected = torch.tensor([(2 / 3) / s, -math.sqrt(0.5), (-1 / 3) / s, (-1 / 3) / s, math.sqrt(0.5), 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=1e-4, atol=1e-4)
    dr = adv_lib.grpo_advantages(rewards, ids, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -0.5, -1 / 3, -1 / 3, 0.5, 0.0, 0.0, 0.0]))
    assert adv_lib.grpo_advantages(torch.tensor([4.0]), ["only"]).item() == 0.0


def test_whiten_uses_masked_entries_only():
    """Whitening statistics come from mask-1 entries: padding values do not move the result."""
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [2.0, -50.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    w = adv_lib.whiten(x, mask)
    # masked entries 1, 2, 3, 2: mean 2, unbiased var 2 / 3 (verl's and TRL's whitening), not the biased 0.5
    torch.testing.assert_close(w[mask > 0], torch.tensor([-1.0, 0.0, 1.0, 0.0]) / math.sqrt(2 / 3))
    m = w[mask > 0]
    assert abs(float(m.mean())) < 1e-6 and abs(float(m.std()) - 1.0) < 1e-4
    # one masked entry: no spread, whitened to 0 rather than divided by zero
    assert float(adv_lib.whiten(x, torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))[0, 0]) == 0.0


# ---------------------------------------------------------------- policy loss, aggregation


def test_policy_loss_clipping_hand_computed():
    """Ratios inside/outside the clip with positive/negative advantages; a masked token with a huge
    ratio counts for nothing; clipped tokens get zero gradient, unclipped ones -A * r / n."""
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.5, 50.0]])
    advs = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    old = torch.full_like(ratios, -2.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    loss, stats = losses.policy_loss(logprobs, old, advs, mask, 0.2, 0.2)
    per_token = [-1.1, -1.2, 0.8, 1.5, -0.5]  # inside, clipped high, clipped low, pessimistic, pessimistic
    assert loss.item() == pytest.approx(sum(per_token) / 5, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(2 / 5)
    loss.backward()
    expected_grad = torch.tensor([[-1.1, 0.0, 0.0, 1.5, -0.5, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected_grad)
    # (B,) advantages broadcast over T
    loss_b, _ = losses.policy_loss(logprobs.detach(), old, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert loss_b.item() == pytest.approx((-1.1 - 1.2 - 0.5 - 1.2 - 0.5) / 5, abs=1e-6)


def test_policy_loss_separate_low_and_high_clip():
    """clip_ratio_low bounds r from below (A<0), clip_ratio_high from above (A>0), independently."""
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[1.25, 0.75]]).log()
    advs = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    wide_high, _ = losses.policy_loss(logprobs, old, advs, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert wide_high.item() == pytest.approx((-1.25 + 0.8) / 2, abs=1e-6)  # 1.25 < 1.28 not clipped; 0.75 -> 0.8
    wide_low, _ = losses.policy_loss(logprobs, old, advs, mask, clip_ratio_low=0.28, clip_ratio_high=0.2)
    assert wide_low.item() == pytest.approx((-1.2 + 0.75) / 2, abs=1e-6)  # 1.25 -> 1.2; 0.75 > 0.72 not clipped


def test_aggregation_token_mean_vs_seq_mean_token_mean():
    """token-mean weighs every token equally; seq-mean-token-mean every sequence; empty rows are ignored."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 9.0], [10.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert losses.aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(16 / 4)
    assert losses.aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 10) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        losses.aggregate(loss_mat, mask, "seq-sum")


# ---------------------------------------------------------------- KL, value loss


def test_kl_k1_and_low_var_kl_hand_computed():
    """k1 = logp - ref; k3 = exp(ref - logp) - (ref - logp) - 1, >= 0 and clamped at 10."""
    logp = torch.tensor([[-1.0, -2.0, -30.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -5.0, -0.5]])
    torch.testing.assert_close(losses.kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0, -25.0, 0.0]]))
    k3 = losses.kl_penalty(logp, ref, "low_var_kl")
    expected = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.e - 2, 10.0, 0.0]])
    torch.testing.assert_close(k3, expected)
    torch.testing.assert_close(losses.kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(ValueError, match="low_var_kl"):
        losses.kl_penalty(logp, ref, "k2")


def test_value_loss_clipping_hand_computed():
    """0.5 * max((v-R)^2, (v_old + clip(v - v_old, +-c) - R)^2) over mask-1 tokens; clip off = plain MSE."""
    values = torch.tensor([[1.0, 2.0, 7.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    clipped, _ = losses.value_loss(values, old, returns, mask, 0.2)
    assert clipped.item() == pytest.approx(0.5 * (0.09 + 4.0) / 2)  # token 0: clip to 0.7 -> 0.09 > 0
    plain, _ = losses.value_loss(values, old, returns, mask, None)
    assert plain.item() == pytest.approx(0.5 * (0.0 + 4.0) / 2)


# ---------------------------------------------------------------- rewards


def test_em_on_last_answer_f1_and_format():
    """EM/F1 use the last complete <answer> with SQuAD normalisation; the format bonus needs a
    well-formed response and the total is capped at 1."""
    resp = "<think>x</think><answer>Paris</answer> then <answer>The  Beatles!</answer>"
    assert extract_answer(resp) == "The  Beatles!"
    assert compute_reward("em", resp, ["beatles"]) == 1.0
    assert compute_reward("em", resp, ["Paris"]) == 0.0
    assert compute_reward("em", "<answer>Paris</answer> <answer>unfinished", ["paris"]) == 1.0
    assert compute_reward("em", "no answer at all: Paris", ["Paris"]) == 0.0
    assert compute_reward("f1", "<answer>the Eiffel Tower, Paris</answer>", ["Eiffel Tower"]) == pytest.approx(0.8)
    good = "<search>q</search>\n\n<information>Doc 1</information>\n\n<answer>Rome</answer><|endoftext|>"
    assert well_formed(good)
    assert compute_reward("em", good, ["Paris"], format_coef=0.2) == pytest.approx(0.2)
    assert compute_reward("em", good, ["Rome"], format_coef=0.2) == 1.0
    assert compute_reward("em", good + " trailing", ["Paris"], format_coef=0.2) == 0.0
    assert compute_reward("em", "<search>q<answer>Rome</answer>", ["Paris"], format_coef=0.2) == 0.0
    with pytest.raises(ValueError, match="unknown reward"):
        compute_reward("bleu", good, ["Rome"])


class _Scripted:
    """An Engine that plays a fixed list of turn texts (a scripted policy)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns, self.stats = tokenizer, list(turns), {"generated_tokens": 0}

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0):
        out = []
        for _ in prompts:
            ids = self.tok(self.turns.pop(0), add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


def _rollout(tokenizer, turns: list[str], golden: list[str]) -> Trajectory:
    prompt = tokenizer(
        "Answer inside <answer> and </answer>, e.g. <answer> Beijing </answer>. Question: who?\n",
        add_special_tokens=False,
    )["input_ids"]
    budget = TokenBudget(
        max_turns=1,
        max_prompt_tokens=128,
        max_tokens_per_turn=48,
        max_obs_tokens=200,
        max_total_tokens=128 + 2 * 48 + 200,
    )
    loop = AgentLoop(_Scripted(tokenizer, turns), tokenizer, None, budget)
    [t] = loop.run([PromptItem("toy-1", "toy", prompt, golden)])
    return t


def test_reward_ignores_prompt_and_inserted_text(tiny_model_dir):
    """A real rollout whose prompt shows `<answer> Beijing </answer>` and whose inserted corrective
    message says `between <answer> and </answer>`: only the policy's own answer is scored."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    never = _rollout(tok, ["hmm", "still thinking"], ["Beijing"])
    assert never.end_reason == "invalid" and 0 in never.loss_mask  # a corrective message was inserted
    assert compute_reward("em", never.response_text, ["Beijing"]) == 0.0  # the prompt's example is not an answer
    assert compute_reward("f1", never.response_text, ["Simon and Garfunkel"]) == 0.0  # nor is the inserted message
    recovered = _rollout(tok, ["hmm", "<answer>Rome</answer>"], ["Beijing"])
    assert recovered.end_reason == "answer"
    assert compute_reward("em", recovered.response_text, ["rome"]) == 1.0
    assert compute_reward("em", recovered.response_text, ["Beijing"], format_coef=0.1) == pytest.approx(0.1)


# ---------------------------------------------------------------- zero gradient on observations


def _trajs(vocab: int, groups: int = 2, n: int = 3, prompt_len: int = 9) -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    trajs = []
    for gi in range(groups):
        prompt = torch.randint(10, vocab, (prompt_len + gi,), generator=g).tolist()
        for j in range(n):
            t = Trajectory(f"toy-{gi}", "toy", prompt, ["x"], sample_idx=j)
            t.append(torch.randint(10, vocab, (5 + j,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * (5 + j))
            t.append(torch.randint(10, vocab, (7,), generator=g).tolist(), sampled=False)  # observation
            t.append(torch.randint(10, vocab, (4,), generator=g).tolist(), sampled=True, logprobs=[-1.0] * 4)
            if j == 1:
                t.append(torch.randint(10, vocab, (3,), generator=g).tolist(), sampled=False)  # ends on an insert
            t.reward = float(j)
            trajs.append(t)
    return trajs


def _capture_grads(module: torch.nn.Module, ids_source: torch.nn.Module, store: list) -> list:
    """Record (input_ids, d loss / d output) of `module` for every forward that builds a graph."""
    seen = {}

    def on_ids(_m, args, _out):
        seen["ids"] = args[0].detach().clone()

    def on_out(_m, _args, out):
        if out.requires_grad:
            ids = seen["ids"]
            out.register_hook(lambda g: store.append((ids, g.detach().clone())))

    return [ids_source.register_forward_hook(on_ids), module.register_forward_hook(on_out)]


def _column_masks(trajs: list[Trajectory], ids: torch.Tensor) -> torch.Tensor:
    """loss_mask columns (collate's layout) for the rows of a micro-batch, matched by token ids."""
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for r in range(ids.shape[0]):
        [t] = [t for t in trajs if ids[r, : t.total_tokens].tolist() == t.prompt_ids + t.response_ids]
        out[r, t.prompt_tokens : t.total_tokens] = torch.tensor(t.loss_mask, dtype=torch.float32)
    return out


def _assert_zero_exactly_where_masked(records, trajs):
    """Output position p feeds the loss for token p + 1: zero gradient iff token p + 1 has mask 0."""
    assert records, "no backward pass reached the hooked module"
    for ids, grad in records:
        cols = _column_masks(trajs, ids)
        feeds = torch.cat([cols[:, 1:], torch.zeros(cols.shape[0], 1)], dim=1)  # position p -> token p+1
        per_pos = grad.abs().sum(-1)
        assert torch.count_nonzero(per_pos[feeds == 0]) == 0, "a masked token received gradient"
        assert bool((per_pos[feeds == 1] > 0).all()), "a policy token received no gradient"
        assert int((feeds == 0).sum()) > int((feeds == 1).sum())  # prompt, observations and padding were all there


def test_observation_tokens_get_zero_gradient_grpo(tiny_model_dir):
    """GRPO update on a real tiny Qwen2 with policy loss + low_var_kl loss + entropy bonus:
    d loss / d (last hidden state) is exactly 0 at every position predicting a prompt, observation or
    pad token (the LM head only ever sees the positions predicting trained tokens)."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "budget.max_total_tokens=1000",
            "train.share_prompt_prefix=false",  # one pass in the full layout; sharing equals it (test_selected_logits)
            "algo.kl_coef=0.1",
            "algo.kl_type=low_var_kl",
            "algo.entropy_coef=0.01",
            "algo.ppo_epochs=2",
            "algo.group_size=3",
        ],
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    ref = frozen_copy(policy, "cpu")
    with torch.no_grad():  # the policy has drifted from the reference, so the KL term has a gradient
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    trajs = _trajs(policy.config.vocab_size)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    assert batch.advantages[batch.loss_mask == 0].abs().sum() == 0  # prompt, observations and padding
    records: list = []
    handles = _capture_grads(
        policy.model.norm, policy.model.embed_tokens, records
    )  # the last hidden state, which only the LM head reads
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    try:
        stats = update(
            cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature
        )
    finally:
        for h in handles:
            h.remove()
    assert stats["actor/kl"] > 0 and stats["actor/entropy"] > 0
    assert len(records) == 2  # one micro-batch per epoch
    _assert_zero_exactly_where_masked(records, trajs)


def test_observation_tokens_get_zero_gradient_ppo_policy_and_critic(tiny_model_dir):
    """PPO with a critic: GAE gives observation positions advantage 0 and return 0, and neither the
    policy logits nor the value head get any gradient from positions scoring inserted tokens."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "budget.max_total_tokens=1000",
            "train.share_prompt_prefix=false",
            "algo.name=ppo",
            "algo.group_size=3",
            "algo.gamma=0.99",
            "algo.lam=0.95",
        ],
    )
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    critic = ValueModel(frozen_copy(policy, "cpu"))
    for p in critic.parameters():
        p.requires_grad_(True)
    with torch.no_grad():
        critic.head.bias.fill_(0.3)  # nonzero values, so GAE has something to skip
    trajs = _trajs(policy.config.vocab_size)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, critic, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    for a, r, m in zip(batch.advantages, batch.returns, batch.loss_mask):
        assert torch.count_nonzero(a[m == 0]) == 0 and torch.count_nonzero(r[m == 0]) == 0
        assert torch.count_nonzero(r[m == 1]) > 0
    pol_records: list = []
    val_records: list = []
    handles = _capture_grads(policy.model.norm, policy.model.embed_tokens, pol_records)
    handles += _capture_grads(critic.head, critic.backbone.embed_tokens, val_records)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    try:
        stats = update(
            cfg.algo,
            cfg.train,
            policy,
            critic,
            opt,
            critic_opt,
            batch,
            random.Random(0),
            temperature=cfg.rollout.temperature,
        )
    finally:
        for h in handles:
            h.remove()
    assert stats["loss/value"] > 0
    _assert_zero_exactly_where_masked(pol_records, trajs)
    _assert_zero_exactly_where_masked(val_records, trajs)


def test_k1_kl_enters_ppo_token_rewards(tiny_model_dir):
    """PPO with kl_type=k1: the KL of the (drifted) policy from the reference is subtracted from the
    token rewards, also on the single-pass path where no old log-probs are kept (need_old=False)."""
    base = [
        f"model.path={tiny_model_dir}",
        "budget.max_total_tokens=1000",
        "algo.name=ppo",
        "algo.group_size=3",
        "algo.kl_type=k1",
    ]
    cfg_kl = load_config(None, [*base, "algo.kl_coef=0.5"])
    cfg_nokl = load_config(None, [*base, "algo.kl_coef=0.0"])
    torch.manual_seed(0)
    policy = load_policy(cfg_kl.model, str(tiny_model_dir), "cpu")
    ref = frozen_copy(policy, "cpu")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    critic = ValueModel(frozen_copy(policy, "cpu"))
    trajs = _trajs(policy.config.vocab_size)
    for need_old in (True, False):
        with_kl = prepare_batch(
            cfg_kl.algo,
            cfg_kl.train,
            policy,
            ref,
            critic,
            trajs,
            0,
            need_old=need_old,
            temperature=cfg_kl.rollout.temperature,
        )
        without = prepare_batch(
            cfg_nokl.algo,
            cfg_nokl.train,
            policy,
            None,
            critic,
            trajs,
            0,
            need_old=need_old,
            temperature=cfg_nokl.rollout.temperature,
        )
        diff = float((with_kl.returns - without.returns).abs().sum())
        assert diff > 1e-3, f"need_old={need_old}: the k1 KL did not change the returns"


# ---------------------------------------------------------------- shared prompt prefix


def test_shared_prompt_prefix_equals_the_full_pass(tiny_model_dir):
    """Each group's prompt runs once (left-padded, prompts of different lengths) and its KV cache,
    gathered per row, carries the gradient back: log-probs, entropy and every parameter gradient
    match the full pass, and one update step lands on the same parameters."""
    import copy

    base = [
        f"model.path={tiny_model_dir}",
        "budget.max_total_tokens=1000",
        "algo.group_size=4",
        "algo.entropy_coef=0.01",
    ]
    torch.manual_seed(0)
    cfg = load_config(None, base)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, groups=3, n=4, prompt_len=40)
    mb = collate(trajs, list(range(len(trajs))), 0)
    weights = torch.rand(mb.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * mb.loss_mask
    results = {}
    for share in (False, True):
        shapes: list[tuple] = []
        hook = policy.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
        policy.zero_grad()
        lp, ent = forward_logprobs(policy, mb, 0.7, with_entropy=True, share_prefix=share)
        ((lp + ent) * weights).sum().backward()
        hook.remove()
        results[share] = (lp.detach(), ent.detach(), [p.grad.clone() for p in policy.parameters()], shapes)
    (lp0, ent0, g0, shapes0), (lp1, ent1, g1, shapes1) = results[False], results[True]
    assert shapes0 == [tuple(mb.input_ids.shape)]
    assert shapes1[0] == (3, 42) and shapes1[1][0] == 12  # three prompts once, then twelve responses
    m = mb.loss_mask
    assert torch.allclose(lp0 * m, lp1 * m, atol=1e-5) and torch.allclose(ent0 * m, ent1 * m, atol=1e-5)
    assert torch.count_nonzero(lp1 * (1 - m)) <= torch.count_nonzero(lp0 * (1 - m))  # nothing outside the response
    for a, b in zip(g0, g1):
        assert float((a - b).norm()) <= 1e-5 * float(a.norm()) + 1e-7

    for t in trajs:
        t.reward = float(t.sample_idx % 2)
    stepped = {}
    for share in (False, True):
        cfg = load_config(None, [*base, f"train.share_prompt_prefix={str(share).lower()}"])
        model = copy.deepcopy(policy)
        batch = prepare_batch(
            cfg.algo, cfg.train, model, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
        )
        update(
            cfg.algo,
            cfg.train,
            model,
            None,
            torch.optim.SGD(model.parameters(), lr=0.5),
            None,
            batch,
            random.Random(0),
            temperature=cfg.rollout.temperature,
        )
        stepped[share] = [p.detach() for p in model.parameters()]
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(stepped[True], policy.parameters()))
    assert moved > 1e-4
    for a, b in zip(stepped[False], stepped[True]):
        assert torch.allclose(a, b, atol=1e-6)
