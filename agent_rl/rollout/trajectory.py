"""A trajectory: the prompt, every token after it, and which of those the policy sampled.

`loss_mask` is the single contract between rollout and update (as in nanochat's engine):
1 on tokens the policy sampled, 0 on tokens inserted by the environment (observations and
corrective messages). Token ids pass through untouched: the ids trained are the ids sampled,
never decoded and re-tokenized (Search-R1 and verl #6501 re-tokenize and can drift).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

END_REASONS = ("answer", "max_turns", "budget_total", "invalid", "retriever_error")


@dataclass
class Turn:
    """One generation turn and what the environment did with it."""

    action: str  # "search" (or another tool's name) | "answer" | "invalid"
    gen_tokens: int  # tokens the policy generated this turn
    truncated: bool  # the turn ran into its token allowance without a stop tag
    query: str | None = None  # the tool call's input (search: the query)
    obs_tokens: int = 0  # tokens inserted after the turn (observation or corrective message)
    obs_truncated: bool = False  # the observation was cut to fit its budget
    retrieval_ms: float = 0.0  # the tool call's latency (the batch that carried it)
    retriever_error: str | None = None  # the tool failed (search: the retriever did not answer)
    docs: list[dict] | None = None  # what the search returned: id, title, score, start of the text
    call_error: str | None = None  # tool_calls: why the turn's call could not run (not JSON, no such tool, ...)


@dataclass
class Trajectory:
    """One sampled multi-turn episode for one prompt."""

    prompt_id: str  # GRPO group key: `data_source-id`, unique across datasets
    data_source: str
    prompt_ids: list[int]
    golden_answers: list[str]
    sample_idx: int = 0
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # over response_ids
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs, 0.0 on inserted tokens
    turns: list[Turn] = field(default_factory=list)
    end_reason: str | None = None
    response_text: str = ""
    reward: float = 0.0
    excluded: bool = False  # a search failed: kept out of the loss and of its group's statistics

    @property
    def retrieval_failed(self) -> bool:
        return any(turn.retriever_error is not None for turn in self.turns)

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        """Append tokens; `sampled` ones are trained (mask 1), inserted ones are not (mask 0)."""
        self.response_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def to_record(self, tokenizer=None) -> dict:
        """The JSON line written by `agent-rl rollout` (fields fixed by docs/DESIGN.md; `logprobs` added).

        With a tokenizer the record also carries `prompt_text` and `tokens`, one display string
        per response id, so `agent-rl view` renders it from the file alone.
        """
        rec = {
            "prompt_id": self.prompt_id,
            "sample_idx": self.sample_idx,
            "data_source": self.data_source,
            "prompt_tokens": self.prompt_tokens,
            "response_tokens": self.response_tokens,
            "total_tokens": self.total_tokens,
            "turns": [asdict(t) for t in self.turns],
            "num_turns": len(self.turns),
            "end_reason": self.end_reason,
            "loss_mask": self.loss_mask,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
            "response_text": self.response_text,
            "golden_answers": self.golden_answers,
            "reward": self.reward,
            "excluded": self.excluded,
        }
        if tokenizer is not None:
            rec["prompt_text"] = tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
            rec["tokens"] = tokenizer.batch_decode([[i] for i in self.response_ids], skip_special_tokens=False)
        return rec


def write_trajectories(path: Path, trajs: list[Trajectory], tokenizer) -> None:
    """One JSON line per trajectory (`Trajectory.to_record` with token strings) plus EM and F1,
    the file `agent-rl view` reads."""
    from agent_rl.rollout.rewards import answer_scores

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for t in trajs:
            fh.write(json.dumps({**t.to_record(tokenizer), **answer_scores(t.response_text, t.golden_answers)}) + "\n")
