"""A user's plug-ins, outside the package: a reward function and a tool, enabled by config
(`reward.fn: plugins_for_tests:searched_once`, `rollout.tools: [search, plugins_for_tests:Calculator]`)."""


def searched_once(trajectory, golden_answers: list[str]) -> float:
    """1 when the trajectory made exactly one search, else 0 (a reward that reads the turns)."""
    return float(sum(1 for turn in trajectory.turns if turn.action == "search") == 1)


not_a_function = 3  # a reward that is not callable


class NoCall:
    """Not a tool: it has a name and a description but no `call`."""

    name = "nocall"
    description = "<nocall> x </nocall> answers nothing"


class CallNotCallable:
    """Not a tool: its `call` is a string and its name is not one."""

    name = 7
    description = "<seven> x </seven>"
    call = "run"


class NeedsArguments(NoCall):
    """A tool class that cannot be built with no arguments."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def call(self, inputs: list[str]):
        return []


class AnswerTool(NoCall):
    """A tool whose tag is `answer`, the final answer's."""

    name = "answer"

    def call(self, inputs: list[str]):
        return []


class Calculator:
    """A tool: `<calc> 2 + 3 </calc>` -> `5`. `fail` raises ToolError (a dead tool); `long` answers
    with a very long text (the observation budget must cut it). Records each batch's size."""

    name = "calc"
    description = "<calc> expression </calc> returns its value"
    batches: list[int] = []  # noqa: RUF012 (shared on purpose: the test reads it from the class)

    def call(self, inputs: list[str]):
        from agent_rl.rollout.tools import ToolError, ToolOutput

        Calculator.batches.append(len(inputs))
        if any(x == "fail" for x in inputs):
            raise ToolError("the calculator is down")
        out = []
        for x in inputs:
            if x == "long":
                out.append(ToolOutput(["digits " * 2000]))
            else:
                a, op, b = x.split()
                out.append(ToolOutput([str({"+": int(a) + int(b), "*": int(a) * int(b)}[op])]))
        return out


class AsyncCalculator(Calculator):
    """The same tool with a coroutine `call` (awaited by the asynchronous driver)."""

    name = "acalc"
    description = "<acalc> expression </acalc> returns its value"

    async def call(self, inputs: list[str]):
        return Calculator.call(self, inputs)
