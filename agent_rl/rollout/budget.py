"""The token budget: a small pure object asked *before* anything is appended to a trajectory.

The one rule at the limit: nothing is ever appended past `max_total_tokens`, and a trajectory
ends with an answer turn rather than being cut. A generation turn may take
`min(max_tokens_per_turn, room)` tokens; an observation may take
`min(max_obs_tokens, room - max_tokens_per_turn)`, so one more turn (the answer) always fits
after it. Before each turn, `must_answer` decides whether it is the forced-answer turn (its
searches are not run, as after `max_turns`): when the room left cannot hold this turn, a
minimal observation and a reserved final turn. So the total budget binds (ASearcher-style long
horizons: many turns under a token cap) and trajectories still end with an answer; only when
not even one token of a turn fits does a trajectory end with `budget_total`. The prompt is
never truncated: a prompt over `max_prompt_tokens` is rejected at data loading (Search-R1 cuts
the context from the left and can lose the question).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_rl.config import BudgetConfig


@dataclass(frozen=True)
class TokenBudget:
    max_turns: int
    max_prompt_tokens: int
    max_tokens_per_turn: int
    max_obs_tokens: int
    max_total_tokens: int

    @classmethod
    def from_config(cls, cfg: BudgetConfig) -> "TokenBudget":
        return cls(
            cfg.max_turns, cfg.max_prompt_tokens, cfg.max_tokens_per_turn, cfg.max_obs_tokens, cfg.max_total_tokens
        )

    def admits_prompt(self, prompt_tokens: int) -> bool:
        """A prompt is admissible when it fits its own budget and leaves room for one turn."""
        return prompt_tokens <= self.max_prompt_tokens and prompt_tokens + 1 <= self.max_total_tokens

    def room(self, total_tokens: int) -> int:
        return max(0, self.max_total_tokens - total_tokens)

    def turn_allowance(self, total_tokens: int) -> int:
        """Tokens the next generation turn may take (0: the trajectory must end, `budget_total`)."""
        return min(self.max_tokens_per_turn, self.room(total_tokens))

    def obs_allowance(self, total_tokens: int) -> int:
        """Tokens the next observation may take, keeping one full turn free for the answer."""
        return max(0, min(self.max_obs_tokens, self.room(total_tokens) - self.max_tokens_per_turn))

    def is_final_turn(self, turn_index: int) -> bool:
        """Turn `max_turns` (0-based) is the forced answer turn: its searches are not run."""
        return turn_index >= self.max_turns

    def must_answer(self, turn_index: int, total_tokens: int, min_obs_tokens: int) -> bool:
        """Is this the forced-answer turn? After `max_turns` search turns, or when the room left
        cannot hold this turn, an observation of `min_obs_tokens` and a reserved final turn."""
        return self.is_final_turn(turn_index) or self.room(total_tokens) < 2 * self.max_tokens_per_turn + min_obs_tokens
