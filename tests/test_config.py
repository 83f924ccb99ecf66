"""Config tree: documented fields, clear errors on unknown keys and bad combinations."""

from pathlib import Path

import pytest

from agent_rl.config import Config, ConfigError, iter_fields, load_config, parse_overrides

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


def test_every_field_is_documented():
    """Every config key carries a help text (the verl rule: no undocumented key)."""
    undocumented = [key for key, f in iter_fields() if not f.metadata.get("help")]
    assert undocumented == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every YAML in configs/ loads and validates."""
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_unknown_key_names_the_key(tmp_path):
    """A typo fails at load with the dotted key and the valid alternatives."""
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"algo\.group_sise.*group_size"):
        load_config(p)


def test_wrong_type_is_rejected():
    """A string where an int belongs fails with the key's name."""
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        load_config(None, ["trainer.max_steps=ten"])


def test_overrides_parse_yaml_scalars():
    """key=value overrides reach the right field with YAML types (null, numbers, lists)."""
    cfg = load_config(
        None, ["algo.group_size=4", "retriever.url=null", "train.lr=1e-5", "data.train_files=[a.parquet]"]
    )
    assert cfg.algo.group_size == 4 and cfg.retriever.url is None and cfg.train.lr == 1e-5
    assert cfg.data.train_files == ["a.parquet"]
    assert parse_overrides(["a.b.c=1"]) == {"a": {"b": {"c": 1}}}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["novalue"])


def test_budget_total_may_bind_but_must_hold_one_answer_turn():
    """A total below prompt + max_turns x (turn + obs) + answer is accepted (it binds at run time,
    ASearcher-style: 32 turns under 2048 tokens); a prompt budget plus one turn over the total is
    refused, naming the keys and the number."""
    cfg = load_config(
        None,
        [
            "budget.max_turns=32",
            "budget.max_tokens_per_turn=64",
            "budget.max_obs_tokens=256",
            "budget.max_prompt_tokens=256",
            "budget.max_total_tokens=2048",
        ],
    )
    assert cfg.budget.worst_case_total() > cfg.budget.max_total_tokens
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["budget.max_tokens_per_turn=500", "budget.max_prompt_tokens=512", "budget.max_total_tokens=1000"]
        )
    msg = str(err.value)
    for key in ("budget.max_total_tokens", "budget.max_prompt_tokens", "budget.max_tokens_per_turn", "1012"):
        assert key in msg


def test_microbatch_cap_must_hold_one_trajectory():
    """The token cap is hard, so one maximal trajectory must fit in a micro-batch."""
    with pytest.raises(ConfigError, match="train.max_tokens_per_microbatch"):
        load_config(None, ["train.max_tokens_per_microbatch=100"])


def test_bad_choices_and_combinations():
    """Enumerated keys and cross-key rules fail with the key's name."""
    with pytest.raises(ConfigError, match="algo.name"):
        load_config(None, ["algo.name=reinforce"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["algo.group_size=1"])
    with pytest.raises(ConfigError, match="rollout.device=cuda:0"):
        load_config(None, ["rollout.engine=vllm", "rollout.device=cuda:2"])
    with pytest.raises(ConfigError, match="rollout.mode"):
        load_config(None, ["rollout.mode=parallel"])
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(None, ["algo.mini_batch_size=7"])


def test_missing_config_file_is_clear(tmp_path):
    """A missing file says where the shipped configs are."""
    with pytest.raises(ConfigError, match="configs/"):
        load_config(tmp_path / "nope.yaml")
