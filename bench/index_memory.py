"""The index memory plan (`retriever-build --plan`) against what a built index takes: its files on
disk, the memory of its build and the RSS of a `retriever-server` process that serves it, by kind
and size; with `--base`, each kind's recall against exact search too.

Usage: .venv/bin/python bench/index_memory.py [--sizes 20000,100000] [--kinds flat,hnsw_sq8,ivf_pq]
       [--dim 384] [--work DIR] [--mmap] [--workers K] [--out FILE]
       .venv/bin/python bench/index_memory.py --base FLAT_INDEX_DIR [--data DIR] --sizes 1000000
       [--train-size 262144] [--mmap] ...
       .venv/bin/python bench/index_memory.py --recall FLAT_INDEX_DIR --data ../shared/data/wiki18_nq_triviaqa
       .venv/bin/python bench/index_memory.py --build-ram ../shared/data/wiki18_nq_triviaqa/corpus.jsonl
       [--sizes 20000,100000] [--kinds flat,hnsw_sq8,ivf_pq] [--forward-rows 256] [--out FILE]

Each index is built as `retriever-build` builds it (the same `faiss_index` over a float32 file of
vectors mapped from disk, the same store and encoder files), over synthetic data and a corpus of
random ~100-word passages. The vectors are random unit vectors (the layout does not depend on the
values), or with `--base` recombined from a flat index's real passage vectors (`recombined`), so that
recall means something. The plan is made from the corpus file alone, before the index exists
(`plan_build`), and compared with the index directory's files and with the server's VmRSS once it is
ready and has answered a batch of 32 queries, with and without the store's mapped pages (two servers
with `--mmap`: the second's Pss and private bytes, from /proc/PID/smaps_rollup), and each server's
start time (spawn to its ready file, the encoder's export kept); with `--workers K`, one
`retriever-server --workers K` (with `--mmap` when given) after 24 more batches of 32 queries on fresh
connections (the kernel hands each to a worker): the parent's and each worker's Rss, Pss and private
bytes, and the sum of their Pss (the tree's memory). What is left once
the store, the index file and the encoder file are taken away is the server's baseline
(`retriever_server.plan.SERVER_BASELINE_BYTES`). Each build runs in a child process: its VmHWM (which
counts the mapped vector file's pages) and its peak anonymous RSS (sampled every 0.2 s) are its
build memory.

With `--base`, the queries are held out of every index: vectors drawn by the same recipe with
another seed, and (with `--data`) the NQ and TriviaQA questions of nq_1000.jsonl and
triviaqa_1000.jsonl encoded by the base index's encoder. Each kind, at the search settings the
server starts with (efSearch 128, nprobe 64), is scored against the flat index's exact top-10:
recall@10 (the share of it returned) and the share with the same top-1; `--ef` and `--nprobe` score
more settings of the same built index.

With `--recall`: each compressed kind built from a flat index's own vectors (as retriever-build builds
it, at its default search settings), and for the questions of --data's nq_1000.jsonl and
triviaqa_1000.jsonl: recall@10 against the flat index's top-10, the share with the same top-1, and
answer recall@1/3/10 (a gold answer in one of the top k passages, as retriever-eval counts it) beside
flat's.

With `--kinds bm25` (alone): a Lucene index of the synthetic corpus at each size, built by
retriever-build, its disk and its server's RSS (the JVM's anonymous memory, the Lucene files' and the
store's resident pages) against the plan.

With `--build-ram`: the whole build's peak anonymous RSS against `plan_build`'s `build_rss_bytes`. Each
size is the given corpus's real passages cycled (new ids), built in a child process by retriever-build's
own `build_index` at its defaults (store, ONNX encoder, 8,192-passage chunks tokenised in full, the
mapped float32 file, `faiss_index` with the 262,144-row training sample), except that the encoder's
forward runs on each chunk's `--forward-rows` longest passages only (0: all of them, as retriever-build
does; on 2 cores that is ~20 passages/s) and the vectors are random unit vectors. The parent samples
the child's RssAnon every 0.1 s, split at the start of the index phase; the child resets its VmHWM
there (clear_refs 5) and reports VmHWM less its mapped pages (the vector file's, all resident by then)
as the index phase's exact peak, which a sample would miss (a growth copy lasts milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import faiss
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the of and in to a was is for on as by with he at from his an were are which".split() + [
    f"w{i}" for i in range(3000)
]
# The scale of the noise added to a recombined vector, relative to the spread of the real vectors.
NOISE = 0.3
CHUNK = 65536


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choices(WORDS, k=rng.randint(80, 120)))
            f.write(json.dumps({"id": str(i), "contents": f"Title {i}\n{text}"}) + "\n")


def recombined(base: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n unit vectors from the real vectors `base` (m, d): each w R[p] + (1 - w) R[q] + NOISE (R[a] -
    R[b]) / sqrt(2), normalised, with p, q, a, b drawn uniformly from the m rows and w from U(0, 1).
    The difference of two real vectors is zero-mean noise with the real vectors' own covariance, so
    the synthetic cloud keeps their anisotropy (sentence vectors fill a narrow cone, not the sphere).
    With m much smaller than n, ~n/m vectors lean on each real one: neighbourhoods are denser than a
    real corpus's, which makes approximate search harder, not easier."""
    rng = np.random.default_rng(seed)
    m = len(base)
    p, q, a, b = (rng.integers(0, m, n) for _ in range(4))
    w = rng.random((n, 1), dtype=np.float32)
    x = w * base[p] + (1 - w) * base[q] + np.float32(NOISE / np.sqrt(2)) * (base[a] - base[b])
    x = np.ascontiguousarray(x, dtype=np.float32)
    faiss.normalize_L2(x)
    return x


def write_vectors(path: Path, n: int, dim: int, base: np.ndarray | None) -> None:
    """n float32 vectors into a .npy file in chunks (as retriever-build's scratch file): random unit
    vectors, or `recombined` from `base` (seed 0; the held-out queries use other seeds)."""
    tmp = path.with_suffix(".part.npy")
    out = np.lib.format.open_memmap(str(tmp), mode="w+", dtype=np.float32, shape=(n, dim))
    for i, lo in enumerate(range(0, n, CHUNK)):
        rows = min(CHUNK, n - lo)
        if base is None:
            x = np.random.default_rng([0, i]).standard_normal((rows, dim), dtype=np.float32)
            faiss.normalize_L2(x)
        else:
            x = recombined(base, rows, seed=i)
        out[lo : lo + rows] = x
    out.flush()
    del out
    os.replace(tmp, path)


def prepare(work: Path, n: int, kind: str, dim: int, vectors: Path) -> Path:
    """The index directory's store, encoder and manifest (as retriever-build writes them); the
    index itself comes from `build_child`."""
    from retriever_server.encoders import Encoder
    from retriever_server.plan import factory_string
    from retriever_server.store import file_sha256, write_store

    corpus = work / f"corpus{n}.jsonl"
    out = work / f"{kind}{n}-{vectors.stem}"
    write_store(corpus, out)
    enc = Encoder(None, "mean", "", "", cache_dir=out)  # copies the exported encoder.onnx beside the index
    manifest = {
        "kind": kind,
        "count": n,
        "corpus": str(corpus.resolve()),
        "corpus_sha256": file_sha256(corpus),
        "encoder": enc.path,
        "pooling": "mean",
        "query_prefix": "",
        "passage_prefix": "",
        "dim": dim,
        "metric": "inner_product",
        "build": {"factory": factory_string(kind, dim, n)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def build_child(out: Path, vectors: Path, train_size: int) -> None:
    """In a child process: `faiss_index` over the mapped vector file, written to out/index.faiss;
    prints its VmHWM."""
    from retriever_server.build import faiss_index

    manifest = json.loads((out / "manifest.json").read_text())
    x = np.load(vectors, mmap_mode="r")
    index, params = faiss_index(manifest["build"]["factory"], x, train_size=train_size)
    faiss.write_index(index, str(out / "index.faiss"))
    params["factory"] = manifest["build"]["factory"]
    if "ef_construction" in params:
        params["ef_search"] = 128
    if "nlist" in params:
        params["nprobe"] = 64
    manifest["build"] = params
    (out / "manifest.json.built").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({"vm_hwm": status(os.getpid())["VmHWM"]}))


def status(pid: int) -> dict[str, int]:
    """/proc/PID/status's memory lines (VmRSS, VmHWM, RssAnon, RssFile, ...) in bytes."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            got[key] = int(value.split()[0]) * 1024
    return got


def build(work: Path, n: int, kind: str, dim: int, train_size: int, vectors: Path) -> tuple[Path, dict]:
    """An index directory as retriever-build writes it over `vectors`, and its build's memory
    (VmHWM, sampled peak RssAnon) and wall time; kept in `work` and reused."""
    out = work / f"{kind}{n}-{vectors.stem}"
    done = out / "build.json"
    if done.exists():
        return out, json.loads(done.read_text())
    prepare(work, n, kind, dim, vectors)
    t = time.time()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--build-child", str(out), "--vectors", str(vectors), "--train-size",
         str(train_size)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    anon = 0
    while proc.poll() is None:
        try:
            anon = max(anon, status(proc.pid).get("RssAnon", 0))
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"building {out} failed ({proc.returncode})")
    info = json.loads(proc.stdout.read().strip().splitlines()[-1])
    info |= {"peak_anon": anon, "wall_s": round(time.time() - t, 1)}
    os.replace(out / "manifest.json.built", out / "manifest.json")
    done.write_text(json.dumps(info))
    return out, info


def write_passages(path: Path, source: Path, n: int) -> None:
    """n passages: `source`'s lines (a real corpus JSONL) cycled, each with a new id."""
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with path.open("w") as f:
        for i in range(n):
            rec = lines[i % len(lines)]
            contents = rec["contents"] if "contents" in rec else f"{rec.get('title', '')}\n{rec.get('text', '')}"
            f.write(json.dumps({"id": str(i), "contents": contents}) + "\n")


def build_ram_child(out: Path, corpus: Path, kind: str, forward_rows: int) -> None:
    """In a child process: `retriever-build --corpus corpus --out out --kind kind` (`build_index` at its
    defaults), except that each chunk's vectors are random unit vectors and the encoder's forward runs
    on the chunk's `forward_rows` longest passages only (batches of 16: ONNX Runtime's arena at its
    largest), after the whole chunk is tokenised as `Encoder.encode` tokenises it. The store, the
    encoder, the mapped float32 file, the sample and batches `faiss_index` copies and the index are
    the real build's. Prints the child's /proc status at the end of the store, of the encoder's load
    and of the encoding, and the index phase's peak anonymous RSS: VmHWM, reset (clear_refs 5) when
    `faiss_index` starts, less the mapped pages (RssFile, which stays put: the vector file's pages
    are all resident once written)."""
    import retriever_server.build as rb
    from retriever_server.encoders import Encoder

    os.environ.pop("TOKENIZERS_PARALLELISM", None)  # this module sets it; retriever-build tokenises in parallel
    marks: dict[str, dict[str, int]] = {}
    rng = np.random.default_rng(0)
    write_store, faiss_index, init = rb.write_store, rb.faiss_index, Encoder.__init__

    def store(*args, **kwargs):
        n = write_store(*args, **kwargs)
        marks["store"] = status(os.getpid())
        return n

    def load(self, *args, **kwargs):
        init(self, *args, **kwargs)
        marks["encoder"] = status(os.getpid())

    def encode_passages(self, passages: list[str], batch_size: int = 64) -> np.ndarray:
        # held while the forwards run, as Encoder.encode holds them: the output, the token ids and types
        x = rng.standard_normal((len(passages), self.dim), dtype=np.float32)
        ids, types = self.tokenize([self.passage_prefix + p for p in passages])
        longest = np.argsort([len(i) for i in ids], kind="stable")[-forward_rows:]
        self.encode([self.passage_prefix + passages[i] for i in longest], batch_size)
        faiss.normalize_L2(x)
        del ids, types
        return x

    def index_phase(*args, **kwargs):
        marks["encoded"] = status(os.getpid())
        (out / "index-phase").touch()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the index phase's peak
        got = faiss_index(*args, **kwargs)
        marks["indexed"] = status(os.getpid())
        return got

    rb.write_store, rb.faiss_index = store, index_phase
    Encoder.__init__ = load  # type: ignore[method-assign]
    if forward_rows > 0:
        Encoder.encode_passages = encode_passages  # type: ignore[method-assign]
    manifest = rb.build_index(corpus, out, kind)
    end = marks["indexed"]
    index_peak = end["VmHWM"] - end["RssFile"] - end.get("RssShmem", 0)
    print(json.dumps({"marks": marks, "index_peak_anon": index_peak, "build": manifest["build"]}))


def build_ram(work: Path, n: int, kind: str, passages: Path, forward_rows: int) -> dict:
    """Run `build_ram_child` for n passages of `passages` and sample its RssAnon every 0.1 s, split
    at the start of the index phase; with the child's own figures."""
    import shutil

    corpus = work / f"passages{n}.jsonl"
    if not corpus.exists():
        write_passages(corpus, passages, n)
    out = work / f"build-ram-{kind}{n}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t = time.time()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--build-ram-child", str(out), "--corpus", str(corpus), "--kinds", kind,
         "--forward-rows", str(forward_rows)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    peak = {"encode": 0, "index": 0}
    while proc.poll() is None:
        phase = "index" if (out / "index-phase").exists() else "encode"
        try:
            peak[phase] = max(peak[phase], status(proc.pid).get("RssAnon", 0))
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    if proc.returncode:
        raise RuntimeError(f"building {out} failed ({proc.returncode})")
    info = json.loads(proc.stdout.read().strip().splitlines()[-1])
    info |= {"sampled_encode_anon": peak["encode"], "sampled_index_anon": peak["index"],
             "wall_s": round(time.time() - t, 1)}  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return info


def build_ram_rows(work: Path, n: int, kind: str, passages: Path, forward_rows: int) -> dict:
    """One row: the plan of building n passages of `passages` as `kind` against `build_ram`'s figures."""
    from retriever_server.plan import plan_build

    info = build_ram(work, n, kind, passages, forward_rows)
    plan = plan_build(work / f"passages{n}.jsonl", kind)
    marks = info.pop("marks")
    measured = max(info["sampled_encode_anon"], info["sampled_index_anon"], info["index_peak_anon"])
    row = {
        "n": n,
        "kind": kind,
        "factory": plan.factory,
        "measured_peak_anon": measured,
        "plan_build_rss": plan.build_rss_bytes,
        "plan_build_parts": plan.build_parts,
        **info,
        "anon_after_store": marks["store"]["RssAnon"],
        "anon_after_encoder_load": marks["encoder"]["RssAnon"],
        "anon_after_encoding": marks["encoded"]["RssAnon"],
        "mapped_after_encoding": marks["encoded"]["RssFile"],
        "anon_after_index": marks["indexed"]["RssAnon"],
    }
    parts = plan.build_parts
    phase = max(parts["encode_chunk"], parts["index_train"], parts["index_add"])
    row["plan_kept"] = plan.build_rss_bytes - phase
    row["plan_index_phase"] = max(parts["index_train"], parts["index_add"])
    row["measured_index_phase"] = info["index_peak_anon"] - row["anon_after_encoding"]
    row["plan_mapped"] = plan.build_mapped_bytes
    row["err"] = round(plan.build_rss_bytes / measured - 1, 4)
    print(json.dumps(row), flush=True)
    return row


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's Rss, Pss and private bytes, and (from /proc/PID/smaps) the resident
    bytes of the mapped document store (docs.arrow: clean page cache, which the plan's RSS at start
    leaves out) and of a mapped index file, and how much of the private bytes are those files' pages
    that no other process maps yet (`private_mapped`: page cache, not the process's own memory)."""
    got = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        got[key.rstrip(":")] = int(value) * 1024
    mapped = {"docs.arrow": 0, "index.faiss": 0, "lucene": 0}
    mapped_private = 0  # of those files' pages, the ones only this process maps (page cache all the same)
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):  # a mapping's header line: address range, perms, ..., path
            path = parts[5] if len(parts) > 5 else ""
            name = "lucene" if "/bm25/" in path else Path(path).name
        elif parts[0] == "Rss:" and name in mapped:
            mapped[name] += int(parts[1]) * 1024
        elif parts[0] in ("Private_Clean:", "Private_Dirty:") and name in mapped:
            mapped_private += int(parts[1]) * 1024
    return {
        "rss": got["Rss"],
        "pss": got["Pss"],
        "private": got.get("Private_Clean", 0) + got.get("Private_Dirty", 0),
        "store_pages": mapped["docs.arrow"],
        "index_pages": mapped["index.faiss"],
        "lucene_pages": mapped["lucene"],
        "private_mapped": mapped_private,
    }


def bm25_rows(work: Path, sizes: list[int]) -> list[dict]:
    """A BM25 (Lucene) index of the synthetic corpus at each size, built by retriever-build, against
    its plan: the index directory's bytes on disk, and the RSS of a server after a batch of 32 queries
    (with its JVM's anonymous memory, the Lucene files' resident pages and the store's)."""
    from retriever_server.plan import plan_build

    rows = []
    for n in sizes:
        corpus = work / f"corpus{n}.jsonl"
        if not corpus.exists():
            write_corpus(corpus, n)
        out = work / f"bm25{n}"
        t = time.time()
        if not (out / "manifest.json").exists():
            subprocess.run(
                [sys.executable, "-m", "retriever_server.build", "--corpus", str(corpus), "--out", str(out), "--kind",
                 "bm25"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        wall = round(time.time() - t, 1)
        plan = plan_build(corpus, "bm25")
        files = [f for f in out.rglob("*") if f.is_file()]
        lucene = sum(f.stat().st_size for f in files if "bm25" in f.relative_to(out).parts)
        row = {"n": n, "kind": "bm25", "build_wall_s": wall, "lucene_bytes": lucene,
               "disk": sum(f.stat().st_size for f in files), "disk_plan": plan.disk_bytes,
               "rss_plan": plan.server_rss_start_bytes, "rss_plan_max": plan.server_rss_max_bytes}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            proc = serve(out, [], Path(tmp), "bm25")
            try:
                got = rollup(proc.pid)
                row |= {"rss": got["rss"], "store_pages": got["store_pages"], "lucene_pages": got["lucene_pages"],
                        "anon": status(proc.pid).get("RssAnon", 0), "start_s": proc.start_s}  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(30)
        # the plan's start leaves out the mapped pages of the store and of Lucene's files (page cache)
        row["rss_less_mapped_err"] = round(
            row["rss_plan"] / (row["rss"] - row["store_pages"] - row["lucene_pages"]) - 1, 4
        )
        row["disk_err"] = round(row["disk_plan"] / row["disk"] - 1, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def serve(index_dir: Path, extra: list[str], tmp: Path, name: str) -> subprocess.Popen:
    ready = tmp / f"{name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retriever_server.app", "--index", str(index_dir), "--port", "0", "--ready-file",
         str(ready), *extra],
        stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    t = time.time()
    while not ready.exists():
        if proc.poll() is not None or time.time() - t > 600:
            raise RuntimeError((tmp / f"{name}.log").read_text())
        time.sleep(0.05)
    proc.start_s = round(time.time() - t, 2)  # type: ignore[attr-defined]  # spawn to ready file
    # a warmed-up server: one batch of 32 queries encoded and searched (ONNX Runtime's arena grows on first use)
    url = json.loads(ready.read_text())["url"]
    queries = [f"warm up query number {i} about {WORDS[i]}" for i in range(32)]
    urllib.request.urlopen(
        urllib.request.Request(
            f"{url}/retrieve",
            json.dumps({"queries": queries, "topk": 10}).encode(),
            {"Content-Type": "application/json"},
        ),
        timeout=300,
    ).read()
    return proc


def workers_rollup(index_dir: Path, extra: list[str], tmp: Path, workers: int) -> dict:
    """One `retriever-server --workers K` after its warm-up batch and 24 more batches of 32 queries,
    each on a new connection: the parent's and each worker's `rollup`, and the sum of their Pss."""
    proc = serve(index_dir, [*extra, "--workers", str(workers)], tmp, "workers")
    try:
        info = json.loads((tmp / "workers.ready").read_text())
        for b in range(24):
            queries = [f"batch {b} query {i} about {WORDS[(b * 32 + i) % len(WORDS)]}" for i in range(32)]
            body = json.dumps({"queries": queries, "topk": 10}).encode()
            req = urllib.request.Request(f"{info['url']}/retrieve", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=300).read()
        parent = rollup(proc.pid)
        each = [rollup(pid) for pid in info["workers"]]
        return {"k": workers, "start_s": proc.start_s, "parent": parent, "workers": each,
                "pss_total": parent["pss"] + sum(w["pss"] for w in each)}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)


def held_out_queries(base_dir: Path, data: Path | None, count: int) -> dict[str, np.ndarray]:
    """Query vectors in no index: `count` recombined from the base's vectors with a seed the corpus
    does not use, and with `data` its NQ and TriviaQA questions encoded by the base's encoder."""
    from retriever_server.indexes import flat_vectors, open_index

    _, _, flat = open_index(base_dir, check_memory=False)
    queries = {"synthetic": recombined(flat_vectors(flat.index), count, seed=10**6)}
    if data is not None:
        from retriever_server.evaluate import load_questions

        sets = [load_questions(data / f"{name}_1000.jsonl", name) for name in ("nq", "triviaqa")]
        queries["questions"] = flat.encoder.encode_queries([q.question for qs in sets for q in qs])
    return queries


def recall_vs_exact(
    dirs: dict[str, Path], queries: dict[str, np.ndarray], efs: list[int], nprobes: list[int]
) -> dict[str, dict]:
    """recall@10 and same top-1 of each built kind against the flat index's exact top-10, at the
    search settings in its manifest (the server's defaults) and at each of `efs` (HNSW efSearch) or
    `nprobes` (IVF lists searched), one index in memory at a time."""
    from retriever_server.indexes import hnsw_of

    exact = faiss.read_index(str(dirs["flat"] / "index.faiss"))
    truth = {name: exact.search(q, 10)[1] for name, q in queries.items()}
    del exact

    def score(index) -> dict:
        row = {}
        for name, q in queries.items():
            got, t = index.search(q, 10)[1], truth[name]
            row[name] = {
                "recall@10": round(float(np.mean([len(set(g) & set(s)) / 10 for g, s in zip(got, t)])), 4),
                "same_top1": round(float(np.mean(got[:, 0] == t[:, 0])), 4),
            }
        return row

    out = {}
    for kind, d in dirs.items():
        build = json.loads((d / "manifest.json").read_text())["build"]
        index = faiss.read_index(str(d / "index.faiss"))
        settings: dict[str, dict] = {}
        if (h := hnsw_of(index)) is not None:
            for ef in [build.get("ef_search", 128), *efs]:
                h.efSearch = ef
                settings[f"efSearch {ef}"] = score(index)
        else:
            try:
                ivf = faiss.extract_index_ivf(index)
            except RuntimeError:
                ivf = None
            for nprobe in [build.get("nprobe", 64), *nprobes] if ivf is not None else [None]:
                if ivf is not None:
                    ivf.nprobe = min(nprobe, ivf.nlist)
                settings[f"nprobe {ivf.nprobe}" if ivf is not None else "exact"] = score(index)
        out[kind] = {"default": next(iter(settings.values())), "settings": settings}
        print(json.dumps({"kind": kind, "recall": settings}), flush=True)
        del index
    return out


def recall(flat_dir: Path, data: Path, kinds: list[str]) -> list[dict]:
    """Recall of each kind against flat over the flat index's vectors (see the module docstring)."""
    from retriever_server.answers import contains_answer
    from retriever_server.build import faiss_index
    from retriever_server.evaluate import load_questions
    from retriever_server.indexes import flat_vectors, hnsw_of, open_index
    from retriever_server.plan import DEFAULT_NPROBE, factory_string

    _, store, flat = open_index(flat_dir, check_memory=False)
    vectors = flat_vectors(flat.index)
    n, d = vectors.shape
    sets = {name: load_questions(data / f"{name}_1000.jsonl", name) for name in ("nq", "triviaqa")}
    encoded = {name: flat.encoder.encode_queries([q.question for q in qs]) for name, qs in sets.items()}
    _, truth = flat.index.search(np.concatenate(list(encoded.values())), 10)

    def answer_recall(rows: np.ndarray, qs) -> dict[str, float]:
        hits = [[contains_answer(doc["contents"], q.golden_answers) for doc in store.get(r)] for r, q in zip(rows, qs)]
        return {f"@{k}": round(float(np.mean([any(h[:k]) for h in hits])), 4) for k in (1, 3, 10)}

    out = []
    for kind in ["flat", *kinds]:
        t = time.time()
        if kind == "flat":
            index, spec = flat.index, "Flat"
        else:
            spec = factory_string(kind, d, n)
            index, _ = faiss_index(spec, vectors)
            if (h := hnsw_of(index)) is not None:
                h.efSearch = 128
            try:
                ivf = faiss.extract_index_ivf(index)
                ivf.nprobe = min(DEFAULT_NPROBE, ivf.nlist)
            except RuntimeError:
                pass
        build_s = time.time() - t
        got = np.concatenate([index.search(q, 10)[1] for q in encoded.values()])
        row = {
            "kind": kind,
            "factory": spec,
            "n": n,
            "build_s": round(build_s, 1),
            "recall@10_vs_flat": round(float(np.mean([len(set(g) & set(t)) / 10 for g, t in zip(got, truth)])), 4),
            "same_top1": round(float(np.mean(got[:, 0] == truth[:, 0])), 4),
        }
        lo = 0
        for name, qs in sets.items():
            row[f"{name}_answer_recall"] = answer_recall(got[lo : lo + len(qs)], qs)
            lo += len(qs)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="20000,100000")
    p.add_argument("--kinds", default="flat,hnsw_sq8,ivf_pq")
    p.add_argument("--dim", type=int, default=384, help="vector dimension (with --base: the base index's)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "agent-rl-bench-index-memory")
    p.add_argument("--mmap", action="store_true", help="also two --mmap servers: the second's added memory")
    p.add_argument("--workers", type=int, default=0, help="also one server with this many forked workers")
    p.add_argument(
        "--train-size",
        type=int,
        default=20_000,
        help="training sample (the layout does not depend on it; recall does: retriever-build's default is 262144)",
    )
    p.add_argument("--base", type=Path, help="a flat index of real passages whose vectors are recombined (and recall)")
    p.add_argument("--queries", type=int, default=2000, help="with --base: held-out recombined query vectors")
    p.add_argument("--ef", default="", help="with --base: HNSW efSearch values scored besides the default")
    p.add_argument("--nprobe", default="", help="with --base: IVF nprobe values scored besides the default")
    p.add_argument("--project", default="21015324,768", help="passages,dim each kind's plan is projected to")
    p.add_argument("--out", type=Path)
    p.add_argument("--recall", type=Path, help="a flat index directory: recall of --kinds against it")
    p.add_argument("--data", type=Path, help="a directory with nq_1000.jsonl and triviaqa_1000.jsonl")
    p.add_argument(
        "--build-ram",
        type=Path,
        help="a corpus JSONL of real passages: the build's peak RAM at each of --sizes (its passages cycled) and "
        "--kinds against the plan's",
    )
    p.add_argument("--forward-rows", type=int, default=16, help="with --build-ram: passages a chunk the encoder runs")
    p.add_argument("--build-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--build-ram-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--vectors", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build_child:
        build_child(a.build_child, a.vectors, a.train_size)
        return 0
    if a.build_ram_child:
        build_ram_child(a.build_ram_child, a.corpus, a.kinds, a.forward_rows)
        return 0
    if a.build_ram:
        a.work.mkdir(parents=True, exist_ok=True)
        rows = [build_ram_rows(a.work, int(n), kind, a.build_ram, a.forward_rows) for n in a.sizes.split(",")
                for kind in a.kinds.split(",")]  # fmt: skip
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
        return 0
    if a.kinds == "bm25":
        a.work.mkdir(parents=True, exist_ok=True)
        rows = bm25_rows(a.work, [int(x) for x in a.sizes.split(",")])
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
        return 0
    if a.recall:
        rows = recall(a.recall, a.data, [k for k in a.kinds.split(",") if k != "flat"])
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1))
        return 0
    from retriever_server.encoders import default_encoder_path, onnx_bytes
    from retriever_server.indexes import flat_vectors
    from retriever_server.plan import encoder_file_bytes, plan_build, plan_index

    a.work.mkdir(parents=True, exist_ok=True)
    base = None
    if a.base:
        base_index = faiss.read_index(str(a.base / "index.faiss"))
        base = flat_vectors(base_index)
        a.dim = base.shape[1]
    project_n, project_d = (int(x) for x in a.project.split(","))
    encoder = encoder_file_bytes(default_encoder_path())
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        corpus = a.work / f"corpus{n}.jsonl"
        if not corpus.exists():
            write_corpus(corpus, n)
        vectors = a.work / (f"real{n}.npy" if base is not None else f"random{n}x{a.dim}.npy")
        if not vectors.exists():
            write_vectors(vectors, n, a.dim, base)
        dirs = {}
        for kind in a.kinds.split(","):
            plan = plan_build(corpus, kind, dim=a.dim)
            out, built = build(a.work, n, kind, a.dim, a.train_size, vectors)
            dirs[kind] = out
            disk = {name: (out / name).stat().st_size for name in ("index.faiss", "docs.arrow")}
            disk["encoder.onnx"] = onnx_bytes(out / "encoder.onnx")  # the graph and its weights' data file
            projected = plan_index(project_n, project_d, kind, 0, *encoder)
            row = {
                "n": n,
                "kind": kind,
                "factory": plan.factory,
                "vectors": "recombined" if base is not None else "random",
                "build_wall_s": built["wall_s"],
                "build_vm_hwm": built["vm_hwm"],
                "build_peak_anon": built["peak_anon"],
                "build_vectors_file": vectors.stat().st_size,
                "index_file": disk["index.faiss"],
                "index_plan": plan.index_bytes,
                "store_file": disk["docs.arrow"],
                "store_plan": plan.store_bytes,
                "disk": sum(disk.values()),
                "disk_plan": plan.disk_bytes,
                "rss_plan": plan.server_rss_start_bytes,
                "rss_plan_max": plan.server_rss_max_bytes,
                "projected": {
                    "n": project_n,
                    "dim": project_d,
                    "factory": projected.factory,
                    "index": projected.index_bytes,
                    "rss_start_without_store": projected.server_rss_start_bytes,
                    "build_scratch": projected.build_scratch_bytes,
                },
            }
            with tempfile.TemporaryDirectory() as tmp:
                proc = serve(out, [], Path(tmp), "one")
                try:
                    one = rollup(proc.pid)
                    row["rss"], row["rss_store_pages"] = one["rss"], one["store_pages"]
                    row["start_s"] = proc.start_s
                finally:
                    proc.terminate()
                    proc.wait(30)
                if a.mmap:
                    first = serve(out, ["--mmap"], Path(tmp), "first")
                    second = serve(out, ["--mmap"], Path(tmp), "second")
                    try:
                        row["mmap_first"] = {**rollup(first.pid), "start_s": first.start_s}
                        row["mmap_second"] = {**rollup(second.pid), "start_s": second.start_s}
                    finally:
                        for proc in (first, second):
                            proc.terminate()
                            proc.wait(30)
                if a.workers:
                    row["workers"] = workers_rollup(out, ["--mmap"] if a.mmap else [], Path(tmp), a.workers)
            for key in ("index", "store"):
                row[f"{key}_err"] = round(row[f"{key}_plan"] / row[f"{key}_file"] - 1, 4)
            row["disk_err"] = round(row["disk_plan"] / row["disk"] - 1, 4)
            row["rss_err"] = round(row["rss_plan"] / row["rss"] - 1, 4)
            # the plan's RSS at start leaves the store's pages out (the kernel can drop them)
            row["rss_less_store_err"] = round(row["rss_plan"] / (row["rss"] - row["rss_store_pages"]) - 1, 4)
            row["baseline_measured"] = row["rss"] - row["rss_store_pages"] - disk["index.faiss"] - disk["encoder.onnx"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        if base is not None and "flat" in dirs:
            efs, nprobes = ([int(x) for x in v.split(",") if x] for v in (a.ef, a.nprobe))
            scores = recall_vs_exact(dirs, held_out_queries(a.base, a.data, a.queries), efs, nprobes)
            for row in rows:
                if row["n"] == n:
                    row["recall"] = scores[row["kind"]]
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
