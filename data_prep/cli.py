"""`data-prep`: QA datasets -> parquet prompts, corpora -> JSONL, and the offline toy world.

    data-prep qa        --dataset NAME [--input PATH] [--split train,test] --out DIR [--template base|chat]
                        [--tokenizer PATH --max-prompt-tokens N]
    data-prep merge     --inputs A.parquet B.parquet ... --out M.parquet [--shuffle-seed S]
    data-prep corpus    --input PATH --format {hipporag,wiki18,beir,cacm} --out C.jsonl
    data-prep toy-world --out DIR [--seed 0]

Heavy libraries (datasets, transformers) are imported by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from data_prep.corpus import FORMATS, CorpusError
from data_prep.qa import DATASETS, DataPrepError


def cmd_qa(args: argparse.Namespace) -> int:
    from data_prep.qa import format_summary, prepare_qa

    splits = [s.strip() for s in args.split.split(",") if s.strip()] if args.split else None
    if splits is None and args.input and Path(args.input).is_file():
        stem = Path(args.input).name.split(".")[0]
        if stem not in ("train", "dev", "test"):
            raise SystemExit(
                f"data-prep qa: --input {args.input} is one file whose name is not train/dev/test: say which split "
                "it is with --split"
            )
        splits = [stem]
    summaries = prepare_qa(
        args.dataset,
        Path(args.out),
        splits,
        Path(args.input) if args.input else None,
        args.template,
        args.tokenizer,
        args.max_prompt_tokens,
    )
    print(format_summary(summaries))
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from data_prep.qa import merge

    results = merge([Path(p) for p in args.inputs], Path(args.out), args.shuffle_seed)
    for name, counts in results.items():
        where = Path(args.out) / name if Path(args.out).suffix != ".parquet" else Path(args.out)
        print(
            f"{where}: {sum(counts.values())} rows"
            + (f", shuffled with seed {args.shuffle_seed}" if args.shuffle_seed is not None else "")
        )
        for source, n in sorted(counts.items()):
            print(f"  {source:<16} {n:>8}")
    return 0


def cmd_corpus(args: argparse.Namespace) -> int:
    from data_prep.corpus import convert_corpus

    stats = convert_corpus(Path(args.input), args.format, Path(args.out))
    print(
        f"{args.out}: read {stats.read} records, wrote {stats.written}, dropped {stats.duplicates} duplicate ids"
        + (f" (e.g. {', '.join(stats.duplicate_examples)})" if stats.duplicates else "")
    )
    return 0


def cmd_toy_world(args: argparse.Namespace) -> int:
    from data_prep.toy_world import build_toy_world

    info = build_toy_world(Path(args.out), seed=args.seed, num_entities=args.num_entities, template=args.template)
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data-prep",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  data-prep qa --dataset nq --input flashrag/nq --out data/nq\n"
        "  data-prep toy-world --out data/toy",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("qa", help="a FlashRAG QA dataset -> DIR/{train,test}.parquet with rendered prompts")
    p.add_argument("--dataset", required=True, choices=DATASETS, help="FlashRAG config name")
    p.add_argument(
        "--input",
        help="local FlashRAG data instead of the hub: a folder with {train,dev,test}.jsonl|.parquet "
        "(or NAME/ under it), or one file (its split from --split or its name)",
    )
    p.add_argument("--split", help="comma-separated splits (default train,test; a missing test falls back to dev)")
    p.add_argument("--out", required=True, help="output folder; writes {split}.parquet")
    p.add_argument(
        "--template",
        default="base",
        choices=("base", "chat"),
        help="base: Search-R1's prompt verbatim; chat: the same text as a user turn of the tokenizer's chat template",
    )
    p.add_argument("--tokenizer", help="tokenizer (local dir or hub id) for --template chat and for token counts")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="drop prompts longer than this many tokens (needs --tokenizer); counts are reported per dataset",
    )
    p.set_defaults(func=cmd_qa)

    p = sub.add_parser("merge", help="concatenate prompt parquet files (group ids must be unique)")
    p.add_argument(
        "--inputs",
        nargs="+",
        required=True,
        help="parquet files, or `data-prep qa` output folders (merged split by split)",
    )
    p.add_argument("--out", required=True, help="output parquet file (or folder when --inputs are folders)")
    p.add_argument("--shuffle-seed", type=int, help="shuffle the rows with this seed (default: keep input order)")
    p.set_defaults(func=cmd_merge)

    p = sub.add_parser("corpus", help='convert a corpus to JSONL lines {"id", "contents": "Title\\ntext"}')
    p.add_argument(
        "--input",
        required=True,
        help="hipporag: JSON list; wiki18/beir: JSONL; cacm: tar(.gz) of HTML or converted JSONL",
    )
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output corpus JSONL")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("toy-world", help="the seeded synthetic world: corpus.jsonl, train.parquet, test.parquet")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical files")
    p.add_argument("--num-entities", type=int, default=1000, help="people and organisations (80/20)")
    p.add_argument(
        "--template",
        default="compact",
        choices=("compact", "base"),
        help="compact: the same protocol in ~25 tokens; base: Search-R1's",
    )
    p.set_defaults(func=cmd_toy_world)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DataPrepError, CorpusError, FileNotFoundError) as err:
        print(f"data-prep {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
