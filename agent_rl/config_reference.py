"""docs/CONFIG.md, the config reference, generated from the help of every field in `agent_rl.config`.

`python -m agent_rl.config_reference docs/CONFIG.md` rewrites the file; without a path it prints it.
tests/test_docs.py fails when the committed file differs from what this writes, so a field added
or reworded in `agent_rl/config/` reaches the reference in the same commit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

from agent_rl.config import Config
from agent_rl.config.base import type_name

COMMAND = "python -m agent_rl.config_reference docs/CONFIG.md"


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    return json.dumps(value)


def _section(cls: type, prefix: str, lines: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append(f)
            continue
        lines.append(
            f"- `{prefix}{f.name}` ({type_name(hints[f.name])}, default `{_default(f)}`): {f.metadata['help']}"
        )
    for f in nested:
        lines += ["", f"### `{prefix}{f.name}`", "", f.metadata["help"], ""]
        _section(hints[f.name], f"{prefix}{f.name}.", lines)


def render(root: type = Config) -> str:
    """The reference as Markdown: one heading per section (its help), one line per key with its type,
    default and help, in the order the dataclasses declare them."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the help of each field in agent_rl/config/. Do not edit by hand: run",
        f"     `{COMMAND}`. tests/test_docs.py checks that this file is up to date. -->",
        "",
        "A config is YAML (`configs/*.yaml`); any key is overridden on the command line as `section.key=value`",
        "(`run.max_steps=10`). An unknown key, a wrong type or a bad combination fails at load with a message",
        "naming the key and the fix. `configs/tiny_cpu_grpo.yaml` is the embedded default.",
    ]
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        lines += ["", f"## `{f.name}`", "", f.metadata["help"], ""]
        _section(hints[f.name], f"{f.name}.", lines)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if not args:
        sys.stdout.write(text)
        return
    Path(args[0]).parent.mkdir(parents=True, exist_ok=True)
    Path(args[0]).write_text(text)


if __name__ == "__main__":
    main()
