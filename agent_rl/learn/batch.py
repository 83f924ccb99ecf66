"""Trajectories into micro-batches for the update.

Micro-batches are packed longest-first so rows of similar length share a batch, and every
micro-batch satisfies rows x longest row <= `max_tokens_per_microbatch` (a hard cap: config
validation guarantees one maximal trajectory fits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_rl.rollout.trajectory import Trajectory


def pack_microbatches(lengths: list[int], max_tokens: int, groups: list | None = None) -> list[list[int]]:
    """Indices grouped so that len(group) * max(lengths in group) <= max_tokens, longest first.

    With `groups` (a key per row, e.g. the prompt id), rows of one group stay next to each other
    (groups longest first, rows longest first inside), so a micro-batch can share their prompt.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if groups is not None:
        longest_of: dict = {}
        for i in order:
            longest_of.setdefault(groups[i], lengths[i])
        rank = {g: k for k, g in enumerate(sorted(longest_of, key=lambda g: -longest_of[g]))}
        order.sort(key=lambda i: rank[groups[i]])  # stable: longest first inside a group
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(f"a trajectory of {lengths[i]} tokens exceeds train.max_tokens_per_microbatch ({max_tokens})")
        new_longest = max(longest, lengths[i])
        if current and (len(current) + 1) * new_longest > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


@dataclass
class MicroBatch:
    """Right-padded tensors of one micro-batch; every (B, T) tensor is aligned with input_ids.

    `loss_mask[b, t]` is 1 where token t of row b was sampled by the policy: the loss at logits
    position t-1 predicting token t. `old_logprobs`, `ref_logprobs`, `advantages`, `returns`,
    `values` share that indexing (column t = token t).
    """

    index: list[int]  # rows of the rollout batch
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T) float
    prompt_lengths: list[int] = field(default_factory=list)  # per row; lets the forward share a group's prompt
    rollout_logprobs: torch.Tensor | None = None  # (B, T) the engine's log-probs of the sampled tokens, 0 elsewhere

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def collate(trajs: list[Trajectory], index: list[int], pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    rows = [trajs[i] for i in index]
    width = max(t.total_tokens for t in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    engine_lp = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, t in enumerate(rows):
        seq = t.prompt_ids + t.response_ids
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[r, : len(seq)] = 1
        mask[r, t.prompt_tokens : len(seq)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        engine_lp[r, t.prompt_tokens : len(seq)] = torch.tensor(t.logprobs, dtype=torch.float32)
    return MicroBatch(
        index=list(index), input_ids=ids.to(device), attention_mask=attn.to(device), loss_mask=mask.to(device),
        prompt_lengths=[t.prompt_tokens for t in rows], rollout_logprobs=engine_lp.to(device),
    )
