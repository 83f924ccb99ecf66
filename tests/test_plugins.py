"""Rewards and tools as plug-ins: a function or a tool defined here, in the tests and not in the
package, is enabled by config alone and runs in a rollout and its GRPO scoring."""

import pytest
import torch
from agent_fixtures import ScriptedEngine

from agent_rl.config import ConfigError, load_config
from agent_rl.learn.advantages import grpo_advantages
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.loop import AgentLoop, PromptItem
from agent_rl.rollout.rewards import Reward
from agent_rl.rollout.trajectory import Trajectory

BUDGET = TokenBudget(
    max_turns=3, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=200, max_total_tokens=800
)


def _items(tokenizer, n=2):
    ids = tokenizer("Question: Who directed Inception?\n", add_special_tokens=False)["input_ids"]
    return [PromptItem(f"toy-{i}", "toy", ids, ["Christopher Nolan"]) for i in range(n)]


def test_reward_fn_by_name_path_and_weighted_list():
    """`reward.fn` takes a built-in name, a module:function path, or a weighted list; `reward.name`
    is still read as `reward.fn`, with a warning."""
    assert load_config(None).reward.terms() == [("em", 1.0)]
    cfg = load_config(None, ["reward.fn=[{fn: em, weight: 1.0}, {fn: 'plugins_for_tests:searched_once', weight: 0.5}]"])
    assert cfg.reward.terms() == [("em", 1.0), ("plugins_for_tests:searched_once", 0.5)]
    with pytest.warns(FutureWarning, match=r"reward\.name.*reward\.fn"):
        assert load_config(None, ["reward.name=f1"]).reward.fn == "f1"
    with pytest.raises(ConfigError, match=r"reward\.name. and .reward\.fn. both given"):
        load_config(None, ["reward.name=f1", "reward.fn=em"])


@pytest.mark.parametrize(
    "value, message",
    [
        ("no_such_module_xyz:fn", r"reward\.fn = 'no_such_module_xyz:fn': cannot import module"),
        ("plugins_for_tests:missing", r"reward\.fn = 'plugins_for_tests:missing': module .* has no attribute"),
        ("plugins_for_tests:not_a_function", r"reward\.fn = .*not callable"),
        ("bleu", r"reward\.fn = 'bleu': not a built-in name"),
        ("[{fn: em, weight: high}]", r"reward\.fn\[0\]\.weight"),
        ("[{fun: em}]", r"reward\.fn\[0\] = .*\{fn: NAME_OR_PATH, weight: FLOAT\}"),
    ],
)
def test_a_bad_reward_fails_at_load_naming_the_key(value, message):
    """A reward that cannot be loaded is a ConfigError at load, naming the key and what is wrong."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"reward.fn={value}"])


def _traj(text: str, searches: int) -> Trajectory:
    from agent_rl.rollout.trajectory import Turn

    t = Trajectory("toy-1", "toy", [1], ["Paris"], response_text=text)
    t.turns = [Turn("search", 3, False, query="q")] * searches + [Turn("answer", 3, False)]
    return t


def test_builtins_and_the_format_bonus_keep_their_meaning():
    """em / f1 / em_format on a trajectory: the format bonus adds, capped at 1; em_format pays a
    right answer only in a well-formed response."""
    good = "<search>q</search>\n\n<information>Doc 1</information>\n\n<answer>Paris</answer>"
    assert Reward(load_config(None).reward)(_traj(good, 1)) == 1.0
    assert Reward(load_config(None, ["reward.format_coef=0.2"]).reward)(_traj(good.replace("Paris<", "Rome<"), 1)) == (
        pytest.approx(0.2)
    )
    em_format = Reward(load_config(None, ["reward.fn=em_format"]).reward)
    assert em_format(_traj(good, 1)) == 1.0
    assert em_format(_traj(good + " trailing", 1)) == 0.0
    assert Reward(load_config(None, ["reward.fn=em"]).reward)(_traj(good + " trailing", 1)) == 1.0


def test_a_reward_from_a_test_file_scores_a_rollout_and_its_grpo_advantages(tokenizer):
    """The user's reward, enabled by config, reads the trajectory's turns in a real rollout: the
    group's rows that searched once outscore the others, and GRPO's advantages follow."""
    cfg = load_config(None, ["reward.fn=[{fn: em, weight: 1.0}, {fn: 'plugins_for_tests:searched_once', weight: 0.5}]"])

    def script(ctx):  # sample_idx is not visible to the engine: alternate by call count instead
        script.calls += 1
        if "<information>" in ctx or script.calls % 2 == 0:
            return "<answer> Christopher Nolan </answer>"
        return "<search> Inception </search>"

    script.calls = 0
    loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, None, BUDGET)
    trajs = loop.run(_items(tokenizer, 1), group_size=4)
    reward = Reward(cfg.reward)
    for t in trajs:
        t.reward = reward(t)
    searched = [sum(x.action == "search" for x in t.turns) == 1 for t in trajs]
    assert any(searched) and not all(searched)
    assert [t.reward for t in trajs] == [1.5 if s else 1.0 for s in searched]
    adv = grpo_advantages(torch.tensor([t.reward for t in trajs]), [t.prompt_id for t in trajs])
    assert all((a > 0) == s for a, s in zip(adv.tolist(), searched))
