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
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable, Sequence

import torch

from agent_rl.rollout.engines.base import (
    EngineMemory,
    FullParams,
    Generation,
    ModelShape,
    sample_tokens,
    stop_token_ids,
)
from agent_rl.rollout.padding import distinct, left_pad
from agent_rl.rollout.protocol import STOP_TAGS


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
    def planned_memory(cfg, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
        """A frozen copy of the weights where it does not generate with the trained module (another
        device), and during the rollout the KV cache of its largest batch at the longest trajectory
        plus two float32 rows of logits per sequence (the step's logits and their log-softmax)."""
        held = {}
        if str(cfg.rollout.device) != str(cfg.train.device):
            held["rollout_copy"] = shape.params() * dtype_bytes
        kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
        seqs = min(cfg.rollout.generation_batch_size, cfg.rollout.prompts_per_step * cfg.algo.group_size)
        kv = seqs * cfg.budget.max_total_tokens * kv_per_token + seqs * shape.vocab * 4 * 2
        return EngineMemory(held=held, rollout={"kv_cache": kv}, on_host=str(cfg.rollout.device) == "cpu")

    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        batch_size: int = 128,
        seed: int = 0,
        bf16: bool = False,
        stop_tags: Sequence[str] = STOP_TAGS,
    ):
        self.model = model
        # bf16 compute over the model's own weights (autocast), as the trainer computes with `train.bf16`:
        # engine and trainer log-probs then come from the same arithmetic.
        self.bf16 = bf16
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer, stop_tags)  # the tools' closing tags and </answer>
        # Multi-token tags (real hub tokenizers) are caught as stop strings on the decoded tail.
        single = {tokenizer.decode([i]) for i in self.stop_ids}
        self.stop_strings = [t for t in stop_tags if t not in single]
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
        own = self.model.state_dict()
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
        cast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
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
        bsz = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(bsz)]
        logps: list[list[float]] = [[] for _ in range(bsz)]
        finish = ["length"] * bsz
        rows = torch.tensor(
            [i for i in range(bsz) if max_new[i] > 0], dtype=torch.long
        )  # original index of each live row
        if len(rows) == 0:
            return [Generation([], [], "length") for _ in range(bsz)]
        # A GRPO group repeats its prompt: prefill each distinct prompt once, then copy its cache rows.
        unique, copy_of = distinct(prompts[i] for i in rows.tolist())
        input_ids, attention, positions = left_pad(unique, self.pad_id, self.device)
        limits = torch.tensor(max_new, dtype=torch.long)
        stop_ids = torch.tensor(self.stop_ids, dtype=torch.long)
        # The prefill needs the next-token logits of the last position only (`logits_to_keep`): the LM head over
        # every prompt position would be a (rows x prompt length x vocabulary) product thrown away.
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        if len(unique) < len(rows):
            expand = torch.tensor(copy_of, dtype=torch.long, device=self.device)
            past.batch_select_indices(expand)
            logits, attention, positions = logits[expand], attention[expand], positions[expand]
        last_pos = positions[:, -1]
        active = torch.ones(len(rows), dtype=torch.bool)
        row_gens = (
            None if seeds is None else [torch.Generator(device="cpu").manual_seed(int(seeds[i])) for i in rows.tolist()]
        )
        for _ in range(int(limits.max().item())):
            ids, lp = sample_tokens(logits, temperature, top_p, self.generator if row_gens is None else row_gens)
            ids, lp = ids.cpu(), lp.cpu()
            live, ids_l, lp_l = rows.tolist(), ids.tolist(), lp.tolist()
            for r in torch.nonzero(active).flatten().tolist():
                tokens[live[r]].append(ids_l[r])
                logps[live[r]].append(lp_l[r])
            hit_stop = torch.isin(ids, stop_ids) & active
            if self.stop_strings:
                for r in torch.nonzero(active & ~hit_stop).flatten().tolist():
                    tail = self.tokenizer.decode(tokens[live[r]][-8:], skip_special_tokens=False)
                    if any(s in tail for s in self.stop_strings):
                        hit_stop[r] = True
            for r in torch.nonzero(hit_stop).flatten().tolist():
                finish[live[r]] = "stop"
            reached = torch.tensor([len(tokens[i]) for i in live]) >= limits[rows]
            active = active & ~hit_stop & ~reached
            if not bool(active.any()):
                break
            if int((~active).sum()) * 4 >= len(rows):
                # A quarter of the rows are done: drop them from the batch and the KV cache, so
                # one long row does not keep paying for the finished ones.
                keep = torch.nonzero(active).flatten()
                past.batch_select_indices(keep.to(self.device))
                rows, ids, active = rows[keep], ids[keep], active[keep]
                if row_gens is not None:
                    row_gens = [row_gens[i] for i in keep.tolist()]
                keep = keep.to(self.device)
                attention, last_pos = attention[keep], last_pos[keep]
            # Finished rows not yet dropped keep feeding a pad with attention 0.
            feed = torch.where(active, ids, torch.full_like(ids, self.pad_id)).to(self.device)
            attention = torch.cat([attention, active.long().to(self.device)[:, None]], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=feed[:, None],
                attention_mask=attention,
                position_ids=last_pos[:, None],
                past_key_values=past,
                use_cache=True,
            )
            past, logits = out.past_key_values, out.logits[:, -1, :]
        self.stats["generated_tokens"] += sum(len(t) for t in tokens)
        return [Generation(tokens[i], logps[i], finish[i]) for i in range(bsz)]
