"""The collapse guard: watches length, budget hits and invalid actions over a window, and acts.

Signals (each compared with the previous `window` steps):
- `length`: mean response length > `length_factor` x the window median (needs 3+ steps);
- `budget_total`: share of trajectories ending on budget_total > `budget_hit_frac`;
- `invalid`: share of invalid actions > `invalid_frac`.
Action as configured: `warn` (log), `stop` (the trainer checkpoints and exits non-zero naming
the signal), `rollback` (the trainer reloads the last checkpoint, lowers the learning rate,
raises the KL coefficient, and goes on; after `max_rollbacks` it stops).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from agent_rl.config import GuardConfig


@dataclass
class GuardDecision:
    action: str  # none | warn | stop | rollback
    signal: str = ""
    message: str = ""


class CollapseGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.lengths: deque[float] = deque(maxlen=max(1, cfg.window))
        self.rollbacks = 0

    def _signal(self, metrics: dict) -> tuple[str, str] | None:
        length = metrics.get("rollout/response_length_mean")
        if length is not None and len(self.lengths) >= 3:
            median = statistics.median(self.lengths)
            if median > 0 and length > self.cfg.length_factor * median:
                return (
                    "length",
                    f"mean response length {length:.1f} > {self.cfg.length_factor} x window median {median:.1f}",
                )
        hit = metrics.get("budget/end_budget_total_frac")
        if hit is not None and hit > self.cfg.budget_hit_frac:
            return (
                "budget_total",
                f"{100 * hit:.0f}% of trajectories ended on budget_total (> {100 * self.cfg.budget_hit_frac:.0f}%)",
            )
        invalid = metrics.get("rollout/invalid_frac")
        if invalid is not None and invalid > self.cfg.invalid_frac:
            return "invalid", f"{100 * invalid:.0f}% of actions were invalid (> {100 * self.cfg.invalid_frac:.0f}%)"
        return None

    def observe(self, step: int, metrics: dict) -> GuardDecision:
        if self.cfg.action == "off":
            return GuardDecision("none")
        found = self._signal(metrics)
        length = metrics.get("rollout/response_length_mean")
        if found is None:
            if length is not None:
                self.lengths.append(float(length))
            return GuardDecision("none")
        signal, message = found
        action = self.cfg.action
        if action == "rollback":
            self.rollbacks += 1
            if self.rollbacks > self.cfg.max_rollbacks:
                action, message = "stop", f"{message}; gave up after {self.cfg.max_rollbacks} rollbacks"
        return GuardDecision(action, signal, f"step {step}: {message}")
