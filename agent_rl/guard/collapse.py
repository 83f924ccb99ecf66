"""The collapse guard: early signals every step, and an action before the collapse.

Every signal is a metric under `guard/` (or `rollout/`) whether or not the guard acts; each
threshold set to 0 keeps its signal out of the rule. The relative signals compare a step with the
healthy steps before it (the last `window` steps that raised no signal, once `min_history` are
held), so a run that starts weak (malformed, rarely searching) raises none for that.

Early (the policy degenerates before test EM falls):
- `update`: the median over the last `update_window` updates of `guard/update_logprob_change` (what each
  update did to the log-prob per token of the rows it rewarded, which it should raise) is below
  -`update_threshold`;
- `replay`: the mean log-prob per token, under the current policy, of responses that earned a
  reward in earlier steps (`guard.signals.ReplaySet`, computed by the trainer) has fallen more
  than `replay_drop` nats below the best it reached (`guard/replay_drop`);
- `grad_norm`: the median gradient norm (before clipping) of the last three steps is more than
  `grad_factor` x the window's median (`guard/grad_norm_ratio`): a sustained rise, not one spike
  (healthy GRPO runs have single-step spikes);
- `entropy`: the policy's entropy at trained tokens is above `entropy_factor` x or below
  1/`entropy_factor` x the window median (`guard/entropy_ratio`; needs `actor/entropy`, which
  `algo.log_entropy` or an entropy bonus gives);
- `format`, `repeat`: the share of malformed responses, or of responses looping on a repeated
  n-gram, is more than `format_rise` / `repeat_rise` above the window median;
- `search`: searches per trajectory fell below `search_ratio` x the window median (which must be
  0.5 or more) (`guard/search_ratio`);
- `logprob_gap`: the engine-trainer log-prob gap at sampled tokens exceeds `logprob_gap`.
Late (the damage is done): `length` (mean response length > `length_factor` x the window median),
`budget_total` (share ending on the total budget > `budget_hit_frac`), `invalid` (share of invalid
actions > `invalid_frac`).

Action as configured: `warn` (log), `stop` (the trainer checkpoints and exits non-zero naming the
signal), `rollback` (the trainer returns to the last healthy checkpoint, taken every
`healthy_every` steps that raised no signal and two or more steps before the one that fired,
lowers the learning rate, raises the KL coefficient, and goes on; after `max_rollbacks` it stops).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from agent_rl.config import GuardConfig

# The metrics the window keeps per healthy step.
_WINDOWED = (
    "rollout/response_length_mean",
    "actor/grad_norm",
    "actor/entropy",
    "rollout/format_error_frac",
    "rollout/repeat_frac",
    "rollout/searches_mean",
)


@dataclass
class GuardDecision:
    action: str  # none | warn | stop | rollback
    signal: str = ""
    message: str = ""


class CollapseGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history: deque[dict[str, float]] = deque(maxlen=max(1, cfg.window))
        self.recent_grads: deque[float] = deque(maxlen=3)  # every step's, healthy or not
        self.replay_best = -math.inf
        # every update's guard/update_logprob_change, healthy or not
        self.recent_changes: deque[float] = deque(maxlen=max(1, cfg.update_window))
        self.rollbacks = 0
        self.first_signal_step = 0  # the step of the first signal of the run (0: none yet)

    def _median(self, key: str) -> float | None:
        xs = [h[key] for h in self.history if key in h]
        return statistics.median(xs) if len(xs) >= self.cfg.min_history else None

    def measure(self, metrics: dict) -> dict[str, float]:
        """This step's signal values (`guard/...`), computed whatever the action."""
        out: dict[str, float] = {}
        replay = metrics.get("guard/replay_logprob")
        if replay is not None:
            out["guard/replay_drop"] = max(0.0, self.replay_best - replay) if self.replay_best > -math.inf else 0.0
        change = metrics.get("guard/update_logprob_change")
        if change is not None:
            self.recent_changes.append(float(change))
            if len(self.recent_changes) == self.recent_changes.maxlen:
                out["guard/update_change_median"] = statistics.median(self.recent_changes)
        grad, median = metrics.get("actor/grad_norm"), self._median("actor/grad_norm")
        if grad is not None:
            self.recent_grads.append(float(grad))
            if median:
                out["guard/grad_norm_ratio"] = statistics.median(self.recent_grads) / median
        entropy, median = metrics.get("actor/entropy"), self._median("actor/entropy")
        if entropy is not None and median:
            out["guard/entropy_ratio"] = entropy / median
        searches, median = metrics.get("rollout/searches_mean"), self._median("rollout/searches_mean")
        if searches is not None and median is not None and median >= 0.5:
            out["guard/search_ratio"] = searches / median
        return out

    def _signal(self, metrics: dict, measured: dict) -> tuple[str, str] | None:
        c = self.cfg
        drop = measured.get("guard/replay_drop")
        if c.replay_drop > 0 and drop is not None and drop > c.replay_drop:
            return "replay", f"log-prob of earlier rewarded responses fell {drop:.2f} nats/token below its best"
        median = measured.get("guard/update_change_median")
        if c.update_window > 0 and median is not None and median < -c.update_threshold:
            return "update", (
                f"the last {c.update_window} updates lowered the log-prob of the responses they rewarded by "
                f"a median {-median:.4f} nats/token"
            )
        ratio = measured.get("guard/grad_norm_ratio")
        if c.grad_factor > 0 and ratio is not None and ratio > c.grad_factor:
            return "grad_norm", f"gradient norm over the last 3 steps is {ratio:.1f} x the window median"
        ratio = measured.get("guard/entropy_ratio")
        if c.entropy_factor > 0 and ratio is not None and not 1 / c.entropy_factor <= ratio <= c.entropy_factor:
            return "entropy", f"entropy {metrics['actor/entropy']:.3f} is {ratio:.2f} x the window median"
        for key, rise, name in (
            ("rollout/format_error_frac", c.format_rise, "format"),
            ("rollout/repeat_frac", c.repeat_rise, "repeat"),
        ):
            value, median = metrics.get(key), self._median(key)
            if rise > 0 and value is not None and median is not None and value > median + rise:
                what = "malformed" if name == "format" else "looping on a repeated n-gram"
                return name, f"{100 * value:.0f}% of responses {what} (window median {100 * median:.0f}%)"
        ratio = measured.get("guard/search_ratio")
        if c.search_ratio > 0 and ratio is not None and ratio < c.search_ratio:
            return "search", f"searches per trajectory fell to {ratio:.2f} x the window median"
        gap = metrics.get("rollout/logprob_diff_mean")
        if c.logprob_gap > 0 and gap is not None and gap > c.logprob_gap:
            return "logprob_gap", f"engine-trainer log-prob gap {gap:.3g} > {c.logprob_gap:g}"
        length, median = metrics.get("rollout/response_length_mean"), self._median("rollout/response_length_mean")
        if c.length_factor > 0 and length is not None and median and length > c.length_factor * median:
            return "length", f"mean response length {length:.1f} > {c.length_factor:g} x window median {median:.1f}"
        hit = metrics.get("budget/end_budget_total_frac")
        if c.budget_hit_frac > 0 and hit is not None and hit > c.budget_hit_frac:
            limit = 100 * c.budget_hit_frac
            return "budget_total", f"{100 * hit:.0f}% of trajectories ended on budget_total (> {limit:.0f}%)"
        invalid = metrics.get("rollout/invalid_frac")
        if c.invalid_frac > 0 and invalid is not None and invalid > c.invalid_frac:
            return "invalid", f"{100 * invalid:.0f}% of actions were invalid (> {100 * c.invalid_frac:.0f}%)"
        return None

    def observe(self, step: int, metrics: dict) -> tuple[GuardDecision, dict[str, float]]:
        """This step's decision and its signal metrics (to log with the step's)."""
        measured = self.measure(metrics)
        found = self._signal(metrics, measured)
        measured["guard/signal"] = float(found is not None)
        if found is None:
            self.history.append({k: float(metrics[k]) for k in _WINDOWED if k in metrics})
            replay = metrics.get("guard/replay_logprob")
            if replay is not None:
                self.replay_best = max(self.replay_best, replay)
            return GuardDecision("none"), measured
        signal, message = found
        measured[f"guard/fired/{signal}"] = 1.0  # under `off` too: what the guard would have said
        if self.cfg.action == "off":
            return GuardDecision("none"), measured
        self.first_signal_step = self.first_signal_step or step
        action = self.cfg.action
        if action == "rollback":
            self.rollbacks += 1
            if self.rollbacks > self.cfg.max_rollbacks:
                action, message = "stop", f"{message}; gave up after {self.cfg.max_rollbacks} rollbacks"
        measured["guard/rollbacks"] = float(self.rollbacks)
        return GuardDecision(action, signal, f"step {step}: {signal}: {message}"), measured

    def state_dict(self) -> dict:
        return {
            "history": list(self.history),
            "replay_best": self.replay_best,
            "recent_grads": list(self.recent_grads),
            "recent_changes": list(self.recent_changes),
            "rollbacks": self.rollbacks,
            "first_signal_step": self.first_signal_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=max(1, self.cfg.window))
        self.replay_best = state["replay_best"]
        self.recent_grads = deque(state["recent_grads"], maxlen=3)
        self.recent_changes = deque(state.get("recent_changes", []), maxlen=max(1, self.cfg.update_window))
        self.rollbacks = state["rollbacks"]
        self.first_signal_step = state["first_signal_step"]
