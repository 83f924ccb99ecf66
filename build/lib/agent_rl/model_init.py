"""`agent-rl init-model`: a small random Qwen2 with a BPE tokenizer trained here, offline.

The tokenizer is a byte-level BPE trained with `tokenizers` on the given texts (by default the
toy world's corpus and prompts) with the agent tags as single special tokens, so `</search>`
and `</answer>` are stop token ids. The result loads like any hub model:
`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

TAGS = ["<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>"]
EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# hidden, layers, heads, kv heads, intermediate, vocab. head_dim = 64 everywhere (vLLM needs >= 64).
SIZES = {
    "tiny": dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, intermediate_size=512, vocab=1536),
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024, vocab=4096),
    "medium": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048, vocab=8192),
}


def _default_texts() -> Iterator[str]:
    from data_prep.toy_world import build_toy_world
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        info = build_toy_world(Path(tmp), seed=0)
        with open(info["corpus"]) as fh:
            texts = [json.loads(line)["contents"] for line in fh]
        texts += pq.read_table(info["train"], columns=["prompt"]).column("prompt").to_pylist()
    yield from texts


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD, *TAGS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # The tags are taught in context too, so the words around them merge naturally.
    tok.train_from_iterator(iter([*texts, " ".join(TAGS)]), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, additional_special_tokens=TAGS, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_model(out_dir: Path, size: str = "tiny", texts: Iterable[str] | None = None, seed: int = 0) -> Path:
    """Train the tokenizer, build a random Qwen2 of `size`, save both to out_dir."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    spec = dict(SIZES[size])
    vocab = spec.pop("vocab")
    tokenizer = train_tokenizer(texts if texts is not None else _default_texts(), vocab)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **spec,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _read_texts(paths: list[str]) -> Iterator[str]:
    import pyarrow.parquet as pq

    for p in paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"--text {path} does not exist")
        if path.suffix == ".parquet":
            yield from pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        elif path.suffix == ".jsonl":
            with path.open() as fh:
                for line in fh:
                    yield json.loads(line)["contents"]
        else:
            yield from path.read_text().splitlines()


def _cmd(args: argparse.Namespace) -> int:
    texts = _read_texts(args.text) if args.text else None
    out = init_model(Path(args.out), args.size, texts, args.seed)
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"wrote a {args.size} Qwen2 ({n / 1e6:.2f}M parameters) with its tokenizer to {out}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("init-model", help="train a BPE tokenizer offline and save a random small Qwen2")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (tiny ~2M, small ~15M, medium ~100M parameters)")
    p.add_argument("--text", nargs="*", help="training text: corpus .jsonl (contents), .parquet (prompt) or plain text files; default: the toy world")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd)
