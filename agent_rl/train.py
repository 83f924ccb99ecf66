"""`agent-rl train`: PPO / GRPO over multi-turn retrieval trajectories, one top-down loop.

rollout (n samples per prompt) -> reward -> buffer -> old / reference log-probs, values ->
advantages -> update epochs over token-capped micro-batches -> log -> guard -> checkpoint ->
evaluate. Departures from Search-R1 / verl: token budgets are hard and checked before any
append; observation tokens carry loss mask 0 in every term (policy, KL, entropy, value, GAE);
the update is micro-batched by token count, not by a fixed row count.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from agent_rl.bootstrap.prepare import prepare
from agent_rl.config import Config, TrainConfig
from agent_rl.guard.collapse import CollapseGuard
from agent_rl.guard.signals import ReplaySet
from agent_rl.learn.batch import RolloutBatch
from agent_rl.learn.policy import _DTYPES, ValueModel, assert_no_data_parallel, frozen_copy, load_policy
from agent_rl.learn.update import adamw, minibatch_plan, prepare_batch, update
from agent_rl.planning.preflight import run_preflight
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.buffer import TrajectoryBuffer
from agent_rl.rollout.engines import EngineSpec, build_engine
from agent_rl.rollout.loop import AgentLoop, rollout_metrics
from agent_rl.rollout.prompts import load_prompts, load_tokenizer
from agent_rl.rollout.rewards import Reward, answer_scores, em
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.run import PromptStream, Run, open_loop
from agent_rl.runtime import allocator
from agent_rl.runtime import distributed as dist_lib
from agent_rl.runtime.checkpoint import checkpoints, discard, install_signal_handlers
from agent_rl.runtime.logger import MetricsLogger
from agent_rl.runtime.memory import peak_rss_bytes, proc_status_bytes
from agent_rl.sft import train_sft
from retriever_server.client import RetrieverClient


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch; with `deterministic` (run.deterministic) also switch torch to its
    deterministic kernels for the rest of the process (never switched back off here)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS reads it when its first handle is made, after this; a CPU run never reads it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.mkldnn.deterministic = True  # type: ignore[assignment]  # a ContextProp setter


def make_scheduler(train: TrainConfig, max_steps: int, optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """train.lr_schedule over run.max_steps (`max_steps`), after train.warmup_steps of linear warmup."""
    warm, total = train.warmup_steps, max(1, max_steps)

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if train.lr_schedule == "cosine":
            progress = (step - warm) / max(1, total - warm)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def save_trajectories(
    out_dir: Path, step: int, batch: RolloutBatch, trainer_logprobs: dict[int, list[float] | None], tokenizer
) -> Path:
    """`run.save_trajectories_every`: write `OUTPUT_DIR/trajectories/step_N.jsonl` for
    `agent-rl view`: the rows named by `trainer_logprobs` with the step, the trainer's (old)
    log-probs and the advantages of their response tokens, each aligned with `response_ids`.

    The log-probs are the ones the update (or `prepare_batch`) computed, never an extra pass: a
    row the update skipped (advantage 0 on every token) has `trainer_logprobs` null.
    """
    assert batch.advantages is not None, "a scored batch (prepare_batch)"
    path = out_dir / "trajectories" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i, lp in trainer_logprobs.items():
            t = batch.trajs[i]
            span = slice(t.prompt_tokens, t.total_tokens)
            if lp is None and batch.old_logprobs is not None:
                lp = batch.old_logprobs[i, span].tolist()
            rec = t.to_record(tokenizer)
            rec.update(
                step=step,
                trainer_logprobs=lp,
                advantages=batch.advantages[i, span].tolist(),
                **answer_scores(t.response_text, t.golden_answers),
            )
            fh.write(json.dumps(rec) + "\n")
    return path


def fresh_start(ckpt_root: Path, overwrite: bool, main: bool) -> None:
    """A run from step 0 in a folder that holds an earlier run's checkpoints: with `overwrite` (run.overwrite)
    rank 0 deletes them; otherwise every rank refuses to start, naming the ways on."""
    earlier = checkpoints(ckpt_root)
    if not earlier:
        return
    names = ", ".join(p.name for p in earlier)
    if not overwrite:
        raise FileExistsError(
            f"{ckpt_root} holds an earlier run's checkpoints ({names}); a new run there would mix its steps with "
            "them. Continue that run with --resume, start afresh over them with run.overwrite=true (deletes them), "
            "or set another run.output_dir"
        )
    if main:
        print(f"[train] run.overwrite: deleting the earlier run's checkpoints {names} in {ckpt_root}", file=sys.stderr)
        for path in earlier:
            discard(path)


def setup(cfg: Config, resume: bool = False) -> Run:
    """Build a run: ranks, first-use preparation, engine, models, optimizers, data, logs."""
    cfg = copy.deepcopy(
        cfg
    )  # the run may rewrite devices (torchrun) and, on rollback, the KL; the caller's config stays as given
    out_dir = Path(cfg.run.output_dir)
    world = dist_lib.init_distributed(cfg)
    # Same seed everywhere for data order and model init; each rank samples its own rollouts.
    seed_everything(cfg.run.seed, cfg.run.deterministic)
    host_allocator = allocator.setup(allocator.mmap_threshold_mib(cfg.train, cfg.rollout))
    if not resume:
        fresh_start(out_dir / "checkpoints", cfg.run.overwrite, world.is_main)
    world.barrier()  # rank 0 deleted what run.overwrite deletes before any rank reads the folder again
    if world.is_main:
        print(f"[train] host allocator: {host_allocator}", file=sys.stderr)
        out_dir.mkdir(parents=True, exist_ok=True)
        prepare(cfg)
        if cfg.model.warm_start and not Path(cfg.model.warm_start).exists():
            print(
                f"[train] warm start {cfg.model.warm_start} is missing: running `agent-rl sft` first", file=sys.stderr
            )
            train_sft(cfg)  # prepared above, under the allocator set above
    world.barrier()  # rank 0 built whatever was missing (toy world, model, index, warm start)
    start_path = cfg.model.warm_start or cfg.model.path
    tokenizer = load_tokenizer(start_path)
    engine_seed = cfg.run.seed + world.rank
    spec = EngineSpec.from_config(cfg)  # after init_distributed placed rollout.device on this rank's device
    # vLLM first, before the trainer's modules take device memory (its reservation is a fraction of what is free).
    engine = (
        build_engine(spec, None, tokenizer, seed=engine_seed, distributed=world.sharded)
        if spec.engine == "vllm"
        else None
    )
    policy = load_policy(cfg.model, start_path, cfg.train.device)
    ref = (
        frozen_copy(policy, cfg.train.device, _DTYPES[cfg.model.dtype])
        if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled
        else None
    )
    critic = ValueModel(frozen_copy(policy, cfg.train.device)).to(cfg.train.device) if cfg.algo.name == "ppo" else None
    if critic is not None:
        for p in critic.parameters():
            p.requires_grad_(True)
    assert_no_data_parallel(policy, ref, critic)
    if isinstance(world, dist_lib.DistInfo):  # torchrun: FSDP2 over the ranks
        if cfg.model.lora.enabled:
            raise ValueError(
                "model.lora.enabled under torchrun is not supported yet: train LoRA in one process, or full weights "
                "with FSDP"
            )
        # The HF engine generates with its own unsharded copy: ranks sample different lengths,
        # and a sharded forward would wait on the other ranks' all-gathers.
        engine = engine or build_engine(spec, policy, tokenizer, seed=engine_seed, own_copy=True)
        for module in (policy, ref, critic):
            if module is not None:
                dist_lib.shard_model(module, world, cfg.train)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = adamw(trainable, cfg.train.lr, cfg.train.betas, cfg.train.weight_decay)
    if cfg.train.offload_optimizer and not cfg.train.device.startswith("cuda"):
        print(
            "[train] train.offload_optimizer: the optimizer state already lives in host RAM on a CPU run; nothing to "
            "offload",
            file=sys.stderr,
        )
    budget = TokenBudget.from_config(cfg.budget)
    train_set = load_prompts(cfg.data.train_files, tokenizer, budget)
    run = Run(
        cfg=cfg,
        world=world,
        out_dir=out_dir,
        tokenizer=tokenizer,
        engine=engine or build_engine(spec, policy, tokenizer, seed=engine_seed),
        policy=policy,
        ref=ref,
        critic=critic,
        optimizer=optimizer,
        critic_opt=adamw(critic.parameters(), cfg.algo.critic_lr) if critic is not None else None,
        scheduler=make_scheduler(cfg.train, cfg.run.max_steps, optimizer),
        budget=budget,
        train_set=train_set,
        test_set=load_prompts(cfg.data.test_files, tokenizer, budget, cfg.run.eval_max_samples)
        if cfg.data.test_files
        else None,
        stream=PromptStream(len(train_set.items), cfg.run.seed, cfg.data.shuffle),
        buffer=TrajectoryBuffer(cfg.buffer.max_tokens, cfg.buffer.max_trajectories),
        logger=MetricsLogger.from_config(cfg, enabled=world.is_main, resume=resume),  # only rank 0 writes
        guard=CollapseGuard(cfg.guard),
        replay=ReplaySet(cfg.guard.replay_size) if cfg.guard.replay_size > 0 else None,
        stop=install_signal_handlers(),
        update_rng=random.Random(cfg.run.seed),
    )
    try:
        if resume:
            run.resume()
        if cfg.run.preflight and run.step == 0:
            report = run_preflight(policy, cfg, cfg.train.device, optimizer)
            print(f"[train] preflight at the largest admissible micro-batch passed: {report}", file=sys.stderr)
    except BaseException:
        run.logger.close(failed=True)  # the W&B run marked failed, not left open
        raise
    return run


def informative(group: list[Trajectory], exclude_failed: bool) -> bool:
    """Whether a group's rewards differ (dynamic sampling keeps it): over the rows the update trains on, so a
    row whose search failed (retriever.exclude_failed takes it out of the loss and of its group's statistics)
    cannot make a group of otherwise equal rewards look informative."""
    return len({t.reward for t in group if not (exclude_failed and t.retrieval_failed)}) > 1


def sample_groups(run: Run, loop: AgentLoop, reward: Reward) -> tuple[list[Trajectory], list[list[Trajectory]], dict]:
    """This step's rollout, rewarded: (every sampled trajectory, the groups the update trains on, metrics).

    Without algo.filter_groups that is one batch of rollout.prompts_per_step prompts, every group kept.
    With it (DAPO's dynamic sampling), groups whose rewards are all equal are dropped and further
    batches are sampled until each rank holds its share of rollout.prompts_per_step groups or
    algo.max_gen_batches batches are spent; the ranks agree on every further batch (one all-reduce), so
    they stay in step. The prompt stream moves on by every batch sampled."""
    cfg, world = run.cfg, run.world
    n = cfg.algo.group_size
    sampled: list[Trajectory] = []
    kept: list[list[Trajectory]] = []
    batches = 0
    while True:
        picked = [run.train_set.items[i] for i in run.stream.next(cfg.rollout.prompts_per_step)]
        picked = dist_lib.split_groups(picked, world.rank, world.world_size)
        target = len(picked)  # this rank's share, the same in every batch
        trajs = loop.run(picked, n, cfg.rollout.temperature, cfg.rollout.top_p)
        batches += 1
        for t in trajs:
            t.reward = reward(t)
        sampled += trajs
        groups = [trajs[g : g + n] for g in range(0, len(trajs), n)]
        last = groups
        if cfg.algo.filter_groups:
            groups = [g for g in groups if informative(g, cfg.retriever.exclude_failed)]
        kept += groups[: target - len(kept)]
        if not cfg.algo.filter_groups or batches >= cfg.algo.max_gen_batches:
            break
        if world.all_reduce_sum(float(target - len(kept))) == 0:
            break
    metrics = {}
    if cfg.algo.filter_groups:
        metrics = {"rollout/gen_batches": float(batches), "rollout/kept_groups": float(len(kept))}
    if not kept:  # no group's rewards differed in any batch: the last one goes through (a step of zero advantages)
        kept = last
    return sampled, kept, metrics


def step_metrics(
    run: Run,
    sampled: list[Trajectory],
    trajs: list[Trajectory],
    rollout_m: dict,
    client: RetrieverClient,
    upd: dict,
    times: dict[str, float],
    gen_tokens: int,
) -> dict[str, float]:
    """One step's metrics, reduced over ranks (identical on every rank, so the guard agrees). `sampled`
    is every trajectory the step generated, `trajs` those the update trained on."""
    rewards = [t.reward for t in sampled]
    t0, t1, t2, t3 = times["start"], times["rollout"], times["prepared"], times["updated"]
    metrics = {
        **rollout_m,
        **{k: float(v) for k, v in run.buffer.counters.items()},
        **{
            f"retriever/total_{k}": float(v) for k, v in client.stats.items()
        },  # cumulative; retriever/queries|errors are this step's
        "retriever/failed_trajectories": float(sum(t.retrieval_failed for t in sampled)),
        "train/excluded_trajectories": float(sum(t.excluded for t in trajs)),
        **upd,
        "reward/mean": sum(rewards) / max(1, len(rewards)),
        "reward/max": max(rewards, default=0.0),
        # the samples' EM whatever reward.fn is: with process terms or weights, reward/mean is not the task's score
        "reward/em": sum(em(t, t.golden_answers) for t in sampled) / max(1, len(sampled)),
        "train/lr": run.scheduler.get_last_lr()[0],
        "timing/rollout_s": t1 - t0,
        "timing/prepare_s": t2 - t1,
        "timing/update_s": t3 - t2,
        "timing/weight_sync": times["sync_s"],
        "timing/step_s": t3 - t0,
        "timing/gen_tokens_per_s": gen_tokens / max(1e-9, t1 - t0),
        "timing/tokens_per_s": sum(t.total_tokens for t in trajs) / max(1e-9, t3 - t1),
        "memory/peak_rss_gib": peak_rss_bytes() / 2**30,
        # Resident now, at the step's end: a peak can only rise, so host memory kept from step to step shows here.
        "memory/rss_gib": (proc_status_bytes("VmRSS") or 0) / 2**30,
    }
    if torch.cuda.is_available() and run.cfg.train.device.startswith("cuda"):
        metrics["memory/gpu_peak_gib"] = torch.cuda.max_memory_allocated(run.cfg.train.device) / 2**30
    return run.world.reduce_metrics(metrics)


def learn_step(run: Run, trajs: list[Trajectory], times: dict) -> tuple[RolloutBatch, dict, dict | None, dict]:
    """Steps 4 and 5 of a training step: old and reference log-probs, values and advantages (the engine asleep),
    the update, the update signal and the weights pushed to the engine; `times` gets the phases' ends. Returns the
    batch, the update's metrics, the rows asked for with their log-probs, and the update signal."""
    cfg, world, engine = run.cfg, run.world, run.engine
    # 4. old / reference log-probs, values, advantages (the engine sleeps where it can: weights offloaded, KV
    # freed)
    engine.sleep(discard_weights=True)  # the weight sync after the update rewrites every weight
    allocator.release()  # the rollout's freed memory back to the system before the update's
    single_pass = cfg.algo.ppo_epochs == 1 and minibatch_plan(cfg.algo, len(trajs), world)[1] == 1
    batch = prepare_batch(
        cfg.algo,
        cfg.train,
        run.policy,
        run.ref,
        run.critic,
        trajs,
        run.tokenizer.pad_token_id,
        need_old=not single_pass,
        world=world,
        temperature=cfg.rollout.temperature,
    )
    times["prepared"] = time.perf_counter()
    # 5. update; the rows to save and the guard's rewarded rows reported with the update's log-probs
    report, signal_rows = run.asked_rows(trajs, batch)
    start = time.perf_counter()
    before = run.signal_logprobs(batch, signal_rows)
    signal_s = time.perf_counter() - start
    upd = update(
        cfg.algo,
        cfg.train,
        run.policy,
        run.critic,
        run.optimizer,
        run.critic_opt,
        batch,
        run.update_rng,
        world=world,
        trainer_logprobs=report,
        temperature=cfg.rollout.temperature,
    )
    # The gradients are spent: freed now, they are not resident across the weight sync, the
    # engine's wake and the rollout (the next update's zero_grad would free them only then).
    run.optimizer.zero_grad(set_to_none=True)
    if run.critic_opt is not None:
        run.critic_opt.zero_grad(set_to_none=True)
    run.scheduler.step()
    update_signal = run.update_signal(batch, before, signal_s)
    times["sync_s"] = run.push_weights()
    allocator.release()  # the update's activations, kept for reuse within it, back to the system
    times["updated"] = time.perf_counter()
    return batch, upd, report, update_signal


def train(cfg: Config, resume: bool = False) -> dict[str, float]:
    """Run the whole training job; returns the last evaluation metrics.

    Under torchrun (`torchrun --nproc-per-node N -m agent_rl train CONFIG`) every rank runs this
    same loop on its share of each step's prompts; one process is a world of one.
    """
    run = setup(cfg, resume)
    cfg, world, engine = run.cfg, run.world, run.engine
    last_eval: dict[str, float] = {}
    # The logger closes at the block's end, and as failed (W&B) when an exception leaves it.
    with open_loop(cfg, engine, run.tokenizer, world, run.budget) as loop, run.logger:
        client = loop.client
        assert client is not None  # open_loop's
        reward = Reward(cfg.reward)  # reward.fn: built-ins or the user's functions
        for prompts in (run.train_set, run.test_set):  # what the tools' note pushes past the prompt budget
            if prompts is not None:
                loop.admit(prompts)
        run.stream.size = len(run.train_set.items)  # the order is drawn on first use, over what is left
        if run.test_set is not None and run.step == 0 and cfg.run.eval_at_start:
            last_eval = run.evaluate(loop)
            run.logger.log(0, last_eval)
            run.logger.progress(0, cfg.run.max_steps, last_eval)
        while run.step < cfg.run.max_steps and not run.stopping():
            cfg = run.cfg  # a guard rollback replaces it
            run.step += 1
            times = {"start": time.perf_counter()}
            # 1. rollout: n samples per prompt (this rank's share of whole groups), budgets enforced inside the loop
            resume_point = (run.stream.cursor, engine.generator.get_state())  # for a checkpoint of this step's start
            loop.counters.clear()
            gen_before = engine.stats["generated_tokens"]
            # 2. reward on the last <answer> of the response only; with algo.filter_groups, further batches
            # until enough groups have rewards that differ
            sampled, groups, gen_m = sample_groups(run, loop, reward)
            times["rollout"] = time.perf_counter()
            # 3. buffer: whole groups, bounded by tokens
            for group in groups:
                run.buffer.add_group(group)
            trajs = run.buffer.drain()
            rollout_m = {**rollout_metrics(sampled, loop.counters), **gen_m}  # before any exclusion zeroes a mask
            # 3b. a dead retriever: wait for it, or checkpoint this step's start and exit
            if not run.retriever_ok(client, loop.counters):
                run.step, (run.stream.cursor, rng) = run.step - 1, resume_point
                engine.generator.set_state(rng)
                run.exit(
                    f"retriever at {client.url} failed {int(loop.counters['retriever/errors'])} of "
                    f"{int(loop.counters['retriever/queries'])} searches "
                    f"at step {run.step + 1} and did not answer /health within "
                    f"retriever.health_wait_s={cfg.retriever.health_wait_s:g} s. "
                    "Saved {path}; start the server again and rerun with --resume."
                )
            if cfg.retriever.exclude_failed:
                for t in trajs:
                    if t.retrieval_failed:
                        t.excluded, t.loss_mask = True, [0] * len(t.loss_mask)
            batch, upd, report, update_signal = learn_step(run, trajs, times)
            if report and world.is_main:
                path = save_trajectories(run.out_dir, run.step, batch, report, run.tokenizer)
                run.logger.log_trajectories(run.step, "rollout/trajectories", path)
            # 6. log, and evaluate every run.eval_every steps
            metrics = step_metrics(
                run, sampled, trajs, rollout_m, client, upd, times, engine.stats["generated_tokens"] - gen_before
            )
            metrics.update(run.replay_signal(sampled))
            metrics.update(update_signal)
            if (
                cfg.run.eval_every
                and run.step % cfg.run.eval_every == 0
                and run.test_set is not None
                and run.step < cfg.run.max_steps
            ):
                last_eval = run.evaluate(loop)
                metrics.update(last_eval)
            # 7. collapse guard: its signals are metrics of the step whether or not it acts
            decision, signals = run.guard.observe(run.step, metrics)
            metrics.update(signals)
            if decision.action != "none":
                print(f"[guard] {decision.action}: {decision.message}", file=sys.stderr)
                metrics[f"guard/{decision.action}"] = 1.0
            run.logger.log(run.step, metrics)
            if run.step % cfg.run.log_every == 0:
                run.logger.progress(run.step, cfg.run.max_steps, metrics)
            if decision.action == "stop":
                run.exit(f"collapse guard stopped the run at step {run.step}: {decision.message}")
            if decision.action == "rollback":
                run.rollback()
                continue
            # 8. checkpoint
            if run.checkpoint_due():
                run.checkpoint()
        if run.stop.is_set():
            print(f"[train] signal received: saving step {run.step} and exiting", file=sys.stderr)
            run.checkpoint()
        elif run.test_set is not None:
            last_eval = run.evaluate(loop)
            run.logger.log(run.step, last_eval)
            run.logger.progress(run.step, cfg.run.max_steps, last_eval)
    engine.close()  # before the process group: vLLM's own groups are built on it
    world.close()
    return last_eval
