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
        (
            "plugins_for_tests:not_a_function",
            r"reward\.fn = '.*:not_a_function' is of type int, not callable: name a function",
        ),
        ("[{fn: em}, {fn: 'plugins_for_tests:not_a_function'}]", r"reward\.fn\[1\] = .* is of type int, not callable"),
        (
            "plugins_broken_at_import:score",
            r"reward\.fn = 'plugins_broken_at_import:score': importing module 'plugins_broken_at_import' raised "
            r"RuntimeError at .*plugins_broken_at_import\.py:4: the plug-in's own bug, at import; fix the module "
            r"there, or take it out of reward\.fn$",
        ),
        ("bleu", r"reward\.fn = 'bleu': not a built-in name"),
        ("[{fn: em, weight: high}]", r"reward\.fn\[0\]\.weight"),
        ("[{fun: em}]", r"reward\.fn\[0\] = .*\{fn: NAME_OR_PATH, weight: FLOAT\}"),
    ],
)
def test_a_bad_reward_fails_at_load_naming_the_key(value, message):
    """A reward that cannot be loaded (whatever its module raises at import) or is not callable is a
    ConfigError at load, naming the key, what is wrong and what to do."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"reward.fn={value}"])


def test_a_plugin_whose_import_raises_keeps_its_error_chained():
    """The module's own exception is the ConfigError's cause, for both keys; `Reward` built from an
    unvalidated config checks callability too."""
    from agent_rl.config import RewardConfig

    for override in (
        "reward.fn=plugins_broken_at_import:score",
        "rollout.tools=[search, 'plugins_broken_at_import:T']",
    ):
        with pytest.raises(ConfigError) as raised:
            load_config(None, [override])
        assert type(raised.value.__cause__) is RuntimeError
        assert str(raised.value.__cause__) == "the plug-in's own bug, at import"
    with pytest.raises(ConfigError, match=r"reward\.fn = .* is of type int, not callable"):
        Reward(RewardConfig(fn="plugins_for_tests:not_a_function"))


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
    assert em_format(_traj("<read> 3\n\n" + good, 1)) == 0.0  # a tool's tag left open
    assert em_format(_traj("<read> 3 </read>" + good, 1)) == 1.0
    assert Reward(load_config(None, ["reward.fn=em"]).reward)(_traj(good + " trailing", 1)) == 1.0


PLANS = {  # what each scripted policy searches, in order, then answers
    "knows": (["Inception film"], "Lester Smith"),  # the answer from its own text: the search missed it
    "finds": (["Demon Dice"], "Tim Brown"),
    "misses then finds": (["Inception film", "Demon Dice"], "Tim Brown"),
    "finds twice": (["Demon Dice", "Demon Dice"], "Tim Brown"),
    "finds and answers": (["Demon Dice"], "Lester Smith"),
}


def test_search_found_pays_once_for_the_search_that_retrieves_the_answer(tokenizer, server):
    """`search_found` beside `em`, on real searches: it pays when a search's passages hold a gold answer,
    once however many do, never for the policy's own text (an answer it knew, its queries), and it agrees with
    what each turn recorded of its documents."""
    from retriever_server.answers import contains_answer
    from retriever_server.client import RetrieverClient

    _, url = server
    golden = ["Lester Smith"]

    def script(ctx):
        plan = next(name for name in PLANS if f"Plan: {name}." in ctx)
        queries, answer = PLANS[plan]
        done = ctx.count("<information>")
        return f"<search> {queries[done]} </search>" if done < len(queries) else f"<answer> {answer} </answer>"

    items = [
        PromptItem(f"toy-{i}", "toy", tokenizer(f"Plan: {name}.\n", add_special_tokens=False)["input_ids"], golden)
        for i, name in enumerate(PLANS)
    ]
    loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, RetrieverClient(url, topk=1), BUDGET)
    trajs = sorted(loop.run(items, group_size=1), key=lambda t: t.prompt_id)
    reward = Reward(load_config(None, ["reward.fn=[{fn: em, weight: 1.0}, {fn: search_found, weight: 0.3}]"]).reward)
    got = {name: reward(t) for name, t in zip(PLANS, trajs)}
    assert got == pytest.approx(
        {"knows": 1.0, "finds": 0.3, "misses then finds": 0.3, "finds twice": 0.3, "finds and answers": 1.3}
    )
    for t in trajs:
        recorded = [contains_answer(f"{d['title']}\n{d['text']}", golden) for x in t.turns for d in x.docs or ()]
        assert Reward(load_config(None, ["reward.fn=search_found"]).reward)(t) == float(any(recorded))
    assert [x.action for x in trajs[2].turns] == ["search", "search", "answer"]


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


# ---------------------------------------------------------------- tools

TOOLS = "rollout.tools=[search, 'plugins_for_tests:Calculator']"


def _spans(t):
    """(sampled?, text ids) runs of the response."""
    runs, cur, flag = [], [], None
    for i, m in zip(t.response_ids, t.loss_mask):
        if m != flag and cur:
            runs.append((flag, cur))
            cur = []
        flag = m
        cur.append(i)
    if cur:
        runs.append((flag, cur))
    return runs


def _calc_loop(tokenizer, script, mode="sync", budget=BUDGET, tools=TOOLS):
    cfg = load_config(None, [tools, f"rollout.mode={mode}"])
    return AgentLoop.from_config(cfg, ScriptedEngine(tokenizer, script), tokenizer, None, budget)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tool_from_a_test_file_runs_end_to_end(tokenizer, mode):
    """A tool defined outside the package, enabled by `rollout.tools`: its call is parsed, batched
    across the turn's trajectories (sync: one call per turn), its answer inserted as an observation
    with loss mask 0 and recorded in the turn; the prompt lists the tools."""
    from plugins_for_tests import Calculator

    def script(ctx):
        return "<answer> 5 </answer>" if "<information>5</information>" in ctx else "<calc> 2 + 3 </calc>"

    Calculator.batches.clear()
    loop = _calc_loop(tokenizer, script, mode)
    trajs = loop.run(_items(tokenizer, 2), group_size=2)
    assert len(trajs) == 4
    for t in trajs:
        prompt = tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        assert prompt.startswith("Tools: <search> query </search> returns the top searched results; <calc> expression")
        assert prompt.endswith("Question: Who directed Inception?\n")
        assert [x.action for x in t.turns] == ["calc", "answer"] and t.end_reason == "answer"
        assert t.turns[0].query == "2 + 3" and t.turns[0].retrieval_ms > 0 and t.turns[0].retriever_error is None
        runs = _spans(t)
        assert [r[0] for r in runs] == [1, 0, 1]
        assert tokenizer.decode(runs[1][1], skip_special_tokens=False) == "\n\n<information>5</information>\n\n"
        assert t.turns[0].obs_tokens == len(runs[1][1])
    assert sum(Calculator.batches) == 4
    if mode == "sync":
        assert Calculator.batches == [4]  # the whole turn's calls in one batch
    assert loop.counters["tool/calc_calls"] == 4 and loop.counters["retriever/queries"] == 0


def test_a_coroutine_tool_and_a_failing_tool(tokenizer):
    """A tool whose `call` is a coroutine runs under both drivers; a tool that raises ToolError
    gives the error observation and marks the trajectory as after a failed search."""
    tools = "rollout.tools=[search, 'plugins_for_tests:AsyncCalculator']"
    for mode in ("sync", "async"):
        loop = _calc_loop(
            tokenizer,
            lambda ctx: "<answer> 6 </answer>" if "<information>6" in ctx else "<acalc> 2 * 3 </acalc>",
            mode,
            tools=tools,
        )
        (t,) = loop.run(_items(tokenizer, 1), group_size=1)
        assert [x.action for x in t.turns] == ["acalc", "answer"] and "<information>6</information>" in t.response_text
    for mode in ("sync", "async"):
        loop = _calc_loop(tokenizer, lambda ctx: "<calc> fail </calc>", mode)
        (t,) = loop.run(_items(tokenizer, 1), group_size=1)
        assert t.turns[0].retriever_error == "the calculator is down" and t.retrieval_failed
        assert "calc failed: the tool did not answer." in t.response_text
        assert loop.counters["tool/calc_errors"] == BUDGET.max_turns and loop.counters["retriever/errors"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_budgets_hold_with_a_tool_under_a_runaway_policy(tokenizer, mode):
    """A policy that calls the tool every turn, whose answers are far over the observation budget:
    each observation is cut to `max_obs_tokens`, the total never passes `max_total_tokens`, the
    forced final turn comes after `max_turns` calls, and only sampled tokens are trained."""
    tight = TokenBudget(
        max_turns=50, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=60, max_total_tokens=400
    )
    loop = _calc_loop(tokenizer, lambda ctx: "<calc> long </calc>", mode, budget=tight)
    trajs = loop.run(_items(tokenizer, 2), group_size=2)
    for t in trajs:
        assert t.total_tokens <= tight.max_total_tokens and t.end_reason == "max_turns"
        assert all(x.obs_tokens <= tight.max_obs_tokens for x in t.turns)
        assert all(x.obs_truncated for x in t.turns if x.obs_tokens)
        assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
    assert loop.counters["budget/obs_truncated"] > 0 and loop.counters["budget/forced_answer_total"] == 4


def test_prompts_the_tools_note_pushes_past_the_budget_are_dropped_at_load(tokenizer, capsys):
    """A prompt that fits budget.max_prompt_tokens alone but not with the list of tools the prompt
    gains is dropped when the set is admitted, counted and reported, not at its first rollout; a
    set with no prompt left is an error naming the key; search alone drops nothing."""
    from agent_rl.rollout.prompts import PromptSet

    short_ids = tokenizer("Question: Who?\n", add_special_tokens=False)["input_ids"]
    [long_item] = _items(tokenizer, 1)
    loop = _calc_loop(tokenizer, lambda ctx: "<answer> x </answer>")
    room = len(loop.new_trajectories([PromptItem("s", "toy", short_ids, ["x"])], 1)[0].prompt_ids)
    assert len(long_item.prompt_ids) < room  # fits alone; with the note only the short one fits
    budget = TokenBudget(
        max_turns=3, max_prompt_tokens=room, max_tokens_per_turn=24, max_obs_tokens=200, max_total_tokens=800
    )
    loop = _calc_loop(tokenizer, lambda ctx: "<answer> x </answer>", budget=budget)
    items = [long_item, PromptItem("s", "other", short_ids, ["x"])]
    prompts = loop.admit(PromptSet(list(items), [{}, {}], ["long", "short"]))
    assert [it.prompt_id for it in prompts.items] == ["s"] and prompts.questions == ["short"]
    assert prompts.dropped == {"toy": 1}
    assert "dropped 1 toy prompts that the list of rollout.tools" in capsys.readouterr().err
    assert len(loop.run(prompts.items, 1)) == 1
    with pytest.raises(ValueError, match=r"no prompt fits budget\.max_prompt_tokens=.*raise budget\.max_prompt_tokens"):
        loop.admit(PromptSet([long_item], [{}], ["long"]))
    plain = AgentLoop.from_config(load_config(None), None, tokenizer, None, budget)
    assert len(plain.admit(PromptSet(list(items), [{}, {}], ["long", "short"])).items) == 2


@pytest.mark.parametrize(
    "tools, message",
    [
        ("[search, 'nope_xyz:T']", r"rollout\.tools\[1\] = 'nope_xyz:T': cannot import .*on PYTHONPATH"),
        (
            "[search, 'plugins_broken_at_import:T']",
            r"rollout\.tools\[1\] = 'plugins_broken_at_import:T': importing module 'plugins_broken_at_import' "
            r"raised RuntimeError at .*plugins_broken_at_import\.py:4: .*take it out of rollout\.tools$",
        ),
        (
            "['plugins_for_tests:searched_once']",
            r"rollout\.tools\[0\] = .* is not a tool: it lacks name, description, call\. A tool has a str `name`",
        ),
        ("[search, 'plugins_for_tests:NoCall']", r"rollout\.tools\[1\] = .* is not a tool: it lacks call\."),
        (
            "[search, 'plugins_for_tests:CallNotCallable']",
            r"rollout\.tools\[1\] = .* is not a tool: its name is of type int, not str; "
            r"its call is of type str, not callable",
        ),
        (
            "[search, 'plugins_for_tests:NeedsArguments']",
            r"rollout\.tools\[1\] = .*: constructing the tool .*NeedsArguments\(\) raised TypeError at .*must build "
            r"with no arguments",
        ),
        ("[search, search]", r"rollout\.tools = .*: tool names \['search', 'search'\] must be distinct"),
        ("[search, 'plugins_for_tests:AnswerTool']", r"rollout\.tools = .* must be distinct and not 'answer'"),
    ],
    ids=["no-module", "import-raises", "a-function", "no-call", "wrong-types", "needs-arguments", "twice", "answer"],
)
def test_a_bad_tool_fails_at_load_naming_the_key(tools, message):
    """A tool path that does not import (whatever its module raises), an object that is not a tool
    (lacking or mistyping `name`, `description`, `call`), a class that cannot be built with no
    arguments, or a tool set whose tags clash, is a ConfigError at `load_config`, not when the
    rollout loop is built, naming the key, what is wrong and what to do."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"rollout.tools={tools}"])


def test_the_default_tool_set_keeps_search_r1s_prompt_and_stop_tags(tokenizer):
    """With `rollout.tools=[search]` the prompt is untouched and the engines stop at Search-R1's
    tags; another tool adds its closing tag."""
    from agent_rl.rollout.protocol import STOP_TAGS, close_tags
    from agent_rl.rollout.tools import tool_names

    loop = AgentLoop.from_config(load_config(None), None, tokenizer, None, BUDGET)
    [item] = _items(tokenizer, 1)
    assert loop.new_trajectories([item], 1)[0].prompt_ids == item.prompt_ids
    assert close_tags(tool_names(["search"])) == STOP_TAGS
    assert close_tags(tool_names(["search", "plugins_for_tests:Calculator"])) == ("</search>", "</calc>", "</answer>")


def test_one_grpo_step_on_tool_trajectories(tiny_model_dir, tokenizer):
    """Trajectories with the test tool's observations, scored by the test reward, take one GRPO
    update (prepare_batch, the loss, the step) and the parameters move."""
    import random

    from agent_rl.learn.policy import load_policy
    from agent_rl.learn.update import prepare_batch, update

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            TOOLS,
            "algo.group_size=4",
            "budget.max_total_tokens=800",
            "reward.fn=[{fn: em, weight: 1.0}, {fn: 'plugins_for_tests:searched_once', weight: 0.5}]",
        ],
    )

    def script(ctx):
        script.calls += 1
        if "<information>" in ctx:
            return "<answer> 5 </answer>" if script.calls % 3 else "<answer> 4 </answer>"
        return "<calc> 2 + 3 </calc>"

    script.calls = 0
    loop = AgentLoop.from_config(cfg, ScriptedEngine(tokenizer, script), tokenizer, None, BUDGET)
    trajs = loop.run([PromptItem("toy-0", "toy", _items(tokenizer, 1)[0].prompt_ids, ["5"])], group_size=4)
    reward = Reward(cfg.reward)
    for t in trajs:
        t.reward = reward(t)
    assert len({t.reward for t in trajs}) == 2  # some right, some wrong: non-zero advantages
    torch.manual_seed(0)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    before = [p.detach().clone() for p in policy.parameters()]
    batch = prepare_batch(
        cfg.algo, cfg.train, policy, None, None, trajs, 0, need_old=False, temperature=cfg.rollout.temperature
    )
    update(
        cfg.algo,
        cfg.train,
        policy,
        None,
        torch.optim.SGD(policy.parameters(), lr=0.5),
        None,
        batch,
        random.Random(0),
        temperature=cfg.rollout.temperature,
    )
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(before, policy.parameters()))
    assert moved > 1e-5


# ---------------------------------------------------------------- read: a second real tool


@pytest.fixture(scope="module")
def keyed_server(hotpot_index_dir):
    """A real retriever-server behind an API key, with small limits."""
    from agent_fixtures import start_server

    with start_server(hotpot_index_dir, "--api-key", "k3y", "--max-queries", "4", "--max-query-chars", "64") as (
        _,
        url,
    ):
        yield url


def test_read_endpoint_returns_whole_documents_under_retrieves_limits_and_key(keyed_server):
    """POST /read: the full document of each id (null for an unknown id), in order; the API key,
    the per-request count and length limits of /retrieve apply, with the same error shape."""
    import requests

    from retriever_server.client import RetrievalError, RetrieverClient

    url, auth = keyed_server, {"Authorization": "Bearer k3y"}
    hits = requests.post(f"{url}/retrieve", json={"queries": ["Inception"], "topk": 2}, headers=auth, timeout=60)
    docs = hits.json()["result"][0]
    ids = [d["id"] for d in docs]
    resp = requests.post(f"{url}/read", json={"ids": [ids[1], "no-such-id", ids[0]]}, headers=auth, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["result"] == [docs[1], None, docs[0]]
    assert requests.post(f"{url}/read", json={"ids": ids}, timeout=60).status_code == 401
    too_many = requests.post(f"{url}/read", json={"ids": ["a"] * 5}, headers=auth, timeout=60)
    assert too_many.status_code == 413 and "--max-queries" in too_many.json()["detail"]
    too_long = requests.post(f"{url}/read", json={"ids": ["a" * 65]}, headers=auth, timeout=60)
    assert too_long.status_code == 413 and "--max-query-chars" in too_long.json()["detail"]
    client = RetrieverClient(url, api_key="k3y", max_queries_per_request=4)
    got = client.read([ids[0], "nope"] * 3)  # 6 ids: split into requests under the limit
    assert [g and g["id"] for g in got] == [ids[0], None] * 3 and got[0]["contents"] == docs[0]["contents"]
    with pytest.raises(RetrievalError, match="401"):
        RetrieverClient(url, max_retries=0).read(ids)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_search_then_read_end_to_end(tokenizer, keyed_server, mode):
    """`rollout.tools=[search, read]`: search shows each document's id, `<read> id </read>` inserts
    that document whole (mask 0, recorded in the turn); the default search format has no ids."""
    import re

    from retriever_server.client import RetrieverClient

    def script(ctx):
        if "<answer>" in ctx or ctx.count("<information>") >= 2:
            return "<answer> Christopher Nolan </answer>"
        found = re.findall(r"id: ([^)]+)\)", ctx)
        return f"<read> {found[0]} </read>" if found else "<search> Inception </search>"

    cfg = load_config(None, ["rollout.tools=[search, read]", f"rollout.mode={mode}", "retriever.topk=2"])
    client = RetrieverClient(keyed_server, api_key="k3y")
    budget = TokenBudget(
        max_turns=3, max_prompt_tokens=128, max_tokens_per_turn=24, max_obs_tokens=400, max_total_tokens=1400
    )
    loop = AgentLoop.from_config(cfg, ScriptedEngine(tokenizer, script), tokenizer, client, budget)
    (t,) = loop.run(_items(tokenizer, 1), group_size=1)
    assert [x.action for x in t.turns] == ["search", "read", "answer"]
    doc_id = t.turns[1].query
    assert t.turns[0].docs[0]["id"] == doc_id and t.turns[1].docs[0]["id"] == doc_id
    assert re.search(r"<information>\(Title: [^)]+\) ", t.response_text)
    assert loop.counters["tool/read_calls"] == 1 and loop.counters["retriever/queries"] == 2
    assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
