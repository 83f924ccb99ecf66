"""This process's memory as Linux reports it: the figures the planner's constants, the preflight
and the benchmarks measure against."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import resource
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# What a trainer process holds before its weights, whatever the model's size: the stages, torch,
# transformers' auto classes (their import alone is ~290 MiB), a fast tokenizer (an empty one: a real
# vocabulary adds tens of MiB more), and what the first training step brings in beside its tensors: the
# pages of torch's forward, backward and AdamW kernels it runs and the autograd engine's state, here from one
# step of a one-layer model of width 32 (49 MiB on a 2-core Intel Xeon with torch 2.13, about half of it library
# pages: without it the plan of the tiny model's test was 0.90 of its measured peak, 0.95 with it). Its peak is
# the environment's share of every run's RSS.
_BASELINE_SCRIPT = """\
import agent_rl.train, tokenizers, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config
PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()))('x')
from agent_rl.learn.update import adamw
cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
model = AutoModelForCausalLM.from_config(cfg)
opt = adamw(model.parameters(), 1e-3)
ids = torch.randint(0, 64, (2, 16))
model(ids).logits.float().log_softmax(-1).gather(-1, ids[..., None]).sum().backward()
opt.step()
from agent_rl.runtime.memory import peak_rss_bytes
print(peak_rss_bytes())
"""


def proc_status_bytes(key: str, pid: int | str = "self") -> int | None:
    """A memory line of /proc/PID/status (VmRSS, VmHWM, RssAnon, ...) in bytes, this process's by default; None
    off Linux."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (VmHWM on Linux).

    Not ru_maxrss: Linux carries the parent's high-water mark into a child across exec (Python's
    subprocess uses vfork), so a run launched from a large process would report the parent's peak.
    """
    hwm = proc_status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@functools.cache
def _versions(statements: tuple[str, ...] = ()) -> str:
    dists = ["torch", "transformers", "tokenizers", "agent-rl"]
    for module in map(imported_package, statements):
        try:  # most packages are their distribution's name; the full map walks every installed file
            metadata.version(module)
            dists.append(module)
        except metadata.PackageNotFoundError:
            dists += metadata.packages_distributions().get(module, [module])
    out = []
    for dist in dists:
        try:
            out.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist}=none")
    return ",".join(out)


def import_baseline_bytes(cache_dir: str | Path | None = None) -> int | None:
    """Peak RSS of a fresh interpreter of this environment that imports what the trainer imports and
    runs one training step of a minute model (the kernels' pages every run's first step brings in):
    measured once on the machine that plans (it moves by ~100 MiB with the versions installed and
    where the environment's files live, so no constant taken elsewhere holds), then read from a
    cache keyed by the interpreter and the versions of torch, transformers, tokenizers and this
    package. None where it cannot be measured (the caller falls back to its constant). Measured
    without a preloaded allocator, whose share the planner adds on its own."""
    return _measured_imports((), cache_dir)


def imported_package(statement: str) -> str:
    """The top-level package an import statement (`import x.y`, `from x.y import z`) loads."""
    return statement.split()[1].split(".")[0]


def import_cost_bytes(statement: str, cache_dir: str | Path | None = None) -> int | None:
    """What an import statement (`from vllm import LLM`: vLLM's top level alone is lazy) adds to
    the baseline's peak RSS, measured the same way and cached with the package's version; None
    where either cannot be measured (the package is not installed)."""
    base, more = _measured_imports((), cache_dir), _measured_imports((statement,), cache_dir)
    return None if base is None or more is None else max(0, more - base)


def _measured_imports(statements: tuple[str, ...], cache_dir: str | Path | None) -> int | None:
    versions = _versions(statements)
    what = "|".join(statements)
    identity = f"{sys.executable}|{sys.version}|{versions}|{what}|{_BASELINE_SCRIPT}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agent_rl"
    name = "_".join(map(imported_package, statements)) or "baseline"
    path = root / f"import_{name}-{key}.json"
    try:
        return int(json.loads(path.read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = "".join(f"{line}\n" for line in statements) + _BASELINE_SCRIPT
    try:
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        measured = int(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        measured = None
    if measured is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bytes": measured, "python": sys.executable, "versions": versions}) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # measured again next time
    return measured
