"""The replay log-likelihood, the collapse guard's earliest signal.

A small fixed set of responses that earned a reward in earlier steps (one per prompt, the first
`size` rewarded ones the run samples) is scored under the current policy after every update: the
mean log-prob per trained token. A policy on its way to collapse unlearns what it had got right
before test EM shows it (in the LLDS analysis of Search-R1 the likelihood of once-correct responses
falls from about step 60 while EM holds until step 300). Forward passes over `size` rows, no
backward.

Both signals here run their forwards in micro-batches under `train.max_tokens_per_microbatch`, the
update's own cap: without a backward to keep activations for, each needs less memory than an update's
micro-batch, so the memory plan's update phase bounds them.
"""

from __future__ import annotations

import torch

from agent_rl.learn.batch import MicroBatch, collate, pack_microbatches
from agent_rl.learn.policy import forward_logprobs
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.world import LOCAL, World


def _scored(
    policy: torch.nn.Module,
    trajs: list[Trajectory],
    rows: list[int],
    pad_id: int,
    device: str,
    temperature: float,
    max_tokens: int,
    world: World,
) -> list[tuple[list[int], MicroBatch, torch.Tensor]]:
    """`policy`'s log-probs of `rows` of `trajs`, micro-batch by micro-batch: (rows, micro-batch, log-probs).

    Every rank runs as many forwards as the rank with the most (a sharded policy's gathers are
    collectives); a rank short of them runs its first trajectory again and gets nothing back for it."""
    lengths = [trajs[i].total_tokens for i in rows]
    local = [[rows[k] for k in b] for b in pack_microbatches(lengths, max_tokens)] if rows else []
    most = int(world.all_reduce_max(len(local)))
    out = []
    was_training = policy.training
    policy.eval()
    try:
        for k in range(most):
            index = local[k] if k < len(local) else [0]
            mb = collate(trajs, index, pad_id, device)
            logprobs, _ = forward_logprobs(policy, mb, temperature)
            if k < len(local):
                out.append((index, mb, logprobs))
    finally:
        policy.train(was_training)
    return out


class ReplaySet:
    """Rewarded responses of earlier steps, fixed once `size` are held (each rank holds its own)."""

    def __init__(self, size: int):
        self.size = size
        self.trajs: list[Trajectory] = []
        self._prompts: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.trajs) >= self.size

    def add(self, trajs: list[Trajectory]) -> None:
        """Keep rewarded, trained-on responses, at most one per prompt, until the set is full."""
        for t in trajs:
            if self.full:
                return
            if t.reward > 0 and not t.excluded and any(t.loss_mask) and t.prompt_id not in self._prompts:
                self._keep(t.prompt_id, t.prompt_ids, t.response_ids, t.loss_mask)

    def _keep(self, prompt_id: str, prompt_ids: list[int], response_ids: list[int], mask: list[int]) -> None:
        self._prompts.add(prompt_id)
        row = Trajectory(prompt_id, "", list(prompt_ids), [], response_ids=list(response_ids), loss_mask=list(mask))
        row.logprobs = [0.0] * len(row.response_ids)
        self.trajs.append(row)

    def ready(self, world: World = LOCAL) -> bool:
        """Every rank's set is full (the ranks then all run the forward: FSDP's gathers are collectives)."""
        return world.all_reduce_sum(0.0 if self.full else 1.0) == 0

    @torch.no_grad()
    def logprob(
        self,
        policy: torch.nn.Module,
        pad_id: int,
        device: str,
        temperature: float,
        max_tokens: int,
        world: World = LOCAL,
    ) -> float:
        """Mean log-prob per policy token of the set under `policy`, over every rank's set."""
        total = count = 0.0
        rows = list(range(len(self.trajs)))
        for _, mb, logprobs in _scored(policy, self.trajs, rows, pad_id, device, temperature, max_tokens, world):
            total += float((logprobs * mb.loss_mask).sum())
            count += float(mb.loss_mask.sum())
        return world.all_reduce_sum(total) / max(1.0, world.all_reduce_sum(count))

    def state_dict(self) -> list[dict]:
        return [
            {"prompt_id": t.prompt_id, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "mask": t.loss_mask}
            for t in self.trajs
        ]

    def load_state_dict(self, rows: list[dict]) -> None:
        self.trajs, self._prompts = [], set()
        for r in rows:
            self._keep(r["prompt_id"], r["prompt_ids"], r["response_ids"], r["mask"])


def rewarded_rows(trajs: list[Trajectory], advantages: torch.Tensor, limit: int) -> list[int]:
    """The first `limit` rows of the batch with a positive advantage on some token (what the update raises)."""
    rows: list[int] = []
    for i, t in enumerate(trajs):
        if len(rows) >= limit:
            break
        if not t.excluded and float(advantages[i].max()) > 0:
            rows.append(i)
    return rows


@torch.no_grad()
def row_logprobs(
    policy: torch.nn.Module,
    trajs: list[Trajectory],
    rows: list[int],
    pad_id: int,
    device: str,
    temperature: float,
    max_tokens: int,
    world: World = LOCAL,
) -> dict[int, torch.Tensor]:
    """Each of `rows`' log-probs over its response tokens under `policy` (float32, on the host; 0 where its
    `loss_mask` is 0). The update signal reads them before and after the update through this one function, so
    the two differ by what the update changed and nothing else: the update's own forward packs and shares
    prefixes across other rows, and in bf16 that rounds differently (~1e-4 a token)."""
    out = {}
    for index, _, logprobs in _scored(policy, trajs, rows, pad_id, device, temperature, max_tokens, world):
        for r, i in enumerate(index):
            t = trajs[i]
            out[i] = logprobs[r, t.prompt_tokens : t.total_tokens].float().cpu()
    return out


def update_logprob_change(
    policy: torch.nn.Module,
    trajs: list[Trajectory],
    before: dict[int, torch.Tensor],
    advantages: torch.Tensor,
    pad_id: int,
    device: str,
    temperature: float,
    max_tokens: int,
    world: World = LOCAL,
) -> float | None:
    """Mean, over every rank's trained tokens with a positive advantage in the rows `before` holds, of (log-prob
    under `policy` - `before`); `before` holds each row's `row_logprobs` before the update, and `advantages` is
    the batch's (N, W), aligned with the tokens. What the update set out to raise: a GRPO row's advantage is one
    number, a PPO row's changes sign along the row. None when no rank has a row."""
    rows = list(before)
    if world.all_reduce_sum(float(len(rows))) == 0:
        return None
    after = row_logprobs(policy, trajs, rows, pad_id, device, temperature, max_tokens, world)
    total = count = 0.0
    for i in rows:
        t = trajs[i]
        raised = advantages[i, t.prompt_tokens : t.total_tokens].cpu() > 0
        mask = torch.tensor(t.loss_mask, dtype=torch.bool) & raised
        total += float((after[i] - before[i])[mask].sum())
        count += float(mask.sum())
    return world.all_reduce_sum(total) / max(1.0, world.all_reduce_sum(count))
