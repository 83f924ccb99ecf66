"""The ranks a run spans, as the stages see them.

A one-process run is a world of one (`LocalWorld`): its collectives are identities, so the
rollout, scoring and update code is the same path in one process as under torchrun, where
`agent_rl.runtime.distributed.DistInfo` implements the same interface over a process group.
"""

from __future__ import annotations

from typing import Any, Protocol


class World(Protocol):
    """What the trainer needs of the ranks: who this rank is, and a few scalar collectives.

    Every collective must be called by all ranks in the same order; the trainer keeps that true
    by giving every rank the same number of prompts, mini-batches and micro-batches.
    """

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    @property
    def sharded(self) -> bool: ...

    def all_reduce_sum(self, x: float) -> float: ...

    def all_reduce_max(self, x: float) -> float: ...

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]: ...

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def gather_object(self, obj: Any) -> list[Any]: ...

    def close(self) -> None: ...


class LocalWorld:
    """One process, no process group: every collective returns its input."""

    rank = 0
    world_size = 1
    local_rank = 0

    @property
    def is_main(self) -> bool:
        return True

    @property
    def sharded(self) -> bool:
        """Whether the trained modules are FSDP-sharded (never in one process)."""
        return False

    def all_reduce_sum(self, x: float) -> float:
        return float(x)

    def all_reduce_max(self, x: float) -> float:
        return float(x)

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass


LOCAL = LocalWorld()
