"""The agent's tag protocol (Search-R1's): what the policy writes, what the environment inserts.

The policy reasons, then either searches, `<search> query </search>`, or answers,
`<answer> text </answer>`; generation stops at either closing tag. Another tool is called the same
way, `<name> input </name>` (`rollout.tools`), and its closing tag stops a turn too. The environment answers a
search with `<information>...</information>` (loss mask 0) and an action it cannot parse with
`INVALID_MESSAGE`. Everything that writes or reads these strings takes them from here.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFORMATION_OPEN, INFORMATION_CLOSE = "<information>", "</information>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# every tag, for tokenizers that make them single tokens
TAGS = [
    THINK_OPEN,
    THINK_CLOSE,
    SEARCH_OPEN,
    SEARCH_CLOSE,
    INFORMATION_OPEN,
    INFORMATION_CLOSE,
    ANSWER_OPEN,
    ANSWER_CLOSE,
]
# generation of a turn ends at the first of these
STOP_TAGS = (SEARCH_CLOSE, ANSWER_CLOSE)

INVALID_MESSAGE = (
    f"\nMy previous action is invalid. If I want to search, I should put the query between {SEARCH_OPEN} and "
    f"{SEARCH_CLOSE}. If I want to give the final answer, I should put the answer between {ANSWER_OPEN} and "
    f"{ANSWER_CLOSE}. Let me try again.\n"
)
# the tool-call protocol's corrective message (a user message; agent_rl/rollout/chat_tools.py)
CHAT_INVALID_MESSAGE = (
    f"Your last message neither called a tool nor gave the answer. Call a tool, or give the final answer between "
    f"{ANSWER_OPEN} and {ANSWER_CLOSE}."
)
# ends an observation cut to its token allowance
TRUNCATION_MARKER = " ...[truncated]"
# an observation, as inserted between turns
OBSERVATION_HEAD, OBSERVATION_TAIL = f"\n\n{INFORMATION_OPEN}", f"{INFORMATION_CLOSE}\n\n"

_SEARCH = re.compile(f"{SEARCH_OPEN}(.*?){SEARCH_CLOSE}", re.DOTALL)
_ANSWER = re.compile(f"{ANSWER_OPEN}(.*?){ANSWER_CLOSE}", re.DOTALL)
# inserted observations of both protocols: `<information>` here, a Hermes-style `<tool_response>` in tool_calls
_OBSERVATION = re.compile(f"{INFORMATION_OPEN}.*?{INFORMATION_CLOSE}|<tool_response>.*?</tool_response>", re.DOTALL)
_TOOL_CALL = re.compile("<tool_call>(.*?)</tool_call>", re.DOTALL)
_TRAILING_SPECIAL = re.compile(r"(\s*<\|[^|<>]*\|>)+\s*$")  # end-of-turn/-text tokens: <|im_end|>, <|eot_id|>


def answer_action(answer: str) -> str:
    return f"{ANSWER_OPEN} {answer} {ANSWER_CLOSE}"


def parse_action(text: str, tools: Sequence[str] = ("search",)) -> tuple[str, str | None]:
    """The first complete `<answer>` or tool call (`<name> input </name>` for each name in `tools`)
    of a turn wins: ("answer" | a tool's name | "invalid", content); an empty tool input is invalid."""
    found = [(m.start(), "answer", m) for m in [_ANSWER.search(text)] if m]
    found += [(m.start(), name, m) for name in tools for m in [_tag_pattern(name).search(text)] if m]
    if not found:
        return "invalid", None
    _, action, match = min(found, key=lambda f: f[0])
    content = match.group(1).strip()
    if action == "answer":
        return "answer", content
    return (action, content) if content else ("invalid", None)


def close_tags(tools: Sequence[str]) -> tuple[str, ...]:
    """The tags a turn stops at: each tool's closing tag and `</answer>` (`STOP_TAGS` for search alone)."""
    return tuple(dict.fromkeys([f"</{name}>" for name in tools] + [ANSWER_CLOSE]))


@functools.lru_cache(maxsize=64)
def _tag_pattern(name: str) -> re.Pattern:
    return _SEARCH if name == "search" else re.compile(f"<{re.escape(name)}>(.*?)</{re.escape(name)}>", re.DOTALL)


def policy_text(response_text: str) -> str:
    """The response without the environment's inserted text (observations, corrective messages)."""
    text = _OBSERVATION.sub(" ", response_text).replace(INVALID_MESSAGE.strip(), " ")
    return text.replace(CHAT_INVALID_MESSAGE, " ")


def observations(response_text: str) -> list[str]:
    """The observations inserted into the response, in order (`<information>` blocks, or tool_calls'
    `<tool_response>` messages): what the policy was shown of its tools, as cut to their budgets."""
    return _OBSERVATION.findall(response_text)


def extract_answer(response_text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` in the response, stripped."""
    found = _ANSWER.findall(response_text)
    return found[-1].strip() if found else None


_OPEN_TAG = re.compile(r"<([A-Za-z_][\w-]*)>")


def well_formed(response_text: str) -> bool:
    """Every tag opened is closed (`<search>`, a tool's `<read>`, `<think>`, `<tool_call>`), every
    `<tool_call>` holds a JSON object with a `name` and `arguments`, exactly one `<answer>...</answer>`,
    and nothing after it but end-of-turn tokens."""
    text = _TRAILING_SPECIAL.sub("", response_text)
    if any(text.count(f"<{tag}>") != text.count(f"</{tag}>") for tag in set(_OPEN_TAG.findall(text))):
        return False
    if not all(_is_call(body) for body in _TOOL_CALL.findall(text)):
        return False
    if len(_ANSWER.findall(text)) != 1:
        return False
    return text.endswith(ANSWER_CLOSE)


def _is_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)


class TagFormat:
    """Search-R1's tag protocol (`rollout.protocol: tags`) behind the interface the turn logic uses,
    which `chat_tools.ChatFormat` also has: stops, parsing, the texts inserted between turns."""

    tool_head, tool_tail = OBSERVATION_HEAD, OBSERVATION_TAIL

    def __init__(self, tools: Sequence[str] = ("search",)):
        self.tools = tuple(tools)
        self.stop_tags = close_tags(self.tools)

    def parse(self, text: str) -> tuple[str, str | None, str | None]:
        action, content = parse_action(text, self.tools)
        return action, content, None

    def invalid_text(self, error: str | None, turn_text: str) -> str:
        return INVALID_MESSAGE

    def call_text(self, name: str, value: str) -> str:
        return f"<{name}> {value} </{name}>"  # search: Search-R1's <search> query </search>

    def answer_text(self, answer: str) -> str:
        return answer_action(answer)
