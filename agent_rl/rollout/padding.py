"""Token sequences into batched tensors, shared by the engine's decode and the policy forward."""

from __future__ import annotations

import torch


def distinct(seqs) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct token sequences in first-seen order, and each input's position among them
    (a GRPO group repeats its prompt: its rows map to one entry)."""
    keys: dict[tuple[int, ...], int] = {}
    index = [keys.setdefault(tuple(s), len(keys)) for s in seqs]
    return list(keys), index


def left_pad(seqs, pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention, positions), each (N, longest), left-padded so every row ends on its last
    token: the layout a KV-cached continuation needs."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attn[r, width - len(s) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)
