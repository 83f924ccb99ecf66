"""Tools the policy calls by tag: `<name> input </name>` runs the tool `name`, whose answer is
inserted as an observation, `<information>...</information>` with loss mask 0.

A tool is any object with a `name` (its tag, and the turn's recorded action), a `description`
(one line the prompt lists when the tool set is not the default) and `call(inputs)`, a batch:
the inputs of many trajectories in, one `ToolOutput` each out, so a tool that serves a batch
(the retriever) keeps its cross-trajectory batching. The turn-synchronous driver calls it once per
turn with all of that turn's calls; the asynchronous one with every call waiting at the time.
`call` may be a plain function (run in a thread by the async driver) or a coroutine function.
A tool that fails raises `ToolError`: every call of the batch gets an observation saying so, and
the trajectory is handled as after a failed search (`Turn.retriever_error`, kept out of the loss
with `retriever.exclude_failed`). Budgets, the mask and the turn record are the driver's, the
same for every tool (`turns.Turns.observe`).

`rollout.tools` chooses the tools by name: `search` (Search-R1's, the default), `read` (a document
whole, by the id search then shows) or the import path of a tool of the user's (`module:Class`,
instantiated with no arguments, or `module:instance`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from agent_rl.config import BUILTIN_TOOLS, ConfigError, load_tool_object
from agent_rl.rollout.retriever import document_summaries, format_documents
from retriever_server.client import RetrievalError, RetrieverClient


@dataclass
class ToolOutput:
    """One call's answer: the observation's body in pieces (whole pieces are kept first when the
    observation budget binds, then the first is cut with a marker) and what the turn records."""

    parts: list[str]
    docs: list[dict] | None = None  # documents shown by `agent-rl view` (id, title, score, text)
    # optional: the output to show instead to a trajectory that was already shown the documents whose ids it is
    # given (search under retriever.new_passages: the next passages of a deeper search); the driver calls it
    fresh: Callable[[set[str]], ToolOutput] | None = None


class ToolError(RuntimeError):
    """A tool could not answer a batch; its message goes into each call's observation and turn."""


class Tool(Protocol):
    name: str  # the tag: the policy writes <name> input </name>
    description: str  # what the prompt says of it, e.g. "<calc> expression </calc> returns its value"

    def call(self, inputs: list[str]) -> list[ToolOutput]: ...


class SearchTool:
    """Search-R1's search: one batched `/retrieve` for all the inputs, the top `topk` documents each. With a `depth`
    above `topk` (retriever.new_passages) it searches that deep, and each output's `fresh(seen)` is the top `topk`
    of those not in `seen`, numbered from Doc 1: a trajectory is shown passages it has not read yet."""

    name = "search"
    description = "<search> query </search> returns the top searched results"
    uses_retriever = True  # optional on a tool: its calls and failures count as retriever/queries and /errors
    # optional on a tool: its function schema under rollout.protocol=tool_calls (chat_tools.tool_schema); without
    # one a tool takes one string argument, named by its optional `argument` ("input"), described by `description`
    schema = {
        "name": "search",
        "description": "Search the corpus; returns the top documents for the query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    }

    def __init__(self, client: RetrieverClient | None, topk: int, with_ids: bool = False, depth: int = 0):
        self.client, self.topk, self.depth = client, topk, max(depth, topk)
        self.with_ids = with_ids  # show each document's id (for `read`); off: Search-R1's format, byte for byte

    def call(self, inputs: list[str]) -> list[ToolOutput]:
        if self.client is None:
            raise ToolError("no retriever configured")
        try:
            results = self.client.retrieve(inputs, self.depth)
        except RetrievalError as err:
            raise ToolError(str(err)) from err
        return [self._output(docs) for docs in results]

    def _output(self, docs: list[dict]) -> ToolOutput:
        shown = docs[: self.topk]
        out = ToolOutput(format_documents(shown, self.with_ids) or ["No documents found."], document_summaries(shown))
        if self.depth > self.topk:
            out.fresh = lambda seen: self._output([d for d in docs if d.get("id") not in seen][: self.topk])
        return out


class ReadTool:
    """The full text of one document by its id (which `search` shows when `read` is enabled), from
    the retriever's `/read`: the agent searches short passages, then reads the one it wants whole
    (ASearcher's `access`). The observation budget cuts a long document, with the marker."""

    name = "read"
    description = "<read> document id </read> returns the full text of that document"
    uses_retriever = True
    schema = {
        "name": "read",
        "description": "The full text of one document, by the id a search result shows.",
        "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}}, "required": ["doc_id"]},
    }

    def __init__(self, client: RetrieverClient | None):
        self.client = client

    def call(self, inputs: list[str]) -> list[ToolOutput]:
        if self.client is None:
            raise ToolError("no retriever configured")
        try:
            docs = self.client.read(inputs)
        except RetrievalError as err:
            raise ToolError(str(err)) from err
        out = []
        for doc_id, doc in zip(inputs, docs):
            if doc is None:
                out.append(ToolOutput([f"No document has the id {doc_id}."]))
                continue
            title, _, text = doc.get("contents", "").partition("\n")
            out.append(ToolOutput([f"(Title: {title}) {text}"], document_summaries([doc])))
        return out


def load_tool(spec: str, key: str) -> Tool:
    """A user's tool from its import path: a class is instantiated with no arguments. The checks
    against `Tool` are config's (`load_tool_object`), so that a bad tool fails at `load_config`."""
    return cast(Tool, load_tool_object(spec, key))


def search_depth(cfg) -> int:
    """How deep search searches: `retriever.topk`, or with `retriever.new_passages` enough for every turn to be
    shown `topk` passages not shown before (`topk` x `budget.max_turns`)."""
    topk = cfg.retriever.topk
    return topk * max(1, cfg.budget.max_turns) if cfg.retriever.new_passages else topk


def build_tools(specs: Sequence[str], client: RetrieverClient | None, topk: int, depth: int = 0) -> list[Tool]:
    """The tools `rollout.tools` names, in order; `depth`: search's (`SearchTool`)."""
    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        if spec == "search":
            tools.append(SearchTool(client, topk, with_ids="read" in specs, depth=depth))
        elif spec == "read":
            tools.append(ReadTool(client))
        else:
            tools.append(load_tool(spec, f"rollout.tools[{i}]"))
    names = [t.name for t in tools]
    if len(set(names)) != len(names) or "answer" in names:
        raise ConfigError(f"rollout.tools = {list(specs)}: tool names {names} must be distinct and not 'answer'")
    return tools


def tool_names(specs: Sequence[str]) -> tuple[str, ...]:
    """The tags of the tools `rollout.tools` names (a user's tool is loaded to read its name)."""
    return tuple(
        spec if spec in BUILTIN_TOOLS else load_tool(spec, f"rollout.tools[{i}]").name for i, spec in enumerate(specs)
    )


def is_default(tools: Sequence[Tool]) -> bool:
    """Search alone: the prompt and the wire format stay Search-R1's, byte for byte."""
    return [t.name for t in tools] == ["search"]


def prompt_note(tools: Sequence[Tool]) -> str:
    """What a prompt says of a non-default tool set, inserted before its `Question:` ('' for the default)."""
    if is_default(tools):
        return ""
    return "Tools: " + "; ".join(t.description for t in tools) + ". "


def call_batch(tool: Tool, inputs: list[str]) -> tuple[list[ToolOutput] | None, str | None, float]:
    """(outputs or None, error or None, milliseconds) of one batch call, from a synchronous driver."""
    start = time.perf_counter()
    try:
        result: Any = tool.call(inputs)
        outputs = asyncio.run(result) if inspect.iscoroutine(result) else result
    except ToolError as err:
        return None, str(err), (time.perf_counter() - start) * 1000.0
    _check(tool, inputs, outputs)
    return outputs, None, (time.perf_counter() - start) * 1000.0


async def call_batch_async(tool: Tool, inputs: list[str]) -> tuple[list[ToolOutput] | None, str | None, float]:
    """The same from the asynchronous driver: a coroutine is awaited, a plain function runs in a thread."""
    start = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(tool.call):
            outputs = await tool.call(inputs)
        else:
            outputs = await asyncio.to_thread(tool.call, inputs)
    except ToolError as err:
        return None, str(err), (time.perf_counter() - start) * 1000.0
    _check(tool, inputs, outputs)
    return outputs, None, (time.perf_counter() - start) * 1000.0


def _check(tool: Tool, inputs: list[str], outputs: list[ToolOutput]) -> None:
    if len(outputs) != len(inputs) or not all(isinstance(o, ToolOutput) for o in outputs):
        raise TypeError(
            f"tool {tool.name!r} answered {len(outputs)} items for {len(inputs)} calls: call(inputs) must return one "
            "ToolOutput per input, in order"
        )
