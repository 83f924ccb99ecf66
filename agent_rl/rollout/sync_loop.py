"""Search-R1's turn-synchronous driver: every active trajectory generates its turn, then one
batched search for all of the turn's queries."""

from __future__ import annotations

import time

from agent_rl.rollout.trajectory import Trajectory
from agent_rl.rollout.turns import PromptItem, Turns
from retriever_server.client import RetrievalError


def run_sync(
    turns: Turns, items: list[PromptItem], group_size: int = 1, temperature: float = 1.0, top_p: float = 1.0
) -> list[Trajectory]:
    """`group_size` trajectories per prompt, turn by turn."""
    trajs = turns.new_trajectories(items, group_size)
    turn = 0
    while True:
        active = [t for t in trajs if not t.done]
        if not active:
            break
        allow = [turns.budget.turn_allowance(t.total_tokens) for t in active]
        for t, a in zip(active, allow):
            if a <= 0:
                turns.end(t, "budget_total")
        pairs = [(t, a) for t, a in zip(active, allow) if a > 0]
        if not pairs:
            break
        finals = [turns.must_answer(t, turn) for t, _ in pairs]  # asked before the turn is generated
        gens = turns.engine.generate(
            [t.prompt_ids + t.response_ids for t, _ in pairs], [a for _, a in pairs], temperature, top_p
        )
        searches: list[tuple[Trajectory, str]] = []
        for (t, _), g, final in zip(pairs, gens, finals):
            query = turns.take_turn(t, g, final)
            if query is not None:
                searches.append((t, query))
        if searches:
            search_and_insert(turns, searches)
        turn += 1
    turns.finish(trajs)
    return trajs


def search_and_insert(turns: Turns, searches: list[tuple[Trajectory, str]]) -> None:
    """One batched `/retrieve` for every query of the turn; each trajectory gets its observation."""
    queries = [q for _, q in searches]
    start = time.perf_counter()
    error = None
    results: list[list[dict]] | list[None]
    try:
        if turns.client is None:
            raise RetrievalError("no retriever configured")
        results = turns.client.retrieve(queries, turns.topk)
    except RetrievalError as err:
        error, results = str(err), [None] * len(queries)
        turns.counters["retriever/errors"] += len(queries)
    ms = (time.perf_counter() - start) * 1000.0
    turns.counters["retriever/queries"] += len(queries)
    for (t, _), docs in zip(searches, results):
        turns.observe(t, docs, error, ms)
