"""Sections of what a run is: the run's control (steps, output, checkpoints, logging), the policy model
and its LoRA adapters, and the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import with_config

from agent_rl.config.base import Bool, ConfigError, Float, Int, List, Section, Str, _check_choices, _f


@with_config(extra="forbid")
@dataclass
class RunConfig:
    """Settings of one training run: its length, output directory, checkpoints, evaluation and seed.
    The live run these settings drive (models, optimizer, step counter) is `agent_rl.run.Run`."""

    output_dir: Str = _f(
        "runs/tiny_cpu_grpo", "Directory for metrics.jsonl, TensorBoard events, checkpoints/ and plots/."
    )
    max_steps: Int = _f(60, "Number of RL steps (one rollout batch + its update epochs each).")
    save_every: Int = _f(20, "Save a checkpoint every N steps (and always at the end or on SIGTERM/SIGINT).")
    keep_last: Int = _f(2, "How many checkpoints to keep under OUTPUT_DIR/checkpoints.")
    overwrite: Bool = _f(
        False,
        "A run started without --resume in an OUTPUT_DIR that holds an earlier run's checkpoints deletes them "
        "(true) or refuses to start (false: they would mix with the new run's, and a later --resume could pick the "
        "earlier run's latest step).",
    )
    save_trajectories_every: Int = _f(
        0,
        "Every N steps write OUTPUT_DIR/trajectories/step_N.jsonl for `agent-rl view` (0 = off): token ids and "
        "strings, loss mask, engine and trainer log-probs, advantages, turns with their documents.",
    )
    save_trajectories_per_step: Int = _f(
        8,
        "Trajectories written at each of those steps: the step's first ones (whole groups when a multiple of "
        "algo.group_size; rank 0's share under torchrun). Bounds the files' size.",
    )
    seed: Int = _f(0, "Seed for python, numpy and torch; rollouts and updates are reproducible on CPU.")
    dist_timeout_s: Float = _f(
        1800.0,
        "torchrun: seconds a collective waits for the slowest rank before the process group fails the run "
        "(torch's own default, 30 minutes). Every rank rolls out and evaluates its own share, so a wait is one "
        "share's imbalance; raise it where one rank's step can take longer than this.",
    )
    deterministic: Bool = _f(
        False,
        "Ask torch for deterministic kernels everywhere (torch.use_deterministic_algorithms, oneDNN's deterministic "
        "mode, and on CUDA a fixed cuBLAS workspace), so that a seeded run and its --resume reach the same weights bit "
        "for bit wherever torch allows (same machine, build and thread count). The trainer's own CPU path is written "
        "to be reproducible without it; this extends the guarantee to every op (other models, LoRA, kernels added "
        "later), and an op torch has no deterministic kernel for warns instead of failing. Off by default: serial "
        "kernels and filling newly allocated tensors cost speed.",
    )
    eval_every: Int = _f(0, "Evaluate on data.test_files every N steps (0 = only at the start and the end).")
    eval_at_start: Bool = _f(
        True,
        "Evaluate the starting model on data.test_files before the first step (step 0; verl's val_before_train). "
        "Off where the start is already scored, e.g. runs of several estimators from one warm start.",
    )
    eval_max_samples: Int = _f(200, "At most this many test prompts per evaluation (0 = all).")
    eval_sampled: Bool = _f(
        False, "Also evaluate one sample per prompt at rollout.temperature (logged as eval_sampled/em)."
    )
    log_every: Int = _f(1, "Print a progress line every N steps.")
    tensorboard: Bool = _f(True, "Also write TensorBoard events under OUTPUT_DIR/tb.")
    wandb: Bool = _f(
        False,
        "Also log to Weights & Biases (needs the wandb extra: pip install 'agent-rl[wandb]'): the same metric names "
        "and steps as TensorBoard (plotted against the `step` metric), the resolved config as the W&B run's config, "
        "tables of a few trajectories at each evaluation and each run.save_trajectories_every step. The run id is "
        "kept in OUTPUT_DIR/wandb_run_id, so --resume continues the same W&B run.",
    )
    wandb_project: Str = _f("agent-rl", "W&B project of the run; the run is named after run.output_dir's folder.")
    wandb_entity: Str = _f("", "W&B entity (user or team) of the run; empty = the account's default.")
    wandb_mode: Str = _f(
        "",
        "W&B mode: online | offline | disabled; empty = $WANDB_MODE when set, else offline (the run's files under "
        "OUTPUT_DIR/wandb, or $WANDB_DIR/wandb; upload them later with `wandb sync DIR`). Online needs `wandb login` "
        "(or WANDB_API_KEY) and a reachable service.",
    )
    wandb_on_missing: Str = _f(
        "error",
        "With run.wandb, what a missing wandb package or a W&B start that fails (no credentials, service unreachable) "
        "does: error (stop at start-up with the install or the setting to fix) | warn (a warning, then the run logs "
        "without W&B). Either way a W&B call that fails mid-run only warns once and switches W&B off.",
    )
    preflight: Bool = _f(
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


@with_config(extra="forbid")
@dataclass
class LoraConfig:
    enabled: Bool = _f(
        False,
        "Train LoRA adapters only (peft); the frozen base doubles as the reference model. Other model.lora.* keys "
        "need it written out: true, or false to train full weights with them unused (e.g. an override of a LoRA "
        "config).",
    )
    rank: Int = _f(8, "LoRA rank r.")
    alpha: Int = _f(16, "LoRA scaling alpha.")
    dropout: Float = _f(0.0, "Dropout on the LoRA branch.")
    target_modules: List = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Module names that get adapters."
    )


@with_config(extra="forbid")
@dataclass
class ModelConfig:
    path: Str = _f(".cache/tiny_model", "Hugging Face model directory or hub id (policy and reference start from it).")
    init_size: Str = _f(
        "", "When set (tiny|small|base|medium) and `path` does not exist, `agent-rl init-model` builds it first."
    )
    init_pretokenizer: Str = _f(
        "bytelevel",
        "How init_size's tokenizer cuts text before BPE: bytelevel (GPT-2's: a word carries the space before it, "
        "so a name is other tokens after a quote) | isolated_spaces (spaces and punctuation runs are tokens of "
        "their own: a word is the same tokens wherever it stands, as when a name is copied from a passage into a "
        "tool call's JSON; texts take more tokens, so budgets need more room; the tiny tool_calls demo's warm start "
        "learned to read worse with it, see bench/RESULTS.md).",
    )
    init_template_phrases: Bool = _f(
        False,
        "Under rollout.protocol=tool_calls, init_size's tokenizer holds each fixed text of the chat template between "
        "its control tokens as one token: the system message's text and the tools' schemas, a call up to its "
        'argument (`{"name": "search", "arguments": {"query": "`), so a prompt is about as short as the tag '
        "protocol's (what it changes for the tiny demo: bench/RESULTS.md); a pretrained model's tokenizer is its own "
        "and this does not apply.",
    )
    preset: Str = _f(
        "",
        "When set (smollm2-135m) and `path` holds no model, `agent-rl init-model --preset` converts that real "
        "pretrained model from its installed package into `path` first.",
    )
    dtype: Str = _f(
        "float32",
        "Storage dtype of what is not trained: the frozen reference copy, LoRA's frozen base and the rollout "
        "engine's weights (float32 | bfloat16). Trained parameters and AdamW state are always float32 (master "
        "weights); train.bf16 sets the compute dtype.",
    )
    warm_start: Str = _f(
        "",
        "Directory of a supervised warm start (`agent-rl sft`); when set, training starts from it, running `sft` "
        "first if it is missing.",
    )
    gradient_checkpointing: Bool = _f(False, "Recompute activations in backward to save memory.")
    lora: Section[LoraConfig] = field(
        default_factory=LoraConfig, metadata={"help": "LoRA adapters (see model.lora.*)."}
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "dtype": ("float32", "bfloat16", "float16"),
        "init_pretokenizer": ("bytelevel", "isolated_spaces"),
    }

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
        if self.init_pretokenizer != "bytelevel" and not self.init_size:
            raise ConfigError(
                f"model.init_pretokenizer = {self.init_pretokenizer!r} shapes the tokenizer of a model that "
                "model.init_size builds; set init_size, or leave init_pretokenizer at bytelevel"
            )
        if self.init_template_phrases and not self.init_size:
            raise ConfigError(
                "model.init_template_phrases shapes the tokenizer of a model that model.init_size builds; set "
                "init_size, or leave init_template_phrases false"
            )
        if self.init_size not in ("", "tiny", "small", "base", "medium"):
            raise ConfigError(f"model.init_size = {self.init_size!r}: use tiny, small, base, medium or leave it empty")


@with_config(extra="forbid")
@dataclass
class DataConfig:
    train_files: List = _f(
        [".cache/toy_world/train.parquet"], "Parquet files written by `data-prep qa` / `toy-world` for training."
    )
    test_files: List = _f([".cache/toy_world/test.parquet"], "Parquet files for evaluation (EM per data_source).")
    toy_world: Str = _f("", "When set, `data-prep toy-world` writes the toy world to this directory on first use.")
    toy_entities: Int = _f(1000, "Entities in the toy world (when data.toy_world is set).")
    shuffle: Bool = _f(True, "Shuffle the training prompts each epoch (seeded).")
    qa_source: Str = _f(
        "",
        "When set, a FlashRAG-layout questions JSONL (`id`, `question`, `golden_answers`, `metadata`) split on first "
        "use into data.train_files[0] / data.test_files[0] (the first data.qa_test_size rows are the test split), "
        "prompts rendered with data.template.",
    )
    qa_dataset: Str = _f("hotpotqa", "data_source name of data.qa_source's rows (GRPO group ids are prefixed by it).")
    qa_test_size: Int = _f(20, "Rows of data.qa_source held out as the test split.")
    template: Str = _f(
        "auto",
        "Prompt template for data.qa_source: auto (the model's chat template, Search-R1's instruction as the user "
        "turn, when the tokenizer has one; else base) | chat | base | compact.",
    )

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"template": ("auto", "chat", "base", "compact")}

    def validate(self) -> None:
        """The data section's own checks; a message names the key and says what to do."""
        _check_choices("data", self, self.CHOICES)
