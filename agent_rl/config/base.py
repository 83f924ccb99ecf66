"""What every config section shares: the error a bad key raises, the documented field, and the check
of an enumerated key's value."""

from __future__ import annotations

import copy
import functools
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config key is unknown, mistyped, or combined with another in a way that cannot work."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _check_choices(section: str, obj: Any, choices: dict[str, tuple[str, ...]]) -> None:
    """Each of `choices`' keys of a section holds one of its allowed values."""
    for key, allowed in choices.items():
        value = getattr(obj, key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")
