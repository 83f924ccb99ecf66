"""`data-prep toy-world`: a seeded synthetic world that the whole pipeline can learn on a CPU.

People and organisations with names built from small recurring pools of parts ("Doran Velk"),
attributes from small pools (city of birth, occupation, instrument; an organisation's founder is
a person, its head office a city). Each passage states one fact, so a query naming the entity
and the attribute ("Doran Velk born") finds it at rank 1; similar names (shared parts) act as
distractors. Questions are single-hop ("Where was Doran Velk born?": one search) or two-hop ("In
which city was the founder of Velk Works born?": search "Velk Works founder", read the founder's
name, search "<founder> born"); about a third are two-hop, so the second search is a skill that
moves test EM. `metadata.type` names the kind and `metadata.queries` holds the natural query per
hop. Entities are split between train and test, and an organisation's founder comes from its own
split, so test questions are about entities never asked about in training: the policy must
search, not memorise. Same seed -> byte-identical files. Prompts use the compact template by
default (the same protocol as Search-R1's base template in a quarter of the tokens;
`template="base"` for theirs).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.templates import render_prompt

FIRST = [
    "Doran",
    "Mira",
    "Talen",
    "Kesra",
    "Brin",
    "Solva",
    "Arden",
    "Lusk",
    "Venna",
    "Orrin",
    "Pell",
    "Tamsin",
    "Quill",
    "Ressa",
    "Corvin",
    "Ilsa",
    "Bram",
    "Nyra",
    "Edric",
    "Faye",
]
LAST = [
    "Velk",
    "Marrow",
    "Tessly",
    "Brook",
    "Halder",
    "Quint",
    "Ostrow",
    "Fenn",
    "Garrick",
    "Lorne",
    "Pike",
    "Rusk",
    "Sable",
    "Thorne",
    "Wexley",
    "Yarrow",
    "Dunmore",
    "Ashby",
    "Cole",
    "Harte",
]
ORG_SUFFIX = ["Works", "Foundry", "Labs", "Trading", "Mills", "Press"]
CITIES = [
    "Oslo",
    "Lima",
    "Cairo",
    "Quito",
    "Porto",
    "Dakar",
    "Hanoi",
    "Perth",
    "Turin",
    "Accra",
    "Bergen",
    "Kyoto",
    "Malmo",
    "Nantes",
    "Riga",
    "Seville",
    "Tallinn",
    "Utrecht",
    "Valencia",
    "Zagreb",
]
JOBS = [
    "baker",
    "pilot",
    "painter",
    "farmer",
    "sailor",
    "teacher",
    "doctor",
    "tailor",
    "miner",
    "chemist",
    "poet",
    "carpenter",
]
INSTRUMENTS = ["violin", "flute", "drums", "cello", "harp", "guitar", "piano", "trumpet", "banjo", "oboe"]


# (question, the attribute's query word, attribute) per person, and per organisation's founder.
PERSON_QUESTIONS = [
    ("Where was {} born", "born", "city"),
    ("What is the occupation of {}", "occupation", "job"),
    ("Which instrument does {} play", "instrument", "instrument"),
]
FOUNDER_QUESTIONS = [
    ("In which city was the founder of {} born", "born", "city"),
    ("What is the occupation of the founder of {}", "occupation", "job"),
    ("Which instrument does the founder of {} play", "instrument", "instrument"),
]
ORG_SHARE = 0.4  # organisations among the entities: three two-hop questions each, so ~35% of questions are two-hop
VERSION = 2  # bumped whenever the same seed would write a different world


def _person_passages(name: str, a: dict, rng: random.Random) -> list[str]:
    """One fact per passage: a search for "NAME born" usually finds the birth passage at rank 1."""
    born = rng.choice([f"{name} was born in {a['city']}.", f"{name} was born in the city of {a['city']}."])
    job = rng.choice([f"{name} works as a {a['job']}.", f"By profession, {name} is a {a['job']}."])
    music = f"{name} plays the {a['instrument']}."
    return [f"{name}\n{born}", f"{name}\n{job}", f"{name}\n{music}"]


def build_toy_world(
    out_dir: Path, seed: int = 0, num_entities: int = 1000, test_fraction: float = 0.15, template: str = "compact"
) -> dict:
    """Write corpus.jsonl, train.parquet, test.parquet under out_dir; return paths and counts."""
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_orgs = max(2, int(num_entities * ORG_SHARE))
    n_people = max(4, num_entities - n_orgs)
    names = [f"{f} {last}" for f in FIRST for last in LAST]
    rng.shuffle(names)
    if n_people > len(names):
        names += [f"{f} {last}-{m}" for m in ("Ross", "Vale") for f in FIRST for last in LAST]
    people = names[:n_people]
    attrs = {
        p: {"city": rng.choice(CITIES), "job": rng.choice(JOBS), "instrument": rng.choice(INSTRUMENTS)} for p in people
    }
    org_names = sorted(
        {f"{last} {s}" for last in LAST for s in ORG_SUFFIX}
        | {f"{f} {last} {s}" for f in FIRST[:10] for last in LAST for s in ORG_SUFFIX}
    )
    rng.shuffle(org_names)
    org_list = org_names[:n_orgs]

    # Split people and organisations separately, then draw each founder from the organisation's own
    # split: a test question's every hop is about a test entity.
    n_test_people = max(1, int(n_people * test_fraction))
    n_test_orgs = max(1, int(n_orgs * test_fraction))
    split_of = {p: ("test" if i < n_test_people else "train") for i, p in enumerate(people)}
    split_of.update({o: ("test" if i < n_test_orgs else "train") for i, o in enumerate(org_list)})
    people_in = {s: [p for p in people if split_of[p] == s] for s in ("train", "test")}
    orgs = {o: {"founder": rng.choice(people_in[split_of[o]]), "city": rng.choice(CITIES)} for o in org_list}

    passages: list[dict] = []
    for p in people:
        for text in _person_passages(p, attrs[p], rng):
            passages.append({"contents": text})
    for o, a in orgs.items():
        passages.append({"contents": f"{o}\n{o} was founded by {a['founder']}."})
        passages.append({"contents": f"{o}\n{o} has its head office in {a['city']}."})
    rng.shuffle(passages)
    corpus_lines = [json.dumps({"id": str(i), "contents": p["contents"]}) for i, p in enumerate(passages)]

    entities = [("person", p) for p in people] + [("org", o) for o in org_list]
    rng.shuffle(entities)
    rows: dict[str, list[tuple]] = {"train": [], "test": []}
    for kind, e in entities:
        split = split_of[e]
        if kind == "person":
            a = attrs[e]
            for q, word, key in PERSON_QUESTIONS:
                rows[split].append(("single", q.format(e), a[key], [f"{e} {word}"], [a[key]], [e]))
        else:
            a = orgs[e]
            f = a["founder"]
            rows[split].append(
                ("single", f"Where is the head office of {e}", a["city"], [f"{e} head office"], [a["city"]], [e])
            )
            for q, word, key in FOUNDER_QUESTIONS:
                ans = attrs[f][key]
                rows[split].append(("two_hop", q.format(e), ans, [f"{e} founder", f"{f} {word}"], [f, ans], [e, f]))
    written = {}
    for split in ("train", "test"):
        items = rows[split]
        rng.shuffle(items)
        table: dict[str, list] = {
            k: [] for k in ("id", "uid", "data_source", "question", "golden_answers", "split", "prompt", "metadata")
        }
        for i, (typ, q, ans, queries, hop_answers, titles) in enumerate(items):
            question = q + "?"
            rid = f"{split}_{i}"
            table["id"].append(rid)
            table["uid"].append(f"toy-{rid}")
            table["data_source"].append("toy")
            table["question"].append(question)
            table["golden_answers"].append([ans])
            table["split"].append(split)
            table["prompt"].append(render_prompt(question, template))
            table["metadata"].append(
                json.dumps(
                    {"type": typ, "queries": queries, "hop_answers": hop_answers, "supporting_titles": titles},
                    sort_keys=True,
                )
            )
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.table(table), path, compression="zstd")
        written[split] = len(items)
    (out_dir / "corpus.jsonl").write_text("\n".join(corpus_lines) + "\n")
    manifest = {"version": VERSION, "seed": seed, "num_entities": num_entities, "template": template}
    (out_dir / "world.json").write_text(json.dumps(manifest, sort_keys=True) + "\n")
    return {
        "corpus": str(out_dir / "corpus.jsonl"),
        "train": str(out_dir / "train.parquet"),
        "test": str(out_dir / "test.parquet"),
        "entities": len(entities),
        "passages": len(passages),
        "train_questions": written["train"],
        "test_questions": written["test"],
    }
