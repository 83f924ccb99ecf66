"""`rollout.protocol: tool_calls`: search as the model's own tool call through its chat template.

Trajectories are compared token for token against `apply_chat_template` over the same messages (the
real SmolLM2 tokenizer and the tiny model's, a real retriever server); calls that are not JSON, name
no tool or lack an argument are answered by a tool message saying so; templates without tools are
refused naming `rollout.chat_template`; SFT demonstrations, rewards and a training run with its
evaluation work in the protocol.
"""

import html
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from agent_fixtures import ROOT, toy_world_overrides

from agent_rl.config import ConfigError, load_config
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.chat_tools import CHATML_TOOLS, TOOL_SYSTEM, ChatFormat, tool_schema
from agent_rl.rollout.engines import EngineSpec, Generation
from agent_rl.rollout.loop import AgentLoop
from agent_rl.rollout.prompts import PromptSet, load_tokenizer
from agent_rl.rollout.protocol import CHAT_INVALID_MESSAGE
from agent_rl.rollout.rewards import answer_scores, em_format
from agent_rl.rollout.tools import SearchTool
from agent_rl.rollout.turns import PromptItem
from retriever_server.client import RetrieverClient

BUDGET = TokenBudget(
    max_turns=5, max_prompt_tokens=1024, max_tokens_per_turn=64, max_obs_tokens=600, max_total_tokens=4096
)
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Inception director"}}\n</tool_call>'


class ScriptedChat:
    """Writes the scripted text of turn k (k: the assistant headers in the context so far), whole."""

    batch_size = 0

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns = tokenizer, turns
        self.generator = torch.Generator().manual_seed(0)
        self.stats = {"generated_tokens": 0}

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, seeds=None):
        out = []
        for p in prompts:
            k = self.tok.decode(p, skip_special_tokens=False).count("<|im_start|>assistant") - 1
            ids = self.tok(self.turns[k], add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def chat_model_dir(toy_warm_start, tmp_path_factory):
    """The tiny model `configs/tiny_cpu_tool_calls.yaml` builds on first use over the toy world: its tokenizer
    trained on the prompts as the chat template renders them, the template's markers as special tokens."""
    from agent_rl.bootstrap.prepare import ensure_model

    path = tmp_path_factory.mktemp("chat_model") / "model"
    overrides = [*toy_world_overrides(toy_warm_start["cache"]), f"model.path={path}"]
    ensure_model(load_config("configs/tiny_cpu_tool_calls.yaml", overrides))
    return path


def _cfg(model_dir, *extra):
    return load_config(
        None,
        [f"model.path={model_dir}", "rollout.protocol=tool_calls", "rollout.chat_template=chatml_tools", *extra],
    )


def _prompts(questions, tokenizer):
    items = [
        PromptItem(f"q-{i}", "nq", tokenizer("x")["input_ids"], ["Christopher Nolan"]) for i in range(len(questions))
    ]
    return PromptSet(items, [{} for _ in questions], list(questions))


def _template_ids(tok, messages, schemas) -> list[int]:
    text = tok.apply_chat_template(messages, tools=schemas, chat_template=CHATML_TOOLS, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("model", ["smollm2", "tiny", "tiny_for_tool_calls"])
def test_a_trajectory_is_the_chat_template_over_its_messages_token_for_token(request, server, model):
    """A search call, a call with a wrong argument, a message with neither call nor answer, then the answer:
    prompt + response ids equal `apply_chat_template` over the same messages (the tool's documents as a tool
    message, the call's error as a tool message, the corrective message as a user message), the policy's
    own tokens are exactly its turns, and EM, F1 and em_format read the answer."""
    fixture = {"smollm2": "smollm2_dir", "tiny": "tiny_model_dir", "tiny_for_tool_calls": "chat_model_dir"}[model]
    model_dir = request.getfixturevalue(fixture)
    tok = load_tokenizer(str(model_dir))
    _, url = server
    client = RetrieverClient(url, topk=2)
    turns = [
        "Let me search.\n" + CALL,
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
        "I am not sure.<|im_end|>",
        "<answer> Christopher Nolan </answer><|im_end|>",
    ]
    cfg = _cfg(model_dir, "retriever.topk=2")
    loop = AgentLoop.from_config(cfg, ScriptedChat(tok, turns), tok, client, BUDGET)
    prompts = loop.admit(_prompts(["Who directed Inception?"], tok))
    (t,) = loop.run(prompts.items, group_size=1)
    assert [x.action for x in t.turns] == ["search", "invalid", "invalid", "answer"] and t.end_reason == "answer"
    assert t.turns[1].call_error == "search needs the argument 'query'" and t.turns[2].call_error is None
    docs = "\n".join(SearchTool(client, 2).call(["Inception director"])[0].parts)
    messages = [
        {"role": "system", "content": TOOL_SYSTEM},
        {"role": "user", "content": "Who directed Inception?"},
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": docs},
        {"role": "assistant", "content": turns[1]},
        {"role": "tool", "content": f"Error: {t.turns[1].call_error}"},
        {"role": "assistant", "content": "I am not sure."},
        {"role": "user", "content": CHAT_INVALID_MESSAGE},
        {"role": "assistant", "content": "<answer> Christopher Nolan </answer>"},
    ]
    want = _template_ids(tok, messages, loop.format.schemas)
    got = t.prompt_ids + t.response_ids
    assert want[: len(got)] == got
    assert tok.decode(want[len(got) :]).strip() == ""  # the template's newline after the last end of turn
    own = [i for i, m in zip(t.response_ids, t.loss_mask) if m]
    assert tok.decode(own, skip_special_tokens=False) == "".join(turns)
    assert answer_scores(t.response_text, t.golden_answers) == {"em": 1.0, "f1": 1.0}
    assert em_format(t, t.golden_answers) == 1.0  # the call with the wrong argument is still a well-formed call
    client.close()


def test_em_format_checks_the_calls_and_reads_no_answer_from_a_tool_message():
    """em_format: well-formed calls and one final answer earn EM; a call that is not JSON earns nothing; an
    `<answer>` inside a tool response (a document) is never read as the policy's answer."""

    class T:
        def __init__(self, text):
            self.response_text, self.golden_answers = text, ["Paris"]

    obs = "<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    good = CALL + obs.format("Doc 1 (Title: France) ...") + "<answer> Paris </answer><|im_end|>"
    assert em_format(T(good), ["Paris"]) == 1.0
    assert em_format(T(good.replace('"query"', "query")), ["Paris"]) == 0.0
    assert em_format(T(CALL + obs.format("<answer> Paris </answer>") + "I do not know.<|im_end|>"), ["Paris"]) == 0.0


def test_calls_are_parsed_and_every_fault_is_said(tokenizer):
    """JSON, a tool's name and its arguments are checked; each fault is an error that says what was wrong,
    a plug-in tool without a schema takes one string argument `input`, and the first call or answer wins."""

    class Calc:
        name, description = "calc", "Evaluates an arithmetic expression."

        def call(self, inputs):
            return []

    fmt = ChatFormat(tokenizer, [SearchTool(None, 3), Calc()], "chatml_tools")
    assert tool_schema(Calc())["function"]["parameters"]["required"] == ["input"]
    cases = {
        CALL: ("search", "Inception director", None),
        '<tool_call>{"name": "calc", "arguments": {"input": "2+2"}}</tool_call>': ("calc", "2+2", None),
        '<tool_call>{"name": "calc", "arguments": "{\\"input\\": \\"3\\"}"}</tool_call>': ("calc", "3", None),
        "<answer> Nolan </answer><|im_end|>" + CALL: ("answer", "Nolan", None),
        "<tool_call>search Nolan</tool_call>": "not JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "names no tool",
        '<tool_call>{"name": "google", "arguments": {"query": "x"}}</tool_call>': "no tool 'google'; the tools are",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "needs the argument 'query'",
        '<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>': "must be a string",
        '<tool_call>{"name": "search", "arguments": {"query": " "}}</tool_call>': "is empty",
        '<tool_call>{"name": "search", "arguments": {"query": "x", "k": 2}}</tool_call>': "has no argument 'k'",
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "search", "arguments": {"query": "x"}}': "not closed with </tool_call>",
        "I think it is Nolan.<|im_end|>": (("invalid", None, None)),
    }
    for text, want in cases.items():
        got = fmt.parse(text)
        if isinstance(want, tuple):
            assert got == want, text
        else:
            assert got[:2] == ("invalid", None) and want in got[2], (text, got)


def test_templates_without_tools_are_refused_naming_the_key(smollm2_dir, tiny_model_dir, tmp_path):
    """SmolLM2's own template (no tools section), a missing template file, a template that escapes a tool
    message's content (tojson) or writes the tool's name into it are refused naming rollout.chat_template; the
    key is refused under the tag protocol, an unknown protocol too; a Jinja file with a tools section is taken."""
    tok = load_tokenizer(str(smollm2_dir))
    with pytest.raises(ConfigError, match="does not render the tools' schemas; set rollout.chat_template"):
        ChatFormat(tok, [SearchTool(None, 3)], "")
    with pytest.raises(ConfigError, match="rollout.chat_template = 'nope.jinja': neither"):
        ChatFormat(tok, [SearchTool(None, 3)], "nope.jinja")
    for key in ("chat_template=chatml_tools", "system_prompt=Answer."):
        with pytest.raises(ConfigError, match=f"rollout.{key.split('=')[0]} = .* read by rollout.protocol=tool_calls"):
            load_config(None, [f"rollout.{key}"])
    with pytest.raises(ConfigError, match="rollout.protocol"):
        load_config(None, ["rollout.protocol=xml"])
    tool_branch = "'<|im_start|>user\n<tool_response>\n' + message['content'] + "
    assert tool_branch in CHATML_TOOLS
    for changed, why in (
        ("'<|im_start|>user\n<tool_response>\n' + message['content'] | tojson + ", "escaped, or moved"),
        ("'<|im_start|>user\n<tool_response>' + message['name'] + message['content'] + ", "writes the tool's name"),
    ):
        path = tmp_path / "changed.jinja"
        path.write_text(CHATML_TOOLS.replace(tool_branch, changed))
        with pytest.raises(ConfigError, match=why):
            ChatFormat(tok, [SearchTool(None, 3)], str(path))
    path = tmp_path / "t.jinja"
    path.write_text(CHATML_TOOLS)
    fmt = ChatFormat(tok, [SearchTool(None, 3)], str(path))
    assert fmt.stop_tags == ("</tool_call>", "<|im_end|>")
    assert "Search the corpus" in fmt.prompt_text("Who?") and fmt.prompt_text("Who?").endswith(
        "<|im_start|>assistant\n"
    )


def test_the_tiny_model_samples_tool_call_turns_within_the_budgets(tiny_model_dir, server):
    """The real tiny model through the HF engine under tool_calls: it stops at the protocol's stops or its
    allowance, every trajectory ends within the budget with a reason, and the loss mask is 1 exactly on the
    sampled tokens."""
    from agent_rl.learn.policy import load_policy
    from agent_rl.rollout.engines import EngineSpec, build_engine

    tok = load_tokenizer(str(tiny_model_dir))
    cfg = _cfg(tiny_model_dir)
    policy = load_policy(cfg.model, str(tiny_model_dir), "cpu")
    engine = build_engine(EngineSpec.from_config(cfg), policy, tok)
    assert "</tool_call>" in engine.stop_strings.strings
    _, url = server
    budget = TokenBudget(
        max_turns=2, max_prompt_tokens=1024, max_tokens_per_turn=24, max_obs_tokens=200, max_total_tokens=1400
    )
    loop = AgentLoop.from_config(cfg, engine, tok, RetrieverClient(url), budget)
    prompts = loop.admit(_prompts(["Who directed Inception?", "Where is the Eiffel Tower?"], tok))
    trajs = loop.run(prompts.items, group_size=2, temperature=1.0)
    for t in trajs:
        assert t.end_reason is not None and t.total_tokens <= budget.max_total_tokens
        assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
        assert (
            t.prompt_ids[-len(tok("<|im_start|>assistant\n")["input_ids"]) :]
            == tok("<|im_start|>assistant\n")["input_ids"]
        )


def test_sft_demonstrations_are_the_template_over_their_messages(toy_warm_start):
    """Under tool_calls `agent-rl sft`'s scripted demonstrations are the chat template over system, question,
    the calls, the tool messages and the answer, token for token, as RL's trajectories are."""
    from agent_rl.run import open_loop
    from agent_rl.sft import build_demonstrations

    cache = toy_warm_start["cache"]
    overrides = [*toy_world_overrides(cache), "rollout.protocol=tool_calls", "rollout.chat_template=chatml_tools"]
    overrides += ["budget.max_prompt_tokens=1024", "budget.max_obs_tokens=200", "budget.max_total_tokens=1600"]
    overrides += ["budget.max_tokens_per_turn=64"]
    cfg = load_config("configs/tiny_cpu_grpo.yaml", overrides)
    tok = load_tokenizer(cfg.model.path)
    with open_loop(cfg, None, tok) as loop:
        demos = build_demonstrations(cfg, loop)
    fmt = ChatFormat(tok, [SearchTool(None, 1)], "chatml_tools")
    rng = random.Random(0)
    for index in range(0, len(demos), max(1, len(demos) // 5)):
        t = demos.draw(index, 0.0, rng)
        text = tok.decode(t.response_ids, skip_special_tokens=False)
        calls = [json.loads(c)["arguments"]["query"] for c in re.findall(r"<tool_call>\n(.*?)\n", text)]
        assert calls, text
        bodies = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, flags=re.S)
        question = tok.decode(t.prompt_ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        messages = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": question}]
        for q, body in zip(calls, bodies):
            messages += [
                {"role": "assistant", "content": fmt.call_text("search", q)},
                {"role": "tool", "content": body},
            ]
        messages.append({"role": "assistant", "content": f"<answer> {t.golden_answers[0]} </answer>"})
        want = _template_ids(tok, messages, fmt.schemas)
        got = t.prompt_ids + t.response_ids
        assert want[: len(got)] == got and tok.decode(want[len(got) :]).strip() == ""


def test_a_training_run_with_evaluation_in_tool_calls(toy_warm_start, tmp_path):
    """`configs/tiny_cpu_tool_calls.yaml` from nothing: its model built, `agent-rl sft`, then `agent-rl train`
    with its step-0 and final evaluation: the run ends, the evaluation scored every question, and the kept
    trajectories are tool calls and tool messages."""
    cache = toy_warm_start["cache"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "agent_rl.cli", "train", "configs/tiny_cpu_tool_calls.yaml"]
    cmd += [*toy_world_overrides(cache), f"model.path={tmp_path}/model", f"model.warm_start={tmp_path}/sft"]
    cmd += ["sft.steps=4", "sft.batch_size=4", "run.max_steps=1"]
    cmd += ["rollout.prompts_per_step=2", "algo.group_size=2", "run.eval_every=1", "run.eval_max_samples=4"]
    cmd += [f"run.output_dir={out}", "run.tensorboard=false", "run.eval_sampled=false", "run.save_trajectories_every=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    for step in (0, 1):
        rows = [json.loads(x) for x in (out / "eval" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and all("em" in r for r in rows)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 for r in metrics)
    kept = [json.loads(x) for p in sorted((out / "trajectories").glob("*.jsonl")) for x in p.read_text().splitlines()]
    assert kept and all(r["prompt_text"].startswith("<|im_start|>system\n") for r in kept)
    # the viewer renders them, a refused call with its reason
    from agent_rl.reports.view import write_report

    index = write_report(sorted((out / "trajectories").glob("*.jsonl")), tmp_path / "report")
    pages = "".join(p.read_text() for p in (index.parent / "t").glob("*.html"))
    assert index.exists() and "tool_call" in pages
    refused = [x["call_error"] for r in kept for x in r["turns"] if x.get("call_error")]
    assert all(f"tool call refused: {html.escape(e)}" in pages for e in refused)


def test_a_model_built_for_tool_calls_speaks_the_template_in_few_tokens(chat_model_dir, tiny_model_dir):
    """`configs/tiny_cpu_tool_calls.yaml`'s model: every marker of the template is one special token, the
    template is the tokenizer's own (so `rollout.chat_template: ''` takes it), `rollout.system_prompt` is the
    system message, and the rendered prompt costs a fraction of the tokens a tokenizer trained without it needs."""
    cfg = load_config("configs/tiny_cpu_tool_calls.yaml", [f"model.path={chat_model_dir}"])
    tok = load_tokenizer(str(chat_model_dir))
    assert tok.chat_template == CHATML_TOOLS
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    fmt = ChatFormat(tok, [SearchTool(None, 1)], "", cfg.rollout.system_prompt)
    prompt = fmt.prompt_text("Where is the head office of Brin Tessly Labs?")
    assert prompt.startswith("<|im_start|>system\n" + cfg.rollout.system_prompt + "\nTools:")
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    other = len(load_tokenizer(str(tiny_model_dir))(prompt, add_special_tokens=False)["input_ids"])
    assert n <= cfg.budget.max_prompt_tokens and 2 * n < other, (n, other)


def _holds(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_isolated_spaces_make_a_name_copied_into_a_call_the_passages_tokens(toy_warm_start, chat_model_dir, tmp_path):
    """`model.init_pretokenizer=isolated_spaces`: a name read in a passage (after a space) and written into the
    call's JSON string (after a quote) is the same tokens; with the default bytelevel it is not (`ĠQu` against
    `Qu`), which is what a tiny model must otherwise learn to map. Text decodes back to itself either way."""
    from agent_rl.bootstrap.prepare import ensure_model

    path = tmp_path / "model"
    overrides = [
        *toy_world_overrides(toy_warm_start["cache"]),
        f"model.path={path}",
        "model.init_pretokenizer=isolated_spaces",
    ]
    cfg = load_config("configs/tiny_cpu_tool_calls.yaml", overrides)
    ensure_model(cfg)
    passage = "Kesra Cole Press\nKesra Cole Press was founded by Quill Sable."
    copied = {}
    for name, model_dir in (("bytelevel", chat_model_dir), ("isolated_spaces", path)):
        tok = load_tokenizer(str(model_dir))
        fmt = ChatFormat(tok, [SearchTool(None, 1)], "", cfg.rollout.system_prompt)
        text = fmt.prompt_text("What is the occupation of the founder of Kesra Cole Press?")
        text += fmt.call_text("search", "Quill Sable occupation")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        name_ids = tok("Quill Sable", add_special_tokens=False)["input_ids"]
        copied[name] = _holds(ids, name_ids) and _holds(tok(passage, add_special_tokens=False)["input_ids"], name_ids)
    assert copied == {"bytelevel": False, "isolated_spaces": True}


def test_template_phrases_hold_the_templates_fixed_text_as_one_token_each(toy_warm_start, tmp_path):
    """`model.init_template_phrases`: each fixed text of the template (the system message's text, the tools' schema,
    a call up to its argument) is one token of the tokenizer built for the format, a piece the tokenizer without them
    needs several for; the markers and tags stay their own special tokens; text decodes back to itself; and the
    prompt takes under half the tokens."""
    from agent_rl.bootstrap.prepare import ensure_model

    base = toy_world_overrides(toy_warm_start["cache"])
    built = {}
    for on in (True, False):
        path = tmp_path / f"model_{on}"
        cfg = load_config(
            "configs/tiny_cpu_tool_calls.yaml", [*base, f"model.path={path}", f"model.init_template_phrases={on}"]
        )
        ensure_model(cfg)
        built[on] = load_tokenizer(str(path))
    fmt = ChatFormat(built[True], [SearchTool(None, 1)], "", cfg.rollout.system_prompt)
    pieces = fmt.fixed_texts()
    assert any("Search the corpus" in p for p in pieces) and '\n{"name": "search", "arguments": {"query": "' in pieces
    text = fmt.prompt_text("Where is the head office of Brin Tessly Labs?")
    text += fmt.call_text("search", "Brin Tessly Labs head office")
    text += fmt.after_turn(fmt.tool_head, "") + "Doc 1 (Title: Brin Tessly Labs) ..." + fmt.tool_tail
    counts = {}
    for on, tok in built.items():
        for piece in pieces:
            assert (len(tok(piece, add_special_tokens=False)["input_ids"]) == 1) == on, (on, piece)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        for control in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<answer>", "</answer>"):
            assert text.count(control) == ids.count(tok.convert_tokens_to_ids(control)), (on, control)
        counts[on] = len(ids)
    assert 2 * counts[True] < counts[False], counts


def test_init_template_phrases_is_checked():
    with pytest.raises(ConfigError, match="init_template_phrases .*rollout.protocol=tool_calls"):
        load_config(None, ["model.init_template_phrases=true", "model.init_size=tiny"])
    with pytest.raises(ConfigError, match="init_size"):
        load_config("configs/tiny_cpu_tool_calls.yaml", ["model.init_template_phrases=true", "model.init_size="])


def test_init_pretokenizer_is_checked():
    with pytest.raises(ConfigError, match="init_pretokenizer"):
        load_config(None, ["model.init_pretokenizer=words"])
    with pytest.raises(ConfigError, match="init_size"):
        load_config(None, ["model.init_pretokenizer=isolated_spaces", "model.init_size="])


class RetrievalScript(ScriptedChat):
    """Searches the question, then answers with the first document's title: the second turn depends on what
    retrieval returned."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, [])

    def generate(self, prompts, max_new_tokens, temperature, top_p=1.0, seeds=None):
        out = []
        for p in prompts:
            ctx = self.tok.decode(p, skip_special_tokens=False)
            titles = re.findall(r"Doc 1\(Title: ([^)]*)\)", ctx)
            question = ctx.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            text = (
                f"<answer> {titles[-1]} </answer><|im_end|>" if titles else CALL.replace("Inception director", question)
            )
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


def test_async_and_a_replayed_record_give_the_same_trajectories_in_tool_calls(chat_model_dir, server, tmp_path):
    """Under tool_calls the asynchronous driver and a rollout replayed from a record (no server) give the
    trajectories of the synchronous live rollout, to the bit, the second turn reading what retrieval returned."""
    import dataclasses

    from retriever_server.record import RetrievalRecord

    tok = load_tokenizer(str(chat_model_dir))
    _, url = server
    questions = ["Who directed Inception?", "Which river flows through Paris?"]

    def rollout(client, mode):
        cfg = _cfg(chat_model_dir, f"rollout.mode={mode}")
        loop = AgentLoop.from_config(cfg, RetrievalScript(tok), tok, client, BUDGET)
        rows = [dataclasses.asdict(t) for t in loop.run(loop.admit(_prompts(questions, tok)).items, group_size=2)]
        for row in rows:
            for turn in row["turns"]:
                turn.pop("retrieval_ms")
        return json.dumps(rows)

    live = RetrieverClient(url, topk=2, record=RetrievalRecord(tmp_path))
    want = rollout(live, "sync")
    live.close()
    assert want.count('"action": "search"') == 4 and want.count('"action": "answer"') == 4
    assert rollout(RetrieverClient(url, topk=2), "async") == want
    for mode in ("sync", "async"):
        replay = RetrieverClient(None, topk=2, record=RetrievalRecord(tmp_path), replay=True)
        assert rollout(replay, mode) == want and replay.stats["requests"] == 0
