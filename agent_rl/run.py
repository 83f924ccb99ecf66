"""One training run's live state between steps (`Run`) and what it does to itself: checkpoint, restore, resume,
the collapse guard's rollback and signals, evaluation, a clean exit. `agent_rl.train` builds a `Run` (`setup`) and
drives it step by step (`train`). `open_loop` assembles the agent loop over the run's retriever, for training, the
SFT's demonstrations and the CLI's rollout, eval and demo alike.

A rollback departs from Search-R1 (which has none): it returns to the last healthy checkpoint with a lower learning
rate, a stronger KL anchored to that checkpoint's policy and a weaker entropy bonus, all saved with the checkpoints
that follow, so a --resume keeps them.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_rl.bootstrap.prepare import local_retriever
from agent_rl.config import Config
from agent_rl.evaluation import evaluate_step
from agent_rl.guard.collapse import CollapseGuard
from agent_rl.guard.signals import ReplaySet, rewarded_rows, row_logprobs, update_logprob_change
from agent_rl.learn.batch import RolloutBatch
from agent_rl.learn.policy import _DTYPES, frozen_copy, trainer_autocast
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.buffer import TrajectoryBuffer
from agent_rl.rollout.engines import Engine
from agent_rl.rollout.loop import AgentLoop
from agent_rl.rollout.prompts import PromptSet
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.runtime import distributed as dist_lib
from agent_rl.runtime.checkpoint import (
    REFERENCE,
    StopFlag,
    checkpoint_step,
    checkpoints,
    drop_checkpoints_after,
    latest_checkpoint,
    load_reference,
)
from agent_rl.runtime.logger import MetricsLogger
from agent_rl.runtime.run_state import RunState, load_state, save_state
from agent_rl.world import LOCAL, World
from retriever_server.client import RetrieverClient


@contextmanager
def open_loop(
    cfg: Config, engine: Engine, tokenizer, world: World = LOCAL, budget: TokenBudget | None = None
) -> Iterator[AgentLoop]:
    """The agent loop `cfg` describes (`AgentLoop.from_config`: rollout.mode, tools, protocol) over `engine`, its
    client on the retriever the run searches: `retriever.url`, a server rank 0 starts here and stops on exit, or none
    when `retriever.replay` answers every search; every rank gets rank 0's URL. The client closes on exit."""
    with local_retriever(cfg.retriever) if world.is_main else nullcontext(None) as url:
        url = world.broadcast_object(url)
        client = RetrieverClient.from_config(cfg.retriever, url)
        try:
            yield AgentLoop.from_config(cfg, engine, tokenizer, client, budget or TokenBudget.from_config(cfg.budget))
        finally:
            client.close()


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


def sync_weights(engine: Engine, policy) -> float:
    """Push the updated weights into the rollout engine (a no-op where it generates with the policy
    module itself); returns seconds."""
    start = time.perf_counter()
    engine.sync_weights(policy)
    return time.perf_counter() - start


@dataclass
class Run:
    """Everything one training run holds between steps: what `setup` builds and `train` drives.
    Its settings (steps, output directory, checkpoints, evaluation) are `cfg.run`, a `RunConfig`."""

    cfg: Config
    world: World
    out_dir: Path
    tokenizer: Any  # a transformers tokenizer
    engine: Engine
    policy: torch.nn.Module
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LambdaLR
    budget: TokenBudget
    train_set: PromptSet
    test_set: PromptSet | None
    stream: PromptStream
    buffer: TrajectoryBuffer
    logger: MetricsLogger
    guard: CollapseGuard
    replay: ReplaySet | None  # the guard's replay set (guard.replay_size)
    stop: StopFlag
    update_rng: random.Random
    step: int = 0
    # `ref` is a rollback's (a frozen copy of the policy it restored): no file but the checkpoint rebuilds it
    rollback_ref: bool = False

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def push_weights(self) -> float:
        """The updated weights into the rollout engine (a collective under torchrun); seconds."""
        if self.world.sharded:
            return dist_lib.sync_rollout_weights(self.engine, self.policy)
        return sync_weights(self.engine, self.policy)

    def state(self) -> RunState:
        """What a checkpoint of this step holds."""
        extra = {
            "step": self.step,
            "cursor": self.stream.cursor,
            "update_rng": self.update_rng.getstate(),
            "engine_rng": self.engine.generator.get_state(),
            "guard": self.guard.state_dict(),  # with what a rollback changed, so --resume keeps it
            "kl_coef": self.cfg.algo.kl_coef,
            "entropy_coef": self.cfg.algo.entropy_coef,
            "replay": self.replay.state_dict() if self.replay is not None else [],
        }
        return RunState(
            step=self.step,
            policy=self.policy,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            extra=extra,
            config=self.cfg.to_dict(),
            critic=self.critic,
            critic_optimizer=self.critic_opt,
            reference=self.ref if self.rollback_ref else None,
        )

    def checkpoint(self) -> Path:
        return save_state(self.ckpt_root, self.state(), self.world, self.cfg.run.keep_last)

    def restore(self, path: Path) -> None:
        extra = load_state(path, self.state(), self.world)
        self.step, self.stream.cursor = int(extra["step"]), int(extra["cursor"])
        if "engine_rng" in extra:
            self.engine.generator.set_state(extra["engine_rng"])
        self.update_rng.setstate(extra["update_rng"])
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
            self._restore_reference(path, extra["kl_coef"])
            self._set_kl(extra["kl_coef"])
            self._set_algo(entropy_coef=extra.get("entropy_coef", self.cfg.algo.entropy_coef))
            if self.replay is not None:
                self.replay.load_state_dict(extra["replay"])
        self.push_weights()

    def _restore_reference(self, path: Path, kl_coef: float) -> None:
        """The reference checkpoint `path` was saved with: a rollback's, read back whole, or none (a checkpoint
        from before the rollback that made the one held now, which is then dropped)."""
        if (path / REFERENCE).exists():
            if self.ref is None:
                self.ref = frozen_copy(self.policy, self.cfg.train.device, _DTYPES[self.cfg.model.dtype])
            load_reference(path, self.ref)
            self.rollback_ref = True
            return
        if self.rollback_ref:
            self.ref, self.rollback_ref = None, False
        if kl_coef > 0 and self.ref is None and not hasattr(self.policy, "disable_adapter") and not self.world.sharded:
            print(
                f"[guard] {path} holds a rollback's KL coefficient but not its reference (saved before references "
                "were kept): the reference is the restored policy",
                file=sys.stderr,
            )

    def _set_kl(self, kl_coef: float) -> None:
        if kl_coef > 0 and self.ref is None and not hasattr(self.policy, "disable_adapter"):
            if self.world.sharded:
                print("[guard] no reference model on this FSDP run: the KL coefficient stays 0", file=sys.stderr)
                return
            # a rollback's first KL: the reference is the policy as restored (the last healthy one), saved
            # with every checkpoint from here on
            self.ref = frozen_copy(self.policy, self.cfg.train.device, _DTYPES[self.cfg.model.dtype])
            self.rollback_ref = True
        self._set_algo(kl_coef=kl_coef)

    def _set_algo(self, **changes) -> None:
        """The run's config with these algo fields changed (what a rollback set, or a checkpoint restores)."""
        self.cfg = dataclasses.replace(self.cfg, algo=dataclasses.replace(self.cfg.algo, **changes))

    def asked_rows(self, trajs: list[Trajectory], batch: RolloutBatch) -> tuple[dict | None, list[int]]:
        """The rows whose log-probs before the update the update is asked for, for the trajectory file: this
        step's first rows (this rank's share) every run.save_trajectories_every steps (None on other steps); and
        the collapse guard's rewarded rows (guard.update_rows), which the update signal scores itself."""
        every = self.cfg.run.save_trajectories_every
        report: dict[int, list[float] | None] | None = (
            dict.fromkeys(range(min(len(trajs), self.cfg.run.save_trajectories_per_step)))
            if every and self.step % every == 0
            else None
        )
        if self.cfg.guard.update_rows <= 0:
            return report, []
        assert batch.advantages is not None
        return report, rewarded_rows(batch.trajs, batch.advantages, self.cfg.guard.update_rows)

    def signal_logprobs(self, batch: RolloutBatch, rows: list[int]) -> dict[int, torch.Tensor]:
        """The update signal's rows scored as the signal scores them after the update (`row_logprobs`, in the
        trainer's arithmetic); nothing when guard.update_rows is 0."""
        if self.cfg.guard.update_rows <= 0:
            return {}
        with trainer_autocast(self.cfg.train, self.world):
            return row_logprobs(
                self.policy,
                batch.trajs,
                rows,
                self.tokenizer.pad_token_id,
                self.cfg.train.device,
                self.cfg.rollout.temperature,
                self.cfg.train.max_tokens_per_microbatch,
                self.world,
            )

    def update_signal(self, batch: RolloutBatch, before: dict[int, torch.Tensor], seconds: float) -> dict[str, float]:
        """guard/update_logprob_change: what the update just made did to the log-probs of the rows it rewarded,
        from their log-probs `before` it (`signal_logprobs`, which took `seconds`; nothing when guard.update_rows
        is 0 or no rank has such a row)."""
        if self.cfg.guard.update_rows <= 0:
            return {}
        start = time.perf_counter()
        assert batch.advantages is not None
        with trainer_autocast(self.cfg.train, self.world):
            change = update_logprob_change(
                self.policy,
                batch.trajs,
                before,
                batch.advantages,
                self.tokenizer.pad_token_id,
                self.cfg.train.device,
                self.cfg.rollout.temperature,
                self.cfg.train.max_tokens_per_microbatch,
                self.world,
            )
        if change is None:
            return {}
        spent = seconds + time.perf_counter() - start
        return {"guard/update_logprob_change": change, "timing/update_signal_s": spent}

    def replay_signal(self, sampled: list[Trajectory]) -> dict[str, float]:
        """guard/replay_logprob of the replay set under the updated policy (once every rank's set is full), then
        this step's rewarded responses into the set while it fills."""
        if self.replay is None:
            return {}
        out = {}
        start = time.perf_counter()
        if self.replay.ready(self.world) and self.step % self.cfg.guard.replay_every == 0:
            pad = self.tokenizer.pad_token_id
            out["guard/replay_logprob"] = self.replay.logprob(
                self.policy,
                pad,
                self.cfg.train.device,
                self.cfg.rollout.temperature,
                self.cfg.train.max_tokens_per_microbatch,
                self.world,
            )
            out["timing/replay_s"] = time.perf_counter() - start
        self.replay.add(sampled)
        return out

    def resume(self) -> None:
        """Restore the latest checkpoint under the output directory, if there is one."""
        path = self.world.broadcast_object(latest_checkpoint(self.ckpt_root))  # every rank the same step
        if path is None:
            print(f"[train] --resume: no checkpoint under {self.ckpt_root}; starting from step 0", file=sys.stderr)
            return
        self.restore(path)
        self.logger.truncate_after(self.step)
        print(f"[train] resumed from {path} at step {self.step}", file=sys.stderr)

    def evaluate(self, loop: AgentLoop) -> dict[str, float]:
        """The test set under the policy of this step (`evaluation.evaluate_step`); nothing without one."""
        if self.test_set is None:
            return {}
        cfg = self.cfg
        return evaluate_step(
            loop, self.test_set, cfg.rollout, cfg.run, self.world, self.out_dir, self.step, self.tokenizer, self.logger
        )

    def stopping(self) -> bool:
        """A signal arrived (on any rank: the ranks leave the loop together)."""
        return self.world.all_reduce_max(float(self.stop.is_set())) > 0

    def retriever_ok(self, client: RetrieverClient, counters) -> bool:
        """Too many of this step's searches failed: wait for /health (rank 0; all ranks agree)."""
        searched, errors = counters["retriever/queries"], counters["retriever/errors"]
        if not self.world.all_reduce_max(
            float(searched > 0 and errors / searched > self.cfg.retriever.max_failed_share)
        ):
            return True
        back = 0.0
        if self.world.is_main:
            print(
                f"[train] step {self.step}: {int(errors)} of {int(searched)} searches failed; waiting for "
                f"{client.url}/health",
                file=sys.stderr,
            )
            back = float(
                client.wait_healthy(
                    self.cfg.retriever.health_wait_s, log=lambda m: print(f"[train] {m}", file=sys.stderr)
                )
            )
        return self.world.all_reduce_max(back) > 0

    def rollback(self) -> Path | None:
        """The guard's rollback: the last healthy checkpoint, a lower learning rate, a stronger KL, a weaker
        entropy bonus (if any); saved again with them, so a --resume after it keeps them, and the checkpoints
        after it deleted. Returns the checkpoint it went back to.

        The last healthy checkpoint is the newest from two or more steps before the step that fired: the
        policy of the step just before generated the rollouts that raised a signal (format, repetition,
        searches, length), so returning to it would replay them. With none that old, the oldest there is."""
        found = checkpoints(self.ckpt_root)
        healthy = [p for p in found if checkpoint_step(p) <= self.step - 2]
        path = self.world.broadcast_object(healthy[-1] if healthy else (found[0] if found else None))
        # Lower the scheduler's base rates, not just the live ones: LambdaLR recomputes
        # lr from base_lrs at every step (and the restore brings back the old ones).
        base_lrs = [lr * self.cfg.guard.lr_factor for lr in self.scheduler.base_lrs]
        kl = self.cfg.algo.kl_coef * self.cfg.guard.kl_factor if self.cfg.algo.kl_coef > 0 else self.cfg.guard.kl_floor
        entropy_coef = self.cfg.algo.entropy_coef * self.cfg.guard.entropy_coef_factor
        rollbacks, first = self.guard.rollbacks, self.guard.first_signal_step
        if path is not None:
            self.restore(path)  # the guard's window and replay set as they were then
            if self.world.is_main:
                drop_checkpoints_after(self.ckpt_root, checkpoint_step(path))
            self.world.barrier()
        self.guard.rollbacks, self.guard.first_signal_step = rollbacks, first
        self.guard.replay_best = -math.inf  # the restored policy is the new baseline of the replay signal
        self.scheduler.base_lrs = base_lrs
        for group, base, factor in zip(self.optimizer.param_groups, base_lrs, self.scheduler.lr_lambdas):
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self._set_kl(kl)
        self._set_algo(entropy_coef=entropy_coef)
        if path is not None:
            self.checkpoint()
        bonus = f", entropy_coef {entropy_coef:g}" if entropy_coef > 0 else ""
        print(
            f"[guard] rolled back to {path} (step {self.step}): lr {self.optimizer.param_groups[0]['lr']:.3g}, "
            f"kl_coef {self.cfg.algo.kl_coef:g}{bonus} ({self.guard.rollbacks} of {self.cfg.guard.max_rollbacks} "
            "rollbacks)",
            file=sys.stderr,
        )
        return path

    def checkpoint_due(self) -> bool:
        """run.save_every, the last step, and with guard.action=rollback every guard.healthy_every steps (a step
        that raised a signal has rolled back before it gets here: what is saved is healthy)."""
        run, guard = self.cfg.run, self.cfg.guard
        healthy = guard.action == "rollback" and guard.healthy_every > 0 and self.step % guard.healthy_every == 0
        return self.step % run.save_every == 0 or self.step == run.max_steps or healthy

    def exit(self, message: str) -> None:
        """Save this step, close the logs and the process group, and stop with `message`."""
        path = self.checkpoint()
        self.logger.close()
        self.engine.close()  # before the process group: vLLM's own groups are built on it
        self.world.close()
        raise SystemExit(message.replace("{path}", str(path)))
