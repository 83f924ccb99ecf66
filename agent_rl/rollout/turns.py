"""The turn logic of a multi-turn search agent: what one generated turn does to a trajectory.

A turn's text is parsed into an action (Search-R1's tags): an answer ends the trajectory, a tool
call (`<search>` or another of `rollout.tools`) returns its tool and input for the driver to run,
anything else gets Search-R1's corrective message. The observation of a search is
`\n\n<information>Doc 1(Title: T) ...</information>\n\n` (Search-R1's format), every other tool's
answer is framed the same way, all with loss mask 0; a dead retriever (a failed tool) gives an
observation saying it failed. The token budget is asked before anything is appended, whatever the
tool; after `max_turns` tool turns the policy must answer (as Search-R1's final rollout).
Departure from Search-R1: no decode/re-tokenize of sampled text, stop at tags, hard budgets.

The drivers sit above this module and it imports neither: `sync_loop` (Search-R1's
turn-synchronous loop) and `async_loop` (each trajectory on its own); `loop.AgentLoop` picks one.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.chat_tools import ChatFormat
from agent_rl.rollout.engines import Engine, Generation
from agent_rl.rollout.protocol import (
    OBSERVATION_HEAD,
    OBSERVATION_TAIL,
    TRUNCATION_MARKER,
    TagFormat,
    policy_text,
    well_formed,
)
from agent_rl.rollout.tools import SearchTool, Tool, ToolOutput, prompt_note
from agent_rl.rollout.trajectory import Trajectory, Turn
from retriever_server.client import RetrieverClient


@dataclass
class PromptItem:
    """One training or test prompt, already tokenized (never truncated)."""

    prompt_id: str
    data_source: str
    prompt_ids: list[int]
    golden_answers: list[str]


class ObservationBuilder:
    """Turns retrieved documents into observation token ids that fit an allowance, framed by `head` and
    `tail` (the tag protocol's `<information>`; in tool_calls the template's tool message)."""

    def __init__(self, tokenizer, head: str = OBSERVATION_HEAD, tail: str = OBSERVATION_TAIL):
        self.tok = tokenizer
        self.head = self._ids(head)
        self.tail = self._ids(tail)
        self.marker = self._ids(TRUNCATION_MARKER)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def min_tokens(self) -> int:
        return len(self.head) + len(self.tail) + len(self.marker) + 1

    def build(self, body_parts: list[str], allowance: int) -> tuple[list[int], bool]:
        """Whole documents first; if even one does not fit, cut it by tokens with a visible marker."""
        frame = len(self.head) + len(self.tail)
        for k in range(len(body_parts), 0, -1):
            body = self._ids("\n".join(body_parts[:k]))
            if frame + len(body) <= allowance:
                return self.head + body + self.tail, k < len(body_parts)
        body = self._ids(body_parts[0]) if body_parts else []
        room = allowance - frame - len(self.marker)
        return self.head + body[: max(0, room)] + self.marker + self.tail, True


class Turns:
    """The turn logic over one rollout's trajectories, shared by both drivers: counters, the forced
    answer, taking a generated turn, inserting an observation."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        client: RetrieverClient | None,
        budget: TokenBudget,
        topk: int = 3,
        tools: list[Tool] | None = None,
        fmt: TagFormat | ChatFormat | None = None,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.client = client
        self.budget = budget
        self.topk = topk
        # `rollout.tools` (tools.build_tools); None: Search-R1's search alone
        self.tools: dict[str, Tool] = {t.name: t for t in (tools or [SearchTool(client, topk)])}
        # `rollout.protocol`: Search-R1's tags (protocol.TagFormat) or chat_tools.ChatFormat's tool calls
        self.format: TagFormat | ChatFormat = fmt or TagFormat(tuple(self.tools))
        self.chat = isinstance(self.format, ChatFormat)
        self.note = "" if self.chat else prompt_note(list(self.tools.values()))
        self._noted: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> with the tools' note
        self.obs = ObservationBuilder(tokenizer, self.format.tool_head, self.format.tool_tail)
        self._invalid: dict[tuple, list[int]] = {}  # (error, the turn wrote its end) -> the inserted ids
        self.counters: Counter = Counter()
        self._forced: set[int] = set()  # trajectories whose next turn must answer (no room for the corrective message)

    def admit(self, prompts):
        """Drop from a loaded `prompts.PromptSet` the prompts that the tools' note pushes past
        budget.max_prompt_tokens (counted per source and reported, as loading drops the long ones), so
        none of them stops a run hours in; returns the set. Search alone adds no note: nothing to drop.
        In tool_calls every prompt is first rendered anew from its question by the chat template."""
        if self.chat:
            self._render(prompts)
        elif not self.note:
            return prompts
        keep = [i for i, it in enumerate(prompts.items) if self.budget.admits_prompt(len(self._prompt(it.prompt_ids)))]
        if len(keep) == len(prompts.items):
            return prompts
        kept = set(keep)
        gone = Counter(it.data_source for i, it in enumerate(prompts.items) if i not in kept)
        for source, n in gone.items():
            added = (
                "the tools' schemas"
                if self.chat
                else f"the list of rollout.tools ({len(self.obs._ids(self.note))} tokens)"
            )
            print(
                f"[data] dropped {n} {source} prompts that {added} pushes past budget.max_prompt_tokens="
                f"{self.budget.max_prompt_tokens}",
                file=sys.stderr,
            )
        if not keep:
            raise ValueError(
                f"no prompt fits budget.max_prompt_tokens={self.budget.max_prompt_tokens} with "
                + ("the chat template and the tools' schemas" if self.chat else "the list of rollout.tools added to it")
                + ": raise budget.max_prompt_tokens"
            )
        prompts.items = [prompts.items[i] for i in keep]
        prompts.metadata = [prompts.metadata[i] for i in keep]
        prompts.questions = [prompts.questions[i] for i in keep]
        prompts.dropped.update(gone)
        return prompts

    def _render(self, prompts) -> None:
        """tool_calls: each prompt is the chat template over the instruction and the row's `question`."""
        for it, question in zip(prompts.items, prompts.questions):
            if not question:
                raise ValueError(
                    "rollout.protocol = tool_calls renders each prompt from its `question` column; prompt "
                    f"{it.prompt_id} has none (write the data with `data-prep`)"
                )
            assert isinstance(self.format, ChatFormat)
            it.prompt_ids = self.obs._ids(self.format.prompt_text(question))

    def new_trajectories(self, items: list[PromptItem], group_size: int) -> list[Trajectory]:
        """`group_size` empty trajectories per prompt (a GRPO group's rows are adjacent)."""
        self._forced.clear()
        trajs = [
            Trajectory(
                prompt_id=it.prompt_id,
                data_source=it.data_source,
                prompt_ids=self._prompt(it.prompt_ids),
                golden_answers=list(it.golden_answers),
                sample_idx=j,
            )
            for it in items
            for j in range(group_size)
        ]
        for t in trajs:
            if not self.budget.admits_prompt(t.prompt_tokens):
                raise ValueError(
                    f"prompt {t.prompt_id} has {t.prompt_tokens} tokens > budget.max_prompt_tokens "
                    f"({self.budget.max_prompt_tokens}); "
                    + (
                        f"the list of rollout.tools added {len(self.obs._ids(self.note))} tokens to it: raise "
                        "budget.max_prompt_tokens"
                        if self.note
                        else "prompts are filtered at data loading, never truncated"
                    )
                )
        return trajs

    def _prompt(self, ids: list[int]) -> list[int]:
        """The prompt with the tools' note before its last `Question:` (unchanged for search alone)."""
        if not self.note:
            return list(ids)
        key = tuple(ids)
        if key not in self._noted:
            text = self.tok.decode(ids, skip_special_tokens=False)
            at = max(0, text.rfind("Question:"))
            self._noted[key] = self.obs._ids(text[:at] + self.note + text[at:])
        return list(self._noted[key])

    def must_answer(self, t: Trajectory, turn: int) -> bool:
        """The budget's forced-answer rule for this trajectory's next turn; counts the total-budget case."""
        final = self.budget.must_answer(turn, t.total_tokens, self.obs.min_tokens()) or id(t) in self._forced
        if final and not self.budget.is_final_turn(turn):
            self.counters["budget/forced_answer_total"] += 1
        return final

    def take_turn(self, t: Trajectory, g: Generation, final: bool) -> tuple[Tool, str] | None:
        """Append a generated turn and act on it: end the trajectory, insert the corrective
        message, or return the tool call to run (the caller calls the tool and then `observe`)."""
        t.append(g.token_ids, sampled=True, logprobs=g.logprobs)
        text = self.tok.decode(g.token_ids, skip_special_tokens=False)
        action, content, error = self.format.parse(text)
        truncated = g.finish_reason == "length"
        t.turns.append(
            Turn(
                action=action,
                gen_tokens=len(g.token_ids),
                truncated=truncated,
                query=content if action in self.tools else None,
                call_error=error,
            )
        )
        self.counters["rollout/turns"] += 1
        self.counters[f"rollout/action_{action}"] += 1
        if truncated:
            self.counters["budget/turn_truncated"] += 1
        if action == "answer":
            self.end(t, "answer")
        elif final:
            last_err = len(t.turns) > 1 and t.turns[-2].retriever_error is not None
            self.end(t, "invalid" if action == "invalid" else ("retriever_error" if last_err else "max_turns"))
        elif action in self.tools:
            assert content is not None
            return self.tools[action], content
        else:
            self._insert(t, self._invalid_ids(error, text))
        return None

    def _invalid_ids(self, error: str | None, text: str) -> list[int]:
        key = (error, isinstance(self.format, ChatFormat) and text.rstrip().endswith(self.format.end_of_turn))
        if key not in self._invalid:
            self._invalid[key] = self.obs._ids(self.format.invalid_text(error, text))
        return self._invalid[key]

    def finish(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            t.response_text = self.tok.decode(t.response_ids, skip_special_tokens=False)

    def end(self, t: Trajectory, reason: str) -> None:
        t.end_reason = reason
        self.counters[f"budget/end_{reason}"] += 1

    def _insert(self, t: Trajectory, ids: list[int]) -> None:
        allowance = self.budget.obs_allowance(t.total_tokens)
        if allowance < len(ids):
            # No room for the corrective message: the next turn is the forced answer instead.
            self.counters["budget/corrective_no_room"] += 1
            self._forced.add(id(t))
            return
        t.append(ids, sampled=False)
        t.turns[-1].obs_tokens = len(ids)

    def count_calls(self, tool: Tool, calls: int, failed: bool) -> None:
        """Count a batch of a tool's calls (a retriever's also as `retriever/queries` and `/errors`)."""
        self.counters[f"tool/{tool.name}_calls"] += calls
        if failed:
            self.counters[f"tool/{tool.name}_errors"] += calls
        if getattr(tool, "uses_retriever", False):
            self.counters["retriever/queries"] += calls
            if failed:
                self.counters["retriever/errors"] += calls

    def observe(self, t: Trajectory, output: ToolOutput | None, error: str | None, ms: float) -> None:
        """Insert the observation for the last turn's tool call (`output` None: the tool failed)."""
        turn = t.turns[-1]
        turn.retrieval_ms = ms
        if output is None:
            turn.retriever_error = error
            what = (
                "Retrieval failed: the search engine" if turn.action == "search" else f"{turn.action} failed: the tool"
            )
            parts = [f"{what} did not answer. Try again or answer from what you know."]
        else:
            if output.fresh is not None:  # only what this trajectory has not been shown yet
                output = output.fresh({d["id"] for x in t.turns[:-1] for d in x.docs or ()})
            parts = output.parts
            turn.docs = output.docs
        allowance = self.budget.obs_allowance(t.total_tokens)
        if allowance < self.obs.min_tokens():
            self.counters["budget/obs_no_room"] += 1
            self.end(t, "budget_total")
            return
        ids, cut = self.obs.build(parts, allowance)
        if cut:
            self.counters["budget/obs_truncated"] += 1
        turn.obs_truncated = cut
        turn.obs_tokens = len(ids)
        t.append(ids, sampled=False)


def repeats_ngram(t: Trajectory, n: int = 4, times: int = 3) -> bool:
    """The policy's own tokens (loss mask 1) hold some n-gram `times` or more times: a response caught in a
    loop. The tags of a well-formed trajectory are shorter than 4 tokens apart from their content, and a
    query repeated across a trajectory's searches counts twice, so a healthy response stays under 3."""
    ids = [tok for tok, m in zip(t.response_ids, t.loss_mask) if m]
    seen = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return max(seen.values(), default=0) >= times


def rollout_metrics(trajs: list[Trajectory], counters: Counter) -> dict[str, float]:
    """Namespaced rollout/budget/retriever metrics for one batch."""
    n = max(1, len(trajs))
    resp = [t.response_tokens for t in trajs]
    gen = [sum(t.loss_mask) for t in trajs]
    m: dict[str, float] = {
        "rollout/trajectories": float(len(trajs)),
        "rollout/response_length_mean": sum(resp) / n,
        "rollout/response_length_max": float(max(resp, default=0)),
        "rollout/generated_tokens_mean": sum(gen) / n,
        "rollout/turns_mean": sum(len(t.turns) for t in trajs) / n,
        "rollout/searches_mean": sum(sum(1 for x in t.turns if x.action == "search") for t in trajs) / n,
        "rollout/invalid_frac": sum(sum(1 for x in t.turns if x.action == "invalid") for t in trajs)
        / max(1, sum(len(t.turns) for t in trajs)),
        "rollout/total_tokens_max": float(max((t.total_tokens for t in trajs), default=0)),
    }
    # Early signs of a degenerating policy (the collapse guard reads them; each is a metric either way):
    # malformed responses, responses looping on a repeated n-gram, and trajectories that never search.
    m["rollout/format_error_frac"] = sum(not well_formed(policy_text(t.response_text)) for t in trajs) / n
    m["rollout/repeat_frac"] = sum(repeats_ngram(t) for t in trajs) / n
    m["rollout/no_search_frac"] = sum(not any(x.action == "search" for x in t.turns) for t in trajs) / n
    reasons = Counter(t.end_reason for t in trajs)
    for reason in ("answer", "max_turns", "budget_total", "invalid", "retriever_error"):
        m[f"budget/end_{reason}_frac"] = reasons.get(reason, 0) / n
    for key, value in counters.items():
        m[key] = float(value)
    return m
