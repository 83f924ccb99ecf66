"""Rollout engines behind one small interface: token ids in, token ids + log-probs out.

`base` holds the `Engine` protocol and what the engines share, `hf` the transformers engine (our loop
over the model's forward), `paged` transformers' continuous batching, `vllm` the vLLM adapter (vLLM
itself is imported only when that engine is built). `build_engine` is the one place an `EngineSpec`
(what the engines read of a config) becomes an engine, for the trainer and for `agent-rl rollout` /
`eval`.
"""

from __future__ import annotations

import torch

from agent_rl.rollout.chat_tools import stop_tags as protocol_stop_tags
from agent_rl.rollout.engines import vllm as _vllm
from agent_rl.rollout.engines.base import (
    Engine,
    EngineMemory,
    EngineSpec,
    FullParams,
    Generation,
    ModelShape,
    sample_tokens,
    stop_token_ids,
)
from agent_rl.rollout.engines.hf import HFEngine, rollout_copy
from agent_rl.rollout.engines.paged import PagedEngine, engine_dtype, paged_sizes, plain_copy
from agent_rl.rollout.engines.vllm import VLLMEngine, VLLMWeightSync, hf_named_weights, vllm_engine_kwargs
from agent_rl.rollout.tools import tool_names

__all__ = [
    "Engine",
    "EngineMemory",
    "EngineSpec",
    "FullParams",
    "Generation",
    "HFEngine",
    "ModelShape",
    "PagedEngine",
    "VLLMEngine",
    "VLLMWeightSync",
    "build_engine",
    "engine_memory",
    "hf_named_weights",
    "sample_tokens",
    "stop_token_ids",
    "vllm_engine_kwargs",
]


def engine_memory(spec: EngineSpec, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
    """The memory figures of the engine `build_engine` would build for `spec`, as that engine reports
    them (for `agent-rl plan`); `dtype_bytes`: bytes per weight of `model.dtype`."""
    if spec.engine == "vllm":
        return _vllm.planned_memory(spec, shape, dtype_bytes)
    if spec.engine == "paged":
        return PagedEngine.planned_memory(spec, shape, dtype_bytes)
    return HFEngine.planned_memory(spec, shape, dtype_bytes)


def _sits_on(module: torch.nn.Module, device: str) -> bool:
    want = torch.device(device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    param = next(module.parameters(), None)
    return param is not None and param.device == want


def build_engine(
    spec: EngineSpec,
    policy: torch.nn.Module | None,
    tokenizer,
    seed: int | None = None,
    own_copy: bool = False,
    distributed: bool = False,
    model_path: str | None = None,
) -> Engine:
    """The rollout engine `rollout.engine` names (`auto` resolved by `RolloutConfig.resolved_engine`) on
    `rollout.device`.

    vLLM loads its start weights itself from `model_path` (default: the run's start model,
    `spec.start_model`), so `policy` may be None: build it before the trainer's
    modules take device memory (its reservation is a fraction of what is free). `distributed`: one
    engine per torchrun rank, on the rank's device.

    The HF engine generates with `policy` itself when the module sits on `rollout.device`, so no
    weight sync is needed; otherwise, or with `own_copy` (under FSDP each rank's engine needs an
    unsharded copy), with a frozen copy moved there that `sync_weights` refreshes. The paged engine
    always runs a frozen copy of its own (`plain_copy`), in the trainer's compute dtype.
    """
    seed = spec.seed if seed is None else seed
    rollout = spec.rollout
    # Search-R1's STOP_TAGS for search alone; </tool_call> and the end of turn in tool_calls
    stop_tags = protocol_stop_tags(rollout, tokenizer, tool_names(rollout.tools))
    if spec.engine == "vllm":
        if distributed and rollout.tensor_parallel_size > 1:
            raise ValueError(
                "rollout.tensor_parallel_size > 1 under torchrun is not supported yet: each rank runs its own engine "
                "(set it to 1)"
            )
        path = model_path or spec.start_model
        return VLLMEngine(path, tokenizer, spec, seed=seed, distributed=distributed, stop_tags=stop_tags)
    if policy is None:
        raise ValueError("the HF and paged rollout engines generate with the policy's weights: pass the loaded model")
    device = rollout.device
    if spec.engine == "paged":
        seqs, blocks, batch_tokens = paged_sizes(spec)
        return PagedEngine(
            plain_copy(policy, device, engine_dtype(spec)),
            tokenizer,
            device=device,
            max_sequences=seqs,
            num_blocks=blocks,
            max_batch_tokens=batch_tokens,
            seed=seed,
            stop_tags=stop_tags,
        )
    module = policy if not own_copy and _sits_on(policy, device) else rollout_copy(policy, device)
    return HFEngine(
        module,
        tokenizer,
        device=device,
        batch_size=rollout.generation_batch_size,
        seed=seed,
        bf16=spec.bf16,
        stop_tags=stop_tags,
        decode=rollout.hf_decode,
    )
