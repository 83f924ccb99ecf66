"""`rollout.protocol: tool_calls`: search as the model's own tool call, through its chat template.

The prompt is the chat template over a system message (`TOOL_SYSTEM`, the instruction) and the question,
with every tool's JSON schema (`apply_chat_template(messages, tools=...)`). The policy calls a tool
Hermes/Qwen style, `<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>`, and a
turn stops at `</tool_call>` or at the template's end of turn (`<|im_end|>`, `<|eot_id|>`, ...). The
call is parsed as JSON; a call that is not JSON, names no tool, or lacks or mistypes an argument is
answered by a `tool` message saying what was wrong (the turn is `invalid`, as an unparseable tag is in
the tag protocol); a message with neither a call nor an answer gets the corrective message as a `user`
message. The tool's answer goes back as the template renders a `tool` message, loss mask 0, under the
same budgets. The final answer is the `<answer> ... </answer>` of the last assistant message (the
system message asks for it), so rewards, evaluation and the viewer read both protocols alike.

Token for token: the ids the policy sampled are kept, and every inserted piece (the end of the
assistant turn a call stopped, the tool or user message, the next assistant header) is the template's
own text for it: a probe conversation is rendered and what follows the assistant's content is taken
(`ChatFormat._after_assistant`). tests/test_tool_calls.py compares whole trajectories against
`apply_chat_template` over the same messages.

Templates (`rollout.chat_template`): empty, the tokenizer's own, when it renders tools (Qwen2.5/3,
Llama 3.x, SmolLM3, Mistral's do); `chatml_tools`, the ChatML template below with a tools section,
written for this project (SmolLM2's and the tiny model's own templates have none); or the path of a
Jinja file. A template that ignores `tools` is refused with a message naming `rollout.chat_template`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.config import ConfigError, RolloutConfig
from agent_rl.rollout.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    CHAT_INVALID_MESSAGE,
    TAGS,
    TagFormat,
    answer_action,
    close_tags,
)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_RESPONSE_TAGS = ("<tool_response>", "</tool_response>")
TOOL_SYSTEM = (
    "Answer the given question. Call a tool whenever you lack some knowledge, as many times as you want. When no "
    f"further knowledge is needed, give the answer inside {ANSWER_OPEN} and {ANSWER_CLOSE}, without detailed "
    f"illustrations. For example, {answer_action('Beijing')}."
)
# ChatML with a tools section, Hermes-style calls and responses (`rollout.chat_template: chatml_tools`)
CHATML_TOOLS = (  # every newline inside a string literal: the template's text does not hang on Jinja's whitespace rules
    "{%- if tools or messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    '{%- if tools %}{{ \'\nTools: call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; its '
    "result comes back inside <tool_response></tool_response>.' }}"
    "{%- for tool in tools %}{{ '\n' }}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
TEMPLATES = {"chatml_tools": CHATML_TOOLS}
_CALL = re.compile(f"{TOOL_CALL_OPEN}(.*?){TOOL_CALL_CLOSE}", re.DOTALL)
_ANSWER = re.compile(f"{ANSWER_OPEN}(.*?){ANSWER_CLOSE}", re.DOTALL)
_PROBE = "PROBE-7f3a9c"  # a string no template writes
_CONTENT = _PROBE + 'x "quoted"\n<&>'  # a content any escaping (tojson, |e) would change
_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


def tool_schema(tool) -> dict:
    """A tool's OpenAI-style function schema: its `schema` attribute where it has one (`name`,
    `description`, `parameters` as JSON Schema), else one required string argument named by its
    `argument` attribute (`input` by default), described by its `description`."""
    schema = getattr(tool, "schema", None)
    if schema is None:
        arg = getattr(tool, "argument", "input")
        schema = {
            "name": tool.name,
            "description": tool.description,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        }
    return {"type": "function", "function": schema}


def load_template(spec: str, tokenizer) -> str:
    """The Jinja template `rollout.chat_template` names: '' the tokenizer's own, `chatml_tools`, or a file."""
    if not spec:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                "rollout.protocol = tool_calls: the tokenizer has no chat template; set rollout.chat_template to "
                "chatml_tools (shipped with agent-rl) or to a Jinja file"
            )
        return template if isinstance(template, str) else template.get("tool_use") or template["default"]
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"rollout.chat_template = {spec!r}: neither {sorted(TEMPLATES)} nor a Jinja file")
    return path.read_text()


class ChatFormat:
    """The tool-call protocol over one tokenizer, template and tool set: prompts, stops, parsing and the
    texts inserted between turns."""

    def __init__(self, tokenizer, tools: Sequence, template: str = "", system: str = ""):
        self.tok = tokenizer
        self.system = system or TOOL_SYSTEM
        self.template = load_template(template, tokenizer)
        self.key = template or "the tokenizer's own"
        self.schemas = [tool_schema(t) for t in tools]
        self.params = {s["function"]["name"]: s["function"]["parameters"] for s in self.schemas}
        probe = self.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], True)
        if self.schemas and self.schemas[0]["function"]["description"] not in probe:
            raise ConfigError(
                f"rollout.protocol = tool_calls: the chat template ({self.key}) does not render the tools' schemas; "
                "set rollout.chat_template to chatml_tools (shipped with agent-rl) or to a Jinja file with a tools "
                "section"
            )
        end = self._after_assistant([], generation=False)
        self.end_of_turn = end.strip()
        if not self.end_of_turn:
            raise ConfigError(f"rollout.chat_template ({self.key}): an assistant message has no end-of-turn text")
        self.tool_head, self.tool_tail = self._frame("tool")
        self.user_head, self.user_tail = self._frame("user")
        self.stop_tags = (TOOL_CALL_CLOSE, self.end_of_turn)

    def render(self, messages: list[dict], generation: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(
                messages,
                tools=self.schemas or None,
                chat_template=self.template,
                add_generation_prompt=generation,
                tokenize=False,
            )
        except TemplateError as err:
            raise ConfigError(
                f"rollout.chat_template ({self.key}) failed to render a conversation of system, user, assistant and "
                f"tool messages: {err}; use chatml_tools or another template"
            ) from err

    def _after_assistant(self, messages: list[dict], generation: bool = True) -> str:
        """What the template writes after an assistant message's content when `messages` follow it."""
        convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
        text = self.render([*convo, {"role": "assistant", "content": _PROBE}, *messages], generation)
        return text[text.index(_PROBE) + len(_PROBE) :]

    def _frame(self, role: str) -> tuple[str, str]:
        """The text before and after a `role` message's content, inserted after an assistant turn: the same for
        every tool (a template that writes the tool's name into its message is refused)."""
        frames = set()
        for name in ("search", "read"):
            text = self._after_assistant([{"role": role, "content": _CONTENT, "name": name}])
            if text.count(_CONTENT) != 1 or not text.lstrip().startswith(self.end_of_turn):
                raise ConfigError(
                    f"rollout.chat_template ({self.key}): a {role} message's content is not rendered as written after "
                    "the assistant's end of turn (escaped, or moved); use chatml_tools or a template that writes "
                    "message contents verbatim"
                )
            frames.add(tuple(text.split(_CONTENT)))
        if len(frames) != 1:
            raise ConfigError(
                f"rollout.chat_template ({self.key}): the template writes the tool's name into its {role} message, "
                "which one frame for every tool cannot hold; use chatml_tools or a template without it"
            )
        head, tail = frames.pop()
        return head, tail

    def prompt_text(self, question: str) -> str:
        """The prompt: the system message (`rollout.system_prompt`), the question as the user message, the
        assistant header."""
        return self.render(
            [{"role": "system", "content": self.system}, {"role": "user", "content": question.strip()}], True
        )

    def markers(self) -> list[str]:
        """The template's control texts (`<|im_start|>`, `<|eot_id|>`, `<tool_call>`, `<tool_response>`, ...): the
        special tokens of a tokenizer trained for it (`agent-rl init-model` under this protocol)."""
        text = self.prompt_text("Q") + "".join(self.call_text(name, "q") for name in self.params)
        text += self.tool_head + self.tool_tail + self.user_head + self.end_of_turn
        found = re.findall(r"<\|[^<>|\s]+\|>", text)
        found += [tag for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, *_RESPONSE_TAGS) if tag in text]
        return list(dict.fromkeys(found))

    def fixed_texts(self) -> list[str]:
        """The template's fixed text between its control tokens (its markers and the agent tags): the prompt
        less the question (the system message with the tools' schemas), each call less its argument
        (`\n{"name": "search", "arguments": {"query": "`), the tool and user frames. The same in every
        conversation, so a tokenizer trained for this format can hold each as one token
        (`model.init_template_phrases`); a piece of one word or punctuation run is left out (BPE makes it a
        token or two already)."""
        controls = sorted({*self.markers(), *TAGS}, key=len, reverse=True)
        cut = re.compile("|".join(re.escape(c) for c in controls))
        texts = self.prompt_text(_PROBE).split(_PROBE)
        for name in self.params:
            texts += self.call_text(name, _PROBE).split(_PROBE)
        texts += [self.tool_head, self.tool_tail, self.user_head, self.user_tail]
        pieces = [part for text in texts for part in cut.split(text) if len(re.findall(r"\w+|[^\w\s]+", part)) > 1]
        return list(dict.fromkeys(pieces))

    def after_turn(self, head: str, turn_text: str) -> str:
        """`head` less the end of turn the policy already wrote (a turn that stopped at it)."""
        if turn_text.rstrip().endswith(self.end_of_turn):
            at = head.index(self.end_of_turn) + len(self.end_of_turn)
            return head[at:]
        return head

    def invalid_text(self, error: str | None, turn_text: str) -> str:
        """What answers an invalid turn: a call's error as a tool message, else the corrective user message."""
        if error is not None:
            return self.after_turn(self.tool_head, turn_text) + f"Error: {error}" + self.tool_tail
        return self.after_turn(self.user_head, turn_text) + CHAT_INVALID_MESSAGE + self.user_tail

    def call_text(self, name: str, value: str) -> str:
        """A call as the policy writes it (the scripted demonstrations' calls)."""
        arg = next(iter(self.params[name]["properties"]))
        return f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": name, "arguments": {arg: value}}) + f"\n{TOOL_CALL_CLOSE}"

    def answer_text(self, answer: str) -> str:
        """A final answer as the policy writes it: `<answer>`, then the end of the turn."""
        return answer_action(answer) + self.end_of_turn

    def parse(self, text: str) -> tuple[str, str | None, str | None]:
        """(action, the tool's input, error) of one turn: the first complete call or answer wins."""
        call, answer = _CALL.search(text), _ANSWER.search(text)
        if call and (answer is None or call.start() < answer.start()):
            return self._call(call.group(1))
        if answer is not None:
            return "answer", answer.group(1).strip(), None
        if TOOL_CALL_OPEN in text:
            return "invalid", None, f"the tool call was not closed with {TOOL_CALL_CLOSE}"
        return "invalid", None, None

    def _call(self, body: str) -> tuple[str, str | None, str | None]:
        example = '{"name": "search", "arguments": {"query": "..."}}'
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return "invalid", None, f"the tool call is not JSON ({err.msg} at character {err.pos}); write {example}"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return "invalid", None, f"the tool call names no tool; write {example}"
        name, args = call["name"], call.get("arguments", {})
        if name not in self.params:
            return "invalid", None, f"there is no tool {name!r}; the tools are {', '.join(self.params)}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return "invalid", None, f"the arguments of {name} must be a JSON object"
        spec = self.params[name]
        props, required = spec.get("properties", {}), spec.get("required", [])
        for key in required:
            if key not in args:
                return "invalid", None, f"{name} needs the argument {key!r}"
        for key, value in args.items():
            if key not in props:
                return "invalid", None, f"{name} has no argument {key!r}; its arguments are {', '.join(props)}"
            want = _JSON_TYPES.get(props[key].get("type", ""), object)
            if not isinstance(value, want) or (isinstance(value, bool) and want in (int, (int, float))):
                return "invalid", None, f"the argument {key!r} of {name} must be a {props[key]['type']}"
        if len(props) == 1:
            value = args.get(next(iter(props)), "")
            value = value if isinstance(value, str) else json.dumps(value)
            if not value.strip():
                return "invalid", None, f"the argument {next(iter(props))!r} of {name} is empty"
            return name, value.strip(), None
        return name, json.dumps(args), None


def build_format(rollout: RolloutConfig, tokenizer, tools: Sequence):
    """The protocol `rollout.protocol` names: `ChatFormat` for tool_calls, Search-R1's `TagFormat` else."""
    if rollout.protocol == "tool_calls":
        return ChatFormat(tokenizer, tools, rollout.chat_template, rollout.system_prompt)
    return TagFormat(tuple(t.name for t in tools))


def stop_tags(rollout: RolloutConfig, tokenizer, tool_names: Sequence[str]) -> tuple[str, ...]:
    """Where a turn stops: each tool's closing tag and `</answer>` (tags), `</tool_call>` and the template's
    end of turn (tool_calls)."""
    if rollout.protocol == "tool_calls":
        return ChatFormat(tokenizer, [], rollout.chat_template).stop_tags
    return close_tags(tool_names)
