"""Config field machinery: `opt()` attaches help text and checks to a dataclass field;
`Section` applies them (types, choices, ranges) on construction with ValueErrors that
name the key as it appears in YAML (`scheduler.max_prefill_chunk must be >= 1, got 0`).

A field's type comes from its annotation (`typing.get_type_hints`): `int`, `float`, `bool`,
`str` or `Mapping[str, float]`, each optionally `| None`. Its choices are a tuple or a
registry (engine.registry.Registry), read when a value is checked or a parser is built,
so a part registered after import is a valid choice.
"""

from __future__ import annotations

import difflib
import functools
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

_SCALARS = (bool, int, float, str)


def opt(default: Any, help: str, *, choices: Collection[str] | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        factory: Any = None) -> Any:
    """A config field: default, help text and the checks applied on construction."""
    md = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if factory is not None:
        return field(default_factory=factory, metadata=md, hash=False)
    return field(default=default, metadata=md)


@dataclass(frozen=True)
class FieldType:
    """A config field's annotation, resolved: `base` is bool/int/float/str or Mapping."""

    base: type
    optional: bool


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_type(cls: type, f: Field) -> FieldType:
    hint = _hints(cls)[f.name]
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported annotation {hint}")
        hint = args[0]
    if typing.get_origin(hint) is Mapping:
        return FieldType(Mapping, optional)
    if hint not in _SCALARS:
        raise TypeError(f"{cls.__name__}.{f.name}: unsupported annotation {hint}")
    return FieldType(hint, optional)


def choices_of(f: Field) -> tuple[str, ...] | None:
    """The field's allowed values now (a registry's names as registered so far)."""
    choices = f.metadata["choices"]
    return None if choices is None else tuple(choices)


def describe_choices(f: Field) -> str:
    """'a (what a does), b, ...' for a registry's choices; '' for a plain tuple."""
    describe = getattr(f.metadata["choices"], "describe", None)
    return describe() if describe is not None else ""


class Section:
    """Base of the frozen sections: generic type/choice/range checks, then `_check()`."""

    NAME: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, self._coerce(f, getattr(self, f.name)))
        self._check()

    def _check(self) -> None:
        """Cross-field checks of one section (override)."""

    def _bad(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.NAME}.{key} {why}, got {getattr(self, key)!r}")

    def _coerce(self, f: Field, value: Any) -> Any:
        kind = field_type(type(self), f)
        key, md = f"{self.NAME}.{f.name}", f.metadata
        if value is None:
            if kind.optional:
                return None
            raise ValueError(f"{key} must not be null")
        if kind.base is bool and not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        if kind.base is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if kind.base is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
            value = float(value)
        if kind.base is str and not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        if kind.base is Mapping:
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
                and v > 0 for k, v in value.items()
            ):
                raise ValueError(f"{key} must map names to numbers > 0, got {value!r}")
            return MappingProxyType({k: float(v) for k, v in value.items()})
        if md["choices"] is not None and value not in md["choices"]:
            raise ValueError(f"{key} must be one of {list(md['choices'])}, got {value!r}"
                             f"{did_you_mean(value, md['choices'], known_list=False)}")
        for bound, ok, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                ("le", lambda v, b: v <= b, "<=")):
            if md[bound] is not None and not ok(value, md[bound]):
                raise ValueError(f"{key} must be {text} {md[bound]}, got {value!r}")
        return value


def did_you_mean(name: str, known, *, known_list: bool = True) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; known: {sorted(known)}" if known_list else ""


def field_default(f) -> Any:
    """A field's default value (calls default factories)."""
    return f.default_factory() if f.default is MISSING else f.default
