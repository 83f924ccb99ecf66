"""Training and test prompts: parquet rows from `data-prep` -> tokenized `PromptItem`s.

The prompt is never truncated. A prompt longer than `budget.max_prompt_tokens` is dropped
here, counted per data source and reported, so the one long sample cannot show up hours in.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.turns import PromptItem


def load_tokenizer(path: str):
    """The model's tokenizer; its EOS pads where it names no pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@dataclass
class PromptSet:
    items: list[PromptItem]
    metadata: list[dict]
    questions: list[str]
    dropped: Counter = field(default_factory=Counter)


def load_prompts(files: list[str], tokenizer, budget: TokenBudget, max_samples: int = 0) -> PromptSet:
    items, metas, questions = [], [], []
    dropped: Counter = Counter()
    for f in files:
        path = Path(f)
        if not path.exists():
            raise FileNotFoundError(
                f"data file {path} does not exist; write it with `data-prep qa` or `data-prep toy-world`"
            )
        table = pq.read_table(path)
        missing = {"uid", "data_source", "prompt", "golden_answers"} - set(table.column_names)
        if missing:
            raise ValueError(f"{path} lacks columns {sorted(missing)}; it must be written by `data-prep`")
        rows = table.to_pylist()
        for row in rows:
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            if not budget.admits_prompt(len(ids)):
                dropped[row["data_source"]] += 1
                continue
            items.append(PromptItem(row["uid"], row["data_source"], ids, list(row["golden_answers"])))
            meta = row.get("metadata") or "{}"
            metas.append(json.loads(meta) if isinstance(meta, str) else dict(meta))
            questions.append(row.get("question", ""))
            if max_samples and len(items) >= max_samples:
                break
        if max_samples and len(items) >= max_samples:
            break
    for source, n in dropped.items():
        print(
            f"[data] dropped {n} {source} prompts longer than budget.max_prompt_tokens={budget.max_prompt_tokens}",
            file=sys.stderr,
        )
    if not items:
        raise ValueError(f"no admissible prompts in {files} (budget.max_prompt_tokens={budget.max_prompt_tokens})")
    return PromptSet(items, metas, questions, dropped)
