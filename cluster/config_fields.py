"""Config field machinery: `opt()` attaches help text and checks to a dataclass field;
`Section` applies them (types, choices, ranges) on construction with ValueErrors that
name the key as it appears in YAML (`scheduler.max_prefill_chunk must be >= 1, got 0`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import MISSING, field, fields
from types import MappingProxyType
from typing import Any, ClassVar


def opt(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, factory: Any = None) -> Any:
    """A config field: default, help text and the checks applied on construction."""
    md = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le}
    if factory is not None:
        return field(default_factory=factory, metadata=md, hash=False)
    return field(default=default, metadata=md)


def _kind(annotation: str) -> tuple[str, bool]:
    """('int' | 'float' | 'bool' | 'str' | 'map', optional) from a string annotation."""
    optional = annotation.endswith("| None")
    base = annotation.replace("| None", "").strip()
    return ("map" if base.startswith("Mapping") else base), optional


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

    def _coerce(self, f, value: Any) -> Any:
        kind, optional = _kind(str(f.type))
        key, md = f"{self.NAME}.{f.name}", f.metadata
        if value is None:
            if optional:
                return None
            raise ValueError(f"{key} must not be null")
        if kind == "bool" and not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
            value = float(value)
        if kind == "str" and not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        if kind == "map":
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
                and v > 0 for k, v in value.items()
            ):
                raise ValueError(f"{key} must map names to numbers > 0, got {value!r}")
            return MappingProxyType({k: float(v) for k, v in value.items()})
        if md["choices"] and value not in md["choices"]:
            raise ValueError(f"{key} must be one of {list(md['choices'])}, got {value!r}")
        for bound, ok, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                ("le", lambda v, b: v <= b, "<=")):
            if md[bound] is not None and not ok(value, md[bound]):
                raise ValueError(f"{key} must be {text} {md[bound]}, got {value!r}")
        return value


def did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known: {sorted(known)}"


def field_default(f) -> Any:
    """A field's default value (calls default factories)."""
    return f.default_factory() if f.default is MISSING else f.default
