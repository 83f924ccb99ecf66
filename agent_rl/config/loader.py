"""The root of the config tree and its loader: a YAML file plus `key=value` overrides, old names
migrated, each key's type checked by pydantic against the sections' dataclasses (the types in
agent_rl/config/base.py), then every section's own checks and those across sections."""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError, with_config
from pydantic_core import ErrorDetails

from agent_rl.config.base import ConfigError, Section, type_name
from agent_rl.config.experiment import DataConfig, ModelConfig, RunConfig
from agent_rl.config.generation import BudgetConfig, RetrieverConfig, RolloutConfig
from agent_rl.config.training import (
    AlgoConfig,
    BufferConfig,
    GuardConfig,
    MemoryConfig,
    RewardConfig,
    SftConfig,
    TrainConfig,
)


@with_config(extra="forbid")
@dataclass
class Config:
    run: Section[RunConfig] = field(
        default_factory=RunConfig,
        metadata={"help": "Run control: steps, output directory, checkpoints, evaluation, seed (formerly `trainer`)."},
    )
    model: Section[ModelConfig] = field(default_factory=ModelConfig, metadata={"help": "Policy model."})
    data: Section[DataConfig] = field(default_factory=DataConfig, metadata={"help": "Training and test prompts."})
    retriever: Section[RetrieverConfig] = field(
        default_factory=RetrieverConfig, metadata={"help": "Retrieval server and client."}
    )
    rollout: Section[RolloutConfig] = field(
        default_factory=RolloutConfig, metadata={"help": "Generation engine and sampling."}
    )
    budget: Section[BudgetConfig] = field(
        default_factory=BudgetConfig, metadata={"help": "Hard token budgets of a trajectory."}
    )
    algo: Section[AlgoConfig] = field(default_factory=AlgoConfig, metadata={"help": "PPO / GRPO."})
    train: Section[TrainConfig] = field(default_factory=TrainConfig, metadata={"help": "Optimisation."})
    reward: Section[RewardConfig] = field(default_factory=RewardConfig, metadata={"help": "Reward function."})
    buffer: Section[BufferConfig] = field(default_factory=BufferConfig, metadata={"help": "Trajectory buffer bounds."})
    sft: Section[SftConfig] = field(
        default_factory=SftConfig, metadata={"help": "Supervised warm start (`agent-rl sft`)."}
    )
    guard: Section[GuardConfig] = field(default_factory=GuardConfig, metadata={"help": "Collapse guard."})
    memory: Section[MemoryConfig] = field(
        default_factory=MemoryConfig, metadata={"help": "Memory budgets for the planner."}
    )

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
        if self.model.init_template_phrases and self.rollout.protocol != "tool_calls":
            raise ConfigError(
                "model.init_template_phrases holds a chat template's fixed text as tokens, which only "
                f"rollout.protocol=tool_calls renders (rollout.protocol is {self.rollout.protocol!r})"
            )
        if self.algo.loss_agg_tokens < 0:
            raise ConfigError(
                f"algo.loss_agg_tokens must be >= 0 (0: the most tokens a trajectory can train on), got "
                f"{self.algo.loss_agg_tokens}"
            )
        if self.algo.loss_agg == "seq-mean-token-sum-norm" and self.algo.loss_agg_tokens == 0:
            # the most tokens one trajectory can train on (Dr. GRPO's generation budget), resolved here so that the
            # run's saved config holds it
            b = self.budget
            most = min(b.max_total_tokens - b.max_prompt_tokens, (b.max_turns + 1) * b.max_tokens_per_turn)
            self.algo.loss_agg_tokens = most
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


@functools.cache
def _adapter() -> TypeAdapter[Config]:
    """pydantic's checker of the whole tree, built on first use rather than at import."""
    return TypeAdapter(Config)


def _build(data: dict) -> Config:
    """`data` as a Config, each key checked against its section's declared type (agent_rl.config.base);
    pydantic's first error becomes a ConfigError naming the dotted key and what it expects."""
    try:
        return _adapter().validate_python(data)
    except ValidationError as err:
        raise _config_error(err.errors()[0]) from None


def _config_error(error: ErrorDetails) -> ConfigError:
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # a section's own __post_init__ check, its message as written
        return cause
    # Down pydantic's path to the key: `section` holds it, `hint` is its type. A part past a leaf key
    # names a member of the key's union (`str | list`), not a key.
    section: Any = None
    hint: Any = Config
    keys: list[str] = []
    for part in error["loc"]:
        if not dataclasses.is_dataclass(hint):
            break
        section, hint = hint, typing.get_type_hints(hint).get(str(part))
        keys.append(str(part))
    key = ".".join(keys)
    if error["type"] == "unexpected_keyword_argument":
        fields = [f.name for f in dataclasses.fields(section)]
        prefix = key.removesuffix(keys[-1])
        close = [prefix + k for k in fields if k.startswith(keys[-1][:3])]
        hint_text = f" Did you mean {', '.join(close)}?" if close else ""
        return ConfigError(f"unknown config key '{key}'. Valid keys here: {', '.join(sorted(fields))}.{hint_text}")
    if error["type"] == "dataclass_type":
        return ConfigError(f"{key or 'config'} must be a mapping, got {type(error['input']).__name__}")
    return ConfigError(f"config key '{key}' expects {type_name(hint)}, got {error['input']!r}")


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
    cfg = _build(data)
    # LoRA settings without `enabled` are a forgotten switch; `enabled: false` written out (in the file or an
    # override) turns the adapters off and leaves their settings standing aside, to switch back on.
    lora = (data.get("model") or {}).get("lora") or {}
    lora_keys = sorted(k for k in lora if k != "enabled")
    if lora_keys and "enabled" not in lora:
        raise ConfigError(
            f"model.lora.{lora_keys[0]} is set but model.lora.enabled is not, so full weights would be trained: "
            "set model.lora.enabled=true, or model.lora.enabled=false to train full weights with the LoRA keys unused"
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
