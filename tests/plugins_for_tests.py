"""A user's plug-ins, outside the package: a reward function and a tool, enabled by config
(`reward.fn: plugins_for_tests:searched_once`, `rollout.tools: [search, plugins_for_tests:Calculator]`)."""


def searched_once(trajectory, golden_answers: list[str]) -> float:
    """1 when the trajectory made exactly one search, else 0 (a reward that reads the turns)."""
    return float(sum(1 for turn in trajectory.turns if turn.action == "search") == 1)


not_a_function = 3
