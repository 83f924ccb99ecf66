"""`data-prep qa` and `data-prep merge`: FlashRAG-layout QA datasets -> parquet prompt files.

Rows are read from the hub (`RUC-NLPIR/FlashRAG_datasets`, one config per dataset) or from local
JSONL / parquet in the same layout (`id`, `question`, `golden_answers`, optional `metadata`), and
written as the columns `agent_rl.rollout.prompts` reads: `id`, `uid`, `data_source`, `question`,
`golden_answers`, `split`, `prompt`, `metadata` (a JSON string, "{}" when absent).

Departures from Search-R1's data scripts: the GRPO group key (`uid`, equal to `id`) is prefixed
with the data source, because Search-R1 numbers rows per dataset and its merged files reuse
the same index across NQ and HotpotQA; a dataset without a `test` split uses `dev` as its test
split (as Search-R1's merge script does), and the summary says so; with `--tokenizer
--max-prompt-tokens`, over-long prompts are dropped here and counted per dataset, never
truncated.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.templates import normalize_question, render_prompt

HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"
DATASETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
# A split asked for but missing is taken from its stand-in, as Search-R1 does for test sets.
FALLBACK_SPLIT = {"test": "dev"}
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("uid", pa.string()),
        ("data_source", pa.string()),
        ("question", pa.string()),
        ("golden_answers", pa.list_(pa.string())),
        ("split", pa.string()),
        ("prompt", pa.string()),
        ("metadata", pa.string()),
    ]
)
_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataPrepError(RuntimeError):
    """A problem the user can fix (bad input, missing file, no network): the CLI prints it alone."""


@dataclass
class SplitSummary:
    """What one (dataset, split) produced; `source_split` differs from `split` on a fallback."""

    dataset: str
    split: str
    source_split: str
    path: str
    rows: int
    dropped: int = 0
    skipped: int = 0  # rows without a question or without any golden answer
    prompt_tokens: list[int] | None = field(default=None, repr=False)  # kept rows; None without a tokenizer

    @property
    def mean_tokens(self) -> float | None:
        return sum(self.prompt_tokens) / len(self.prompt_tokens) if self.prompt_tokens else None

    @property
    def max_tokens(self) -> int | None:
        return max(self.prompt_tokens) if self.prompt_tokens else None


# --------------------------------------------------------------------------- loading


def _local_file(path: Path) -> tuple[str, str]:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    builder = _LOCAL_SUFFIXES.get(suffixes[-1] if suffixes else "")
    if builder is None:
        raise DataPrepError(f"--input {path}: expected a .jsonl, .json or .parquet file (FlashRAG layout)")
    return builder, str(path)


def _find_local_split(root: Path, dataset: str, split: str) -> Path | None:
    """A FlashRAG checkout has `{dataset}/{split}.jsonl`; accept the dataset folder or its parent."""
    for folder in (root / dataset, root):
        for suffix in (".jsonl", ".jsonl.gz", ".json", ".parquet"):
            candidate = folder / f"{split}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def resolve_splits(dataset: str, splits: list[str], input_path: Path | None) -> list[tuple[str, str, str | Path]]:
    """-> [(split, source_split, where)] for the splits that exist; `where` is a file or "hub"."""
    found: list[tuple[str, str, str | Path]] = []
    if input_path is not None:
        if not input_path.exists():
            raise DataPrepError(f"--input {input_path} does not exist")
        if input_path.is_file():
            if len(splits) != 1:
                raise DataPrepError(
                    f"--input {input_path} is one file: name its split with --split (one of train, dev, test), not "
                    f"{','.join(splits)}"
                )
            return [(splits[0], splits[0], input_path)]
        for split in splits:
            for source in (split, FALLBACK_SPLIT.get(split)):
                path = _find_local_split(input_path, dataset, source) if source else None
                if path is not None:
                    found.append((split, str(source), path))
                    break
            else:
                print(f"[data-prep] {dataset}: no {split} split under {input_path}; skipped", file=sys.stderr)
        if not found:
            raise DataPrepError(
                f"--input {input_path} holds no {'/'.join(splits)} file for {dataset} (expected e.g. "
                f"{input_path}/{dataset}/train.jsonl)"
            )
        return found
    available = hub_split_names(dataset)
    for split in splits:
        for source in (split, FALLBACK_SPLIT.get(split)):
            if source in available:
                found.append((split, source, "hub"))
                break
        else:
            print(
                f"[data-prep] {dataset}: {HUB_REPO} has no {split} split (it has {', '.join(available)}); skipped",
                file=sys.stderr,
            )
    if not found:
        raise DataPrepError(f"{HUB_REPO}/{dataset} has none of the splits {splits} (it has {available})")
    return found


def _offline_hint(dataset: str, err: Exception) -> DataPrepError:
    return DataPrepError(
        f"could not load {HUB_REPO} config {dataset!r} from the hub ({type(err).__name__}: {err}). "
        f"Without network access (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}), download the FlashRAG "
        f"files elsewhere and pass --input PATH: a {dataset}/ folder with train/dev/test .jsonl or .parquet files, "
        f"or one such file together with --split."
    )


def hub_split_names(dataset: str) -> list[str]:
    import datasets

    try:
        return list(datasets.get_dataset_split_names(HUB_REPO, dataset))
    except Exception as err:  # network, auth, offline mode, renamed config: all end the same way
        raise _offline_hint(dataset, err) from err


def load_records(dataset: str, source_split: str, where: str | Path):
    """A `datasets.Dataset` of FlashRAG rows for one split, from the hub or a local file."""
    import datasets

    if where == "hub":
        try:
            return datasets.load_dataset(HUB_REPO, dataset, split=source_split)
        except Exception as err:
            raise _offline_hint(dataset, err) from err
    builder, path = _local_file(Path(where))
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as err:
        raise DataPrepError(
            f"could not read {path} as {builder} in FlashRAG layout ({type(err).__name__}: {err})"
        ) from err


# --------------------------------------------------------------------------- rows


def _answers(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    return [str(a).strip() for a in value if a is not None and str(a).strip()]


def build_rows(
    records, dataset: str, split: str, template: str = "base", tokenizer=None
) -> tuple[dict[str, list], int]:
    """FlashRAG records -> column dict in SCHEMA order, and the count of rows skipped as unusable."""
    missing = {"id", "question", "golden_answers"} - set(records.column_names)
    if missing:
        raise DataPrepError(
            f"{dataset}/{split} lacks the FlashRAG fields {sorted(missing)} (has {records.column_names})"
        )
    has_meta = "metadata" in records.column_names
    cols: dict[str, list] = {name: [] for name in SCHEMA.names}
    skipped = 0
    for rec in records:
        answers = _answers(rec["golden_answers"])
        question = (rec["question"] or "").strip()
        if not question or not answers:
            skipped += 1
            continue
        question = normalize_question(question)
        rid = f"{dataset}_{rec['id']}"
        meta = rec["metadata"] if has_meta else None
        cols["id"].append(rid)
        cols["uid"].append(rid)
        cols["data_source"].append(dataset)
        cols["question"].append(question)
        cols["golden_answers"].append(answers)
        cols["split"].append(split)
        cols["prompt"].append(render_prompt(question, template, tokenizer))
        cols["metadata"].append(
            json.dumps(meta, sort_keys=True, ensure_ascii=False, default=str) if meta is not None else "{}"
        )
    if skipped:
        print(
            f"[data-prep] {dataset}/{split}: skipped {skipped} rows without a question or a golden answer",
            file=sys.stderr,
        )
    dupes = [k for k, n in Counter(cols["id"]).items() if n > 1]
    if dupes:
        raise DataPrepError(
            f"{dataset}/{split}: {len(dupes)} ids occur more than once (e.g. {dupes[:3]}); GRPO groups would mix "
            "questions"
        )
    return cols, skipped


def count_tokens(prompts: list[str], tokenizer, batch: int = 1024) -> list[int]:
    """Prompt lengths as the trainer counts them (`add_special_tokens=False`, see agent_rl.rollout.prompts)."""
    lengths: list[int] = []
    for start in range(0, len(prompts), batch):
        ids = tokenizer(prompts[start : start + batch], add_special_tokens=False)["input_ids"]
        lengths.extend(len(x) for x in ids)
    return lengths


def filter_long(
    cols: dict[str, list], lengths: list[int], max_tokens: int | None
) -> tuple[dict[str, list], list[int], int]:
    """Drop rows whose prompt exceeds max_tokens; -> (kept columns, kept lengths, dropped count)."""
    if not max_tokens:
        return cols, lengths, 0
    keep = [i for i, n in enumerate(lengths) if n <= max_tokens]
    kept = {name: [values[i] for i in keep] for name, values in cols.items()}
    return kept, [lengths[i] for i in keep], len(lengths) - len(keep)


def write_parquet(cols: dict[str, list], path: Path) -> None:
    """Write atomically: a crash never leaves a half-written file where the trainer looks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(cols, schema=SCHEMA), tmp, compression="zstd")
    os.replace(tmp, path)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise DataPrepError(
            f"could not load the tokenizer {path!r} ({type(err).__name__}: {err}); pass a local model directory offline"
        ) from err


def prepare_qa(
    dataset: str,
    out_dir: Path,
    splits: list[str] | None = None,
    input_path: Path | None = None,
    template: str = "base",
    tokenizer=None,
    max_prompt_tokens: int | None = None,
) -> list[SplitSummary]:
    """Write out_dir/{split}.parquet for each split found; `tokenizer` is a path or a loaded tokenizer."""
    if dataset not in DATASETS:
        raise DataPrepError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(str(tokenizer))
    if template == "chat" and tokenizer is None:
        raise DataPrepError("--template chat renders through the tokenizer's chat template: pass --tokenizer PATH")
    if max_prompt_tokens is not None and max_prompt_tokens <= 0:
        raise DataPrepError(f"--max-prompt-tokens must be positive, got {max_prompt_tokens}")
    if max_prompt_tokens and tokenizer is None:
        raise DataPrepError("--max-prompt-tokens counts tokens: pass --tokenizer PATH too")
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataPrepError(
            "--template chat: the tokenizer has no chat_template; use --template base or a tokenizer with one"
        )
    splits = splits or ["train", "test"]
    out_dir = Path(out_dir)
    summaries = []
    for split, source, where in resolve_splits(dataset, splits, Path(input_path) if input_path else None):
        records = load_records(dataset, source, where)
        cols, skipped = build_rows(records, dataset, split, template, tokenizer)
        lengths = count_tokens(cols["prompt"], tokenizer) if tokenizer is not None else []
        cols, lengths, dropped = filter_long(cols, lengths, max_prompt_tokens)
        if dropped and not cols["id"]:
            print(
                f"[data-prep] {dataset}/{split}: every prompt is longer than {max_prompt_tokens} tokens; the file is "
                "empty",
                file=sys.stderr,
            )
        path = out_dir / f"{split}.parquet"
        write_parquet(cols, path)
        summaries.append(
            SplitSummary(
                dataset,
                split,
                source,
                str(path),
                len(cols["id"]),
                dropped,
                skipped,
                lengths if tokenizer is not None else None,
            )
        )
    return summaries


def format_summary(summaries: list[SplitSummary]) -> str:
    header = (
        f"{'dataset':<16} {'split':<12} {'rows':>8} {'dropped':>8} {'skipped':>8} {'mean_tok':>9} {'max_tok':>8}  file"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        split = s.split if s.source_split == s.split else f"{s.split}<{s.source_split}"
        mean = f"{s.mean_tokens:.1f}" if s.mean_tokens is not None else "-"
        mx = str(s.max_tokens) if s.max_tokens is not None else "-"
        lines.append(
            f"{s.dataset:<16} {split:<12} {s.rows:>8} {s.dropped:>8} {s.skipped:>8} {mean:>9} {mx:>8}  {s.path}"
        )
    if any(s.source_split != s.split for s in summaries):
        lines.append("(test<dev: the dataset has no test split; its dev split is used, as in Search-R1)")
    if all(s.prompt_tokens is None for s in summaries):
        lines.append("(token columns need --tokenizer)")
    else:
        lines.append("(mean_tok / max_tok: over the rows kept)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- merge


def merge_tables(inputs: list[Path], out: Path, shuffle_seed: int | None = None) -> Counter:
    """Concatenate parquet prompt files into `out`; group ids must stay unique. -> rows per data_source."""
    tables = []
    for path in inputs:
        if not Path(path).is_file():
            raise DataPrepError(f"merge input {path} does not exist")
        tables.append(pq.read_table(path))
    merged = pa.concat_tables(tables, promote_options="permissive")
    key = "uid" if "uid" in merged.column_names else "id"
    if key not in merged.column_names:
        raise DataPrepError("merge inputs have neither a uid nor an id column: write them with `data-prep qa`")
    counts = Counter(merged.column(key).to_pylist())
    dupes = [k for k, n in counts.items() if n > 1]
    if dupes:
        raise DataPrepError(
            f"{len(dupes)} {key}s occur in more than one row (e.g. {dupes[:3]}): GRPO would group different questions. "
            "Did you pass the same file twice, or files not written by `data-prep qa` (which prefixes ids with the "
            "data source)?"
        )
    if shuffle_seed is not None:
        import numpy as np

        merged = merged.take(pa.array(np.random.default_rng(shuffle_seed).permutation(merged.num_rows)))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(merged, tmp, compression="zstd")
    os.replace(tmp, out)
    return (
        Counter(merged.column("data_source").to_pylist())
        if "data_source" in merged.column_names
        else Counter({"?": merged.num_rows})
    )


def merge(inputs: list[Path], out: Path, shuffle_seed: int | None = None) -> dict[str, Counter]:
    """Files -> one file. Folders (as written by `data-prep qa`) -> out/{split}.parquet per split."""
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise DataPrepError("merge needs at least one --inputs file")
    if all(p.is_dir() for p in inputs):
        names = sorted({f.name for p in inputs for f in p.glob("*.parquet")})
        if not names:
            raise DataPrepError(f"no .parquet files in {[str(p) for p in inputs]}")
        return {
            name: merge_tables([p / name for p in inputs if (p / name).is_file()], Path(out) / name, shuffle_seed)
            for name in names
        }
    if any(p.is_dir() for p in inputs):
        raise DataPrepError("merge --inputs: pass either parquet files or `data-prep qa` output folders, not a mix")
    return {Path(out).name: merge_tables(inputs, Path(out), shuffle_seed)}
