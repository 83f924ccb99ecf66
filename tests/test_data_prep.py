"""data-prep: FlashRAG loaders, prompt templates, merge, over-long filtering, corpus formats, toy world.

Real files only: the fixtures under tests/fixtures/flashrag (FlashRAG layout, one folder per
dataset with its real split names), a BPE tokenizer trained here, the CLI run as a subprocess.
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.json as pj
import pyarrow.parquet as pq
import pytest

from data_prep.corpus import CorpusError, cacm_html_to_contents, convert_corpus, iter_json_array
from data_prep.qa import DATASETS, SCHEMA, DataPrepError, merge, prepare_qa
from data_prep.templates import render_prompt

FIXTURES = Path(__file__).parent / "fixtures"
FLASHRAG = FIXTURES / "flashrag"
CORPORA = FLASHRAG / "corpora"
# The splits each dataset has on the hub (and in its fixture folder); test<-dev where there is no test.
SPLITS = {
    "nq": {"train": "train", "test": "test"},
    "triviaqa": {"train": "train", "test": "test"},
    "popqa": {"test": "test"},
    "hotpotqa": {"train": "train", "test": "dev"},
    "2wikimultihopqa": {"train": "train", "test": "dev"},
    "musique": {"train": "train", "test": "dev"},
    "bamboogle": {"test": "test"},
}
# Search-R1 scripts/data_process/nq_search.py, make_prefix(template_type='base'), copied as text.
SEARCH_R1_BASE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("data-prep")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "data_prep.cli"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=_env(), timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _fixture_rows(dataset: str, split: str) -> list[dict]:
    return [
        json.loads(line) for line in (FLASHRAG / dataset / f"{split}.jsonl").read_text().splitlines() if line.strip()
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (agent_rl.bootstrap.model_init.train_tokenizer, with its chat template) saved to disk."""
    from agent_rl.bootstrap.model_init import train_tokenizer

    texts = [SEARCH_R1_BASE] + [
        r["question"] for d, splits in SPLITS.items() for s in splits.values() for r in _fixture_rows(d, s)
    ]
    tok = train_tokenizer(texts, vocab_size=400)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- qa loaders


@pytest.mark.parametrize("dataset", DATASETS)
def test_each_loader_reads_its_flashrag_fixture(dataset, tmp_path):
    """Every dataset's fixture folder -> {split}.parquet with the trainer's columns, prefixed ids,
    '?'-terminated questions, string answer lists, base prompts and metadata as JSON; a missing
    test split falls back to dev and a missing train split is skipped."""
    summaries = prepare_qa(dataset, tmp_path, ["train", "test"], FLASHRAG / dataset)
    assert {s.split: s.source_split for s in summaries} == SPLITS[dataset]
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == sorted(f"{s}.parquet" for s in SPLITS[dataset])
    for split, source in SPLITS[dataset].items():
        table = pq.read_table(tmp_path / f"{split}.parquet")
        assert table.schema.names == SCHEMA.names
        assert {"uid", "data_source", "prompt", "golden_answers"} <= set(
            table.column_names
        )  # agent_rl.rollout.prompts's contract
        rows, raw = table.to_pylist(), _fixture_rows(dataset, source)
        assert len(rows) == len(raw)
        for row, rec in zip(rows, raw):
            assert row["id"] == row["uid"] == f"{dataset}_{rec['id']}"
            assert row["data_source"] == dataset and row["split"] == split
            assert row["question"] == rec["question"].strip() + ("" if rec["question"].strip().endswith("?") else "?")
            assert row["golden_answers"] == rec["golden_answers"]
            assert row["prompt"] == SEARCH_R1_BASE.format(question=row["question"])
            assert json.loads(row["metadata"]) == rec.get("metadata", {})


def test_local_input_forms(tmp_path):
    """--input takes a FlashRAG checkout root (NAME/ under it) or one parquet file with --split."""
    [summary] = prepare_qa("bamboogle", tmp_path / "root", ["test"], FLASHRAG)
    assert summary.rows == len(_fixture_rows("bamboogle", "test"))
    src = tmp_path / "popqa_test.parquet"
    pq.write_table(pj.read_json(FLASHRAG / "popqa" / "test.jsonl"), src)
    [summary] = prepare_qa("popqa", tmp_path / "out", ["test"], src)
    rows = pq.read_table(summary.path).to_pylist()
    assert [r["id"] for r in rows] == ["popqa_test_0", "popqa_test_1", "popqa_test_2"]
    assert json.loads(rows[1]["metadata"])["obj"] == "Japan"
    with pytest.raises(DataPrepError, match="--split"):
        prepare_qa("popqa", tmp_path / "out2", ["train", "test"], src)


def test_hub_failure_points_to_input(tmp_path, monkeypatch):
    """Without network the hub path fails with an error that names --input as the offline route."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataPrepError, match="--input"):
        prepare_qa("bamboogle", tmp_path)


def test_base_template_is_search_r1_verbatim(tmp_path):
    """The base prompt equals Search-R1's nq_search.py text, with '?' appended as it does."""
    prepare_qa("nq", tmp_path, ["train"], FLASHRAG / "nq")
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    assert row["prompt"] == SEARCH_R1_BASE.format(question="who wrote the declaration of independence?")
    assert render_prompt("Q?", "base") == SEARCH_R1_BASE.format(question="Q?")


def test_chat_template_through_tokenizer(tmp_path, tokenizer_dir):
    """--template chat wraps the base instruction as one user turn of the tokenizer's chat template,
    and the files load through agent_rl.rollout.prompts with the same token counts as the summary's."""
    from transformers import AutoTokenizer

    from agent_rl.rollout.budget import TokenBudget
    from agent_rl.rollout.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    [summary] = prepare_qa(
        "triviaqa", tmp_path, ["test"], FLASHRAG / "triviaqa", template="chat", tokenizer=str(tokenizer_dir)
    )
    rows = pq.read_table(summary.path).to_pylist()
    for row in rows:
        content = SEARCH_R1_BASE.format(question=row["question"]).rstrip("\n")
        assert row["prompt"] == tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        assert row["prompt"].startswith("<|user|>\n") and row["prompt"].endswith("<|assistant|>\n")
    prompts = load_prompts([summary.path], tok, TokenBudget(4, summary.max_tokens, 50, 50, 10_000))
    assert not prompts.dropped and [item.prompt_id for item in prompts.items] == [r["uid"] for r in rows]
    assert [len(item.prompt_ids) for item in prompts.items] == summary.prompt_tokens
    with pytest.raises(DataPrepError, match="--tokenizer"):
        prepare_qa("triviaqa", tmp_path / "x", ["test"], FLASHRAG / "triviaqa", template="chat")


# --------------------------------------------------------------------------- merge and filtering


def test_group_ids_unique_across_datasets_after_merge(tmp_path):
    """NQ and TriviaQA share the raw id 'train_0' (Search-R1's collision); prefixed ids stay unique
    after merge, counts per data_source are reported, and merging a file twice is refused."""
    assert _fixture_rows("nq", "train")[0]["id"] == _fixture_rows("triviaqa", "train")[0]["id"] == "train_0"
    for d in ("nq", "triviaqa", "hotpotqa"):
        prepare_qa(d, tmp_path / d, ["train", "test"], FLASHRAG / d)
    files = [tmp_path / d / "train.parquet" for d in ("nq", "triviaqa", "hotpotqa")]
    [counts] = merge(files, tmp_path / "m.parquet", shuffle_seed=3).values()
    assert counts == {"nq": 3, "triviaqa": 2, "hotpotqa": 4}
    uids = pq.read_table(tmp_path / "m.parquet").column("uid").to_pylist()
    assert len(uids) == len(set(uids)) == 9
    assert uids != [u for f in files for u in pq.read_table(f).column("uid").to_pylist()]  # shuffled
    with pytest.raises(DataPrepError, match="more than one row"):
        merge([files[0], files[0]], tmp_path / "dup.parquet")
    # Folders merge split by split, through the CLI (the README's form).
    out = _cli(
        "merge", "--inputs", str(tmp_path / "nq"), str(tmp_path / "hotpotqa"), "--out", str(tmp_path / "both")
    ).stdout
    assert "hotpotqa" in out and pq.read_table(tmp_path / "both" / "test.parquet").num_rows == 3 + 3
    assert (
        _cli(
            "merge", "--inputs", str(files[0]), str(files[0]), "--out", str(tmp_path / "x.parquet"), check=False
        ).returncode
        == 2
    )


def test_over_long_filtering_counts_end_to_end(tmp_path, tokenizer_dir):
    """`data-prep qa --tokenizer --max-prompt-tokens N` (CLI subprocess) drops exactly the prompts
    longer than N, per dataset, and the summary table reports rows, dropped and max tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = {}
    for d in ("nq", "popqa"):
        prepare_qa(d, tmp_path / f"all_{d}", ["test"], FLASHRAG / d)
        prompts = pq.read_table(tmp_path / f"all_{d}" / "test.parquet").column("prompt").to_pylist()
        lengths[d] = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    limit = sorted(lengths["nq"] + lengths["popqa"])[2]  # strictly inside the range: some kept, some dropped
    for d in ("nq", "popqa"):  # nq through the CLI, popqa through the library
        expect_drop = sum(n > limit for n in lengths[d])
        if d == "nq":
            out = _cli(
                "qa",
                "--dataset",
                d,
                "--input",
                str(FLASHRAG / d),
                "--split",
                "test",
                "--out",
                str(tmp_path / d),
                "--tokenizer",
                str(tokenizer_dir),
                "--max-prompt-tokens",
                str(limit),
            ).stdout
            line = next(row for row in out.splitlines() if row.startswith(d))
            rows, dropped, _skipped, _mean, mx = (int(float(x)) for x in line.split()[2:7])
        else:
            [s] = prepare_qa(d, tmp_path / d, ["test"], FLASHRAG / d, tokenizer=tok, max_prompt_tokens=limit)
            rows, dropped, mx = s.rows, s.dropped, s.max_tokens
        kept = pq.read_table(tmp_path / d / "test.parquet").column("prompt").to_pylist()
        kept_lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in kept]
        assert len(kept) == len(lengths[d]) - expect_drop and all(n <= limit for n in kept_lengths)
        assert (rows, dropped, mx) == (len(kept), expect_drop, max(kept_lengths))
    assert sum(n > limit for n in lengths["nq"]) >= 1  # nq's long test question is one of them
    assert (
        _cli(
            "qa",
            "--dataset",
            "nq",
            "--input",
            str(FLASHRAG / "nq"),
            "--out",
            str(tmp_path / "e"),
            "--max-prompt-tokens",
            "5",
            check=False,
        ).returncode
        == 2
    )


# --------------------------------------------------------------------------- corpora


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_corpus_hipporag_streams_and_dedupes(tmp_path):
    """HippoRAG list: ids from idx (a reused idx is dropped and counted) or from the position."""
    stats = convert_corpus(CORPORA / "hipporag_corpus.json", "hipporag", tmp_path / "c.jsonl")
    assert (stats.read, stats.written, stats.duplicates, stats.duplicate_examples) == (4, 3, 1, ["0"])
    docs = _read_jsonl(tmp_path / "c.jsonl")
    assert docs[0] == {"id": "0", "contents": "Oslo\nOslo is the capital and most populous city of Norway."}
    assert [d["id"] for d in docs] == ["0", "1", "3"]
    convert_corpus(CORPORA / "hipporag_noidx.json", "hipporag", tmp_path / "n.jsonl")
    assert [d["id"] for d in _read_jsonl(tmp_path / "n.jsonl")] == ["0", "1"]
    # The incremental reader agrees with json.load at any chunk size and rejects broken lists.
    text = (CORPORA / "hipporag_corpus.json").read_text()
    for chunk in (1, 3, 17, 1 << 20):
        assert list(iter_json_array(io.StringIO(text), chunk_size=chunk)) == json.loads(text)
    assert list(iter_json_array(io.StringIO(" [ ] "))) == []
    for bad in ('{"a": 1}', '[{"a": 1} {"b": 2}]', '[{"a": 1},', '[{"a": '):
        with pytest.raises(CorpusError):
            list(iter_json_array(io.StringIO(bad), chunk_size=4))


def test_corpus_wiki18_and_beir(tmp_path):
    """wiki18 passes contents through (or joins title+text); BEIR joins title+text; dupes dropped;
    the output is what retriever_server.store reads."""
    from retriever_server.store import iter_corpus

    stats = convert_corpus(CORPORA / "wiki18.jsonl", "wiki18", tmp_path / "w.jsonl")
    assert (stats.read, stats.written, stats.duplicates) == (4, 3, 1)
    docs = _read_jsonl(tmp_path / "w.jsonl")
    assert (
        docs[0]["contents"]
        == '"Aaron"\nAaron is a prophet, high priest, and the brother of Moses in the Abrahamic religions.'
    )
    assert docs[2] == {"id": "3", "contents": "Kyoto\nKyoto is a city on the island of Honshu."}
    stats = convert_corpus(CORPORA / "beir_corpus.jsonl", "beir", tmp_path / "b.jsonl")
    assert (stats.read, stats.written, stats.duplicates) == (4, 3, 1)
    docs = list(iter_corpus(tmp_path / "b.jsonl"))
    assert docs[0] == {
        "id": "doc1",
        "contents": "Albert Einstein\nAlbert Einstein was a theoretical physicist born in Ulm in 1879.",
    }
    assert docs[2]["contents"] == "\nA passage without a title."
    with pytest.raises(CorpusError, match="_id"):
        convert_corpus(CORPORA / "wiki18.jsonl", "beir", tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()


def test_corpus_cacm_html_tarball_and_jsonl(tmp_path):
    """CACM: a tar.gz of HTML files (id = file stem, title line then Anserini-style collapsed text;
    the same file twice is a dupe) and Anserini's converted JSONL both convert; via the CLI too."""
    tar_path = tmp_path / "cacm.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for sub in ("cacm", "again"):
            for f in (
                sorted((CORPORA / "cacm_html").glob("*.html"))
                if sub == "cacm"
                else [CORPORA / "cacm_html" / "CACM-0001.html"]
            ):
                tar.add(f, arcname=f"{sub}/{f.name}")
    out = _cli("corpus", "--input", str(tar_path), "--format", "cacm", "--out", str(tmp_path / "h.jsonl")).stdout
    assert "read 3 records, wrote 2, dropped 1 duplicate ids" in out
    docs = _read_jsonl(tmp_path / "h.jsonl")
    assert [d["id"] for d in docs] == ["CACM-0001", "CACM-0002"]
    assert docs[1]["contents"].split("\n") == [
        "Extraction of Roots by Repeated Subtractions for Digital Computers",
        "A method for extracting roots & powers by repeated subtraction is described. CACM December, 1958 Sugai, I. "
        "CA581202 JB March 22, 1978 8:29 PM 2 5 2",
    ]
    anserini = _read_jsonl(FIXTURES / "cacm" / "cacm_corpus.jsonl")[0]["contents"]
    assert anserini.startswith(docs[0]["contents"].replace("\n", " "))  # same text as Anserini's converter
    stats = convert_corpus(CORPORA / "cacm_corpus.jsonl", "cacm", tmp_path / "j.jsonl")
    assert (stats.read, stats.written, stats.duplicates) == (4, 3, 1)
    assert _read_jsonl(tmp_path / "j.jsonl")[0]["contents"] == anserini
    assert cacm_html_to_contents("<html><pre>\nOnly a title\n</pre></html>") == "Only a title\n"


# --------------------------------------------------------------------------- toy world


def test_toy_world_deterministic_and_answers_reachable(tmp_path):
    """Same seed -> byte-identical files (CLI and library agree); another seed differs; every test
    question's hops are answered by a passage titled with the hop's entity, which the hop's query names."""
    from data_prep.toy_world import build_toy_world

    names = ("corpus.jsonl", "train.parquet", "test.parquet")
    _cli("toy-world", "--out", str(tmp_path / "a"), "--seed", "0", "--num-entities", "60")
    build_toy_world(tmp_path / "b", seed=0, num_entities=60)
    build_toy_world(tmp_path / "c", seed=1, num_entities=60)
    assert [_sha256(tmp_path / "a" / n) for n in names] == [_sha256(tmp_path / "b" / n) for n in names]
    assert all(_sha256(tmp_path / "a" / n) != _sha256(tmp_path / "c" / n) for n in names)

    by_title: dict[str, list[str]] = {}
    for doc in _read_jsonl(tmp_path / "a" / "corpus.jsonl"):
        title, text = doc["contents"].split("\n", 1)
        by_title.setdefault(title, []).append(text)
    rows = pq.read_table(tmp_path / "a" / "test.parquet").to_pylist()
    assert rows and {r["data_source"] for r in rows} == {"toy"}
    for row in rows:
        meta = json.loads(row["metadata"])
        assert meta["hop_answers"][-1] == row["golden_answers"][0]
        assert len(meta["queries"]) == len(meta["hop_answers"]) == len(meta["supporting_titles"])
        for query, title, answer in zip(meta["queries"], meta["supporting_titles"], meta["hop_answers"]):
            assert query.startswith(title)
            assert any(answer in text for text in by_title.get(title, [])), (row["question"], title, answer)
    # About a third of the questions are two-hop, and every entity a test question touches is a test entity.
    train_rows = pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()
    metas = [json.loads(r["metadata"]) for r in rows + train_rows]
    assert 0.25 < sum(m["type"] == "two_hop" for m in metas) / len(metas) < 0.45
    assert {m["type"] for m in metas} == {"single", "two_hop"}
    train_entities = {t for r in train_rows for t in json.loads(r["metadata"])["supporting_titles"]}
    test_entities = {t for r in rows for t in json.loads(r["metadata"])["supporting_titles"]}
    assert test_entities and not test_entities & train_entities
    assert json.loads((tmp_path / "a" / "world.json").read_text())["seed"] == 0
