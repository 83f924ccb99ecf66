"""The documents stay true to the repository: the config reference is the one the fields' help
generates, and every repository path the README and docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

from agent_rl.config_reference import COMMAND, render

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path is checked when it starts at one of the repository's own folders (or a stage folder of
# agent_rl, as the README writes `rollout/budget.py`); run outputs (OUTPUT_DIR/..., .cache/...,
# data/..., runs/...) and metric names (`rollout/...`) are not repository files.
TOP = ("agent_rl", "retriever_server", "data_prep", "configs", "bench", "tests", "docs", ".ci")
STAGES = ("rollout", "learn", "runtime", "bootstrap", "planning", "guard", "reports")
PATH = re.compile(r"(?<![\w./-])((?:\.ci|[A-Za-z_][\w-]*)/[\w./*-]*)")
LINK = re.compile(r"\]\(([^)#\s]+)\)")


def _mentioned_paths(text: str) -> set[str]:
    found = set()
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        first = path.split("/", 1)[0]
        if "*" in path or first not in TOP + STAGES:
            continue
        if first in STAGES and not (path.endswith("/") or Path(path).suffix):
            continue  # a metric name such as rollout/logprob_diff_mean
        found.add(path)
    return found


def test_config_reference_is_up_to_date():
    """docs/CONFIG.md is exactly what the config dataclasses' help generates."""
    committed = (ROOT / "docs" / "CONFIG.md").read_text()
    assert committed == render(), (
        "docs/CONFIG.md is out of date with the fields' help in agent_rl/config/. Regenerate it from the "
        f"repository root with `.venv/bin/{COMMAND}` and commit it with the config change."
    )


def test_docs_name_only_files_that_exist():
    """Every repository path in README.md, bench/RESULTS.md and docs/*.md, and every relative link, exists."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in sorted(_mentioned_paths(text)):
            candidates = [ROOT / path] + ([ROOT / "agent_rl" / path] if path.split("/")[0] in STAGES else [])
            if not any(c.exists() for c in candidates):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
        for link in LINK.findall(text):
            if "://" not in link and not (doc.parent / link).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {link}")
    assert not missing, "documents name files that do not exist:\n" + "\n".join(missing)


def test_path_finder_keeps_repository_paths_only():
    """The path finder picks repository paths and the README's stage-relative ones, and leaves out run outputs
    and metric names."""
    text = (
        "see agent_rl/config.py, `rollout/budget.py`, tests/test_architecture.py. and .ci/run; not "
        "OUTPUT_DIR/eval/step_N.jsonl, .cache/toy_world, rollout/logprob_diff_mean or configs/*.yaml"
    )
    assert _mentioned_paths(text) == {
        "agent_rl/config.py",
        "rollout/budget.py",
        "tests/test_architecture.py",
        ".ci/run",
    }
