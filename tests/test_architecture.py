"""The plan of the package holds: stages import only earlier stages, no import circle anywhere,
and the loop stays short.

Stages, earliest first: the config and the world of ranks; rollout (budget, engines, retriever
client, turn logic and its drivers, rewards); reports (viewer, eval table, plots); runtime
(distributed, checkpoints, logging, allocator, memory readings); bootstrap (first-use builders);
learn (batch, policy forward, advantages, losses, update); planning (the planner and the preflight
step); guard (the collapse guard and its signals); the entry points at the top (train and the run it
drives, sft, cli, evaluation). A module may import its own stage or an earlier one, never a later one, also inside
functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agent_rl"

FOUNDATION = {
    "agent_rl.config",
    "agent_rl.config.base",
    "agent_rl.config.plugins",
    "agent_rl.config.experiment",
    "agent_rl.config.generation",
    "agent_rl.config.training",
    "agent_rl.config.loader",
    "agent_rl.world",
}
STAGES = (
    "agent_rl.rollout",
    "agent_rl.reports",
    "agent_rl.runtime",
    "agent_rl.bootstrap",
    "agent_rl.learn",
    "agent_rl.planning",
    "agent_rl.guard",
)


def _stage(module: str) -> int:
    if module in FOUNDATION:
        return 0
    for rank, prefix in enumerate(STAGES, start=1):
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return (
        len(STAGES) + 1
    )  # agent_rl.train, agent_rl.run, agent_rl.sft, agent_rl.cli, agent_rl.evaluation, agent_rl.__main__


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every `agent_rl` import; `from agent_rl.x import y` counts y when it is a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("agent_rl")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agent_rl"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*sub.split("."))
                ).is_dir()
                out.append((node.lineno, sub if is_module else node.module))
    return out


def test_no_module_imports_a_later_stage():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        for line, target in _imports(ast.parse(path.read_text(), str(path))):
            if _stage(target) > _stage(name):
                bad.append(
                    f"{path.relative_to(ROOT)}:{line} ({name}, stage {_stage(name)}) imports {target} (stage "
                    f"{_stage(target)})"
                )
    assert not bad, "imports from a later stage:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (function-level imports included); a name imported
    from a package's `__init__` counts as the package."""
    graph: dict[str, set[str]] = {}
    for root in (PACKAGE, ROOT / "retriever_server"):
        for path in sorted(root.rglob("*.py")):
            name = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            targets = {t for _, t in _imports(tree)}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("retriever_server"):
                    targets.add(node.module)
            graph[name] = {t for t in targets if t != name}
    return graph


def test_no_import_circle():
    """Tarjan's strongly connected components over the import graph: every one is a single module."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_retriever_server_does_not_import_the_trainer():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / "retriever_server").rglob("*.py"))
        for line, target in _imports(ast.parse(path.read_text(), str(path)))
    ]
    assert not bad, "\n".join(bad)


def test_train_is_the_loop_only():
    """`train()` reads top to bottom in under 150 lines; setup and the pieces live beside it."""
    tree = ast.parse((PACKAGE / "train.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    lines = fn.end_lineno - fn.lineno + 1
    assert lines < 150, f"train() is {lines} lines"
    nested = [
        n.name
        for n in ast.walk(fn)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and n is not fn and hasattr(n, "name")
    ]
    assert not nested, f"closures inside train(): {nested}"


def test_the_trainer_imports_only_the_servers_light_modules():
    """`agent_rl` may use the server package's wire format, client and text helpers, never its
    index, encoders or app (FAISS, a second torch model, FastAPI)."""
    light = {
        "retriever_server.schema",
        "retriever_server.client",
        "retriever_server.answers",
        "retriever_server.jsonl",
        "retriever_server.plan",  # the kinds' names; FAISS and the encoders load inside its functions only
    }
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("retriever_server") and name not in light:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)
