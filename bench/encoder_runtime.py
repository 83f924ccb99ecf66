"""Query and passage encoding by runtime, and what int8 costs in answer recall on real questions.

Usage: .venv/bin/python bench/encoder_runtime.py --data ../shared/data/wiki18_nq_triviaqa
       [--passages 1024] [--queries 512] [--rounds 3] [--recall]

1. Speed in alternated rounds (every variant once a round, the order rotating between rounds):
   queries/s over the NQ questions sent in batches of 32 (the server's batch at concurrency 32) and
   one at a time, and passages/s over the first --passages passages of the corpus.
   - `transformers`: AutoModel and its tokenizer as a user writes them: batches of 128 in corpus
     order, padded to the longest, mean pooling (the reference for passage encoding);
   - `torch`: agent-rl's Encoder(runtime="torch"): length-sorted batches (of --passage-batch
     passages), the same forward;
   - `onnx`, `onnx-int8`: Encoder(runtime="onnx"), fp32 (on ORT's fused kernels) and that graph in
     dynamic int8 (its fused Attention as QAttention: the QKV projection in int8 too);
   - `onnx-unfused`, `onnx-int8-unfused`: the fp32 graph as torch.onnx exports it, before the kernel
     fusion, and that graph quantised the same way (its QKV projections in int8 too).
2. `--recall`: the whole corpus encoded with transformers' plain forward, onnx fp32 and onnx-int8 (each
   timed once, in that order: the passage goal's measure), FAISS flat
   inner product, answer recall@1/3/10 (a passage holds a gold answer as a token span) for NQ and
   TriviaQA with (passages, queries) = (fp32, fp32), (fp32, int8), (int8, int8).
3. `--split` (instead of 1 and 2): the server's batches, 32 consecutive questions of a stream that
   alternates NQ and TriviaQA ones, encoded in fp32 and int8 with the length split's fixed cost of a
   forward (`Encoder.forward_tokens`) at each of --forward-tokens and off (one forward a batch, padded to
   its longest question, as before the split), in alternated rounds: queries/s.
4. `--layout` (instead of 1 and 2): how the fp32 export is kept and loaded, in alternated rounds as in 1
   (queries/s in batches of 32 and one at a time, passages/s): `one file` (the graph with its weights
   inside, read into the process), `mapped` (the export: its weights in an external data file that
   ONNX Runtime maps, the linear layers' packed into each process), `machine (default)` (the model
   ONNX Runtime optimised for this machine, its packed weights mapped from its data file:
   `encoders.machine_model`), `mapped, no prepacking` (`Encoder(prepack=False)`: the linear layers'
   weights packed at each call instead of once).
The encoder is the default MiniLM; every variant uses all cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retriever_server.answers import contains_answer  # noqa: E402
from retriever_server.encoders import (  # noqa: E402
    FEWEST_FORWARDS,
    Encoder,
    _export,
    _quantize,
    _whole,
    default_encoder_path,
    onnx_session,
)


class Transformers:
    """The plain forward: corpus order, padded batches, mean pooling, L2 norm."""

    def __init__(self, batch_size: int = 128):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch, self.batch_size = torch, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(default_encoder_path())
        self.model = AutoModel.from_pretrained(default_encoder_path()).eval()

    def encode(self, texts: list[str], batch_size: int | None = None) -> np.ndarray:
        torch, out = self.torch, []
        bs = batch_size or self.batch_size
        with torch.inference_mode():
            for lo in range(0, len(texts), bs):
                batch = self.tokenizer(
                    texts[lo : lo + bs], padding=True, truncation=True, max_length=256, return_tensors="pt"
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).float()
                out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy())
        return np.concatenate(out)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def speed(variants: dict, queries: list[str], passages: list[str], rounds: int, passage_batch: int) -> dict:
    runs: dict[str, dict[str, list[float]]] = {name: {"q32": [], "q1": [], "passages": []} for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            enc = variants[name]
            t = time.perf_counter()
            for lo in range(0, len(queries), 32):
                enc.encode(queries[lo : lo + 32], 32)
            runs[name]["q32"].append(len(queries) / (time.perf_counter() - t))
            t = time.perf_counter()
            for q in queries[:64]:
                enc.encode([q], 1)
            runs[name]["q1"].append(64 / (time.perf_counter() - t))
            t = time.perf_counter()
            enc.encode(passages, None if name == "transformers" else passage_batch)
            runs[name]["passages"].append(len(passages) / (time.perf_counter() - t))
            row = runs[name]
            print(
                f"round {r}  {name:<22} queries/s batch 32 {row['q32'][-1]:7.0f}  batch 1 {row['q1'][-1]:6.0f}  "
                f"passages/s {row['passages'][-1]:6.1f}",
                flush=True,
            )
    return {name: {k: statistics.median(v) for k, v in row.items()} for name, row in runs.items()}


def split_speed(encoders: dict, queries: list[str], costs: list[int], rounds: int) -> dict:
    """Queries/s of batches of 32 by (encoder, fixed cost of a forward); FEWEST_FORWARDS is off."""
    cells = [(name, c) for name in encoders for c in [FEWEST_FORWARDS, *costs]]
    runs: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    for r in range(rounds):
        for name, c in cells[r % len(cells) :] + cells[: r % len(cells)]:
            enc = encoders[name]
            enc.forward_tokens = c
            t = time.perf_counter()
            for lo in range(0, len(queries), 32):
                enc.encode(queries[lo : lo + 32], 32)
            runs[(name, c)].append(len(queries) / (time.perf_counter() - t))
            label = "off" if c == FEWEST_FORWARDS else c
            print(f"round {r}  {name:<9} forward cost {label:>4}: {runs[(name, c)][-1]:6.0f} q/s", flush=True)
    labels = {c: "off" if c == FEWEST_FORWARDS else c for _, c in cells}
    return {f"{name} {labels[c]}": statistics.median(v) for (name, c), v in runs.items()}


def recall_at(vectors: np.ndarray, q: np.ndarray, contents: list[str], answers: list[list[str]]) -> list[float]:
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    _, rows = index.search(q, 10)
    hit = np.array([[contains_answer(contents[r], a) for r in row] for row, a in zip(rows, answers, strict=True)])
    return [round(float(hit[:, :k].any(1).mean()), 3) for k in (1, 3, 10)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", type=Path, required=True, help="directory with corpus.jsonl, nq_1000.jsonl, triviaqa_1000.jsonl"
    )
    p.add_argument("--passages", type=int, default=1024, help="passages timed per round")
    p.add_argument("--queries", type=int, default=512, help="NQ questions timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--passage-batch", type=int, default=16, help="agent-rl's passage batch (retriever-build's default on a CPU)"
    )
    p.add_argument("--recall", action="store_true", help="also the whole-corpus encodings and answer recall")
    p.add_argument("--split", action="store_true", help="only the length split's fixed forward cost (3.)")
    p.add_argument("--layout", action="store_true", help="only the export's file layout and prepacking (4.)")
    p.add_argument("--forward-tokens", type=int, nargs="+", default=[0, 8, 16, 32, 64])
    p.add_argument("--out", type=Path, help="write the numbers here as JSON")
    a = p.parse_args()
    corpus = read_jsonl(a.data / "corpus.jsonl")
    sets = {name: read_jsonl(a.data / f"{name}_1000.jsonl") for name in ("nq", "triviaqa")}
    if a.split:
        pairs = zip(sets["nq"][: a.queries // 2], sets["triviaqa"][: a.queries // 2])
        stream = [row["question"] for pair in pairs for row in pair]
        cache = Path(tempfile.mkdtemp(prefix="encoder_runtime_"))
        encoders = {"fp32": Encoder(cache_dir=cache), "int8": Encoder(int8=True, cache_dir=cache)}
        table = split_speed(encoders, stream, a.forward_tokens, a.rounds)
        print(
            f"\nmedians over {a.rounds} rounds, {len(stream)} questions in batches of 32 (NQ and TriviaQA alternating)"
        )
        for name, qps in table.items():
            print(f"  {name:<10} {qps:7.0f} q/s  ({qps / table[name.split()[0] + ' off']:.2f}x of one forward a batch)")
        if a.out:
            a.out.write_text(json.dumps({"split": table}, indent=1))
        return 0
    contents = [c["contents"] for c in corpus]
    queries = [q["question"] for q in sets["nq"]][: a.queries]
    cache = Path(tempfile.mkdtemp(prefix="encoder_runtime_"))
    threads = os.cpu_count() or 1
    if a.layout:
        layouts = {
            "one file": Encoder(cache_dir=cache),
            "mapped": Encoder(cache_dir=cache),
            "machine (default)": Encoder(cache_dir=cache),
            "mapped, no prepacking": Encoder(cache_dir=cache, prepack=False),
        }
        _whole(cache / "encoder.onnx", cache / "whole.onnx")
        layouts["one file"].session = onnx_session(cache / "whole.onnx")
        layouts["mapped"].session = onnx_session(cache / "encoder.onnx")
        table = speed(layouts, queries, contents[: a.passages], a.rounds, a.passage_batch)
        print(f"\nmedians over {a.rounds} rounds; x = against one file")
        for name, row in table.items():
            print(
                f"  {name:<22} queries/s batch 32 {row['q32']:7.0f} ({row['q32'] / table['one file']['q32']:.3f}x)  "
                f"batch 1 {row['q1']:6.0f} ({row['q1'] / table['one file']['q1']:.3f}x)  "
                f"passages/s {row['passages']:6.1f} ({row['passages'] / table['one file']['passages']:.3f}x)"
            )
        if a.out:
            a.out.write_text(json.dumps({"layout": table}, indent=1))
        return 0
    variants = {
        "transformers": Transformers(),
        "torch": Encoder(runtime="torch"),
        "onnx": Encoder(runtime="onnx", cache_dir=cache, threads=threads),
        "onnx-unfused": Encoder(runtime="onnx", cache_dir=cache, threads=threads),
        "onnx-int8": Encoder(runtime="onnx", int8=True, cache_dir=cache, threads=threads),
        "onnx-int8-unfused": Encoder(runtime="onnx", int8=True, cache_dir=cache, threads=threads),
    }
    unfused = cache / "unfused.onnx"
    _export(Encoder(runtime="torch").model.model, "mean", variants["onnx"].input_names, unfused, fuse=False)
    variants["onnx-unfused"].session = onnx_session(unfused, threads)
    _quantize(unfused, cache / "int8_unfused.onnx")
    variants["onnx-int8-unfused"].session = onnx_session(cache / "int8_unfused.onnx", threads)
    want = variants["transformers"].encode(contents[:256])
    for name, enc in variants.items():
        cos = (enc.encode(contents[:256], 64) * want).sum(1)
        print(
            f"{name:<13} cosine to transformers' vectors over 256 passages: min {cos.min():.4f} mean {cos.mean():.4f}"
        )
    report: dict = {"speed": speed(variants, queries, contents[: a.passages], a.rounds, a.passage_batch)}
    base = report["speed"]["transformers"]
    print(f"\nmedians over {a.rounds} rounds ({threads} threads); x = against transformers' plain forward")
    for name, row in report["speed"].items():
        print(
            f"  {name:<13} queries/s batch 32 {row['q32']:7.0f} ({row['q32'] / base['q32']:.2f}x)  "
            f"batch 1 {row['q1']:6.0f} ({row['q1'] / base['q1']:.2f}x)  "
            f"passages/s {row['passages']:6.1f} ({row['passages'] / base['passages']:.2f}x)"
        )
    if a.recall:
        vectors, seconds = {}, {}
        for name in ("transformers", "onnx", "onnx-int8"):
            t = time.perf_counter()
            enc = variants[name]
            if name == "transformers":
                vectors[name] = enc.encode(contents)
            else:
                vectors[name] = enc.encode_passages(contents, a.passage_batch)
            seconds[name] = round(time.perf_counter() - t, 1)
            x = seconds["transformers"] / seconds[name]
            print(f"{name}: {len(contents)} passages encoded in {seconds[name]} s ({x:.2f}x)", flush=True)
        report["full_corpus_seconds"] = seconds
        report["recall"] = {}
        for set_name, rows in sets.items():
            answers = [r["golden_answers"] for r in rows]
            qs = [r["question"] for r in rows]
            q = {name: variants[name].encode_queries(qs) for name in ("onnx", "onnx-int8")}
            for label, (pv, qv) in {
                "fp32/fp32": ("onnx", "onnx"),
                "fp32 passages, int8 queries": ("onnx", "onnx-int8"),
                "int8/int8": ("onnx-int8", "onnx-int8"),
            }.items():
                r = recall_at(vectors[pv], q[qv], contents, answers)
                report["recall"][f"{set_name} {label}"] = r
                print(f"  {set_name:<9} {label:<28} answer recall@1/3/10 {r[0]:.3f} {r[1]:.3f} {r[2]:.3f}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
