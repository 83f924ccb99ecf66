"""One checkpoint call for both layouts: `RunState` names what a training run saves, `save_state` writes it
and `load_state` reads it back.

One process writes `checkpoint.save_checkpoint`'s layout (a Hugging Face model dir, the critic and its
optimizer in the extra state); under torchrun every rank writes its DCP shards (`distributed.save_sharded`,
with a full Hugging Face model exported for `agent-rl eval`). A sharded checkpoint also loads into one
process: DCP reshards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_rl.runtime import distributed as dist_lib
from agent_rl.runtime.checkpoint import load_checkpoint, save_checkpoint
from agent_rl.world import World


@dataclass
class RunState:
    """What one checkpoint holds besides the RNG streams (which the save reads itself)."""

    step: int
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch LR scheduler (its state dict)
    extra: dict
    """The caller's own state: data cursor, engine RNG, guard, ..."""
    config: dict
    """The run's config (`Config.to_dict`), written as `config.json`."""
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    reference: torch.nn.Module | None = None
    """A reference no other file rebuilds (a rollback's), saved whole; one process only."""


def save_state(root: Path, state: RunState, world: World, keep_last: int) -> Path:
    """Write `root/step_N` (sharded under torchrun, from every rank) and keep the newest `keep_last`."""
    if world.sharded:
        return dist_lib.save_sharded(
            root,
            state.step,
            state.policy,
            state.optimizer,
            world,
            state.scheduler,
            state.extra,
            state.config,
            keep_last,
            export_hf=True,
            critic=state.critic,
            critic_optimizer=state.critic_optimizer,
        )
    extra = dict(state.extra)
    if state.critic is not None and state.critic_optimizer is not None:
        extra["critic"], extra["critic_opt"] = state.critic.state_dict(), state.critic_optimizer.state_dict()
    return save_checkpoint(
        root,
        state.step,
        state.policy,
        state.optimizer,
        state.scheduler,
        extra,
        state.config,
        keep_last,
        reference=state.reference,
    )


def load_state(path: Path, state: RunState, world: World) -> dict:
    """Restore the modules, optimizers, scheduler and RNG streams of `state` from checkpoint `path`; returns
    the extra state saved with it. `state.step`, `extra` and `config` are not read; the reference is
    `checkpoint.load_reference`'s."""
    if world.sharded or (path / "dcp").is_dir():  # DCP reshards a torchrun checkpoint into one process
        return dist_lib.load_sharded(
            path, state.policy, state.optimizer, world, state.scheduler, state.critic, state.critic_optimizer
        )
    extra = load_checkpoint(path, state.policy, state.optimizer, state.scheduler)
    if state.critic is not None and state.critic_optimizer is not None:
        state.critic.load_state_dict(extra["critic"])
        state.critic_optimizer.load_state_dict(extra["critic_opt"])
    return extra
