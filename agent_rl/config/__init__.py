"""The typed configuration tree, loaded from YAML with `key=value` overrides.

Every field carries its documentation in `field(metadata={"help": ...})`; a test fails when one
does not. An unknown key, a wrong type (checked by pydantic against the sections' dataclasses) or a
bad combination fails at load time with a message naming the key and the fix; a renamed section
(`trainer`, now `run`) is still read, with a warning (`migrate_sections`). The sections live by job:
`experiment` (run, model, data), `generation` (retriever, rollout, budget), `training` (algo, train,
reward, buffer, sft, guard, memory); `plugins` loads the user's rewards and tools; `loader` holds the
root `Config` and `load_config`.
"""

from agent_rl.config.base import ConfigError
from agent_rl.config.experiment import DataConfig, LoraConfig, ModelConfig, RunConfig
from agent_rl.config.generation import BudgetConfig, RetrieverConfig, RolloutConfig
from agent_rl.config.loader import (
    RENAMED_KEYS,
    RENAMED_SECTIONS,
    Config,
    iter_fields,
    load_config,
    migrate_keys,
    migrate_sections,
    parse_overrides,
)
from agent_rl.config.plugins import BUILTIN_REWARDS, BUILTIN_TOOLS, load_object, load_reward, load_tool_object
from agent_rl.config.training import (
    PREFIX_MAX_SHARE,
    AlgoConfig,
    BufferConfig,
    GuardConfig,
    MemoryConfig,
    RewardConfig,
    SftConfig,
    TrainConfig,
)

__all__ = [
    "BUILTIN_REWARDS",
    "BUILTIN_TOOLS",
    "PREFIX_MAX_SHARE",
    "RENAMED_KEYS",
    "RENAMED_SECTIONS",
    "AlgoConfig",
    "BudgetConfig",
    "BufferConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "GuardConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "RetrieverConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SftConfig",
    "TrainConfig",
    "iter_fields",
    "load_config",
    "load_object",
    "load_reward",
    "load_tool_object",
    "migrate_keys",
    "migrate_sections",
    "parse_overrides",
]
