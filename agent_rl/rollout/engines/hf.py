"""`HFEngine`: batched, left-padded, KV-cached sampling over a transformers causal LM (CPU or one GPU).

Each decode step is the model's own forward over its KV cache; `sample_tokens` draws from the
logits with one generator per row when the caller gives seeds. The engine shares the module with
the trainer when it sits on the rollout device, so no weight sync is needed; otherwise it holds a
frozen copy that `sync_weights` overwrites after each update.

Why a loop over the forward and not transformers' `generate()`: a rollout needs each row to draw
with its own seed (the async driver's trajectories sample the same tokens whatever they are batched
with) and to stop at its own token allowance (the budget); here a GRPO group's repeated prompt is
prefilled once and its cache rows copied, and rows that finished leave the batch. `generate()` does
none of these, returns log-probs only through the scores it keeps for every step (rows x vocabulary
floats each), and measured no faster, with its static cache or with its decode step compiled
(`bench/engines.py --engines hf generate generate-static generate-compile`, bench/RESULTS.md).

On a GPU a decode step of a small model is bound by the host, not the device: SmolLM2-135M's forward dispatches
thousands of aten ops a step, each a kernel launch (bench/RESULTS.md has the count and the tokens/s).
`decode` picks how the steps run: `dynamic` (transformers' DynamicCache; finished rows leave the batch), `static`
(a StaticCache of the batch's whole length and a 4D attention mask over its slots, both updated in place, so every
step has the same shapes and addresses; finished rows stay in the batch, computed and ignored) and `graph` (the
static step captured once per batch as a CUDA graph and replayed: one launch a step instead of thousands; CUDA
only). `auto` is graph on CUDA and dynamic elsewhere. The static and graph paths need the model's attention to
take a 4D boolean mask (`sdpa`, transformers' default); `static` runs on the CPU, so the steps a graph replays are
tested there.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable, Sequence

import torch
from transformers import StaticCache

from agent_rl.rollout.engines.base import (
    EngineMemory,
    EngineSpec,
    FullParams,
    Generation,
    ModelShape,
    StopStrings,
    copy_weights,
    sample_tokens,
    stop_token_ids,
)
from agent_rl.rollout.padding import distinct, left_pad
from agent_rl.rollout.protocol import STOP_TAGS

DECODE_MODES = ("auto", "dynamic", "static", "graph")


def resolve_decode(mode: str, device: torch.device, model) -> str:
    """`mode` (DECODE_MODES) on `device` for `model`: auto is graph on CUDA, else dynamic; a mode the device or
    the model's attention cannot run is an error naming rollout.hf_decode."""
    if mode not in DECODE_MODES:
        raise ValueError(f"rollout.hf_decode = {mode!r} is not one of {', '.join(DECODE_MODES)}")
    attention = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if mode == "auto":
        return "graph" if device.type == "cuda" and attention == "sdpa" else "dynamic"
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"rollout.hf_decode = graph needs a CUDA device (rollout.device is {device}): use auto")
    if mode in ("static", "graph") and attention != "sdpa":
        raise ValueError(
            f"rollout.hf_decode = {mode} needs the model's attention to take a 4D mask (sdpa); it is {attention}: "
            "use dynamic"
        )
    return mode


class StaticDecode:
    """The decode step over a transformers StaticCache with fixed-shape inputs: the step's ids and positions are
    copied into buffers of the batch's size, the attention mask is the caller's (rows, 1, 1, slots) boolean
    tensor, set in place as slots fill. With `graph` (CUDA), the first `WARMUP` steps run eagerly on a side stream
    (what capture needs: kernels chosen, lazy state made), the next is captured as a CUDA graph, and it and every
    later step are one replay. The graph is this batch's only: its shapes and the cache's addresses are."""

    WARMUP = 2

    def __init__(self, model, past, mask: torch.Tensor, graph: bool):
        self.model, self.past, self.mask, self.graph_on = model, past, mask, graph
        rows = mask.shape[0]
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=mask.device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=mask.device)
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            position_ids=self.pos,
            past_key_values=self.past,
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The next-token logits (rows, vocabulary) after feeding `ids` (rows,) at positions `pos` (rows,)."""
        self.ids.copy_(ids[:, None])
        self.pos.copy_(pos[:, None])
        self.steps += 1
        if not self.graph_on:
            return self._forward()
        if self.graph is None:
            device = self.mask.device
            if self.steps <= self.WARMUP:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    logits = self._forward()
                torch.cuda.current_stream(device).wait_stream(side)
                return logits
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (the trainer's, an async loop's) does not void the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # recorded; the replay runs it
                self.logits = self._forward()
        self.graph.replay()
        assert self.logits is not None  # set by the capture above
        return self.logits


def rollout_copy(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """A frozen copy of `model` on `device`, for an engine that must not generate with the trained module."""
    module = copy.deepcopy(model).to(device)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class HFEngine:
    """Batched sampling with a KV cache over a transformers causal LM."""

    @staticmethod
    def planned_memory(spec: EngineSpec, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
        """A frozen copy of the weights where it does not generate with the trained module (another
        device), and during the rollout the KV cache of its largest batch at the longest trajectory
        plus two float32 rows of logits per sequence (the step's logits and their log-softmax)."""
        held = {}
        if spec.device != spec.train_device:
            held["rollout_copy"] = shape.params() * dtype_bytes
        kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
        seqs = spec.sequences
        kv = seqs * spec.max_total_tokens * kv_per_token + seqs * shape.vocab * 4 * 2
        return EngineMemory(held=held, rollout={"kv_cache": kv}, on_host=spec.device == "cpu")

    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        batch_size: int = 128,
        seed: int = 0,
        bf16: bool = False,
        stop_tags: Sequence[str] = STOP_TAGS,
        decode: str = "auto",
    ):
        self.model = model
        # bf16 compute over the model's own weights (autocast), as the trainer computes with `train.bf16`:
        # engine and trainer log-probs then come from the same arithmetic.
        self.bf16 = bf16
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.decode = resolve_decode(decode, self.device, model)
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer, stop_tags)  # the tools' closing tags and </answer>
        # Multi-token tags (real hub tokenizers) are stop strings, matched on the sampled ids on the device.
        single = {tokenizer.decode([i]) for i in self.stop_ids}
        vocab = max(len(tokenizer), int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0))
        self.stop_strings = StopStrings(tokenizer, [t for t in stop_tags if t not in single], vocab, self.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"generated_tokens": 0, "generate_s": 0.0}

    def sleep(self, discard_weights: bool = False) -> None:
        """Nothing to free: the model is the policy itself or a plain copy, and the KV cache lives
        only inside `generate`."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Nothing of its own beyond the model, which the garbage collector frees."""

    def sync_weights(self, policy: torch.nn.Module, full_params: FullParams | None = None) -> None:
        """Copy the policy's weights into the engine's own copy; a no-op when the engine generates with
        the policy module itself. Sharing a sharded policy is refused: ranks sample different lengths,
        and a sharded forward would wait forever on the other ranks' all-gathers."""
        if self.model is policy:
            if full_params is not None:
                raise RuntimeError(
                    "the HF rollout engine shares the FSDP-sharded policy; under torchrun build it with its own "
                    "unsharded copy (build_engine(..., own_copy=True), a frozen_copy made before shard_model): "
                    "ranks generate different lengths"
                )
            return
        self.load_weights(policy.state_dict().items() if full_params is None else full_params(None))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (name, tensor) pairs into the engine's own model; returns how many. A name the model
        lacks is an error: the copy would otherwise keep stale weights."""
        return copy_weights(self.model, named_tensors)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        out: list[Generation] = []
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        # A captured graph replays the casts it recorded; autocast's cache of cast weights must not outlive it.
        cast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.decode != "graph")
            if self.bf16
            else contextlib.nullcontext()
        )
        try:
            for lo in range(0, len(prompts), self.batch_size):
                with cast:
                    batch = self._generate_batch(
                        prompts[lo : lo + self.batch_size],
                        max_new_tokens[lo : lo + self.batch_size],
                        temperature,
                        top_p,
                        None if seeds is None else seeds[lo : lo + self.batch_size],
                    )
                out.extend(batch)
        finally:
            self.model.train(was_training)
        self.stats["generate_s"] += time.perf_counter() - start
        return out

    def _generate_batch(self, prompts, max_new, temperature, top_p, seeds=None) -> list[Generation]:
        """One batch, decoded step by step on the device: what rows sampled, their lengths and how they ended stay
        in device tensors until the batch is done; the host learns one thing a step, which rows are still live."""
        bsz = len(prompts)
        live = [i for i in range(bsz) if max_new[i] > 0]
        if not live:
            return [Generation([], [], "length") for _ in range(bsz)]
        dev = self.device
        width = max(max_new)
        static = self.decode != "dynamic"
        # A GRPO group repeats its prompt: prefill each distinct prompt once, then copy its cache rows.
        unique, copy_of = distinct(prompts[i] for i in live)
        input_ids, attention, positions = left_pad(unique, self.pad_id, dev)
        past = StaticCache(config=self.model.config, max_cache_len=input_ids.shape[1] + width) if static else None
        # The prefill needs the next-token logits of the last position only (`logits_to_keep`): the LM head over
        # every prompt position would be a (rows x prompt length x vocabulary) product thrown away.
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        if len(unique) < len(live):
            expand = torch.tensor(copy_of, dtype=torch.long, device=dev)
            if static:
                past.reorder_cache(expand)  # a StaticCache has no batch_select_indices; index_select either way
            else:
                past.batch_select_indices(expand)
            logits, attention, positions = logits[expand], attention[expand], positions[expand]
        last_pos = positions[:, -1]
        step = None
        if static:
            # The mask over the cache's slots: the prompts' now, each decode slot as it is written (by the rows
            # still live, as the dynamic path appends `active`).
            slot = attention.shape[1]
            mask = torch.zeros((len(live), 1, 1, slot + width), dtype=torch.bool, device=dev)
            mask[:, 0, 0, :slot] = attention.bool()
            step = StaticDecode(self.model, past, mask, graph=self.decode == "graph")
        # Per original row: the sampled ids and log-probs (one spare column: a finished row writes there, unread),
        # how many it kept, and whether it ended on a stop.
        ids_out = torch.full((bsz, width + 1), self.pad_id, dtype=torch.long, device=dev)
        lp_out = torch.zeros((bsz, width + 1), dtype=torch.float32, device=dev)
        length = torch.zeros(bsz, dtype=torch.long, device=dev)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=dev)
        limit = torch.tensor(max_new, dtype=torch.long, device=dev)
        stop_ids = torch.tensor(self.stop_ids, dtype=torch.long, device=dev)
        at = torch.tensor(live, dtype=torch.long, device=dev)  # the original row of each row of the batch
        active = torch.ones(len(live), dtype=torch.bool, device=dev)
        state = self.stop_strings.start(len(live)) if self.stop_strings else None
        row_gens = None if seeds is None else [torch.Generator(device="cpu").manual_seed(int(seeds[i])) for i in live]
        for _ in range(width):
            ids, lp = sample_tokens(logits, temperature, top_p, self.generator if row_gens is None else row_gens)
            pos = length[at]
            ids_out[at, pos], lp_out[at, pos] = ids, lp.float()
            length[at] = pos + active.long()
            hit = torch.isin(ids, stop_ids)
            if state is not None:
                state, ended = self.stop_strings.step(state, ids)
                hit = hit | ended
            hit = hit & active
            stopped[at] = stopped[at] | hit
            active = active & ~hit & (length[at] < limit[at])
            on_host = active.cpu()  # the step's one transfer
            n_live = int(on_host.sum())
            if n_live == 0:
                break
            # Finished rows not yet dropped keep feeding a pad with attention 0.
            feed = torch.where(active, ids, torch.full_like(ids, self.pad_id))
            last_pos = last_pos + 1
            if step is not None:  # static shapes: finished rows stay in the batch
                mask[:, 0, 0, slot] = active
                slot += 1
                logits = step(feed, last_pos)
                continue
            if (len(on_host) - n_live) * 4 >= len(on_host):
                # A quarter of the rows are done: drop them from the batch and the KV cache, so
                # one long row does not keep paying for the finished ones.
                keep_host = torch.nonzero(on_host).flatten()
                keep = keep_host.to(dev)
                past.batch_select_indices(keep)
                at, feed, active, attention, last_pos = (
                    at[keep],
                    feed[keep],
                    active[keep],
                    attention[keep],
                    last_pos[keep],
                )
                if state is not None:
                    state = state[keep]
                if row_gens is not None:
                    row_gens = [row_gens[i] for i in keep_host.tolist()]
            attention = torch.cat([attention, active.long()[:, None]], dim=1)
            out = self.model(
                input_ids=feed[:, None],
                attention_mask=attention,
                position_ids=last_pos[:, None],
                past_key_values=past,
                use_cache=True,
            )
            past, logits = out.past_key_values, out.logits[:, -1, :]
        lengths, ended_stop = length.tolist(), stopped.tolist()
        ids_host, lp_host = ids_out.cpu(), lp_out.cpu()
        self.stats["generated_tokens"] += sum(lengths)
        finish = ["stop" if e else "length" for e in ended_stop]
        return [
            Generation(ids_host[i, : lengths[i]].tolist(), lp_host[i, : lengths[i]].tolist(), finish[i])
            for i in range(bsz)
        ]
