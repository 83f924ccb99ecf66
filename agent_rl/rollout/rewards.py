"""Rewards by name: exact match or F1 on the last `<answer>` of the *response* (never the prompt).

Only the policy's own text is scored: inserted observations (`<information>...</information>`)
and the corrective message (which itself says "between <answer> and </answer>") are removed
first, so they can never be read as an answer or break the format check.
Normalisation is SQuAD's (`retriever_server.answers`), shared with retrieval evaluation. The
optional format reward adds `format_coef` when the response is well formed: every `<search>`
is closed, it ends with exactly one `<answer>...</answer>` and nothing after it; the total is
capped at 1. It is off by default (Search-R1's format variant can pay for well-formed wrong
answers).
"""

from __future__ import annotations

from agent_rl.rollout.protocol import extract_answer, policy_text, well_formed
from retriever_server.answers import exact_match, f1_score


def _em(answer: str, golden: list[str]) -> float:
    return exact_match(answer, golden)


def _f1(answer: str, golden: list[str]) -> float:
    return f1_score(answer, golden)


REWARDS = {"em": _em, "f1": _f1}


def compute_reward(name: str, response_text: str, golden_answers: list[str], format_coef: float = 0.0) -> float:
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
