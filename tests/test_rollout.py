"""The agent loop: scripted policies drive every path; a real server answers the searches."""

import signal
from pathlib import Path

import pytest
import torch
from agent_fixtures import ScriptedEngine, start_server

from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.engines import Generation, HFEngine, sample_tokens
from agent_rl.rollout.loop import AgentLoop, PromptItem
from agent_rl.rollout.protocol import INVALID_MESSAGE, parse_action
from retriever_server.client import RetrieverClient


def _items(tokenizer, n=2):
    ids = tokenizer("Question: Who directed Inception?\n", add_special_tokens=False)["input_ids"]
    return [PromptItem(f"toy-{i}", "toy", ids, ["Christopher Nolan"]) for i in range(n)]


BUDGET = TokenBudget(
    max_turns=3, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=1500, max_total_tokens=64 + 3 * 1524 + 24
)


def _spans(t):
    """(sampled?, ids) runs of the response."""
    runs, cur, flag = [], [], None
    for i, m in zip(t.response_ids, t.loss_mask):
        if flag is not None and m != flag:
            runs.append((flag, cur))
            cur = []
        flag = m
        cur.append(i)
    if cur:
        runs.append((flag, cur))
    return runs


def test_parse_action():
    """The first complete tag wins; an empty query is invalid."""
    assert parse_action("<think>x</think><search> a b </search>") == ("search", "a b")
    assert parse_action("<answer> Paris </answer><search>q</search>") == ("answer", "Paris")
    assert parse_action("<search>  </search>") == ("invalid", None)
    assert parse_action("no tags at all") == ("invalid", None)


def test_search_then_answer_masks_exactly_the_observation(tokenizer, server):
    """search -> information -> answer: loss_mask is 0 exactly on the inserted tokens, ids untouched."""
    _, url = server

    def script(ctx):
        return (
            "<answer> Christopher Nolan </answer>" if "<information>" in ctx else "<search> Christopher Nolan </search>"
        )

    loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, RetrieverClient(url, topk=3), BUDGET)
    trajs = loop.run(_items(tokenizer), group_size=2, temperature=1.0)
    assert len(trajs) == 4
    for t in trajs:
        assert t.end_reason == "answer"
        assert [x.action for x in t.turns] == ["search", "answer"]
        assert t.turns[0].query == "Christopher Nolan" and t.turns[0].retrieval_ms > 0
        runs = _spans(t)
        assert [r[0] for r in runs] == [1, 0, 1]
        obs = tokenizer.decode(runs[1][1], skip_special_tokens=False)
        assert obs.startswith("\n\n<information>Doc 1(Title: ") and obs.endswith("</information>\n\n")
        assert "Doc 3(Title:" in obs
        assert tokenizer.decode(runs[0][1], skip_special_tokens=False) == "<search> Christopher Nolan </search>"
        assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
        assert "<answer> Christopher Nolan </answer>" in t.response_text


def test_invalid_action_gets_corrective_message(tokenizer, server):
    """A turn with no valid tag gets Search-R1's corrective message (mask 0), then the loop goes on."""
    _, url = server
    script = lambda ctx: "<answer> Nolan </answer>" if "invalid" in ctx else "I think the answer is Nolan"  # noqa: E731
    loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, RetrieverClient(url), BUDGET)
    (t,) = loop.run(_items(tokenizer, 1), group_size=1)
    assert [x.action for x in t.turns] == ["invalid", "answer"] and t.end_reason == "answer"
    inserted = tokenizer.decode(_spans(t)[1][1], skip_special_tokens=False)
    assert inserted == INVALID_MESSAGE
    assert loop.counters["rollout/action_invalid"] == 1


def test_multi_search_and_forced_final_answer(tokenizer, server):
    """A policy that searches every turn gets max_turns observations, then a final turn whose search is not run."""
    _, url = server
    loop = AgentLoop(
        ScriptedEngine(tokenizer, lambda ctx: "<search> Inception film </search>"),
        tokenizer,
        RetrieverClient(url),
        BUDGET,
    )
    (t,) = loop.run(_items(tokenizer, 1), group_size=1)
    assert len(t.turns) == BUDGET.max_turns + 1
    assert sum(1 for x in t.turns if x.obs_tokens > 0) == BUDGET.max_turns
    assert t.end_reason == "max_turns" and t.total_tokens <= BUDGET.max_total_tokens


def test_runaway_policy_is_bounded(tokenizer, server):
    """A policy that never emits a stop tag ends within max_total_tokens; each turn is cut at its allowance."""
    _, url = server
    loop = AgentLoop(ScriptedEngine(tokenizer, lambda ctx: "blah " * 5000), tokenizer, RetrieverClient(url), BUDGET)
    trajs = loop.run(_items(tokenizer, 3), group_size=2)
    for t in trajs:
        assert t.total_tokens <= BUDGET.max_total_tokens
        assert all(x.truncated and x.gen_tokens == BUDGET.max_tokens_per_turn for x in t.turns)
        assert t.end_reason == "invalid"
        assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
    # A total that binds early: the searcher gets its forced-answer turn before the cap (no cut).
    tight = TokenBudget(
        max_turns=50, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=200, max_total_tokens=150
    )
    loop = AgentLoop(
        ScriptedEngine(tokenizer, lambda ctx: "<search> Inception </search>"), tokenizer, RetrieverClient(url), tight
    )
    for t in loop.run(_items(tokenizer, 2), group_size=2):
        assert t.end_reason == "max_turns" and t.total_tokens <= 150 and t.turns[-1].obs_tokens == 0
    assert loop.counters["budget/forced_answer_total"] == 4 and loop.counters["budget/end_budget_total"] == 0


def test_dead_retriever_gives_error_observation(tokenizer, hotpot_index_dir):
    """The server is stopped mid-rollout: the rollout finishes, with 'retrieval failed' observations and a count."""
    with start_server(hotpot_index_dir) as (proc, url):

        def script(ctx):
            if ctx.count("<information>") == 1 and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            return "<search> Inception </search>"

        client = RetrieverClient(url, timeout_s=2, max_retries=1, backoff_s=0.01)
        loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, client, BUDGET)
        trajs = loop.run(_items(tokenizer, 2), group_size=1)
    for t in trajs:
        assert t.turns[0].retriever_error is None
        assert t.turns[1].retriever_error is not None
        assert "Retrieval failed" in t.response_text
        assert t.end_reason == "retriever_error"
    assert loop.counters["retriever/errors"] >= 2


def test_hf_engine_with_tiny_model_and_real_server(tokenizer, tiny_model_dir, server):
    """The real HFEngine: sampled ids pass through untouched, no token after a stop tag, budgets hold."""
    from transformers import AutoModelForCausalLM

    _, url = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tokenizer, "cpu", batch_size=8, seed=0)
    loop = AgentLoop(engine, tokenizer, RetrieverClient(url), BUDGET)
    trajs = loop.run(_items(tokenizer, 3), group_size=2, temperature=1.0)
    stop_ids = set(engine.stop_ids)
    for t in trajs:
        assert t.end_reason is not None and t.total_tokens <= BUDGET.max_total_tokens
        for sampled, ids in _spans(t):
            if sampled:
                assert not any(i in stop_ids for i in ids[:-1])  # nothing generated past a stop tag
        assert all(lp <= 0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
    # Same seed, same model -> the same rollouts (reproducible on CPU).
    engine2 = HFEngine(model, tokenizer, "cpu", batch_size=8, seed=0)
    again = AgentLoop(engine2, tokenizer, RetrieverClient(url), BUDGET).run(
        _items(tokenizer, 3), group_size=2, temperature=1.0
    )
    assert [t.response_ids for t in trajs] == [t.response_ids for t in again]


def test_client_splits_batches_above_the_servers_per_request_limit(server):
    """A 300-prompt eval turn is one `retrieve` call; the server refuses more than 256 queries per
    request (413), so the client splits it and every query gets its own, ordered documents."""
    import requests

    _, url = server
    queries = [f"film number {i} Inception" if i % 2 else f"Nolan {i}" for i in range(300)]
    refused = requests.post(f"{url}/retrieve", json={"queries": queries, "topk": 1}, timeout=120)
    assert refused.status_code == 413 and "256" in refused.text
    client = RetrieverClient(url, topk=1, max_queries_per_request=128)
    docs = client.retrieve(queries)
    assert len(docs) == 300 and all(len(d) == 1 for d in docs)
    assert client.stats["requests"] == 3 and client.stats["errors"] == 0
    for i in (0, 1, 150, 299):  # order kept across the split
        assert docs[i] == client.retrieve([queries[i]])[0]
    with pytest.raises(ValueError, match="max_queries_per_request"):
        RetrieverClient(url, max_queries_per_request=0)


def test_hf_engine_drops_finished_rows_without_changing_the_rest(tokenizer, tiny_model_dir):
    """Rows that reach their limit leave the batch and the KV cache (a quarter done triggers it);
    the rows still running generate exactly what they would have in the full batch (greedy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tokenizer, "cpu", batch_size=8, seed=0)
    engine.stop_ids, engine.stop_strings = [tokenizer.pad_token_id], []  # rows run to their limits
    prompts = [
        tokenizer(f"Question: Who directed film {i}?\n", add_special_tokens=False)["input_ids"] for i in range(8)
    ]
    rows_fed: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows_fed.append(args[0].shape[0]))
    try:
        mixed = engine.generate(prompts, [2] * 6 + [20, 0], temperature=0.0)
    finally:
        hook.remove()
    assert rows_fed[0] == 7 and rows_fed[-1] == 1  # the 0-limit row never enters; 6 finished rows leave
    full = engine.generate(prompts, [20] * 8, temperature=0.0)
    assert [len(g.token_ids) for g in mixed] == [2] * 6 + [20, 0]
    assert mixed[7].finish_reason == "length" and mixed[7].logprobs == []
    for g, ref in zip(mixed, full):
        assert g.token_ids == ref.token_ids[: len(g.token_ids)]
        assert g.logprobs == pytest.approx(ref.logprobs[: len(g.logprobs)], abs=1e-4)


def test_hf_engine_prefills_a_repeated_prompt_once(tokenizer, tiny_model_dir):
    """A GRPO group repeats its prompt: each distinct prompt is prefilled once and its cache rows
    copied; every row generates what it would alone (greedy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tokenizer, "cpu", batch_size=8, seed=0)
    engine.stop_ids, engine.stop_strings = [tokenizer.pad_token_id], []
    a, b = (
        tokenizer(q, add_special_tokens=False)["input_ids"]
        for q in ("Question: Who wrote it?\n", "Question: Where is the old mill of Velk?\n")
    )
    rows_fed: list[tuple] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows_fed.append(tuple(args[0].shape)))
    try:
        grouped = engine.generate([a, a, b, b, a], [12] * 5, temperature=0.0)
    finally:
        hook.remove()
    assert rows_fed[0] == (2, max(len(a), len(b))) and rows_fed[1][0] == 5  # then one token for each of the 5 rows
    alone = [engine.generate([p], [12], temperature=0.0)[0] for p in (a, b)]
    for g, ref in zip(grouped, [alone[0], alone[0], alone[1], alone[1], alone[0]]):
        assert g.token_ids == ref.token_ids
        assert g.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_sampler_draws_from_the_tempered_distribution_and_respects_top_p():
    """Inverse-CDF sampling: frequencies match the softmax at the temperature, a zero-probability
    token is never drawn, top-p keeps only the nucleus, and the log-prob returned is the token's."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = (probs.log() * 2.0).expand(40000, 5)  # at temperature 2 the softmax gives `probs` back
    gen = torch.Generator().manual_seed(0)
    ids, lp = sample_tokens(logits, 2.0, 1.0, gen)
    freq = torch.bincount(ids, minlength=5).float() / len(ids)
    assert torch.allclose(freq, probs, atol=0.01) and freq[4] == 0
    assert torch.allclose(lp, probs.log()[ids])
    ids, _ = sample_tokens(logits, 2.0, 0.7, gen)  # nucleus {0, 1}: 0.5 + 0.3 covers 0.7
    freq = torch.bincount(ids, minlength=5).float() / len(ids)
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]), atol=0.01)


def test_hf_engine_row_seeds_make_each_rows_draws_its_own(tokenizer, tiny_model_dir):
    """With one seed per prompt a row samples the same tokens (T=1) whatever else is in the batch:
    prompts of other lengths (left padding), a repeated prompt, rows that finish early and leave;
    its log-probs agree to float rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tokenizer, "cpu", batch_size=8, seed=3)
    engine.stop_ids, engine.stop_strings = [tokenizer.pad_token_id], []  # rows run to their limits
    questions = ["Who wrote it?", "Where is the old mill of Velk, and who runs it now?", "When?", "Who wrote it?"]
    prompts = [tokenizer(f"Question: {q}\n", add_special_tokens=False)["input_ids"] for q in questions]
    limits, seeds = [30, 6, 30, 18], [11, 12, 13, 14]
    batched = engine.generate(prompts, limits, temperature=1.0, seeds=seeds)
    assert batched[0].token_ids[:18] != batched[3].token_ids, "a repeated prompt with its own seed draws its own"
    for i, got in enumerate(batched):
        alone = engine.generate([prompts[i]], [limits[i]], temperature=1.0, seeds=[seeds[i]])[0]
        assert got.token_ids == alone.token_ids and len(got.token_ids) == limits[i]
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


@pytest.mark.parametrize("turns,per_turn,total", [(8, 64, 256), (32, 64, 2048)])
def test_total_budget_binds_with_a_forced_answer_turn(tokenizer, server, turns, per_turn, total):
    """max_total_tokens below prompt + max_turns x (turn + obs) binds: a policy that searches every
    turn, and a runaway one that never stops, end within the total with a reason; the searcher
    gets a forced-answer turn (its search not run) before room runs out, counted under
    budget/forced_answer_total; the loss mask is 1 exactly on generated tokens."""
    _, url = server
    budget = TokenBudget(
        max_turns=turns, max_prompt_tokens=64, max_tokens_per_turn=per_turn, max_obs_tokens=256, max_total_tokens=total
    )
    for script in (lambda ctx: "<search> Inception film director </search>", lambda ctx: "blah " * 5000):
        loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, RetrieverClient(url), budget)
        trajs = loop.run(_items(tokenizer, 2), group_size=2)
        for t in trajs:
            assert t.total_tokens <= total and t.end_reason is not None
            assert sum(t.loss_mask) == sum(x.gen_tokens for x in t.turns)
            assert len(t.loss_mask) == len(t.response_ids) == len(t.logprobs)
            assert len(t.turns) <= turns + 1
        assert loop.counters["budget/forced_answer_total"] == len(trajs)
        searched = [x for t in trajs for x in t.turns if x.action == "search"]
        if searched:  # the searcher: its last turn was the forced answer (no observation after it)
            assert all(t.turns[-1].obs_tokens == 0 and t.end_reason == "max_turns" for t in trajs)
            assert all(1 < len(t.turns) < turns + 1 for t in trajs)
