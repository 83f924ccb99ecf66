"""The root of the config tree and its loader: a YAML file plus `key=value` overrides, old names
migrated, each key's type checked, then every section's and the cross-section checks."""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent_rl.config.base import ConfigError
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
