"""Per-trajectory asynchronous rollout (`rollout.mode=async`) against a real retriever server.

A deterministic scripted engine gives the same trajectories in both modes; the real tiny model's
seeded draws do not depend on completion order; a slow server (a delaying proxy) and a server
killed mid-rollout keep the loop's contract; budgets hold under a runaway policy.
"""

import time

import pytest
import torch
from agent_fixtures import ScriptedEngine, delaying_proxy, start_server

from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.engines import Generation, HFEngine
from agent_rl.rollout.loop import AgentLoop, PromptItem
from retriever_server.client import RetrieverClient

BUDGET = TokenBudget(
    max_turns=3, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=400, max_total_tokens=64 + 3 * 424 + 24
)


def _items(tokenizer, questions):
    return [
        PromptItem(
            f"hotpot-{i}", "hotpotqa", tokenizer(f"Question: {q}\n", add_special_tokens=False)["input_ids"], ["x"]
        )
        for i, q in enumerate(questions)
    ]


QUESTIONS = [
    "Who directed Inception?",
    "Where is the Eiffel Tower?",
    "What is the capital of Peru?",
    "Who wrote Hamlet?",
    "When did WW2 end?",
]


def _script(ctx: str) -> str:
    """Searches a number of times that depends on the question, then answers: rows finish at different turns."""
    searches = ctx.count("<information>")
    wanted = len(ctx) % 3
    return (
        "<answer> yes </answer>"
        if searches >= wanted
        else f"<search> {ctx.split(chr(10))[0][10:]} part {searches} </search>"
    )


def _record(t):
    return (
        t.prompt_id,
        t.sample_idx,
        t.response_ids,
        t.loss_mask,
        t.end_reason,
        [(x.action, x.query, x.obs_tokens) for x in t.turns],
    )


def test_async_equals_sync_for_a_deterministic_engine(tokenizer, server):
    """The async loop gives exactly the sync loop's trajectories (ids, masks, turns, end reasons)
    for a deterministic engine, in the same order, and sends fewer engine calls than trajectories."""
    _, url = server
    client = RetrieverClient(url, topk=2)
    sync = AgentLoop(ScriptedEngine(tokenizer, _script), tokenizer, client, BUDGET).run(
        _items(tokenizer, QUESTIONS), group_size=2
    )
    engine = ScriptedEngine(tokenizer, _script)
    loop = AgentLoop(engine, tokenizer, client, BUDGET, mode="async")
    asyn = loop.run(_items(tokenizer, QUESTIONS), group_size=2)
    assert [_record(t) for t in asyn] == [_record(t) for t in sync]
    assert {t.end_reason for t in asyn} == {"answer"} and max(len(t.turns) for t in asyn) == 3
    assert len(engine.batch_sizes) < sum(len(t.turns) for t in asyn)
    assert loop.counters["rollout/search_requests"] < loop.counters["retriever/queries"]


def test_async_seeded_sampling_is_independent_of_completion_order(tokenizer, tiny_model_dir, server):
    """The real tiny model sampling at T=1: each trajectory's turns draw with their own seeds, so
    the same engine-generator state gives the same trajectories whether all run at once or two
    at a time (different batches, different completion order)."""
    from transformers import AutoModelForCausalLM

    _, url = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    runs = []
    for inflight in (0, 2):
        engine = HFEngine(model, tokenizer, "cpu", 64, seed=5)
        loop = AgentLoop(engine, tokenizer, RetrieverClient(url), BUDGET, mode="async", max_inflight=inflight)
        runs.append([_record(t) for t in loop.run(_items(tokenizer, QUESTIONS[:3]), group_size=2, temperature=1.0)])
    assert runs[0] == runs[1]
    assert len({tuple(r[2]) for r in runs[0]}) > 1  # the samples really differ


def test_async_overlaps_slow_searches_and_survives_a_dead_server(tokenizer, hotpot_index_dir):
    """Behind a proxy that holds every request 200 ms both modes give the same trajectories (the
    speed of each is measured in bench/async_rollout.py); when the server is killed mid-rollout the
    loop finishes every trajectory with the error observation."""
    with start_server(hotpot_index_dir) as (proc, url), delaying_proxy(url, 0.2) as slow:
        runs = {}
        for mode in ("sync", "async"):
            engine = ScriptedEngine(tokenizer, _script, delay_s=0.05)
            loop = AgentLoop(engine, tokenizer, RetrieverClient(slow, timeout_s=5), BUDGET, mode=mode)
            trajs = loop.run(_items(tokenizer, QUESTIONS), group_size=2)
            assert all(t.end_reason == "answer" for t in trajs)
            runs[mode] = [_record(t) for t in trajs]
        assert runs["async"] == runs["sync"]

        script = lambda ctx: "<search> Inception </search>"  # noqa: E731
        killer = ScriptedEngine(tokenizer, script, delay_s=0.05)
        original = killer.generate

        def generate_then_kill(*args, **kw):
            if len(killer.batch_sizes) == 2:
                proc.kill()  # the server dies after the first searches went through
                proc.wait()
            return original(*args, **kw)

        killer.generate = generate_then_kill
        loop = AgentLoop(
            killer, tokenizer, RetrieverClient(slow, timeout_s=2, max_retries=1, backoff_s=0.05), BUDGET, mode="async"
        )
        trajs = loop.run(_items(tokenizer, QUESTIONS), group_size=1)
        assert all(t.done for t in trajs)
        assert loop.counters["retriever/errors"] > 0
        assert any(x.retriever_error for t in trajs for x in t.turns)
        assert all(t.total_tokens <= BUDGET.max_total_tokens for t in trajs)


def test_async_runaway_policy_stays_within_budget(tokenizer, server):
    """A policy that never stops: every trajectory ends within max_total_tokens with a reason,
    loss mask exact (1 on generated ids only)."""
    _, url = server
    loop = AgentLoop(
        ScriptedEngine(tokenizer, lambda ctx: "blah " * 5000),
        tokenizer,
        RetrieverClient(url),
        BUDGET,
        mode="async",
        max_inflight=3,
    )
    trajs = loop.run(_items(tokenizer, QUESTIONS), group_size=2)
    for t in trajs:
        assert t.end_reason is not None and t.total_tokens <= BUDGET.max_total_tokens
        assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
        assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
    assert loop.counters["budget/turn_truncated"] == sum(len(t.turns) for t in trajs)


def test_search_batcher_overlaps_requests_and_batches_waiting_queries(server):
    """Queries waiting together go as one /retrieve request; a query that arrives while a slow
    request is out is sent at once (up to `max_requests` in flight), not after that answer."""
    import asyncio

    from agent_rl.rollout.async_loop import SearchBatcher

    _, url = server

    async def staggered(client, max_requests: int) -> tuple[float, int]:
        batcher = SearchBatcher(client, topk=2, max_requests=max_requests)
        done: dict[str, float] = {}

        async def ask(query: str, after_s: float) -> None:
            await asyncio.sleep(after_s)
            docs, error, _ = await batcher.search(query)
            assert error is None and docs
            done[query] = time.perf_counter()

        await asyncio.gather(ask("Inception", 0.0), ask("Eiffel Tower", 0.15))
        return done["Eiffel Tower"] - done["Inception"], batcher.requests

    async def together(client) -> int:
        batcher = SearchBatcher(client, topk=2)
        results = await asyncio.gather(*(batcher.search(q) for q in ("Inception", "Hamlet", "Peru")))
        assert all(r[1] is None and r[0] for r in results)
        return batcher.requests

    with delaying_proxy(url, 0.6) as slow:
        client = RetrieverClient(slow, timeout_s=10)
        assert asyncio.run(together(client)) == 1
        gap_overlapped, requests = asyncio.run(staggered(client, max_requests=4))
        assert requests == 2
        gap_serial, _ = asyncio.run(staggered(client, max_requests=1))
    # overlapped: the second answer comes ~0.15 s after the first; one at a time: a whole 0.6 s hold later
    assert gap_overlapped < 0.45 < gap_serial, (gap_overlapped, gap_serial)


def _search_twice(ctx: str) -> str:
    """The question searched twice, word for word, then an answer."""
    if ctx.count("<information>") >= 2:
        return "<answer> yes </answer>"
    return f"<search> {ctx.split(chr(10))[0][10:]} </search>"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_new_passages_shows_a_repeated_search_what_it_has_not_read(tokenizer, server, mode):
    """retriever.new_passages (search `depth` above `topk`): a query searched again shows the next `topk` passages,
    numbered from Doc 1, none of those the trajectory was shown; off, the same passages again (Search-R1's). In
    both loop modes, with the real server."""
    from agent_rl.config import load_config
    from agent_rl.rollout.tools import SearchTool, search_depth

    for flag, depth in ((True, 6), (False, 2)):  # the config's depth: enough for every turn to see topk new ones
        cfg = load_config(None, [f"retriever.new_passages={flag}", "retriever.topk=2", "budget.max_turns=3"])
        assert search_depth(cfg) == depth
    _, url = server
    client = RetrieverClient(url, topk=2)
    items = _items(tokenizer, QUESTIONS[:3])
    shown = {}
    for depth in (0, 6):
        loop = AgentLoop(
            ScriptedEngine(tokenizer, _search_twice),
            tokenizer,
            client,
            BUDGET,
            2,
            mode,
            tools=[SearchTool(client, 2, depth=depth)],
        )
        shown[depth] = [[[d["id"] for d in x.docs] for x in t.turns if x.action == "search"] for t in loop.run(items)]
    deep = client.retrieve([q for q in QUESTIONS[:3]], 4)
    for same, fresh, top4 in zip(shown[0], shown[6], deep):
        assert same[0] == same[1] == [d["id"] for d in top4[:2]]
        assert fresh[0] == same[0] and fresh[1] == [d["id"] for d in top4[2:4]]
    t = AgentLoop(ScriptedEngine(tokenizer, _search_twice), tokenizer, client, BUDGET, 2, mode,
                  tools=[SearchTool(client, 2, depth=6)]).run(items[:1])[0]  # fmt: skip
    second = tokenizer.decode(t.response_ids).split("<information>")[2]
    assert "Doc 1(Title:" in second and "Doc 3" not in second
