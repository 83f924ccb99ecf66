"""Answer normalisation and matching, as in SQuAD's evaluation script.

Shared by the retrieval evaluation (`retriever-eval`) and the trainer's rewards, so that
"answer recall" and "exact match" mean the same thing everywhere. Pure functions, no deps.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse white space."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden_answers: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def f1_score(prediction: str, golden_answers: Iterable[str]) -> float:
    """Best token-level F1 of the prediction against the gold answers (SQuAD)."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision = same / len(pred_tokens)
        recall = same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains_answer(passage: str, golden_answers: Iterable[str]) -> bool:
    """True when a normalised gold answer occurs as a whole-token span of the passage.

    Token boundaries matter: "1" does not match inside "1984", "art" not inside "party".
    """
    tokens = normalize_answer(passage).split()
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        n = len(gold_tokens)
        if n == 0:
            continue
        for i in range(len(tokens) - n + 1):
            if tokens[i : i + n] == gold_tokens:
                return True
    return False
