"""Search-R1's turn-synchronous driver: every active trajectory generates its turn, then one
batched call per tool for all of the turn's calls (search: one `/retrieve` for all the queries)."""

from __future__ import annotations

from agent_rl.rollout.tools import Tool, call_batch
from agent_rl.rollout.trajectory import Trajectory
from agent_rl.rollout.turns import PromptItem, Turns


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
        calls: dict[str, list[tuple[Trajectory, str]]] = {}  # per tool, in the turn's order
        for (t, _), g, final in zip(pairs, gens, finals):
            call = turns.take_turn(t, g, final)
            if call is not None:
                calls.setdefault(call[0].name, []).append((t, call[1]))
        for name, batch in calls.items():
            call_and_insert(turns, turns.tools[name], batch)
        turn += 1
    turns.finish(trajs)
    return trajs


def call_and_insert(turns: Turns, tool: Tool, batch: list[tuple[Trajectory, str]]) -> None:
    """One batch call of `tool` for every call of the turn (search: one `/retrieve`); each
    trajectory gets its observation."""
    outputs, error, ms = call_batch(tool, [x for _, x in batch])
    turns.count_calls(tool, len(batch), error is not None)
    for i, (t, _) in enumerate(batch):
        turns.observe(t, None if outputs is None else outputs[i], error, ms)
