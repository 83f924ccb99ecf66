"""What every config section shares: the error a bad key raises, the documented field, the types a
key's YAML value is checked against, and the check of an enumerated key's value.

The sections are stdlib dataclasses; the loader checks a YAML tree against them with pydantic
(`TypeAdapter`), each section declared `with_config(extra="forbid")` so that an unknown key fails.
"""

from __future__ import annotations

import copy
import functools
import types
import typing
from dataclasses import field
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Strict


class ConfigError(ValueError):
    """A config key is unknown, mistyped, or combined with another in a way that cannot work."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _number_from_string(value: Any) -> Any:
    """YAML 1.1 reads `1e-5` (no dot) as a string: a float key takes a string that parses as a number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _text_from_scalar(value: Any) -> Any:
    """YAML 1.1 reads a bare off / on (and no / yes) as a bool: a str key takes it as that word
    (`guard.action=off`), and a number as its text."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)):
        return str(value)
    return value


# The types of the sections' keys. Strict, as a YAML value is meant: no bool or "3" or 3.0 for an int,
# no 1 or "yes" for a bool, no bool for a float, a list only as a list; int is taken for a float. Two
# readings of YAML 1.1 are taken as the writer meant them (above).
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict(), BeforeValidator(_number_from_string)]
Str = Annotated[str, Strict(), BeforeValidator(_text_from_scalar)]
List = Annotated[list, Strict()]

_S = TypeVar("_S")
# A section key left empty in YAML (`memory:` with every key commented out) holds the section's defaults.
Section = Annotated[_S, BeforeValidator(lambda value: value or {})]


def type_name(hint: Any) -> str:
    """A key's type as the docs and the errors write it (`int`, `str | None`), without the checks above."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(hint))
    return "None" if hint is type(None) else hint.__name__


def _check_choices(section: str, obj: Any, choices: dict[str, tuple[str, ...]]) -> None:
    """Each of `choices`' keys of a section holds one of its allowed values."""
    for key, allowed in choices.items():
        value = getattr(obj, key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")
