"""Session fixtures for the trainer's tests: a tiny model, a small dense index, a tiny toy world."""
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2 with a BPE tokenizer trained on the hotpotqa fixture text."""
    import json

    from agent_rl.model_init import init_model

    texts = [json.loads(line)["contents"] for line in (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()]
    out = tmp_path_factory.mktemp("tiny_model")
    init_model(out, size="tiny", texts=texts, seed=0)
    return out


@pytest.fixture(scope="session")
def hotpot_index_dir(tmp_path_factory) -> Path:
    """A flat MiniLM index over the first 200 hotpotqa fixture paragraphs (fast to encode)."""
    from retriever_server.build import build_index

    work = tmp_path_factory.mktemp("hotpot_flat")
    corpus = work / "corpus.jsonl"
    lines = (FIXTURES / "hotpotqa100" / "corpus.jsonl").read_text().splitlines()[:200]
    corpus.write_text("\n".join(lines) + "\n")
    build_index(corpus, work / "index", kind="flat")
    return work / "index"
