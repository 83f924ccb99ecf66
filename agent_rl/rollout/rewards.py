"""Rewards: functions `(trajectory, golden_answers) -> float`, chosen by `reward.fn`.

The built-ins score the last `<answer>` of the *response* (never the prompt): `em` and `f1`, and
`em_format`, EM counted only when the response is well formed; `search_found` is a process reward for
the search rather than the answer (1 when an observation holds a gold answer), to weigh beside `em`. The
answer rewards score only the policy's own text: inserted observations
(`<information>...</information>`) and the corrective message (which itself says "between <answer> and
</answer>") are removed first, so they can never be read as an answer or break the format check.
Normalisation is SQuAD's (`retriever_server.answers`), shared with retrieval evaluation. Any other
`reward.fn` is a function of the user's, named by its import path (`module:function`); a list of `{fn,
weight}` sums its terms (`Reward`). The optional format bonus adds `reward.format_coef` when the
response is well formed: every tag it opens is closed, it ends with exactly one `<answer>...</answer>`
and nothing after it; the total is capped at 1. It is off by default (Search-R1's format variant can pay
for well-formed wrong answers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from agent_rl.config import BUILTIN_REWARDS, RewardConfig, load_reward
from agent_rl.rollout.protocol import extract_answer, observations, policy_text, well_formed
from retriever_server.answers import contains_answer, exact_match, f1_score


class Scored(Protocol):
    """What the built-ins read of a trajectory (`trajectory.Trajectory`, which imports this module
    to write EM and F1 beside each record, so it is not imported here)."""

    response_text: str
    golden_answers: list[str]


# A reward function receives the whole `Trajectory` (turns, tokens, documents) and the gold answers.
RewardFn = Callable[[Scored, list[str]], float]


def _em(answer: str, golden: list[str]) -> float:
    return exact_match(answer, golden)


def _f1(answer: str, golden: list[str]) -> float:
    return f1_score(answer, golden)


REWARDS = {"em": _em, "f1": _f1}


def compute_reward(name: str, response_text: str, golden_answers: list[str], format_coef: float = 0.0) -> float:
    """EM or F1 (`name`) of a response's last answer, plus the format bonus."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}")
    text = policy_text(response_text)
    answer = extract_answer(text)
    score = REWARDS[name](answer, golden_answers) if answer is not None else 0.0
    if format_coef > 0 and well_formed(text):
        score = min(1.0, score + format_coef)
    return float(score)


def answer_scores(response_text: str, golden_answers: list[str]) -> dict[str, float]:
    """EM and F1 of the response's last answer against the gold answers (no format bonus)."""
    return {name: compute_reward(name, response_text, golden_answers) for name in ("em", "f1")}


def em(t: Scored, golden_answers: list[str]) -> float:
    """Exact match of the last answer of the policy's own text."""
    return compute_reward("em", t.response_text, golden_answers)


def f1(t: Scored, golden_answers: list[str]) -> float:
    """Token F1 of the last answer of the policy's own text."""
    return compute_reward("f1", t.response_text, golden_answers)


def em_format(t: Scored, golden_answers: list[str]) -> float:
    """Exact match, counted only when the response is well formed (a right answer after an unclosed
    `<search>` or tool tag, or followed by more text, earns nothing)."""
    return em(t, golden_answers) if well_formed(policy_text(t.response_text)) else 0.0


def search_found(t: Scored, golden_answers: list[str]) -> float:
    """1.0 when an observation the policy was shown holds a gold answer as a whole-token span (the hit
    that retrieval evaluation counts), else 0.0: a process reward for searching, whatever the answer.

    It pays once per trajectory, so beside `em` (`reward.fn=[{fn: em, weight: 1.0}, {fn: search_found,
    weight: 0.3}]`) a further search earns it only when the searches before it had not found the answer,
    and nothing when the answer was already read: a reward for the search step by what it retrieves, the
    idea of StepSearch (Wang et al., 2025), reduced to "was the answer retrieved". Only the inserted text
    is read (`<information>` or `<tool_response>`, as cut to its budget), never the policy's own."""
    return float(any(contains_answer(obs, golden_answers) for obs in observations(t.response_text)))


BUILTINS: dict[str, RewardFn] = {"em": em, "f1": f1, "em_format": em_format, "search_found": search_found}
assert set(BUILTINS) == set(BUILTIN_REWARDS)


class Reward:
    """The reward `reward:` describes: the weighted sum of its functions, plus the format bonus."""

    def __init__(self, cfg: RewardConfig):
        self.terms: list[tuple[RewardFn, float]] = []
        for i, (spec, weight) in enumerate(cfg.terms()):
            key = "reward.fn" if isinstance(cfg.fn, str) else f"reward.fn[{i}]"
            self.terms.append((BUILTINS[spec] if spec in BUILTINS else load_reward(spec, key), weight))
        self.format_coef = cfg.format_coef

    def __call__(self, t: Scored) -> float:
        score = sum(weight * float(fn(t, t.golden_answers)) for fn, weight in self.terms)
        if self.format_coef > 0 and well_formed(policy_text(t.response_text)):
            score = min(1.0, score + self.format_coef)
        return float(score)
