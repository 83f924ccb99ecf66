"""Trajectories into the step's batch, and the batch into micro-batches for the forward passes.

`RolloutBatch` is built once from the step's trajectories: padded (rows x longest) tensors of
ids, masks and engine log-probs, later the old / reference log-probs, values, advantages and
returns; every pass takes its micro-batches as row slices of it (`RolloutBatch.micro`).
Micro-batches are packed longest-first so rows of similar length share a batch, and every
micro-batch satisfies rows x longest row <= `max_tokens_per_microbatch` (a hard cap: config
validation guarantees one maximal trajectory fits).

Every micro-batch carries its rows on the host too (`HostRows`: ids, loss mask, lengths), which the batch already
holds before it moves them: the forward plans its passes (trained positions, packing, shared prompts) from them, so
it never waits for the device to learn a length or a position. Host tensors go to a CUDA device through pinned
memory without waiting (`to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_rl.rollout.trajectory import Trajectory
from agent_rl.world import World


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
            raise ValueError(
                f"a trajectory of {lengths[i]} tokens exceeds train.max_tokens_per_microbatch ({max_tokens})"
            )
        new_longest = max(longest, lengths[i])
        if current and (len(current) + 1) * new_longest > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory and without waiting: a copy from pageable memory
    first waits for the stream, so the host would stall on the previous micro-batch's backward."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class HostRows:
    """A micro-batch's rows on the host: what the forward's plans read, so they never read the device."""

    input_ids: torch.Tensor  # (B, T) on the host
    loss_mask: torch.Tensor  # (B, T) on the host
    lengths: list[int]  # tokens of each row (prompt + response)


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
    # filled by `RolloutBatch.micro` once the batch is scored
    old_logprobs: torch.Tensor | None = None  # (B, T)
    ref_logprobs: torch.Tensor | None = None  # (B, T)
    values: torch.Tensor | None = None  # (B, T)
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)
    host: HostRows | None = None  # the rows on the host; `collate` and `RolloutBatch.micro` fill it

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def on_host(self) -> HostRows:
        """`host`; a micro-batch built without it (by hand) reads it from its tensors once."""
        if self.host is None:
            lengths = [int(n) for n in self.attention_mask.sum(-1).tolist()]
            self.host = HostRows(self.input_ids.cpu(), self.loss_mask.cpu(), lengths)
        return self.host


def collate(
    trajs: list[Trajectory],
    index: list[int],
    pad_id: int,
    device: torch.device | str = "cpu",
    observation_weight: float = 0.0,
) -> MicroBatch:
    """Rows `index` of `trajs` as padded (B, T) tensors. `loss_mask` is 1 at sampled tokens and
    `observation_weight` at the response's other tokens (the observations; 0 in RL, SFT's
    `sft.observation_loss`), 0 over the prompt and the padding."""
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
        mask[r, t.prompt_tokens : len(seq)] = torch.tensor(
            [1.0 if m else observation_weight for m in t.loss_mask] if observation_weight else t.loss_mask,
            dtype=torch.float32,
        )
        engine_lp[r, t.prompt_tokens : len(seq)] = torch.tensor(t.logprobs, dtype=torch.float32)
    return MicroBatch(
        index=list(index),
        input_ids=to_device(ids, device),
        attention_mask=to_device(attn, device),
        loss_mask=to_device(mask, device),
        prompt_lengths=[t.prompt_tokens for t in rows],
        rollout_logprobs=to_device(engine_lp, device),
        host=HostRows(ids, mask, [t.total_tokens for t in rows]),
    )


def even_microbatches(batches: list[list[int]], world: World) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches padded to the most any rank has: `(index, real)` pairs.

    FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in every
    backward, so a rank that ran fewer micro-batches would leave the others waiting forever.
    Padding entries repeat the first micro-batch with `real=False`: run them with loss weight 0
    (the gradient is unchanged) and leave them out of the metrics.
    """
    out = [(b, True) for b in batches]
    most = int(world.all_reduce_max(len(batches)))
    if most > len(batches):
        if not batches:
            raise RuntimeError(
                f"rank {world.rank} has no trajectories to train on while others have; every rank needs at least one "
                "group per step (raise buffer.max_tokens)"
            )
        out += [(batches[0], False)] * (most - len(batches))
    return out


_SCORED = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")


@dataclass
class RolloutBatch:
    """The step's trajectories as padded (N, W) tensors on the host, W the longest row.

    Column t of every tensor is token t of the row (prompt + response), as in `MicroBatch`.
    `old_logprobs` is None on the single-pass path (one epoch, one mini-batch: the update's own
    forward is the old policy); `ref_logprobs` without a reference, `values` without a critic.
    """

    trajs: list[Trajectory]
    rows: MicroBatch  # every row, index 0..N-1
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory], pad_id: int) -> RolloutBatch:
        return cls(trajs=trajs, rows=collate(trajs, list(range(len(trajs))), pad_id))

    def __len__(self) -> int:
        return len(self.trajs)

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.rows.loss_mask

    @property
    def on_policy(self) -> bool:
        """No separate old log-probs: the update's first forward is the sampling policy."""
        return self.old_logprobs is None

    def lengths(self, members: list[int] | range | None = None) -> list[int]:
        members = range(len(self.trajs)) if members is None else members
        return [self.trajs[i].total_tokens for i in members]

    def micro(self, index: list[int], device: torch.device | str) -> MicroBatch:
        """Rows `index`, cut to their longest row and moved to `device` (their host copy kept as `host`)."""
        lengths = self.lengths(index)
        width = max(lengths)
        rows = torch.tensor(index, dtype=torch.long)

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[rows, :width]

        def take(t: torch.Tensor) -> torch.Tensor:
            return to_device(cut(t), device)

        ids, mask = cut(self.rows.input_ids), cut(self.rows.loss_mask)
        scored = {name: take(t) for name in _SCORED if (t := getattr(self, name)) is not None}
        return MicroBatch(
            index=list(index),
            input_ids=to_device(ids, device),
            attention_mask=take(self.rows.attention_mask),
            loss_mask=to_device(mask, device),
            prompt_lengths=[self.rows.prompt_lengths[i] for i in index],
            rollout_logprobs=None if self.rows.rollout_logprobs is None else take(self.rows.rollout_logprobs),
            host=HostRows(ids, mask, lengths),
            **scored,
        )
