"""The host memory allocator of a CPU training process.

A CPU update allocates and frees its activations every micro-batch, most of them larger than a
MiB. glibc's default (an mmap threshold that rises as tensors are freed) reuses that memory but
leaves freed activations as holes in the heap, and peak RSS grows past what is held. Two CPU-only
levers, neither of which touches a CUDA run (`mmap_threshold_mib`):

- `train.host_mmap_threshold_mib` (glibc's public `mallopt`, set once at start): allocations from
  that size up get their own mapping, unmapped when freed, so RSS follows what is held (what the
  memory planner assumes). The price is a page fault per fresh page of a large tensor.
- mimalloc, a launcher setting: `LD_PRELOAD=$(python -m agent_rl.runtime.allocator) agent-rl train ...`
  (`make demo` sets it where the `cmeel-mimalloc` wheel is installed). It keeps freed pages for
  reuse within a phase, so the update runs without the faults; `release()` returns them between
  the rollout and the update. An allocator must be in the process before anything allocates, so
  it can only come from the launcher. Measurements in bench/RESULTS.md.
"""

from __future__ import annotations

import functools
import os
import sys

from agent_rl.config import RolloutConfig, TrainConfig

PRELOADED = ("mimalloc", "tcmalloc", "jemalloc")  # allocators that replace glibc's malloc when preloaded


def mmap_threshold_mib(train: TrainConfig, rollout: RolloutConfig) -> float:
    """`train.host_mmap_threshold_mib` as it applies to this run's process: 0 (glibc's defaults)
    when train.device or rollout.device is CUDA, where the activations live on the GPU."""
    if str(train.device).startswith("cuda") or str(rollout.device).startswith("cuda"):
        return 0.0
    return train.host_mmap_threshold_mib


def mimalloc_library() -> str | None:
    """Path of the installed libmimalloc shared library (the `cmeel-mimalloc` wheel), or None."""
    if not sys.platform.startswith("linux"):
        return None  # LD_PRELOAD is the Linux loader's
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


@functools.lru_cache(maxsize=1)  # fixed at exec time
def in_use() -> str:
    """The allocator of this process: mimalloc (or a tcmalloc / jemalloc) when the launcher preloaded
    its library, else glibc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "glibc"
    return next((name for name in PRELOADED if f"lib{name}" in maps), "glibc")


def setup(mmap_threshold_mib: float) -> str:
    """Configure this process's allocator for training; returns a line saying which one it is."""
    if in_use() != "glibc":
        return f"{in_use()} (preloaded)"
    if fix_mmap_threshold(mmap_threshold_mib):
        return f"glibc, mmap threshold fixed at {mmap_threshold_mib:g} MiB"
    return "glibc, default mmap threshold"


def release() -> None:
    """Give the memory freed since the last phase back to the system (between rollout and update).

    A preloaded mimalloc keeps freed pages for reuse until told (`mi_collect`, its public API);
    within a phase that reuse is the point, across phases it would hold one phase's peak while the
    other runs. A no-op under glibc, where the fixed threshold already unmaps every large block."""
    if in_use() != "mimalloc":
        return
    import ctypes

    ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))


def fix_mmap_threshold(mib: float) -> bool:
    """glibc: allocations of at least `mib` MiB get their own mapping, unmapped when freed.

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which
    tensors of that size come from the heap; freed activations then leave holes the next
    micro-batch cannot always reuse, and the process keeps them. A fixed threshold disables that
    adjustment, so RSS follows what is held. True if applied."""
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


if __name__ == "__main__":  # what a launcher puts in LD_PRELOAD: the library's path, or nothing
    print(mimalloc_library() or "")
