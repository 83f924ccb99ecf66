"""bench/gpu_session.sh and its helpers on the CPU: the session's smoke run ends in its summary and JSON, with the
steps a CPU cannot run skipped by name; the payload's parts travel and come back whole; the bandwidth bound and the
update's model FLOPs match hand counts; bench/engines.py's lines parse."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_payload  # noqa: E402
import gpu_session  # noqa: E402
from update_throughput import model_flops  # noqa: E402


def test_payload_parts_travel_one_a_call_and_unpack_whole(tmp_path):
    """A payload cut into parts arrives over two calls (the stash keeps the first), is joined, checked and
    extracted byte for byte; a damaged part is refused by name; the plan of calls carries one part each and
    runs the session last."""
    payload = tmp_path / "payload"
    (payload / "nq" / "data").mkdir(parents=True)
    blobs = {"nq/data/a.bin": os.urandom(5000), "notes.txt": b"x" * 3000}
    for name, data in blobs.items():
        (payload / name).write_bytes(data)
    home, stash = tmp_path / "home", tmp_path / "stash"
    parts = gpu_payload.pack(payload, home / "parts", part_bytes=2048)
    assert len(parts) >= 2 and all(p["bytes"] <= 2048 for p in parts)
    manifest = {"parts": parts, "calls": gpu_payload.calls(parts)}
    assert [c["command"] for c in manifest["calls"]][-1] == "bash bench/gpu_session.sh"
    assert all(len(c["carry"]) == 2 and c["carry"][0] == ".cache/gpu_payload/manifest.json" for c in manifest["calls"])

    arrived = sorted((home / "parts").iterdir())
    held = tmp_path / "held"
    held.mkdir()
    for f in arrived[1:]:  # the first call carries only the first part
        f.rename(held / f.name)
    assert gpu_payload.receive(manifest, home / "parts", stash) == [p["name"] for p in parts[1:]]
    for f in held.iterdir():
        f.rename(home / "parts" / f.name)
    (home / "parts" / parts[0]["name"]).unlink()  # gone from the tree: the stash has it
    assert gpu_payload.unpack(manifest, home, stash, tmp_path / "site") == 0
    for name, data in blobs.items():
        assert (home / "unpacked" / name).read_bytes() == data

    (stash / parts[1]["name"]).write_bytes(b"damaged" + b"\0" * (parts[1]["bytes"] - 7))
    (home / "unpacked" / ".parts.json").unlink()
    with pytest.raises(SystemExit, match=parts[1]["name"]):
        gpu_payload.extract(manifest, home / "unpacked", stash)
    assert hashlib.sha256(b"").hexdigest() != parts[1]["sha256"]


def test_decode_bound_counts_weights_once_a_step_and_each_rows_cache():
    """Two rows of 3 and 5 prompt tokens, 4 new tokens: the KV read is 4 x 8 + 2 x (0+1+2+3) = 44 tokens, so
    4 x 100 weight bytes + 44 x 10 KV bytes = 840 bytes at 1000 B/s: 0.84 s for 8 tokens."""
    got = gpu_session.decode_bound(100, 10, [3, 5], 4, 1000.0)
    assert got["bytes"] == 840
    assert got["seconds"] == pytest.approx(0.84)
    assert got["tokens_per_s"] == pytest.approx(8 / 0.84)
    assert gpu_session.device_specs("NVIDIA H100 80GB HBM3")["bandwidth"] == 3.35e12
    assert gpu_session.device_specs("NVIDIA H200")["bandwidth"] == 4.8e12
    assert gpu_session.device_specs("cpu") is None


def test_model_flops_full_weights_and_lora_by_hand():
    """Full weights: 6 x (body x tokens + head x trained); LoRA: 4 for the frozen base, 6 for the adapters."""
    assert model_flops(body=10, head=3, adapters=0, tokens=7, trained=2, lora=False) == 6 * (70 + 6)
    assert model_flops(body=10, head=3, adapters=5, tokens=7, trained=2, lora=True) == 4 * (70 + 6) + 6 * 35


def test_engines_lines_parse_and_the_fastest_engine_is_picked(tmp_path):
    """bench/engines.py's per-pair lines become one record per engine and row count; the NQ step takes the
    engine with the most tokens/s on the first model at its fewest rows, and hf when nothing was measured."""
    text = (
        "rows 128 pair 1: hf 32768 tok in 8.00 s (4096.0 tok/s, start 5.1 s, warm-up 1.2 s), "
        "paged 30000 tok in 3.00 s (10000.0 tok/s, start 6.0 s, warm-up 9.5 s)\n"
        "rows 128: median tokens/s  hf 4096.0  paged 10000.0  paged/hf 2.44x\n"
    )
    runs = gpu_session.parse_engines_output(text)
    assert [(r["engine"], r["rows"], r["tokens"], r["tokens_per_s"]) for r in runs] == [
        ("hf", 128, 32768, 4096.0),
        ("paged", 128, 30000, 10000.0),
    ]
    path = tmp_path / "engines.json"
    path.write_text(json.dumps({"runs": [{"model": "m", **r} for r in runs]}))
    assert gpu_session.fastest_engine(path, "hf") == "paged"
    assert gpu_session.fastest_engine(tmp_path / "none.json", "hf") == "hf"


def test_session_smoke_run_on_the_cpu_ends_in_its_summary_and_json(tiny_model_dir, tmp_path):
    """GPU_SESSION_SMOKE=1 on a CPU: setup, engines (hf, 2 rows of 8 tokens) and update (LoRA, then the smoke
    shape's full weights, one cap) run; planner and nq are skipped with a line saying why; the summary is printed
    and OUT/session.json holds every step's status and results."""
    out = tmp_path / "session"
    env = {**os.environ, "GPU_SESSION_SMOKE": "1", "MODEL": str(tiny_model_dir), "OUT": str(out)}
    env.update(PY=sys.executable, SESSION_S="500", BUDGET_ENGINES="200", BUDGET_UPDATE="250")  # slack for a busy CPU
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_session.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "== gpu_session" in res.stdout and f"JSON: {out / 'session.json'}" in res.stdout
    session = json.loads((out / "session.json").read_text())
    status = {s["step"]: (s["status"], s["note"]) for s in session["steps"]}
    assert [s["step"] for s in session["steps"]] == ["setup", "engines", "update", "planner", "nq"]
    assert status["engines"][0] == status["update"][0] == "ok", status
    assert status["planner"] == ("skipped", "needs CUDA (torch.cuda's allocator statistics)")
    assert status["nq"][0] == "skipped" and "needs CUDA" in status["nq"][1]
    runs = session["engines"]["runs"]
    assert [(r["engine"], r["rows"]) for r in runs] == [("hf", 2)] and runs[0]["tokens"] > 0
    lora, full = session["update"]["lora"], session["update"]["smoke_full_checkpointed"]
    assert lora["lora"] and lora["parameters"]["adapters"] > 0
    assert not full["lora"] and full["gradient_checkpointing"] and full["parameters"]["adapters"] == 0
    for res_ in (lora, full):
        (cap,) = res_["caps"].values()
        n = res_["parameters"]
        want = model_flops(
            n["body"], n["head"], n["adapters"], cap["tokens"], cap["rows"] * res_["trained_per_row"], res_["lora"]
        )
        assert cap["model_flops"] == want and cap["mfu"] is None  # no datasheet peak for a CPU
    assert (out / "session.log").read_text().count("== ") >= 6
