"""The training jobs' host allocator (agent_rl/infra/allocator.py): mimalloc from its wheel, loaded
by re-executing the command, reuses freed memory where glibc's fixed mmap threshold faults it in
afresh, and gives it back; a wrong or unavailable choice is a clear error."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.config import ConfigError, load_config
from agent_rl.infra import allocator

ROOT = Path(__file__).resolve().parents[1]
WHEEL_PLATFORM = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def _python(code: str, choice: str, *args: str) -> subprocess.CompletedProcess:
    env = allocator.exec_env(choice, {**os.environ, "PYTHONPATH": str(ROOT)})
    env.pop(allocator.MARKER, None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="cmeel-mimalloc is a dependency on x86-64 and aarch64 Linux only")
def test_auto_resolves_to_the_installed_mimalloc():
    """The dependency is installed, so auto means mimalloc; glibc stays glibc when asked for."""
    assert allocator.mimalloc_library() is not None
    assert allocator.resolve("auto") == "mimalloc" and allocator.resolve("mimalloc") == "mimalloc"
    assert allocator.resolve("glibc") == "glibc"
    assert "libmimalloc" in allocator.exec_env("auto", {})["LD_PRELOAD"]
    assert "LD_PRELOAD" not in allocator.exec_env("glibc", {})


def test_bad_or_unavailable_allocator_is_a_clear_error(monkeypatch):
    """An unknown name fails at config load naming the key; mimalloc asked for where its library is
    missing names the package to install and the way out; auto then falls back to glibc."""
    with pytest.raises(ConfigError, match="train.host_allocator"):
        load_config(None, ["train.host_allocator=jemalloc"])
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    with pytest.raises(ConfigError, match="pip install cmeel-mimalloc.*train.host_allocator=glibc"):
        allocator.resolve("mimalloc")
    assert allocator.resolve("auto") == "glibc"


EXEC = r"""
import os, sys
from agent_rl.infra import allocator
print(os.getpid(), allocator.in_use(), flush=True)
allocator.exec_under(sys.argv[1])
print("done", os.getpid(), allocator.in_use(), flush=True)
"""


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="cmeel-mimalloc is a dependency on x86-64 and aarch64 Linux only")
def test_exec_under_restarts_the_same_process_once_under_mimalloc():
    """A process started under glibc re-executes itself (same PID, same argv) under mimalloc and goes
    on there; asked for glibc it does not restart."""
    res = _python(EXEC, "glibc", "auto")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.split("\n")
    pid = lines[0].split()[0]
    assert lines[:3] == [f"{pid} glibc", f"{pid} mimalloc", f"done {pid} mimalloc"]
    res = _python(EXEC, "glibc", "glibc")
    pid = res.stdout.split()[0]
    assert res.stdout.split("\n")[:2] == [f"{pid} glibc", f"done {pid} glibc"]


CHURN = r"""
import json, resource, sys
import torch
from agent_rl.infra import allocator
from agent_rl.infra.preflight import proc_status_bytes
allocator.setup(sys.argv[1], 1.0)

def rss():
    return proc_status_bytes("VmRSS")

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

base = rss()
rounds = []
for _ in range(4):  # an update's pattern: many MiB-sized activations made, used, freed
    f0 = faults()
    held = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MiB
    peak = rss()
    del held
    rounds.append(faults() - f0)
allocator.release()  # as `train` does between rollout and update
print(json.dumps({"allocator": allocator.in_use(), "faults": rounds, "held": peak - base, "after": rss() - base}))
"""


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="cmeel-mimalloc is a dependency on x86-64 and aarch64 Linux only")
def test_mimalloc_reuses_freed_activations_and_gives_them_back():
    """256 MiB of 4 MiB tensors made and freed four times: under glibc's fixed threshold every round
    faults every page in afresh; under mimalloc the later rounds reuse the pages (a tenth of the
    faults or fewer), and in both RSS falls back to within a quarter of the held size once freed and
    released (`allocator.release`, which the trainer calls between its phases)."""
    out = {}
    for choice in ("glibc", "auto"):
        res = _python(CHURN, choice, choice)
        assert res.returncode == 0, res.stderr[-3000:]
        out[choice] = json.loads(res.stdout.strip().splitlines()[-1])
    glibc, mi = out["glibc"], out["auto"]
    assert glibc["allocator"] == "glibc" and mi["allocator"] == "mimalloc"
    pages = 256 * 2**20 // 4096
    assert min(glibc["faults"][1:]) >= 0.9 * pages
    assert max(mi["faults"][1:]) <= 0.1 * pages
    for r in (glibc, mi):
        assert r["held"] >= 240 * 2**20
        assert r["after"] <= 0.25 * r["held"], r


def test_a_cuda_run_gets_no_reexec_and_no_mallopt(monkeypatch):
    """With train.device or rollout.device on CUDA (torchrun or not) the CPU allocator settings do not
    apply: the decision is glibc with its default threshold, so `exec_under` does not re-execute and
    `setup` calls no mallopt. A CPU config keeps its own settings. No GPU needed."""
    calls = []
    monkeypatch.setattr(allocator.os, "execve", lambda *a: calls.append("execve"))
    real_fix = allocator.fix_mmap_threshold  # returns before mallopt for 0 (glibc's default)
    monkeypatch.setattr(allocator, "fix_mmap_threshold", lambda mib: calls.append(mib) if mib > 0 else real_fix(mib))
    monkeypatch.setattr(allocator, "in_use", lambda: "glibc")
    monkeypatch.delenv(allocator.MARKER, raising=False)
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: "/lib/libmimalloc.so")  # as if installed
    for devices in (["train.device=cuda", "rollout.device=cuda"], ["train.device=cuda"], ["rollout.device=cuda:0"]):
        cfg = load_config(None, ["train.host_allocator=auto", "train.host_mmap_threshold_mib=1", *devices])
        assert allocator.for_config(cfg) == ("glibc", 0.0)
        allocator.exec_under(allocator.for_config(cfg)[0])
        assert allocator.setup(*allocator.for_config(cfg)) == "glibc, default mmap threshold"
    assert calls == []
    cpu = load_config(None, ["train.host_allocator=auto", "train.host_mmap_threshold_mib=1"])
    assert allocator.for_config(cpu) == ("auto", 1.0)
