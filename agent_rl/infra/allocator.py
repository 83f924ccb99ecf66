"""The host memory allocator of a CPU training process: mimalloc where installed, else glibc with a
fixed mmap threshold.

A CPU update allocates and frees its activations every micro-batch, most of them larger than a
MiB. Under glibc with a fixed 1 MiB mmap threshold each one is a fresh mapping whose pages are
faulted in and zeroed on first touch, hundreds of thousands of faults an update; glibc's default
(a threshold that rises as tensors are freed) reuses the memory but leaves freed activations as
holes in the heap, and peak RSS grows past what is held. mimalloc keeps freed pages for reuse and
returns them to the system soon after they go unused, so the update runs at the reusing speed
with the fixed threshold's peak (measurements in bench/RESULTS.md).

mimalloc must be in the process before anything allocates, so it can only come in at exec time
(LD_PRELOAD): `agent-rl train` / `sft` re-execute themselves under it once (`exec_under`). A run
started another way (the Python API, a test) keeps glibc and says so. PyTorch's CPU guides ask for
the same with jemalloc or tcmalloc; mimalloc is the one that comes as a wheel (`cmeel-mimalloc`).
None of this applies to a CUDA run (`for_config`).
"""

from __future__ import annotations

import functools
import os
import sys

MARKER = "AGENT_RL_ALLOCATOR_EXEC"  # set across the re-exec, so a failed preload cannot loop
PRELOADED = ("mimalloc", "tcmalloc", "jemalloc")  # allocators that replace glibc's malloc when preloaded


def for_config(cfg) -> tuple[str, float]:
    """(`train.host_allocator`, `train.host_mmap_threshold_mib`) as they apply to this config's process.

    Both are CPU-training settings. On a CUDA run (train.device or rollout.device on CUDA, torchrun
    included) the update's activations live on the GPU, and a preloaded allocator would sit under
    CUDA's and vLLM's own host memory as well: glibc with its defaults, so no re-exec and no mallopt."""
    if str(cfg.train.device).startswith("cuda") or str(cfg.rollout.device).startswith("cuda"):
        return "glibc", 0.0
    return cfg.train.host_allocator, cfg.train.host_mmap_threshold_mib


@functools.cache  # resolve() asks on every call; the installed files do not change in a process
def mimalloc_library() -> str | None:
    """Path of the installed libmimalloc shared library (the `cmeel-mimalloc` wheel), or None."""
    if not sys.platform.startswith("linux"):
        return None  # LD_PRELOAD is the Linux loader's; macOS would need DYLD_INSERT_LIBRARIES
    from importlib import metadata

    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmimalloc.so"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    return None


def resolve(choice: str) -> str:
    """What `train.host_allocator` means here: mimalloc or glibc.

    auto takes mimalloc where it is installed; an explicit mimalloc that is not installed is an error."""
    if choice == "glibc":
        return "glibc"
    if mimalloc_library() is not None:
        return "mimalloc"
    if choice == "mimalloc":
        from agent_rl.config import ConfigError

        raise ConfigError(
            "train.host_allocator=mimalloc: libmimalloc is not installed (Linux: pip install cmeel-mimalloc), "
            "or set train.host_allocator=glibc"
        )
    return "glibc"


@functools.lru_cache(maxsize=1)  # fixed at exec time
def in_use() -> str:
    """The allocator of this process: mimalloc (or a tcmalloc / jemalloc the user preloaded) when its
    library is mapped, else glibc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "glibc"
    return next((name for name in PRELOADED if f"lib{name}" in maps), "glibc")


def exec_env(choice: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with what a process needs to start under the resolved allocator."""
    env = dict(os.environ if env is None else env)
    preload = env.get("LD_PRELOAD", "")
    if resolve(choice) == "mimalloc" and "libmimalloc" not in preload:
        env["LD_PRELOAD"] = f"{mimalloc_library()} {preload}".strip()
    return env


def exec_under(choice: str) -> None:
    """Re-execute this command line under mimalloc when it is wanted and not yet loaded; else return.

    Called by the CLI before the job imports torch, with the process's own argv (`sys.orig_argv`):
    the PID, the environment and the arguments stay, so torchrun and job schedulers see the same
    process."""
    if resolve(choice) != "mimalloc" or in_use() != "glibc" or os.environ.get(MARKER):
        return  # not wanted, already under mimalloc or an allocator the user preloaded, or tried once
    env = exec_env(choice)
    env[MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def setup(choice: str, mmap_threshold_mib: float) -> str:
    """Configure this process's allocator for training; returns a line saying which one it is.

    Under glibc the mmap threshold is fixed (`fix_mmap_threshold`), so RSS follows what is held."""
    if in_use() != "glibc":
        return in_use()
    fixed = fix_mmap_threshold(mmap_threshold_mib)
    line = f"glibc, mmap threshold fixed at {mmap_threshold_mib:g} MiB" if fixed else "glibc, default mmap threshold"
    if resolve(choice) == "mimalloc":
        line += "; mimalloc is installed but needs the process to start with it: run `agent-rl train`"
    return line


def release() -> None:
    """Give the memory freed since the last phase back to the system (between rollout and update).

    mimalloc keeps freed pages for reuse until told (`mi_collect`); within a phase that reuse is the
    point, across phases it would hold one phase's peak while the other runs. A no-op under glibc,
    where the fixed threshold already unmaps every large block as it is freed."""
    if in_use() != "mimalloc":
        return
    import ctypes

    ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))


def fix_mmap_threshold(mib: float) -> bool:
    """glibc: allocations of at least `mib` MiB get their own mapping, unmapped when freed.

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which
    tensors of that size come from the heap; freed activations then leave holes the next
    micro-batch cannot always reuse, and the process keeps them (with LoRA on SmolLM2, a multiple
    of the saved activations). A fixed threshold disables that adjustment, so RSS follows
    what is held; the price is a page fault per fresh page of a large tensor. True if applied."""
    if mib <= 0:
        return False
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    if mallopt is None:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)))
