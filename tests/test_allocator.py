"""The training jobs' host allocator (agent_rl/runtime/allocator.py): glibc with a fixed mmap
threshold set at start, or mimalloc from its wheel preloaded by the launcher (`make demo`), which
reuses freed memory where glibc's fixed threshold faults it in afresh, and gives it back. Neither
applies to a CUDA run; the removed re-exec setting is a clear error."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.config import ConfigError, load_config
from agent_rl.runtime import allocator

ROOT = Path(__file__).resolve().parents[1]
WHEEL_PLATFORM = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def _python(code: str, choice: str, *args: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, started as a launcher starts a job: with mimalloc preloaded
    (the path `python -m agent_rl.runtime.allocator` prints) or without."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LD_PRELOAD", None)
    if choice == "mimalloc":
        path = subprocess.run(
            [sys.executable, "-m", "agent_rl.runtime.allocator"], cwd=ROOT, env=env, capture_output=True, text=True
        ).stdout.strip()
        assert path.endswith(".so") or ".so." in path, path
        env["LD_PRELOAD"] = path
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not WHEEL_PLATFORM, reason="cmeel-mimalloc is a dependency on x86-64 and aarch64 Linux only")
def test_the_launcher_preloads_mimalloc_and_the_job_says_so():
    """The wheel's library path comes from `python -m agent_rl.runtime.allocator`; a process started
    with it in LD_PRELOAD runs under mimalloc and `setup` reports it; without it, glibc with the
    fixed threshold."""
    code = "from agent_rl.runtime import allocator; print(allocator.in_use()); print(allocator.setup(1.0))"
    res = _python(code, "mimalloc")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:2] == ["mimalloc", "mimalloc (preloaded)"]
    res = _python(code, "glibc")
    assert res.stdout.split("\n")[:2] == ["glibc", "glibc, mmap threshold fixed at 1 MiB"]


def test_the_removed_allocator_key_is_a_clear_error():
    """`train.host_allocator` (the re-exec under mimalloc) is gone: a config still setting it fails at
    load naming the key."""
    with pytest.raises(ConfigError, match="host_allocator"):
        load_config(None, ["train.host_allocator=auto"])


CHURN = r"""
import json, resource, sys
import torch
from agent_rl.runtime import allocator
from agent_rl.runtime.memory import proc_status_bytes
print(allocator.setup(1.0), flush=True)

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
    faults every page in afresh; under a preloaded mimalloc the later rounds reuse the pages (a tenth of the
    faults or fewer), and in both RSS falls back to within a quarter of the held size once freed and
    released (`allocator.release`, which the trainer calls between its phases)."""
    out = {}
    for choice in ("glibc", "mimalloc"):
        res = _python(CHURN, choice)
        assert res.returncode == 0, res.stderr[-3000:]
        out[choice] = json.loads(res.stdout.strip().splitlines()[-1])
    glibc, mi = out["glibc"], out["mimalloc"]
    assert glibc["allocator"] == "glibc" and mi["allocator"] == "mimalloc"
    pages = 256 * 2**20 // 4096
    assert min(glibc["faults"][1:]) >= 0.9 * pages
    assert max(mi["faults"][1:]) <= 0.1 * pages
    for r in (glibc, mi):
        assert r["held"] >= 240 * 2**20
        assert r["after"] <= 0.25 * r["held"], r


def test_a_cuda_run_gets_no_mallopt(monkeypatch):
    """With train.device or rollout.device on CUDA (torchrun or not) the CPU allocator setting does not
    apply: `setup` calls no mallopt. A CPU config keeps its threshold. No GPU needed."""
    calls = []
    real_fix = allocator.fix_mmap_threshold  # returns before mallopt for 0 (glibc's default)
    monkeypatch.setattr(allocator, "fix_mmap_threshold", lambda mib: calls.append(mib) if mib > 0 else real_fix(mib))
    monkeypatch.setattr(allocator, "in_use", lambda: "glibc")
    for devices in (["train.device=cuda", "rollout.device=cuda"], ["train.device=cuda"], ["rollout.device=cuda:0"]):
        cfg = load_config(None, ["train.host_mmap_threshold_mib=1", *devices])
        assert allocator.mmap_threshold_mib(cfg.train, cfg.rollout) == 0.0
        assert allocator.setup(allocator.mmap_threshold_mib(cfg.train, cfg.rollout)) == "glibc, default mmap threshold"
    assert calls == []
    cpu = load_config(None, ["train.host_mmap_threshold_mib=1"])
    assert allocator.mmap_threshold_mib(cpu.train, cpu.rollout) == 1.0
