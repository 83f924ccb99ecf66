"""Config tree: documented fields, clear errors on unknown keys and bad combinations."""

import dataclasses
import json
from pathlib import Path

import pytest

from agent_rl.config import (
    Config,
    ConfigError,
    RunConfig,
    iter_fields,
    load_config,
    migrate_sections,
    parse_overrides,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


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
    with pytest.raises(ConfigError, match="run.max_steps"):
        load_config(None, ["run.max_steps=ten"])


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
    # YAML 1.1 reads a bare `off` as false: a string setting takes it as the word it was
    assert load_config(None, ["guard.action=off"]).guard.action == "off"
    with pytest.raises(ConfigError, match="guard.action"):
        load_config(None, ["guard.action=on"])  # and a word that is no choice still fails, naming the key


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


def test_old_trainer_section_in_yaml_is_read_as_run_with_one_warning(tmp_path):
    """A config written before `trainer` became `run` loads unchanged: every key reaches `run`,
    with one FutureWarning naming each key's new spelling and the file."""
    p = tmp_path / "old.yaml"
    p.write_text("trainer:\n  max_steps: 7\n  seed: 3\n  output_dir: runs/old\n")
    with pytest.warns(FutureWarning) as caught:
        cfg = load_config(p)
    assert (cfg.run.max_steps, cfg.run.seed, cfg.run.output_dir) == (7, 3, "runs/old")
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "config section `trainer` is now `run`" in msg and str(p) in msg
    for key in ("max_steps", "seed", "output_dir"):
        assert f"trainer.{key} as run.{key}" in msg


def test_old_trainer_override_is_read_as_run_with_a_warning():
    """`trainer.max_steps=3` on the command line sets run.max_steps, warns with the new spelling,
    and merges with new-style overrides from a new-style file."""
    with pytest.warns(FutureWarning, match=r"read trainer\.max_steps as run\.max_steps \(the overrides\)"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu_grpo.yaml", ["trainer.max_steps=3"])
    assert cfg.run.max_steps == 3
    assert cfg.run.output_dir == "runs/tiny_cpu_grpo"  # the file's other run.* keys are kept


def test_old_yaml_section_takes_new_style_overrides(tmp_path, recwarn):
    """An old-style file and a new-style override are separate sources: the override wins, the
    file's other keys stay, and only the file is warned about."""
    p = tmp_path / "old.yaml"
    p.write_text("trainer:\n  max_steps: 7\n  seed: 3\n")
    cfg = load_config(p, ["run.max_steps=2"])
    assert (cfg.run.max_steps, cfg.run.seed) == (2, 3)
    assert [str(w.message).count("trainer.") for w in recwarn if w.category is FutureWarning] == [2]


def test_trainer_and_run_both_given_is_an_error(tmp_path):
    """One source giving both spellings cannot be read either way: a ConfigError naming both."""
    p = tmp_path / "both.yaml"
    p.write_text("trainer:\n  max_steps: 7\nrun:\n  max_steps: 9\n")
    with pytest.raises(ConfigError, match=r"`trainer` and `run` both given in config file .*both\.yaml.*move the"):
        load_config(p)
    with pytest.raises(ConfigError, match="`trainer` and `run` both given in the overrides"):
        load_config(None, ["trainer.max_steps=3", "run.seed=1"])


def test_an_old_checkpoint_config_record_migrates_without_loss():
    """The config.json saved with a checkpoint before the rename holds a `trainer` section: read
    through the one migration, every key and value of it lands under `run`, and it then builds a
    RunConfig equal to what the old run used."""
    old = Config().to_dict()
    old["trainer"] = old.pop("run")
    old["trainer"]["max_steps"] = 11
    saved = json.loads(json.dumps(old, indent=1, default=str))  # as save_checkpoint writes it
    with pytest.warns(
        FutureWarning, match="read trainer.deterministic as run.deterministic, .*trainer.eval_every as run.eval_every"
    ):
        new = migrate_sections(saved, "checkpoint config.json")
    assert "trainer" not in new and new["run"] == old["trainer"]
    assert RunConfig(**new["run"]) == RunConfig(**{**dataclasses.asdict(RunConfig()), "max_steps": 11})


def test_wrong_type_under_the_old_section_names_the_new_key():
    """A bad value under `trainer` fails naming the key as it is now spelt."""
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"'run\.max_steps' expects int"):
        load_config(None, ["trainer.max_steps=ten"])


def test_top_p_below_one_is_refused_for_training_rollouts():
    """The trainer scores tokens under the temperature alone; a nucleus renormalises the sampled
    distribution (and vLLM's log-probs), so rollout.top_p < 1 fails at load naming the key and the fix.
    Evaluation has no top-p of its own (greedy or rollout.eval_temperature), so nothing else reads it."""
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.9.*rollout.top_p=1.0.*rollout.temperature"):
        load_config(None, ["rollout.top_p=0.9"])
    assert load_config(None, ["rollout.top_p=1.0"]).rollout.top_p == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.max_steps=true", "'run.max_steps' expects int, got True"),
        ("run.max_steps='3'", "'run.max_steps' expects int, got '3'"),
        ("run.max_steps=3.0", "'run.max_steps' expects int, got 3.0"),
        ("run.wandb=1", "'run.wandb' expects bool, got 1"),
        ("train.lr=true", "'train.lr' expects float, got True"),
        ("train.betas=0.9", "'train.betas' expects list, got 0.9"),
        ("retriever.url=[a]", "'retriever.url' expects str | None, got ['a']"),
        ("reward.fn={fn: em}", "'reward.fn' expects str | list, got {'fn': 'em'}"),
        ("model.lora=3", "model.lora must be a mapping, got int"),
        (
            "model.lora.ran=1",
            "unknown config key 'model.lora.ran'. Valid keys here: alpha, dropout, enabled, rank, "
            "target_modules. Did you mean model.lora.rank?",
        ),
        ("retriever.kind=factory", "retriever.kind=factory needs retriever.factory"),
    ],
)
def test_each_key_is_checked_strictly_with_the_key_named(override, message):
    """A YAML value of the wrong kind fails naming the dotted key and the type it expects: no bool,
    string or float for an int, no 1 for a bool, no bool for a float, a list only as a list; a
    section's own construction check keeps its message."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_lora_settings_need_the_switch_written_out(tmp_path):
    """LoRA keys without `model.lora.enabled` are a forgotten switch (full weights would train unnoticed): refused,
    naming both ways out. `enabled: false` written out, in the file or as an override of a LoRA config, trains full
    weights with the other keys standing aside; `true` trains the adapters they describe."""
    with pytest.raises(ConfigError, match=r"model.lora.rank is set but model.lora.enabled is not.*enabled=false"):
        load_config(None, ["model.lora.rank=4"])
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  lora:\n    enabled: true\n    rank: 16\n    alpha: 32\n")
    assert (load_config(p).model.lora.enabled, load_config(p).model.lora.rank) == (True, 16)
    off = load_config(p, ["model.lora.enabled=false"]).model.lora
    assert (off.enabled, off.rank) == (False, 16)
    p.write_text("model:\n  lora:\n    enabled: false\n    rank: 16\n")
    assert not load_config(p).model.lora.enabled


def test_yaml_readings_are_taken_as_meant(tmp_path):
    """YAML 1.1 reads `1e-5` as a string and a bare `off` as false: a float key takes the number, a
    str key the word (and a number as its text); an int stands for a float; an empty section holds
    its defaults."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1e-5\n  max_grad_norm: 2\nguard:\n  action: off\nmodel:\n  path: 123\nmemory:\n")
    cfg = load_config(p)
    assert (cfg.train.lr, cfg.train.max_grad_norm, cfg.guard.action, cfg.model.path) == (1e-5, 2.0, "off", "123")
    assert isinstance(cfg.train.max_grad_norm, float) and cfg.memory == Config().memory
