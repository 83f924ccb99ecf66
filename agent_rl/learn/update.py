"""Score the step's batch, then update the policy (and critic) on it.

`prepare_batch`: the no-grad passes (old log-probs, reference log-probs, values) and the
advantages and returns, into one `RolloutBatch`. `update`: PPO-style epochs over mini-batches,
each accumulated over token-capped micro-batches sliced from that batch.

Under torchrun (`world.sharded`) every rank holds whole GRPO groups and runs as many forward
passes as the rank with the most micro-batches (FSDP all-gathers in each one); the padding passes
have loss weight 0 and report no metrics. The loss is normalised by the mini-batch's global count of
trained tokens (token-mean) or of rows with a trained token (seq-mean-token-mean, as `losses.aggregate`
counts them), times the world size because FSDP averages gradients over ranks, so N ranks and k
micro-batches take the step one process would take in one pass. The ranks also take the same number of
mini-batches (optimizer steps), as many as the rank with the most rows needs (`minibatch_plan`): their row
counts differ when the buffer's budget drops groups on one rank or dynamic sampling runs out of batches.

A micro-batch's forward and backward never wait for the device: its loss weight comes from the host copy of the
batch, its forward plans from the rows' host copy (`MicroBatch.host`), and its metrics (and the log-probs reported
for saved rows) stay on the device as tensors until the update ends, then reach the host in one copy
(`_Readout`). So the host queues micro-batch after micro-batch while the device computes.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from torch import nn

from agent_rl.config import AlgoConfig, TrainConfig
from agent_rl.learn import advantages as adv_lib
from agent_rl.learn import losses
from agent_rl.learn.batch import MicroBatch, RolloutBatch, even_microbatches, pack_microbatches
from agent_rl.learn.policy import forward_logprobs, reference_mode, trainer_autocast, update_logprobs
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.world import LOCAL, World


def adamw(params, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over `params`, fused (one kernel over all tensors) where every parameter is a plain
    CPU or CUDA tensor: on CPU the 32M model's step took 0.021 s fused against 0.082 s in
    torch's default per-tensor loop (TRL's trainer uses the fused one too). Sharded (DTensor) or
    other parameters take the default. The state dict is the same either way, so checkpoints load
    across both."""
    params = list(params)
    plain = all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=plain or None)


def share_prefix(train: TrainConfig, policy: nn.Module, world: World) -> bool:
    """Share a group's prompt in the forward? Not under FSDP (every rank must run the same passes), nor when
    the policy recomputes its activations in backward (model.gradient_checkpointing, which `load_policy` turns
    on in the module)."""
    checkpointing = bool(getattr(policy, "is_gradient_checkpointing", False))
    return train.share_prompt_prefix and not world.sharded and not checkpointing


def _pack(train: TrainConfig, batch: RolloutBatch, members: list[int], share: bool) -> list[list[int]]:
    """Micro-batches over `members` as rows of the batch, a group's rows together when shared."""
    groups = [batch.trajs[i].prompt_id for i in members] if share else None
    local = pack_microbatches(batch.lengths(members), train.max_tokens_per_microbatch, groups)
    return [[members[j] for j in b] for b in local]


def minibatch_plan(algo: AlgoConfig, n: int, world: World = LOCAL) -> tuple[int, int]:
    """(rows a mini-batch takes on this rank, mini-batches an epoch) for a rank holding `n` rows.

    algo.mini_batch_size counts rows over all ranks, each taking mini_batch_size / world_size of them. Each
    mini-batch is an optimizer step with its own collectives, so the count follows the rank with the most rows
    (one all-reduce): a rank whose rows run out takes padding passes (loss weight 0) for the rest. A remainder
    shorter than a mini-batch (dynamic sampling or the buffer's budget can leave one) joins the last mini-batch
    (`minibatch_members`) instead of taking an optimizer step of its own: its few rows would move the weights
    as far as a full mini-batch does, each weighing several times a row of the others. Without mini-batches
    (0), one step over each rank's rows. One epoch of one mini-batch is the update's single pass (no old
    log-probs needed), decided alike on every rank."""
    mini = algo.mini_batch_size // world.world_size if algo.mini_batch_size else 0
    if not mini:
        return n, 1
    most = int(world.all_reduce_max(float(n)))
    return mini, max(1, most // mini)


def minibatch_members(order: list[int], mini: int, steps: int, step: int) -> list[int]:
    """The rows of mini-batch `step` of `steps` (`minibatch_plan`) in the epoch's `order`: `mini` of them, the
    last mini-batch taking the remainder too."""
    return order[step * mini : (step + 1) * mini if step < steps - 1 else len(order)]


def prepare_batch(
    algo: AlgoConfig,
    train: TrainConfig,
    policy: nn.Module,
    ref: nn.Module | None,
    critic: nn.Module | None,
    trajs: list[Trajectory],
    pad_id: int,
    need_old: bool,
    world: World = LOCAL,
    *,
    temperature: float,
) -> RolloutBatch:
    """The step's batch, scored: old log-probs (when `need_old`), reference log-probs (when a KL
    term is on), values (PPO), then advantages and returns, each (N, W) over the full sequence.
    Log-probs are at the sampling `temperature` (rollout.temperature)."""
    batch = RolloutBatch.from_trajectories(trajs, pad_id)
    n, width = batch.rows.input_ids.shape
    use_ref = algo.kl_coef > 0
    estimator = algo.resolved_advantage()
    # k1 in the reward needs the current policy's log-probs even on the single-pass path
    k1_reward = use_ref and algo.kl_type == "k1" and estimator in ("gae", "reinforce_pp", "reinforce_pp_baseline")
    wanted = {"old": need_old or k1_reward, "ref": use_ref, "values": critic is not None}
    out = {k: torch.zeros((n, width), dtype=torch.float32) for k, on in wanted.items() if on}
    share = share_prefix(train, policy, world)
    scored: list[tuple[list[int], str, torch.Tensor]] = []
    # scored in eval mode: no dropout (`model.lora.dropout`) in the old log-probs, the reference or the values
    with torch.no_grad(), trainer_autocast(train, world), _eval_mode(policy, critic):
        for index, real in even_microbatches(_pack(train, batch, list(range(n)), share), world):
            mb = batch.micro(index, train.device)
            got = {}
            if wanted["old"]:
                got["old"], _ = forward_logprobs(policy, mb, temperature, share_prefix=share, pack=train.pack_rows)
            if use_ref:
                with reference_mode(policy, ref) as ref_model:
                    got["ref"], _ = forward_logprobs(
                        ref_model, mb, temperature, share_prefix=share, pack=train.pack_rows
                    )
            if critic is not None:
                got["values"] = critic(mb.input_ids, mb.attention_mask)
            if real:
                keep = mb.attention_mask.float()  # right-padded rows: zeros past each row's end
                scored += [(index, k, v.float() * keep) for k, v in got.items()]
    for index, k, v in scored:  # to the host after every pass is queued: the first copy waits, the rest do not
        out[k][index, : v.shape[1]] = v.cpu()
    mask = batch.loss_mask
    scores = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    # An excluded trajectory (failed search) is its own group of one: advantage 0 under grpo and rloo (its
    # mask is all 0 under every estimator), and its group's statistics come from the others.
    keys = [f"{t.prompt_id}#excluded{i}" if t.excluded else t.prompt_id for i, t in enumerate(trajs)]
    if estimator == "grpo":
        batch.advantages = adv_lib.grpo_advantages(scores, keys, norm_by_std=algo.norm_adv_by_std)[:, None] * mask
        batch.returns = torch.zeros_like(mask)
    elif estimator == "rloo":
        batch.advantages = adv_lib.rloo_advantages(scores, keys)[:, None] * mask
        batch.returns = torch.zeros_like(mask)
    else:
        kl = losses.kl_penalty(out["old"], out["ref"], "k1") if k1_reward else None
        token_rewards = adv_lib.token_level_rewards(scores, mask, kl, algo.kl_coef if kl is not None else 0.0)
        # GAE's and REINFORCE++'s advantages are whitened over the whole batch: every rank's rows under torchrun
        reduce_sum = world.all_reduce_sum if world.sharded else None
        if estimator == "gae":
            a, batch.returns = adv_lib.gae(token_rewards, out["values"], mask, algo.gamma, algo.lam)
            batch.advantages = adv_lib.whiten(a, mask, reduce_sum=reduce_sum) * mask
        else:
            if estimator == "reinforce_pp":
                batch.advantages = adv_lib.reinforce_pp_advantages(token_rewards, mask, algo.gamma, reduce_sum)
            else:
                batch.advantages = adv_lib.reinforce_pp_baseline_advantages(
                    scores, keys, token_rewards, mask, algo.gamma, reduce_sum
                )
            batch.returns = torch.zeros_like(mask)
    batch.old_logprobs = out.get("old") if need_old else None
    batch.ref_logprobs = out.get("ref")
    batch.values = out.get("values")
    return batch


@contextlib.contextmanager
def _eval_mode(*modules: nn.Module | None) -> Iterator[None]:
    """`modules` (None skipped) in eval mode inside, each put back in the mode it had."""
    modes = [(m, m.training) for m in modules if m is not None]
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)


def update(
    algo: AlgoConfig,
    train: TrainConfig,
    policy: nn.Module,
    critic: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    critic_opt: torch.optim.Optimizer | None,
    batch: RolloutBatch,
    rng: random.Random,
    world: World = LOCAL,
    trainer_logprobs: dict[int, list[float] | None] | None = None,
    *,
    temperature: float,
) -> dict[str, float]:
    """PPO-style epochs over mini-batches, each accumulated over token-capped micro-batches; log-probs at the
    sampling `temperature` (rollout.temperature).

    `trainer_logprobs`, when given, maps rows of the batch to be reported (`save_trajectories`);
    the first epoch fills each with that row's old log-probs over its response tokens.
    """
    if batch.advantages is None:
        raise ValueError("update needs a scored batch: build it with prepare_batch")
    advantages = batch.advantages
    mini, steps = minibatch_plan(algo, len(batch), world)
    share = share_prefix(train, policy, world)
    policy.train()
    # A row whose advantage is 0 on every token adds exactly 0 to the policy gradient (every
    # term of the clipped loss is advantage x ratio) unless a KL, entropy or value loss reads it.
    skip_zero = (
        train.skip_zero_advantage
        and critic is None
        and algo.entropy_coef == 0
        and not (algo.kl_coef > 0 and algo.kl_type == "low_var_kl")
    )
    skipped = 0
    readout = _Readout()  # metrics; |trainer - engine| log-prob over sampled tokens (first epoch); reported rows
    for epoch in range(algo.ppo_epochs):
        order = list(range(len(batch)))
        rng.shuffle(order)
        for step in range(steps):
            members = minibatch_members(order, mini, steps, step)
            # The normalisers of the whole mini-batch, as `losses.aggregate` counts them over one micro-batch:
            # masked tokens (token-mean), or rows with at least one masked token (seq-mean-token-mean; an
            # excluded row, mask all 0, is in neither), so k micro-batches add up to the one-pass loss. Read
            # from the host copy once a mini-batch, the micro-batches' weights too (exact: whole numbers).
            tokens = dict(zip(members, batch.loss_mask[members].sum(-1).tolist()))
            mask_tokens = world.all_reduce_sum(sum(tokens.values())) / world.world_size
            rows = world.all_reduce_sum(float(sum(v > 0 for v in tokens.values()))) / world.world_size
            optimizer.zero_grad(set_to_none=True)
            if critic_opt is not None:
                critic_opt.zero_grad(set_to_none=True)
            # A rank whose rows ran out on earlier mini-batches runs its first row with weight 0 (a padding pass)
            padding = not members
            if skip_zero and members:  # kept in the normaliser above, left out of the forward and backward
                # One row still runs when none would: a zero gradient, not a missing one, so AdamW
                # moves (momentum, weight decay) exactly as the plain path, and FSDP ranks stay in step.
                trained = advantages[members].ne(0).any(-1).tolist()
                run = [i for i, t in zip(members, trained) if t] or members[:1]
                skipped += len(members) - len(run)
                members = run
            for index, real in even_microbatches(_pack(train, batch, members or order[:1], share), world):
                real = real and not padding
                mb = batch.micro(index, train.device)
                if not real:
                    weight = 0.0
                elif algo.loss_agg == "token-mean":
                    weight = sum(tokens[i] for i in index) / max(1.0, mask_tokens)
                else:
                    weight = sum(tokens[i] > 0 for i in index) / max(1.0, rows)
                # an FSDP padding pass: the same collectives, a zero gradient, no metrics
                mb_stats, old = _microbatch_step(algo, train, policy, critic, mb, weight, share, world, temperature)
                if real:
                    readout.stats += mb_stats.items()
                if epoch == 0 and real:  # old = the weights the engine sampled with
                    assert mb.rollout_logprobs is not None, "micro-batches of a scored RolloutBatch carry them"
                    readout.agree.append(losses.logprob_diff(old, mb.rollout_logprobs, mb.loss_mask))
                    for r, i in enumerate(mb.index):
                        if trainer_logprobs is not None and i in trainer_logprobs:
                            t = batch.trajs[i]
                            readout.rows.append((i, old[r, t.prompt_tokens : t.total_tokens]))
            if train.max_grad_norm > 0:
                params = [p for p in policy.parameters() if p.requires_grad]
                norm = torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
                readout.stats.append(("actor/grad_norm", _replicated(norm)))
                if critic is not None:
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), train.max_grad_norm)
            optimizer.step()
            if critic_opt is not None:
                critic_opt.step()
    stats, agree, reported = readout.read()
    if trainer_logprobs is not None:
        trainer_logprobs.update(reported)
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    out["train/skipped_zero_advantage_rows"] = float(skipped)
    out["rollout/logprob_diff_mean"] = world.all_reduce_sum(agree[0]) / max(1.0, world.all_reduce_sum(agree[2]))
    out["rollout/logprob_diff_max"] = world.all_reduce_max(agree[1])
    out["train/microbatch_tokens_max"] = max(stats.get("train/microbatch_tokens", [0]))
    out["train/microbatches"] = float(len(stats.get("train/microbatch_tokens", [])))
    return out


class _Readout:
    """What the update reports, kept on the device while it runs and read on the host once at its end:
    a read per micro-batch would make the host wait for the device every time, and the device then wait
    for the host to queue the next micro-batch."""

    def __init__(self) -> None:
        self.stats: list[tuple[str, torch.Tensor | float]] = []  # (metric, 0-dim tensor or host value), in order
        self.agree: list[torch.Tensor] = []  # `losses.logprob_diff` (3,) of each first-epoch micro-batch
        self.rows: list[tuple[int, torch.Tensor]] = []  # rows of the batch reported, their old log-probs

    def read(self) -> tuple[dict[str, list[float]], list[float], dict[int, list[float]]]:
        """(every metric's values in order; |trainer - engine| log-prob sum, max, count; the reported rows'
        log-probs), from one copy to the host."""
        tensors = [v for _, v in self.stats if isinstance(v, torch.Tensor)] + self.agree + [lp for _, lp in self.rows]
        values = torch.cat([t.detach().float().reshape(-1) for t in tensors]).cpu().tolist() if tensors else []
        at = 0

        def take(k: int) -> list[float]:
            nonlocal at
            at += k
            return values[at - k : at]

        stats: dict[str, list[float]] = {}
        for key, v in self.stats:
            stats.setdefault(key, []).append(take(1)[0] if isinstance(v, torch.Tensor) else v)
        agree = [0.0, 0.0, 0.0]  # sum, max, count, added in the order the micro-batches ran
        for _ in self.agree:
            total, worst, count = take(3)
            agree = [agree[0] + total, max(agree[1], worst), agree[2] + count]
        return stats, agree, {i: take(lp.numel()) for i, lp in self.rows}


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """A sharded result (FSDP's gradient norm is a DTensor) as the plain tensor every rank holds: what `.item()`
    would have read, without reading it."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _microbatch_step(
    algo: AlgoConfig,
    train: TrainConfig,
    policy: nn.Module,
    critic: nn.Module | None,
    mb: MicroBatch,
    weight: float,
    share: bool,
    world: World,
    temperature: float,
) -> tuple[dict[str, torch.Tensor | float], torch.Tensor]:
    """Forward and backward of one micro-batch, its loss scaled by `weight`. Returns its metrics (0-dim tensors
    on the device, read once at the update's end) and the old log-probs it used (B, T), detached. Nothing in it
    reads a value from the device."""
    stats: dict[str, torch.Tensor | float] = {}
    advantages, engine_lp = mb.advantages, mb.rollout_logprobs
    assert advantages is not None and engine_lp is not None, "micro-batches of a scored RolloutBatch carry both"
    with trainer_autocast(train, world):
        logprobs, entropy = update_logprobs(algo, train, policy, mb, temperature, share)
    old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs  # None: on-policy, the update's own forward
    tis = losses.tis_weights(old, engine_lp, mb.loss_mask, algo.tis_cap) if algo.tis_cap > 0 else None
    agg_tokens = float(algo.loss_agg_tokens)
    if algo.policy_loss == "cispo":
        pg_loss, pg_stats = losses.cispo_loss(
            logprobs, old, advantages, mb.loss_mask, algo.clip_ratio_high, algo.loss_agg, tis, agg_tokens
        )
    else:  # ppo_clip and gspo take the same arguments
        clipped = losses.gspo_loss if algo.policy_loss == "gspo" else losses.policy_loss
        pg_loss, pg_stats = clipped(
            logprobs,
            old,
            advantages,
            mb.loss_mask,
            algo.clip_ratio_low,
            algo.clip_ratio_high,
            algo.loss_agg,
            tis,
            agg_tokens,
        )
    if tis is not None:
        stats["actor/tis_weight_mean"] = (tis * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
    loss = pg_loss
    if algo.kl_coef > 0 and algo.kl_type == "low_var_kl":
        assert mb.ref_logprobs is not None, "prepare_batch computes reference log-probs whenever algo.kl_coef > 0"
        kl = losses.aggregate(
            losses.kl_penalty(logprobs, mb.ref_logprobs, "low_var_kl"), mb.loss_mask, algo.loss_agg, agg_tokens
        )
        loss = loss + algo.kl_coef * kl
        stats["actor/kl"] = kl.detach()
    if entropy is not None:
        if algo.entropy_coef > 0:
            ent = losses.aggregate(entropy, mb.loss_mask, algo.loss_agg, agg_tokens)
            loss = loss - algo.entropy_coef * ent
        else:  # a metric only (algo.log_entropy)
            ent = losses.aggregate(entropy.detach(), mb.loss_mask, algo.loss_agg, agg_tokens)
        stats["actor/entropy"] = ent.detach()
    (loss * weight).backward()
    stats["loss/policy"] = pg_loss.detach()
    stats.update({f"actor/{k}": v for k, v in pg_stats.items()})
    if critic is not None:
        assert mb.values is not None and mb.returns is not None, (
            "prepare_batch computes values and returns with a critic"
        )
        with trainer_autocast(train, world):
            values = critic(mb.input_ids, mb.attention_mask)
        v_loss, v_stats = losses.value_loss(
            values, mb.values, mb.returns, mb.loss_mask, algo.value_clip or None, algo.loss_agg, agg_tokens
        )
        (v_loss * weight).backward()
        stats["loss/value"] = v_loss.detach()
        stats.update({f"critic/{k}": v for k, v in v_stats.items()})
    stats["train/microbatch_tokens"] = float(mb.num_tokens)
    return stats, old
