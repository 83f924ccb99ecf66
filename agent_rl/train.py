"""`agent-rl train`: PPO / GRPO over multi-turn retrieval trajectories, one top-down loop.

rollout (n samples per prompt) -> reward -> buffer -> old / reference log-probs, values ->
advantages -> update epochs over token-capped micro-batches -> log -> guard -> checkpoint ->
evaluate. Departures from Search-R1 / verl: token budgets are hard and checked before any
append; observation tokens carry loss mask 0 in every term (policy, KL, entropy, value, GAE);
the update is micro-batched by token count, not by a fixed row count.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agent_rl.learn import advantages as adv_lib
from agent_rl.learn import losses
from agent_rl.rollout.budget import TokenBudget
from agent_rl.learn.batch import collate, pack_microbatches
from agent_rl.rollout.buffer import TrajectoryBuffer
from agent_rl.infra.checkpoint import install_signal_handlers, latest_checkpoint, load_checkpoint, save_checkpoint
from agent_rl.config import Config
from agent_rl.rollout.prompts import PromptSet, load_prompts
from agent_rl.infra.distributed import even_microbatches
from agent_rl.rollout.engines import HFEngine, VLLMEngine, hf_named_weights
from agent_rl.infra.logger import MetricsLogger
from agent_rl.learn.policy import _DTYPES, ValueModel, assert_no_data_parallel, compute_autocast, forward_logprobs, frozen_copy, load_policy, load_tokenizer, reference_mode
from agent_rl.infra.preflight import fix_mmap_threshold, peak_rss_bytes
from agent_rl.rollout.retriever import RetrieverClient
from agent_rl.rollout.rewards import answer_scores, compute_reward
from agent_rl.rollout.loop import AgentLoop, rollout_metrics
from agent_rl.rollout.trajectory import Trajectory


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class PromptStream:
    """Deterministic, resumable order over the training prompts: a seeded shuffle per epoch."""

    size: int
    seed: int
    shuffle: bool
    cursor: int = 0
    _order: list[int] = field(default_factory=list)
    _epoch: int = -1

    def next(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, self.size)
            if epoch != self._epoch:
                self._order = list(range(self.size))
                if self.shuffle:
                    random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            out.append(self._order[pos])
            self.cursor += 1
        return out


def build_engine(cfg: Config, policy, tokenizer, seed: int | None = None, own_copy: bool = False, distributed: bool = False):
    """The rollout engine on `rollout.device`. The HF engine shares the policy module when devices
    match (and `own_copy` is off: under FSDP the engine needs its own unsharded copy); vLLM loads
    the start weights itself (`policy` may be None: build it before the trainer's modules)."""
    seed = cfg.trainer.seed if seed is None else seed
    if cfg.rollout.engine == "vllm":
        from agent_rl.rollout.engines import VLLMEngine

        if distributed and cfg.rollout.tensor_parallel_size > 1:
            raise ValueError("rollout.tensor_parallel_size > 1 under torchrun is not supported yet: each rank runs its own engine (set it to 1)")
        return VLLMEngine(cfg.model.warm_start or cfg.model.path, tokenizer, cfg, seed=seed, distributed=distributed)
    if cfg.rollout.device == cfg.train.device and not own_copy:
        module = policy
    else:
        module = frozen_copy(policy, cfg.rollout.device)
    return HFEngine(module, tokenizer, device=cfg.rollout.device, batch_size=cfg.rollout.generation_batch_size, seed=seed, fast_decode=cfg.rollout.fast_decode)


def sync_weights(engine, policy) -> float:
    """Push updated weights to the rollout engine when it holds its own copy; returns seconds."""
    start = time.perf_counter()
    if isinstance(engine, VLLMEngine):
        engine.load_weights(hf_named_weights(policy))  # LoRA merged under the base names
    elif engine.model is not policy:
        engine.load_weights(policy.state_dict().items())
    return time.perf_counter() - start


def make_scheduler(cfg: Config, optimizer):
    warm, total = cfg.train.warmup_steps, max(1, cfg.trainer.max_steps)

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.train.lr_schedule == "cosine":
            progress = (step - warm) / max(1, total - warm)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def evaluate(loop: AgentLoop, prompts: PromptSet, cfg: Config, temperature: float | None = None, prefix: str = "eval",
             keep: list[Trajectory] | None = None) -> dict[str, float]:
    """Rollouts over the test prompts (greedy by default: rollout.eval_temperature): EM and F1
    overall and per data_source, under `prefix/`. The trajectories are appended to `keep` if given."""
    temperature = cfg.rollout.eval_temperature if temperature is None else temperature
    trajs = loop.run(prompts.items, group_size=1, temperature=temperature)
    if keep is not None:
        keep.extend(trajs)
    by_source: dict[str, list[tuple[float, float]]] = {}
    for t in trajs:
        em = compute_reward("em", t.response_text, t.golden_answers)
        f1 = compute_reward("f1", t.response_text, t.golden_answers)
        by_source.setdefault(t.data_source, []).append((em, f1))
    out: dict[str, float] = {}
    allv = [v for vs in by_source.values() for v in vs]
    out[f"{prefix}/em"] = sum(v[0] for v in allv) / len(allv)
    out[f"{prefix}/f1"] = sum(v[1] for v in allv) / len(allv)
    for src, vs in by_source.items():
        out[f"{prefix}/{src}/em"] = sum(v[0] for v in vs) / len(vs)
        out[f"{prefix}/{src}/f1"] = sum(v[1] for v in vs) / len(vs)
    out[f"{prefix}/searches_mean"] = sum(sum(1 for x in t.turns if x.action == "search") for t in trajs) / len(trajs)
    out[f"{prefix}/n"] = float(len(trajs))
    return out


def evaluate_all(loop: AgentLoop, prompts: PromptSet, cfg: Config) -> dict[str, float]:
    """Greedy EM/F1 under eval/, plus, with trainer.eval_sampled, EM/F1 of one sample at
    rollout.temperature under eval_sampled/ (what GRPO optimises; greedy EM can sit still while
    the sampled policy sharpens)."""
    out = evaluate(loop, prompts, cfg)
    if cfg.trainer.eval_sampled:
        gen = getattr(loop.engine, "generator", None)  # the HF engine's; vLLM keeps its own seed
        state = None
        if gen is not None:
            state = gen.get_state()
            gen.manual_seed(cfg.trainer.seed)  # the same draws at every evaluation
        try:
            out.update(evaluate(loop, prompts, cfg, cfg.rollout.temperature, "eval_sampled"))
        finally:
            if state is not None:
                gen.set_state(state)  # training rollouts (and --resume) never see the eval's draws
    return out


def _rows(values: list[torch.Tensor], index: list[int], width: int) -> torch.Tensor:
    out = torch.zeros((len(index), width), dtype=torch.float32)
    for r, i in enumerate(index):
        out[r, : values[i].numel()] = values[i]
    return out


def prepare_batch(cfg: Config, policy, ref, critic, trajs: list[Trajectory], pad_id: int, need_old: bool, dist=None) -> dict[str, list[torch.Tensor]]:
    """No-grad passes: old log-probs, reference log-probs, values; then advantages and returns.

    Every result is a per-trajectory 1-D tensor over the full sequence (prompt + response).
    With `dist`, every rank runs as many forward passes as the rank with the most micro-batches
    (FSDP all-gathers in each forward); the padding passes are discarded.
    """

    device = cfg.train.device
    n = len(trajs)
    old, refs, vals = [None] * n, [None] * n, [None] * n
    use_ref = cfg.algo.kl_coef > 0
    # k1 in the reward needs the current policy's log-probs even on the single-pass path
    k1_reward = use_ref and cfg.algo.kl_type == "k1" and cfg.algo.name == "ppo"
    cur = [None] * n
    share = _share_prefix(cfg, dist)
    with torch.no_grad(), (compute_autocast(cfg, device) if dist is None else contextlib.nullcontext()):
        for index, real in even_microbatches(_pack(cfg, trajs, range(n), share), dist):
            mb = collate(trajs, index, pad_id, device)
            if need_old or k1_reward:
                lp, _ = forward_logprobs(policy, mb, cfg.rollout.temperature, share_prefix=share)
            if use_ref:
                with reference_mode(policy, ref) as ref_model:
                    rlp, _ = forward_logprobs(ref_model, mb, cfg.rollout.temperature, share_prefix=share)
            if critic is not None:
                v = critic(mb.input_ids, mb.attention_mask)
            if not real:
                continue
            for r, i in enumerate(index):
                L = trajs[i].total_tokens
                if need_old:
                    old[i] = lp[r, :L].float().cpu()
                if k1_reward:
                    cur[i] = lp[r, :L].float().cpu()
                if use_ref:
                    refs[i] = rlp[r, :L].float().cpu()
                if critic is not None:
                    vals[i] = v[r, :L].float().cpu()
    masks = [torch.tensor([0.0] * t.prompt_tokens + [float(m) for m in t.loss_mask]) for t in trajs]
    scores = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    if cfg.algo.name == "grpo":
        # An excluded trajectory (failed search) is its own group of one: advantage 0, and its
        # group's mean and std come from the others.
        keys = [f"{t.prompt_id}#excluded{i}" if t.excluded else t.prompt_id for i, t in enumerate(trajs)]
        a = adv_lib.grpo_advantages(scores, keys, norm_by_std=cfg.algo.norm_adv_by_std)
        advs = [a[i] * masks[i] for i in range(n)]
        rets = [torch.zeros_like(m) for m in masks]
    else:
        width = max(m.numel() for m in masks)
        idx = list(range(n))
        mask_t = _rows(masks, idx, width)
        kl = None
        if k1_reward:
            kl = losses.kl_penalty(_rows(cur, idx, width), _rows(refs, idx, width), "k1")
        token_rewards = adv_lib.token_level_rewards(scores, mask_t, kl, cfg.algo.kl_coef if kl is not None else 0.0)
        a_t, r_t = adv_lib.gae(token_rewards, _rows(vals, idx, width), mask_t, cfg.algo.gamma, cfg.algo.lam)
        a_t = adv_lib.whiten(a_t, mask_t) * mask_t
        advs = [a_t[i, : masks[i].numel()] for i in range(n)]
        rets = [r_t[i, : masks[i].numel()] for i in range(n)]
    return {"old": old, "ref": refs, "values": vals, "advantages": advs, "returns": rets}


def save_trajectories(out_dir: Path, step: int, trajs: list[Trajectory], batch: dict, trainer_logprobs: dict[int, list[float] | None], tokenizer) -> Path:
    """`trainer.save_trajectories_every`: write `OUTPUT_DIR/trajectories/step_N.jsonl` for
    `agent-rl view`: the rows named by `trainer_logprobs` with the step, the trainer's (old)
    log-probs and the advantages of their response tokens, each aligned with `response_ids`.

    The log-probs are the ones the update (or `prepare_batch`) computed, never an extra pass: a
    row the update skipped (advantage 0 on every token) has `trainer_logprobs` null.
    """
    path = out_dir / "trajectories" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i, lp in trainer_logprobs.items():
            t = trajs[i]
            if lp is None and batch["old"][i] is not None:
                lp = batch["old"][i][t.prompt_tokens :].tolist()
            rec = t.to_record(tokenizer)
            rec.update(step=step, trainer_logprobs=lp, advantages=batch["advantages"][i][t.prompt_tokens :].tolist(), **answer_scores(t.response_text, t.golden_answers))
            fh.write(json.dumps(rec) + "\n")
    return path


def _share_prefix(cfg: Config, dist) -> bool:
    """Share a group's prompt in the forward? Not under FSDP (every rank must run the same passes)."""
    return cfg.train.share_prompt_prefix and dist is None and not cfg.model.gradient_checkpointing


def _pack(cfg: Config, trajs: list[Trajectory], members, share: bool) -> list[list[int]]:
    """Micro-batches over `members` (positions in that list), a group's rows together when shared."""
    members = list(members)
    groups = [trajs[i].prompt_id for i in members] if share else None
    return pack_microbatches([trajs[i].total_tokens for i in members], cfg.train.max_tokens_per_microbatch, groups)


def _discard(key: str, value: float) -> None:
    pass


def update(cfg: Config, policy, critic, optimizer, critic_opt, trajs: list[Trajectory], batch: dict, pad_id: int, rng: random.Random, dist=None,
           trainer_logprobs: dict[int, list[float] | None] | None = None) -> dict[str, float]:
    """PPO-style epochs over mini-batches, each accumulated over token-capped micro-batches.

    `trainer_logprobs`, when given, maps rows of `trajs` to be reported (`save_trajectories`);
    the first epoch fills each with that row's old log-probs over its response tokens.

    With `dist` (torchrun + FSDP), `trajs` is this rank's share of whole groups; the loss is
    normalised by the mini-batch's *global* token (or row) count, times the world size because
    FSDP averages gradients over ranks, so N ranks take the same step as one process would.
    """
    device = cfg.train.device
    n = len(trajs)
    world = dist.world_size if dist is not None else 1
    mini = (cfg.algo.mini_batch_size // world if cfg.algo.mini_batch_size else 0) or n
    on_policy = batch["old"][0] is None  # one epoch, one mini-batch: old == current, detached
    share = _share_prefix(cfg, dist)
    stats: dict[str, list[float]] = {}
    agree = [0.0, 0.0, 0.0]  # |trainer - engine| log-prob over sampled tokens: sum, max, count (first epoch)

    def keep(key: str, value: float) -> None:
        stats.setdefault(key, []).append(float(value))

    add = keep

    policy.train()
    autocast = compute_autocast(cfg, device) if dist is None else contextlib.nullcontext()
    # A row whose advantage is 0 on every token adds exactly 0 to the policy gradient (every
    # term of the clipped loss is advantage x ratio) unless a KL, entropy or value loss reads it.
    skip_zero = cfg.train.skip_zero_advantage and critic is None and cfg.algo.entropy_coef == 0 and not (
        cfg.algo.kl_coef > 0 and cfg.algo.kl_type == "low_var_kl")
    skipped = 0
    for epoch in range(cfg.algo.ppo_epochs):
        order = list(range(n))
        rng.shuffle(order)
        for lo in range(0, n, mini):
            members = order[lo : lo + mini]
            sub = [trajs[i] for i in members]
            mask_tokens = float(sum(sum(t.loss_mask) for t in sub))
            rows = float(len(members))
            if dist is not None:
                mask_tokens, rows = dist.all_reduce_sum(mask_tokens) / world, dist.all_reduce_sum(rows) / world
            optimizer.zero_grad(set_to_none=True)
            if critic_opt is not None:
                critic_opt.zero_grad(set_to_none=True)
            if skip_zero:  # kept in the normaliser above, left out of the forward and backward
                # One row still runs when none would: a zero gradient, not a missing one, so AdamW
                # moves (momentum, weight decay) exactly as the plain path, and FSDP ranks stay in step.
                run = [i for i in members if batch["advantages"][i].any()] or members[:1]
                skipped += len(members) - len(run)
                members = run
            for local, real in even_microbatches(_pack(cfg, trajs, members, share), dist):
                index = [members[j] for j in local]
                mb = collate(trajs, index, pad_id, device)
                width = mb.input_ids.shape[1]
                mb_tokens = float(mb.loss_mask.sum())
                weight = mb_tokens / max(1.0, mask_tokens) if cfg.algo.loss_agg == "token-mean" else len(index) / rows
                if not real:  # FSDP padding pass: same collectives, zero gradient, no metrics
                    weight = 0.0
                    add = _discard
                with autocast:
                    logprobs, entropy = forward_logprobs(policy, mb, cfg.rollout.temperature, with_entropy=cfg.algo.entropy_coef > 0, share_prefix=share)
                old = logprobs.detach() if on_policy else _rows(batch["old"], index, width).to(device)
                if epoch == 0 and real:  # old = the weights the engine sampled with
                    total, worst, count = losses.logprob_diff(old, mb.rollout_logprobs, mb.loss_mask)
                    agree[0], agree[1], agree[2] = agree[0] + total, max(agree[1], worst), agree[2] + count
                    for r, i in enumerate(index):
                        if trainer_logprobs is not None and i in trainer_logprobs:
                            trainer_logprobs[i] = old[r, trajs[i].prompt_tokens : trajs[i].total_tokens].float().cpu().tolist()
                tis = losses.tis_weights(old, mb.rollout_logprobs, mb.loss_mask, cfg.algo.tis_cap) if cfg.algo.tis_cap > 0 else None
                advantages = _rows(batch["advantages"], index, width).to(device)
                pg_loss, pg_stats = losses.policy_loss(
                    logprobs, old, advantages, mb.loss_mask, cfg.algo.clip_ratio_low, cfg.algo.clip_ratio_high, cfg.algo.loss_agg, is_weights=tis
                )
                if tis is not None:
                    add("actor/tis_weight_mean", float((tis * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)))
                loss = pg_loss
                if cfg.algo.kl_coef > 0 and cfg.algo.kl_type == "low_var_kl":
                    ref_lp = _rows(batch["ref"], index, width).to(device)
                    kl = losses.aggregate(losses.kl_penalty(logprobs, ref_lp, "low_var_kl"), mb.loss_mask, cfg.algo.loss_agg)
                    loss = loss + cfg.algo.kl_coef * kl
                    add("actor/kl", kl.item())
                if entropy is not None:
                    ent = losses.aggregate(entropy, mb.loss_mask, cfg.algo.loss_agg)
                    loss = loss - cfg.algo.entropy_coef * ent
                    add("actor/entropy", ent.item())
                (loss * weight).backward()
                add("loss/policy", pg_loss.item())
                for k, v in pg_stats.items():
                    add(f"actor/{k}", v)
                if critic is not None:
                    with autocast:
                        values = critic(mb.input_ids, mb.attention_mask)
                    old_values = _rows(batch["values"], index, width).to(device)
                    returns = _rows(batch["returns"], index, width).to(device)
                    v_loss, v_stats = losses.value_loss(values, old_values, returns, mb.loss_mask, cfg.algo.value_clip or None, cfg.algo.loss_agg)
                    (v_loss * weight).backward()
                    add("loss/value", v_loss.item())
                    for k, v in v_stats.items():
                        add(f"critic/{k}", v)
                add("train/microbatch_tokens", mb.num_tokens)
                add = keep
            if cfg.train.max_grad_norm > 0:
                add("actor/grad_norm", torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], cfg.train.max_grad_norm).item())
                if critic is not None:
                    torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.train.max_grad_norm)
            optimizer.step()
            if critic_opt is not None:
                critic_opt.step()
    out = {k: sum(v) / len(v) for k, v in stats.items()}
    out["train/skipped_zero_advantage_rows"] = float(skipped)
    if dist is not None:
        agree = [dist.all_reduce_sum(agree[0]), dist.all_reduce_max(agree[1]), dist.all_reduce_sum(agree[2])]
    out["rollout/logprob_diff_mean"] = agree[0] / max(1.0, agree[2])
    out["rollout/logprob_diff_max"] = agree[1]
    out["train/microbatch_tokens_max"] = max(stats.get("train/microbatch_tokens", [0]))
    out["train/microbatches"] = float(len(stats.get("train/microbatch_tokens", [])))
    return out


def train(cfg: Config, resume: bool = False) -> dict[str, float]:
    """Run the whole training job; returns the last evaluation metrics.

    Under torchrun (`torchrun --nproc-per-node N -m agent_rl.train CONFIG`) every rank runs this
    same loop on its share of each step's prompts; see `agent_rl.infra.distributed`.
    """
    from contextlib import nullcontext

    from agent_rl.infra import distributed as dist_lib
    from agent_rl.infra.prepare import local_retriever, prepare

    dist = dist_lib.init_distributed(cfg)
    main = dist is None or dist.is_main
    # Same seed everywhere for data order and model init; each rank samples its own rollouts.
    seed_everything(cfg.trainer.seed)
    fix_mmap_threshold(cfg.train.host_mmap_threshold_mib)
    out_dir = Path(cfg.trainer.output_dir)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        prepare(cfg)
        if cfg.model.warm_start and not Path(cfg.model.warm_start).exists():
            from agent_rl.sft import sft

            print(f"[train] warm start {cfg.model.warm_start} is missing: running `agent-rl sft` first", file=sys.stderr)
            sft(cfg)
    if dist is not None:
        dist.barrier()  # rank 0 built whatever was missing (toy world, model, index, warm start)
    start_path = cfg.model.warm_start or cfg.model.path
    tokenizer = load_tokenizer(start_path)
    pad_id = tokenizer.pad_token_id
    engine_seed = cfg.trainer.seed + (dist.rank if dist is not None else 0)
    # vLLM first, before the trainer's modules take device memory (its reservation is a fraction of what is free).
    engine = build_engine(cfg, None, tokenizer, seed=engine_seed, distributed=dist is not None) if cfg.rollout.engine == "vllm" else None
    policy = load_policy(cfg, start_path, cfg.train.device)
    ref = frozen_copy(policy, cfg.train.device, _DTYPES[cfg.model.dtype]) if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled else None
    critic = ValueModel(frozen_copy(policy, cfg.train.device)).to(cfg.train.device) if cfg.algo.name == "ppo" else None
    if critic is not None:
        for p in critic.parameters():
            p.requires_grad_(True)
    assert_no_data_parallel(policy, ref, critic)
    if dist is not None:
        if cfg.model.lora.enabled:
            raise ValueError("model.lora.enabled under torchrun is not supported yet: train LoRA in one process, or full weights with FSDP")
        # The HF engine generates with its own unsharded copy: ranks sample different lengths,
        # and a sharded forward would wait on the other ranks' all-gathers.
        if engine is None:
            engine = build_engine(cfg, policy, tokenizer, seed=engine_seed, own_copy=True)
        for module in (policy, ref, critic):
            if module is not None:
                dist_lib.shard_model(module, dist, cfg)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
    if cfg.train.offload_optimizer and not cfg.train.device.startswith("cuda"):
        print("[train] train.offload_optimizer: the optimizer state already lives in host RAM on a CPU run; nothing to offload", file=sys.stderr)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.algo.critic_lr) if critic is not None else None
    scheduler = make_scheduler(cfg, optimizer)
    budget = TokenBudget.from_config(cfg.budget)
    train_set = load_prompts(cfg.data.train_files, tokenizer, budget)
    test_set = load_prompts(cfg.data.test_files, tokenizer, budget, cfg.trainer.eval_max_samples) if cfg.data.test_files else None
    stream = PromptStream(len(train_set.items), cfg.trainer.seed, cfg.data.shuffle)
    if engine is None:
        engine = build_engine(cfg, policy, tokenizer, seed=engine_seed)
    buffer = TrajectoryBuffer(cfg.buffer.max_tokens, cfg.buffer.max_trajectories)
    logger = MetricsLogger(out_dir, cfg.trainer.tensorboard, enabled=main)  # only rank 0 writes
    ckpt_root = out_dir / "checkpoints"
    update_rng = random.Random(cfg.trainer.seed)
    step = 0

    def push_weights() -> float:
        return dist_lib.sync_rollout_weights(engine, policy) if dist is not None else sync_weights(engine, policy)

    def restore(path: Path) -> None:
        nonlocal step
        if dist is not None or (path / "dcp").is_dir():
            extra = dist_lib.load_sharded(path, policy, optimizer, dist, scheduler, critic, critic_opt)
        else:
            extra = load_checkpoint(path, policy, optimizer, scheduler)
            if critic is not None:
                critic.load_state_dict(extra["critic"])
                critic_opt.load_state_dict(extra["critic_opt"])
        step, stream.cursor = int(extra["step"]), int(extra["cursor"])
        if hasattr(engine, "generator") and "engine_rng" in extra:
            engine.generator.set_state(extra["engine_rng"])
        update_rng.setstate(extra["update_rng"])
        push_weights()

    if resume:
        path = latest_checkpoint(ckpt_root)
        if dist is not None:
            path = dist.broadcast_object(path)  # every rank restores the same step
        if path is None:
            print(f"[train] --resume: no checkpoint under {ckpt_root}; starting from step 0", file=sys.stderr)
        else:
            restore(path)
            logger.truncate_after(step)
            print(f"[train] resumed from {path} at step {step}", file=sys.stderr)

    def checkpoint() -> Path:
        extra = {"step": step, "cursor": stream.cursor, "update_rng": update_rng.getstate()}
        if hasattr(engine, "generator"):
            extra["engine_rng"] = engine.generator.get_state()
        if dist is not None:
            return dist_lib.save_sharded(ckpt_root, step, policy, optimizer, dist, scheduler, extra, cfg.to_dict(), cfg.trainer.keep_last, export_hf=True, critic=critic, critic_optimizer=critic_opt)
        if critic is not None:
            extra["critic"] = critic.state_dict()
            extra["critic_opt"] = critic_opt.state_dict()
        return save_checkpoint(ckpt_root, step, policy, optimizer, scheduler, extra, cfg.to_dict(), cfg.trainer.keep_last)

    def run_eval() -> dict[str, float]:
        # Rank 0 evaluates with its own unsharded rollout model (no collectives); the rest wait.
        result = evaluate_all(loop, test_set, cfg) if main else {}
        if dist is not None:
            dist.barrier()
        return result

    if cfg.trainer.preflight and step == 0:
        from agent_rl.infra.preflight import run_preflight

        report = run_preflight(policy, cfg, cfg.train.device)
        print(f"[train] preflight at the largest admissible micro-batch passed: {report}", file=sys.stderr)

    from agent_rl.infra.guard import CollapseGuard

    guard = CollapseGuard(cfg.guard)
    stop = install_signal_handlers()
    last_eval: dict[str, float] = {}
    with local_retriever(cfg) if main else nullcontext(None) as url:
        if dist is not None:
            url = dist.broadcast_object(url)  # the server rank 0 started, or retriever.url
        client = RetrieverClient.from_config(cfg.retriever, url)
        loop = AgentLoop(engine, tokenizer, client, budget, cfg.retriever.topk, cfg.rollout.mode, cfg.rollout.max_inflight)
        if test_set is not None and step == 0:
            last_eval = run_eval()
            logger.log(0, last_eval)
            logger.progress(0, cfg.trainer.max_steps, last_eval)
        def retriever_ok(counters) -> bool:
            """Too many of this step's searches failed: wait for /health (rank 0; all ranks agree)."""
            searched, errors = counters["retriever/queries"], counters["retriever/errors"]
            bad = float(searched > 0 and errors / searched > cfg.retriever.max_failed_share)
            if dist is not None:
                bad = dist.all_reduce_max(bad)
            if not bad:
                return True
            back = 1.0
            if main:
                print(f"[train] step {step}: {int(errors)} of {int(searched)} searches failed; waiting for {client.url}/health", file=sys.stderr)
                back = float(client.wait_healthy(cfg.retriever.health_wait_s, log=lambda m: print(f"[train] {m}", file=sys.stderr)))
            if dist is not None:
                back = dist.all_reduce_max(back if main else 0.0)
            return back > 0

        def stopping() -> bool:  # ranks must leave the loop together
            flag = float(stop.is_set())
            return (dist.all_reduce_max(flag) if dist is not None else flag) > 0

        while step < cfg.trainer.max_steps and not stopping():
            step += 1
            t0 = time.perf_counter()
            # 1. rollout: n samples per prompt (this rank's share of whole groups), budgets enforced inside the loop
            resume_point = (stream.cursor, engine.generator.get_state())  # for a checkpoint of this step's start
            picked = [train_set.items[i] for i in stream.next(cfg.rollout.prompts_per_step)]
            if dist is not None:
                picked = dist_lib.split_groups(picked, dist.rank, dist.world_size)
            loop.counters.clear()
            gen_before = engine.stats["generated_tokens"]
            trajs = loop.run(picked, cfg.algo.group_size, cfg.rollout.temperature, cfg.rollout.top_p)
            t_rollout = time.perf_counter() - t0
            # 2. reward on the last <answer> of the response only
            for t in trajs:
                t.reward = compute_reward(cfg.reward.name, t.response_text, t.golden_answers, cfg.reward.format_coef)
            # 3. buffer: whole groups, bounded by tokens
            for g in range(0, len(trajs), cfg.algo.group_size):
                buffer.add_group(trajs[g : g + cfg.algo.group_size])
            trajs = buffer.drain()
            rollout_m = rollout_metrics(trajs, loop.counters)  # before any exclusion zeroes a mask
            # 3b. a dead retriever: wait for it, or checkpoint this step's start and exit
            if not retriever_ok(loop.counters):
                step, (stream.cursor, rng) = step - 1, resume_point
                engine.generator.set_state(rng)
                path = checkpoint()
                logger.close()
                if dist is not None:
                    dist.close()
                raise SystemExit(
                    f"retriever at {client.url} failed {int(loop.counters['retriever/errors'])} of {int(loop.counters['retriever/queries'])} searches "
                    f"at step {step + 1} and did not answer /health within retriever.health_wait_s={cfg.retriever.health_wait_s:g} s. "
                    f"Saved {path}; start the server again and rerun with --resume."
                )
            failed = [t for t in trajs if t.retrieval_failed]
            if cfg.retriever.exclude_failed:
                for t in failed:
                    t.excluded = True
                    t.loss_mask = [0] * len(t.loss_mask)
            # 4. old / reference log-probs, values, advantages (the engine sleeps where it can: weights offloaded, KV freed)
            engine.sleep()
            t1 = time.perf_counter()
            world = dist.world_size if dist is not None else 1
            single_pass = cfg.algo.ppo_epochs == 1 and (cfg.algo.mini_batch_size == 0 or cfg.algo.mini_batch_size // world >= len(trajs))
            batch = prepare_batch(cfg, policy, ref, critic, trajs, pad_id, need_old=not single_pass, dist=dist)
            # this step's first rows (this rank's share under torchrun), reported with the update's log-probs
            report = None
            if cfg.trainer.save_trajectories_every and step % cfg.trainer.save_trajectories_every == 0:
                report = dict.fromkeys(range(min(len(trajs), cfg.trainer.save_trajectories_per_step)))
            # 5. update
            t2 = time.perf_counter()
            upd = update(cfg, policy, critic, optimizer, critic_opt, trajs, batch, pad_id, update_rng, dist=dist, trainer_logprobs=report)
            scheduler.step()
            sync_s = push_weights()
            t3 = time.perf_counter()
            if report and main:
                save_trajectories(out_dir, step, trajs, batch, report, tokenizer)
            # 6. log
            rewards = [t.reward for t in trajs]
            gen_tokens = engine.stats["generated_tokens"] - gen_before
            train_tokens = sum(t.total_tokens for t in trajs)
            metrics = {
                **rollout_m,
                **{k: float(v) for k, v in buffer.counters.items()},
                **{f"retriever/total_{k}": float(v) for k, v in client.stats.items()},  # cumulative; retriever/queries|errors are this step's
                "retriever/failed_trajectories": float(len(failed)),
                "train/excluded_trajectories": float(sum(t.excluded for t in trajs)),
                **upd,
                "reward/mean": sum(rewards) / max(1, len(rewards)),
                "reward/max": max(rewards, default=0.0),
                "train/lr": scheduler.get_last_lr()[0],
                "timing/rollout_s": t_rollout,
                "timing/prepare_s": t2 - t1,
                "timing/update_s": t3 - t2,
                "timing/weight_sync": sync_s,
                "timing/step_s": t3 - t0,
                "timing/gen_tokens_per_s": gen_tokens / max(1e-9, t_rollout),
                "timing/tokens_per_s": train_tokens / max(1e-9, t3 - t1),
                "memory/peak_rss_gib": peak_rss_bytes() / 2**30,
            }
            if torch.cuda.is_available() and cfg.train.device.startswith("cuda"):
                metrics["memory/gpu_peak_gib"] = torch.cuda.max_memory_allocated(cfg.train.device) / 2**30
            if dist is not None:
                metrics = dist.reduce_metrics(metrics)  # identical on every rank, so the guard agrees
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and test_set is not None and step < cfg.trainer.max_steps:
                last_eval = run_eval()
                metrics.update(last_eval)
            logger.log(step, metrics)
            if step % cfg.trainer.log_every == 0:
                logger.progress(step, cfg.trainer.max_steps, metrics)
            # 7. collapse guard
            decision = guard.observe(step, metrics)
            if decision.action != "none":
                print(f"[guard] step {step}: {decision.action}: {decision.message}", file=sys.stderr)
                logger.log(step, {f"guard/{decision.action}": 1.0})
            if decision.action == "stop":
                checkpoint()
                logger.close()
                if dist is not None:
                    dist.close()
                raise SystemExit(f"collapse guard stopped the run at step {step}: {decision.message}")
            if decision.action == "rollback":
                path = latest_checkpoint(ckpt_root)
                if dist is not None:
                    path = dist.broadcast_object(path)
                # Lower the scheduler's base rates, not just the live ones: LambdaLR recomputes
                # lr from base_lrs at every step (and the restore brings back the old ones).
                base_lrs = [lr * cfg.guard.lr_factor for lr in scheduler.base_lrs]
                if path is not None:
                    restore(path)
                scheduler.base_lrs = base_lrs
                for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
                    group["lr"] = base * factor(scheduler.last_epoch)
                cfg.algo.kl_coef = cfg.algo.kl_coef * cfg.guard.kl_factor if cfg.algo.kl_coef > 0 else cfg.algo.kl_coef
                continue
            # 8. checkpoint
            if step % cfg.trainer.save_every == 0 or step == cfg.trainer.max_steps:
                checkpoint()
        if stop.is_set():
            print(f"[train] signal received: saving step {step} and exiting", file=sys.stderr)
            checkpoint()
        elif test_set is not None:
            last_eval = run_eval()
            logger.log(step, last_eval)
            logger.progress(step, cfg.trainer.max_steps, last_eval)
        client.close()
    logger.close()
    if dist is not None:
        dist.close()
    return last_eval

