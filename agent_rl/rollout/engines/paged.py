"""`PagedEngine`: transformers' continuous batching (`ContinuousBatchingManager`: a paged KV cache,
rows joining and leaving the batch as they start and finish, CUDA graphs where the attention kernel
allows) as a rollout engine; the GPU engine where vLLM is not installed (`rollout.engine=auto`).

Each `generate` call is one manager over the engine's own copy of the policy: every request is
queued before the manager's thread starts, the thread runs them to completion, and the manager is
stopped, so its paged cache (and any prefix it shares) never outlives the weights it was computed
with and nothing is held during the update. The draws are torch.multinomial from the process-wide
generator, which the manager seeds in its thread from a seed drawn from `self.generator`; with every
request queued first, the batches it forms, and so the draws, are the same on every run.

What it cannot do, and how that shows:
- Per-row seeds (the `seeds` argument): transformers samples every row of a step from one
  generator, so a row's draws depend on what it is batched with. `generate` refuses them, and the
  config refuses `rollout.mode=async` (whose trajectories are seeded one by one) with this engine.
- Stop strings exactly: a tag that is several tokens (most hub tokenizers; the tiny model's tags are
  one token each) is caught on the streamed tokens and the row cancelled; the cancellation lands a
  step or so later, at a time that changes from run to run, so with such tags sampled draws are not
  reproducible (the returned tokens still end at the tag: what the row generated past it is dropped).
- Generating with the trained module itself: the manager takes over the module it runs (its attention
  implementation, eval mode, a thread of its own where the trainer's autocast does not reach), so the
  engine always holds a frozen copy in the trainer's compute dtype, which `sync_weights` overwrites.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from agent_rl.rollout.engines.base import (
    EngineMemory,
    EngineSpec,
    FullParams,
    Generation,
    ModelShape,
    StopStrings,
    copy_weights,
    stop_token_ids,
)
from agent_rl.rollout.engines.vllm import hf_named_weights
from agent_rl.rollout.protocol import STOP_TAGS

# Tokens per page of the paged cache (transformers' default; `ContinuousBatchingConfig.block_size` in
# transformers 5.17, renamed `page_size` since).
PAGE_TOKENS = 256


def engine_dtype(spec: EngineSpec) -> torch.dtype:
    """The dtype of the engine's copy: the trainer's compute dtype, so engine and trainer log-probs
    come from the same arithmetic."""
    return getattr(torch, spec.compute_dtype)


def paged_sizes(spec: EngineSpec) -> tuple[int, int, int]:
    """(sequences, cache blocks, batch tokens): room in the paged cache for the KV of
    min(rollout.generation_batch_size, one step's trajectories) sequences at budget.max_total_tokens
    each, and up to max(budget.max_total_tokens, 2048) tokens in one forward step, so a whole prefill
    fits one step."""
    seqs = spec.sequences
    blocks = seqs * math.ceil(spec.max_total_tokens / PAGE_TOKENS)
    return seqs, blocks, max(spec.max_total_tokens, 2048)


def plain_copy(policy: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of `policy` as a plain causal LM on `device` in `dtype` (LoRA adapters merged in),
    its KV cache on: what `PagedEngine` runs."""
    module: Any = copy.deepcopy(policy)
    if hasattr(module, "peft_config"):
        module = module.merge_and_unload()
    module = module.to(device=device, dtype=dtype).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    module.config.use_cache = True  # a policy with gradient checkpointing has it off
    return module


class PagedEngine:
    """transformers' continuous batching over a frozen copy of the policy (CPU or one GPU)."""

    batch_size = 0  # every waiting request in one call; the manager's scheduler sizes its own batches

    @staticmethod
    def planned_memory(spec: EngineSpec, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
        """Its copy of the weights through both phases; during the rollout its paged KV cache
        (`paged_sizes`), the attention mask eager / SDPA attention reads over the whole cache (flash
        attention needs none: an upper bound there), and two float32 rows of logits per sequence."""
        act = torch.tensor([], dtype=engine_dtype(spec)).element_size()
        seqs, blocks, batch_tokens = paged_sizes(spec)
        cache_tokens = blocks * PAGE_TOKENS
        kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * act
        return EngineMemory(
            held={"rollout_copy": shape.params() * act},
            rollout={
                "paged_kv_cache": cache_tokens * kv_per_token,
                "paged_attention_mask": batch_tokens * (cache_tokens + batch_tokens) * act,
                "paged_logits": seqs * shape.vocab * 4 * 2,
            },
            on_host=spec.device == "cpu",
        )

    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        max_sequences: int = 128,
        num_blocks: int = 384,
        max_batch_tokens: int = 2048,
        seed: int = 0,
        stop_tags: Sequence[str] = STOP_TAGS,
    ):
        self.model = model  # the engine's own copy (`plain_copy`): the manager takes it over while it runs
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_sequences, self.num_blocks, self.max_batch_tokens = max_sequences, num_blocks, max_batch_tokens
        self.stop_ids = stop_token_ids(tokenizer, stop_tags)  # the tools' closing tags and </answer>, eos
        single = {tokenizer.decode([i]) for i in self.stop_ids}
        self.stop_strings = [t for t in stop_tags if t not in single]  # multi-token tags, caught on the stream
        vocab = max(len(tokenizer), int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0))
        self._stops = StopStrings(tokenizer, self.stop_strings, vocab, "cpu")  # matched on the streamed ids
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"generated_tokens": 0, "generate_s": 0.0, "weight_syncs": 0}

    def sleep(self, discard_weights: bool = False) -> None:
        """Nothing to free: the paged cache lives only inside `generate`; the copy of the weights stays
        (the HF engine's copy does too)."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Nothing of its own beyond the copy, which the garbage collector frees."""

    def sync_weights(self, policy: torch.nn.Module, full_params: FullParams | None = None) -> None:
        """Copy the policy's weights into the engine's copy: a plain policy's tensors as they are (LoRA
        merged, under the base names), a sharded one's gathered one parameter at a time."""
        self.load_weights(hf_named_weights(policy) if full_params is None else full_params(self.model.dtype))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (name, tensor) pairs into the engine's copy; returns how many. A name the copy lacks is
        an error: it would otherwise keep stale weights."""
        n = copy_weights(self.model, named_tensors)
        self.stats["weight_syncs"] += 1
        return n

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        if seeds is not None:
            raise ValueError(
                "the paged engine cannot seed rows one by one (transformers draws every row of a step from one "
                "generator): rollout.mode=async needs rollout.engine=hf or vllm"
            )
        start = time.perf_counter()
        gens = [Generation([], [], "length") for _ in prompts]
        live = [i for i, n in enumerate(max_new_tokens) if n > 0]
        if live:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator).item())
            # The manager seeds the process-wide generators in its thread; the trainer's draws stay its own.
            cuda = []
            if self.device.type == "cuda":
                cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            with torch.random.fork_rng(devices=cuda):
                outs = self._run(
                    [prompts[i] for i in live], [max_new_tokens[i] for i in live], temperature, top_p, seed
                )
            for i, g in zip(live, outs):
                gens[i] = g
        self.stats["generated_tokens"] += sum(len(g.token_ids) for g in gens)
        self.stats["generate_s"] += time.perf_counter() - start
        return gens

    def _configs(self, rows: int, temperature: float, top_p: float, seed: int):
        import dataclasses

        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if temperature > 0:  # top_k=0: the full distribution, which the trainer scores
            gen = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            gen = GenerationConfig(do_sample=False)
        gen.eos_token_id = list(self.stop_ids)
        names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        page = "page_size" if "page_size" in names else "block_size"
        kwargs: dict[str, Any] = {page: PAGE_TOKENS, "num_blocks": self.num_blocks}
        kwargs |= {"max_batch_tokens": self.max_batch_tokens, "max_requests_per_batch": min(self.max_sequences, rows)}
        return gen, ContinuousBatchingConfig(**kwargs, return_logprobs=True, seed=seed)

    def _run(
        self, prompts: list[list[int]], max_new: list[int], temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        gen_cfg, cb_cfg = self._configs(len(prompts), temperature, top_p, seed)
        manager = self.model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        streaming = bool(self.stop_strings)  # each new token is seen, so a row stops at its tag
        slots: dict[str, int] = {}  # request id -> row, while the row runs
        seen: dict[str, tuple[int, torch.Tensor] | None] = {}  # request id -> tokens matched so far, matcher state
        for i, (prompt, n) in enumerate(zip(prompts, max_new)):
            rid = manager.add_request(list(prompt), max_new_tokens=n, streaming=streaming)
            if rid is None:
                raise RuntimeError("transformers' continuous batching refused a request before it started")
            slots[rid] = i
        out: list[Generation | None] = [None] * len(prompts)
        manager.start()  # after every request is queued: its first step sees them all
        try:
            while slots:
                res = manager.get_result(timeout=1.0)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError(
                            f"transformers' continuous batching loop stopped with {len(slots)} requests unanswered"
                        )
                    continue
                slot = slots.get(res.request_id)
                if slot is None:  # a row already stopped at its tag: what it generated since is dropped
                    continue
                if res.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {res.error}")
                if streaming:
                    searched = seen.get(res.request_id) or (0, self._stops.start(1))
                    done, seen[res.request_id] = self._finished(res, searched)
                else:
                    done, _ = self._finished(res, None)
                if done is not None:
                    out[slot] = done
                    del slots[res.request_id]
                    if not res.is_finished():
                        manager.cancel_request(res.request_id)
        finally:
            # stop() gives the module its attention back and drops the paged cache, which reference
            # counting frees; it and the batch processor's finalizer also run a full gc.collect() each,
            # ~0.4 s apiece in a trainer's process on 2 cores. With every live object frozen, they scan
            # next to nothing.
            gc.freeze()
            try:
                manager.stop(block=True)
            finally:
                gc.unfreeze()
        assert all(g is not None for g in out)
        return out  # type: ignore[return-value]

    def _finished(
        self, res, searched: tuple[int, torch.Tensor] | None
    ) -> tuple[Generation | None, tuple[int, torch.Tensor] | None]:
        """The row's Generation once it is done: at a stop id, at a stop string (matched on the stream's ids
        from token `searched[0]` on, the matcher in state `searched[1]`; None: not streamed), or at its
        allowance; None while it runs. Also where the search got to. A missing log-prob is an error, never a
        zero."""
        ids, lps = list(res.generated_tokens), list(res.logprobs)
        if len(lps) != len(ids):
            raise RuntimeError(f"transformers returned {len(lps)} log-probs for {len(ids)} sampled tokens")
        if searched is not None:
            start, state = searched
            for j in range(start, len(ids)):
                state, ended = self._stops.step(state, torch.tensor([ids[j]]))
                if ids[j] in self.stop_ids or bool(ended[0]):
                    return Generation(ids[: j + 1], lps[: j + 1], "stop"), None
            searched = (len(ids), state)
        if not res.is_finished():
            return None, searched
        return Generation(ids, lps, "stop" if ids and ids[-1] in self.stop_ids else "length"), None
