"""The user's own rewards and tools, named in the config by import path: loaded and checked at load
time, so that a path that does not import or an object of the wrong shape fails naming the key."""

from __future__ import annotations

from typing import Any

from agent_rl.config.base import ConfigError

# Built-in rewards and tools by name (agent_rl/rollout/rewards.py, agent_rl/rollout/tools.py); any other
# name is a dotted import path `module:attr` (or `module.attr`), loaded by `load_object`.
BUILTIN_REWARDS = ("em", "f1", "em_format", "search_found")
BUILTIN_TOOLS = ("search", "read")


def load_object(spec: str, key: str) -> Any:
    """The object a dotted import path names, `module:attr` or `module.attr` (the last dot splits);
    a path that does not import, or a module whose import raises anything, is a ConfigError naming
    `key`, with the module's own error chained."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r}: not a built-in name, nor an import path module:attr (or module.attr)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{key} = {spec!r}: cannot import module {module_name!r} ({err}); check the path's spelling and that the "
            "module and what it imports are installed or on PYTHONPATH"
        ) from err
    except (Exception, SystemExit) as err:  # a plug-in is the user's code: a bug in it is any exception, or an exit
        raise ConfigError(
            f"{key} = {spec!r}: importing module {module_name!r} raised {type(err).__name__}{_where(err)}: {err}; "
            f"fix the module there, or take it out of {key.partition('[')[0]}"
        ) from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} = {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _where(err: BaseException) -> str:
    """' at file:line' of the code that raised `err` (the CLI prints a ConfigError's message alone)."""
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_reward(spec: str, key: str) -> Any:
    """The reward function an import path names; an object that is not callable is a ConfigError naming `key`."""
    fn = load_object(spec, key)
    if not callable(fn):
        raise ConfigError(
            f"{key} = {spec!r} is of type {type(fn).__name__}, not callable: name a function "
            "(trajectory, golden_answers) -> float"
        )
    return fn


def load_tool_object(spec: str, key: str) -> Any:
    """The tool an import path names (a class is instantiated with no arguments), checked against the
    interface of agent_rl/rollout/tools.py: a str `name` (its tag), a str `description` and a callable
    `call`. Anything else, or a class whose construction raises, is a ConfigError naming `key`."""
    obj = load_object(spec, key)
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as err:
            raise ConfigError(
                f"{key} = {spec!r}: constructing the tool {spec}() raised {type(err).__name__}{_where(err)}: {err}; "
                "a tool class must build with no arguments (or name an instance instead, module:instance)"
            ) from err
    missing = [a for a in ("name", "description", "call") if not hasattr(obj, a)]
    wrong = [
        f"its {a} is of type {type(getattr(obj, a)).__name__}, not str"
        for a in ("name", "description")
        if a not in missing and not isinstance(getattr(obj, a), str)
    ]
    if "name" not in missing and obj.name == "":
        wrong.append("its name is empty")
    if "call" not in missing and not callable(obj.call):
        wrong.append(f"its call is of type {type(obj.call).__name__}, not callable")
    if missing or wrong:
        what = ([f"it lacks {', '.join(missing)}"] if missing else []) + wrong
        raise ConfigError(
            f"{key} = {spec!r} is not a tool: {'; '.join(what)}. A tool has a str `name` (its tag), a str "
            "`description` and `call(inputs) -> list[ToolOutput]` (see agent_rl/rollout/tools.py)"
        )
    return obj
