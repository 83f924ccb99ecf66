"""The trajectory buffer: finished trajectories, bounded by tokens and count.

Policy when full: a whole GRPO group is admitted or refused together (a partial group would
bias its advantages); a refused group is counted in `buffer/dropped_groups` and
`buffer/dropped_tokens`.
"""

from __future__ import annotations

from collections import Counter

from agent_rl.rollout.trajectory import Trajectory

# Host bytes a buffered token costs: its id, mask and log-prob in Python lists, and its share of
# the trajectory's Python objects.
BYTES_PER_TOKEN = 64


class TrajectoryBuffer:
    @staticmethod
    def planned_bytes(max_tokens: int, step_tokens: int) -> int:
        """Host memory of a full buffer for `agent-rl plan`: a step's trajectories at their longest,
        or the buffer's token cap where that is smaller."""
        return min(max_tokens, step_tokens) * BYTES_PER_TOKEN

    def __init__(self, max_tokens: int, max_trajectories: int):
        self.max_tokens = max_tokens
        self.max_trajectories = max_trajectories
        self.items: list[Trajectory] = []
        self.tokens = 0
        self.counters: Counter = Counter()

    def __len__(self) -> int:
        return len(self.items)

    def add_group(self, group: list[Trajectory]) -> bool:
        """Admit the whole group or none of it; returns whether it was admitted."""
        size = sum(t.total_tokens for t in group)
        if self.tokens + size > self.max_tokens or len(self.items) + len(group) > self.max_trajectories:
            self.counters["buffer/dropped_groups"] += 1
            self.counters["buffer/dropped_tokens"] += size
            return False
        self.items.extend(group)
        self.tokens += size
        return True

    def drain(self) -> list[Trajectory]:
        items, self.items, self.tokens = self.items, [], 0
        return items
