"""Record and replay of retrieval: a rollout replayed from a record is bit-identical to the live
one with no server running; a miss is an error naming the query; a torn line (a kill while
writing) loses only its own entry; ranks writing one folder each keep a segment of their own."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agent_fixtures import ScriptedEngine

from agent_rl.bootstrap.prepare import local_retriever
from agent_rl.config import ConfigError, load_config
from agent_rl.rollout.budget import TokenBudget
from agent_rl.rollout.loop import AgentLoop, PromptItem
from agent_rl.rollout.rewards import compute_reward
from retriever_server.app import index_fingerprint
from retriever_server.client import ReplayMiss, RetrieverClient
from retriever_server.record import RetrievalRecord

BUDGET = TokenBudget(
    max_turns=4, max_prompt_tokens=64, max_tokens_per_turn=24, max_obs_tokens=400, max_total_tokens=64 + 4 * 424 + 24
)
QUESTIONS = ["Who directed Inception?", "Which river flows through Paris?", "Where was Doran Velk born?"]
TITLE = re.compile(r"Doc 1\(Title: ([^)]*)\)")


def _items(tokenizer) -> list[PromptItem]:
    return [
        PromptItem(f"q-{i}", "hotpot", tokenizer(f"Question: {q}\n", add_special_tokens=False)["input_ids"], ["x"])
        for i, q in enumerate(QUESTIONS)
    ]


def script(ctx: str) -> str:
    """Search the question, then the first document's title, then answer with the last one's title:
    every turn after the first depends on what retrieval returned."""
    titles = TITLE.findall(ctx)
    if not titles:
        question = ctx.split("Question:", 1)[1].split("\n", 1)[0].strip()
        return f"<search> {question} </search>"
    if len(titles) == 1:
        return f"<search> {titles[0]} </search>"
    return f"<answer> {titles[-1]} </answer>"


def _run(tokenizer, client: RetrieverClient, mode: str = "sync") -> list[dict]:
    """The rollout as the evaluation keeps it (trajectory, turns, documents, reward), less the wall times."""
    trajs = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, client, BUDGET, topk=3, mode=mode).run(
        _items(tokenizer), group_size=2, temperature=0.0
    )
    out = []
    for t in trajs:
        t.reward = compute_reward("em", t.response_text, t.golden_answers)
        row = dataclasses.asdict(t)
        for turn in row["turns"]:
            turn.pop("retrieval_ms")
        out.append(row)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_replayed_rollout_is_bit_identical_with_no_server(tokenizer, server, tmp_path, mode):
    """A rollout recorded against the live server and replayed from the record alone (no URL) gives
    the same trajectories, documents, scores and rewards, to the bit (JSON of the whole)."""
    _, url = server
    live_client = RetrieverClient(url, topk=3, record=RetrievalRecord(tmp_path))
    live = _run(tokenizer, live_client, mode)
    live_client.close()
    assert all(len(t["turns"]) == 3 and t["turns"][1]["docs"] for t in live)
    # 3 questions, then their first titles: a group's two samples ask the same, recorded once
    assert live_client.stats["recorded"] == len({t["turns"][i]["query"] for t in live for i in (0, 1)})
    (fingerprint,) = RetrievalRecord(tmp_path).fingerprints()
    about = json.loads((tmp_path / fingerprint / "index.json").read_text())  # for people: which index
    assert about["kind"] == "flat" and about["count"] == 200 and about["url"] == url
    replay_client = RetrieverClient(None, topk=3, record=RetrievalRecord(tmp_path), replay=True)
    replayed = _run(tokenizer, replay_client, mode)
    assert json.dumps(replayed) == json.dumps(live)
    assert replay_client.stats["requests"] == 0 and replay_client.stats["replayed"] == 12
    assert list(tmp_path.glob("*/*.jsonl")) == list((tmp_path / fingerprint).glob("*.jsonl"))  # replay wrote nothing


def test_fingerprint_is_what_health_serves_and_follows_the_index(server, hotpot_index_dir):
    """/health's index_fingerprint is the manifest's, less where and when it was built, with the
    serving options; another corpus or another efSearch gives another one."""
    import requests

    _, url = server
    health = requests.get(f"{url}/health", timeout=30).json()
    manifest = json.loads((hotpot_index_dir / "manifest.json").read_text())
    assert health["index_fingerprint"] == index_fingerprint(manifest, {})
    assert health["corpus_sha256"] == manifest["corpus_sha256"]
    moved = {**manifest, "corpus": "/elsewhere/corpus.jsonl", "created": "2001-01-01T00:00:00Z"}
    assert index_fingerprint(moved, {}) == health["index_fingerprint"]
    assert index_fingerprint({**manifest, "corpus_sha256": "0" * 64}, {}) != health["index_fingerprint"]
    assert index_fingerprint(manifest, {"ef_search": 16}) != health["index_fingerprint"]


def test_a_miss_is_an_error_naming_the_query_and_stops_the_rollout(tokenizer, server, tmp_path):
    """Replaying a record that lacks a query raises ReplayMiss naming it, in the client and through a
    rollout (not a 'retrieval failed' observation, which would make the replay differ silently)."""
    _, url = server
    recorder = RetrieverClient(url, topk=3, record=RetrievalRecord(tmp_path))
    recorder.retrieve(["Who directed Inception?"])
    recorder.close()
    replay = RetrieverClient(None, topk=3, record=RetrievalRecord(tmp_path), replay=True)
    assert replay.retrieve(["Who directed Inception?"])[0]
    with pytest.raises(ReplayMiss, match=r"'Which river flows through Paris\?'.*retriever.replay_miss=live"):
        replay.retrieve(["Who directed Inception?", "Which river flows through Paris?"])
    with pytest.raises(ReplayMiss, match="at topk 5"):  # topk is part of the key
        replay.retrieve(["Who directed Inception?"], topk=5)
    with pytest.raises(ReplayMiss, match="Which river flows through Paris"):
        AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, replay, BUDGET).run(_items(tokenizer), group_size=1)


def test_replay_miss_live_asks_the_server_and_records_the_answer(server, tmp_path):
    """replay_miss=live: a miss goes to the live server and joins the record; a later replay with no
    server answers it, identically."""
    _, url = server
    RetrieverClient(url, record=RetrievalRecord(tmp_path)).retrieve(["Inception"])
    client = RetrieverClient(url, record=RetrievalRecord(tmp_path), replay=True, replay_miss="live")
    docs = client.retrieve(["Inception", "Paris"])
    assert client.stats["replayed"] == 1 and client.stats["recorded"] == 1 and client.stats["requests"] == 1
    client.close()
    again = RetrieverClient(None, record=RetrievalRecord(tmp_path), replay=True).retrieve(["Inception", "Paris"])
    assert again == docs


def test_reads_are_recorded_and_replayed_beside_searches(server, tmp_path):
    """`/read` answers (the `read` tool's) join the record under k = 0, an unknown id as None; a
    replay with no server gives the same documents, and an unrecorded id is a miss naming it."""
    _, url = server
    live = RetrieverClient(url, topk=3, record=RetrievalRecord(tmp_path))
    ids = [d["id"] for d in live.retrieve(["Inception"])[0]][:2]
    read = live.read([*ids, "no-such-id"])
    live.close()
    assert read[0]["id"] == ids[0] and read[0]["contents"] and read[2] is None
    assert live.stats["recorded"] == 1 + 3
    replay = RetrieverClient(None, topk=3, record=RetrievalRecord(tmp_path), replay=True)
    assert replay.read([*ids, "no-such-id"]) == read and replay.stats["requests"] == 0
    assert replay.retrieve(["Inception"])[0][0]["id"] == ids[0]
    with pytest.raises(ReplayMiss, match=r"the read of document 'other-id'"):
        replay.read(["other-id"])


def _segment_lines(folder: Path) -> list[bytes]:
    return [line for seg in sorted(folder.glob("*/*.jsonl")) for line in seg.read_bytes().splitlines(keepends=True)]


def test_a_torn_last_line_loses_only_its_entry(server, tmp_path, capsys):
    """A kill in the middle of a write leaves the segment's last line without its end: the reader
    skips it (and says so), every other entry is read, and the next process (its own segment)
    records the lost query again."""
    _, url = server
    queries = ["Inception", "Paris", "Nolan", "Seine"]
    client = RetrieverClient(url, topk=2, record=RetrievalRecord(tmp_path))
    live = client.retrieve(queries)
    client.close()
    (segment,) = tmp_path.glob("*/*.jsonl")
    data = segment.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    segment.write_bytes(data[: last + (len(data) - last) // 2])  # the last entry cut halfway
    replay = RetrieverClient(None, topk=2, record=RetrievalRecord(tmp_path), replay=True)
    assert replay.retrieve(queries[:3]) == live[:3]
    assert "skipped 1 torn" in capsys.readouterr().err
    with pytest.raises(ReplayMiss, match="'Seine'"):
        replay.retrieve(queries)
    redo = RetrieverClient(url, topk=2, record=RetrievalRecord(tmp_path), replay=True, replay_miss="live")
    assert redo.retrieve(queries) == live and redo.stats["recorded"] == 1
    redo.close()
    assert len(list(tmp_path.glob("*/*.jsonl"))) == 2  # the torn segment is never appended to
    assert RetrieverClient(None, topk=2, record=RetrievalRecord(tmp_path), replay=True).retrieve(queries) == live


WRITER = textwrap.dedent(
    """
    import sys
    from retriever_server.record import RetrievalRecord

    record = RetrievalRecord(sys.argv[1])
    doc = {"id": "1", "contents": "T\\n" + "x" * 20000, "title": "T", "score": 0.5}
    i = 0
    while True:
        record.append("fp", [(f"{sys.argv[2]}-{i}", 3, [doc] * 3)])
        i += 1
        if i == 50:
            print("ready", flush=True)
    """
)


def test_killed_writers_sharing_a_folder_leave_whole_entries(tmp_path):
    """Two processes (two ranks) record into one folder, each its own segment, and are SIGKILLed
    mid-stream: every entry read back is whole and each writer's entries are a gapless prefix."""
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], stdout=subprocess.PIPE, text=True)
        for name in ("rank0", "rank1")
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(list((tmp_path / "fp").glob("*.jsonl"))) == 2
    answers = RetrievalRecord(tmp_path).load("fp")
    for name in ("rank0", "rank1"):
        got = sorted(int(q.split("-")[1]) for q, _ in answers if q.startswith(name))
        assert len(got) >= 50 and got == list(range(len(got)))
    assert all(len(docs) == 3 and docs[0]["contents"].endswith("x" * 100) for docs in answers.values())
    whole = [line for line in _segment_lines(tmp_path) if line.endswith(b"\n")]
    assert len(answers) == len(whole)  # every whole line is an entry (the keys are distinct)


def test_config_replay_starts_no_retriever(tmp_path, server):
    """retriever.replay with replay_miss=error: local_retriever starts no server and builds no index
    (it yields None); the client the config describes answers from the record. record and replay
    together, or an unknown replay_miss, are refused at load; an empty record is refused at start."""
    _, url = server
    RetrieverClient(url, record=RetrievalRecord(tmp_path / "rec")).retrieve(["Inception"])
    missing_index = tmp_path / "no_index"
    cfg = load_config(None, [f"retriever.replay={tmp_path / 'rec'}", f"retriever.index_dir={missing_index}"])
    with local_retriever(cfg.retriever) as got:
        assert got is None
        client = RetrieverClient.from_config(cfg.retriever, got)
        assert client.retrieve(["Inception"])[0] and client.stats["replayed"] == 1
    assert not missing_index.exists()
    with pytest.raises(ConfigError, match="retriever.record and retriever.replay"):
        load_config(None, ["retriever.replay=a", "retriever.record=b"])
    with pytest.raises(ConfigError, match="replay_miss"):
        load_config(None, ["retriever.replay_miss=skip"])
    empty = load_config(None, [f"retriever.replay={tmp_path / 'empty'}"])
    with pytest.raises(FileNotFoundError, match="holds no recorded answers"):
        RetrieverClient.from_config(empty.retriever, None)
