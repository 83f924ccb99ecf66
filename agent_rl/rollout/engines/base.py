"""What every rollout engine shares: the `Engine` protocol, `Generation`, the stop tokens and the sampler.

Engines stop each row at the first stop token (`</search>`, `</answer>`, eos) or stop string, so
no token is generated past a tag (Search-R1 lets every turn run to its length limit, #151). They
return the sampled ids and their log-probs under the sampling distribution; nothing here decodes
and re-tokenizes what will be trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from agent_rl.config import RolloutConfig
from agent_rl.rollout.protocol import STOP_TAGS

if TYPE_CHECKING:
    from agent_rl.config import Config

# `full_params(dtype)`: (name, full tensor) for every entry of a sharded policy's state dict, one
# tensor at a time, named as the unsharded model's; a collective every rank runs in step.
FullParams = Callable[[torch.dtype | None], Iterable[tuple[str, torch.Tensor]]]


class ModelShape(Protocol):
    """What an engine's memory figures read of the model (the planner's `Arch` is one)."""

    hidden: int
    layers: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int: ...

    def params(self) -> int: ...


@dataclass(frozen=True)
class EngineSpec:
    """What the engines read of a run's config: the rollout section, the budget's total, and the few
    keys of other sections that set an engine's dtype, its copy, its size and its start weights.
    `from_config` is the one place they are read; `build_engine`, the engines and their memory figures
    take this."""

    rollout: RolloutConfig
    max_total_tokens: int  # budget.max_total_tokens: the longest trajectory
    trajectories_per_step: int  # rollout.prompts_per_step x algo.group_size
    train_device: str
    compute_dtype: str  # the trainer's compute dtype: bfloat16 under train.bf16, else model.dtype
    bf16: bool  # train.bf16: the HF engine computes under bf16 autocast, as the trainer does
    lora: bool  # model.lora.enabled: the weights an engine is handed are merged adapters
    start_model: str  # model.warm_start, else model.path: what vLLM loads
    seed: int  # run.seed

    @classmethod
    def from_config(cls, cfg: Config) -> EngineSpec:
        return cls(
            rollout=cfg.rollout,
            max_total_tokens=cfg.budget.max_total_tokens,
            trajectories_per_step=cfg.rollout.prompts_per_step * cfg.algo.group_size,
            train_device=str(cfg.train.device),
            compute_dtype="bfloat16" if cfg.model.dtype == "bfloat16" or cfg.train.bf16 else cfg.model.dtype,
            bf16=cfg.train.bf16,
            lora=cfg.model.lora.enabled,
            start_model=cfg.model.warm_start or cfg.model.path,
            seed=cfg.run.seed,
        )

    @property
    def engine(self) -> str:
        """`rollout.engine` with `auto` resolved."""
        return self.rollout.resolved_engine()

    @property
    def device(self) -> str:
        return str(self.rollout.device)

    @property
    def sequences(self) -> int:
        """The most sequences one rollout batch holds: rollout.generation_batch_size, at most a step's
        trajectories."""
        return min(self.rollout.generation_batch_size, self.trajectories_per_step)


@dataclass
class EngineMemory:
    """An engine's own memory figures for `agent-rl plan`, in bytes by component name.

    `held`: through both phases (an engine that cannot sleep keeps it during the update);
    `rollout`: only while it generates (freed or asleep during the update). A value of -1 is a
    share of the device the planner fills in from its budget. `on_host`: the figures are host RAM
    (a CPU engine), else memory of each rollout device. `imports`: the import statements the
    engine runs in the trainer's process, whose resident bytes no formula knows: the planner
    measures them on its own machine."""

    held: dict[str, int]
    rollout: dict[str, int]
    on_host: bool
    imports: tuple[str, ...] = ()


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop tag / eos) | "length" (hit its allowance)


class Engine(Protocol):
    """What the agent loop and the trainer use of a rollout engine.

    `seeds` (one per prompt) makes each row's draws its own: the same seed gives the same tokens
    whatever else is in the batch (the asynchronous loop batches whatever is ready). Without
    seeds the engine draws from its own `generator`, which checkpoints save.
    """

    generator: torch.Generator
    stats: dict
    # The most prompts the asynchronous loop puts in one `generate` call (0: any number).
    batch_size: int

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[Generation]: ...

    def sleep(self, discard_weights: bool = False) -> None:
        """Give memory back while the trainer updates; with `discard_weights` the engine may drop its
        weights outright, because the caller syncs every weight before the next generation."""

    def wake(self) -> None:
        """Take it again before generating."""

    def close(self) -> None:
        """Release the engine (its memory and whatever it set up in the process); it is not used after.
        Called before the process group is destroyed: an engine may have built groups of its own on it."""

    def sync_weights(self, policy: torch.nn.Module, full_params: FullParams | None = None) -> None:
        """Sample from `policy`'s current weights from now on (after each update).

        `full_params` is given when `policy` is sharded across ranks (FSDP): the engine reads the
        weights through it (every rank calls this in step). Without it `policy` is a plain module,
        read directly."""


def copy_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy (name, tensor) pairs into an engine's own `model`; returns how many. A name the model lacks is an
    error: the copy would otherwise keep stale weights."""
    own = model.state_dict()
    n = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in own:
                raise KeyError(
                    f"weight sync: the rollout model has no tensor named {name!r}; it must be built from the "
                    "same model as the trained one"
                )
            own[name].copy_(tensor)
            n += 1
    return n


def stop_token_ids(tokenizer, stop_tags: Sequence[str] = STOP_TAGS) -> list[int]:
    """Ids of the stop tags when the tokenizer has them as single tokens, plus eos."""
    ids = []
    for tag in stop_tags:
        tok = tokenizer.convert_tokens_to_ids(tag)
        if isinstance(tok, int) and tok != tokenizer.unk_token_id and tok is not None and tok >= 0:
            if tokenizer.decode([tok]) == tag:
                ids.append(tok)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _after(tag: str, state: int, text: str) -> int:
    """The matcher's state after `text` from `state` (len(tag) once the tag has occurred): the longest prefix
    of `tag` that the text read so far ends with."""
    seen = tag[:state] + text
    if tag in seen:
        return len(tag)
    return next((k for k in range(min(len(tag) - 1, len(seen)), 0, -1) if seen.endswith(tag[:k])), 0)


def _transitions(tag: str, texts: list[str]) -> torch.Tensor:
    """(len(tag) + 1, V): the state after each token id from each state (the last state: the tag occurred).

    Computed in full for the tokens holding the tag's first character; when that character occurs once in the
    tag (`</search>`'s `<`), any other token leads back to 0 except where it continues the tag read so far or
    completes it, which are looked up rather than computed for every state and token."""
    n, first = len(tag), tag[0]
    table = torch.zeros((n + 1, len(texts)), dtype=torch.int32)
    table[n] = n
    once = tag.count(first) == 1
    for v, text in enumerate(texts):
        if not once or first in text:
            for q in range(n):
                table[q, v] = _after(tag, q, text)
    if once:
        by_text: dict[str, list[int]] = {}
        for v, text in enumerate(texts):
            if text and first not in text:
                by_text.setdefault(text, []).append(v)
        for q in range(1, n):
            rest = tag[q:]
            for k in range(1, len(rest) + 1):
                for v in by_text.get(rest[:k], ()):
                    table[q, v] = q + k
            ends = [v for v, text in enumerate(texts) if first not in text and text.startswith(rest)]
            table[q, ends] = n
    return table


class StopStrings:
    """Stop strings matched on token ids, on the device: per string an automaton over the vocabulary (its state
    is the longest prefix of the string that a row's text ends with), advanced by one gather a decode step.

    A string is caught however it was tokenized: SmolLM2 writes `</search>` as 3 tokens, or with `>` merged into
    the next character (`>.`, `><`); the string may end inside the token that completes it, which is kept, as
    a decoded tail would find it. Token texts are each id decoded alone (`skip_special_tokens=False`)."""

    def __init__(self, tokenizer, strings: Sequence[str], vocab_size: int, device: torch.device | str):
        self.strings = [s for s in strings if s]
        known = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(min(known, vocab_size))], skip_special_tokens=False)
        texts += [""] * (vocab_size - len(texts))  # ids past the tokenizer's (a padded embedding) read as nothing
        tables = [_transitions(s, texts) for s in self.strings]
        width = max((t.shape[0] for t in tables), default=1)
        stacked = torch.zeros((len(tables), width, vocab_size), dtype=torch.int32)
        for k, t in enumerate(tables):
            stacked[k, : t.shape[0]] = t
        self.table = stacked.to(device)
        self.done = torch.tensor([len(s) for s in self.strings], dtype=torch.int32, device=device)
        self._which = torch.arange(len(self.strings), device=device)[None, :]

    def __bool__(self) -> bool:
        return bool(self.strings)

    def start(self, rows: int) -> torch.Tensor:
        """The states of `rows` fresh rows: (rows, strings)."""
        return torch.zeros((rows, len(self.strings)), dtype=torch.long, device=self.table.device)

    def step(self, state: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state: (B, S), ids: (B,) the tokens just sampled -> (the new state, (B,) True where a string ended)."""
        new = self.table[self._which, state, ids[:, None]]
        return new.long(), (new == self.done).any(-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | list[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (B, V) -> (token ids (B,), log-probs (B,)) under the sampling distribution.

    `generator` is one generator for the batch, or one per row (each row's draws its own)."""
    logits = logits.float()
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        ids = logits.argmax(dim=-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    # Inverse-CDF sampling: one uniform per row, where torch.multinomial draws one per vocabulary
    # entry (much slower on CPU at a decode step's shape).
    cdf = probs.cumsum(-1)
    if isinstance(generator, list):
        u = (
            torch.cat([torch.rand((1, 1), generator=g, dtype=cdf.dtype) for g in generator]).to(cdf.device)
            * cdf[:, -1:]
        )
    else:
        u = torch.rand((probs.shape[0], 1), generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
    ids = (
        torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1).squeeze(-1)
    )  # first entry with cdf > u: never a 0-probability token
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
