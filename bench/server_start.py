"""Start-up time of `retriever-server`: from the process's spawn to its ready file (listening, index and
encoder loaded), on an index whose ONNX encoder export is already kept beside it, as every start
after the first finds it. With --against TREE, the same spawns from another checkout of this
repository (e.g. a `git worktree` of an older commit), alternated with this one's.

Usage: .venv/bin/python bench/server_start.py --index DIR [--against TREE] [--pairs 5]

Each tree serves its own copy of the index (an older tree keys its ONNX export differently and
would otherwise export again at every alternation). One untimed start per tree first. Prints the
median seconds per tree, every start's seconds and whether the server process imported torch (read
from its /proc maps: libtorch is mapped once torch is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_once(tree: Path, index: Path) -> dict:
    """Spawn the server from `tree` on `index`, time it to its ready file, look at what it loaded, stop it."""
    work = Path(tempfile.mkdtemp(prefix="server_start_"))
    ready = work / "ready.json"
    cmd = [sys.executable, "-m", "retriever_server.app", "--index", str(index), "--port", "0"]
    cmd += ["--ready-file", str(ready)]
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit(f"the server from {tree} exited with {proc.returncode}")
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        maps = Path(f"/proc/{proc.pid}/maps").read_text() if Path(f"/proc/{proc.pid}/maps").exists() else ""
        loaded = {"torch": "libtorch" in maps}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return {"seconds": seconds, **loaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, help="an index directory (retriever-build output)")
    parser.add_argument("--against", help="another checkout of this repository to compare with")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args(argv)
    trees = {"this": ROOT} | ({"against": Path(args.against).resolve()} if args.against else {})
    work = Path(tempfile.mkdtemp(prefix="server_start_indexes_"))
    indexes = {}
    for name in trees:
        indexes[name] = work / name
        shutil.copytree(args.index, indexes[name])
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for name, tree in trees.items():
            start_once(tree, indexes[name])  # untimed: exports the encoder if this tree's key has none kept
        for i in range(args.pairs):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                runs[name].append(start_once(trees[name], indexes[name]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        name: {
            "median_s": statistics.median(r["seconds"] for r in rs),
            "seconds": [round(r["seconds"], 3) for r in rs],
            "imports_torch": any(r["torch"] for r in rs),
        }
        for name, rs in runs.items()
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
