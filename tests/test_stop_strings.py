"""Stop strings matched on token ids (`engines.base.StopStrings`): the step a row's decoded text first holds a
tag, whatever tokens spelled it, found by one gather a step instead of decoding every live row's tail."""

import random

import pytest
import torch

from agent_rl.rollout.engines.base import StopStrings
from agent_rl.rollout.protocol import STOP_TAGS


def _first_stop_by_decoding(tokenizer, ids: list[int], tags) -> int | None:
    """The reference: the first prefix whose decoded text holds a tag (what the HF engine decoded before)."""
    for k in range(1, len(ids) + 1):
        if any(t in tokenizer.decode(ids[:k], skip_special_tokens=False) for t in tags):
            return k
    return None


def _first_stop_by_ids(stops: StopStrings, ids: list[int]) -> int | None:
    state = stops.start(1)
    for k, i in enumerate(ids, 1):
        state, ended = stops.step(state, torch.tensor([i]))
        if bool(ended[0]):
            return k
    return None


def _streams(tokenizer, tags, n: int, seed: int) -> list[list[int]]:
    """Token streams that spell the tags in many ways: as the tokenizer writes them after assorted text (SmolLM2
    merges `>` into a following `.` or `<`), character by character, split at random points, or not at all."""
    rng = random.Random(seed)
    words = ["the", " answer", " is", " Paris", ".", " <", "</", "search", "answer", ">", "><", ">.", "<search>"]
    out = []
    for _ in range(n):
        tag = rng.choice(tags)
        before = "".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        after = rng.choice(["", ".", "<", "<information>", " and", "\n"])
        how = rng.randint(0, 3)
        if how == 0:
            ids = tokenizer(before + tag + after, add_special_tokens=False)["input_ids"]
        elif how == 1:
            cut = rng.randint(1, len(tag) - 1)
            ids = [
                *tokenizer(before + tag[:cut], add_special_tokens=False)["input_ids"],
                *tokenizer(tag[cut:] + after, add_special_tokens=False)["input_ids"],
            ]
        elif how == 2:
            ids = [i for ch in before + tag for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
        else:  # no whole tag: a near miss
            ids = tokenizer(before + tag[:-1] + " " + tag[1:], add_special_tokens=False)["input_ids"]
        out.append(ids)
    return out


def _agree(tokenizer, vocab_size: int, n: int) -> int:
    tags = list(STOP_TAGS)
    stops = StopStrings(tokenizer, tags, vocab_size, "cpu")
    found = 0
    for ids in _streams(tokenizer, tags, n, seed=0):
        want = _first_stop_by_decoding(tokenizer, ids, tags)
        assert _first_stop_by_ids(stops, ids) == want, (ids, tokenizer.decode(ids))
        found += want is not None
    return found


def test_stop_strings_on_ids_agree_with_decoding_on_the_tiny_tokenizer(tiny_model_dir):
    """The tiny tokenizer (tags are single special tokens there, and also reachable through plain pieces):
    on 300 streams the id automaton stops at the same token as decoding the text, and does not stop where
    decoding finds no tag."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    found = _agree(tokenizer, len(tokenizer) + 3, 300)  # ids past the tokenizer's (a padded embedding) read as nothing
    assert 100 < found < 300


@pytest.mark.real_model
def test_stop_strings_on_ids_agree_with_decoding_on_smollm2(smollm2_dir):
    """SmolLM2: tags are 3 tokens and `>` merges with what follows; on 400 streams the id automaton stops at the
    same token as decoding, the merged `>.` / `><` included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    merged = tokenizer("</search>.", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(merged[-1:]) == ">.", "the case this test is about: `>` merged into the next token"
    found = _agree(tokenizer, len(tokenizer), 400)
    assert 100 < found < 400
