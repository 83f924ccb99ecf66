"""The update moves a real tiny Qwen2 the right way on a fixed batch: one GRPO step raises the
log-probs of positive-advantage responses and lowers those of negative ones, the entropy bonus
raises the entropy, the KL term pulls the policy back to the reference. Around it: k micro-batches
give the one-pass gradient for every `algo.loss_agg` (with an excluded all-zero-mask row),
`algo.mini_batch_size` takes one optimizer step per mini-batch, truncated-IS weights, gradient
checkpointing and the learning-rate schedule against hand-computed values, and the same update
repeated gives the same gradient bit for bit."""

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
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    adv = batch.advantages.sum(-1)
    pos, neg = adv > 0, adv < 0
    assert int(pos.sum()) == 4 and int(neg.sum()) == 4
    before, _ = _response_stats(policy, trajs)
    update(
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
    assert bool((delta[pos] > 0).all()) and bool((delta[neg] < 0).all()), delta  # row by row, too


def test_entropy_bonus_raises_entropy_with_zero_advantages(tiny_model_dir):
    """Equal rewards in every group (advantage 0: the policy term has no gradient) and
    algo.entropy_coef > 0: one update raises the mean entropy over the response positions."""
    cfg = _cfg(tiny_model_dir, "train.lr=1e-3", "algo.entropy_coef=0.1")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    _drift(policy)  # a sharper start than the near-uniform random init, so entropy has room to rise
    trajs = _trajs(policy.config.vocab_size, [1.0] * 4 + [0.0] * 4)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    assert float(batch.advantages.abs().sum()) == 0.0
    _, before = _response_stats(policy, trajs)
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
    _, after = _response_stats(policy, trajs)
    assert stats["actor/entropy"] == pytest.approx(before, rel=1e-4)  # the update read the same entropy
    assert after > before + 1e-3, (before, after)


def test_kl_term_pulls_the_policy_back_to_the_reference(tiny_model_dir):
    """Zero advantages, algo.kl_coef > 0 (low_var_kl as a loss term), the policy moved away from its
    frozen reference: one update lowers the KL to the reference over the sampled tokens."""
    cfg = _cfg(tiny_model_dir, "train.lr=1e-3", "algo.kl_coef=0.5")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    ref = frozen_copy(policy, "cpu")
    _drift(policy)
    trajs = _trajs(policy.config.vocab_size, [1.0] * 4 + [0.0] * 4)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    assert float(batch.advantages.abs().sum()) == 0.0
    before = _kl_to_ref(policy, ref, trajs)
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
    after = _kl_to_ref(policy, ref, trajs)
    assert stats["actor/kl"] == pytest.approx(before, rel=1e-4)
    assert before > 0.01 and after < before - 1e-3, (before, after)


# ---------------------------------------------------------------- micro-batches, mini-batches


def _grads(cfg, trajs):
    """One `update` of a fresh tiny policy on `trajs` (SGD at lr 0: the parameters stay, the
    gradients are left in .grad); a KL reference is a copy the policy has drifted from, a critic
    (PPO) starts from the policy with a nonzero value head. Returns (policy and critic gradients,
    the update's metrics)."""
    torch.manual_seed(0)
    policy = load_policy(cfg.model, cfg.model.path, "cpu")
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
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, ref, critic, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.0) if critic is not None else None
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
    from transformers import AutoConfig

    extra = [f"algo.loss_agg={loss_agg}", *TERMS[terms]]
    rewards = [1.0, 0.0, 1.0, 0.0] + [0.0, 1.0, 1.0, 0.0] + [1.0] * 4  # the last group: advantage 0
    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    one, one_stats = _grads(
        _cfg(tiny_model_dir, *extra, "train.max_tokens_per_microbatch=4096", "train.skip_zero_advantage=false"),
        _trajs(vocab, rewards, excluded=2),
    )
    assert one_stats["train/microbatches"] == 1
    counts = set()
    for cap in (64, 100, 160):
        got, stats = _grads(
            _cfg(tiny_model_dir, *extra, f"train.max_tokens_per_microbatch={cap}"), _trajs(vocab, rewards, excluded=2)
        )
        counts.add(stats["train/microbatches"])
        _assert_same_gradient(got, one)
    assert len(counts) == 3 and min(counts) >= 2  # three different splits


def _sub_batch(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """Rows of a scored batch as a batch of their own, with the full batch's advantages and old log-probs."""
    sub = RolloutBatch(trajs=[batch.trajs[i] for i in rows], rows=collate(batch.trajs, rows, 0))
    index = torch.tensor(rows)
    for name in ("old_logprobs", "advantages", "returns"):
        setattr(sub, name, getattr(batch, name)[index])
    return sub


def _one_pass_gradient(cfg, state: dict, batch: RolloutBatch) -> list[torch.Tensor]:
    """The policy gradient of one update pass (`cfg` without mini-batches) over `batch` at the weights `state`."""
    model = load_policy(cfg.model, cfg.model.path, "cpu")
    model.load_state_dict(state)
    update(
        cfg.algo,
        cfg.train,
        model,
        None,
        torch.optim.SGD(model.parameters(), lr=0.0),
        None,
        batch,
        random.Random(0),
        temperature=cfg.rollout.temperature,
    )
    return [p.grad for p in model.parameters()]


def test_mini_batch_size_takes_one_optimizer_step_per_mini_batch(tiny_model_dir):
    """algo.mini_batch_size=4 on 8 trajectories with algo.ppo_epochs=2 ("trajectories per optimizer
    step"): 4 optimizer steps, each over 4 distinct trajectories, each epoch over all 8; every step's
    gradient is the one-pass gradient of those 4 rows alone (their own token count as normaliser) at
    the parameters that step started from, against the old log-probs scored before the update."""
    extra = ["algo.mini_batch_size=4", "algo.ppo_epochs=2", "train.share_prompt_prefix=false", "train.pack_rows=false"]
    cfg = _cfg(tiny_model_dir, *extra)
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    by_ids = {tuple(t.prompt_ids + t.response_ids): i for i, t in enumerate(trajs)}
    seen: list[int] = []
    steps: list[tuple[list[int], list[torch.Tensor], dict]] = []

    def on_forward(_module, args, kwargs):  # unpacked, unshared: each input row is one trajectory
        ids = kwargs["input_ids"]
        for r in range(ids.shape[0]):
            seen.append(next(i for key, i in by_ids.items() if ids[r, : len(key)].tolist() == list(key)))

    def on_step(optimizer, _args, _kwargs):
        params = list(policy.parameters())
        steps.append((sorted(seen), [p.grad.clone() for p in params], copy.deepcopy(policy.state_dict())))
        seen.clear()

    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    hooks = [policy.register_forward_pre_hook(on_forward, with_kwargs=True), opt.register_step_pre_hook(on_step)]
    try:
        update(
            cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(steps) == 4
    for epoch in (steps[:2], steps[2:]):
        assert [len(rows) for rows, _, _ in epoch] == [4, 4] and len(set(epoch[0][0]) | set(epoch[1][0])) == 8
    one_pass = _cfg(tiny_model_dir, "train.share_prompt_prefix=false", "train.pack_rows=false")
    for k, (rows, grads, state) in enumerate(steps):
        _assert_same_gradient(grads, _one_pass_gradient(one_pass, state, _sub_batch(batch, rows)))
        if k:
            assert not torch.equal(grads[0], steps[k - 1][1][0])
    assert any(not torch.equal(a, b) for a, b in zip(steps[0][2].values(), steps[1][2].values()))  # it stepped


def test_a_short_remainder_joins_the_last_mini_batch(tiny_model_dir):
    """12 trajectories (dynamic sampling kept three groups of four where the config's batch holds four) with
    algo.mini_batch_size=8: one optimizer step over all 12, its gradient the one-pass gradient of the 12, not
    a step of 8 and then a step of the 4 left over, whose rows would each weigh twice a row of the first."""
    cfg = _cfg(tiny_model_dir, "algo.mini_batch_size=8", "algo.ppo_epochs=2", "rollout.prompts_per_step=4")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=True, temperature=cfg.rollout.temperature
    )
    grads: list[list[torch.Tensor]] = []

    def on_step(optimizer, _args, _kwargs):
        grads.append([p.grad.clone() for p in policy.parameters()])

    start = copy.deepcopy(policy.state_dict())
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    hook = opt.register_step_pre_hook(on_step)
    try:
        update(
            cfg.algo, cfg.train, policy, None, opt, None, batch, random.Random(0), temperature=cfg.rollout.temperature
        )
    finally:
        hook.remove()
    assert len(grads) == 2  # one optimizer step an epoch
    _assert_same_gradient(grads[0], _one_pass_gradient(_cfg(tiny_model_dir), start, batch))


# ---------------------------------------------------------------- truncated importance sampling


def test_tis_weights_hand_computed():
    """min(pi_old / pi_engine, cap) per token: above 1 where the trainer's old policy gives the token
    more probability than the engine did, capped at `cap`, below 1 the other way, 1 on mask-0 tokens
    whatever the log-probs there."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0, -0.2]])
    engine = torch.tensor([[-1.5, -1.0, -0.5, -0.1, -9.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    w = losses.tis_weights(old, engine, mask, cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, math.exp(-2.9), 1.0, 2.0]])  # e^1.8 capped
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad
    torch.testing.assert_close(losses.tis_weights(old, engine, mask, cap=1.5)[0, 0], torch.tensor(1.5))


def test_tis_cap_reweights_each_token_of_the_update(tiny_model_dir):
    """algo.tis_cap=2 in a real update: engine log-probs set to the trainer's minus 1 (weight e, capped
    to 2), plus 0.5 (weight e^-0.5) or equal (1) on alternating sampled tokens. The logged mean weight
    is the hand-computed one, and the gradient is the uncorrected update's with each token's advantage
    multiplied by its hand-computed weight."""
    cfg = _cfg(tiny_model_dir, "algo.tis_cap=2.0")
    plain = _cfg(tiny_model_dir)
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
    mb = collate(trajs, list(range(len(trajs))), 0)
    with torch.no_grad():
        trainer_lp, _ = forward_logprobs(policy, mb, 1.0)
    shifts = torch.tensor([-1.0, 0.5, 0.0])
    weights = torch.ones_like(mb.loss_mask)
    for r, t in enumerate(trajs):
        k = 0
        for pos, m in enumerate(t.loss_mask):
            col = t.prompt_tokens + pos
            if m:
                s = shifts[k % 3]
                t.logprobs[pos] = float(trainer_lp[r, col] + s)
                weights[r, col] = min(2.0, math.exp(-float(s)))
                k += 1
    want_mean = float((weights * mb.loss_mask).sum() / mb.loss_mask.sum())
    assert 1.0 < want_mean < 2.0

    def run(c, scale):
        model = copy.deepcopy(policy)
        batch = prepare_batch(
            c.algo, c.train, model, None, None, trajs, 0, need_old=False, temperature=c.rollout.temperature
        )
        batch.advantages = batch.advantages * scale
        stats = update(
            c.algo,
            c.train,
            model,
            None,
            torch.optim.SGD(model.parameters(), lr=0.0),
            None,
            batch,
            random.Random(0),
            temperature=c.rollout.temperature,
        )
        return [p.grad.clone() for p in model.parameters()], stats

    got, stats = run(cfg, 1.0)
    assert stats["actor/tis_weight_mean"] == pytest.approx(want_mean, rel=1e-5)
    want, _ = run(plain, weights)
    _assert_same_gradient(got, want)
    unweighted, _ = run(plain, 1.0)
    a, b = torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in unweighted])
    assert float((a - b).norm()) > 0.05 * float(b.norm())  # the weights changed the step


# ---------------------------------------------------------------- gradient checkpointing, schedule


def test_gradient_checkpointing_gives_the_plain_update_gradient(tiny_model_dir):
    """model.gradient_checkpointing=true recomputes every decoder layer in backward (each layer runs
    twice per micro-batch) and gives the plain update's gradients to float rounding, with the KL and
    entropy terms on."""
    results = {}
    for ckpt in (False, True):
        cfg = _cfg(
            tiny_model_dir,
            f"model.gradient_checkpointing={str(ckpt).lower()}",
            "algo.kl_coef=0.1",
            "algo.entropy_coef=0.01",
            "train.share_prompt_prefix=false",
        )
        torch.manual_seed(0)
        policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
        ref = frozen_copy(policy, "cpu")
        _drift(policy, 0.02)
        trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0] * 2)
        batch = prepare_batch(
            cfg.algo, cfg.train, policy, ref, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
        )
        layer, calls = policy.model.layers[0], []
        forward = layer.forward

        def counted(*args, _forward=forward, **kwargs):  # the recomputation runs forward, not the module's hooks
            calls.append(1)
            return _forward(*args, **kwargs)

        layer.forward = counted
        try:
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
        finally:
            del layer.forward
        results[ckpt] = ([p.grad.clone() for p in policy.parameters()], len(calls))
    (plain, plain_calls), (ckpt_grads, ckpt_calls) = results[False], results[True]
    assert plain_calls == 1 and ckpt_calls == 2  # one micro-batch; the second pass is the recomputation
    _assert_same_gradient(ckpt_grads, plain)


@pytest.mark.parametrize(
    "schedule,warmup,factors",
    [
        # warmup (s + 1) / 4 for s < 4, then 0.5 (1 + cos(pi (s - 4) / 6)): cos(pi/6) = 0.8660254
        ("cosine", 4, [0.25, 0.5, 0.75, 1.0, 1.0, 0.9330127, 0.75, 0.5, 0.25, 0.0669873]),
        (
            "cosine",
            0,
            [1.0, 0.9755283, 0.9045085, 0.7938926, 0.6545085, 0.5, 0.3454915, 0.2061074, 0.0954915, 0.0244717],
        ),
        ("constant", 3, [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("constant", 0, [1.0] * 10),
    ],
)
def test_lr_schedule_at_every_step_hand_computed(schedule, warmup, factors):
    """make_scheduler over run.max_steps=10 with train.lr=1e-3: the learning rate each of the 10
    optimizer steps uses (the trainer steps the scheduler after each update) is lr x the
    hand-computed factor: linear warmup from lr / warmup_steps, then constant or a half cosine
    over the remaining steps."""
    cfg = load_config(
        None, ["run.max_steps=10", "train.lr=1e-3", f"train.warmup_steps={warmup}", f"train.lr_schedule={schedule}"]
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = adamw([param], cfg.train.lr)
    scheduler = make_scheduler(cfg.train, cfg.run.max_steps, opt)
    used = []
    for _ in range(cfg.run.max_steps):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert used == pytest.approx([1e-3 * f for f in factors], rel=1e-5)


# ---------------------------------------------------------------- reproducibility


def test_shared_prefix_update_is_bitwise_repeatable(tiny_model_dir):
    """The shared-prompt-prefix update (the CPU default) on the same batch gives the same gradient bit
    for bit every time, with two threads or more. Each group's prompt KV cache and first-token logits
    are gathered for its rows with repeated indices, here large enough (>= 32768 elements) for torch's
    parallel CPU path: gathered as `t[index]`, the backward added the rows' gradients with atomic float
    adds in thread order, and the repetitions rounded differently (here one group of 32 rows and a long
    prompt, so both threads add into the same prompt's entries at once)."""
    cfg = _cfg(tiny_model_dir, "budget.max_prompt_tokens=256", "budget.max_total_tokens=320")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    g = torch.Generator().manual_seed(0)
    trajs = []
    prompt = torch.randint(10, policy.config.vocab_size, (192,), generator=g).tolist()
    for j in range(32):
        t = Trajectory("toy-0", "toy", prompt, ["x"], sample_idx=j)
        for sampled, n in ((True, 4 + j % 8), (False, 8), (True, 12 - j % 8)):
            ids = torch.randint(10, policy.config.vocab_size, (n,), generator=g).tolist()
            t.append(ids, sampled=sampled, logprobs=[-1.0] * n if sampled else None)
        t.reward = float(j % 2)
        trajs.append(t)
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        runs = []
        for _ in range(6):
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
            runs.append([p.grad.clone() for p in policy.parameters()])
    finally:
        torch.set_num_threads(threads)
    assert stats["train/microbatches"] == 1
    for other in runs[1:]:
        differ = [i for i, (a, b) in enumerate(zip(runs[0], other)) if not torch.equal(a, b)]
        assert not differ, f"{len(differ)} of {len(other)} gradients differ between two identical updates"


def test_old_logprobs_are_scored_without_dropout(tiny_model_dir):
    """LoRA with dropout: the old log-probs `prepare_batch` scores are the eval-mode ones, the same on every call
    (in train mode each call would draw other dropout masks), and the policy is left in the mode it had."""
    cfg = _cfg(tiny_model_dir, "model.lora.enabled=true", "model.lora.dropout=0.5")
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    _drift(policy)  # LoRA's B starts at 0: its branch, dropout and all, would add nothing
    trajs = _trajs(policy.config.vocab_size, [1.0, 0.0, 1.0, 0.0])

    def old() -> torch.Tensor:
        b = prepare_batch(cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=True, temperature=1.0)
        assert b.old_logprobs is not None
        return b.old_logprobs * b.loss_mask

    policy.train()
    first, second = old(), old()
    assert policy.training
    policy.eval()
    mb = collate(trajs, list(range(len(trajs))), 0)
    with torch.no_grad():
        want, _ = forward_logprobs(policy, mb, 1.0)
    assert not policy.training
    assert torch.equal(first, second)
    assert torch.allclose(first, want * mb.loss_mask, atol=1e-6)
