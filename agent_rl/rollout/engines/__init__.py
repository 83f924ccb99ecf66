"""Rollout engines behind one small interface: token ids in, token ids + log-probs out.

`base` holds the `Engine` protocol and what the engines share, `hf` the transformers engine (our loop
over the model's forward), `paged` transformers' continuous batching, `vllm` the vLLM adapter (vLLM
itself is imported only when that engine is built). `build_engine` is the one place a config becomes
an engine, for the trainer and for `agent-rl rollout` / `eval`.
"""

from __future__ import annotations

import torch

from agent_rl.rollout.chat_tools import stop_tags as protocol_stop_tags
from agent_rl.rollout.engines import vllm as _vllm
from agent_rl.rollout.engines.base import (
    Engine,
    EngineMemory,
    FullParams,
    Generation,
    ModelShape,
    sample_tokens,
    stop_token_ids,
)
from agent_rl.rollout.engines.hf import HFEngine, rollout_copy
from agent_rl.rollout.engines.paged import PagedEngine, engine_dtype, paged_sizes, plain_copy
from agent_rl.rollout.engines.vllm import VLLMEngine, VLLMWeightSync, hf_named_weights, vllm_dtype, vllm_engine_kwargs
from agent_rl.rollout.tools import tool_names

__all__ = [
    "Engine",
    "EngineMemory",
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
    "vllm_dtype",
    "vllm_engine_kwargs",
]


def engine_memory(cfg, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
    """The memory figures of the engine `build_engine` would build for `cfg`, as that engine reports
    them (for `agent-rl plan`); `dtype_bytes`: bytes per weight of `model.dtype`."""
    engine = cfg.rollout.resolved_engine()
    if engine == "vllm":
        return _vllm.planned_memory(cfg, shape, dtype_bytes)
    if engine == "paged":
        return PagedEngine.planned_memory(cfg, shape, dtype_bytes)
    return HFEngine.planned_memory(cfg, shape, dtype_bytes)


def _sits_on(module: torch.nn.Module, device: str) -> bool:
    want = torch.device(device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    param = next(module.parameters(), None)
    return param is not None and param.device == want


def build_engine(
    cfg,
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
    `model.warm_start` or `model.path`), so `policy` may be None: build it before the trainer's
    modules take device memory (its reservation is a fraction of what is free). `distributed`: one
    engine per torchrun rank, on the rank's device.

    The HF engine generates with `policy` itself when the module sits on `rollout.device`, so no
    weight sync is needed; otherwise, or with `own_copy` (under FSDP each rank's engine needs an
    unsharded copy), with a frozen copy moved there that `sync_weights` refreshes. The paged engine
    always runs a frozen copy of its own (`plain_copy`), in the trainer's compute dtype.
    """
    seed = cfg.run.seed if seed is None else seed
    # Search-R1's STOP_TAGS for search alone; </tool_call> and the end of turn in tool_calls
    stop_tags = protocol_stop_tags(cfg.rollout, tokenizer, tool_names(cfg.rollout.tools))
    if cfg.rollout.resolved_engine() == "vllm":
        if distributed and cfg.rollout.tensor_parallel_size > 1:
            raise ValueError(
                "rollout.tensor_parallel_size > 1 under torchrun is not supported yet: each rank runs its own engine "
                "(set it to 1)"
            )
        path = model_path or cfg.model.warm_start or cfg.model.path
        return VLLMEngine(path, tokenizer, cfg, seed=seed, distributed=distributed, stop_tags=stop_tags)
    if policy is None:
        raise ValueError("the HF and paged rollout engines generate with the policy's weights: pass the loaded model")
    device = cfg.rollout.device
    if cfg.rollout.resolved_engine() == "paged":
        seqs, blocks, batch_tokens = paged_sizes(cfg)
        return PagedEngine(
            plain_copy(policy, device, engine_dtype(cfg)),
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
        batch_size=cfg.rollout.generation_batch_size,
        seed=seed,
        bf16=cfg.train.bf16,
        stop_tags=stop_tags,
        decode=cfg.rollout.hf_decode,
    )
